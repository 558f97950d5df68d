"""LiveSet: which blocks the cold tier holds, where, and how many bytes that takes.

One entry per live block key: (lsn, record bytes, segment) of its newest PUT record. Kept in
write order (a dict's insertion order): that is the eviction order under ``disk_bytes``, the
oldest written block first. A block that compaction copies keeps its place (``keep_order``).
Alongside: live record bytes per segment (what segment GC and compaction judge a segment by,
kvdb/cold/checkpoint.py C4) and in all.

Rebuilt on open from one scan of the index, sorted by lsn (``load``); changed only by the store's
appends, under ``writer.lock``: every method but ``has`` and ``__len__`` expects the caller to
hold it.

Eviction under ``disk_bytes`` (``plan_evictions``): live record bytes never exceed the bound; the
oldest written blocks go first (the store appends a DELETE record in the same batch). A batch
bigger than the bound keeps only its last blocks. Dead bytes stay in their segments until a
checkpoint finds a segment wholly dead or compaction copies the live rest out (``space``).
"""

from __future__ import annotations

import collections
from itertools import repeat

from kvdb.format.record import SEGMENT_HEADER_BYTES


class LiveSet:
    def __init__(self) -> None:
        self._live: dict[bytes, tuple[int, int, int]] = {}  # key -> (lsn, record_bytes, segment)
        self._seg_live: collections.Counter = collections.Counter()  # segment -> live record bytes
        self.bytes = 0  # live record bytes in all
        self.has = self._live.__contains__  # ``key in live``, at dict speed (no lock: one lookup)

    def __len__(self) -> int:
        return len(self._live)

    def get(self, key: bytes) -> tuple[int, int, int] | None:
        """(lsn, record bytes, segment) of a live block, None when it is not live."""
        return self._live.get(key)

    def segment_of(self, key: bytes) -> int | None:
        cur = self._live.get(key)
        return None if cur is None else cur[2]

    def keys(self) -> list[bytes]:
        """The live keys in eviction order (oldest written first)."""
        return list(self._live)

    def keys_in(self, segment_no: int) -> list[bytes]:
        return [k for k, (_lsn, _rb, seg) in self._live.items() if seg == segment_no]

    def segment_bytes(self, segment_no: int) -> int:
        """Live record bytes in a segment."""
        return self._seg_live.get(segment_no, 0)

    def is_counted(self, segment_no: int) -> bool:
        """The segment is still counted (not collected): a read that finds it gone is damage."""
        return segment_no in self._seg_live

    def load(self, entries) -> None:
        """From the index on open: ``(key, BlockEntry)`` pairs sorted by lsn (write order)."""
        for key, e in entries:
            self._live[key] = (e.lsn, e.record_bytes, e.segment_no)
            self._seg_live[e.segment_no] += e.record_bytes
            self.bytes += e.record_bytes

    def set(self, key: bytes, lsn: int, record_bytes: int, segment_no: int, keep_order: bool = False) -> None:
        """The block's newest record; ``record_bytes=0``: it is gone (deleted, evicted).
        ``keep_order``: a block moved by compaction keeps its place (the eviction order under
        ``disk_bytes`` is write order, not copy order)."""
        old = self._live.get(key) if keep_order and record_bytes else self._live.pop(key, None)
        if old is not None:
            self._seg_live[old[2]] -= old[1]
            self.bytes -= old[1]
        if record_bytes:
            self._live[key] = (lsn, record_bytes, segment_no)
            self._seg_live[segment_no] += record_bytes
            self.bytes += record_bytes

    def set_run(self, keys: list[bytes], first_lsn: int, record_bytes: int, segment_no: int) -> None:
        """``set`` of blocks written back to back in one segment, lsns from ``first_lsn``, each
        record ``record_bytes`` long: the same state, with a Python step only per key that was
        already live."""
        live = self._live
        for key in [k for k in keys if k in live] if any(map(live.__contains__, keys)) else ():
            _lsn, rb, seg = live.pop(key)
            self._seg_live[seg] -= rb
            self.bytes -= rb
        live.update(zip(keys, zip(range(first_lsn, first_lsn + len(keys)), repeat(record_bytes), repeat(segment_no))))
        self._seg_live[segment_no] += record_bytes * len(keys)
        self.bytes += record_bytes * len(keys)

    def dead_segments(self, segments: list[int], before: int) -> list[int]:
        """Listed segments below ``before`` that hold no live block."""
        return [s for s in segments if s < before and self._seg_live.get(s, 0) <= 0]

    def drop_segments(self, dead: list[int]) -> None:
        """Forget segments being deleted (sealed and wholly dead: nothing can make them live)."""
        for s in dead:
            self._seg_live.pop(s, None)

    def plan_evictions(self, sizes: list[int], batch_keys, limit: int) -> tuple[int, list[bytes]]:
        """Keep live bytes <= ``limit`` for a batch of records of ``sizes`` bytes whose keys are
        ``batch_keys``: returns (how many of the batch's first blocks to drop, because the batch
        alone is too big; the live keys to evict, oldest first)."""
        keep_from, total = len(sizes), 0
        while keep_from > 0 and total + sizes[keep_from - 1] <= limit:
            keep_from -= 1
            total += sizes[keep_from]
        kept = set(batch_keys[keep_from:])
        need = self.bytes + total - sum(self._live[k][1] for k in kept if k in self._live)
        evict = []
        if need > limit:
            for key, (_lsn, rbytes, _seg) in self._live.items():
                if key in kept:
                    continue
                evict.append(key)
                need -= rbytes
                if need <= limit:
                    break
        return keep_from, evict

    def space(self, segments, writer, dead_fraction: float) -> dict:
        """Log bytes (all segments), live record bytes, dead bytes in sealed segments (what a
        compaction could reclaim) and ``reclaimable_bytes``: the dead bytes of sealed segments
        whose record bytes are at least ``dead_fraction`` dead. ``segments`` is the log's SegmentSet (sealed sizes
        cached there); takes ``writer.lock`` itself, briefly."""
        with writer.lock:
            segs = segments.list()
            active, active_bytes = writer.segment_no, writer.offset
            live = self.bytes
            seg_live = dict(self._seg_live)
        log_bytes = active_bytes if active in segs else 0
        dead = reclaimable = 0
        for x, size in segments.sealed_sizes(segs, active).items():
            log_bytes += size
            d = max(0, size - SEGMENT_HEADER_BYTES - seg_live.get(x, 0))
            dead += d
            if d and d >= dead_fraction * (size - SEGMENT_HEADER_BYTES):  # of its record bytes
                reclaimable += d
        return {"log_bytes": log_bytes, "live_bytes": live, "dead_bytes": dead, "reclaimable_bytes": reclaimable,
                "segments": len(segs)}


__all__ = ["LiveSet"]
