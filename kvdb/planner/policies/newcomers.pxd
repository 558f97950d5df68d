cimport cython

cdef class SessionPrefixes:
    cdef public dict _sig, _agents, _ids, _links, _formed
    cdef public set provisional
    cdef public double first_calls, read

    cpdef double p(self)
    cpdef bint called(self, tuple agent)
    cpdef list prefix(self, tuple agent)
    @cython.locals(k=cython.Py_ssize_t, m=cython.Py_ssize_t, n=cython.Py_ssize_t, first=cython.bint, formed=cython.Py_ssize_t)
    cpdef observe(self, tuple agent, list links, list ids)
    cpdef end(self, object sid)
    cpdef missed(self)
    cdef _count(self, bint read)
