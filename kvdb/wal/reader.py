"""Reading log segments: whole-segment scans (recovery, verify, ``kvdb wal dump``).

A scan walks records from an offset and classifies how it ends (invariant R2 of
kvdb/format/record.py):

* ``clean``  -- the bytes end exactly at a record boundary;
* ``torn``   -- a record is cut short or fails its crc and no later intact record follows:
               the tail of an interrupted append; recovery truncates it in the last segment;
* damage     -- a record fails but records with the next lsns follow it (found by searching
               for their lsn bytes, R1): the bad span is skipped and reported, never returned,
               and the scan goes on. This is how a bit flip in the middle of the log is told
               apart from a torn tail without losing the acknowledged records after it.

Block reads by index location do not go through here (kvdb.cold.store reads one record with
preadv straight into the caller's page and checks its crc).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass, field

from kvdb.format.record import (
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    Record,
    SegmentHeader,
    check_record,
    decode_segment_header,
)
from kvdb.errors import CorruptionError

#: how many following lsns a resync tries before calling a failure a torn tail
RESYNC_LSNS = 8


@dataclass
class Damage:
    offset: int
    end: int  # first byte after the skipped span
    what: str


@dataclass
class SegmentScan:
    segment_no: int
    header: SegmentHeader | None
    file_bytes: int
    records: list[Record] = field(default_factory=list)
    end: int = 0  # byte after the last intact record
    ending: str = "clean"  # "clean" | "torn" | "bad-header"
    damage: list[Damage] = field(default_factory=list)
    first_lsn: int | None = None
    last_lsn: int | None = None


#: segments up to this size are read whole with large sequential reads (measured ~3x faster
#: than page-faulting through an mmap on a cold cache); larger ones are mapped
READ_WHOLE_MAX_BYTES = 1 << 30
_READ_CHUNK_BYTES = 16 << 20


class _FileFill:
    """Reads a file into an anonymous map on a helper thread, front to back in large chunks;
    ``ready(n)`` blocks until the first n bytes are in. The scan checks record k while the
    device reads record k+1 (preadv and crc32c both release the GIL)."""

    def __init__(self, fd: int, size: int) -> None:
        self.buf = mmap.mmap(-1, size)  # pages faulted in by the read itself, never zero-filled
        self.size = size
        self.filled = 0  # bytes read so far; guarded by _cond
        self.error: OSError | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(os.dup(fd),), daemon=True,
                                        name="kvdb-wal-read")
        self._thread.start()

    def _run(self, fd: int) -> None:
        mv = memoryview(self.buf)
        try:
            off = 0
            while off < self.size:
                n = os.preadv(fd, [mv[off : off + _READ_CHUNK_BYTES]], off)
                if n <= 0:
                    break
                off += n
                with self._cond:
                    self.filled = off
                    self._cond.notify_all()
        except OSError as e:
            self.error = e
        finally:
            mv.release()
            os.close(fd)
            with self._cond:
                self.size = self.filled  # a short file ends where the reads ended
                self._cond.notify_all()

    def ready(self, n: int) -> None:
        with self._cond:
            while self.filled < min(n, self.size):
                self._cond.wait()

    def join(self) -> None:
        self._thread.join()


def map_file(path: str):
    """Read-only mmap of a whole file (b"" for an empty one); zero-copy, for callers that come
    back to a segment many times (log shipping). Close it with ``.close()``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)


def read_file_ahead(path: str, fill_holder: list):
    """The bytes of a whole file for one front-to-back scan. Files up to READ_WHOLE_MAX_BYTES are
    read with large sequential reads by a helper thread (~3x faster than page-faulting through a
    file mmap on a cold cache); its ``_FileFill`` is appended to ``fill_holder`` so the caller
    scans behind the reads. Larger files are mapped. Close the result with ``.close()``."""
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        if size <= READ_WHOLE_MAX_BYTES:
            fill = _FileFill(fd, size)
            fill_holder.append(fill)
            return fill.buf
        m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            try:
                m.madvise(mmap.MADV_SEQUENTIAL)
            except OSError:
                pass
        return m


