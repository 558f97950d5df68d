cimport cython
from kvdb.planner.policies.agentplans cimport AgentPlans
from kvdb.planner.policies.reuse cimport ReuseEstimator
from kvdb.planner.policies.orphans cimport OrphanEstimator

cdef int _ABSENT, _LISTED, _PINNED
cdef long long _VALUE_CAP

cdef class PlannedCore(AgentPlans):
    cdef public long long _tick, _count
    cdef public double _lam, _Lc, _L, _tc, _now
    cdef public ReuseEstimator _reuse
    cdef public object _sampled, _current, _next, unplanned
    cdef public dict _session_frames, _returns, _orph_pending
    cdef public unsigned char[:] _orph
    cdef public OrphanEstimator _orphans
    cdef public bint _chain_open, _use_crf

    cdef _rebuild_gd(self)
    cdef _own(self, Py_ssize_t f, object sid)
    @cython.locals(j=cython.Py_ssize_t, f=cython.Py_ssize_t, last=cython.Py_ssize_t, call_len=cython.Py_ssize_t, n=cython.longlong, L=cython.double,
                   tick=cython.longlong, lam=cython.double, c=cython.double, t0=cython.double, leaf=cython.bint, prio=cython.double, now=cython.double, k1=cython.int,
                   new_call=cython.bint, wf=cython.bint, reuse=ReuseEstimator)
    cpdef record_access(self, frames, ids=*, ctx=*)
    @cython.locals(f=cython.Py_ssize_t, now=cython.double, age=cython.double)
    cpdef evict(self)
    cdef _forget(self, Py_ssize_t f)
    @cython.locals(f=cython.Py_ssize_t, i=cython.longlong, p=cython.double, lp=cython.double, L=cython.double, junk=cython.bint, k=cython.longlong)
    cdef _orphan(self, tuple agent, list left)
