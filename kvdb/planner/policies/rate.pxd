cdef class Rate:
    cdef public double window, trials, reads

    cpdef add(self, double trials, double reads)
    cpdef double p(self)
