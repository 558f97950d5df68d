"""Agent workflows as plans: a DAG of nodes (agent LLM calls and tool waits).

A workflow is declared at session start (a ``workflow`` trace line, or
``Planner.begin_session(..., workflow=...)``). Later calls name their node with ``node_id``;
the planner marks that node done and recomputes each pending node's *steps to execution*.

Invariants (tests cite them):
  W1  node ids are unique; every dep names a node of the same workflow (else InvalidInput
      naming the node and the dangling dep).
  W2  the graph is acyclic (else InvalidInput naming a node on the cycle).
  W3  steps(n) = 0 when every dep of n is done, else 1 + max(steps(d)) over the pending deps d;
      a done node has no steps. An agent's steps are the minimum over its pending nodes and
      ``inf`` when it has none left (its blocks are the first candidates for eviction).
  W4  marking a node done marks its ancestors done too: a node runs only after its deps, and
      tool nodes have no call of their own to mark them.
  W5  estimated starts: a done node ends at its done time (+ ``llm_s`` for an LLM call); a
      pending LLM node starts at max(now, ends of its deps); a pending tool ends at
      max(now, start + expected duration) -- an overdue tool is still running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from kvdb.errors import InvalidInput

KINDS = ("llm", "tool")


@dataclass(frozen=True)
class Node:
    id: str
    agent_id: str | None
    deps: tuple[str, ...] = ()
    kind: str = "llm"  # "llm" (an agent LLM call) or "tool" (a tool wait)
    expected_duration_s: float | None = None  # tools: how long the wait is expected to last


@dataclass
class Workflow:
    """A validated DAG plus its execution state (which nodes are done)."""

    session_id: str
    nodes: dict[str, Node]
    order: list[str]  # a topological order (deps first), fixed at validation
    done: set[str] = field(default_factory=set)
    done_s: dict[str, float] = field(default_factory=dict)  # node -> when its call was seen
    # the last agent_next_start, ((now_s, llm_s, default_tool_s), result), until mark_done: every
    # planner of a guard (kvdb/planner/policies/adaptive.py) asks the same after each call
    _starts: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # per llm_s, what W5 needs that only mark_done changes (``_settle``), so that a new ``now_s``
    # walks the pending nodes only; one per llm_s asked (the engine's Db asks with 0, its planners
    # with their call time)
    _settled: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # deps -> the LLM nodes with an agent that have them (``parallel``), built at its first call
    _by_deps: dict | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_spec(cls, session_id: str, nodes: Iterable[Mapping[str, Any]], where: str = "workflow") -> "Workflow":
        """Validate a declared DAG (``[{"id", "agent_id", "deps", ...}]``) -- W1, W2."""
        if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Iterable):
            raise InvalidInput(f"{where}: 'nodes' must be a list of node objects")
        by_id: dict[str, Node] = {}
        for i, spec in enumerate(nodes):
            if not isinstance(spec, Mapping) or "id" not in spec:
                raise InvalidInput(f"{where}: node #{i} must be an object with an 'id'")
            nid = str(spec["id"])
            if nid in by_id:
                raise InvalidInput(f"{where}: node {nid!r} is declared twice")
            deps = spec.get("deps", []) or []
            if isinstance(deps, (str, bytes)) or not isinstance(deps, Iterable):
                raise InvalidInput(f"{where}: node {nid!r}: 'deps' must be a list of node ids")
            kind = spec.get("kind", "llm")
            if kind not in KINDS:
                raise InvalidInput(f"{where}: node {nid!r}: kind {kind!r} is not one of {KINDS}")
            dur = spec.get("expected_duration_s")
            if dur is not None:
                try:  # an int past float's range (10**400) is refused too, not an OverflowError
                    ok = isinstance(dur, (int, float)) and not isinstance(dur, bool) and dur >= 0 and math.isfinite(dur)
                except OverflowError:
                    ok = False
                if not ok:
                    raise InvalidInput(f"{where}: node {nid!r}: expected_duration_s must be a finite number >= 0, "
                                       f"got {dur!r:.40}")
                dur = float(dur)
            agent = spec.get("agent_id")
            by_id[nid] = Node(nid, None if agent is None else str(agent), tuple(str(d) for d in deps), kind, dur)
        for n in by_id.values():
            for d in n.deps:
                if d not in by_id:
                    raise InvalidInput(f"{where}: node {n.id!r} depends on {d!r}, which is not a node of the workflow (dangling dep)")
        order = _topological_order(by_id, where)
        return cls(session_id, by_id, order)

    def fresh(self) -> "Workflow":
        """The same DAG with no progress (a session starts from this; the declaration stays clean)."""
        return Workflow(self.session_id, self.nodes, self.order)

    def parallel(self, node_id: str) -> list[str]:
        """The agents of the pending LLM nodes other than ``node_id`` with the same deps: they run
        beside it (a fan-out's siblings). The nodes are indexed by deps once per session, so a
        call costs its fan-out, not the workflow's size."""
        if self._by_deps is None:
            self._by_deps = {}
            for n in self.nodes.values():
                if n.kind == "llm" and n.agent_id is not None:
                    self._by_deps.setdefault(n.deps, []).append(n)
        return [n.agent_id for n in self._by_deps.get(self.nodes[node_id].deps, ())
                if n.id != node_id and n.id not in self.done]

    def mark_done(self, node_id: str, now_s: float | None = None) -> None:
        """W4: the node and all its ancestors are done."""
        if node_id not in self.nodes:
            raise InvalidInput(f"session {self.session_id!r}: node {node_id!r} is not in its workflow")
        self._starts = None
        if now_s is not None:
            if node_id in self.done:  # a done node's end moves: W5's settled part is computed again
                self._settled.clear()
            self.done_s[node_id] = now_s
        stack = [node_id]
        while stack:
            nid = stack.pop()
            if nid in self.done:
                continue
            self.done.add(nid)
            stack.extend(self.nodes[nid].deps)
        for llm_s, (end, pending, best) in self._settled.items():  # the newly done nodes were pending, and no done node descends from them
            self._settled[llm_s] = (end, self._settle(llm_s, end, pending), best)

    def agent_next_start(self, now_s: float, llm_s: float, default_tool_s: float) -> dict[str, float]:
        """W5: each agent's earliest estimated start of a pending LLM node (inf when none)."""
        key = (now_s, llm_s, default_tool_s)
        if self._starts is not None and self._starts[0] == key:
            return dict(self._starts[1])
        kept = self._settled.get(llm_s)
        if kept is None:
            end = {}
            kept = self._settled[llm_s] = (end, self._settle(llm_s, end, [self.nodes[nid] for nid in self.order]),
                                           {n.agent_id: math.inf for n in self.nodes.values() if n.agent_id is not None})
        end, pending, best = kept
        end = dict(end)  # the done nodes' ends; the pending ones' are added below
        best = dict(best)
        for n in pending:  # deps first: every dep's end is known when its node comes up
            start = _latest_end(end, n.deps, now_s)
            if n.kind == "tool":
                dur = n.expected_duration_s if n.expected_duration_s is not None else default_tool_s
                end[n.id] = now_s if now_s > start + dur else start + dur
            else:
                if now_s > start:
                    start = now_s
                end[n.id] = start + llm_s
                a = n.agent_id
                if a is not None and start < best[a]:
                    best[a] = start
        self._starts = (key, best)
        return dict(best)

    def _settle(self, llm_s: float, end: dict[str, float], pending: list[Node]) -> list[Node]:
        """W5's part that does not depend on ``now_s``, for one ``llm_s``: the nodes of ``pending``
        (in order) that are done now get their end in ``end``, in order (their deps are done
        before them); the ones still pending are returned. ``_settled`` keeps, per ``llm_s``, (the
        end of every done node, the pending nodes in order, every agent at inf)."""
        left = []
        for n in pending:
            if n.id not in self.done:
                left.append(n)
                continue
            t = self.done_s.get(n.id)
            if t is None:  # an implicit ancestor: it ended no later than its dependents
                t = _latest_end(end, n.deps, 0.0)
            else:
                t = t + (llm_s if n.kind == "llm" else 0.0)
            end[n.id] = t
        return left

    def steps(self) -> dict[str, int]:
        """Steps to execution of every pending node (W3)."""
        out: dict[str, int] = {}
        for nid in self.order:  # deps come first
            if nid in self.done:
                continue
            pending = [out[d] for d in self.nodes[nid].deps if d not in self.done]
            out[nid] = 1 + max(pending) if pending else 0
        return out

    def agent_steps(self) -> dict[str, float]:
        """Min steps over each agent's pending nodes; agents with none pending get inf (W3)."""
        best: dict[str, float] = {n.agent_id: math.inf for n in self.nodes.values() if n.agent_id is not None}
        for nid, s in self.steps().items():
            a = self.nodes[nid].agent_id
            if a is not None and s < best[a]:
                best[a] = s
        return best


def _latest_end(end: dict[str, float], deps: tuple[str, ...], default: float) -> float:
    """The latest end among ``deps`` (``default`` when there are none), as ``max`` picks it."""
    t = default
    first = True
    for d in deps:
        e = end[d]
        if first or e > t:
            t = e
            first = False
    return t


def _topological_order(nodes: Mapping[str, Node], where: str) -> list[str]:
    """Iterative DFS (no recursion limit on deep chains); raises on a cycle (W2)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = finished
    order: list[str] = []
    for root in nodes:  # insertion order keeps the result independent of hashing
        if root in state:
            continue
        stack = [(root, iter(nodes[root].deps))]
        state[root] = 1
        while stack:
            nid, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[nid] = 2
                order.append(nid)
            elif state.get(nxt) == 1:
                raise InvalidInput(f"{where}: the workflow has a cycle through node {nxt!r} (deps must form a DAG)")
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(nodes[nxt].deps)))
    return order
