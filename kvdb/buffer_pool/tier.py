"""One tier of the buffer pool: its arena, free list, per-frame arrays, replacer and counters.

Per-frame state lives in flat arrays (array/bytearray) indexed by frame number, not in an
object per page; the page table that maps keys to (frame, tier) is the pool's
(kvdb/buffer_pool/pool.py, invariants P1-P6), and only the pool reads and writes these arrays.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kvdb.buffer_pool.arena import Arena
from kvdb.buffer_pool.replacer import Replacer

DEVICE, HOST = 0, 1
TIER_NAMES = ("device", "host")
#: the deepest block position a frame records (``positions`` is an int32 array); callers check it
MAX_POSITION = 2**31 - 1


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    inserts: int = 0
    reads: int = 0  # pages copied out by read_into (get_blocks)


@dataclass
class Tier:
    index: int
    arena: Arena
    replacer: Replacer
    free: list = field(default_factory=list)  # free frames, descending: pop() gives the lowest
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        n = self.arena.num_frames
        self.free = list(range(n - 1, -1, -1))
        self.keys: list = [None] * n  # frame -> key (the same bytes object as the table's)
        self.pins = array("i", [0]) * n  # frame -> pin count
        self.positions = array("i", [-1]) * n  # frame -> block depth in its chain (-1 unknown), <= MAX_POSITION
        self.dirty = bytearray(n)  # frame -> 1 when the page is not yet in the cold tier
        self.reserved: set[int] = set()  # frames lent out to be written in place (P6)

    @property
    def name(self) -> str:
        return TIER_NAMES[self.index]

    @property
    def num_frames(self) -> int:
        return self.arena.num_frames

    @property
    def num_resident(self) -> int:
        return self.num_frames - len(self.free) - len(self.reserved)

    def figures(self) -> dict:
        """What ``Db.stats()`` reports for this tier (its own counters and occupancy)."""
        s = self.stats
        page_bytes = self.arena.page_bytes
        return {
            "pages": self.num_resident,
            "capacity_pages": self.num_frames,
            "bytes": self.num_resident * page_bytes,
            "capacity_bytes": self.arena.capacity_bytes,
            "pinned_pages": sum(1 for p in self.pins if p),
            "hits": s.hits,
            "misses": s.misses,
            "reads": s.reads,
            "inserts": s.inserts,
            "evictions": s.evictions,
            "demotions": s.demotions,
            "promotions": s.promotions,
            "device": str(self.arena.device),
        }
