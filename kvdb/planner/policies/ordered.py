"""Bases of the policies that keep frames in ordered dicts: pins as a set, recency as a fallback.

``PinSetReplacer`` keeps pinned frames in their own lists and skips them when choosing a
victim; ``LruOrderedReplacer`` adds an ``_lru`` order of every known frame. ARC (arc.py),
kvflow and tokencake build on them. Interface and invariants R1-R4: kvdb/buffer_pool/replacer.py.
"""

from __future__ import annotations

from collections import OrderedDict

from kvdb.buffer_pool.replacer import Replacer


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
