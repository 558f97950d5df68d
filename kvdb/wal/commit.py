"""Group commit: how appended records become durable, all in one place.

Three layers, top to bottom:

1. The commit queue (``commit``; LevelDB's writer queue). A ``group`` put of the cold store joins
   it with its batch. The writer at its front is the leader: it first gathers -- waits at most
   ``max_gather_s`` until as many batches are queued as its previous round had (their writers
   are on their way back) -- then appends every queued batch through its owner's hook
   ``append_batches(batches) -> last lsn`` (one writev for all: kvdb/cold/store.py), waits for
   one fsync covering them (2 or 3), wakes their writers and hands the lead to the queue's
   front (a leader that went on committing would starve its own caller). The others neither
   append nor take any lock but the queue's: they sleep once, each on its own wake-up lock. The
   put that completes a gathering round takes the lead over at once (it is running already;
   waking the gatherer would put one more thread switch in series with everyone's commit).
2. The fsync leader (``sync_to``, the default). A waiter for lsn L: if no fsync is running it
   becomes the leader: it notes the last lsn written so far, fsyncs (``LogWriter.sync_active``)
   and publishes ``durable_lsn``. If one is running it queues itself as a waiter on its own
   wake-up lock (no notify_all herd, no spinning) and sleeps. After each fsync the leader wakes
   exactly the waiters it covered; if others appended meanwhile it fsyncs again for them (up to
   ``max_lead_rounds`` times, then it hands the lead to one of them). So N concurrent writers
   share about one fsync per fsync-time, and nobody waits for a timer.
   ``sync_to(lsn, own=True)`` (the ``sync`` mode) fsyncs at once without joining a group.
3. The native committer (``native_commit=True``, opt-in; the real ``OsFs`` and the compiled core
   only), the native twin of 2: no Python thread leads, a C thread (native/kvdb_native.c "group
   commit", invariants K1-K4) fsyncs the active segment once for everyone waiting and wakes
   exactly the waiters it covered; ``sync_to`` is one call that blocks with the GIL released.
   Appends, rotations, the ``own`` fsync and every failure stay in Python and are handed to it
   (``publish``, ``set_path``, ``fail``). The Python leader of 2 is the default: measured in the
   same runs, it commits 4-16 % more group puts per second when fsync takes 0.16-0.21 ms (the
   committer's thread is one more wake-up between a leader's append and its fsync), while the
   committer is ~20 % ahead when fsync takes ~60 us (docs/durability.md). FaultFs cannot be
   used with it: its counted and failing I/O points are Python calls, which the C thread
   bypasses.

After each fsync ``on_durable(lsn)`` runs (the cold store applies its index queue there), unless
the caller asked ``notify=False`` to run it itself; the commit queue's leader does, after it
has woken its writers.

Failure is the writer's state (kvdb/wal/writer.py): it is recorded there first, then the writer's
``on_fail`` hook wakes every waiter here, who sees it. A waiter never retries an fsync after
one failed (the kernel may have dropped the dirty pages, so a later fsync could succeed
without them).

Invariants
    W2  ``durable_lsn`` only grows, and every record with lsn <= durable_lsn has been fsynced.
    (W1, W3, W4 are the writer's: kvdb/wal/writer.py.)

Locks (in the order they may nest)
    ``_gq_mu``     the commit queue: _gq, _gq_busy, _gq_expect, _gq_want (nothing blocks while
                   holding it).
    writer.lock    appends (``append_batches``), and each fsync's capture of the active segment.
    ``_mu``        _durable_lsn, _syncing, _waiters, _num_fsyncs. Taken under writer.lock when a
                   rotation publishes; writer.lock is never taken while ``_mu`` is held, and
                   nobody may call ``sync_to`` holding writer.lock (a waiter sleeping there would
                   block the leader).
"""

from __future__ import annotations

import errno
import threading

from kvdb import native
from kvdb.errors import InvalidInput, StorageIOError
from kvdb.fs import OsFs
from kvdb.wal.writer import LogWriter

_allocate_lock = threading.Lock


