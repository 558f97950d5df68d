"""``lru``: least recently used, the pool's default policy for every tier.

Follows the replacer interface and its invariants R1-R4 (kvdb/buffer_pool/replacer.py).
"""

from __future__ import annotations

from array import array

from kvdb.buffer_pool.replacer import Replacer
from kvdb.compiled import copy_fields

_NIL = -1
_ABSENT, _LISTED, _PINNED = 0, 1, 2  # a frame's state


class LruCore:
    """Least recently used, as an intrusive doubly linked list over two int32 arrays.

    Memory is 9 bytes per frame (prev, next, state), not a Python object per page: a pool
    with a million resident pages spends 9 MB here. Head = most recent, tail = victim end.
    Only evictable frames are on the list; a pinned frame leaves the list and re-enters at
    the head when unpinned. LruReplacer is this class and the interface; compiled (setup.py),
    this class is an extension type typed by lru.pxd.
    """

    def __init__(self, num_frames: int) -> None:
        Replacer.__init__(self, num_frames)
        self._prev = array("i", [_NIL]) * num_frames
        self._next = array("i", [_NIL]) * num_frames
        self._state = bytearray(num_frames)
        self._head = _NIL
        self._tail = _NIL
        self._count = 0

    def __deepcopy__(self, memo: dict) -> LruCore:
        return copy_fields(self, memo)  # compiled, the fields are not in ``__dict__``

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
        self._check_frames(frames)  # all first: state[-1] would be the last frame's
        for i in range(len(frames) - 1, -1, -1):
            f = frames[i]
            s = state[f]
            if s == _LISTED:
                self._unlink(f)
                self._push_head(f)
            elif s == _ABSENT:
                state[f] = _LISTED
                self._push_head(f)

    def set_evictable(self, frame: int, evictable: bool) -> None:
        self._check(frame)
        s = self._state[frame]
        if evictable and s == _PINNED:
            self._state[frame] = _LISTED
            self._push_head(frame)
        elif not evictable and s == _LISTED:
            self._unlink(frame)
            self._state[frame] = _PINNED
        elif not evictable and s == _ABSENT:
            self._state[frame] = _PINNED

    def evict(self) -> int | None:
        f = self._tail
        if f == _NIL:
            return None
        self._unlink(f)
        self._state[f] = _ABSENT
        return f

    def remove(self, frame: int) -> None:
        self._check(frame)
        if self._state[frame] == _LISTED:
            self._unlink(frame)
        self._state[frame] = _ABSENT

    def num_evictable(self) -> int:
        return self._count

    def debug_order(self) -> list[int]:
        """Evictable frames from next victim to most recent (tests only)."""
        out, f = [], self._tail
        while f != _NIL:
            out.append(f)
            f = self._prev[f]
        return out


class LruReplacer(LruCore, Replacer):
    name = "lru"
