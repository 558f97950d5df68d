"""Least frequently used: evict the frame with the fewest accesses since it entered.

Key = (accesses, last access tick, -depth): ties go to the least recent, then to the deeper
block (R3). Counts start again at 1 when a block comes back after eviction (plain LFU, no
ghosts), which is what makes LFU slow to forget a once-hot prefix.
"""

from __future__ import annotations

from array import array

from kvdb.planner.policies.heap import ABSENT, HeapReplacer


class LfuReplacer(HeapReplacer):
    name = "lfu"

    def __init__(self, num_frames: int) -> None:
        super().__init__(num_frames)
        self._hits = array("q", [0]) * num_frames
        self._tick = 0

    def record_access(self, frames, ids=None, ctx=None) -> None:
        self._check_frames(frames)
        self._tick += 1
        t = self._tick
        hits, state = self._hits, self._state
        for j, f in enumerate(frames):
            n = 1 if state[f] == ABSENT else hits[f] + 1
            hits[f] = n
            self._set_key(f, (n, t, -j))

    def _default_key(self, frame: int) -> tuple:
        self._tick += 1
        self._hits[frame] = 1
        return (1, self._tick, 0)
