"""When each agent calls next: the estimates the ``kvdb`` policy (planned.py) plans blocks by.

The kvdb policy plans every agent's *last chain* (all blocks of its latest call) for the
agent's next call. This module estimates that call's start; planned.py applies an estimate to
the chain's frames (``_plan_agent``) and keeps the frames' interests.

* Sessions with a declared workflow (``call_finished``): the start of each agent's next LLM
  node on the critical path over the DAG (kvdb.planner.workflow W5), tools taking their
  declared durations or an EWMA of the observed tool waits (a node whose dependency is a tool
  started when that tool ended). An agent whose latest call waits on a tool is left out: it
  calls again when the tool returns (its hint's estimate, ``on_call``), whatever its node's
  successors (for an agent in its last node the critical path says "nothing left").
* Sessions without one (``on_call``), each call of an agent:
  - a tool-wait hint d: after this call (one LLM call) and the tool, now + llm + d; it extends
    the session's wait (until its last tool returns) and re-plans the agents taken to wait
    for it;
  - no hint while siblings wait on tools (fan-in, as a coordinator does): the end of their
    wait + one LLM call + the learned residual of its context;
  - no hint and nobody waiting: now + the learned residual, or unplanned (None) while its
    context has too few observations. An agent calling without a hint also joins the
    session's next wait: a coordinator's plan call comes before its workers' hints;
  - ``ttl_s``: kept until now + ttl.
  Residuals are learned online by kvdb.planner.policies.gaps from the agent's next call, in
  contexts of (kind, agent, gap before its last call, progress); an estimate's distance from
  now is stretched by 1 / P(it calls again) ** 2. An agent waiting on a fan-in that called
  with nobody waiting keeps both estimates and uses the one that came closer so far for its
  (agent, gap bin).

Each estimate carries a deadline (``deadline``): t + 3 (t - now) + 2 s, slack for noisy
hints (σ = 1 in log space is a factor e either way); past it the plan proved wrong.

Reads only the past, declared workflows and hints (no peeking; tests/sim check it).
"""

from __future__ import annotations

from typing import Any

from kvdb.errors import InvalidInput
from kvdb.planner.policies.gaps import GapEstimator, gap_bin
from kvdb.planner.workflow import Workflow

PLAN_SLACK_FACTOR = 3.0
PLAN_SLACK_S = 2.0
REPEAT_ALPHA = 0.02  # EWMA weight of one workflow call in repeat_rate
LLM_CALL_S = 2.0  # default time from a node's CallFinished to its end (W5): the simulator
# reports calls at their arrival; an engine that reports them when they finish passes 0
TOOL_DEFAULT_S = 10.0  # a tool's duration before any has been observed
TOOL_ALPHA = 0.1  # EWMA weight of one observed tool wait
PROGRESS_CAP = 8  # a session's waits (or an agent's calls), as a context of its estimates, saturate here
PREFER_ALPHA = 0.1  # EWMA weight of one comparison of an agent's free and fan-in estimates

#: an agent: (session id, agent id or None)
Agent = tuple
#: plans to apply, in order: (agent, its next call's estimated start; None releases its chain)
Plans = list[tuple[Agent, "float | None"]]


def hint_plan(hints: dict[str, Any], now: float) -> tuple[float, float] | None:
    """(next use, deadline) that a call's own hints promise: a tool wait, else a ttl."""
    d = hints.get("expected_tool_duration_s")
    ttl = hints.get("ttl_s")
    if d is not None:
        return now + d, now + d * (1.0 + PLAN_SLACK_FACTOR) + PLAN_SLACK_S
    if ttl is not None:
        return now, now + ttl
    return None


def stretched(t: float, now: float, p: float) -> float:
    """An estimate ``t`` whose outcome has chance ``p``: its distance from now over p ** 2, so an
    unlikely next use ranks as a later one."""
    return now + (t - now) / (p * p)


def deadline(t: float, now: float) -> float:
    """Until when a plan for ``t`` made at ``now`` stands."""
    return t + PLAN_SLACK_FACTOR * max(0.0, t - now) + PLAN_SLACK_S


def _contexts(kind: str, name: str | None, features: tuple[int, int]) -> tuple:
    """GapEstimator contexts of an estimate, most specific first (kvdb.planner.policies.gaps)."""
    gap, progress = features
    return ((kind, name, gap, progress), (kind, name, progress), (kind, name), (kind,))


