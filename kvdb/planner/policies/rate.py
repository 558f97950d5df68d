"""A learned rate with a uniform prior: P = (reads + 1) / (trials + 2), both counts halved once
the trials pass a window, so that the rate follows a workload that changes. O1's orphans
(kvdb.planner.policies.orphans) and N1 / N2's newcomers (kvdb.planner.policies.newcomers) learn
theirs with it."""

from __future__ import annotations


class Rate:
    """(reads + 1) / (trials + 2), halved past ``window`` trials."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.trials = 0.0
        self.reads = 0.0

    def add(self, trials: float, reads: float) -> None:
        self.trials += trials
        self.reads += reads
        if self.trials > self.window:
            self.trials *= 0.5
            self.reads *= 0.5

    def p(self) -> float:
        return (self.reads + 1.0) / (self.trials + 2.0)
