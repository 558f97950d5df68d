"""LiveSet: how many blocks the cold tier holds, in which segments, and which to evict first.

Nothing here is kept per block. Where a block's newest record lies is the index's (and, for
records not yet applied, the queue's ``pending``): ``locate`` answers it for a batch of keys
(kvdb/cold/apply.py). Kept here, per segment: the live record bytes and blocks whose newest
record is in it, and the sums over all segments. Segment GC and compaction judge a segment by
them (kvdb/cold/checkpoint.py C4); ``stats`` reports the sums; the bound ``disk_bytes`` is
checked against them.

They change by deltas: an append looks up the old locations of its keys (``locate``, before
it queues its own), and ``change`` turns (old, new) locations into (segment, bytes, blocks)
deltas, added here at once and handed to the index queue, which adds them to the totals
persisted with the entries (C7, kvdb/cold/apply.py). On open the totals are read back from
the index (``load``): O(segments), not O(blocks).

Eviction under ``disk_bytes`` (``plan_evictions``): live record bytes never exceed the bound;
the oldest written blocks go first (the store appends a DELETE record in the same batch). The
order is the log's: a cursor walks the oldest segment holding live blocks from record header
to record header (kvdb/wal/reader.py ``walk_puts``) and a record is a live block when the index
still points at it. Records behind the cursor are dead for good (evicted, overwritten or
deleted), so the cursor only moves forward; after a reopen it starts again at the oldest
segment with live blocks. A block that compaction copied sits at its copy's place in the log.
Where a walk cannot go on (a damaged record header), the cursor moves to the next segment and,
should that not free enough, the live blocks are listed from an index scan (``scan``).
A batch bigger than the bound keeps only its last blocks. Dead bytes stay in their segments
until a checkpoint finds a segment wholly dead or compaction copies the live rest out.

Every method but ``__len__`` and ``blocks_in`` (of a sealed segment) expects the caller to hold
``writer.lock``.
"""

from __future__ import annotations

import collections

from kvdb.cold.apply import fold, location_delta
from kvdb.errors import CorruptionError
from kvdb.format.record import SEGMENT_HEADER_BYTES
from kvdb.wal.reader import walk_puts

#: record headers the eviction cursor reads ahead per walk
WALK_RECORDS = 4096


