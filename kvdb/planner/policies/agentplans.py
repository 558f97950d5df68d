"""Agent-level plans of the ``kvdb`` policy (kvdb.planner.policies.planned): a private block's
plan is its agent's, one heap entry per agent, not one per block.

An agent's *last chain* (the frames of its latest call, in call order) is planned for the
estimated start of its next call ``t``, until a deadline (kvdb.planner.policies.nextuse
``deadline``). A frame is planned for the earliest ``t`` among the agents interested in it
(``_interest[f]``: the agents whose last chain holds it).

* A *private* frame (one interested agent) has no plan entry of its own: its agent's entry on
  the agents' heap stands for the whole chain, so re-planning an agent whose chain is unchanged
  costs O(log agents) for its private frames, whatever the chain's length.
* A *shared* frame (two agents or more: a prompt prefix several agents read) has its own entry
  on the frames' heap, ``(-t, -depth, pver, f)``, pushed again whenever one of its agents moves.

Frames are otherwise touched only when they move between the planner's classes: planned (out
of the GreedyDual heap), unplanned, or released (``t`` infinite: nobody has anything left to
run with them).

Invariants
    P1  ``_planned[f]`` only if some agent in ``_interest[f]`` has a plan; a frame whose last
        planned agent drops its plan (released, expired, its session ended, it moved to a
        chain without the frame) is unplanned then, and goes back on the GreedyDual heap.
    P2  an agent in ``_clean`` holds an interest in every live, non-leaf frame of its chain,
        and each of those frames is planned or released; only then may its re-plan skip them.
        A chain that grows or is replaced, or one of its frames unplanned by an access outside
        the agent's calls, takes the agent out of ``_clean``.
    P3  the planned victim is the one wanted furthest in the future, deepest first: the top of
        the frames' heap (shared frames) or the deepest private frame of the agent with the
        furthest finite ``t`` (its live heap entry is the one whose sequence number
        ``_agent_seq`` names); that agent's scan cursor only moves down while its entry lives,
        and a new entry (re-plan, chain change, a shared frame turned private) starts it again
        at the end.
    P4  ``_agent_shared[a]`` holds the live frames a shares with other agents; their frame
        entries follow every change of their agents' plans.

Pseudo-agents: session-wide hints (``HintGiven``) plan the session's private frames through an
agent of their own, ``(session, HINT)``. Provisional chains (N1, kvdb.planner.policies.newcomers):
an agent of a workflow that has not called yet is planned, for its estimated start, to read the
prefix its kind read in sessions like its own; its first call replaces that chain.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Hashable
from heapq import heapify, heappop, heappush, heapreplace

from kvdb.compiled import copy_fields
from kvdb.planner.policies.newcomers import SessionPrefixes
from kvdb.planner.policies.nextuse import PLAN_SLACK_S, deadline, stretched

ABSENT, LISTED, PINNED = 0, 1, 2  # frame states (PlannedReplacer's ``_state``; defined here, below it)
_ABSENT, _LISTED, _PINNED = ABSENT, LISTED, PINNED  # typed in agentplans.pxd: compiled, a C compare
REPLAN_TOLERANCE_S = 0.5  # an agent whose estimate moved less keeps its plan
HINT = ("<session hint>",)  # the agent name of a session's hint plans (never an agent id: not a str)

Agent = tuple[str, Hashable]


class AgentPlans:
    """Mixin of PlannedReplacer: its frames' arrays (``_state``, ``_inc``, ``_leaf``,
    ``_shared``, ``_planned``, ``_ver``, ``_h``, ``_hc``) and ``_push_gd``."""

    def _init_plans(self, n: int) -> None:
        self._interest: list[dict | None] = [None] * n  # agents whose last chain holds the frame
        self._pver = array("q", [0]) * n  # version of a shared frame's entry on the frames' heap
        self._ft = array("d", [0.0]) * n  # a planned shared frame's plan (P4) ...
        self._fwho: list[Agent | None] = [None] * n  # ... and the agent it is
        self._fplan: list[tuple] = []  # (-t, -depth, pver, f) of shared planned frames
        self._agent_shared: dict[Agent, set[int]] = {}  # P4
        self._agent_chain: dict[Agent, list[tuple[int, int]]] = {}  # agent -> (frame, inc) of its last call
        self._agent_plan: dict[Agent, float] = {}  # agent -> t of its next call (inf: nothing left)
        self._agent_dl: dict[Agent, float] = {}  # agent -> until when its plan stands
        self._agent_seq: dict[Agent, int] = {}  # agent -> sequence number of its live heap entries
        self._agent_cur: dict[Agent, int] = {}  # agent -> scan cursor into its chain (P3)
        self._clean: set[Agent] = set()  # P2
        self._aplan: list[tuple] = []  # (-t, -depth, seq, agent): furthest first, then deepest
        self._aexp: list[tuple] = []  # (deadline, seq, agent): earliest first
        self._seq = 0
        self._sess_agents: dict[str, dict[tuple, None]] = {}  # session -> its agents with a last chain
        self._prefixes = SessionPrefixes()  # N1: what agents that have not called yet will read

    def _push_gd(self, f: int) -> None:
        raise NotImplementedError  # PlannedCore's (declared here: compiled, the base calls it directly)

    def __deepcopy__(self, memo: dict) -> AgentPlans:
        """Field by field (a guard copies a mini cache, kvdb/planner/policies/adaptive.py): compiled,
        the fields are not in ``__dict__`` (kvdb/compiled.py ``copy_fields``)."""
        return copy_fields(self, memo)

    # -- frames --------------------------------------------------------------------------
    def _plan_of(self, f: int) -> float | None:
        """The earliest ``t`` among the planned agents interested in frame f (None: none);
        its agent is left in ``_fwho[f]``."""
        d = self._interest[f]
        if not d:
            return None
        plan = self._agent_plan
        t = who = None
        for a in d:
            u = plan.get(a)
            if u is not None and (t is None or u < t):
                t, who = u, a
        self._fwho[f] = who
        return t

    def _frame_update(self, f: int) -> None:
        """Put frame f in the class its interested agents' plans make it (P1), a shared one
        on the frames' heap at its plan (P3)."""
        t = self._plan_of(f)
        if t is None:
            if self._planned[f]:
                self._unplan(f)
        elif t == math.inf:  # nobody has anything left to run with it
            if not self._shared[f]:
                self._h[f] = self._hc[f] = -math.inf
            if self._planned[f]:
                self._unplan(f)
            else:
                self._push_gd(f)
        else:
            if not self._planned[f]:
                self._planned[f] = 1
                self._ver[f] += 1  # its GreedyDual entry is dead while planned
            if len(self._interest[f]) > 1:
                self._push_frame(f, t)

    def _push_frame(self, f: int, t: float) -> None:
        self._ft[f] = t
        pv = self._pver[f] + 1
        self._pver[f] = pv
        heappush(self._fplan, (-t, -self._depth[f], pv, f))
        if len(self._fplan) > 4 * self.num_frames + 64:
            self._fplan = [e for e in self._fplan if self._pver[e[3]] == e[2]]
            heapify(self._fplan)

    def _shared_moved(self, f: int, agent: Agent, t: float) -> None:
        """Agent's finite plan moved to finite ``t``; f is a planned frame it shares: O(1)
        unless f followed that agent and now must find its earliest agent again."""
        if t < self._ft[f]:
            self._fwho[f] = agent
            self._push_frame(f, t)
        elif self._fwho[f] == agent and t != self._ft[f]:
            self._frame_update(f)

    def _unplan(self, f: int) -> None:
        self._planned[f] = 0
        self._pver[f] += 1
        self._push_gd(f)

    def _unplan_by_access(self, f: int) -> None:
        """An access outside its agents' calls fulfils frame f's plan: unplanned; its agents
        plan it again at their next full pass (P2)."""
        self._planned[f] = 0
        self._pver[f] += 1
        for a in self._interest[f] or ():
            self._clean.discard(a)

    def _add_interest(self, f: int, agent: Agent, t: float, old: float | None) -> None:
        """Agent (planned for ``t``, before for ``old``) is interested in frame f."""
        d = self._interest[f]
        if d is None:
            d = self._interest[f] = {}
        finite = t != math.inf and self._planned[f] and len(d) > 1  # f's plan (``_ft``) is known
        if agent not in d:
            d[agent] = None
            if len(d) > 1:  # shared (P4)
                for a in (d if len(d) == 2 else (agent,)):
                    self._agent_shared.setdefault(a, set()).add(f)
            if finite:  # one more agent: f is wanted sooner or not at all differently
                if t < self._ft[f]:
                    self._fwho[f] = agent
                    self._push_frame(f, t)
                return
        elif finite and old is not None and old != math.inf:
            self._shared_moved(f, agent, t)
            return
        self._frame_update(f)

    def _drop_interest(self, f: int, agent: Agent) -> None:
        d = self._interest[f]
        if d is not None and agent in d:
            del d[agent]
            s = self._agent_shared.get(agent)
            if s is not None:
                s.discard(f)
            if len(d) == 1:  # private again: its agent's scan finds it (P3)
                (other,) = d
                s = self._agent_shared.get(other)
                if s is not None:
                    s.discard(f)
                self._pver[f] += 1
                self._restart_scan(other)
            elif not d:
                self._interest[f] = None
            self._frame_update(f)

    def _unpinned(self, f: int) -> None:
        """Planned frame f can be evicted again: a scan may have passed it while it was pinned,
        so its agent's scan starts again (P3; a shared frame's entry waited on its heap)."""
        d = self._interest[f]
        if d is not None and len(d) == 1:
            self._restart_scan(next(iter(d)))

    def _forget_frame(self, f: int) -> None:
        """Frame f is evicted or removed: out of its agents' shared sets (P4)."""
        d = self._interest[f]
        if d is not None and len(d) > 1:
            for a in d:
                s = self._agent_shared.get(a)
                if s is not None:
                    s.discard(f)
        self._interest[f] = None
        self._pver[f] += 1

    def _live(self, f: int, i: int) -> bool:
        return self._inc[f] == i and self._state[f] != _ABSENT

    # -- agents --------------------------------------------------------------------------
    def _chain_changed(self, agent: Agent) -> None:
        """The agent's chain grew or was replaced: its frames need a full pass (P2) and its
        scan a new start (P3)."""
        self._clean.discard(agent)
        self._restart_scan(agent)

    def _restart_scan(self, agent: Agent) -> None:
        """A new heap entry for the agent, its scan starting again at its chain's end (P3); none
        for an agent with no plan, and an infinite plan is never a victim nor expires."""
        t = self._agent_plan.get(agent)
        if t is None:
            return
        if t == math.inf:
            self._agent_seq.pop(agent, None)
            return
        self._seq += 1
        s = self._agent_seq[agent] = self._seq
        self._agent_cur[agent] = len(self._agent_chain.get(agent, ())) - 1
        heappush(self._aplan, (-t, -math.inf, s, agent))  # its depth is keyed when it comes up
        heappush(self._aexp, (self._agent_dl[agent], s, agent))
        if len(self._aplan) > 4 * len(self._agent_seq) + 64:
            self._aplan = [e for e in self._aplan if self._agent_seq.get(e[3]) == e[2]]
            heapify(self._aplan)
        if len(self._aexp) > 4 * len(self._agent_seq) + 64:
            self._aexp = [e for e in self._aexp if self._agent_seq.get(e[2]) == e[1]]
            heapify(self._aexp)

    def _plan_agent(self, agent: Agent, t: float | None, now: float, dl: float | None = None) -> None:
        """Plan (t) or release (None) the agent's interest in every block of its last chain."""
        chain = self._agent_chain.get(agent)
        if not chain:
            return
        if t is None:
            self._drop_plan(agent)
            return
        old = self._agent_plan.get(agent)
        self._agent_plan[agent] = t
        self._agent_dl[agent] = deadline(t, now) if dl is None else dl
        if old is None or agent not in self._clean or (old == math.inf) != (t == math.inf):
            inc, state, leaf = self._inc, self._state, self._leaf
            for f, i in chain:
                if inc[f] != i or state[f] == _ABSENT or leaf[f]:
                    continue
                self._add_interest(f, agent, t, old)
            self._clean.add(agent)
        elif old != t:  # private frames follow the agent's entry; shared ones move now (P4)
            for f in list(self._agent_shared.get(agent, ())):
                if self._planned[f]:
                    self._shared_moved(f, agent, t)
                else:
                    self._frame_update(f)
        self._restart_scan(agent)

    def _replan(self, sid: str, starts: dict[str, float], now: float, changed: tuple | None = None) -> None:
        """Plan each agent's last chain for its next node's estimated start (W5, ``starts``).

        Only agents whose estimate moved by more than REPLAN_TOLERANCE_S are re-planned, and
        ``changed``, the agent whose chain was just replaced (whatever its estimate did).
        """
        prov = self._prefixes.provisional
        for agent, t in starts.items():
            key = (sid, agent)
            if not self._agent_chain.get(key) or key in prov:
                if not self._prefixes.called(key):
                    self._plan_newcomer(key, t, now)
                continue
            old = self._agent_plan.get(key)
            if key != changed and old is not None and (old == t or abs(old - t) <= REPLAN_TOLERANCE_S):
                continue
            self._plan_agent(key, t, now)

    def _plan_newcomer(self, key: tuple, t: float, now: float) -> None:
        """An agent that has not called yet, starting at ``t``, is planned through a provisional chain
        to read what its parallel siblings began with (N2) or the prefix its kind read in sessions
        like its own (N1); kvdb.planner.policies.newcomers."""
        links, p, sib = self._prefixes.plan_of(key)
        prov = self._prefixes.provisional
        old = self._agent_plan.get(key)
        same = bool(links) and key in prov and self._agent_chain.get(key) == links
        if same and old is None and t != math.inf:  # its plan expired before it called: a newcomer that did not read it (yet)
            self._prefixes.missed(key, sib)
            links, p, sib = self._prefixes.plan_of(key)  # N2: a sibling that did not come falls back to its role prefix
            same = key in prov and self._agent_chain.get(key) == links
        if t == math.inf or not links:
            if key in prov:
                prov.discard(key)
                self._forget_agent(key)
            return
        dl = None
        if sib:  # a sibling (N2) is due now: planned a little later, briefly
            t = stretched(max(t, now + REPLAN_TOLERANCE_S), now, p)
            dl = t + PLAN_SLACK_S
        elif t > now:
            t = stretched(t, now, p)
        if same:
            if old is None or abs(old - t) > REPLAN_TOLERANCE_S:
                self._plan_agent(key, t, now, dl)
            return
        self._drop_plan(key)
        self._agent_chain[key] = list(links)
        prov.add(key)
        self._sess_agents.setdefault(key[0], {})[key] = None
        self._chain_changed(key)
        self._plan_agent(key, t, now, dl)

    def _drop_plan(self, agent: Agent) -> None:
        """The agent's plan is gone (released, expired): its frames lose its interest."""
        self._agent_plan.pop(agent, None)
        self._agent_dl.pop(agent, None)
        self._agent_seq.pop(agent, None)
        self._agent_cur.pop(agent, None)
        self._clean.discard(agent)
        for f, i in self._agent_chain.get(agent, ()):
            if self._live(f, i):
                self._drop_interest(f, agent)
        self._agent_shared.pop(agent, None)

    def _forget_agent(self, agent: Agent) -> None:
        """The agent's session ended: its plan and its chain go."""
        self._drop_plan(agent)
        self._agent_chain.pop(agent, None)

    def _expire_plans(self, now: float) -> None:
        """Drop the plans whose deadline passed: they proved wrong."""
        exp = self._aexp
        while exp and exp[0][0] < now:
            _, s, agent = heappop(exp)
            if self._agent_seq.get(agent) == s:
                self._drop_plan(agent)

    def _planned_victim(self) -> tuple[float, int] | None:
        """(t, frame) of the planned block wanted furthest in the future (P3), or None."""
        heap = self._aplan
        seq = self._agent_seq
        best = None
        while heap:
            negt, negd, s, agent = heap[0]
            f = self._scan(agent) if seq.get(agent) == s else None
            if f is None:
                heappop(heap)
            elif -negd != self._depth[f]:  # keyed by the depth of its deepest plannable block
                heapreplace(heap, (negt, -self._depth[f], s, agent))
            else:
                best = (-negt, self._depth[f], f)
                break
        e = self._top_live(self._fplan, self._pver, self._planned, 1)
        if e is not None and (best is None or (-e[0], -e[1]) > best[:2]):  # furthest, then deepest
            return -e[0], e[3]
        return None if best is None else (best[0], best[2])

    def _scan(self, agent: Agent) -> int | None:
        """The deepest private planned frame of the agent's chain."""
        chain = self._agent_chain.get(agent)
        if not chain:
            return None
        i = min(self._agent_cur.get(agent, len(chain) - 1), len(chain) - 1)
        inc, state, planned, interest = self._inc, self._state, self._planned, self._interest
        while i >= 0:
            f, k = chain[i]
            if inc[f] != k or state[f] == _ABSENT:
                if i == len(chain) - 1:
                    chain.pop()  # a dead tail: gone for good
                i -= 1
                continue
            d = interest[f]
            if state[f] == _PINNED or not planned[f] or not d or len(d) > 1 or agent not in d:
                i -= 1  # shared frames are on the frames' heap; a pinned one is looked at again once unpinned
                continue
            self._agent_cur[agent] = i
            return f
        self._agent_cur[agent] = -1
        return None

    def _top_live(self, heap: list[tuple], ver: array, flag: bytearray, want: int) -> tuple | None:
        """The smallest live, unpinned entry of a lazy heap of ``(..., version, frame)`` entries,
        left on the heap: stale entries (version moved on, frame absent, or ``flag[frame] != want``)
        are dropped, pinned ones set aside and pushed back."""
        state = self._state
        stash = []
        found = None
        while heap:
            e = heap[0]
            f = e[-1]
            if ver[f] != e[-2] or state[f] == _ABSENT or flag[f] != want:
                heappop(heap)
                continue
            if state[f] == _PINNED:
                stash.append(heappop(heap))
                continue
            found = e
            break
        for e in stash:
            heappush(heap, e)
        return found

    def debug_plan(self, frame: int) -> float | None:
        """The frame's planned next use, None when it is not planned (tests only)."""
        if not self._planned[frame] or self._state[frame] == _ABSENT:
            return None
        return self._plan_of(frame)


__all__ = ["AgentPlans", "HINT"]
