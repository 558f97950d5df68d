"""``tokencake``: offload the blocks of agents that wait on a tool (after TokenCake, 2025).

When a call ends with an expected tool wait (hint ``expected_tool_duration_s``; without a
number, the running mean of that ``tool``'s past waits), its session's private blocks are
the first victims while the wait lasts, the session returning last going first; within a
session, least recent and deeper first. ``RELOAD_LEAD_S`` before the predicted return the
session stops being a victim (TokenCake reloads it then; the timed replay in kvdb/sim does
the reload). Blocks touched by more than one session (shared prompts) are never offloaded
this way. Everything else is LRU.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from kvdb.planner.events import CallStarted, HintGiven, SessionEnded
from kvdb.planner.policies.ordered import LruOrderedReplacer

RELOAD_LEAD_S = 1.0


class TokencakeReplacer(LruOrderedReplacer):
    name = "tokencake"

    def __init__(self, num_frames: int) -> None:
        super().__init__(num_frames)
        self._owner: dict[int, str | None] = {}
        self._shared: set[int] = set()
        self._private: dict[str, OrderedDict[int, None]] = {}
        self._waiting: dict[str, tuple[float, int]] = {}  # session -> (return_s, epoch)
        self._heap: list[tuple[float, int, str]] = []  # (-return_s, epoch, session)
        self._epoch = 0
        self._tool_mean: dict[str, tuple[float, int]] = {}
        self._now = 0.0

    def _wait(self, sid: str, hints: dict[str, Any], now: float) -> None:
        d = hints.get("expected_tool_duration_s")
        tool = hints.get("tool")
        if tool is not None:
            tool = str(tool)
            if d is not None:
                m, n = self._tool_mean.get(tool, (0.0, 0))
                self._tool_mean[tool] = ((m * n + d) / (n + 1), n + 1)
            elif tool in self._tool_mean:
                d = self._tool_mean[tool][0]
        if d is None:
            return
        self._epoch += 1
        ret = now + d
        self._waiting[sid] = (ret, self._epoch)
        heapq.heappush(self._heap, (-ret, self._epoch, sid))
        if len(self._heap) > 2 * len(self._waiting) + 64:  # drop superseded waits
            self._heap = [(-r, e, s) for s, (r, e) in self._waiting.items()]
            heapq.heapify(self._heap)

    def on_event(self, event: Any) -> None:
        now = getattr(event, "now_s", None)
        if now is not None and now > self._now:
            self._now = now
        if isinstance(event, CallStarted) and event.session_id is not None:
            self._waiting.pop(event.session_id, None)
        elif isinstance(event, HintGiven):
            self._wait(event.session_id, event.hints, self._now)
        elif isinstance(event, SessionEnded):
            self._waiting.pop(event.session_id, None)

    def record_access(self, frames, ids=None, ctx=None) -> None:
        self._check_frames(frames)
        if ctx is not None and ctx.now_s > self._now:
            self._now = ctx.now_s
        sid = ctx.session_id if ctx is not None else None
        priv = None
        if sid is not None:
            priv = self._private.get(sid)
            if priv is None:
                priv = self._private[sid] = OrderedDict()
        for i in range(len(frames) - 1, -1, -1):
            f = frames[i]
            self._lru[f] = None
            self._lru.move_to_end(f)
            if f in self._shared:
                continue
            if f in self._owner:
                old = self._owner[f]
                if old != sid:  # a second session touched it: shared from now on
                    self._shared.add(f)
                    if old is not None and old in self._private:
                        self._private[old].pop(f, None)
                    continue
            else:
                self._owner[f] = sid
            if priv is not None:
                priv[f] = None
                priv.move_to_end(f)
        if sid is not None and ctx is not None and ctx.hints:
            self._wait(sid, ctx.hints, self._now)

    def _take(self, f: int) -> int:
        del self._lru[f]
        sid = self._owner.pop(f, None)
        self._shared.discard(f)
        if sid is not None:
            p = self._private.get(sid)
            if p is not None:
                p.pop(f, None)
                if not p:
                    del self._private[sid]
        return f

    def evict(self) -> int | None:
        heap = self._heap
        while heap:
            neg_ret, epoch, sid = heap[0]
            w = self._waiting.get(sid)
            if w is None or w[1] != epoch or not self._private.get(sid):
                heapq.heappop(heap)
                continue
            if -neg_ret - self._now <= RELOAD_LEAD_S:
                break  # the furthest return is imminent: nobody is worth offloading
            for f in self._private[sid]:
                if f not in self._pinned:
                    return self._take(f)
            break
        return self._evict_lru()

    def predicted_return(self, session_id: str) -> float | None:
        w = self._waiting.get(session_id)
        return None if w is None else w[0]

    def waiting_sessions(self, now_s: float) -> dict[str, float]:
        """Sessions in a tool wait -> predicted return time (the timed replay reloads them)."""
        return {s: r for s, (r, _) in self._waiting.items() if r > now_s}
