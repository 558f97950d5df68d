cimport cython
from kvdb.planner.policies.newcomers cimport SessionPrefixes

cdef int _ABSENT, _LISTED, _PINNED

cdef class AgentPlans:
    cdef public Py_ssize_t num_frames  # Replacer.__init__ sets it
    cdef public list _interest, _fwho, _fplan, _aplan, _aexp, _id, _sess, _gd
    cdef public long long[:] _pver, _ver, _inc, _hits, _tick_of
    cdef public double[:] _ft, _h, _hc, _key, _crf, _last_s
    cdef public int[:] _depth, _kls
    cdef public unsigned char[:] _state, _planned, _leaf, _shared
    cdef public dict _agent_shared, _agent_chain, _agent_plan, _agent_dl, _agent_seq, _agent_cur, _sess_agents
    cdef public SessionPrefixes _prefixes
    cdef public set _clean
    cdef public long long _seq

    cpdef _init_plans(self, Py_ssize_t n)
    cdef _push_gd(self, Py_ssize_t f)
    @cython.locals(t=object, who=object, u=object)
    cdef _plan_of(self, Py_ssize_t f)
    cpdef _frame_update(self, Py_ssize_t f)
    cdef _push_frame(self, Py_ssize_t f, double t)
    cdef _shared_moved(self, Py_ssize_t f, object agent, double t)
    cdef _unplan(self, Py_ssize_t f)
    cdef _unplan_by_access(self, Py_ssize_t f)
    @cython.locals(finite=cython.bint)
    cdef _add_interest(self, Py_ssize_t f, object agent, double t, object old)
    cdef _drop_interest(self, Py_ssize_t f, object agent)
    cdef _unpinned(self, Py_ssize_t f)
    cdef _forget_frame(self, Py_ssize_t f)
    cdef bint _live(self, Py_ssize_t f, long long i)
    cdef _chain_changed(self, object agent)
    cdef _restart_scan(self, object agent)
    @cython.locals(f=cython.Py_ssize_t, i=cython.longlong)
    cpdef _plan_agent(self, object agent, object t, double now, object dl=*)
    @cython.locals(f=cython.Py_ssize_t, i=cython.longlong)
    cdef _drop_plan(self, object agent)
    cpdef _replan(self, object sid, dict starts, double now, object changed=*)
    @cython.locals(same=cython.bint, sib=cython.bint, p=cython.double)
    cdef _plan_newcomer(self, tuple key, double t, double now)
    cdef _forget_agent(self, object agent)
    cpdef _expire_plans(self, double now)
    cdef _planned_victim(self)
    @cython.locals(i=cython.Py_ssize_t, f=cython.Py_ssize_t, k=cython.longlong)
    cdef _scan(self, object agent)
    @cython.locals(f=cython.Py_ssize_t, e=tuple, stash=list)
    cdef _top_live(self, list heap, long long[:] ver, unsigned char[:] flag, int want)
