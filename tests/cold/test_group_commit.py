"""Group commit (kvdb/wal/commit.py): the commit queue (``group`` puts from many threads share one
append and one fsync) and the fsync leader's waiters. The file layer's fsync is held open by a
fault-injecting OsFs, so which writers share which fsync is decided by the test, not by thread
timing. ``native_commit=True`` runs the native committer (native/kvdb_native.c) instead of the
Python leader/follower; its tests are at the end: agreement with the Python path byte for byte,
many writers, injected EIO/ENOSPC, close while writers wait."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest
from cold_fixtures import TINY, key, pages_for

from kvdb import native
from kvdb.cold.store import ColdStore
from kvdb.errors import DbFailedError, InvalidInput, StorageIOError
from kvdb.format.record import RecordType, encode_meta
from kvdb.fs import OsFs
from kvdb.wal.commit import GroupCommit
from kvdb.wal.writer import LogWriter

FOLLOWERS = 7


class HeldSyncFs(OsFs):
    """OsFs whose next fsync, once ``holding`` is set, waits for ``release``; with
    ``fail_after_hold`` the fsync after that one fails with EIO (a fake only to inject faults)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.holding = False
        self.fail_after_hold = False
        self._fail_next = False
        self.syncs = 0

    def sync(self, fd: int, path: str) -> None:
        self.syncs += 1
        if self.holding:
            self.holding = False
            self.entered.set()
            assert self.release.wait(30)
            super().sync(fd, path)
            self._fail_next = self.fail_after_hold
            return
        if self._fail_next:
            self._fail_next = False
            raise OSError(errno.EIO, "injected fsync error")
        super().sync(fd, path)


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _run_group(store: ColdStore, fs: HeldSyncFs, fail_second: bool) -> tuple[list, list]:
    """Thread 0 leads and is held in its fsync while 7 more group puts queue behind it; then
    the fsync is let go. Returns (outcome per thread, keys per thread)."""
    keys = [[key(100 + 10 * t + i) for i in range(2)] for t in range(1 + FOLLOWERS)]
    outcome: list = [None] * (1 + FOLLOWERS)

    def put(t: int) -> None:
        try:
            store.put(keys[t], pages_for(keys[t]), None, "group")
            outcome[t] = "ok"
        except DbFailedError:
            outcome[t] = "failed"
        except StorageIOError:
            outcome[t] = "io error"

    fs.holding = True
    fs.fail_after_hold = fail_second
    first = threading.Thread(target=put, args=(0,))
    first.start()
    assert fs.entered.wait(30)
    others = [threading.Thread(target=put, args=(t,)) for t in range(1, 1 + FOLLOWERS)]
    for th in others:
        th.start()
    _wait_for(lambda: store.commit.queued == FOLLOWERS, "the queued group puts")
    fs.release.set()
    for th in [first, *others]:
        th.join(30)
    return outcome, keys


def test_writers_queued_behind_an_fsync_share_the_next_append_and_fsync(tmp_path):
    # Scenario: one group put is in its fsync; 7 more (2 pages each) queue meanwhile. When the
    # fsync ends, all 7 are committed by one fsync, and every page reads back after a reopen.
    fs = HeldSyncFs()
    store = ColdStore.open(tmp_path / "s", TINY, fs=fs, flush_interval_s=None)
    try:
        before_syncs = fs.syncs
        before = store.stats()["fsyncs"]
        outcome, keys = _run_group(store, fs, fail_second=False)
        assert outcome == ["ok"] * (1 + FOLLOWERS)
        assert store.stats()["fsyncs"] - before == 2
        assert fs.syncs - before_syncs == 2
        assert store.stats()["puts"] == 2 * (1 + FOLLOWERS)
    finally:
        store.close()
    with ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None) as store:
        all_keys = [k for ks in keys for k in ks]
        out = np.zeros((len(all_keys), TINY.page_bytes), np.uint8)
        assert store.get_into(all_keys, out) == [True] * len(all_keys)
        assert (out == pages_for(all_keys)).all()


