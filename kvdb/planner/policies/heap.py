"""A replacer that evicts the frame with the smallest key, over a lazy binary heap.

Subclasses compute a key per frame in ``record_access`` and call ``_set_key``. A key is a
tuple; the heap holds ``key + (version, frame)`` and an entry is live only while its version
equals the frame's current version (every ``_set_key``/evict/remove bumps it), so an update
is one push, O(log n), and stale entries are dropped when they surface. When stale entries
outnumber live ones 3 to 1 the heap is rebuilt, keeping memory O(frames).

Pinned frames (``set_evictable(f, False)``) keep their key; ``evict`` sets aside pinned
entries it meets and pushes them back afterwards (R1).
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any

from kvdb.buffer_pool.replacer import Replacer

ABSENT, LISTED, PINNED = 0, 1, 2


class HeapReplacer(Replacer):
    name = "heap"

    def __init__(self, num_frames: int) -> None:
        super().__init__(num_frames)
        self._state = bytearray(num_frames)
        self._ver = array("q", [0]) * num_frames
        self._key: list[tuple | None] = [None] * num_frames
        self._heap: list[tuple] = []
        self._count = 0  # known and evictable (R4)

    # -- subclass API -------------------------------------------------------------------
    def _set_key(self, f: int, key: tuple) -> None:
        s = self._state[f]
        if s == ABSENT:
            self._check(f)
            self._state[f] = LISTED
            self._count += 1
        v = self._ver[f] + 1
        self._ver[f] = v
        self._key[f] = key
        heapq.heappush(self._heap, key + (v, f))
        if len(self._heap) > 4 * self.num_frames + 64:
            self._compact()

    def _on_evicted(self, f: int) -> None:
        """Called after f left the replacer through evict() or remove()."""

    def _pop_min(self) -> tuple[int, tuple] | None:
        heap, ver, state = self._heap, self._ver, self._state
        stash: list[tuple] = []
        found = None
        while heap:
            e = heapq.heappop(heap)
            f = e[-1]
            if ver[f] != e[-2] or state[f] == ABSENT:
                continue
            if state[f] == PINNED:
                stash.append(e)
                continue
            found = (f, self._key[f])
            break
        for e in stash:
            heapq.heappush(heap, e)
        return found

    def _peek_min(self) -> tuple[int, tuple] | None:
        got = self._pop_min()
        if got is not None:
            f, key = got
            heapq.heappush(self._heap, key + (self._ver[f], f))
        return got

    def _compact(self) -> None:
        ver, state, key = self._ver, self._state, self._key
        self._heap = [key[f] + (ver[f], f) for f in range(self.num_frames) if state[f] != ABSENT]
        heapq.heapify(self._heap)

    def _drop(self, f: int) -> None:
        if self._state[f] == LISTED:
            self._count -= 1
        self._state[f] = ABSENT
        self._ver[f] += 1
        self._key[f] = None

    # -- Replacer -----------------------------------------------------------------------
    def set_evictable(self, frame: int, evictable: bool) -> None:
        self._check(frame)
        s = self._state[frame]
        if evictable and s == PINNED:
            self._state[frame] = LISTED
            self._count += 1
            if self._key[frame] is None:  # pinned before it was ever accessed
                self._set_key(frame, self._default_key(frame))
        elif not evictable and s == LISTED:
            self._state[frame] = PINNED
            self._count -= 1
        elif not evictable and s == ABSENT:
            self._state[frame] = PINNED

    def _default_key(self, frame: int) -> tuple:
        raise NotImplementedError

    def evict(self) -> int | None:
        got = self._pop_min()
        if got is None:
            return None
        f = got[0]
        self._drop(f)
        self._on_evicted(f)
        return f

    def remove(self, frame: int) -> None:
        self._check(frame)
        if self._state[frame] != ABSENT:
            self._drop(frame)
            self._on_evicted(frame)

    def num_evictable(self) -> int:
        return self._count

    def debug_key(self, frame: int) -> Any:
        return self._key[frame]

