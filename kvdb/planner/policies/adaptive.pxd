cimport cython

cdef class _Mini:
    cdef public object repl
    cdef public dict table
    cdef public list owner, free
    cdef public long long hits, accesses
    cdef public bint planned

    cpdef _release(self, Py_ssize_t f)
    cpdef bint _evict_one(self) except -1
    cpdef drop(self, object bid)
    cpdef trim(self, Py_ssize_t cap)
    @cython.locals(hit=cython.longlong, run=cython.bint, frames=list, missing=cython.Py_ssize_t)
    cpdef long long access(self, list ids, object ctx, tuple call) except -1
