"""LogWriter: appends records to the active segment and rotates to a new one when it is full.

States of the writer::

    open --append ok--> open
    open --OSError from the file layer, or fail()--> failed   (sticky: every later call raises DbFailedError)
    open/failed --close()--> closed

Making records durable is kvdb/wal/commit.py's job (group commit, the fsync leader, the native
committer). The writer tells it about the three events that change durability, through hooks
it sets: ``on_sealed(last_lsn)`` once a rotation has fsynced the old segment in full (W3),
``on_segment(path)`` once the new active segment exists, ``on_fail(exc)`` when the log fails.
``sync_active`` is the one fsync of the active segment they all go through (W4).

Invariants
    W1  records are appended in lsn order and lsns are consecutive (format invariant R1).
    W3  a segment is fsynced in full before the next one is created, so only the last segment
        can end in a torn record.
    W4  a segment's fd is closed only when no fsync holds it (``pins``).
    (W2, on ``durable_lsn``, is kvdb/wal/commit.py's.)

Locks
    ``lock``     (re-entrant) guards the active segment, its append offset and next_lsn; the
                 store holds it while it queues index updates, so queue order == lsn order.
                 Nobody may wait for durability while holding it (kvdb/wal/commit.py).
    ``_fail_mu`` makes the first failure the one that sticks.
"""

from __future__ import annotations

import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from kvdb.errors import DbFailedError, StorageIOError
from kvdb.format.record import (
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    buffer_bytes,
    encode_header,
    encode_segment_header,
    seal_rows,
)
from kvdb.fs import IOV_MAX, OsFs
from kvdb.threads import submit_or_none
from kvdb.wal.segments import segment_path

_CRC = struct.Struct("<I")  # a record header's crc field (bytes 4..8)
#: bytes per write of ``append_rows`` (the crcs of the next are computed while one is written)
ROWS_WRITE_BYTES = 4 << 20


class Location(NamedTuple):  # a tuple: built once per record on the append path
    segment_no: int
    offset: int
    record_bytes: int
    crc: int
    lsn: int


class _Segment:
    __slots__ = ("segment_no", "path", "fd", "offset", "pins", "retired")

    def __init__(self, segment_no: int, path: str, fd: int, offset: int) -> None:
        self.segment_no = segment_no
        self.path = path
        self.fd = fd
        self.offset = offset  # bytes in the file (next append goes here)
        self.pins = 0  # fsyncs in flight on fd
        self.retired = False


