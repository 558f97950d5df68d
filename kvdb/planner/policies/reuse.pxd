cimport cython

cdef class ReuseEstimator:
    cdef public Py_ssize_t capacity
    cdef public object _hist, recalled, median_gap_s
    cdef public list _won, _lost, _mult, _gaps
    cdef public long long _observed
    cdef public double alpha

    @cython.locals(got=tuple)
    cpdef long long recall(self, object bid, double now) except? -1
    cpdef seen_again(self, int klass)
    cpdef double first_value(self, int klass) except? -1
    @cython.locals(k=cython.int)
    cpdef remember(self, object bid, long long accesses, double last_s, int klass=*, double crf=*, long long tick=*)
    @cython.locals(i=cython.Py_ssize_t)
    cpdef observe_gap(self, double gap_s)
    cpdef bint epoch_due(self)
    @cython.locals(n=cython.longlong)
    cpdef double value(self, long long accesses, long long cap) except? -1