def test_a_failed_group_fsync_fails_every_queued_writer_and_keeps_the_acknowledged(tmp_path):
    # Scenario: as above, but the fsync that covers the 7 queued puts fails with EIO: the one
    # leading them gets the StorageIOError, the 6 others DbFailedError, the store is failed,
    # and the first put (acknowledged before the error) survives a reopen.
    fs = HeldSyncFs()
    store = ColdStore.open(tmp_path / "s", TINY, fs=fs, flush_interval_s=None)
    try:
        outcome, keys = _run_group(store, fs, fail_second=True)
        assert outcome[0] == "ok"
        assert sorted(outcome[1:]) == ["failed"] * (FOLLOWERS - 1) + ["io error"]
        assert store.failed
        with pytest.raises(DbFailedError):
            store.put([key(1)], pages_for([key(1)]), None, "group")
    finally:
        store.close()
    with ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None) as store:
        out = np.zeros((2, TINY.page_bytes), np.uint8)
        assert store.get_into(keys[0], out) == [True, True]
        assert (out == pages_for(keys[0])).all()
        assert store.verify().ok


class SlowSyncFs(OsFs):
    """fsync takes at least 0.2 ms, so that group puts gather and take the lead over."""

    def sync(self, fd: int, path: str) -> None:
        time.sleep(0.0002)
        super().sync(fd, path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["python", "native"])
def test_many_writers_with_deletes_and_sync_puts_all_commit_and_read_back(tmp_path, path):
    # Scenario: 8 threads x 60 group puts, one thread of sync puts and one deleting under
    # group, all at once (the Python path over a slow fsync, the native committer over the
    # real one, small segments so that rotations happen meanwhile). Every call returns, and
    # after a reopen exactly the last acknowledged state is there (the deleted keys absent,
    # every other page exact).
    if path == "native" and not native.HAVE_NATIVE:
        pytest.skip("compiled core not built")
    fs = SlowSyncFs() if path == "python" else OsFs()
    store = ColdStore.open(tmp_path / "s", TINY, fs=fs, flush_interval_s=None, segment_bytes=16 << 10,
                           native_commit=path == "native")
    assert (store.commit.committer is not None) == (path == "native")
    group_keys = [[key(1000 + 100 * t + i) for i in range(60)] for t in range(8)]
    sync_keys = [key(5000 + i) for i in range(30)]
    doomed = [k for ks in group_keys for k in ks[:5]]
    errors: list = []
    deleted: list = []

    def run(fn) -> None:
        try:
            fn()
        except BaseException as e:  # reported below
            errors.append(e)

    def group_writer(ks: list[bytes]) -> None:
        for k in ks:
            store.put([k], pages_for([k]), None, "group")

    def sync_writer() -> None:
        for k in sync_keys:
            store.put([k], pages_for([k]), None, "sync")

    def deleter() -> None:
        while len(deleted) < len(doomed):
            live = [k for k in doomed if k not in deleted and store.contains([k])[0]]
            for k in live:
                assert store.delete([k], "group") == 1
                deleted.append(k)
            time.sleep(0.001)

    threads = [threading.Thread(target=run, args=(lambda ks=ks: group_writer(ks),)) for ks in group_keys]
    threads += [threading.Thread(target=run, args=(sync_writer,)), threading.Thread(target=run, args=(deleter,))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(50)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert sorted(deleted) == sorted(doomed)
    store.close()
    with ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None) as store:
        kept = [k for ks in group_keys for k in ks[5:]] + sync_keys
        out = np.zeros((len(kept), TINY.page_bytes), np.uint8)
        assert store.get_into(kept, out) == [True] * len(kept)
        assert (out == pages_for(kept)).all()
        assert store.contains(doomed) == [False] * len(doomed)
        assert store.stats()["pages"] == len(kept)
        assert store.verify().ok


