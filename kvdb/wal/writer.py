"""LogWriter: appends records to the active segment and makes them durable with group commit.

States of the writer::

    open --append/sync ok--> open
    open --OSError from the file layer--> failed   (sticky: every later call raises DbFailedError)
    open/failed --close()--> closed

Group commit (the ``group`` durability mode). A writer appends under ``lock`` and then calls
``sync_to(its_lsn)``. If no fsync is running it becomes the leader: it notes the last lsn
written so far, fsyncs and publishes ``durable_lsn``. If one is running it queues itself as a
waiter (its own wake-up lock: no notify_all herd, no spinning) and sleeps. After each fsync the
leader wakes exactly the waiters it covered; if others appended meanwhile it fsyncs again for
them (up to ``max_lead_rounds`` times, then it hands the lead to one of them). So N concurrent
writers share about one fsync per fsync-time, and nobody waits for a timer. (The cold store
batches ``group`` puts in front of this, kvdb/cold/store.py ``_put_group``.)
``sync_to(lsn, own=True)`` (the ``sync`` mode) fsyncs at once without joining a group.

The native committer (``native_commit=True``, opt-in; the real ``OsFs`` and the compiled core
only). Then no Python thread leads: a C thread (native/kvdb_native.c "group commit", invariants
K1-K4) fsyncs the active segment once for everyone waiting and wakes exactly the waiters it
covered; ``sync_to`` is one call that blocks with the GIL released. Appends, rotations, the ``own`` fsync and every failure stay here and
are handed to it (``publish``, ``set_path``, ``fail``). The leader/follower path above is its
pure-Python twin and the default: measured in the same runs, it commits 4-16 % more group puts
per second when fsync takes 0.16-0.21 ms (the committer's thread is one more wake-up between a
leader's append and its fsync), while the committer is ~20 % ahead when fsync takes ~60 us
(docs/durability.md). FaultFs cannot be used with it: its counted and failing I/O points are
Python calls, which the C thread bypasses.

Invariants
    W1  records are appended in lsn order and lsns are consecutive (format invariant R1).
    W2  ``durable_lsn`` only grows, and every record with lsn <= durable_lsn has been fsynced.
    W3  a segment is fsynced in full before the next one is created, so only the last segment
        can end in a torn record.
    W4  a segment's fd is closed only when no fsync holds it (``pins``).

Locks
    ``lock``   (re-entrant) guards the active segment, its append offset and next_lsn; the
               store holds it while it queues index updates, so queue order == lsn order.
    ``_mu``    guards _durable_lsn, _syncing, _waiters and _failed.
    Nesting: ``lock`` is never taken while ``_mu`` is held; the leader releases ``_mu``
    before it captures the segment under ``lock``, and nobody may call ``sync_to`` while
    holding ``lock`` (a waiter sleeping there would block the leader).
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from typing import NamedTuple

from kvdb import native
from kvdb.errors import DbFailedError, InvalidInput, StorageIOError
from kvdb.format.record import (
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    buffer_bytes,
    encode_header,
    encode_segment_header,
    segment_name,
)
from kvdb.fs import OsFs

_allocate_lock = threading.Lock
_CRC = struct.Struct("<I")  # a record header's crc field (bytes 4..8)


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
                 segment_bytes: int, on_durable=None, native_commit: bool = False,
                 gather_s: float = 0.0, commit_workers: int = 1) -> None:
        """``native_commit``: fsync group commits in the native committer (needs the compiled
        core and the plain OsFs); False keeps the Python leader/follower.
        ``gather_s``: how long the native committer waits for the writers it last woke (0:
        the cold store gathers its group puts in its own queue, and the fsync starts at once);
        ``commit_workers``: its fsync threads (more than one lets fsyncs overlap; see
        native/kvdb_native.c for why one is the default)."""
        self.fs = fs
        self.wal_dir = wal_dir
        self.segment_bytes = segment_bytes
        self.on_durable = on_durable  # called with the new durable lsn after each fsync
        self.lock = threading.RLock()
        self._mu = threading.Lock()  # guards _durable_lsn, _syncing, _waiters, _failed
        self._syncing = False  # a leader is fsyncing (or the lead is being handed over)
        self._waiters: list[list] = []  # [lsn, lock, leads] of writers waiting for a leader
        self._failed: BaseException | None = None
        self.next_lsn = next_lsn
        self._durable_lsn = next_lsn - 1  # the Python path's; the committer keeps its own
        self._num_fsyncs = 0  # fsyncs done by Python threads
        self.committer: native.Committer | None = None
        self.closed = False
        # fsyncs one leader does back to back before it hands the lead on (its own caller
        # waits meanwhile; the others are woken after each fsync that covers them)
        self.max_lead_rounds = 8
        try:
            if offset == 0:
                self._active = self._create(segment_no)
            else:
                path = os.path.join(wal_dir, segment_name(segment_no))
                self._active = _Segment(segment_no, path, fs.open_append(path), offset)
        except OSError as e:
            raise StorageIOError(f"cannot open log segment {segment_no} in {wal_dir}: {e}") from e
        if native_commit and (not native.HAVE_NATIVE or type(fs) is not OsFs):
            fs.close(self._active.fd)
            raise InvalidInput("native_commit needs the compiled core (kvdb._native) and the plain OsFs "
                               "file layer (a fault-injecting one cannot see the committer's fsyncs)")
        if native_commit:
            try:
                self.committer = native.Committer(self._active.path, self._durable_lsn, gather_s, commit_workers)
            except OSError as e:
                fs.close(self._active.fd)
                raise StorageIOError(f"cannot start the log committer in {wal_dir}: {e}") from e

    @property
    def durable_lsn(self) -> int:
        """Every record with lsn <= this is fsynced (W2)."""
        c = self.committer
        return self._durable_lsn if c is None else c.durable_lsn

    @property
    def num_fsyncs(self) -> int:
        c = self.committer
        return self._num_fsyncs + (0 if c is None else c.num_fsyncs)

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
        with self._mu:
            self._num_fsyncs += 1
            self._publish(self.next_lsn - 1)
        self._active = self._create(old.segment_no + 1)
        if self.committer is not None:
            self.committer.set_path(self._active.path)  # K3: its workers open it themselves
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
        with self._mu:
            if self._failed is None:
                self._failed = exc
            waiters, self._waiters = self._waiters, []
        for w in waiters:
            w[1].release()  # they see the failure
        if self.committer is not None:
            self.committer.fail(errno.EIO)  # its waiters wake, find _failed set and raise

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

    # -- durability

    def _publish(self, target: int) -> None:
        """Caller holds ``_mu``: ``durable_lsn`` grows to ``target`` (W2)."""
        if target > self._durable_lsn:
            self._durable_lsn = target
        if self.committer is not None:
            self.committer.publish(target)

    def _fsync_active(self) -> int:
        """fsync the active segment; returns the last lsn it covers (W4: the fd is pinned)."""
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

    def _failure(self, e: BaseException) -> BaseException:
        """Mark the log failed by ``e`` (an OSError becomes StorageIOError) before anyone is
        woken: a waiter must never retry an fsync after one failed (the kernel may have
        dropped the dirty pages, so a later fsync can succeed without them)."""
        err = e
        if isinstance(e, OSError):
            err = StorageIOError(f"fsync of the log in {self.wal_dir} failed: {e}")
        self.fail(err)
        return err

    def sync_to(self, lsn: int, own: bool = False, notify: bool = True) -> int:
        """Return once every record up to ``lsn`` is fsynced (W2); returns the durable lsn.
        ``own``: fsync now, alone. ``notify=False``: the caller runs ``on_durable`` itself
        (after it has woken its own waiters)."""
        if own:
            try:
                target = self._fsync_active()
            except BaseException as e:
                err = self._failure(e)
                if err is e:
                    raise
                raise err from e
            with self._mu:
                self._num_fsyncs += 1
                self._publish(target)
            if notify and self.on_durable is not None:
                self.on_durable(target)
            return target
        if self.committer is not None:
            return self._wait_native(lsn, notify)
        mu = self._mu
        while True:
            mu.acquire()
            if self._failed is not None:
                mu.release()
                self.check()
            if self._durable_lsn >= lsn:
                mu.release()
                return self._durable_lsn
            if not self._syncing:
                self._syncing = True
                mu.release()
                return self._lead(notify)
            waiter = [lsn, _allocate_lock(), False]  # lsn, wake-up lock, "you lead now"
            waiter[1].acquire()
            self._waiters.append(waiter)
            mu.release()
            waiter[1].acquire()  # released by the leader (covered, or leadership handed over)
            if waiter[2]:
                return self._lead(notify)

    def _wait_native(self, lsn: int, notify: bool) -> int:
        if self._failed is not None:
            self.check()
        try:
            durable = self.committer.wait(lsn)
        except OSError as e:  # the committer's fsync failed (K2), or fail() woke us
            if self._failed is not None:
                self.check()
            err = self._failure(e)
            raise err from e
        except native.CommitterClosed:
            self.check()
            raise
        if notify and self.on_durable is not None:
            self.on_durable(durable)
        return durable

    def _lead(self, notify: bool) -> int:
        """The group leader: fsync, wake exactly the waiters it covered, and go on with the
        ones that appended during that fsync (at most ``max_lead_rounds`` fsyncs, then hand
        the lead to one of them). Index updates are applied once, at the end."""
        mu = self._mu
        rounds = 0
        target = self._durable_lsn
        while True:
            synced = False
            try:
                if self.next_lsn - 1 > self._durable_lsn:
                    target = self._fsync_active()
                    synced = True
                    rounds += 1
            except BaseException as e:
                err = self._failure(e)  # wakes the waiters, who see the failure
                with mu:
                    self._syncing = False
                if err is e:
                    raise
                raise err from e
            mu.acquire()
            if synced:
                self._num_fsyncs += 1
            self._publish(target)
            durable = self._durable_lsn
            woken = [w for w in self._waiters if w[0] <= durable]
            if woken:
                self._waiters = rest = [w for w in self._waiters if w[0] > durable]
            else:
                rest = self._waiters
            heir = None
            again = bool(rest) and rounds < self.max_lead_rounds
            if not again:
                if rest:
                    heir = rest.pop(0)
                    heir[2] = True  # _syncing stays True: the lead passes straight on
                else:
                    self._syncing = False
            mu.release()
            for w in woken:
                w[1].release()
            if heir is not None:
                heir[1].release()
            if not again:
                break
        if notify and self.on_durable is not None and rounds:
            self.on_durable(durable)
        return durable

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.committer is not None:
                self.committer.stop()  # K4: what its waiters are owed is fsynced first
            try:
                self.fs.close(self._active.fd)
            except OSError:
                pass
