"""The replacer interface and the two classic policies every tier can use: LRU and ARC.

A replacer picks eviction victims among the *evictable* frames of one tier (frames are ints in
``[0, num_frames)``). The pool (and the simulator, kvdb/sim/, which drives the very same
objects) reports every request's frames through ``record_access``; pinned frames are made
non-evictable with ``set_evictable(frame, False)`` and are never returned by ``evict``.

Invariants (tests cite them):
  R1  evict() never returns a non-evictable frame, nor a frame it was not told about.
  R2  after evict() or remove(f), f is unknown to the replacer until it is accessed again.
  R3  among the frames of one record_access call, deeper frames (later in the list) are
      evicted before shallower ones when nothing else tells them apart.
  R4  num_evictable() equals the number of known, evictable frames.

Frames enter with ``record_access`` (evictable by default). Block ids (``ids``) are opaque,
hashable identities of the blocks in those frames (BlockKey in the engine, hash id in the
simulator); policies with ghost lists (ARC) use them, others ignore them. ``ctx`` carries what
the planner knows about the request (kvdb/planner/); policies that do not plan ignore it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from kvdb.errors import InvalidInput


@dataclass
class AccessContext:
    """What a request tells the replacer beyond its frames. All fields optional."""

    now_s: float = 0.0
    session_id: str | None = None
    tenant: str | None = None
    positions: Sequence[int] | None = None  # block depth of each frame in the chain
    hints: dict[str, Any] = field(default_factory=dict)


class Replacer(ABC):
    name = "abstract"

    def __init__(self, num_frames: int) -> None:
        if num_frames <= 0:
            raise InvalidInput(f"a replacer needs at least one frame, got {num_frames}")
        self.num_frames = num_frames

    @abstractmethod
    def record_access(
        self, frames: Sequence[int], ids: Sequence[Hashable] | None = None, ctx: AccessContext | None = None
    ) -> None:
        """One request touched these frames, in chain order (index 0 = shallowest)."""

    @abstractmethod
    def set_evictable(self, frame: int, evictable: bool) -> None: ...

    @abstractmethod
    def evict(self) -> int | None:
        """Remove and return a victim frame; None when no frame is evictable (an outcome)."""

    @abstractmethod
    def remove(self, frame: int) -> None:
        """Forget a frame the pool freed itself (delete); no-op for unknown frames.

        Every method raises InvalidInput for a frame outside ``[0, num_frames)``."""

    @abstractmethod
    def num_evictable(self) -> int: ...

    def on_event(self, event: Any) -> None:
        """Workflow / session events from the planner; classic policies ignore them."""

    def _check(self, frame: int) -> None:
        if not 0 <= frame < self.num_frames:
            raise InvalidInput(f"frame {frame} outside [0, {self.num_frames})")


_NIL = -1


class LruReplacer(Replacer):
    """Least recently used, as an intrusive doubly linked list over two int32 arrays.

    Memory is 9 bytes per frame (prev, next, state), not a Python object per page: a pool
    with a million resident pages spends 9 MB here. Head = most recent, tail = victim end.
    Only evictable frames are on the list; a pinned frame leaves the list and re-enters at
    the head when unpinned.
    """

    name = "lru"
    _ABSENT, _LISTED, _PINNED = 0, 1, 2

    def __init__(self, num_frames: int) -> None:
        super().__init__(num_frames)
        self._prev = array("i", [_NIL]) * num_frames
        self._next = array("i", [_NIL]) * num_frames
        self._state = bytearray(num_frames)
        self._head = _NIL
        self._tail = _NIL
        self._count = 0

    def _unlink(self, f: int) -> None:
        p, n = self._prev[f], self._next[f]
        if p == _NIL:
            self._head = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail = p
        else:
            self._prev[n] = p
        self._count -= 1

    def _push_head(self, f: int) -> None:
        self._prev[f] = _NIL
        self._next[f] = self._head
        if self._head != _NIL:
            self._prev[self._head] = f
        self._head = f
        if self._tail == _NIL:
            self._tail = f
        self._count += 1

    def record_access(self, frames, ids=None, ctx=None) -> None:
        # deepest first, so the shallowest ends most recent (R3)
        state = self._state
        n = self.num_frames
        for i in range(len(frames) - 1, -1, -1):
            f = frames[i]
            if not 0 <= f < n:  # before indexing: state[-1] would be the last frame's
                self._check(f)
            s = state[f]
            if s == self._LISTED:
                self._unlink(f)
                self._push_head(f)
            elif s == self._ABSENT:
                state[f] = self._LISTED
                self._push_head(f)

    def set_evictable(self, frame: int, evictable: bool) -> None:
        self._check(frame)
        s = self._state[frame]
        if evictable and s == self._PINNED:
            self._state[frame] = self._LISTED
            self._push_head(frame)
        elif not evictable and s == self._LISTED:
            self._unlink(frame)
            self._state[frame] = self._PINNED
        elif not evictable and s == self._ABSENT:
            self._state[frame] = self._PINNED

    def evict(self) -> int | None:
        f = self._tail
        if f == _NIL:
            return None
        self._unlink(f)
        self._state[f] = self._ABSENT
        return f

    def remove(self, frame: int) -> None:
        self._check(frame)
        if self._state[frame] == self._LISTED:
            self._unlink(frame)
        self._state[frame] = self._ABSENT

    def num_evictable(self) -> int:
        return self._count

    def debug_order(self) -> list[int]:
        """Evictable frames from next victim to most recent (tests only)."""
        out, f = [], self._tail
        while f != _NIL:
            out.append(f)
            f = self._prev[f]
        return out


class PinSetReplacer(Replacer):
    """Base of policies that keep pinned frames in their own lists and skip them when they
    choose a victim: the pins are a set."""

    def __init__(self, num_frames: int) -> None:
        super().__init__(num_frames)
        self._pinned: set[int] = set()

    def set_evictable(self, frame: int, evictable: bool) -> None:
        self._check(frame)
        if evictable:
            self._pinned.discard(frame)
        else:
            self._pinned.add(frame)


class LruOrderedReplacer(PinSetReplacer):
    """Base of policies that fall back to recency: ``_lru`` holds every known frame, least
    recent first. Subclasses keep their own groupings and extend ``_take`` to drop a frame
    from them too."""

    def __init__(self, num_frames: int) -> None:
        super().__init__(num_frames)
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = least recent

    def _take(self, f: int) -> int:
        del self._lru[f]
        return f

    def _evict_lru(self) -> int | None:
        for f in self._lru:
            if f not in self._pinned:
                return self._take(f)
        return None

    def remove(self, frame: int) -> None:
        self._check(frame)
        self._pinned.discard(frame)
        if frame in self._lru:
            self._take(frame)

    def num_evictable(self) -> int:
        return sum(1 for f in self._lru if f not in self._pinned)


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
        for i in range(len(frames) - 1, -1, -1):  # deepest first (R3)
            f = frames[i]
            bid = ids[i] if ids is not None else None
            if f in self._t1:
                del self._t1[f]
                self._t2[f] = bid
            elif f in self._t2:
                self._t2.move_to_end(f)
            else:
                self._check(f)
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


REPLACERS: dict[str, type[Replacer]] = {"lru": LruReplacer, "arc": ArcReplacer}


def make_replacer(name: str, num_frames: int) -> Replacer:
    try:
        cls = REPLACERS[name]
    except KeyError:
        raise InvalidInput(f"unknown replacer {name!r}; one of {sorted(REPLACERS)}") from None
    return cls(num_frames)
