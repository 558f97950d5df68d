"""``arc``: Adaptive Replacement Cache, the opt-in classic policy (ghost lists of block ids).

Follows the replacer interface and its invariants R1-R4 (kvdb/buffer_pool/replacer.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvdb.errors import InvalidInput
from kvdb.planner.policies.ordered import PinSetReplacer


class ArcReplacer(PinSetReplacer):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) over frames.

    T1 holds frames seen once recently, T2 frames seen at least twice; ghost lists B1 and B2
    remember the *block ids* of recent victims of each (frames are reused, ids are not). A hit
    on a B1 ghost grows the target size p of T1, a B2 ghost shrinks it. Victims come from T1
    while it is above p, else from T2. Pinned frames stay in their list but are skipped.
    Without ids (ids=None) ghosts are not tracked and ARC degrades to a T1/T2 split LRU.

    ARC's cache size c (the bound of p and of each ghost list) is ``capacity_frames``: the
    frames that stay resident. In the engine that is every frame (the default); the replay's
    pool has spare frames for one call in flight (capacity + the trace's longest call), and a
    c that counted them would let a later, longer call change earlier decisions (S4).
    """

    name = "arc"

    def __init__(self, num_frames: int, capacity_frames: int | None = None) -> None:
        super().__init__(num_frames)
        if capacity_frames is None:
            capacity_frames = num_frames
        if not 0 < capacity_frames <= num_frames:
            raise InvalidInput(f"ARC's capacity_frames must be in [1, {num_frames}], got {capacity_frames}")
        self.capacity_frames = capacity_frames
        self._t1: OrderedDict[int, Hashable] = OrderedDict()  # frame -> id; first = LRU end
        self._t2: OrderedDict[int, Hashable] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0.0

    def record_access(self, frames, ids=None, ctx=None) -> None:
        c = self.capacity_frames
        if ids is not None and len(ids) != len(frames):
            raise InvalidInput(f"record_access got {len(frames)} frames but {len(ids)} ids")
        self._check_frames(frames)
        for i in range(len(frames) - 1, -1, -1):  # deepest first (R3)
            f = frames[i]
            bid = ids[i] if ids is not None else None
            if f in self._t1:
                del self._t1[f]
                self._t2[f] = bid
            elif f in self._t2:
                self._t2.move_to_end(f)
            else:
                if bid is not None and bid in self._b1:
                    self._p = min(c, self._p + max(1.0, len(self._b2) / max(1, len(self._b1))))
                    del self._b1[bid]
                    self._t2[f] = bid
                elif bid is not None and bid in self._b2:
                    self._p = max(0.0, self._p - max(1.0, len(self._b1) / max(1, len(self._b2))))
                    del self._b2[bid]
                    self._t2[f] = bid
                else:
                    self._t1[f] = bid

    def _first_unpinned(self, lst: OrderedDict) -> int | None:
        for f in lst:
            if f not in self._pinned:
                return f
        return None

    def evict(self) -> int | None:
        from_t1 = len(self._t1) > 0 and (len(self._t1) > self._p or not self._t2)
        order = (self._t1, self._t2) if from_t1 else (self._t2, self._t1)
        for lst in order:
            f = self._first_unpinned(lst)
            if f is not None:
                bid = lst.pop(f)
                ghosts = self._b1 if lst is self._t1 else self._b2
                if bid is not None:
                    ghosts[bid] = None
                    while len(ghosts) > self.capacity_frames:
                        ghosts.popitem(last=False)
                return f
        return None

    def remove(self, frame: int) -> None:
        self._check(frame)
        self._t1.pop(frame, None)
        self._t2.pop(frame, None)
        self._pinned.discard(frame)

    def num_evictable(self) -> int:
        return sum(1 for f in self._t1 if f not in self._pinned) + sum(
            1 for f in self._t2 if f not in self._pinned
        )
