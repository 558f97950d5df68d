"""Base of the classic ghost-list policies (lirs, s3fifo, sieve, 2q, wtinylfu): resident frames,
the block id each one holds, pins and the evictable count.

A subclass keeps its own queues of *frames* (resident blocks) and, where its paper has them, of
*block ids* (ghosts of evicted blocks: frames are reused, ids are not). The base turns the
replacer interface (kvdb/buffer_pool/replacer.py, invariants R1-R4) into four hooks:

  ``_admit(f, bid)``  a frame it did not know was accessed (``bid`` None when the caller gave
                      no ids: such a block leaves no ghost);
  ``_hit(f)``         a known frame was accessed again;
  ``_victim()``       choose an unpinned known frame, drop it from the subclass's queues (leaving
                      a ghost if the policy keeps them) and return it, or None;
  ``_forget(f)``      drop a known frame without a ghost (``remove``: the pool deleted it).

Within one ``record_access`` frames are handed over deepest first, so when nothing else tells
them apart the shallowest ends most recent and the deepest goes first (R3). Pins are a set
(pinned frames stay in their queues and ``_victim`` skips them, as ARC does); a frame may be
pinned before it is first accessed. The evictable count is kept, not computed, so
``num_evictable`` is O(1) (R4).

``capacity_frames`` is the cache size c the papers size their queues by: every frame in the
engine; in the replay the resident capacity, not the pool, which has spare frames for one call
in flight (kvdb/sim/replay.py S4).
"""

from __future__ import annotations

from typing import Hashable

from kvdb.buffer_pool.replacer import Replacer
from kvdb.errors import InvalidInput


class ResidentReplacer(Replacer):
    name = "resident"

    def __init__(self, num_frames: int, capacity_frames: int | None = None) -> None:
        super().__init__(num_frames)
        if capacity_frames is None:
            capacity_frames = num_frames
        if isinstance(capacity_frames, bool) or not 0 < capacity_frames <= num_frames:
            raise InvalidInput(f"{self.name}'s capacity_frames must be in [1, {num_frames}], got {capacity_frames}")
        self.capacity_frames = capacity_frames
        self._known = bytearray(num_frames)  # 1 while the frame holds a block the policy tracks
        self._id_of: list[Hashable | None] = [None] * num_frames  # the block id in each known frame
        self._pinned: set[int] = set()  # may hold frames not (yet) known
        self._count = 0  # known and evictable (R4)

    # -- hooks ----------------------------------------------------------------------------
    def _begin(self, ctx) -> None:
        """A request starts (LRFU-style clocks); nothing by default."""

    def _admit(self, f: int, bid: Hashable | None) -> None:
        raise NotImplementedError

    def _hit(self, f: int) -> None:
        raise NotImplementedError

    def _victim(self) -> int | None:
        raise NotImplementedError

    def _forget(self, f: int) -> None:
        raise NotImplementedError

    # -- Replacer -------------------------------------------------------------------------
    def record_access(self, frames, ids=None, ctx=None) -> None:
        if ids is not None and len(ids) != len(frames):
            raise InvalidInput(f"record_access got {len(frames)} frames but {len(ids)} ids")
        self._check_frames(frames)  # all first: a bad frame leaves no trace
        self._begin(ctx)
        known, pinned = self._known, self._pinned
        for i in range(len(frames) - 1, -1, -1):  # deepest first (R3)
            f = frames[i]
            if known[f]:
                self._hit(f)
                continue
            known[f] = 1
            if f not in pinned:
                self._count += 1
            bid = ids[i] if ids is not None else None
            self._id_of[f] = bid
            self._admit(f, bid)

    def set_evictable(self, frame: int, evictable: bool) -> None:
        self._check(frame)
        if evictable:
            if frame in self._pinned:
                self._pinned.discard(frame)
                if self._known[frame]:
                    self._count += 1
        elif frame not in self._pinned:
            self._pinned.add(frame)
            if self._known[frame]:
                self._count -= 1

    def evict(self) -> int | None:
        if self._count == 0:
            return None
        f = self._victim()
        if f is None:
            return None
        self._known[f] = 0
        self._id_of[f] = None
        self._count -= 1
        return f

    def remove(self, frame: int) -> None:
        self._check(frame)
        if self._known[frame]:
            self._forget(frame)
            self._known[frame] = 0
            self._id_of[frame] = None
            if frame not in self._pinned:
                self._count -= 1
        self._pinned.discard(frame)

    def num_evictable(self) -> int:
        return self._count

    # -- helpers for subclasses -------------------------------------------------------------
    def _first_unpinned(self, frames) -> int | None:
        """The first frame of an ordered collection that is not pinned (pins are rare: the
        loop passes only the pinned frames at the old end)."""
        pinned = self._pinned
        if not pinned:
            return next(iter(frames), None)
        for f in frames:
            if f not in pinned:
                return f
        return None


def share(capacity_frames: int, fraction: float) -> int:
    """``fraction`` of the cache size, at least one frame (a queue sized 0 never holds anything)."""
    return max(1, int(capacity_frames * fraction))
