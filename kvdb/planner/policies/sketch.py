"""A TinyLFU frequency sketch (Einziger et al., ACM ToS 2017): count-min, doorkeeper, aging.

  count-min  4 rows of ``width`` 4-bit counters (kept in bytes, capped at 15); a block's
             estimate is the smallest of its 4 counters;
  doorkeeper a Bloom filter (2 probes) in front of it: a block's first reference only sets
             its doorkeeper bits, later ones raise the counters, and the estimate adds one for
             a block the doorkeeper holds -- one-hit wonders never touch the counters;
  aging      after ``sample_size`` recorded references every counter is halved, the
             doorkeeper is cleared and the sample count halved ("reset"), so the sketch
             follows a frequency that changes over time.

Hashes are stable across processes (ints as they are, ``bytes`` keys by their first 8 bytes,
anything else by CRC-32 of its repr), so replays are repeatable whatever PYTHONHASHSEED is.
Each operation is O(1); a reset is O(width) once per ``sample_size`` references.
"""

from __future__ import annotations

import zlib
from typing import Hashable

_MASK64 = (1 << 64) - 1
_HALF = bytes(i >> 1 for i in range(256))
_ROWS = 4


def stable_hash(bid: Hashable) -> int:
    if type(bid) is int:
        h = bid & _MASK64
    elif type(bid) is bytes:
        h = int.from_bytes(bid[:8], "little")
    else:
        h = zlib.crc32(repr(bid).encode())
    h = (h ^ (h >> 31)) * 0x9E3779B97F4A7C15 & _MASK64  # splitmix64's finaliser
    h = (h ^ (h >> 29)) * 0xBF58476D1CE4E5B9 & _MASK64
    return h ^ (h >> 32)


class FrequencySketch:
    """Counts by ``stable_hash`` values: callers hash a block once and keep the hash."""

    def __init__(self, capacity_frames: int, sample_factor: int = 10) -> None:
        width = 64
        while width < capacity_frames:
            width *= 2
        self.width = width
        self.sample_size = sample_factor * capacity_frames  # the paper's W
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(_ROWS)]
        self._door = bytearray(width * 8)  # one byte per Bloom bit: simple, 8 bits per block
        self._door_mask = width * 8 - 1
        self._adds = 0

    def add(self, h: int) -> None:
        dm = self._door_mask
        a, b = (h >> 7) & dm, (h >> 37) & dm
        door = self._door
        if door[a] and door[b]:
            m, h2 = self._mask, (h >> 32) | 1
            for r in self._rows:
                i = h & m
                if r[i] < 15:
                    r[i] += 1
                h += h2
        else:
            door[a] = door[b] = 1
        self._adds += 1
        if self._adds >= self.sample_size:
            self._reset()

    def estimate(self, h: int) -> int:
        dm = self._door_mask
        a, b = (h >> 7) & dm, (h >> 37) & dm
        m, h2 = self._mask, (h >> 32) | 1
        n = 15
        for r in self._rows:
            v = r[h & m]
            if v < n:
                n = v
            h += h2
        return n + (1 if self._door[a] and self._door[b] else 0)

    def _reset(self) -> None:
        self._rows = [r.translate(_HALF) for r in self._rows]
        self._door = bytearray(len(self._door))
        self._adds //= 2