class NextUseEstimator:
    """Per session and agent: declared workflows, tool waits, fan-ins and pending predictions."""

    def __init__(self, llm_call_s: float = LLM_CALL_S) -> None:
        if not llm_call_s >= 0:
            raise InvalidInput(f"llm_call_s must be a number >= 0, got {llm_call_s!r}")
        self.llm_s = float(llm_call_s)
        self.use_workflows = True  # False: declared workflows are kept but not planned from (the guard's choice)
        self._nodes_seen: dict[str, set[str]] = {}  # workflow session -> its nodes called so far
        self.repeat_rate = 0.0  # EWMA: share of workflow calls whose node had been called before
        self._tool_s = TOOL_DEFAULT_S
        self._workflows: dict[str, Workflow] = {}
        self._sess_wait: dict[str, float] = {}  # no-workflow session -> when its last tool wait ends
        self._on_tool: dict[str, set] = {}  # session -> names of its agents whose latest call waits on a tool
        self._fan_in: dict[str, dict[Agent, tuple[tuple[int, int], int]]] = {}  # session -> waiting agent -> (features, wait epoch)
        self._epoch: dict[str, int] = {}  # no-workflow session -> number of its waits so far
        self._gaps = GapEstimator()  # residuals of next-call estimates, learned online
        self._pending: dict[Agent, list[tuple]] = {}  # agent -> [(contexts, base s, raw estimate)] of its open estimates
        self._last_call: dict[Agent, float] = {}  # agent -> time of its last call
        self._prefer: dict[tuple, float] = {}  # (agent, gap bin) -> > 0: fan-in estimates came closer
        self._calls: dict[Agent, int] = {}  # agent -> its calls so far
        self._feat: dict[Agent, tuple[int, int]] = {}  # agent -> (octave of the gap before its last call, progress)

    # -- sessions with a workflow ---------------------------------------------------------
    def begin(self, session_id: str, workflow: Workflow | None) -> None:
        if workflow is not None:
            self._workflows[session_id] = workflow

    def agent_of(self, session_id: str | None, node_id: str | None, agent_id: str | None) -> str | None:
        """The agent a call belongs to: its node's ``agent_id`` when the session's workflow
        declares the node (a call may name its agent in another namespace; the node links
        them), else the call's own ``agent_id``."""
        wf = self._workflows.get(session_id) if self.use_workflows and session_id is not None else None
        if wf is not None and node_id is not None:
            node = wf.nodes.get(node_id)
            if node is not None and node.agent_id is not None:
                return node.agent_id
        return agent_id

    def has_workflow(self, session_id: str) -> bool:
        return self.use_workflows and session_id in self._workflows

    def call_finished(self, session_id: str, node_id: str | None, now: float) -> dict[str, float] | None:
        """Each agent's next LLM node start (W5) after a call of a workflow session, but for
        the agents waiting on a tool (their next call is its return); None for a session
        without a workflow."""
        wf = self._workflows.get(session_id) if self.use_workflows else None
        if wf is None:
            return None
        if node_id is not None and node_id in wf.nodes:
            self._observe_tools(wf, node_id, now)
            seen = self._nodes_seen.setdefault(session_id, set())
            self.repeat_rate += REPEAT_ALPHA * ((node_id in seen) - self.repeat_rate)
            seen.add(node_id)
        starts = wf.agent_next_start(now, self.llm_s, self._tool_s)
        busy = self._on_tool.get(session_id)
        return {a: t for a, t in starts.items() if a not in busy} if busy else starts

    def parallel(self, session_id: str, node_id: str | None) -> tuple[tuple, list[str]] | None:
        """(deps of the call's node, the agents of the other pending LLM nodes with the same deps);
        None without a workflow or a declared node."""
        wf = self._workflows.get(session_id) if self.use_workflows else None
        if wf is None or node_id is None or node_id not in wf.nodes:
            return None
        return wf.nodes[node_id].deps, wf.parallel(node_id)

    def looping(self) -> bool:
        """Whether declared nodes are more often called again than left: agents loop inside
        their nodes (ReAct), so an agent's next call is its loop's, not its next node's."""
        return self.repeat_rate > 0.5

    def _observe_tools(self, wf: Workflow, node_id: str, now: float) -> None:
        """Learn tool durations: a node whose dep is a tool started when that tool ended."""
        for t in wf.nodes[node_id].deps:
            tn = wf.nodes[t]
            if tn.kind != "tool":
                continue
            starts = [wf.done_s[d] + self.llm_s for d in tn.deps if d in wf.done_s]
            if starts:
                obs = max(0.0, now - max(starts))
                self._tool_s += TOOL_ALPHA * (obs - self._tool_s)

    # -- sessions without one -------------------------------------------------------------
    def on_call(self, agent: Agent, hints: dict[str, Any], now: float, new_call: bool) -> Plans:
        """A call of ``agent`` (the first access of it when ``new_call``): the plans it
        changes, its own and those of siblings waiting on the session's tools. The agent's
        next call closes its pending prediction: the residual is learned."""
        sid, name = agent
        if new_call:
            self._close(agent, sid, now)
        plans: Plans = []
        waiting = self._fan_in.setdefault(sid, {})
        d = hints.get("expected_tool_duration_s")
        on_tool = self._on_tool.setdefault(sid, set())
        if d is not None:
            on_tool.add(name)
        else:
            on_tool.discard(name)
        until = self._sess_wait.get(sid, 0.0)
        epoch = self._epoch.get(sid, 0)
        if d is not None:
            waiting.pop(agent, None)
            self._pending.pop(agent, None)
            if until <= now:  # a new wait begins: waiters of older ones have moved on
                epoch += 1
                self._epoch[sid] = epoch
                until = 0.0
            t = now + self.llm_s + d
            plans.append((agent, t))
            if t > until:
                self._sess_wait[sid] = t
                base = t + self.llm_s
                for k, (ft, ep) in list(waiting.items()):
                    if ep != epoch:
                        del waiting[k]
                        continue
                    ctxs = _contexts("fan-in", k[1], ft)
                    # one that called with nobody waiting keeps that estimate too (the last
                    # worker back calls again with the next round's workers); the one that came
                    # closer for its (agent, gap bin) so far is used
                    pend = [e for e in self._pending.get(k, ()) if e[0][-1][0] == "free"]
                    self._pending[k] = [*pend, (ctxs, base, self._raw(ctxs, base))]
                    if pend and self._prefer.get(pend[0][0][0][1:3], 0.0) < 0:
                        continue  # its own estimate stands
                    plans.append((k, self._estimate(ctxs, base, now, True)))
            return plans
        ttl = hints.get("ttl_s")
        if ttl is not None:
            self._pending.pop(agent, None)
            plans.append((agent, now + ttl / (1.0 + PLAN_SLACK_FACTOR)))
            return plans
        ft = self._feat.get(agent, (-1, 0))
        if until > now:
            kind, base = "fan-in", until + self.llm_s
            waiting[agent] = (ft, epoch)
        else:
            kind, base = "free", now
            waiting[agent] = (ft, epoch + 1)
        ctxs = _contexts(kind, name, ft)
        self._pending[agent] = [(ctxs, base, self._raw(ctxs, base))]
        plans.append((agent, self._estimate(ctxs, base, now, kind == "fan-in")))
        return plans

    def _close(self, agent: Agent, sid: str, now: float) -> None:
        """The agent called again: learn the residuals of its open estimates, and which of
        its free and fan-in estimates came closer; update its context features."""
        pend = self._pending.pop(agent, ())
        for ctxs, base, _ in pend:
            self._gaps.observe(ctxs, now - base)
        if len(pend) == 2:  # which estimate came closer ("at once" when it had none)
            (c, b, t_free), (_, b2, t_fan) = pend
            t_free = b if t_free is None else t_free
            t_fan = b2 if t_fan is None else t_fan
            won = 1.0 if abs(now - t_fan) <= abs(now - t_free) else -1.0
            k = c[0][1:3]
            old = self._prefer.get(k, 0.0)
            self._prefer[k] = old + PREFER_ALPHA * (won - old)
        prev = self._last_call.get(agent)
        self._last_call[agent] = now
        # progress: the session's tool waits so far; without any, the agent's calls (negated)
        waits = self._epoch.get(sid, 0)
        calls = self._calls[agent] = self._calls.get(agent, 0) + 1
        self._feat[agent] = (gap_bin(None if prev is None else now - prev),
                             min(waits, PROGRESS_CAP) if waits else -min(calls, PROGRESS_CAP))

    def _raw(self, ctxs: tuple, base: float) -> float | None:
        r = self._gaps.predict(ctxs)
        return None if r is None else base + r

    def _estimate(self, ctxs: tuple, base: float, now: float, fan_in: bool) -> float | None:
        """base + the context's learned residual, its distance from now stretched by
        1 / P(the agent calls again): an agent that may never return ranks as a later one."""
        g = self._gaps
        r = g.predict(ctxs)
        if r is None and not fan_in:
            return None
        t = base + (r or 0.0)
        return stretched(t, now, g.p_next(ctxs))

    # -- both -----------------------------------------------------------------------------
    def end(self, session_id: str, agents) -> None:
        """The session ended: forget it and its ``agents``; their open estimates were false alarms."""
        self._workflows.pop(session_id, None)
        self._nodes_seen.pop(session_id, None)
        self._sess_wait.pop(session_id, None)
        self._on_tool.pop(session_id, None)
        self._fan_in.pop(session_id, None)
        self._epoch.pop(session_id, None)
        for key in agents:
            for ctxs, _, _ in self._pending.pop(key, ()):
                self._gaps.missed(ctxs)
            self._last_call.pop(key, None)
            self._feat.pop(key, None)
            self._calls.pop(key, None)
