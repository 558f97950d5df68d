"""``sieve``: SIEVE (Zhang et al., NSDI'24), a FIFO queue with one visited bit and a moving hand.

New blocks enter at the head of one FIFO queue; a hit only sets the block's visited bit (no
move, so a hit costs O(1) with no list surgery). The hand walks from the tail (oldest) towards
the head: a visited block has its bit cleared and stays where it is, the first unvisited one is
the victim, and the hand stays at the victim's newer neighbour for the next eviction (back at
the tail once it passes the head). Blocks that survive a pass keep their place, so new blocks
behind the hand are judged quickly ("lazy promotion, quick demotion"). No ghosts.

Pinned frames are passed over without touching their bit. Each eviction clears at most one
pass of bits, and every bit was set by one access: O(1) amortized. Interface and R1-R4:
kvdb/buffer_pool/replacer.py; the base: kvdb/planner/policies/resident.py.
"""

from __future__ import annotations

from array import array

from kvdb.planner.policies.resident import ResidentReplacer

_NIL = -1


class SieveReplacer(ResidentReplacer):
    name = "sieve"

    def __init__(self, num_frames: int, capacity_frames: int | None = None) -> None:
        super().__init__(num_frames, capacity_frames)
        self._newer = array("i", [_NIL]) * num_frames
        self._older = array("i", [_NIL]) * num_frames
        self._visited = bytearray(num_frames)
        self._head = _NIL  # newest
        self._tail = _NIL  # oldest
        self._hand = _NIL  # next frame to look at; NIL = start at the tail

    def _admit(self, f, bid) -> None:
        self._visited[f] = 0
        self._older[f] = self._head
        self._newer[f] = _NIL
        if self._head != _NIL:
            self._newer[self._head] = f
        self._head = f
        if self._tail == _NIL:
            self._tail = f

    def _hit(self, f) -> None:
        self._visited[f] = 1

    def _unlink(self, f: int) -> None:
        older, newer = self._older[f], self._newer[f]
        if self._hand == f:
            self._hand = newer
        if newer == _NIL:
            self._head = older
        else:
            self._older[newer] = older
        if older == _NIL:
            self._tail = newer
        else:
            self._newer[older] = newer

    def _victim(self) -> int | None:
        visited, pinned = self._visited, self._pinned
        f = self._hand if self._hand != _NIL else self._tail
        # an evictable frame exists (the base checked): one pass clears every bit in the way,
        # the second finds it; the bound only guards against a broken list
        for _ in range(2 * self.num_frames + 2):
            if f == _NIL:
                f = self._tail
                continue
            if f in pinned:
                f = self._newer[f]
            elif visited[f]:
                visited[f] = 0
                f = self._newer[f]
            else:
                self._hand = f
                self._unlink(f)
                return f
        return None

    def _forget(self, f) -> None:
        self._unlink(f)

    def debug_order(self) -> list[int]:
        """Known frames from the tail (oldest) to the head (tests only)."""
        out, f = [], self._tail
        while f != _NIL:
            out.append(f)
            f = self._newer[f]
        return out

    def debug_hand(self) -> int | None:
        return None if self._hand == _NIL else self._hand
