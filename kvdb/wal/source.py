"""SegmentLogSource: a log directory read record by record, for log shipping
(kvdb/replication/shipping.py ``LogSource``; layout: kvdb/format/record.py).

Records are found by walking record headers (no checksum work here: the follower checks every
record's crc32c before applying it) and handed out as read-only views of the segment's mmap,
so a batch is copied once, into the send buffer or the socket. A cursor remembers where the
last read stopped; a reconnect at another lsn walks headers from the segment whose header's
first_lsn covers it. Segments deleted meanwhile (segment GC) drop out of the listing; their
maps go when the last view of them does.
"""

from __future__ import annotations

import threading

from kvdb.errors import CorruptionError
from kvdb.format.record import RECORD_HEADER, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES, decode_segment_header
from kvdb.fs import OsFs
from kvdb.wal.reader import map_file, scan_segment
from kvdb.wal.segments import list_segments, segment_path


_FS = OsFs()


class SegmentLogSource:
    """Reads the log directory ``wal_dir`` (see the module doc).

    ``durable`` is a callable returning the writer's durable lsn (S3); without it, every
    intact record counts as durable (a log not being written, or one just recovered).
    """

    def __init__(self, wal_dir, durable=None) -> None:
        self.wal_dir = str(wal_dir)
        self._durable = durable
        self._lock = threading.Lock()  # guards _cursor and _maps
        self._cursor: tuple[int, int, int] | None = None  # (segment_no, offset, lsn of the record there)
        self._maps: dict[int, object] = {}  # segment_no -> mmap of the file as of its last map

    def _segments(self) -> list[int]:
        try:
            return list_segments(_FS, self.wal_dir)
        except FileNotFoundError:
            return []

    def _map(self, seg: int, need_bytes: int):
        """The segment's bytes, remapped when the file grew past the old map (None if gone)."""
        m = self._maps.get(seg)
        if m is None or len(m) < need_bytes:
            try:
                m = map_file(segment_path(self.wal_dir, seg))
            except FileNotFoundError:
                self._maps.pop(seg, None)
                return None
            self._maps[seg] = m
        return m

    def _header(self, seg: int):
        """The segment's header (kvdb/format/record.py, either version), None if gone or damaged."""
        m = self._map(seg, SEGMENT_HEADER_BYTES)
        if m is None:
            return None
        try:
            return decode_segment_header(m[:SEGMENT_HEADER_BYTES])
        except CorruptionError:
            return None

    def _header_first_lsn(self, seg: int) -> int | None:
        h = self._header(seg)
        return None if h is None else h.first_lsn

    def _records_start(self, seg: int) -> int:
        h = self._header(seg)
        return SEGMENT_HEADER_BYTES if h is None else h.header_bytes

    def durable_lsn(self) -> int:
        if self._durable is not None:
            return int(self._durable())
        for seg in reversed(self._segments()):
            scan = scan_segment(segment_path(self.wal_dir, seg), seg, keep_records=False)
            if scan.last_lsn is not None:
                return scan.last_lsn
        return 0

    def first_lsn(self) -> int:
        with self._lock:
            for seg in self._segments():
                first = self._header_first_lsn(seg)
                if first is not None:
                    return first
        return self.durable_lsn() + 1

    def _locate(self, segs: list[int], lsn: int) -> tuple[int, int] | None:
        """(segment, offset) of the record with ``lsn``, walking headers; None if not in the log."""
        cur = self._cursor
        if cur is not None and cur[2] == lsn and cur[0] in segs:
            return cur[0], cur[1]
        start = None
        for seg in segs:
            first = self._header_first_lsn(seg)
            if first is not None and first <= lsn:
                start = seg
        if start is None:
            return None
        for seg in segs[segs.index(start):]:
            off = self._records_start(seg)
            while True:
                m = self._map(seg, off + RECORD_HEADER_BYTES)  # remaps a map older than the file
                if m is None or off + RECORD_HEADER_BYTES > len(m):
                    break
                length, _crc, _t, rec_lsn = RECORD_HEADER.unpack_from(m, off)
                if rec_lsn == lsn:
                    return seg, off
                if rec_lsn > lsn:
                    return None
                off += RECORD_HEADER_BYTES + length
        return None

    def read_records(self, after_lsn: int, max_bytes: int, upto_lsn: int) -> list[tuple[int, memoryview]]:
        out: list[tuple[int, memoryview]] = []
        with self._lock:
            segs = self._segments()
            loc = self._locate(segs, after_lsn + 1)
            if loc is None:
                if after_lsn + 1 <= upto_lsn:
                    raise CorruptionError(f"log {self.wal_dir} has no record {after_lsn + 1} (compacted away "
                                          "or damaged); the follower must be re-seeded")
                return out
            seg, off = loc
            lsn, total = after_lsn + 1, 0
            while lsn <= upto_lsn:
                m = self._map(seg, off + RECORD_HEADER_BYTES)
                if m is None or off + RECORD_HEADER_BYTES > len(m):
                    nxt = [s for s in segs if s > seg]
                    if not nxt:
                        break
                    seg = nxt[0]
                    off = self._records_start(seg)
                    continue
                length, _crc, _t, rec_lsn = RECORD_HEADER.unpack_from(m, off)
                nbytes = RECORD_HEADER_BYTES + length
                if rec_lsn != lsn:
                    raise CorruptionError(f"log {self.wal_dir} has lsn {rec_lsn} where {lsn} was expected "
                                          f"(segment {seg}, offset {off})")
                if out and total + nbytes > max_bytes:
                    break
                m = self._map(seg, off + nbytes)
                out.append((lsn, memoryview(m)[off : off + nbytes]))
                total += nbytes
                off += nbytes
                lsn += 1
            self._cursor = (seg, off, lsn)
            for old in [k for k in self._maps if k not in segs]:
                self._maps.pop(old, None)  # deleted segments: the map goes when its views do
        return out


__all__ = ["SegmentLogSource"]
