"""``wtinylfu``: W-TinyLFU (Einziger, Friedman & Manes, ACM ToS 2017): a small LRU window in
front of a segmented-LRU main cache guarded by a TinyLFU admission filter.

  window      LRU, 1 % of the cache (the paper's default): every new block enters here;
  probation   the main cache's first segment (20 % of the main cache), LRU;
  protected   its second (80 %), LRU: a hit in probation promotes there, and protected's
              least recent block is demoted back to probation's recent end when it overflows;
  sketch      a frequency sketch of every reference (kvdb/planner/policies/sketch.py:
              count-min, doorkeeper, halving every 10 x c references).

To evict: while the window is above its share and the main cache below its own, the window's
least recent block simply moves to probation. Then the window's least recent block (the
candidate) duels with the main cache's victim (probation's least recent, else protected's):
the candidate is admitted only if the sketch says it is strictly more frequent; the loser is
evicted. A one-hit wonder therefore never displaces a block seen twice. With the window below
its share (after removes) the main cache's victim goes without a duel.

Every step is O(1) amortized (moves into an under-full main cache happen once per block).
Pinned frames are passed over. Without ids the sketch counts frames. Interface and R1-R4:
kvdb/buffer_pool/replacer.py; the base: kvdb/planner/policies/resident.py.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from kvdb.planner.policies.resident import ResidentReplacer, share
from kvdb.planner.policies.sketch import FrequencySketch, stable_hash

WINDOW_SHARE = 0.01
PROTECTED_SHARE = 0.80  # of the main cache
_WINDOW, _PROBATION, _PROTECTED = 1, 2, 3


class WTinyLfuReplacer(ResidentReplacer):
    name = "wtinylfu"

    def __init__(self, num_frames: int, capacity_frames: int | None = None) -> None:
        super().__init__(num_frames, capacity_frames)
        c = self.capacity_frames
        self.window_frames = share(c, WINDOW_SHARE)
        self.main_frames = c - self.window_frames
        self.protected_frames = int(self.main_frames * PROTECTED_SHARE)
        self.sketch = FrequencySketch(c)
        self._window: OrderedDict[int, None] = OrderedDict()  # first = least recent
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._where = bytearray(num_frames)
        self._hash = array("Q", [0]) * num_frames  # each known frame's block, hashed once

    def _admit(self, f, bid) -> None:
        # without an id the frame is counted (negative: never one of the replay's ids)
        h = self._hash[f] = stable_hash(-1 - f if bid is None else bid)
        self.sketch.add(h)
        self._window[f] = None
        self._where[f] = _WINDOW

    def _hit(self, f) -> None:
        self.sketch.add(self._hash[f])
        w = self._where[f]
        if w == _WINDOW:
            self._window.move_to_end(f)
        elif w == _PROTECTED:
            self._protected.move_to_end(f)
        else:
            del self._probation[f]
            self._protected[f] = None
            self._where[f] = _PROTECTED
            if len(self._protected) > self.protected_frames:
                g, _ = self._protected.popitem(last=False)
                self._probation[g] = None
                self._where[g] = _PROBATION

    def _victim(self) -> int | None:
        window, probation = self._window, self._probation
        while len(window) > self.window_frames and len(probation) + len(self._protected) < self.main_frames:
            g = self._first_unpinned(window)
            if g is None:
                break
            del window[g]
            probation[g] = None
            self._where[g] = _PROBATION
        cand = self._first_unpinned(window) if len(window) >= self.window_frames else None
        victim = self._first_unpinned(probation)
        if victim is None:
            victim = self._first_unpinned(self._protected)
        if cand is None:
            if victim is None:
                cand = self._first_unpinned(window)
                return None if cand is None else self._drop(cand)
            return self._drop(victim)
        if victim is None:
            return self._drop(cand)
        if self.sketch.estimate(self._hash[cand]) > self.sketch.estimate(self._hash[victim]):
            self._drop(victim)
            del window[cand]
            probation[cand] = None
            self._where[cand] = _PROBATION
            return victim
        return self._drop(cand)

    def _drop(self, f: int) -> int:
        w = self._where[f]
        if w == _WINDOW:
            del self._window[f]
        elif w == _PROBATION:
            del self._probation[f]
        elif w == _PROTECTED:
            del self._protected[f]
        self._where[f] = 0
        return f

    def _forget(self, f) -> None:
        self._drop(f)

    def debug_segments(self) -> tuple[list[int], list[int], list[int]]:
        """(window, probation, protected), each least recent first (tests only)."""
        return list(self._window), list(self._probation), list(self._protected)