class FailingHeldSyncFs(OsFs):
    """After ``arm()``, the next fsync waits for ``release`` and then fails with EIO."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.syncs_after_arm = 0

    def sync(self, fd: int, path: str) -> None:
        if not self.armed:
            return super().sync(fd, path)
        self.syncs_after_arm += 1
        if self.syncs_after_arm == 1:
            self.entered.set()
            assert self.release.wait(30)
            raise OSError(errno.EIO, "injected fsync error")
        return super().sync(fd, path)


def test_a_writer_waiting_on_a_failed_fsync_fails_and_never_fsyncs_again(tmp_path):
    # Scenario: writer A's group fsync is in flight when writer B appends and waits for it;
    # the fsync fails. A gets the StorageIOError, B DbFailedError, and nobody retries the
    # fsync (after a failed fsync the kernel may have dropped the pages: a retry could
    # "succeed" and acknowledge records that are gone).
    fs = FailingHeldSyncFs()
    (tmp_path / "wal").mkdir()
    w = LogWriter(fs, str(tmp_path / "wal"), segment_no=1, offset=0, next_lsn=1, segment_bytes=1 << 20)
    c = GroupCommit(w)
    fs.armed = True
    outcome: dict = {}

    def writer(name: str) -> None:
        with w.lock:
            (loc,) = w.append([(RecordType.SESSION, [encode_meta(name.encode(), b"v")])])
        try:
            c.sync_to(loc.lsn)
            outcome[name] = "ok"
        except DbFailedError:
            outcome[name] = "failed"
        except StorageIOError as e:
            outcome[name] = f"io error: {errno.errorcode[e.__cause__.errno]}"

    a = threading.Thread(target=writer, args=("a",))
    a.start()
    assert fs.entered.wait(30)
    b = threading.Thread(target=writer, args=("b",))
    b.start()
    _wait_for(lambda: c.waiting == 1, "writer b to wait for the fsync")
    fs.release.set()
    a.join(30)
    b.join(30)
    assert outcome == {"a": "io error: EIO", "b": "failed"}
    assert fs.syncs_after_arm == 1
    assert c.durable_lsn == 0
    c.close()


# ---------------------------------------------------------------- the native committer

needs_native = pytest.mark.skipif(not native.HAVE_NATIVE, reason="compiled core kvdb._native not built")


def _workload(store: ColdStore) -> None:
    """One thread, every kind of append: group / sync / none puts, deletes, metadata, a
    checkpoint, rotations (small segments)."""
    for i in range(40):
        ks = [key(10 * i + j) for j in range(1 + i % 3)]
        store.put(ks, pages_for(ks, salt=i % 2), list(range(len(ks))), ("group", "sync", "none")[i % 3])
        if i % 7 == 6:
            store.delete([key(10 * (i - 3))], "group")
        if i % 11 == 10:
            store.put_metadata("session", b"s%d" % i, b"v%d" % i, "group")
        if i == 20:
            store.checkpoint()
    store.flush()


@needs_native
def test_native_committer_writes_the_same_log_as_the_python_path(tmp_path):
    # Scenario: the same single-threaded workload through both paths. The segment files are
    # identical byte for byte (same records, lsns, rotations), and so are the reads and stats.
    results = {}
    for name in ("native", "python"):
        store = ColdStore.open(tmp_path / name, TINY, flush_interval_s=None, segment_bytes=2048,
                               native_commit=name == "native")
        assert (store.commit.committer is not None) == (name == "native")
        _workload(store)
        all_keys = [key(k) for k in range(400)]
        out = np.zeros((len(all_keys), TINY.page_bytes), np.uint8)
        found = store.get_into(all_keys, out)
        st = store.stats()
        store.close()
        wal = tmp_path / name / "wal"
        segs = {p.name: p.read_bytes() for p in sorted(wal.iterdir())}
        results[name] = (segs, found, out, st["pages"], st["durable_lsn"])
    (n_segs, n_found, n_out, n_pages, n_lsn), (p_segs, p_found, p_out, p_pages, p_lsn) = results["native"], results["python"]
    assert len(n_segs) > 3  # rotations happened
    assert n_segs == p_segs
    assert n_found == p_found and sum(n_found) > 0
    assert (n_out == p_out).all()
    assert (n_pages, n_lsn) == (p_pages, p_lsn)


@needs_native
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_native_fsync_error_is_typed_sticky_and_loses_nothing_acknowledged(tmp_path, err):
    # Scenario: 4 writers put under group; after their first round the committer's next fsync
    # fails (injected in C, as the device would fail it). Every writer waiting on it gets a
    # StorageIOError or DbFailedError, no later fsync acknowledges anything (K2), every later
    # call raises DbFailedError, and after a reopen every acknowledged page reads back exact.
    store = ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None, native_commit=True)
    c = store.commit.committer
    acked = [key(1000 + t) for t in range(4)]
    for k in acked:
        store.put([k], pages_for([k]), None, "group")
    durable = store.durable_lsn
    c.debug_fail_next(err)
    outcome: list = [None] * 4

    def put(t: int) -> None:
        k = key(2000 + t)
        try:
            store.put([k], pages_for([k]), None, "group")
            outcome[t] = "ok"
        except DbFailedError:
            outcome[t] = "failed"
        except StorageIOError as e:
            outcome[t] = errno.errorcode[e.__cause__.errno]

    threads = [threading.Thread(target=put, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert "ok" not in outcome
    assert errno.errorcode[err] in outcome
    assert store.failed and c.error == err
    assert store.durable_lsn == durable
    with pytest.raises(DbFailedError):
        store.put([key(1)], pages_for([key(1)]), None, "group")
    with pytest.raises(DbFailedError):
        store.flush()
    store.close()
    with ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None) as store:
        out = np.zeros((len(acked), TINY.page_bytes), np.uint8)
        assert store.get_into(acked, out) == [True] * len(acked)
        assert (out == pages_for(acked)).all()
        assert store.verify().ok


@needs_native
@pytest.mark.timeout(60)
def test_close_while_native_waiters_are_blocked_returns_everyone(tmp_path):
    # Scenario: 8 writers put under group in a loop while the main thread closes the store.
    # Nobody hangs; every put either returned (then it is durable: it reads back after a
    # reopen) or raised a kvdb error (the store was closed under it).
    store = ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None, native_commit=True)
    acked: list[list[bytes]] = [[] for _ in range(8)]
    errors: list = []
    started = threading.Barrier(9)

    def writer(t: int) -> None:
        started.wait()
        try:
            for i in range(10_000):
                k = key(100_000 * (t + 1) + i)
                store.put([k], pages_for([k]), None, "group")
                acked[t].append(k)
        except (DbFailedError, InvalidInput, StorageIOError) as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    started.wait()
    _wait_for(lambda: sum(map(len, acked)) >= 200, "some acknowledged puts")
    store.close()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert len(errors) == 8  # each writer ran into the closed store
    done = [k for ks in acked for k in ks]
    with ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None) as store:
        out = np.zeros((len(done), TINY.page_bytes), np.uint8)
        assert store.get_into(done, out) == [True] * len(done)
        assert (out == pages_for(done)).all()
        assert store.verify().ok


def test_native_commit_refuses_a_fault_injecting_file_layer(tmp_path):
    # its fsyncs would bypass the layer's counted and failing I/O points
    with pytest.raises(InvalidInput):
        ColdStore.open(tmp_path / "s", TINY, fs=SlowSyncFs(), flush_interval_s=None, native_commit=True)


@pytest.mark.parametrize("durability", ["group", "sync"])
def test_durable_listeners_hear_every_commit_before_the_put_returns(tmp_path, durability):
    # Scenario: with the background flusher off, a listener is told the durable lsn by each
    # group or sync put before that put returns (log shipping wakes its streams on it; the
    # index update of a group put may still be queued), and nothing after it is removed.
    heard: list[int] = []
    with ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None) as store:
        store.add_durable_listener(heard.append)
        for i in range(3):
            store.put([key(i)], pages_for([key(i)]), durability=durability)
            assert heard and heard[-1] == store.durable_lsn, (i, heard)
        n = len(heard)
        store.remove_durable_listener(heard.append)
        store.put([key(9)], pages_for([key(9)]), durability=durability)
        assert len(heard) == n
