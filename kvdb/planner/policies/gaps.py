"""Next-call estimator for agents of sessions without a declared workflow.

A session's calls name their agent, but without a workflow nothing says when an agent that
called without a tool-wait hint calls next (a worker between rounds, a coordinator after
fan-in). The kvdb policy learns it online from the sessions' own past: each such call opens
a *pending prediction* -- a context and a base time (the call's time, or, while siblings of
its session wait on tools, the end of their last wait + one LLM call) -- and the agent's
next call closes it with the observed residual ``next call - base``. The estimate for a
context is the median of its residuals (quarter-octave bins, halved every ``DECAY_AT``
observations, so it follows a drifting workload).

Contexts go from specific to general; the first one with ``MIN_OBS`` observations answers:

* ``(kind, agent, gap bin)``: kind is ``fan-in`` or ``free`` (no sibling waits), the agent
  id (a coordinator and its workers keep different rhythms), and the octave of the time
  since the agent's previous call (a coordinator's plan follows its aggregation within one
  LLM call; its aggregation follows the plan after the whole fan-out);
* ``(kind, agent)``, then ``(kind,)``.

Deterministic; reads only the past (a residual is observed when the next call is seen).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

BINS_PER_OCTAVE = 4
SMALLEST_S = 0.25  # residuals below this share bin 0
BINS = 22 * BINS_PER_OCTAVE  # up to ~12 days
MIN_OBS = 4  # observations before a context answers
DECAY_AT = 64.0
GAP_OCTAVES_PER_BIN = 2


def gap_bin(gap_s: float | None) -> int:
    """Octave of the time since an agent's previous call (-1: first call)."""
    if gap_s is None:
        return -1
    return 0 if gap_s < 1.0 else 1 + int(math.log2(gap_s)) // GAP_OCTAVES_PER_BIN


class GapEstimator:
    """Online medians of an agent's time to its next call, by context with fallback."""

    def __init__(self) -> None:
        self._hist: dict[Hashable, list[float]] = {}
        self._sum: dict[Hashable, list[float]] = {}  # per bin: sum of its residuals (its mean answers)
        self._total: dict[Hashable, float] = {}
        self._median: dict[Hashable, float] = {}
        self._missed: dict[Hashable, float] = {}  # estimates the session ended before closing

    @staticmethod
    def _bin(value_s: float) -> int:
        if value_s < SMALLEST_S:
            return 0
        return min(BINS - 1, 1 + int(BINS_PER_OCTAVE * math.log2(value_s / SMALLEST_S)))

    def observe(self, contexts: tuple[Hashable, ...], residual_s: float) -> None:
        b = self._bin(residual_s)
        for c in contexts:
            h = self._hist.get(c)
            if h is None:
                h = self._hist[c] = [0.0] * BINS
                self._sum[c] = [0.0] * BINS
                self._total[c] = 0.0
            sums = self._sum[c]
            h[b] += 1.0
            sums[b] += max(0.0, residual_s)
            total = self._total[c] + 1.0
            if total + self._missed.get(c, 0.0) >= DECAY_AT:
                for i in range(BINS):
                    h[i] *= 0.5
                    sums[i] *= 0.5
                total *= 0.5
                self._missed[c] = self._missed.get(c, 0.0) * 0.5
            self._total[c] = total
            if total >= MIN_OBS:
                acc = 0.0
                for i, n in enumerate(h):
                    acc += n
                    if acc >= total / 2:
                        self._median[c] = sums[i] / n  # the mean of the median's bin
                        break

    def missed(self, contexts: tuple[Hashable, ...]) -> None:
        """The session ended before the agent called again: the estimate was a false alarm."""
        for c in contexts:
            self._missed[c] = self._missed.get(c, 0.0) + 1.0

    def p_next(self, contexts: tuple[Hashable, ...]) -> float:
        """P(the agent calls again in its session) of the most specific context with enough
        outcomes (both kinds, one pseudo-observation each); 1 before anything is known."""
        for c in contexts:
            won = self._total.get(c, 0.0)
            lost = self._missed.get(c, 0.0)
            if won + lost >= MIN_OBS:
                return (won + 1.0) / (won + lost + 2.0)
        return 1.0

    def predict(self, contexts: tuple[Hashable, ...]) -> float | None:
        """Median residual of the most specific context with enough observations, else None."""
        for c in contexts:
            m = self._median.get(c)
            if m is not None:
                return m
        return None
