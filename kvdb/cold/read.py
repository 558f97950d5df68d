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
from kvdb.threads import submit_or_none
from kvdb.types import KEY_BYTES

READ_SLICE_BYTES = 4 << 20  # raw runs are read and checked in slices of this many bytes
RUN_NOT_READ = -1  # read_runs' state of a key it did not read
TAIL_SLICE_BYTES = 256 << 10  # ... the last one cut down in halves to about this many


def check_raw(key: bytes, e: iv.BlockEntry, head: bytearray, row: np.ndarray) -> bool:
    """C3 for a raw page read into ``row`` after its record's ``head``."""
    length, crc, rtype, lsn = RECORD_HEADER.unpack_from(head, 0)
    if (length + RECORD_HEADER_BYTES != e.record_bytes or crc != e.crc or rtype != RecordType.PUT_BLOCK
            or lsn != e.lsn or head[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + KEY_BYTES] != key):
        return False
    return native.crc32c(row, native.crc32c(memoryview(head)[8:])) == crc


def check_fields(kv: np.ndarray, record_bytes: np.ndarray, crcs: np.ndarray, lsns: np.ndarray,
                 heads: np.ndarray, out: np.ndarray, rows, whole: int) -> np.ndarray:
    """``check_raw`` of every record of a slice read back to back, the header fields compared
    for the whole slice at once and the crcs in one native call (GIL released): a bool array.
    ``kv``: the keys as one "V16" array; ``record_bytes``, ``crcs``, ``lsns``: the index
    entries' fields, one per key (as in kvdb/format/index_value.py ``ENTRY_DTYPE``); ``heads``
    uint8 [k, PUT_PAYLOAD_OFFSET] the records' leading bytes, ``out[rows[j]]`` the page read
    after head j (``out`` C-contiguous [m, page]); ``whole``: how many records the read
    returned in full (the rest are misses)."""
    k = len(kv)
    h = heads[:k].view(PUT_HEAD_DTYPE).reshape(k)
    good = (h["length"].astype(np.int64) + RECORD_HEADER_BYTES == record_bytes) \
        & (h["crc"] == crcs) \
        & (h["type"] == RecordType.PUT_BLOCK) \
        & (h["lsn"] == lsns) \
        & (h["key"] == kv)
    good[whole:] = False
    w = min(k, whole)  # the records read in full: their crcs in one native call
    good[:w] &= native.crc32c_heads_pages(heads, 8, out, rows[:w]) == h["crc"][:w]
    return good


def run_bounds(seg: np.ndarray, off: np.ndarray, want: int) -> list[tuple[int, int]]:
    """(first, end) of each stretch of records of ``want`` bytes lying back to back in one
    segment, in the given order (``seg``, ``off``: int64 arrays, one per record)."""
    cut = (np.flatnonzero((seg[1:] != seg[:-1]) | (off[1:] != off[:-1] + want)) + 1).tolist()
    return list(zip([0, *cut], [*cut, len(seg)]))


