"""BlockReader: reading blocks out of log segments by index location, checked.

An index entry names a record (segment, offset, length, crc, lsn). A read opens the segment
through a cache of read fds (one per segment, pinned while in use) and reads the record back:

* raw, unsealed pages are read with ``preadv`` straight into the caller's row, after their
  header; records that lie back to back in a segment are read as one run (``read_runs``), in
  slices of ``READ_SLICE_BYTES``, by a read-ahead thread while the calling thread checks the
  slices already read (preadv and crc32c both release the GIL);
* every other record is read whole, checked, unsealed and decoded (``read_entry``).

Invariant
    C3  a read returns a page only if its record's crc, type, lsn and key match the index
        entry and its payload decodes (and authenticates) to exactly page_bytes; otherwise the
        read is a miss, the row is zeroed (``read_runs``, ``read_found``) and ``corruptions``
        counts it (kvdb/cold/store.py ``read_rows``). A read error is a counted miss too
        (``read_errors``), never a reason to fail the store.

A segment deleted by GC after a reader looked a block up (C4, kvdb/cold/checkpoint.py) is either
still open here (POSIX unlink: the pinned fd keeps reading it; ``retire`` closes it when the
last pin goes) or gone, and then ``read_entry`` answers None: look the block up again.

Locks
    ``_fd_lock``  the fd cache ``_fds`` and the read-ahead pool.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numpy as np

from kvdb import native
from kvdb.cold.codec import aad, decode_page
from kvdb.errors import CorruptionError
from kvdb.format import index_value as iv
from kvdb.format.record import (
    FLAG_SEALED,
    PUT_PAYLOAD_OFFSET,
    RECORD_HEADER,
    PUT_HEAD_DTYPE,
    RECORD_HEADER_BYTES,
    Codec,
    RecordType,
    check_record,
    decode_put,
)
from kvdb.fs import IOV_MAX
from kvdb.types import KEY_BYTES

READ_SLICE_BYTES = 4 << 20  # raw runs are read and checked in slices of this many bytes
TAIL_SLICE_BYTES = 256 << 10  # ... the last one cut down in halves to about this many


def check_raw(key: bytes, e: iv.BlockEntry, head: bytearray, row: np.ndarray) -> bool:
    """C3 for a raw page read into ``row`` after its record's ``head``."""
    length, crc, rtype, lsn = RECORD_HEADER.unpack_from(head, 0)
    if (length + RECORD_HEADER_BYTES != e.record_bytes or crc != e.crc or rtype != RecordType.PUT_BLOCK
            or lsn != e.lsn or head[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + KEY_BYTES] != key):
        return False
    return native.crc32c(row, native.crc32c(memoryview(head)[8:])) == crc


def check_slice(keys: list[bytes], entries: list, heads: np.ndarray, out: np.ndarray, rows, whole: int) -> list[bool]:
    """``check_raw`` of every record of a slice read back to back, the header fields compared
    for the whole slice at once: ``heads`` uint8 [k, PUT_PAYLOAD_OFFSET] holds the records'
    leading bytes, ``out[rows[j]]`` the page read after head j (``out`` C-contiguous [m, page]);
    ``whole``: how many records the read returned in full (the rest are misses). The crcs run in
    one native call (GIL released)."""
    k = len(keys)
    return check_slice_fields(keys, np.fromiter((e.record_bytes for e in entries), np.int64, k),
                              np.fromiter((e.crc for e in entries), np.uint32, k),
                              np.fromiter((e.lsn for e in entries), np.uint64, k), heads, out, rows, whole)


