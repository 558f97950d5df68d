"""Reuse estimator for blocks nobody planned: how much one more access of a block is worth.

On traces without sessions or hints (the Mooncake traces) the only signals are the access
history of each block and the clock. Measured on both shared traces, the number of times a
block has been seen predicts whether it is seen again (conversation: P(reuse) 0.26 after one
access, 0.42 after two, 0.58 after four, 0.84 after five or more; synthetic: 0.45, then
0.73-0.85), while the time to that reuse barely depends on the count (median ~450-570 calls
for every class). Two things follow:

* the count must outlive residency: a block comes back after hundreds of calls, long after a
  small cache dropped it, so counts (and the time of the last access) are kept for evicted
  blocks in a history of ``HISTORY_MULT * num_frames`` ids (FIFO; a ghost table of one
  cache's worth forgets most blocks before they return);
* how much more a frequent block is worth depends on the cache's size relative to the reuse
  gap. GreedyDual keeps a block about ``v / (rate of rise of L)``; if the cache's
  characteristic time ``Tc`` (age of its victims) is far below the typical reuse gap, keeping
  every class a little is wasted (hits come only after the gap): the cache should hold the
  best class long and admit the rest barely (TinyLFU-like admission). If ``Tc`` is near the
  gap, the classes should share the space in proportion. Hence the value of a block with n
  accesses is ``min(n, cap) ** alpha`` with ``alpha = 1 + clamp(r - 1.5, 0, 2)``,
  ``r = median observed reuse gap / Tc``, re-estimated every ``EPOCH`` observed reuses.

The reuse gap is observed from the past only: when a block (resident or in the history) is
accessed again, the time since its previous access goes into a histogram of quarter-octave bins that halves at
each epoch. Deterministic: no randomness, no hashing of ids beyond dict lookups.
"""

from __future__ import annotations

import math
from typing import Hashable

HISTORY_MULT = 32  # history ids kept per frame of the tier
EPOCH = 4096  # observed reuses between re-estimates of alpha
ALPHA_MAX = 3.0
GAP_RATIO_KNEE = 1.5  # below this gap / Tc ratio the counts are weighed linearly
BINS_PER_OCTAVE = 4
BINS = 40 * BINS_PER_OCTAVE


class ReuseEstimator:
    """Access counts that survive eviction, and the exponent that turns them into value."""

    def __init__(self, num_frames: int, history_mult: int = HISTORY_MULT) -> None:
        self.capacity = max(1, history_mult * num_frames)
        self._hist: dict[Hashable, tuple[int, float]] = {}  # id -> (accesses, last access s)
        self._gaps = [0.0] * BINS
        self._observed = 0
        self.alpha = 1.0
        self.median_gap_s: float | None = None

    def recall(self, bid: Hashable, now: float) -> int:
        """Accesses of ``bid`` before this one (0 if unknown); forgets it (it is resident now)."""
        got = self._hist.pop(bid, None)
        if got is None:
            return 0
        self.observe_gap(now - got[1])
        return got[0]

    def remember(self, bid: Hashable, accesses: int, last_s: float) -> None:
        """``bid`` left the tier after ``accesses`` accesses, the last at ``last_s``."""
        h = self._hist
        h.pop(bid, None)
        h[bid] = (accesses, last_s)
        if len(h) > self.capacity:
            del h[next(iter(h))]

    def observe_gap(self, gap_s: float) -> None:
        i = int(BINS_PER_OCTAVE * math.log2(gap_s)) + 1 if gap_s >= 1 else 0
        self._gaps[min(i, BINS - 1)] += 1.0
        self._observed += 1

    def epoch_due(self) -> bool:
        return self._observed >= EPOCH

    def update(self, tc: float) -> None:
        """Re-estimate the median reuse gap and alpha against the cache's characteristic time."""
        self._observed = 0
        gaps = self._gaps
        total = sum(gaps)
        acc = 0.0
        for i, c in enumerate(gaps):
            acc += c
            if acc >= total / 2:
                self.median_gap_s = 2.0 ** ((i - 0.5) / BINS_PER_OCTAVE) if i else 0.5  # bin middle
                break
        self._gaps = [c * 0.5 for c in gaps]
        if self.median_gap_s is not None and tc != math.inf and tc > 0:
            r = self.median_gap_s / tc
            self.alpha = 1.0 + max(0.0, min(ALPHA_MAX - 1.0, r - GAP_RATIO_KNEE))

    def value(self, accesses: int, cap: int) -> float:
        n = min(accesses, cap)
        return float(n) if self.alpha == 1.0 else n ** self.alpha

    def __len__(self) -> int:
        return len(self._hist)