class LiveSet:
    def __init__(self) -> None:
        """Empty, and answering nothing, until ``attach``: ``locate(keys)`` gives (segment,
        offset, record bytes) of each live key, None for others; ``_walk(segment, offset|None,
        n)`` up to n (key, offset, record bytes) of the segment's PUT records from ``offset``
        (None: its first), the offset reached, and "more" (n reached, or the active segment's
        end for now), "end" (the segment's end) or "damage" (no further); ``scan()`` (key,
        segment, offset, record bytes) of every live block."""
        self.locate = self._walk = self.scan = None
        self._seg: dict[int, list[int]] = {}  # segment -> [live record bytes, live blocks]
        self.bytes = 0  # live record bytes in all
        self.count = 0  # live blocks in all
        self._cursor: list | None = None  # [segment, offset] the eviction walk goes on from
        self._ahead: collections.deque = collections.deque()  # walked, not yet judged: (key, seg, off, rb)

    def __len__(self) -> int:
        return self.count

    def attach(self, queue, segments, writer, totals: dict[int, list[int]]) -> None:
        """A store's live set, once it is recovered: ``queue`` its IndexQueue (locate, and the
        index for the scan), ``segments`` and ``writer`` its log, ``totals`` what the index holds."""
        queue.applied = {s: list(t) for s, t in totals.items()}
        self.locate = queue.locate
        self._walk = segment_walker(segments, writer)
        self.scan = live_scanner(queue.index, queue)
        self.load(totals)

    def load(self, totals: dict[int, list[int]]) -> None:
        """The per-segment totals an open read from the index."""
        self._seg = {s: list(t) for s, t in totals.items() if t[1] > 0}
        self.bytes = sum(t[0] for t in self._seg.values())
        self.count = sum(t[1] for t in self._seg.values())

    def totals(self) -> dict[int, list[int]]:
        return {s: list(t) for s, t in self._seg.items()}

    def contains(self, keys: list[bytes]) -> list[bool]:
        return [loc is not None for loc in self.locate(keys)]

    def segment_bytes(self, segment_no: int) -> int:
        """Live record bytes in a segment."""
        t = self._seg.get(segment_no)
        return 0 if t is None else t[0]

    def segment_blocks(self, segment_no: int) -> int:
        """Live blocks in a segment."""
        t = self._seg.get(segment_no)
        return 0 if t is None else t[1]

    def is_counted(self, segment_no: int) -> bool:
        """The segment holds live blocks: a read that finds it gone is damage."""
        return segment_no in self._seg

    # -- changes

    def _add(self, seg: int, nbytes: int, nblocks: int) -> None:
        t = self._seg.get(seg)
        if t is None:
            t = self._seg[seg] = [0, 0]
        t[0] += nbytes
        t[1] += nblocks
        if t[1] <= 0:
            del self._seg[seg]
        self.bytes += nbytes
        self.count += nblocks

    def change(self, keys: list[bytes], olds: list, news: list) -> list[tuple | None]:
        """Each key's newest record moves from ``olds[i]`` to ``news[i]`` ((segment, offset,
        record bytes), None: not live), in order (a key twice: its second old is its first
        new). Returns each key's delta ((segment, bytes, blocks) triples, or None)."""
        deltas: list[tuple | None] = []
        cur: dict | None = {} if len(set(keys)) != len(keys) else None
        for k, old, new in zip(keys, olds, news):
            if cur is not None:
                old = cur.get(k, old)
                cur[k] = new
            d = location_delta(old, new)
            for seg, nbytes, nblocks in d:
                self._add(seg, nbytes, nblocks)
            deltas.append(d or None)
        return deltas

    def change_summed(self, keys: list[bytes], olds: list, news: list) -> tuple:
        """``change``, its deltas summed per segment (one delta for a whole record or batch)."""
        summed: dict[int, list[int]] = {}
        touched: set[int] = set()
        for d in self.change(keys, olds, news):
            fold(summed, d or (), touched)
        return tuple((s, t[0], t[1]) for s, t in summed.items() if t[0] or t[1])

    def change_runs(self, keys: list[bytes], olds: list, runs, record_bytes: int) -> tuple:
        """``change`` of a batch written as ``runs`` ((segment, first offset, count) back to
        back, ``record_bytes`` each); returns the batch's delta, summed per segment."""
        if any(o is not None for o in olds) or len(set(keys)) != len(keys):
            news = [(s, off + j * record_bytes, record_bytes) for s, off, c in runs for j in range(c)]
            return self.change_summed(keys, olds, news)
        for s, _off, c in runs:
            self._add(s, record_bytes * c, c)
        return tuple((s, record_bytes * c, c) for s, _off, c in runs)

    # -- segment GC

    def dead_segments(self, segments: list[int], before: int) -> list[int]:
        """Listed segments below ``before`` that hold no live block."""
        return [s for s in segments if s < before and s not in self._seg]

    def drop_segments(self, dead: list[int]) -> None:
        """Segments being deleted (wholly dead): the eviction cursor leaves them."""
        if self._cursor is not None and self._cursor[0] in dead:
            self._cursor = None
            self._ahead.clear()

    def blocks_in(self, segment_no: int) -> list[tuple[bytes, int]]:
        """(key, record bytes) of the live blocks whose newest record is in the segment, in log
        order (compaction's list); from the index scan where the walk meets damage."""
        found, off = [], None
        while True:
            more, off, state = self._walk(segment_no, off, WALK_RECORDS)
            found.extend((k, segment_no, o, rb) for k, o, rb in more)
            if state != "more" or not more:
                break
        if state == "damage":
            found = [c for c in self.scan() if c[1] == segment_no]
        out = []
        for i in range(0, len(found), WALK_RECORDS):
            chunk = found[i : i + WALK_RECORDS]
            for (k, seg, o, _rb), loc in zip(chunk, self.locate([c[0] for c in chunk])):
                if loc is not None and loc[0] == seg and loc[1] == o:
                    out.append((k, loc[2]))
        return out

    # -- eviction

    def _candidates(self) -> list[tuple[bytes, int, int, int]]:
        """The next walked PUT records in log order (possibly dead: the caller checks), [] when
        the walk has reached the end of the log."""
        while not self._ahead:
            segs = sorted(self._seg)
            if not segs:
                return []
            if self._cursor is None or self._cursor[0] < segs[0]:
                self._cursor = [segs[0], None]
            seg, off = self._cursor
            found, reached, state = self._walk(seg, off, WALK_RECORDS)
            self._cursor[1] = reached
            self._ahead.extend((k, seg, o, rb) for k, o, rb in found)
            if not found:
                later = [s for s in segs if s > seg]
                if state == "more" or not later:
                    return []
                self._cursor = [later[0], None]
        out = list(self._ahead)
        self._ahead.clear()
        return out

    def plan_evictions(self, sizes: list[int], batch_keys: list[bytes], olds: list,
                       limit: int) -> tuple[int, list[bytes], list]:
        """Keep live bytes <= ``limit`` for a batch of records of ``sizes`` bytes whose keys are
        ``batch_keys`` (now at ``olds``): returns (how many of the batch's first blocks to drop,
        because the batch alone is too big; the live keys to evict, oldest first; their
        locations)."""
        keep_from, total = len(sizes), 0
        while keep_from > 0 and total + sizes[keep_from - 1] <= limit:
            keep_from -= 1
            total += sizes[keep_from]
        kept: dict[bytes, object] = dict(zip(batch_keys[keep_from:], olds[keep_from:]))
        need = self.bytes + total - sum(o[2] for o in kept.values() if o is not None)
        evict: list[bytes] = []
        locs: list = []
        scanned = False
        while need > limit:
            cands = self._candidates()
            if not cands:
                if scanned:
                    break  # nothing live is left to evict but the batch itself
                scanned = True
                chosen = set(evict)
                cands = [c for c in self.scan() if c[0] not in chosen]
            found = self.locate([c[0] for c in cands])
            for j, ((key, seg, off, _rb), loc) in enumerate(zip(cands, found)):
                if loc is None or loc[0] != seg or loc[1] != off or key in kept:
                    continue  # dead (or about to be overwritten by the batch)
                evict.append(key)
                locs.append(loc)
                need -= loc[2]
                if need <= limit:
                    if not scanned:
                        self._ahead.extendleft(reversed(cands[j + 1:]))
                    break
        return keep_from, evict, locs

    def space(self, segments, writer, dead_fraction: float) -> dict:
        """Log bytes (all segments), live record bytes, dead bytes in sealed segments (what a
        compaction could reclaim) and ``reclaimable_bytes``: the dead bytes of sealed segments
        whose record bytes are at least ``dead_fraction`` dead. ``segments`` is the log's SegmentSet (sealed sizes
        cached there); takes ``writer.lock`` itself, briefly."""
        with writer.lock:
            segs = segments.list()
            active, active_bytes = writer.segment_no, writer.offset
            live = self.bytes
            seg_live = {s: t[0] for s, t in self._seg.items()}
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


