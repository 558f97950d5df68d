"""``lrfu``: Least Recently/Frequently Used (Lee et al., IEEE ToC 2001), over a lazy heap.

Each resident block has a Combined Recency and Frequency value summing every reference it
had since it entered, each weighted by F(x) = 2^(-x / half_life) for a reference x time units
ago. The victim is the block with the smallest CRF now. Half-life infinity is LFU; a half-life
below one unit is LRU (a single recent reference outweighs any history).

Time is counted in **requests**: one ``record_access`` call (one request's frames on this
tier) is one tick, and the frames of one request share its timestamp, so a 40-block prompt
ages the cache as much as a 1-block one. The default half-life is 1000 requests
(lambda = 1/1000 in the paper's terms), the value of the reference figures in
docs/planner.md "Classic baselines". Within one request, ties go to the deeper block (R3).

CRF values only shrink together, so the order is kept by a time-invariant key:
``log2(CRF(t)) + t / half_life`` does not change while no reference comes, and a reference at
t turns it into ``log2(1 + CRF(t)) + t / half_life``. One heap push per reference, O(log n)
(the paper's heap as well); the key stays a float of modest size (t / half_life).

A block keeps its CRF when it is evicted (the paper defines CRF over every past reference,
resident or not): the key of each evicted block id is remembered, and a block that comes back
continues from it. The history is bounded to ``history_factor`` x c ids (default 64, oldest
eviction forgotten first): a few KB per frame, against pages of many KB. Measured on the
conversation trace at 0.5 % capacity (docs/planner.md "Classic baselines"): block hit ratio
0.049 with no history, 0.071 / 0.081 / 0.083 with 2 / 8 / 32 x c. Without ids there is no
history. Interface and R1-R4: kvdb/buffer_pool/replacer.py; the heap:
kvdb/planner/policies/heap.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Hashable

from kvdb.errors import InvalidInput
from kvdb.planner.policies.heap import ABSENT, HeapReplacer

DEFAULT_HALF_LIFE_REQUESTS = 1000.0
DEFAULT_HISTORY_FACTOR = 64


class LrfuReplacer(HeapReplacer):
    name = "lrfu"

    def __init__(self, num_frames: int, half_life_requests: float = DEFAULT_HALF_LIFE_REQUESTS,
                 capacity_frames: int | None = None, history_factor: int = DEFAULT_HISTORY_FACTOR) -> None:
        super().__init__(num_frames)
        if not (isinstance(half_life_requests, (int, float)) and 0 < half_life_requests < math.inf):
            raise InvalidInput(f"lrfu's half_life_requests must be a positive number, got {half_life_requests!r}")
        if capacity_frames is None:
            capacity_frames = num_frames
        if not 0 < capacity_frames <= num_frames:
            raise InvalidInput(f"lrfu's capacity_frames must be in [1, {num_frames}], got {capacity_frames}")
        if isinstance(history_factor, bool) or not isinstance(history_factor, int) or history_factor < 0:
            raise InvalidInput(f"lrfu's history_factor must be an int >= 0, got {history_factor!r}")
        self.capacity_frames = capacity_frames
        self.history_limit = history_factor * capacity_frames
        self._history: OrderedDict[Hashable, float] = OrderedDict()  # evicted id -> its key's score
        self._id_of: list[Hashable | None] = [None] * num_frames
        self.half_life_requests = float(half_life_requests)
        self._lam = 1.0 / self.half_life_requests  # the paper's lambda, per request
        self._now = 0  # requests seen

    def record_access(self, frames, ids=None, ctx=None) -> None:
        for f in frames:
            if not 0 <= f < self.num_frames:
                self._check(f)
        self._now += 1
        lt = self._now * self._lam
        state, key = self._state, self._key
        log2, set_key = math.log2, self._set_key
        for j in range(len(frames) - 1, -1, -1):  # deepest first, so equal keys stay in R3 order
            f = frames[j]
            k = key[f]
            if state[f] == ABSENT or k is None:
                bid = ids[j] if ids is not None else None
                self._id_of[f] = bid
                old = self._history.pop(bid, None) if bid is not None else None
                # one reference now (log2(1) + t / half_life), plus what is left of its history
                s = lt if old is None else log2(1.0 + 2.0 ** (old - lt)) + lt
            else:
                s = log2(1.0 + 2.0 ** (k[0] - lt)) + lt
            set_key(f, (s, -j))

    def evict(self) -> int | None:
        got = self._pop_min()
        if got is None:
            return None
        f, key = got
        bid = self._id_of[f]
        if bid is not None and self.history_limit:
            self._history[bid] = key[0]
            self._history.move_to_end(bid)
            if len(self._history) > self.history_limit:
                self._history.popitem(last=False)
        self._id_of[f] = None
        self._drop(f)
        return f

    def remove(self, frame: int) -> None:
        self._check(frame)
        self._id_of[frame] = None
        super().remove(frame)

    def _default_key(self, frame: int) -> tuple:
        return (self._now * self._lam, 0)

    def debug_crf(self, frame: int) -> float | None:
        """The frame's CRF at the current time (tests only)."""
        k = self._key[frame]
        return None if k is None else 2.0 ** (k[0] - self._now * self._lam)
