"""The planner's engine API on the Db, and the engine carrying out the plan.

A mixin of ``kvdb.db.core.Db``. ``begin_session`` / ``hint`` / ``call_started`` /
``call_finished`` / ``end_session`` forward to the Db's ``Planner`` (kvdb/planner/sessions.py),
which informs every tier's replacer. The Db itself then *acts* on what the plan says: it
moves a waiting agent's blocks down while it waits and back up before it returns, and it
keeps a session's declared shared prefix resident. All of it runs under the Db's lock; the
moves run on the Db's one background mover (kvdb/db/mover.py), timed ones from its timer heap.

Agent chains
    A call's blocks are the keys of the ``match_prefix`` and ``put_blocks`` made with the
    context ``call_started`` returned (chain order; a put extends the lookup's chain). An
    agent's *chain* is its latest call's. A block is *private* to an agent when no other
    open agent's chain holds it and it is in no protected shared prefix.

Tool waits: when an agent waits, and until when (R, its predicted return, on the Db's clock)
    - ``call_finished(..., hints={"expected_tool_duration_s": d})``, or that hint given to
      ``call_started`` for the call: the agent waits d from the call's end;
    - ``hint(sid, expected_tool_duration_s=d, agent_id=a)`` between calls: agent ``a``
      (default: the session's agent that finished last) waits d from now;
    - a session with a declared workflow: after each ``call_finished``, every agent of the
      session whose next LLM node is estimated to start later (W5, tools at their declared
      durations) waits until that estimate; an agent with nothing left to run waits for
      nothing (its blocks are the replacer's to drop).
    A new wait for the agent replaces the old plan.

Agent states (one per (session, agent); the plan lives in AgentPlan)::

    (new) --call_started--> in call --call_finished, no wait--> idle --call_started--> in call
                               |                                                         ^
                               +--call_finished with a wait d / workflow estimate--> waiting
                                                                                         |
    waiting --hint / new estimate--> waiting (new R)   waiting --call_started--> in call (E3)
    waiting: offload job (E1) moves blocks down; prefetch timer (E2) moves them up
    any state --end_session--> gone (timer cancelled, chain dropped)

    | edge                      | method                                        |
    | in call -> waiting        | call_finished (hint / pending call hint), _workflow_waits |
    | idle -> waiting           | hint(expected_tool_duration_s=), _workflow_waits |
    | waiting -> in call        | call_started -> _end_wait (scores hits, early / late) |
    | waiting -> idle           | _workflow_waits when the agent has nothing left |

The plan of a waiting agent (invariants; tests cite them)
  E1  offload: while R is more than ``OFFLOAD_MIN_WAIT_S`` + the prefetch lead away, the
      agent's private device blocks move to the host tier *when device space is needed*:
      at the wait's start if the device tier is at or below its free-frame watermark
      (``device_free_fraction``; full when 0), and after any put that brings it there. The
      agent with the furthest R goes first, one agent per such moment. When the host tier
      has too few free frames and the disk tier is on, the agent's private blocks in both
      memory tiers go to disk instead (host to disk under pressure).
  E2  prefetch: a timer at R - lead brings the agent's whole chain back to the device tier
      (disk -> host -> device); lead = 2 x (chain blocks x measured seconds per page, an
      EWMA of the mover's own planned prefetches; the cost model's host bandwidth until
      one is measured) + ``PREFETCH_MARGIN_S``.
  E3  cancel: ``end_session``, a new wait for the agent (new hint or workflow estimate), and
      the agent's next call starting. A call that starts before the timer is due is *early*
      (the prefetch is dropped: the call reads wherever the blocks are); one that starts
      when the timer is due but its move has not run is *late*.
  E4  nothing is lost: a planned move is a move (the pool's offload / promote); with no disk
      tier, blocks leave memory only as ordinary capacity evictions do.

Shared prefixes (hint ``prefix_hash``)
    ``prefix_hash`` names a shared prefix (system prompt + tool schemas) by the key of its
    last block: a 32-hex-digit string is a kvdb ``BlockKey`` (``db.block_keys(...)[-1].hex()``),
    an integer is the engine's own hash of that block (mapped like ``db.engine_keys``, in the
    session's tenant). The Db resolves it through the chains it has seen in calls *of the
    session's tenant* (open agents' chains and the last ``RECENT_CHAINS`` ones): the prefix
    is that chain up to the named block. While at least one open session names it:
  X1  its blocks are prefetched toward the device (at resolution, and at each call of an
      interested session: before the session's first call) and protected: the Db pins their
      resident frames (a refcounted interest: one prefix, N sessions; released when the
      last of them ends), at most ``PREFIX_PIN_FRACTION`` of each tier's frames. A
      ``delete`` of a protected key drops the protection first.
  X2  a prefix hash the Db cannot resolve is *clipped*, never an error: nothing is protected,
      and it is resolved at a later call of the session whose chain holds it.
  X3  tenants: keys are tenant-salted and resolution looks only at the session tenant's
      chains, so another tenant's prefix hash resolves to nothing and ``explain`` shows no
      residency for it.

Idle expiry (``kvdb.open(..., session_idle_s=)``; None: never)
  S1  a session's *deadline* is the latest of: its last activity (begin_session, call_started,
      call_finished, hint, a lookup or put with its context: ``Session.last_active_s``) +
      ``session_idle_s``; that activity + its latest ``ttl_s`` hint; and, for each agent in a
      planned tool wait, its predicted return R + ``session_idle_s`` (the slack: idle time
      counts from when the agent should have come back).
  S2  at or after its deadline the session is ended exactly as ``end_session`` ends it
      (``_end_session_locked``: timers cancelled, chains dropped, prefix pins released,
      ``SessionEnded`` to the planner) and counted in ``expired_sessions``. Afterwards its id
      is an ended one's: hint / end_session / explain raise NotFound (saying it expired),
      call_started opens a fresh session.
  S3  the cost: activity writes one timestamp (O(1), nothing else per put); a heap holds one
      entry per open session (``(check_s, seq, sid)``; entries of ended sessions are dropped
      lazily, the heap rebuilt when they outnumber the live ones), and one mover timer (kind
      ``"expiry"``) is due at the heap's earliest check. The sweep re-checks a due entry: an
      expired session ends, a live one goes back at its deadline but at most one idle period
      ahead. Why that bound: an entry must never be later than the deadline, and a deadline
      can drop (a wait ends early, a shorter wait or ttl_s replaces a longer one) -- but only
      through activity, which puts it at least an idle period past the sweep. A long wait
      costs one re-check per idle period. No thread of its own.

Statistics: ``stats()["plans"]``; the live plan of a session: ``explain(session_id=...)``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvdb.buffer_pool.pool import DEVICE, HOST, TIER_NAMES
from kvdb.errors import InvalidInput
from kvdb.keys import DEFAULT_TENANT
from kvdb.planner.cost import DEFAULT_COST
from kvdb.planner.hints import CLIPPED, REJECTED, HintOutcome
from kvdb.planner.sessions import CallContext
from kvdb.types import KEY_BYTES

OFFLOAD_MIN_WAIT_S = 1.0  # shorter waits keep their blocks: two copies for little room
DISK_OFFLOAD_MIN_WAIT_S = 30.0  # a full host tier takes a waiting agent's blocks only for short
# waits; longer ones go straight to disk (a host cache is full in its steady state: demoting
# there would push out someone else's blocks, while a disk reload still fits in the wait)
PREFETCH_MARGIN_S = 0.25  # slack on top of twice the reload estimate (a busy mover, a late hint)
RECENT_CHAINS = 256  # ended calls' chains kept for resolving prefix hashes
PREFIX_PIN_FRACTION = 0.5  # at most this share of a tier's frames is pinned for prefixes
REPLAN_TOLERANCE_S = 0.5  # a wait whose return moved less keeps its timer (the same wait said twice)
WORKFLOW_TOOL_DEFAULT_S = 10.0  # a declared tool without expected_duration_s
RATE_ALPHA = 0.2  # EWMA weight of one measured prefetch
DISK_SLOWDOWN = DEFAULT_COST.host_bytes_per_s / DEFAULT_COST.disk_bytes_per_s  # disk reload vs host

STAT_NAMES = ("waits", "replanned_waits", "planned_offloads", "planned_offload_blocks", "planned_disk_offload_blocks",
              "planned_prefetches", "planned_prefetch_blocks", "planned_prefetch_hits", "planned_prefetch_misses",
              "early_calls", "late_prefetches", "cancelled_prefetches", "prefixes_resolved", "prefixes_unknown",
              "prefix_prefetch_blocks", "expired_sessions")


@dataclass(eq=False)  # identity: plans live in sets
class AgentPlan:
    """One (session, agent): its chain and, while it waits, its plan (E1-E3)."""

    session_id: str
    agent_id: str | None
    tenant: str
    chain: list = field(default_factory=list)  # keys of its latest call, chain order
    ctx: Any = None  # the CallContext of its latest call (identity: a stale context is ignored)
    fresh: bool = False  # no lookup or put of the latest call yet: the next one starts the chain
    in_call: bool = False
    pending_wait_s: float | None = None  # the call's hinted tool wait, applied at call_finished
    return_s: float | None = None  # predicted return on the Db's clock, while waiting
    timer: Any = None  # the prefetch Timer
    gen: int = 0  # bumped by every new plan or cancel: a stale job does nothing
    offloaded: bool = False
    prefetched: bool = False


@dataclass
class SharedPrefix:
    tenant: str
    key: bytes  # its last block
    keys: tuple  # chain order
    sessions: set = field(default_factory=set)


class SessionsMixin:
    # ------------------------------------------------------------------ state (from Db._open)

    def _init_plans(self) -> None:
        self._agents: dict[str, dict[str | None, AgentPlan]] = {}  # session -> agent -> plan
        self._waiting: set[AgentPlan] = set()  # plans with a predicted return
        self._last_agent: dict[str, str | None] = {}  # session -> agent that finished last
        self._chain_refs: dict[bytes, int] = {}  # key -> open agents' chains holding it
        self._recent_chains: deque = deque(maxlen=RECENT_CHAINS)  # (tenant, tuple(keys))
        self._prefixes: dict[tuple, SharedPrefix] = {}  # (tenant, last key) -> prefix
        self._session_prefix: dict[str, tuple] = {}  # session -> (tenant, last key), resolved
        self._pending_prefix: dict[str, bytes] = {}  # session -> unresolved last key
        self._protected: dict[bytes, int] = {}  # key -> interested prefixes holding it
        self._pinned: dict[bytes, tuple] = {}  # key -> (tier, frame) the Db pinned for prefixes (one pin each)
        self._prefix_pinned = [0, 0]  # frames pinned for prefixes, per tier
        self._offload_pending = False
        page = self.layout.page_bytes
        self._s_per_page = page / DEFAULT_COST.host_bytes_per_s
        self._plan_stats = dict.fromkeys(STAT_NAMES, 0)
        self._plan_stats["planned_prefetch_s"] = 0.0
        # idle expiry (S1-S3); _session_idle_s is set by Db.__init__ before _open
        self._idle_heap: list[tuple[float, int, str]] = []  # (check at, seq, session id)
        self._idle_entry: dict[str, int] = {}  # open session -> seq of its live heap entry
        self._idle_seq = itertools.count()
        self._idle_timer: Any = None  # the mover timer of the next sweep
        self._idle_stale = 0  # heap entries of sessions that ended before their check

    # ------------------------------------------------------------------ engine API

    def begin_session(self, session_id: str, *, tenant: str | None = None, workflow=None,
                      hints: Mapping[str, Any] | None = None, now_s: float | None = None) -> list[HintOutcome]:
        """Open an agent session, optionally with its declared workflow (DAG of LLM calls and
        tool waits: a list of ``{"id", "agent_id", "deps"}`` nodes or ``{"nodes": [...]}``) and
        hints (e.g. ``prefix_hash``); returns the hints' outcomes."""
        self._check()
        with self._lock:
            self.planner.begin_session(session_id, tenant=tenant, workflow=workflow, now_s=now_s)
            self._watch_idle(session_id)
            return self._hint_locked(session_id, None, dict(hints or {}), now_s) if hints else []

    def hint(self, session_id: str, *, agent_id: str | None = None, now_s: float | None = None,
             **hints) -> list[HintOutcome]:
        """Advisory hints (``expected_tool_duration_s``, ``ttl_s``, ``priority``, ``prefix_hash``,
        ``tool``); each comes back accepted, clipped or rejected with the reason.
        ``expected_tool_duration_s`` starts a tool wait of ``agent_id`` (default: the session's
        agent that finished last); NotFound for an unknown session."""
        self._check()
        with self._lock:
            return self._hint_locked(session_id, agent_id, hints, now_s)

    def _hint_locked(self, sid: str, agent_id, hints: dict, now_s) -> list[HintOutcome]:
        if agent_id is not None and agent_id not in self._agents.get(sid, {}):
            self.planner.get_session(sid)  # NotFound first
            raise InvalidInput(f"session {sid!r} has no agent {agent_id!r} yet (agents appear with their "
                               "first call_started); leave agent_id out to mean the agent that finished last")
        outcomes = self.planner.hint(sid, now_s=now_s, **hints)
        outcomes = self._apply_prefix_outcomes(sid, outcomes)
        d = _usable(outcomes, "expected_tool_duration_s")
        if d is not None:
            agent = agent_id if agent_id is not None else self._last_agent.get(sid)
            plan = self._agents.get(sid, {}).get(agent)
            if plan is not None and not plan.in_call:
                self._start_wait(plan, d, self.planner.now(now_s))
            elif plan is not None:
                plan.pending_wait_s = d
        return outcomes

    def call_started(self, session_id: str | None, *, node_id: str | None = None, agent_id: str | None = None,
                     tenant: str | None = None, hints=None, now_s: float | None = None):
        """An LLM call arrives: returns ``(ctx, hint_outcomes)``; pass ``ctx`` to the call's
        ``match_prefix`` and ``put_blocks`` so the policy knows whose blocks these are and the
        Db knows the agent's chain. Ends the agent's wait (E3)."""
        self._check()
        with self._lock:
            ctx, outcomes = self.planner.call_started(session_id, node_id=node_id, agent_id=agent_id, tenant=tenant,
                                                      hints=hints, now_s=now_s)
            if session_id is None:
                return ctx, outcomes
            if session_id not in self._idle_entry:  # opened implicitly
                self._watch_idle(session_id)
            outcomes = self._apply_prefix_outcomes(session_id, outcomes)
            agents = self._agents.setdefault(session_id, {})
            plan = agents.get(ctx.agent_id)
            if plan is None:
                plan = agents[ctx.agent_id] = AgentPlan(session_id, ctx.agent_id, ctx.tenant or DEFAULT_TENANT)
            if plan.return_s is not None:
                self._end_wait(plan)
            plan.in_call = True
            plan.ctx, plan.fresh = ctx, True
            plan.pending_wait_s = _usable(outcomes, "expected_tool_duration_s")
            pk = self._session_prefix.get(session_id)
            if pk is not None:
                self._mover.submit(self._prefix_job, pk)
            return ctx, outcomes

    def call_finished(self, session_id: str | None, *, node_id: str | None = None, agent_id: str | None = None,
                      hints=None, now_s: float | None = None) -> list[HintOutcome]:
        """The call ended. ``hints={"expected_tool_duration_s": d}`` says its agent now waits d
        on a tool (E1-E2); a session's workflow does the same from its tool nodes. Returns the
        outcomes of those hints."""
        self._check()
        with self._lock:
            outcomes = []
            if hints:
                outcomes = self.planner.check_call_hints(hints)
            usable = {o.name: o.value for o in outcomes if o.status != REJECTED}
            self.planner.call_finished(session_id, node_id=node_id, agent_id=agent_id, hints=usable, now_s=now_s)
            if session_id is None:
                return outcomes
            if agent_id is None and node_id is not None:
                wf = self.planner.workflow_of(session_id)
                if wf is not None and node_id in wf.nodes:
                    agent_id = wf.nodes[node_id].agent_id
            plan = self._agents.get(session_id, {}).get(agent_id)
            if plan is not None:
                plan.in_call = False
                self._last_agent[session_id] = agent_id
                d = usable.get("expected_tool_duration_s", plan.pending_wait_s)
                plan.pending_wait_s = None
                if d is not None:
                    self._start_wait(plan, float(d), self.planner.now(now_s))
            self._workflow_waits(session_id, now_s)
            return outcomes

    def end_session(self, session_id: str, *, now_s: float | None = None) -> None:
        """Close a session: its plans are cancelled (E3), its prefix interest released (X1)."""
        self._check()
        with self._lock:
            self.planner.end_session(session_id, now_s=now_s)
            self._end_session_locked(session_id)

    def _end_session_locked(self, session_id: str) -> None:
        """What the Db drops when a session ends or expires (S2); the planner has ended it."""
        if self._idle_entry.pop(session_id, None) is not None:
            self._idle_stale += 1
        for plan in self._agents.pop(session_id, {}).values():
            self._waiting.discard(plan)
            if plan.timer is not None and plan.timer.cancel() and not plan.prefetched:
                self._plan_stats["cancelled_prefetches"] += 1
            plan.gen += 1
            self._set_chain(plan, [])
        self._last_agent.pop(session_id, None)
        self._pending_prefix.pop(session_id, None)
        self._drop_prefix_interest(session_id)

    # ------------------------------------------------------------------ idle expiry (S1-S3)

    def _watch_idle(self, sid: str) -> None:
        """A session opened: its first check is one idle period from now (S3)."""
        idle = self._session_idle_s
        if idle is None:
            return
        seq = next(self._idle_seq)
        self._idle_entry[sid] = seq
        heapq.heappush(self._idle_heap, (self._clock() + idle, seq, sid))
        self._arm_idle_timer()

    def _arm_idle_timer(self) -> None:
        heap = self._idle_heap
        if self._idle_stale > 64 and self._idle_stale > len(self._idle_entry):  # S3: drop ended sessions' entries
            live = self._idle_entry
            self._idle_heap = heap = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(heap)
            self._idle_stale = 0
        t = self._idle_timer
        if not heap:
            return
        if t is not None and not t.ran and not t.cancelled and t.due_s <= heap[0][0]:
            return
        if t is not None:
            t.cancel()
        self._idle_timer = self._mover.schedule(heap[0][0], self._expiry_job, kind="expiry")

    def _session_deadline(self, sid: str, s) -> float:
        """S1: when the session expires if nothing happens meanwhile (the Db's time base)."""
        idle = self._session_idle_s
        d = s.last_active_s + max(idle, s.ttl_s or 0.0)
        for plan in self._agents.get(sid, {}).values():
            if plan.return_s is not None:
                d = max(d, plan.return_s + idle)
        return d

    def _expiry_job(self) -> None:
        """The sweep (a mover timer): end each due session that has stayed idle (S2)."""
        with self._lock:
            if self._state != "open":
                return
            now = self._clock()
            heap, live = self._idle_heap, self._idle_entry
            while heap and heap[0][0] <= now:
                _, seq, sid = heapq.heappop(heap)
                if live.get(sid) != seq:
                    self._idle_stale -= 1
                    continue
                s = self.planner.find_session(sid)
                if s is None:  # cannot happen: the Db ends the planner's sessions itself
                    del live[sid]
                    continue
                deadline = self._session_deadline(sid, s)
                if deadline > now:  # at most an idle period ahead: see S3
                    heapq.heappush(heap, (min(deadline, now + self._session_idle_s), seq, sid))
                    continue
                self.planner.expire_session(sid, now_s=now)
                self._end_session_locked(sid)
                self._idle_stale -= 1  # its entry is already out of the heap
                self._plan_stats["expired_sessions"] += 1
            self._idle_timer = None
            self._arm_idle_timer()

    def run_plans(self) -> None:
        """Run every planned move due by now on the mover and wait for it. The mover runs them
        on its own when their time comes; call this after moving an injected clock (tests, a
        simulated timeline) or to be sure the moves are done."""
        self._check()
        self._mover.run_due()

    def explain(self, workflow=None, *, session_id: str | None = None) -> dict:
        """The plan of a workflow spec as a tree (what ``kvdb explain`` prints), or with
        ``session_id`` the live plan of an open session: per agent its chain's tiers, wait and
        prefetch timer; its shared prefix and where that is resident."""
        if session_id is None:
            if workflow is None:
                raise InvalidInput("explain needs a workflow spec or session_id=")
            return self.planner.explain(workflow)
        self._check()
        with self._lock:
            return self._explain_session(session_id)

    # ------------------------------------------------------------------ chains

    def _note_call_keys(self, ctx, keys: list) -> None:
        """A call's lookup or put: the keys join its agent's chain (the context of an earlier
        call, or of none, changes nothing)."""
        if not isinstance(ctx, CallContext) or ctx.session_id is None:
            return
        with self._lock:
            s = self.planner.find_session(ctx.session_id)
            if s is not None:
                s.last_active_s = self._clock()  # S1/S3: the one thing a put does for expiry
            plan = self._agents.get(ctx.session_id, {}).get(ctx.agent_id)
            if plan is None or plan.ctx is not ctx:
                return
            if plan.fresh:
                plan.fresh = False
                self._set_chain(plan, list(keys))
            else:
                chain = plan.chain
                if keys[: len(chain)] == chain:
                    self._set_chain(plan, list(keys))
                else:
                    have = set(chain)
                    self._set_chain(plan, chain + [k for k in keys if k not in have])
            sid = ctx.session_id
            if sid in self._pending_prefix:
                self._resolve_pending(sid)

    def _set_chain(self, plan: AgentPlan, keys: list) -> None:
        refs = self._chain_refs
        old, new = set(plan.chain), set(keys)
        for k in old - new:
            n = refs[k] - 1
            if n:
                refs[k] = n
            else:
                del refs[k]
        for k in new - old:
            refs[k] = refs.get(k, 0) + 1
        if plan.chain and keys[: len(plan.chain)] != plan.chain:
            self._recent_chains.append((plan.tenant, tuple(plan.chain)))
        plan.chain = keys

    def _private(self, plan: AgentPlan) -> list:
        refs, prot = self._chain_refs, self._protected
        return [k for k in plan.chain if refs.get(k, 0) <= 1 and k not in prot]

    # ------------------------------------------------------------------ waits (E1-E3)

    def _lead_s(self, plan: AgentPlan, on_disk: int = 0) -> float:
        """Prefetch lead (E2): twice the reload estimate plus a margin; ``on_disk`` of the
        chain's blocks reload at the disk's rate (the cost model's, relative to host's)."""
        mem = len(plan.chain) - on_disk
        return 2.0 * (mem + on_disk * DISK_SLOWDOWN) * self._s_per_page + PREFETCH_MARGIN_S

    def _start_wait(self, plan: AgentPlan, wait_s: float, now: float) -> None:
        """The agent waits ``wait_s`` from ``now`` (the event's time: ``now_s`` or the clock)."""
        if plan.return_s is not None and abs(plan.return_s - (now + wait_s)) <= REPLAN_TOLERANCE_S:
            return  # the same wait said twice (the call's hint, then the tool's start)
        if plan.timer is not None and plan.timer.cancel() and plan.return_s is not None:
            self._plan_stats["replanned_waits"] += 1  # a new hint or estimate replaces the plan
        plan.gen += 1
        plan.return_s = now + wait_s
        self._waiting.add(plan)
        plan.offloaded = plan.prefetched = False
        plan.timer = self._mover.schedule(plan.return_s - self._lead_s(plan), self._prefetch_job, plan, plan.gen)
        self._plan_stats["waits"] += 1
        self._plan_pressure()

    def _end_wait(self, plan: AgentPlan) -> None:
        """The agent's call came: score the plan, drop what did not run (E3)."""
        st = self._plan_stats
        if plan.timer is not None and not plan.prefetched:
            if self._clock() >= plan.timer.due_s:
                st["late_prefetches"] += 1
            else:
                st["early_calls"] += 1
            plan.timer.cancel()
        table = self.pool.table
        on_dev = sum(1 for k in plan.chain if (c := table.get(k)) is not None and c & 1 == DEVICE)
        if self.pool.tiers[DEVICE] is None:
            on_dev = sum(1 for k in plan.chain if k in table)
        st["planned_prefetch_hits"] += on_dev
        st["planned_prefetch_misses"] += len(plan.chain) - on_dev
        plan.gen += 1
        plan.return_s = None
        plan.timer = None
        self._waiting.discard(plan)

    def _workflow_waits(self, sid: str, now_s: float | None) -> None:
        wf = self.planner.workflow_of(sid)
        if wf is None:
            return
        now = self.planner.now(now_s)
        starts = wf.agent_next_start(now, 0.0, WORKFLOW_TOOL_DEFAULT_S)
        for agent, plan in self._agents.get(sid, {}).items():
            if plan.in_call or agent not in starts:
                continue
            t = starts[agent]
            if t == math.inf:  # nothing left to run: no prefetch
                if plan.timer is not None and plan.timer.cancel() and not plan.prefetched:
                    self._plan_stats["cancelled_prefetches"] += 1
                plan.gen += 1
                plan.return_s = plan.timer = None
                self._waiting.discard(plan)
                continue
            wait = t - now
            if wait <= 0:
                continue
            self._start_wait(plan, wait, now)

    def _plan_pressure(self) -> None:
        """E1: the device tier is at its watermark and someone waits: offload on the mover."""
        dev = self.pool.tiers[DEVICE]
        if dev is None or self._offload_pending or len(dev.free) > self._device_free_target:
            return
        if not any(not p.offloaded for p in self._waiting):
            return
        self._offload_pending = True
        self._mover.submit(self._offload_job)

    def _offload_job(self) -> None:
        with self._lock:
            self._offload_pending = False
            dev, host = self.pool.tiers
            if self._state != "open" or dev is None or len(dev.free) > self._device_free_target:
                return
            now = self._clock()
            waiting = sorted((p for p in self._waiting if not p.offloaded
                              and p.return_s - now > OFFLOAD_MIN_WAIT_S + self._lead_s(p)),
                             key=lambda p: -p.return_s)
            table = self.pool.table
            for plan in waiting:
                plan.offloaded = True
                private = self._private(plan)
                on_dev = [k for k in private if (c := table.get(k)) is not None and c & 1 == DEVICE]
                if not on_dev:
                    continue
                if (self._cold is not None and len(host.free) < len(on_dev)
                        and plan.return_s - now > DISK_OFFLOAD_MIN_WAIT_S + self._lead_s(plan, len(private))):
                    moved = self.pool.offload([k for k in private if k in table], None)  # host pressure: to disk
                    plan.timer.cancel()  # the reload now comes from disk: an earlier deadline
                    plan.gen += 1
                    plan.timer = self._mover.schedule(plan.return_s - self._lead_s(plan, len(private)),
                                                      self._prefetch_job, plan, plan.gen)
                    self._plan_stats["planned_disk_offload_blocks"] += moved
                else:
                    moved = self.pool.offload(on_dev, HOST)
                self._plan_stats["planned_offloads"] += 1
                self._plan_stats["planned_offload_blocks"] += moved
                return

    def _prefetch_job(self, plan: AgentPlan, gen: int) -> None:
        """E2 (a timer on the mover)."""
        with self._lock:
            if self._state != "open" or plan.gen != gen:
                return
            plan.prefetched = True
            moved, dt = self._bring_up(self._prefetch_keys(plan))
            st = self._plan_stats
            st["planned_prefetches"] += 1
            st["planned_prefetch_blocks"] += moved
            st["planned_prefetch_s"] += dt
            if moved:
                self._s_per_page += RATE_ALPHA * (dt / moved - self._s_per_page)

    def _prefetch_keys(self, plan: AgentPlan) -> list:
        """The chain's blocks not on the device, private ones first, at most half the device
        tier: a chain longer than the tier must not push out everyone else (and itself)."""
        dev = self.pool.tiers[DEVICE]
        table = self.pool.table
        private = self._private(plan)
        mine = set(private)
        order = private + [k for k in plan.chain if k not in mine]
        up = [k for k in order if (c := table.get(k)) is None or c & 1 != DEVICE]
        return up if dev is None else up[: max(1, dev.num_frames // 2)]

    def _bring_up(self, keys) -> tuple[int, float]:
        """Keys toward the device tier (disk -> host -> device); (pages moved, seconds)."""
        t0 = time.perf_counter()
        table = self.pool.table
        absent = [k for k in keys if k not in table]
        loaded = self._load_from_disk(absent)[0] if absent and self._cold is not None else []
        moved = self.pool.promote([k for k in keys if (c := table.get(k)) is not None and c & 1 == HOST])
        return moved + len(loaded), time.perf_counter() - t0

    # ------------------------------------------------------------------ shared prefixes (X1-X3)

    def _apply_prefix_outcomes(self, sid: str, outcomes: list[HintOutcome]) -> list[HintOutcome]:
        out = []
        for o in outcomes:
            if o.name == "prefix_hash" and o.status != REJECTED:
                o = self._declare_prefix(sid, o)
            out.append(o)
        return out

    def _declare_prefix(self, sid: str, o: HintOutcome) -> HintOutcome:
        tenant = self.planner.get_session(sid).tenant or DEFAULT_TENANT
        v = o.value
        if isinstance(v, int):
            key = self.keyspace.engine_keys([v], tenant)[0]
        else:
            try:
                key = bytes.fromhex(v)
            except ValueError:
                key = b""
            if len(key) != KEY_BYTES:
                new = HintOutcome(o.name, CLIPPED, v, "not a block key (32 hex digits) nor an engine hash (int): "
                                                      "nothing to protect")
                self.planner.revise(o, new)
                self._plan_stats["prefixes_unknown"] += 1
                return new
        if self._session_prefix.get(sid) == (tenant, key):
            return o  # named again (e.g. on every call): nothing changes
        first = self._pending_prefix.get(sid) != key
        if first:  # another prefix than before: the old interest goes
            self._pending_prefix.pop(sid, None)
            self._drop_prefix_interest(sid)
        if self._resolve(sid, tenant, key):
            self._pending_prefix.pop(sid, None)
            return o
        self._pending_prefix[sid] = key
        if first:
            self._plan_stats["prefixes_unknown"] += 1
        new = HintOutcome(o.name, CLIPPED, v, "unknown prefix for this session's tenant (no chain seen holds it): "
                                              "nothing protected yet; resolved when a call of the session stores it")
        self.planner.revise(o, new)
        return new

    def _resolve(self, sid: str, tenant: str, key: bytes) -> bool:
        pk = (tenant, key)
        p = self._prefixes.get(pk)
        if p is None:
            chains = [(p.tenant, p.chain) for agents in self._agents.values() for p in agents.values()]
            chains.extend(reversed(self._recent_chains))
            for t, chain in chains:
                if t == tenant and key in chain:
                    keys = tuple(chain[: list(chain).index(key) + 1])
                    break
            else:
                return False
            p = self._prefixes[pk] = SharedPrefix(tenant, key, keys)
            for k in keys:
                self._protected[k] = self._protected.get(k, 0) + 1
        p.sessions.add(sid)
        self._session_prefix[sid] = pk
        self._plan_stats["prefixes_resolved"] += 1
        self._mover.submit(self._prefix_job, pk)
        return True

    def _resolve_pending(self, sid: str) -> None:
        s = self.planner.find_session(sid)
        if s is not None and self._resolve(sid, s.tenant or DEFAULT_TENANT, self._pending_prefix[sid]):
            del self._pending_prefix[sid]

    def _drop_prefix_interest(self, sid: str) -> None:
        pk = self._session_prefix.pop(sid, None)
        p = self._prefixes.get(pk) if pk is not None else None
        if p is None:
            return
        p.sessions.discard(sid)
        if p.sessions:
            return
        del self._prefixes[pk]
        free = []
        for k in p.keys:
            n = self._protected[k] - 1
            if n:
                self._protected[k] = n
            else:
                del self._protected[k]
                free.append(k)
        self._unpin_prefix_keys(free)

    def _unpin_prefix_keys(self, keys) -> None:
        """Drop the Db's prefix pins on these keys (those it holds)."""
        for k in keys:
            loc = self._pinned.pop(k, None)
            if loc is not None:
                self.pool.unpin(*loc)
                self._prefix_pinned[loc[0].index] -= 1

    def _unprotect(self, keys) -> None:
        """Before a delete: the Db's own prefix pins on these keys go (X1)."""
        self._unpin_prefix_keys(keys)

    def _prefix_job(self, pk: tuple) -> None:
        """X1 on the mover: bring the prefix toward the device, then pin what is resident
        (each key once, whatever number of prefixes hold it)."""
        with self._lock:
            p = self._prefixes.get(pk)
            if self._state != "open" or p is None:
                return
            pinned = self._pinned
            self._unpin_prefix_keys([k for k in p.keys if k in pinned and pinned[k][0].index == HOST])  # pinned pages cannot move
            moved, _ = self._bring_up([k for k in p.keys if k not in pinned])
            self._plan_stats["prefix_prefetch_blocks"] += moved
            for k in p.keys:
                loc = self.pool.locate(k)
                if k in pinned or loc is None:
                    continue
                t = loc[0]
                if self._prefix_pinned[t.index] >= int(t.num_frames * PREFIX_PIN_FRACTION):
                    continue
                pinned[k] = self.pool.pin(k)
                self._prefix_pinned[t.index] += 1

    # ------------------------------------------------------------------ reports

    def _tiers_of(self, keys) -> dict[str, int]:
        out = dict.fromkeys((*TIER_NAMES, "disk", "absent"), 0)
        table = self.pool.table
        rest = []
        for k in keys:
            c = table.get(k)
            if c is None:
                rest.append(k)
            else:
                out[TIER_NAMES[c & 1]] += 1
        if rest and self._cold is not None:
            on_disk = sum(self._cold_call(self._cold.contains, rest))
            out["disk"] += on_disk
            out["absent"] += len(rest) - on_disk
        else:
            out["absent"] += len(rest)
        return out

    def _explain_session(self, sid: str) -> dict:
        s = self.planner.get_session(sid)
        now = self._clock()
        agents = []
        for agent, p in self._agents.get(sid, {}).items():
            state = "in call" if p.in_call else ("waiting" if p.return_s is not None else "idle")
            a = {"agent_id": agent, "state": state, "chain_blocks": len(p.chain),
                 "private_blocks": len(self._private(p)), "tiers": self._tiers_of(p.chain)}
            if p.return_s is not None:
                a["return_in_s"] = round(p.return_s - now, 3)
                a["prefetch_in_s"] = None if p.timer is None else round(p.timer.due_s - now, 3)
                a["offloaded"] = p.offloaded
                a["prefetched"] = p.prefetched
            agents.append(a)
        out: dict[str, Any] = {"session_id": sid, "tenant": s.tenant, "agents": agents, "prefix": None}
        pk = self._session_prefix.get(sid)
        if pk is not None:
            p = self._prefixes[pk]
            tiers = self._tiers_of(p.keys)
            status = "resident" if tiers["absent"] == 0 else ("partial" if tiers["absent"] < len(p.keys) else "gone")
            out["prefix"] = {"status": status, "blocks": len(p.keys), "tiers": tiers, "sessions": len(p.sessions),
                             "protected_blocks": sum(1 for k in p.keys if k in self._pinned)}
        elif sid in self._pending_prefix:
            out["prefix"] = {"status": "unknown"}
        return out

    def _plans_stats(self) -> dict:
        out = dict(self._plan_stats)
        out["planned_prefetch_s"] = round(out["planned_prefetch_s"], 6)
        out["waiting_agents"] = len(self._waiting)
        out["timers"] = self._mover.count_timers("plan")
        out["failed_moves"] = self._mover.failed_timers  # a planned move that raised (see mover.last_error)
        out["prefixes"] = len(self._prefixes)
        out["prefix_pinned_pages"] = sum(self._prefix_pinned)
        return out


def _usable(outcomes: list[HintOutcome], name: str):
    for o in outcomes:
        if o.name == name and o.status != REJECTED:
            return o.value
    return None