def plan_slices(seg: np.ndarray, off: np.ndarray, idx: np.ndarray, want: int,
                per: int) -> list[tuple[int, int, np.ndarray]]:
    """The reads of ``read_runs``: raw records of ``want`` bytes at ``seg[j]``, ``off[j]`` (int64
    arrays, any order), ``idx[j]`` their key indices. Records back to back in a segment form a
    run (a lone record is left to the per-entry path); runs are cut into slices of at most
    ``per`` records, in file order, except the last ``per`` records of the last run: they are
    cut in halves down to TAIL_SLICE_BYTES (63 records of 64 KiB pages become 31, 16, 8, 4, 2,
    2), so that what is checked and promoted after the last read completes is a small piece,
    not a whole slice. Returns (segment, offset, key indices) per slice."""
    order = np.lexsort((off, seg))  # stable: a key listed twice keeps its order
    seg, off, idx = seg[order], off[order], idx[order]
    runs = [(a, z) for a, z in run_bounds(seg, off, want) if z - a > 1]
    slices = []
    tail = max(1, TAIL_SLICE_BYTES // want)
    for r, (a, z) in enumerate(runs):
        s0, o0 = int(seg[a]), int(off[a])
        body = (z - a) - min(z - a, per) if r == len(runs) - 1 else z - a
        slices.extend((s0, o0 + b * want, idx[a + b : a + min(b + per, body)]) for b in range(0, body, per))
        b = body
        while z - a - b > tail:
            h = (z - a - b) // 2
            slices.append((s0, o0 + b * want, idx[a + b : a + b + h]))
            b += h
        if z - a > b:
            slices.append((s0, o0 + b * want, idx[a + b : z]))
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
        state = self.read_runs(keys, entries, out, rows, on_ready)
        if state is None:  # no run (a lone key, say): every key is read alone
            results = [RUN_NOT_READ] * len(keys)
        elif (state == 1).all():  # every key read in a run and checked good
            return [True] * len(keys), len(keys), 0, 0
        else:
            results = state.tolist()
        found = [False] * len(keys)
        late = []
        hits = misses = bad = 0
        for i, (key, e) in enumerate(zip(keys, entries)):
            if e is None:
                ok = "absent"
            elif results[i] != RUN_NOT_READ:  # read in a run: 1 good, 0 damaged
                ok = results[i] == 1
            else:  # not in a run: read alone
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

    def read_runs(self, keys, entries, out: np.ndarray, rows, on_ready=None) -> np.ndarray | None:
        """Raw, unsealed pages whose records lie back to back in a segment are read with one
        preadv per run slice, straight into their rows ``out[rows[i]]`` (the same I/O a plain
        sequential read does; the rows need not be adjacent in ``out``). Returns the state per
        key (int8): 1 read and checked, 0 damaged (its row zeroed), RUN_NOT_READ for the others
        (absent, not raw, alone, or in a segment gone since); None when there is no run at all.

        A reader thread goes through the slices back to back (the native preadv releases the
        GIL) while this thread checks the slices already read, a slice at a time
        (``check_fields``), and hands them to ``on_ready``: the device never waits for a check
        or a promotion except the last slice's. Entries, slices and checks are arrays: no
        Python step per record."""
        if len(keys) < 2:  # no run: a lone record takes the per-entry path
            return None
        want = PUT_PAYLOAD_OFFSET + self.page_bytes
        tab, present = iv.entry_table(entries)
        idx = np.flatnonzero(present & (tab["codec"] == Codec.RAW) & ((tab["flags"] & FLAG_SEALED) == 0)
                             & (tab["record_bytes"] == want))
        slices = plan_slices(tab["segment_no"][idx].astype(np.int64), tab["offset"][idx].astype(np.int64), idx,
                             want, max(1, min(IOV_MAX // 2, READ_SLICE_BYTES // want)))
        if not slices:
            return None
        state = np.full(len(keys), RUN_NOT_READ, dtype=np.int8)
        at_rows = np.arange(rows.start, rows.stop, rows.step) if type(rows) is range else np.asarray(rows, dtype=np.int64)
        kv = np.frombuffer(b"".join(keys), dtype="V16")
        pool = self._read_pool() if len(slices) > 1 else None
        pinned: dict[int, int | None] = {}
        jobs = []  # per slice: (key indices, heads, rows, read future or None, fd, offset)
        try:
            for seg, off, part in slices:  # every slice submitted up front: the reads go back to back
                if seg not in pinned:
                    pinned[seg] = self._pin_fd(seg)
                fd = pinned[seg]
                if fd is None:
                    continue  # the segment is gone: the per-entry path looks again
                heads = np.empty((len(part), PUT_PAYLOAD_OFFSET), dtype=np.uint8)
                at = at_rows[part]
                fut = submit_or_none(pool, self._safe_preadv_rows, fd, heads, out, at, off)  # None: read inline below
                jobs.append((part, heads, at, fut, fd, off))
            for part, heads, at, fut, fd, off in jobs:
                n = fut.result() if fut is not None else self._safe_preadv_rows(fd, heads, out, at, off)
                e = tab[part]
                good = check_fields(kv[part], e["record_bytes"].astype(np.int64), e["crc"], e["lsn"], heads, out,
                                    at, n // want)
                state[part] = good
                if not good.all():
                    out[at[~good]] = 0  # C3: zeroed now, whatever on_ready does next
                if on_ready is not None and good.any():
                    on_ready(part[good].tolist())
        finally:
            for job in jobs:
                if job[3] is not None:
                    job[3].exception()  # never leave a read running into rows the caller reuses
            for seg, fd in pinned.items():
                if fd is not None:
                    self._unpin_fd(seg, fd)
        return state

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

    def _safe_preadv_rows(self, fd: int, heads: np.ndarray, out: np.ndarray, rows: np.ndarray, offset: int) -> int:
        try:
            return self.fs.preadv_rows(fd, heads, out, rows, offset)
        except OSError:
            self.count(read_errors=1)  # counted as read_entry counts one: the slice's records are misses
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


__all__ = ["BlockReader", "READ_SLICE_BYTES", "RUN_NOT_READ", "TAIL_SLICE_BYTES", "check_fields", "check_raw",
           "plan_slices", "run_bounds"]
