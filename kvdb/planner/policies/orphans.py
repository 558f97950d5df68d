"""O1: how often an orphaned block is read again, learned online (kvdb.planner.policies.planned).

An *orphan* is a block an agent's new call left out of its last chain (a chain break: shared
context inserted before the agent's history changes every hash after it; a tool list that
changed), that no other agent's last chain holds and no other session read. Whether such a
block is ever read again depends on the workload (none is in ``kvdb gen``'s traces; an agent
that retries or backtracks goes back to them), so it is learned, not assumed:
P(read again) = (revived + 1) / (orphaned + 2), both counts halved once the orphans pass
``WINDOW`` (kvdb.planner.policies.rate). The planner scales an orphan's value by P, and below ``JUNK_P`` puts it at the
floor. A revival is an orphan read again while resident (the planner's per-frame flag) or after
its eviction (its id is kept here, in a FIFO of ``4 n + 64`` ids for n frames).
docs/planner.md, "Orphans".
"""

from __future__ import annotations

from collections.abc import Hashable

from kvdb.planner.policies.rate import Rate

WINDOW = 2048.0  # orphan and revival counts are halved when the orphans pass this (a memory of ~2-4k)
JUNK_P = 0.05  # below this P(an orphan is read again), an orphan is junk (at the floor)


class OrphanEstimator:
    """P(an orphaned block is read again), and the ids of evicted orphans."""

    def __init__(self, num_frames: int) -> None:
        self._rate = Rate(WINDOW)  # trials: orphans made; reads: orphans read again
        self._ids: dict[Hashable, None] = {}  # evicted orphans, oldest first
        self._cap = 4 * num_frames + 64

    def p(self) -> float:
        return self._rate.p()

    def made(self, k: int) -> None:
        """k more orphans."""
        self._rate.add(k, 0.0)

    def read_again(self) -> None:
        """A resident orphan was read again."""
        self._rate.add(0.0, 1.0)

    def evicted(self, bid: Hashable) -> None:
        ids = self._ids
        ids[bid] = None
        if len(ids) > self._cap:
            del ids[next(iter(ids))]

    def recalled(self, bid: Hashable) -> None:
        """A block read after its eviction: counted when it was an evicted orphan."""
        if self._ids and bid in self._ids:
            del self._ids[bid]
            self._rate.add(0.0, 1.0)

    def describe(self) -> dict[str, float]:
        return {"orphaned": self._rate.trials, "revived": self._rate.reads, "p_revive": self.p()}
