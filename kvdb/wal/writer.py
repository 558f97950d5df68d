"""LogWriter: appends records to the active segment and makes them durable with group commit.

States of the writer::

    open --append/sync ok--> open
    open --OSError from the file layer--> failed   (sticky: every later call raises DbFailedError)
    open/failed --close()--> closed

Group commit (the ``group`` durability mode). A writer appends under ``lock`` and then calls
``sync_to(its_lsn)``. If no fsync is running it becomes the leader: it notes the last lsn
written so far, fsyncs, publishes ``durable_lsn`` and wakes the others. If one is running it
waits; when that fsync ends either it already covered the waiter's lsn (done, no fsync of its
own) or the waiter becomes the next leader and covers everyone who appended meanwhile. So N
concurrent writers share about one fsync per fsync-time, and nobody waits for a timer.
``sync_to(lsn, own=True)`` (the ``sync`` mode) fsyncs at once without joining a group.

Invariants
    W1  records are appended in lsn order and lsns are consecutive (format invariant R1).
    W2  ``durable_lsn`` only grows, and every record with lsn <= durable_lsn has been fsynced.
    W3  a segment is fsynced in full before the next one is created, so only the last segment
        can end in a torn record.
    W4  a segment's fd is closed only when no fsync holds it (``pins``).

Locks
    ``lock``   (re-entrant) guards the active segment, its append offset and next_lsn; the
               store holds it while it queues index updates, so queue order == lsn order.
    ``_cond``  guards durable_lsn, _syncing and _failed.
    Nesting: ``lock`` is never taken while ``_cond`` is held; the leader releases ``_cond``
    before it captures the segment under ``lock``, and nobody may call ``sync_to`` while
    holding ``lock`` (a follower waiting there would block the leader).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass

from kvdb.errors import DbFailedError, StorageIOError
from kvdb.format.record import SEGMENT_HEADER_BYTES, buffer_bytes, encode_header, encode_segment_header, segment_name
from kvdb.wal.fs import OsFs


@dataclass(frozen=True)
class Location:
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
                 segment_bytes: int, on_durable=None) -> None:
        self.fs = fs
        self.wal_dir = wal_dir
        self.segment_bytes = segment_bytes
        self.on_durable = on_durable  # called with the new durable lsn after each fsync
        self.lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._syncing = False
        self._failed: BaseException | None = None
        self.next_lsn = next_lsn
        self.durable_lsn = next_lsn - 1
        self.num_fsyncs = 0
        self.closed = False
        # writers between "about to append" and "appended" (``arriving()``); a group leader
        # waits up to ``max_gather_s`` for them so that one fsync covers them too
        # one entry per writer on its way (deque append/pop are atomic in CPython: no lock on
        # the hot path)
        self._arriving: collections.deque = collections.deque()
        self.max_gather_s = 0.0005
        try:
            if offset == 0:
                self._active = self._create(segment_no)
            else:
                path = os.path.join(wal_dir, segment_name(segment_no))
                self._active = _Segment(segment_no, path, fs.open_append(path), offset)
        except OSError as e:
            raise StorageIOError(f"cannot open log segment {segment_no} in {wal_dir}: {e}") from e

    # -- segments

    def _create(self, segment_no: int) -> _Segment:
        path = os.path.join(self.wal_dir, segment_name(segment_no))
        fd = self.fs.create(path)
        seg = _Segment(segment_no, path, fd, 0)
        self.fs.writev(fd, path, [encode_segment_header(segment_no, self.next_lsn)])
        seg.offset = SEGMENT_HEADER_BYTES
        self.fs.sync(fd, path)
        self.fs.sync_dir(self.wal_dir)
        return seg

    def _rotate(self) -> None:
        old = self._active
        self.fs.sync(old.fd, old.path)  # W3
        self.num_fsyncs += 1
        with self._cond:
            self.durable_lsn = max(self.durable_lsn, self.next_lsn - 1)
        self._active = self._create(old.segment_no + 1)
        old.retired = True
        if old.pins == 0:
            self.fs.close(old.fd)

    @property
    def segment_no(self) -> int:
        return self._active.segment_no

    @property
    def offset(self) -> int:
        return self._active.offset

    # -- failure

    def check(self) -> None:
        if self._failed is not None:
            raise DbFailedError(f"the log failed earlier ({self._failed}); close the store and open it again") from None
        if self.closed:
            raise DbFailedError("the log is closed")

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = exc
            self._cond.notify_all()

    # -- appends

    def append(self, records: list[tuple[int, list]]) -> list[Location]:
        """Append records given as (type, body buffers); caller holds ``lock``. Returns their
        locations. Buffers are written straight from the caller's memory (writev)."""
        self.check()
        locs: list[Location] = []
        bufs: list = []
        pending = 0
        try:
            for rtype, parts in records:
                body_bytes = sum(buffer_bytes(p) for p in parts)
                header = encode_header(rtype, self.next_lsn, parts, body_bytes)
                nbytes = len(header) + body_bytes
                seg = self._active
                if seg.offset + pending + nbytes > self.segment_bytes and seg.offset + pending > SEGMENT_HEADER_BYTES:
                    if bufs:
                        self.fs.writev(seg.fd, seg.path, bufs, pending)
                        seg.offset += pending
                        bufs, pending = [], 0
                    self._rotate()
                    seg = self._active
                crc = int.from_bytes(header[4:8], "little")
                locs.append(Location(seg.segment_no, seg.offset + pending, nbytes, crc, self.next_lsn))
                bufs.append(header)
                bufs.extend(parts)
                pending += nbytes
                self.next_lsn += 1
            if bufs:
                self.fs.writev(self._active.fd, self._active.path, bufs, pending)
                self._active.offset += pending
        except OSError as e:
            err = StorageIOError(f"writing the log in {self.wal_dir} failed: {e}")
            self.fail(err)
            raise err from e
        return locs

    # -- durability

    def arrive(self) -> object:
        """The store announces a writer on its way to ``append``; returns its token."""
        token = object()
        self._arriving.append(token)
        return token

    def arrived(self, token: object) -> None:
        """The writer holding ``token`` has appended (or given up)."""
        self._arriving.remove(token)

    def _gather(self) -> None:
        """Leader: wait (at most max_gather_s) for the writers that were already on their way
        when it took the lead -- not for later ones, or a busy log would always wait."""
        snapshot = list(self._arriving)
        if not snapshot:
            return
        deadline = time.perf_counter() + self.max_gather_s
        arriving = self._arriving
        while time.perf_counter() < deadline and any(t in arriving for t in snapshot):
            time.sleep(0)

    def sync_to(self, lsn: int, own: bool = False) -> int:
        """Return once every record up to ``lsn`` is fsynced (W2). ``own``: fsync now, alone."""
        if not own:
            with self._cond:
                while True:
                    if self._failed is not None:
                        self.check()
                    if self.durable_lsn >= lsn:
                        return self.durable_lsn
                    if not self._syncing:
                        self._syncing = True
                        break
                    self._cond.wait()
        if not own:
            self._gather()
        try:
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
        except OSError as e:
            err = StorageIOError(f"fsync of the log in {self.wal_dir} failed: {e}")
            self.fail(err)
            if not own:
                with self._cond:
                    self._syncing = False
                    self._cond.notify_all()
            raise err from e
        except BaseException as e:
            self.fail(e)
            if not own:
                with self._cond:
                    self._syncing = False
                    self._cond.notify_all()
            raise
        with self._cond:
            self.num_fsyncs += 1
            self.durable_lsn = max(self.durable_lsn, target)
            if not own:
                self._syncing = False
            self._cond.notify_all()
        if self.on_durable is not None:
            self.on_durable(target)
        return target

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.fs.close(self._active.fd)
            except OSError:
                pass
