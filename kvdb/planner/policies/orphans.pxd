cimport cython
from kvdb.planner.policies.rate cimport Rate

cdef class OrphanEstimator:
    cdef public Rate _rate
    cdef public dict _ids
    cdef public Py_ssize_t _cap

    cpdef double p(self)
    cpdef made(self, long long k)
    cpdef read_again(self)
    cpdef evicted(self, object bid)
    cpdef recalled(self, object bid)
