cimport cython

cdef int _NIL, _ABSENT, _LISTED, _PINNED

cdef class LruCore:
    cdef public Py_ssize_t num_frames  # Replacer.__init__ sets it
    cdef public int[:] _prev, _next
    cdef public unsigned char[:] _state
    cdef public int _head, _tail
    cdef public Py_ssize_t _count

    cdef _unlink(self, int f)
    cdef _push_head(self, int f)
    @cython.locals(i=cython.Py_ssize_t, s=cython.int)  # f untyped: a huge frame is refused, not an OverflowError
    cpdef record_access(self, frames, ids=*, ctx=*)
    @cython.locals(f=cython.int)
    cpdef evict(self)
