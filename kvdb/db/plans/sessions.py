"""The planner's engine API on the Db, and the engine carrying out the plan.

Part of the class ``kvdb.db.core.Db`` (mixins). ``begin_session`` / ``hint`` / ``call_started`` /
``call_finished`` / ``end_session`` forward to the Db's ``Planner`` (kvdb/planner/sessions.py),
which informs every tier's replacer. The Db itself then *acts* on what the plan says: it
moves a waiting agent's blocks down while it waits and back up before it returns, and it
keeps a session's declared shared prefix resident. All of it runs under the Db's lock; the
moves run on the Db's one background mover (kvdb/db/mover.py), timed ones from its timer heap.

The plan's parts, each with its invariants, one module each: agent chains (chains.py), tool
waits E1-E4 (waits.py), shared prefixes X1-X3 (prefixes.py), idle expiry S1-S3 (expiry.py).
This module: the calls (begin_session, hint, call_started, call_finished, end_session, explain,
run_plans) and what a session's end drops.

Statistics: ``stats()["plans"]``; the live plan of a session: ``explain(session_id=...)``.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvdb.buffer_pool.pool import TIER_NAMES
from kvdb.db.plans.chains import AgentPlan, ChainsMixin
from kvdb.db.plans.expiry import ExpiryMixin
from kvdb.db.plans.prefixes import PrefixesMixin
from kvdb.db.plans.waits import WaitsMixin
from kvdb.errors import InvalidInput
from kvdb.keys import DEFAULT_TENANT
from kvdb.planner.hints import REJECTED, HintOutcome
from kvdb.planner.sessions import check_now, check_session_args

STAT_NAMES = ("waits", "replanned_waits", "planned_offloads", "planned_offload_blocks", "planned_disk_offload_blocks",
              "planned_prefetches", "planned_prefetch_blocks", "planned_prefetch_hits", "planned_prefetch_misses",
              "early_calls", "late_prefetches", "cancelled_prefetches", "prefixes_resolved", "prefixes_unknown",
              "prefix_prefetch_blocks", "expired_sessions", "evicted_sessions")


class PlansMixin(ChainsMixin, WaitsMixin, PrefixesMixin, ExpiryMixin):
    def _init_plans(self) -> None:
        self._init_chains()
        self._init_waits()
        self._init_prefixes()
        self._init_expiry()
        self._plan_stats = dict.fromkeys(STAT_NAMES, 0)
        self._plan_stats["planned_prefetch_s"] = 0.0

    # ------------------------------------------------------------------ engine API

    def begin_session(self, session_id: str, *, tenant: str | None = None, workflow=None,
                      hints: Mapping[str, Any] | None = None, now_s: float | None = None) -> list[HintOutcome]:
        """Open an agent session, optionally with its declared workflow (DAG of LLM calls and
        tool waits: a list of ``{"id", "agent_id", "deps"}`` nodes or ``{"nodes": [...]}``) and
        hints (e.g. ``prefix_hash``); returns the hints' outcomes."""
        self._check()
        if hints is not None and not isinstance(hints, Mapping):  # before the session opens
            raise InvalidInput(f"hints must be a mapping of hint name to value, got {type(hints).__name__}")
        with self._lock:
            self.planner.begin_session(session_id, tenant=tenant, workflow=workflow, now_s=now_s)
            self._watch_idle(session_id)
            self._bound_sessions(session_id)
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
        check_session_args(sid, agent_id=agent_id)
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
                self._bound_sessions(session_id)
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
        now_s = None if now_s is None else check_now(now_s)
        check_session_args(session_id, optional=True, agent_id=agent_id, node_id=node_id)
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
        self._prompts.end(session_id)

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

    # ------------------------------------------------------------------ reports

    def _tiers_of(self, keys) -> dict[str, int]:
        out = dict.fromkeys((*TIER_NAMES, "disk", "absent"), 0)
        rest = []
        for k, t in zip(keys, self.pool.tiers_of(keys)):
            if t is None:
                rest.append(k)
            else:
                out[TIER_NAMES[t]] += 1
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
        out["prompts"] = self._prompts.session(sid)  # cache breaks (kvdb/prompts), None before a noted prompt
        # what the eviction policy has learned (the kvdb policy's guard: kvdb/planner/policies/adaptive.py)
        out["eviction"] = [r.describe() for r in self.pool.replacers() if callable(getattr(r, "describe", None))]
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
