cimport cython
from kvdb.planner.policies.rate cimport Rate

cdef class SessionPrefixes:
    cdef public dict _sig, _agents, _ids, _links, _formed, _groups, _member, _sess_sib
    cdef public set provisional
    cdef public Rate _ext, _rate, _sib

    cdef _role(self, tuple agent)
    cdef _raw_group(self, tuple agent)
    cdef _group(self, tuple agent, list g)
    cpdef bint called(self, tuple agent)
    cpdef tuple plan_of(self, tuple agent)
    @cython.locals(k=cython.Py_ssize_t, m=cython.Py_ssize_t, n=cython.Py_ssize_t, j=cython.Py_ssize_t, first=cython.bint, formed=cython.Py_ssize_t)
    cpdef observe(self, tuple agent, list links, list ids)
    cpdef end(self, object sid)
    @cython.locals(k=cython.Py_ssize_t, n=cython.Py_ssize_t)
    cpdef parallel(self, object sid, tuple deps, list names, list links, list ids)
    cpdef missed(self, tuple agent, bint sibling)
    cdef _sib_count(self, object sid, double read)
