"""``kvflow``: workflow-aware eviction by steps to execution (after KVFlow, 2025).

Every frame belongs to the (session, agent) that touched it last. An agent's *steps to
execution* come from its session's declared workflow (kvdb.planner.workflow, W3): 0 for an
agent whose next node is ready, more the further its next node is, inf when it has none left.
The victim is the least recently used frame of the group with the most steps; when every
group with frames is at 0 steps, or no workflow was declared, it is plain LRU (R3 within a
call: deeper first). Steps are recomputed after each workflow event, not per eviction.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from kvdb.planner.events import CallFinished, CallStarted, SessionBegan, SessionEnded
from kvdb.planner.policies.ordered import LruOrderedReplacer
from kvdb.planner.workflow import Workflow

Group = tuple  # (session_id, agent_id)


class KvflowReplacer(LruOrderedReplacer):
    name = "kvflow"

    def __init__(self, num_frames: int) -> None:
        super().__init__(num_frames)
        self._group_of: dict[int, Group] = {}
        self._groups: dict[Group, OrderedDict[int, None]] = {}
        self._workflows: dict[str, Workflow] = {}
        self._ranked: list[Group] = []  # groups with steps > 0, most steps first
        self._dirty = False
        self._current: tuple = (None, None)  # (session, agent) of the call in progress

    def on_event(self, event: Any) -> None:
        if isinstance(event, CallStarted):
            self._current = (event.session_id, event.agent_id)
        elif isinstance(event, SessionBegan) and event.workflow is not None:
            self._workflows[event.session_id] = event.workflow
            self._dirty = True
        elif isinstance(event, CallFinished) and event.session_id in self._workflows:
            self._dirty = True
        elif isinstance(event, SessionEnded):
            self._workflows.pop(event.session_id, None)
            self._dirty = True

    def _rank(self) -> None:
        steps: dict[Group, float] = {}
        for g in self._groups:
            sid, agent = g
            wf = self._workflows.get(sid)
            if wf is None:
                # no plan: a session that ended leaves its frames at inf, an unknown one at 0
                steps[g] = 0.0
                continue
            steps[g] = wf.agent_steps().get(agent, math.inf) if agent is not None else 0.0
        ranked = [g for g, s in steps.items() if s > 0]
        ranked.sort(key=lambda g: -steps[g])  # stable: ties keep group creation order
        self._ranked = ranked
        self._dirty = False

    def record_access(self, frames, ids=None, ctx=None) -> None:
        self._check_frames(frames)
        sid = ctx.session_id if ctx is not None else None
        g = (sid, self._current[1] if self._current[0] == sid else None)
        grp = self._groups.get(g)
        if grp is None:
            grp = self._groups[g] = OrderedDict()
            self._dirty = True
        for i in range(len(frames) - 1, -1, -1):  # deepest first: the shallowest ends most recent
            f = frames[i]
            old = self._group_of.get(f)
            if old is not None and old != g:
                og = self._groups.get(old)
                if og is not None:
                    og.pop(f, None)
            self._group_of[f] = g
            grp[f] = None
            grp.move_to_end(f)
            self._lru[f] = None
            self._lru.move_to_end(f)

    def _take(self, f: int) -> int:
        del self._lru[f]
        g = self._group_of.pop(f)
        grp = self._groups[g]
        del grp[f]
        if not grp:
            del self._groups[g]
            self._dirty = True
        return f

    def evict(self) -> int | None:
        if self._dirty:
            self._rank()
        for g in self._ranked:
            grp = self._groups.get(g)
            if not grp:
                continue
            for f in grp:
                if f not in self._pinned:
                    return self._take(f)
        return self._evict_lru()
