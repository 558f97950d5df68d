"""Tool waits: the Db moves a waiting agent's blocks down while it waits and back up in time.

Part of the class ``kvdb.db.core.Db`` (a mixin of kvdb/db/plans/; the Db's lock guards it).
Timed moves run on the Db's mover (kvdb/db/mover.py) from its timer heap.

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
"""

from __future__ import annotations

import math

from kvdb.buffer_pool.pool import DEVICE, HOST
from kvdb.db.plans.chains import AgentPlan
from kvdb.planner.cost import DEFAULT_COST

OFFLOAD_MIN_WAIT_S = 1.0  # shorter waits keep their blocks: two copies for little room
DISK_OFFLOAD_MIN_WAIT_S = 30.0  # a full host tier takes a waiting agent's blocks only for short
# waits; longer ones go straight to disk (a host cache is full in its steady state: demoting
# there would push out someone else's blocks, while a disk reload still fits in the wait)
PREFETCH_MARGIN_S = 0.25  # slack on top of twice the reload estimate (a busy mover, a late hint)
REPLAN_TOLERANCE_S = 0.5  # a wait whose return moved less keeps its timer (the same wait said twice)
WORKFLOW_TOOL_DEFAULT_S = 10.0  # a declared tool without expected_duration_s
RATE_ALPHA = 0.2  # EWMA weight of one measured prefetch
DISK_SLOWDOWN = DEFAULT_COST.host_bytes_per_s / DEFAULT_COST.disk_bytes_per_s  # disk reload vs host


class WaitsMixin:
    def _init_waits(self) -> None:
        self._waiting: set[AgentPlan] = set()  # plans with a predicted return
        self._last_agent: dict[str, str | None] = {}  # session -> agent that finished last
        self._offload_pending = False
        self._s_per_page = self.layout.page_bytes / DEFAULT_COST.host_bytes_per_s

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
        pool = self.pool
        if pool.has_device:
            on_dev = len(pool.keys_in(DEVICE, plan.chain))
        else:
            on_dev = sum(1 for k in plan.chain if k in pool)
        st["planned_prefetch_hits"] += on_dev
        st["planned_prefetch_misses"] += len(plan.chain) - on_dev
        plan.gen += 1
        plan.return_s = None
        plan.timer = None
        self._waiting.discard(plan)

    def agent_private(self, session_id: str, agent_id: str | None) -> tuple[float | None, frozenset] | None:
        """An open agent's (seconds until its predicted return, None when it does not wait;
        the keys of its private blocks), or None for an agent the Db has no plan of. For an
        engine that keeps the agent's blocks in a pool of its own (the vLLM connector demotes
        them there: kvdb/integrations/vllm/pool.py)."""
        with self._lock:
            plan = self._agents.get(session_id, {}).get(agent_id)
            if plan is None:
                return None
            left = None if plan.return_s is None else plan.return_s - self._clock()
            return left, frozenset(self._private(plan))

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
        if self._offload_pending or not self._device_at_watermark():
            return
        if not any(not p.offloaded for p in self._waiting):
            return
        self._offload_pending = True
        self._mover.submit(self._offload_job)

    def _offload_job(self) -> None:
        with self._lock:
            self._offload_pending = False
            if self._state != "open" or not self._device_at_watermark():
                return
            now = self._clock()
            waiting = sorted((p for p in self._waiting if not p.offloaded
                              and p.return_s - now > OFFLOAD_MIN_WAIT_S + self._lead_s(p)),
                             key=lambda p: -p.return_s)
            pool = self.pool
            for plan in waiting:
                plan.offloaded = True
                private = self._private(plan)
                on_dev = pool.keys_in(DEVICE, private)
                if not on_dev:
                    continue
                if (self._cold is not None and pool.free_frames(HOST) < len(on_dev)
                        and plan.return_s - now > DISK_OFFLOAD_MIN_WAIT_S + self._lead_s(plan, len(private))):
                    moved = pool.offload([k for k in private if k in pool], None)  # host pressure: to disk
                    plan.timer.cancel()  # the reload now comes from disk: an earlier deadline
                    plan.gen += 1
                    plan.timer = self._mover.schedule(plan.return_s - self._lead_s(plan, len(private)),
                                                      self._prefetch_job, plan, plan.gen)
                    self._plan_stats["planned_disk_offload_blocks"] += moved
                else:
                    moved = pool.offload(on_dev, HOST)
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
        pool = self.pool
        private = self._private(plan)
        mine = set(private)
        order = private + [k for k in plan.chain if k not in mine]
        up = [k for k, t in zip(order, pool.tiers_of(order)) if t != DEVICE]
        return up if not pool.has_device else up[: max(1, pool.num_frames(DEVICE) // 2)]
