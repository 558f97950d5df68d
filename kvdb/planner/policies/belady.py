"""Belady's MIN, the offline bound (replay only: it reads the future of the trace).

Built over the whole sequence of calls (block ids in chain order); the k-th
``record_access`` is taken to be the k-th call. Every frame of the call gets the key
(-next use, -depth): the min-heap then evicts the block used furthest in the future,
never-again blocks first, ties to the deeper block (R3, kvdb/buffer_pool/replacer.py).
Because the simulator offers a call's blocks before evicting (S2, S3 in kvdb/sim/replay.py),
an offered block may go at once.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from kvdb.errors import InvalidInput
from kvdb.planner.policies.heap import HeapReplacer


class BeladyReplacer(HeapReplacer):
    name = "belady"
    replay_only = True

    def __init__(self, num_frames: int, future: Sequence[Sequence[Hashable]] | None = None) -> None:
        super().__init__(num_frames)
        if future is None:
            raise InvalidInput("belady needs the whole trace (future=...); it is a replay-only bound")
        nxt: list[list[float]] = [[]] * len(future)
        last: dict[Hashable, float] = {}
        for i in range(len(future) - 1, -1, -1):
            ids = future[i]
            nxt[i] = [last.get(b, math.inf) for b in ids]
            for b in ids:
                last[b] = i
        self._next_use = nxt
        self._call = 0

    def record_access(self, frames, ids=None, ctx=None) -> None:
        k = self._call
        if k >= len(self._next_use):
            raise InvalidInput(f"belady was built for {len(self._next_use)} calls; call #{k + 1} is beyond its trace")
        nu = self._next_use[k]
        if len(nu) != len(frames):
            raise InvalidInput(f"belady: call #{k} has {len(frames)} frames but the trace has {len(nu)} blocks")
        self._call = k + 1
        for j, f in enumerate(frames):
            self._set_key(f, (-nu[j], -j))

    def _default_key(self, frame: int) -> tuple:
        return (-math.inf, 0)