def check_slice_fields(keys: list[bytes], record_bytes: np.ndarray, crcs: np.ndarray, lsns: np.ndarray,
                       heads: np.ndarray, out: np.ndarray, rows, whole: int) -> list[bool]:
    """``check_slice`` with the index entries' fields as arrays (``record_bytes``, ``crcs``,
    ``lsns``: one per key, as in kvdb/format/index_value.py ``ENTRY_DTYPE``)."""
    k = len(keys)
    h = heads.view(PUT_HEAD_DTYPE).reshape(k)
    good = (h["length"].astype(np.int64) + RECORD_HEADER_BYTES == record_bytes) \
        & (h["crc"] == crcs) \
        & (h["type"] == RecordType.PUT_BLOCK) \
        & (h["lsn"] == lsns) \
        & (h["key"] == np.frombuffer(b"".join(keys), dtype="V16"))
    good[whole:] = False
    w = min(k, whole)  # the records read in full: their crcs in one native call
    good[:w] &= native.crc32c_heads_pages(heads, 8, out, rows[:w]) == h["crc"][:w]
    return good.tolist()


def plan_slices(cand: list, want: int, per: int) -> list[tuple[int, int, list[int]]]:
    """The reads of ``read_runs``: ``cand`` (segment, offset, key index) of raw records of ``want``
    bytes, in any order. Records back to back in a segment form a run (a lone record is left to
    the per-entry path); runs are cut into slices of at most ``per`` records, in file order,
    except the last ``per`` records of the last run: they are cut in halves down to
    TAIL_SLICE_BYTES (63 records of 64 KiB pages become 31, 16, 8, 4, 2, 2), so that what is
    checked and promoted after the last read completes is a small piece, not a whole slice.
    Returns (segment, offset, [key index]) per slice."""
    cand.sort()
    runs = []  # (segment, offset, [key index]) of each run of two or more records
    j = 0
    while j < len(cand):
        seg, off, _ = cand[j]
        run = [cand[j][2]]
        j += 1
        while j < len(cand) and cand[j][0] == seg and cand[j][1] == off + len(run) * want:
            run.append(cand[j][2])
            j += 1
        if len(run) > 1:
            runs.append((seg, off, run))
    slices = []
    for r, (seg, off, run) in enumerate(runs):
        body = len(run) - min(len(run), per) if r == len(runs) - 1 else len(run)
        slices.extend((seg, off + a * want, run[a : min(a + per, body)]) for a in range(0, body, per))
        part, off, tail = run[body:], off + body * want, max(1, TAIL_SLICE_BYTES // want)
        while len(part) > tail:
            h = len(part) // 2
            slices.append((seg, off, part[:h]))
            off += h * want
            part = part[h:]
        if part:
            slices.append((seg, off, part))
    return slices


class BlockReader:
    def __init__(self, segments, *, page_bytes: int, itemsize: int, sealer, live, count) -> None:
        """``segments``: the log's SegmentSet (paths and the file layer); ``sealer``: the
        store's Sealer or None; ``live``: its LiveSet (is a vanished segment still counted?);
        ``count(**deltas)``: the store's counters."""
        self.segments = segments
        self.fs = segments.fs
        self.page_bytes = page_bytes
        self.itemsize = itemsize
        self.sealer = sealer
        self.live = live
        self.count = count
        self._fd_lock = threading.Lock()
        self._fds: dict[int, list] = {}  # segment -> [fd, pins, retired]
        self._pool = None  # read-ahead thread of raw runs, made on first use

    # -- the fd cache

    def _pin_fd(self, segment_no: int) -> int | None:
        with self._fd_lock:
            ent = self._fds.get(segment_no)
            if ent is None:
                try:
                    fd = self.fs.open_read(self.segments.path(segment_no))
                except FileNotFoundError:
                    return None
                ent = self._fds[segment_no] = [fd, 0, False]
            ent[1] += 1
            return ent[0]

    def _unpin_fd(self, segment_no: int, fd: int) -> None:
        with self._fd_lock:
            ent = self._fds.get(segment_no)
            if ent is not None and ent[0] == fd:
                ent[1] -= 1
                if ent[2] and ent[1] == 0:
                    del self._fds[segment_no]
                    os.close(fd)

    def retire(self, segment_no: int) -> None:
        """The segment is being deleted: close its fd now, or when the last reader unpins it."""
        with self._fd_lock:
            ent = self._fds.get(segment_no)
            if ent is None:
                return
            if ent[1] == 0:
                del self._fds[segment_no]
                os.close(ent[0])
            else:
                ent[2] = True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._fd_lock:
            for fd, _pins, _retired in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()

    def _read_pool(self):
        with self._fd_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvdb-cold-read")
            return self._pool

    # -- reads

    def read_found(self, keys: list[bytes], entries: list, out: np.ndarray, rows, on_ready, lookup):
        """Read ``entries`` (looked up for ``keys``) into ``out``'s rows: key i lands in
        ``out[rows[i]]`` (rows default 0..n-1), read there directly. Returns (found per key,
        hits, misses, corruptions). A key without an entry is a miss; a damaged block is a miss
        and a corruption, its row zeroed (C3); a block whose segment is gone (moved by compaction
        between lookup and read) is looked up again (``lookup``) and read once more.
        ``on_ready(indices)``, when given, is told each hit once, as soon as it is checked: the
        runs' slices while later ones are still being read, then the lone records together."""
        rows = range(len(keys)) if rows is None else rows
        results: list = [None] * len(keys)
        self.read_runs(keys, entries, out, results, rows, on_ready)
        found = [False] * len(keys)
        late = []
        hits = misses = bad = 0
        for i, (key, e) in enumerate(zip(keys, entries)):
            ok = "absent" if e is None else results[i]
            if ok is None:  # not in a run: read alone
                ok = self.read_entry(key, e, out[rows[i]])
                if ok is None:  # its segment is gone: look again once
                    (e2,) = lookup([key])
                    ok = "absent" if e2 is None else bool(self.read_entry(key, e2, out[rows[i]]))
                if ok is True:
                    late.append(i)
            if ok is True:
                found[i] = True
                hits += 1
            else:
                misses += 1
                if ok is False:
                    out[rows[i]] = 0
                    bad += 1
        if late and on_ready is not None:
            on_ready(late)
        return found, hits, misses, bad

    def read_runs(self, keys, entries, out: np.ndarray, results: list, rows=None, on_ready=None) -> None:
        """Raw, unsealed pages whose records lie back to back in a segment are read with one
        preadv per run slice, straight into their rows ``out[rows[i]]`` (the same I/O a plain
        sequential read does; the rows need not be adjacent in ``out``).

        A reader thread goes through the slices back to back (preadv releases the GIL) while
        this thread checks the slices already read, a slice at a time (``check_slice``), and
        hands them to ``on_ready``: the device never waits for a check or a promotion except
        the last slice's."""
        if len(keys) < 2:  # no run: a lone record takes the per-entry path
            return
        rows = range(len(keys)) if rows is None else rows
        want = PUT_PAYLOAD_OFFSET + self.page_bytes
        cand = [(e.segment_no, e.offset, i) for i, e in enumerate(entries)
                if e is not None and e.codec == Codec.RAW and not (e.flags & FLAG_SEALED) and e.record_bytes == want]
        slices = plan_slices(cand, want, max(1, min(IOV_MAX // 2, READ_SLICE_BYTES // want)))
        if not slices:
            return
        pool = self._read_pool() if len(slices) > 1 else None
        pinned: dict[int, int | None] = {}
        jobs = []  # per slice: (key indices, heads, rows, fd, iovecs, offset, read future or None)
        try:
            for seg, off, part in slices:  # every slice submitted up front: the reads go back to back
                if seg not in pinned:
                    pinned[seg] = self._pin_fd(seg)
                fd = pinned[seg]
                if fd is None:
                    continue  # the segment is gone: the per-entry path looks again
                heads = np.empty((len(part), PUT_PAYLOAD_OFFSET), dtype=np.uint8)
                at = [rows[i] for i in part]
                bufs = [b for j, r in enumerate(at) for b in (heads[j], out[r])]
                fut = pool.submit(self._safe_preadv, fd, bufs, off) if pool is not None else None
                jobs.append((part, heads, at, fd, bufs, off, fut))
            for part, heads, at, fd, bufs, off, fut in jobs:
                n = fut.result() if fut is not None else self._safe_preadv(fd, bufs, off)
                ok = check_slice([keys[i] for i in part], [entries[i] for i in part], heads, out, at, n // want)
                for i, good in zip(part, ok):
                    results[i] = good
                    if not good:
                        out[rows[i]] = 0  # C3: zeroed now, whatever on_ready does next
                ready = [i for i, good in zip(part, ok) if good]
                if ready and on_ready is not None:
                    on_ready(ready)
        finally:
            for job in jobs:
                if job[-1] is not None:
                    job[-1].exception()  # never leave a read running into rows the caller reuses
            for seg, fd in pinned.items():
                if fd is not None:
                    self._unpin_fd(seg, fd)

    def read_entry(self, key: bytes, e: iv.BlockEntry, row: np.ndarray):
        """True: row holds the page. False: damaged. None: the segment is gone (retry)."""
        fd = self._pin_fd(e.segment_no)
        if fd is None:
            # GC deleted the segment (C4 stops counting it first): the block moved since the
            # caller looked it up, so look again; a segment the store still counts is damage
            return None if not self.live.is_counted(e.segment_no) else False
        try:
            if e.codec == Codec.RAW and not (e.flags & FLAG_SEALED) \
                    and e.record_bytes == PUT_PAYLOAD_OFFSET + self.page_bytes:
                return self._read_raw(fd, key, e, row)
            return self._read_decoded(fd, key, e, row)
        except OSError:
            # a read error is a miss (counted), not a reason to fail the store
            self.count(read_errors=1)
            return False
        finally:
            self._unpin_fd(e.segment_no, fd)

    def _read_raw(self, fd: int, key: bytes, e: iv.BlockEntry, row: np.ndarray) -> bool:
        head = bytearray(PUT_PAYLOAD_OFFSET)
        n = self.fs.preadv(fd, [head, row], e.offset)  # straight into the caller's row
        if n != e.record_bytes:
            return False
        return check_raw(key, e, head, row)

    def _safe_preadv(self, fd: int, bufs: list, offset: int) -> int:
        try:
            return self.fs.preadv(fd, bufs, offset)
        except OSError:
            return 0

    def _read_decoded(self, fd: int, key: bytes, e: iv.BlockEntry, row: np.ndarray) -> bool:
        buf = self.fs.pread(fd, e.record_bytes, e.offset)
        status, rec = check_record(buf, 0)
        if status != "ok" or rec.crc != e.crc or rec.lsn != e.lsn or rec.rtype != RecordType.PUT_BLOCK \
                or rec.record_bytes != e.record_bytes:
            return False
        try:
            p = decode_put(rec.body)
            if p.key != key or p.raw_bytes != self.page_bytes:
                return False
            payload = p.payload
            if p.flags & FLAG_SEALED:
                if self.sealer is None:
                    return False
                payload = self.sealer.open(payload, aad(key, p.namespace_id, p.position, p.codec))
            decode_page(payload, p.codec, self.itemsize, row)
        except CorruptionError:
            return False
        return True

    def read_record(self, segment_no: int, offset: int, nbytes: int) -> bytes | None:
        """Raw bytes of one record (compaction, verify, export); None when the segment is gone."""
        fd = self._pin_fd(segment_no)
        if fd is None:
            return None
        try:
            return self.fs.pread(fd, nbytes, offset)
        finally:
            self._unpin_fd(segment_no, fd)


__all__ = ["BlockReader", "READ_SLICE_BYTES", "TAIL_SLICE_BYTES", "check_raw", "check_slice", "check_slice_fields", "plan_slices"]