class LogWriter:
    def __init__(self, fs: OsFs, wal_dir: str, *, segment_no: int, offset: int, next_lsn: int,
                 segment_bytes: int, store_id: bytes | None = None) -> None:
        """Appends resume in ``segment_no`` at ``offset`` (0: create that segment) with
        ``next_lsn`` (kvdb/wal/recovery.py finds all three); every segment it creates carries
        ``store_id`` in its header (None: zeros, a store without an id)."""
        self.fs = fs
        self.store_id = store_id
        self.wal_dir = wal_dir
        self.segment_bytes = segment_bytes
        self.lock = threading.RLock()
        self._fail_mu = threading.Lock()
        self.error: BaseException | None = None  # what failed the log (sticky), None while healthy
        self.next_lsn = next_lsn
        self.closed = False
        # hooks of the durability layer (kvdb/wal/commit.py GroupCommit sets them)
        self.on_sealed = None  # (last lsn of the sealed segment) after its W3 fsync
        self.on_segment = None  # (path of the new active segment)
        self.on_fail = None  # (the error) after the failure is recorded
        self._io: ThreadPoolExecutor | None = None  # append_rows' write thread, made on first need
        try:
            if offset == 0:
                self._active = self._create(segment_no)
            else:
                path = segment_path(wal_dir, segment_no)
                self._active = _Segment(segment_no, path, fs.open_append(path), offset)
        except OSError as e:
            raise StorageIOError(f"cannot open log segment {segment_no} in {wal_dir}: {e}") from e

    # -- segments

    def _create(self, segment_no: int) -> _Segment:
        path = segment_path(self.wal_dir, segment_no)
        fd = self.fs.create(path)
        seg = _Segment(segment_no, path, fd, 0)
        self.fs.writev(fd, path, [encode_segment_header(segment_no, self.next_lsn, self.store_id)])
        seg.offset = SEGMENT_HEADER_BYTES
        self.fs.sync(fd, path)
        self.fs.sync_dir(self.wal_dir)
        return seg

    def _rotate(self) -> None:
        old = self._active
        self.fs.sync(old.fd, old.path)  # W3
        if self.on_sealed is not None:
            self.on_sealed(self.next_lsn - 1)
        self._active = self._create(old.segment_no + 1)
        if self.on_segment is not None:
            self.on_segment(self._active.path)
        old.retired = True
        if old.pins == 0:
            self.fs.close(old.fd)

    @property
    def segment_no(self) -> int:
        return self._active.segment_no

    @property
    def offset(self) -> int:
        return self._active.offset

    @property
    def active_path(self) -> str:
        return self._active.path

    # -- failure

    def check(self) -> None:
        if self.error is not None:
            raise DbFailedError(f"the log failed earlier ({self.error}); close the store and open it again") from None
        if self.closed:
            raise DbFailedError("the log is closed")

    def fail(self, exc: BaseException) -> None:
        """Fail the log (the first error sticks), then tell the durability layer, whose waiters
        wake and see it."""
        with self._fail_mu:
            if self.error is None:
                self.error = exc
        if self.on_fail is not None:
            self.on_fail(exc)

    # -- appends

    def append(self, records: list[tuple[int, list]]) -> list[Location]:
        """Append records given as (type, body buffers); caller holds ``lock``. Returns their
        locations. Buffers are written straight from the caller's memory (writev)."""
        self.check()
        locs: list[Location] = []
        bufs: list = []
        pending = 0
        seg = self._active
        limit = self.segment_bytes
        try:
            for rtype, parts in records:
                body_bytes = 0
                for p in parts:
                    body_bytes += buffer_bytes(p)
                lsn = self.next_lsn
                header = encode_header(rtype, lsn, parts, body_bytes)
                nbytes = RECORD_HEADER_BYTES + body_bytes
                if seg.offset + pending + nbytes > limit and seg.offset + pending > SEGMENT_HEADER_BYTES:
                    if bufs:
                        self.fs.writev(seg.fd, seg.path, bufs, pending)
                        seg.offset += pending
                        bufs, pending = [], 0
                    self._rotate()
                    seg = self._active
                locs.append(Location(seg.segment_no, seg.offset + pending, nbytes, _CRC.unpack_from(header, 4)[0], lsn))
                bufs.append(header)
                bufs.extend(parts)
                pending += nbytes
                self.next_lsn = lsn + 1
            if bufs:
                self.fs.writev(self._active.fd, self._active.path, bufs, pending)
                self._active.offset += pending
        except OSError as e:
            err = StorageIOError(f"writing the log in {self.wal_dir} failed: {e}")
            self.fail(err)
            raise err from e
        return locs

    def append_rows(self, rows, payloads=None) -> tuple[list[tuple[int, int, int, int]], object]:
        """Append a batch of records of one size built by kvdb/format/record.py ``put_rows``
        (``payloads``: their payload rows, when not inside ``rows``); caller holds ``lock``.
        The same bytes, lsns and rotations as ``append`` of the records one by one. Returns the
        runs (segment_no, offset of the first record, its lsn, records) and the crcs.

        The batch goes out in writes of up to ``ROWS_WRITE_BYTES`` (``rows`` slices, or head
        and payload per record as iovecs built natively: kvdb/fs.py ``writev_rows``); while one
        is written (by the writer's I/O thread, GIL released), the next one's lsns and crcs are
        filled in (``seal_rows``): the checksums overlap the kernel's copy instead of adding to
        it. Writes stay in order, one at a time; a rotation waits for the write before it (W3)."""
        self.check()
        n = rows.shape[0]
        rbytes = rows.shape[1] + (0 if payloads is None else payloads.shape[1])
        first = self.next_lsn
        runs: list[list[int]] = []
        crcs = np.empty(n, dtype=np.uint32)
        step = max(1, min(IOV_MAX // 2, ROWS_WRITE_BYTES // rbytes))
        if n > step and self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="kvdb-log-write")
        writing = None  # the write in flight
        try:
            try:
                i = 0
                while i < n:
                    seg = self._active
                    room = (self.segment_bytes - seg.offset) // rbytes
                    if room <= 0 and seg.offset > SEGMENT_HEADER_BYTES:
                        if writing is not None:
                            writing, w = None, writing
                            w.result()
                        self._rotate()
                        continue
                    count = max(1, min(room, n - i, step))
                    j = i + count
                    crcs[i:j] = seal_rows(rows[i:j], first + i, None if payloads is None else payloads[i:j])
                    if payloads is None:
                        write, args = self.fs.writev, (seg.fd, seg.path, [rows[i:j].reshape(-1)], count * rbytes)
                    else:  # head and payload per record, the iovecs built natively (kvdb/fs.py)
                        write, args = self.fs.writev_rows, (seg.fd, seg.path, rows[i:j], payloads[i:j], count * rbytes)
                    if writing is not None:
                        writing, w = None, writing
                        w.result()
                    writing = submit_or_none(self._io, write, *args) if n > step else None
                    if writing is None:  # one write, or a pool that takes no work at exit: inline
                        write(*args)
                    if runs and runs[-1][0] == seg.segment_no:
                        runs[-1][3] += count
                    else:
                        runs.append([seg.segment_no, seg.offset, first + i, count])
                    seg.offset += count * rbytes
                    i = j
                    self.next_lsn = first + i
            finally:
                if writing is not None:  # never leave a write running behind a failure
                    writing.result()
        except OSError as e:
            err = StorageIOError(f"writing the log in {self.wal_dir} failed: {e}")
            self.fail(err)
            raise err from e
        return [tuple(r) for r in runs], crcs  # type: ignore[misc]

    # -- the fsync

    def sync_active(self) -> int:
        """fsync the active segment; returns the last lsn it covers (W4: the fd is pinned, so
        a rotation meanwhile does not close it under the fsync). The durability layer's
        leaders call it (kvdb/wal/commit.py)."""
        with self.lock:
            self.check()
            seg = self._active
            seg.pins += 1
            target = self.next_lsn - 1
        try:
            self.fs.sync(seg.fd, seg.path)
        finally:
            with self.lock:
                seg.pins -= 1
                if seg.retired and seg.pins == 0:
                    self.fs.close(seg.fd)
        return target

    def close(self) -> None:
        """Close the active segment's fd (the durability layer stops first). Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self._io is not None:
                self._io.shutdown(wait=True)
            try:
                self.fs.close(self._active.fd)
            except OSError:
                pass


__all__ = ["Location", "LogWriter"]
