cimport cython
from kvdb.planner.policies.lru cimport LruCore
from kvdb.planner.policies.planned cimport PlannedCore

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

cdef class AdaptiveCore:
    cdef public Py_ssize_t num_frames  # Replacer.__init__ sets it
    cdef public PlannedCore planner
    cdef public LruCore _lru
    cdef public object mode, _cap
    cdef public double rate, _seen
    cdef public long long _threshold, _since, epochs, switches
    cdef public Py_ssize_t _resident
    cdef public bint _shadow, _nowf_later, _evicted_since_access
    cdef public dict _minis, _pd, _pv
    cdef public list _mode_counts, _ids
    cdef public unsigned char[:] _known

    @cython.locals(j=cython.Py_ssize_t, f=cython.Py_ssize_t, k=cython.int, tier_hits=cython.longlong, run=cython.bint,
                   m=_Mini, d=cython.longlong, h=cython.longlong, base=cython.longlong)
    cpdef record_access(self, frames, ids=*, ctx=*)
    @cython.locals(cap=cython.Py_ssize_t, m=_Mini)
    cpdef evict(self)
    cpdef _forget(self, Py_ssize_t f)
