"""Reuse estimator for blocks nobody planned: how much one more access of a block is worth.

On traces without sessions or hints (the Mooncake traces) the only signals are the access
history of each block and the clock. Measured on both shared traces, the number of times a
block has been seen predicts whether it is seen again (conversation: P(reuse) 0.26 after one
access, 0.42 after two, 0.58 after four, 0.84 after five or more; synthetic: 0.45, then
0.73-0.85), while the time to that reuse barely depends on the count (median ~450-570 calls
for every class). Three things follow:

* the count must outlive residency: a block comes back after hundreds of calls, long after a
  small cache dropped it, so counts (and the time of the last access) are kept for evicted
  blocks in a history of ``HISTORY_MULT * num_frames`` ids, at most ``HISTORY_MAX`` (FIFO;
  a ghost table of one cache's worth forgets most blocks before they return);
* how much more a frequent block is worth depends on the cache's size relative to the reuse
  gap. GreedyDual keeps a block about ``v / (rate of rise of L)``; if the cache's
  characteristic time ``Tc`` (age of its victims) is far below the typical reuse gap, keeping
  every class a little is wasted (hits come only after the gap): the cache should hold the
  best class long and admit the rest barely (TinyLFU-like admission). If ``Tc`` is near the
  gap, the classes should share the space in proportion. Hence the value of a block with n
  accesses is ``min(n, cap) ** alpha`` with ``alpha = 1 + clamp(r - 1.5, 0, 2)``,
  ``r = median observed reuse gap / Tc``, re-estimated every ``EPOCH`` observed reuses.

* a block seen once is worth ``P(seen again | class) / P(seen again)`` (1 before anything is
  learned), its class the length of the call that brought it in quarter octaves (synthetic:
  0.23 for 30-40-block calls, 0.76 for 70-80). Outcomes are learned as they happen: a second
  access (resident or recalled from the history) is a success, falling out of the history
  unseen a failure; each class's rate is shrunk to the overall one by ``PRIOR``
  pseudo-observations, and the counts halve every epoch. A history that never overflows
  judges no failure, and every class then weighs 1.

The reuse gap is observed from the past only: when a block (resident or in the history) is
accessed again, the time since its previous access goes into a histogram of quarter-octave
bins that halves at each epoch. Deterministic: no randomness, no hashing of ids beyond dict
lookups.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable

HISTORY_MULT = 32  # history ids kept per frame of the tier
HISTORY_MAX = 1 << 18  # ... and at most this many (~280 B an id: ~75 MB for a large pool)
EPOCH = 4096  # observed reuses between re-estimates of alpha
ALPHA_MAX = 3.0
GAP_RATIO_KNEE = 1.5  # below this gap / Tc ratio the counts are weighed linearly
BINS_PER_OCTAVE = 4
BINS = 40 * BINS_PER_OCTAVE
LEN_CLASSES = 12 * BINS_PER_OCTAVE
PRIOR = 20.0  # pseudo-observations at the overall rate in each class's estimate


class ReuseEstimator:
    """Access counts that survive eviction, and the exponent that turns them into value."""

    def __init__(self, num_frames: int, history_mult: int = HISTORY_MULT) -> None:
        self.capacity = max(1, min(HISTORY_MAX, history_mult * num_frames))
        self._hist: OrderedDict[Hashable, tuple] = OrderedDict()  # id -> (accesses, last s, class, crf, tick)
        self.recalled: tuple[float, int] | None = None  # (crf, tick) of the last recall that found its id
        self._won = [0.0] * LEN_CLASSES  # first-seen blocks of each class seen again
        self._lost = [0.0] * LEN_CLASSES  # ... and forgotten without a second access
        self._mult = [1.0] * LEN_CLASSES
        self._gaps = [0.0] * BINS
        self._observed = 0
        self.alpha = 1.0
        self.median_gap_s: float | None = None

    def recall(self, bid: Hashable, now: float) -> int:
        """Accesses of ``bid`` before this one (0 if unknown); forgets it (it is resident now)."""
        got = self._hist.pop(bid, None)
        if got is None:
            self.recalled = None
            return 0
        self.recalled = (got[3], got[4])
        self.observe_gap(now - got[1])
        if got[2] >= 0:
            self._won[got[2]] += 1.0
        return got[0]

    @staticmethod
    def klass(call_blocks: int) -> int:
        """Class of a first-seen block: the length of the call that brought it, in quarter octaves."""
        return min(LEN_CLASSES - 1, int(BINS_PER_OCTAVE * math.log2(call_blocks))) if call_blocks > 1 else 0

    def seen_again(self, klass: int) -> None:
        """A resident first-seen block of ``klass`` was accessed a second time."""
        self._won[klass] += 1.0

    def first_value(self, klass: int) -> float:
        """Value of a block on its first access: P(seen again | class) / P(seen again)."""
        return self._mult[klass]

    def remember(self, bid: Hashable, accesses: int, last_s: float, klass: int = -1,
                 crf: float = 0.0, tick: int = 0) -> None:
        """``bid`` left the tier after ``accesses`` accesses, the last at ``last_s``; ``klass``
        is its first-access class while it has been accessed only once, else -1; ``crf`` and
        ``tick``: its combined recency-frequency at its last access and that access's tick."""
        h = self._hist
        h.pop(bid, None)
        h[bid] = (accesses, last_s, klass, crf, tick)
        if len(h) > self.capacity:  # OrderedDict: a plain dict's next(iter()) slows as its head empties
            k = h.popitem(last=False)[1][2]
            if k >= 0:
                self._lost[k] += 1.0

    def observe_gap(self, gap_s: float) -> None:
        i = int(BINS_PER_OCTAVE * math.log2(gap_s)) + 1 if gap_s >= 1 else 0
        self._gaps[min(i, BINS - 1)] += 1.0
        self._observed += 1

    def epoch_due(self) -> bool:
        return self._observed >= EPOCH

    def update(self, tc: float) -> None:
        """Re-estimate the median reuse gap and alpha against the cache's characteristic time."""
        self._observed = 0
        self.median_gap_s = _median(self._gaps, self.median_gap_s)
        self._gaps = [c * 0.5 for c in self._gaps]
        won, lost = self._won, self._lost
        tw, tl = sum(won), sum(lost)
        if tw + tl > 0:
            p = tw / (tw + tl)
            for k in range(LEN_CLASSES):
                pk = (won[k] + PRIOR * p) / (won[k] + lost[k] + PRIOR)
                self._mult[k] = pk / p if p > 0 else 1.0
                won[k] *= 0.5
                lost[k] *= 0.5
        if self.median_gap_s is not None and tc != math.inf and tc > 0:
            r = self.median_gap_s / tc
            self.alpha = 1.0 + max(0.0, min(ALPHA_MAX - 1.0, r - GAP_RATIO_KNEE))

    def value(self, accesses: int, cap: int) -> float:
        n = min(accesses, cap)
        return float(n) if self.alpha == 1.0 else n ** self.alpha

    def __len__(self) -> int:
        return len(self._hist)


def _median(bins: list[float], old: float | None) -> float | None:
    """The median of a quarter-octave histogram (bin middle); ``old`` when it is empty."""
    total = sum(bins)
    if total <= 0:
        return old
    acc = 0.0
    for i, c in enumerate(bins):
        acc += c
        if acc >= total / 2:
            return 2.0 ** ((i - 0.5) / BINS_PER_OCTAVE) if i else 0.5
    return old