class GroupCommit:
    def __init__(self, writer: LogWriter, *, append_batches=None, check=None, on_durable=None,
                 native_commit: bool = False, gather_s: float = 0.0, commit_workers: int = 1) -> None:
        """Durability for ``writer``'s records.

        ``append_batches(batches) -> last lsn``: the owner's append of queued ``commit``
        batches (called by the queue's leader, holding no lock). ``check()``: raises the
        owner's error for a writer whose batch failed under another leader (default: the
        writer's). ``on_durable(lsn)``: called after each fsync (see the module doc).
        ``native_commit``: fsync in the native committer (needs the compiled core and the plain
        OsFs); ``gather_s``: how long that committer waits for the writers it last woke (0:
        the commit queue gathers, and the fsync starts at once); ``commit_workers``: its fsync
        threads (see native/kvdb_native.c for why one is the default)."""
        self.writer = writer
        self.append_batches = append_batches
        self.check = check if check is not None else writer.check
        self.on_durable = on_durable
        # the fsync leader (2)
        self._mu = threading.Lock()
        self._syncing = False  # a leader is fsyncing (or the lead is being handed over)
        self._waiters: list[list] = []  # [lsn, lock, leads] of writers waiting for a leader
        self._durable_lsn = writer.next_lsn - 1  # the Python path's; the committer keeps its own
        self._num_fsyncs = 0  # fsyncs done by Python threads
        # fsyncs one leader does back to back before it hands the lead on (its own caller
        # waits meanwhile; the others are woken after each fsync that covers them)
        self.max_lead_rounds = 8
        # the commit queue (1)
        self._gq_mu = threading.Lock()
        self._gq: list[list] = []  # [batch, wake-up lock, leads, error] of waiting commits
        self._gq_busy = False  # a writer is leading the queue (or the lead is being handed on)
        self._gq_expect = 1  # size of the last committed round
        self._gq_want = 0  # a gathering leader waits until this many batches are queued
        self.max_gather_s = 0.0005
        # the native committer (3)
        self.committer: native.Committer | None = None
        if native_commit and (not native.HAVE_NATIVE or type(writer.fs) is not OsFs):
            writer.close()
            raise InvalidInput("native_commit needs the compiled core (kvdb._native) and the plain OsFs "
                               "file layer (a fault-injecting one cannot see the committer's fsyncs)")
        if native_commit:
            try:
                self.committer = native.Committer(writer.active_path, self._durable_lsn, gather_s, commit_workers)
            except OSError as e:
                writer.close()
                raise StorageIOError(f"cannot start the log committer in {writer.wal_dir}: {e}") from e
        writer.on_sealed = self._sealed
        writer.on_segment = self._new_segment
        writer.on_fail = self._wake_failed

    @property
    def durable_lsn(self) -> int:
        """Every record with lsn <= this is fsynced (W2)."""
        c = self.committer
        return self._durable_lsn if c is None else c.durable_lsn

    @property
    def num_fsyncs(self) -> int:
        c = self.committer
        return self._num_fsyncs + (0 if c is None else c.num_fsyncs)

    @property
    def queued(self) -> int:
        """Commits waiting in the queue (not counting a leader's round in flight)."""
        return len(self._gq)

    @property
    def waiting(self) -> int:
        """Writers asleep until an fsync covers them (the Python path)."""
        return len(self._waiters)

    # -- the writer's hooks

    def _sealed(self, last_lsn: int) -> None:
        """A rotation fsynced the old segment in full (W3): everything in it is durable."""
        with self._mu:
            self._num_fsyncs += 1
            self._publish(last_lsn)

    def _new_segment(self, path: str) -> None:
        if self.committer is not None:
            self.committer.set_path(path)  # K3: its workers open it themselves

    def _wake_failed(self, exc: BaseException) -> None:
        with self._mu:
            waiters, self._waiters = self._waiters, []
        for w in waiters:
            w[1].release()  # they see the failure
        if self.committer is not None:
            self.committer.fail(errno.EIO)  # its waiters wake, find the writer failed and raise

    # -- 1. the commit queue

    def commit(self, batch) -> int | None:
        """Append ``batch`` (through ``append_batches``) and return once it is durable. Returns
        the durable lsn to the leader that committed it (the caller then runs its own
        ``on_durable`` step, see the module doc), None to a writer another leader committed."""
        req = [batch, _allocate_lock(), False, None]  # batch, wake-up lock, lead, error
        req[1].acquire()
        with self._gq_mu:
            self._gq.append(req)
            if not self._gq_busy:
                self._gq_busy = True
                lead, gathered = True, False
            elif self._gq_want and len(self._gq) >= self._gq_want:
                self._gq_want = 0  # the gatherer is a follower in this round now
                lead, gathered = True, True
            else:
                lead = False
        if not lead:
            return self._follow(req)
        return self._lead_queue(req, gathered)

    def _follow(self, req: list) -> int | None:
        req[1].acquire()  # released when the round is durable or failed, or the lead is ours
        if req[2]:
            req[2] = False
            return self._lead_queue(req, False)
        self._follow_done(req)
        return None

    def _follow_done(self, req: list) -> None:
        if req[3] is not None:
            self.check()
            raise req[3]

    def _lead_queue(self, mine: list, gathered: bool) -> int | None:
        """Gather, commit the queue in one round, then pass the lead to the queue's front."""
        if not gathered:
            with self._gq_mu:
                if len(self._gq) < self._gq_expect:
                    self._gq_want = self._gq_expect
                    gathered = None  # wait below
            if gathered is None:
                if mine[1].acquire(timeout=self.max_gather_s):
                    self._follow_done(mine)  # taken over, and already committed
                    return None
                with self._gq_mu:
                    taken = self._gq_want == 0
                    self._gq_want = 0
                if taken:
                    return self._follow(mine)
        with self._gq_mu:
            batch, self._gq = self._gq, []
        err: BaseException | None = None
        durable = None
        try:
            last = self.append_batches([req[0] for req in batch])
            durable = self.sync_to(last, notify=False)  # the caller's on_durable step runs after the wake-ups
        except BaseException as e:
            self.writer.fail(e)
            err = e
        with self._gq_mu:
            self._gq_expect = len(batch)
            heir = None
            if err is not None:
                batch.extend(self._gq)  # they fail the same way
                self._gq = []
            if self._gq:
                heir = self._gq[0]
                heir[2] = True  # _gq_busy stays True: the lead passes straight on
            else:
                self._gq_busy = False
        for req in batch:
            if req is not mine:
                req[3] = err
                req[1].release()
        if heir is not None:
            heir[1].release()
        if err is not None:
            raise err
        return durable

    # -- 2. the fsync leader (3 when the native committer runs)

    def _publish(self, target: int) -> None:
        """Caller holds ``_mu``: ``durable_lsn`` grows to ``target`` (W2)."""
        if target > self._durable_lsn:
            self._durable_lsn = target
        if self.committer is not None:
            self.committer.publish(target)

    def _failure(self, e: BaseException) -> BaseException:
        """Fail the log by ``e`` (an OSError becomes StorageIOError) before anyone is woken."""
        err = e
        if isinstance(e, OSError):
            err = StorageIOError(f"fsync of the log in {self.writer.wal_dir} failed: {e}")
        self.writer.fail(err)
        return err

    def sync_to(self, lsn: int, own: bool = False, notify: bool = True) -> int:
        """Return once every record up to ``lsn`` is fsynced (W2); returns the durable lsn.
        ``own``: fsync now, alone. ``notify=False``: the caller runs ``on_durable`` itself."""
        if own:
            try:
                target = self.writer.sync_active()
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
        writer = self.writer
        while True:
            mu.acquire()
            if writer.error is not None:
                mu.release()
                writer.check()
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
        writer = self.writer
        if writer.error is not None:
            writer.check()
        try:
            durable = self.committer.wait(lsn)
        except OSError as e:  # the committer's fsync failed (K2), or a failure woke us
            if writer.error is not None:
                writer.check()
            err = self._failure(e)
            raise err from e
        except native.CommitterClosed:
            writer.check()
            raise
        if notify and self.on_durable is not None:
            self.on_durable(durable)
        return durable

    def _lead(self, notify: bool) -> int:
        """The fsync leader: fsync, wake exactly the waiters it covered, and go on with the
        ones that appended during that fsync (at most ``max_lead_rounds`` fsyncs, then hand
        the lead to one of them). ``on_durable`` runs once, at the end."""
        mu = self._mu
        writer = self.writer
        rounds = 0
        target = self._durable_lsn
        while True:
            synced = False
            try:
                if writer.next_lsn - 1 > self._durable_lsn:
                    target = writer.sync_active()
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
        """Stop the native committer (K4: what its waiters are owed is fsynced first), then
        close the writer. Idempotent."""
        with self.writer.lock:
            if self.writer.closed:
                return
            if self.committer is not None:
                self.committer.stop()
            self.writer.close()


__all__ = ["GroupCommit"]