def segment_walker(segments, writer):
    """LiveSet's ``walk`` over a store's log (``segments``: its SegmentSet, ``writer``: its
    LogWriter, whose lock the caller holds): the active segment is walked up to the writer's
    offset and does not end there; a sealed one ends at its file's end, or at damage."""

    def walk(seg: int, off: int | None, n: int):
        active = seg == writer.segment_no
        try:
            end = writer.offset if active else segments.file_bytes(seg)
            if off is None:
                off = segments.header(seg).header_bytes
            found, reached, clean = walk_puts(segments.path(seg), off, end, n)
        except (OSError, CorruptionError):  # gone or damaged: verify reports it; the walk moves on
            return [], off, "damage"
        if not clean:
            return found, reached, "damage"
        return found, reached, "more" if active or len(found) >= n else "end"

    return walk


def live_scanner(index, queue):
    """LiveSet's ``scan``: every live block from the index, the queue's pending ones over it,
    in log order."""

    def scan() -> list[tuple[bytes, int, int, int]]:
        locs = {k: (e.segment_no, e.offset, e.record_bytes) for k, e in index.entries()}
        locs.update(queue.pending_locations())
        return sorted(((k, *loc) for k, loc in locs.items() if loc is not None), key=lambda c: (c[1], c[2]))

    return scan


__all__ = ["LiveSet", "WALK_RECORDS", "live_scanner", "segment_walker"]