def _resync(buf, start: int, expect_lsn: int | None) -> tuple[int, Record] | None:
    """The first intact record after ``start`` whose lsn is one of the next RESYNC_LSNS."""
    if expect_lsn is None:
        return None
    for lsn in range(expect_lsn, expect_lsn + RESYNC_LSNS):
        pat = struct.pack("<Q", lsn)
        pos = start
        while True:
            hit = buf.find(pat, pos)
            if hit < 0:
                break
            cand = hit - 9  # the lsn sits at byte 9 of a record header
            if cand > start:
                status, rec = check_record(buf, cand)
                if status == "ok" and rec.lsn == lsn:
                    return cand, rec
            pos = hit + 1
    return None


def scan_buffer(buf, segment_no: int, start: int | None = None, expect_lsn: int | None = None,
                keep_records: bool = True, on_record=None, fill=None) -> SegmentScan:
    """Scan one segment's bytes. ``start`` defaults to just after the header; ``expect_lsn`` is
    the lsn the first record should carry (None: take the header's first_lsn). ``fill``: a
    ``_FileFill`` still reading ``buf``; the scan waits for the bytes it needs."""
    ready = fill.ready if fill is not None else (lambda n: None)
    ready(SEGMENT_HEADER_BYTES)
    size = fill.size if fill is not None else len(buf)
    try:
        header = decode_segment_header(buf[:SEGMENT_HEADER_BYTES])
    except CorruptionError:
        header = None
    scan = SegmentScan(segment_no, header, size)
    if header is None:
        scan.ending = "bad-header"
        scan.end = 0
        if start is None:
            # the header is gone; records may still be intact after it (damage, not a torn create)
            start = SEGMENT_HEADER_BYTES
            if size <= SEGMENT_HEADER_BYTES:
                return scan
            scan.damage.append(Damage(0, SEGMENT_HEADER_BYTES, "segment header"))
    elif header.segment_no != segment_no:
        scan.damage.append(Damage(0, SEGMENT_HEADER_BYTES, f"header names segment {header.segment_no}"))
    if start is None:
        start = SEGMENT_HEADER_BYTES
    if expect_lsn is None and header is not None and start == SEGMENT_HEADER_BYTES:
        expect_lsn = header.first_lsn
    off = start
    scan.end = off
    while off < size:
        ready(off + RECORD_HEADER_BYTES)
        if fill is not None:
            size = fill.size
            if off + RECORD_HEADER_BYTES <= size:
                ready(off + RECORD_HEADER_BYTES + struct.unpack_from("<I", buf, off)[0])
            size = fill.size
        status, rec = check_record(memoryview(buf)[:size] if fill is not None and size < len(buf) else buf, off)
        if status == "ok":
            if expect_lsn is not None and rec.lsn != expect_lsn:
                scan.damage.append(Damage(off, off, f"lsn {rec.lsn} where {expect_lsn} was expected (records missing)"))
            if keep_records:
                scan.records.append(rec)
            if on_record is not None:
                on_record(rec)
            if scan.first_lsn is None:
                scan.first_lsn = rec.lsn
            scan.last_lsn = rec.lsn
            expect_lsn = rec.lsn + 1
            off += rec.record_bytes
            scan.end = off
            continue
        ready(size)
        if fill is not None:
            size = fill.size
        found = _resync(buf if fill is None or size == len(buf) else bytes(buf[:size]), off + 1, expect_lsn)
        if found is None:
            if scan.ending != "bad-header":
                scan.ending = "torn"
            return scan
        nxt, nrec = found
        what = "record cut short" if status == "short" else "checksum or length mismatch"
        scan.damage.append(Damage(off, nxt, what))
        off = nxt
        expect_lsn = nrec.lsn
    if scan.ending != "bad-header":
        scan.ending = "clean"
    return scan


def scan_segment(path: str, segment_no: int, start: int | None = None, expect_lsn: int | None = None,
                 keep_records: bool = True, on_record=None) -> SegmentScan:
    holder: list = []
    buf = read_file_ahead(path, holder)
    fill = holder[0] if holder else None
    try:
        return scan_buffer(buf, segment_no, start, expect_lsn, keep_records, on_record, fill)
    finally:
        if fill is not None:
            fill.join()
        # records hold views into the map when kept; the last view's release frees it
        if isinstance(buf, mmap.mmap) and not keep_records:
            try:
                buf.close()
            except BufferError:
                pass
