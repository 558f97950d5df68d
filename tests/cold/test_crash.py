"""Crash tests with the fault-injecting file layer (docs/style.md "Tests", acceptance of issue 3).

Scenario: a fixed workload of puts (none / group / sync), deletes, checkpoints and a
compaction runs once to count its I/O points; then for every point it runs again in a fresh
directory and the machine dies there. Files are rewound to what a crash can leave ("drop":
only synced bytes; "tear": the last write half on disk), and on odd rounds RocksDB is also rolled
back to its last flushed state (its memtable is not logged: invariant C1, kvdb/cold/apply.py).
After reopen:

* every put and delete acknowledged under group / sync (and everything before it in the log)
  is there, bit-exact (W2 in kvdb/wal/commit.py, C2 in kvdb/cold/checkpoint.py);
* the state is exactly the log's state after *some* whole record at or beyond the last
  acknowledgement: no torn or half-written block is ever visible;
* ``verify`` is clean;
* rebuilding the index from the log alone (index/ removed, reopen) gives the very same state
  (invariant C6, kvdb/cold/checkpoint.py: GC never drops a tombstone or metadata a replay
  still needs).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from cold_fixtures import TINY, assert_totals, key, pages_for

from kvdb.cold import ColdStore
from kvdb.errors import KvdbError
from kvdb.fs import FaultFs, SimulatedCrash

KEYS = [key(i) for i in range(12)]


class Model:
    """The log as the test sees it: one entry per record (key -> page or None), and the number
    of records an acknowledgement has made durable."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes | None]] = []
        self.durable = 0

    def put(self, store, keys, salt, durability):
        pages = pages_for(keys, salt)
        # recorded before the call: a crash inside it may leave any prefix of these records
        self.records.extend((k, pages[i].tobytes()) for i, k in enumerate(keys))
        store.put(keys, pages, list(range(len(keys))), durability)
        if durability != "none":
            self.durable = len(self.records)

    def delete(self, store, keys, live, durability):
        gone = [k for k in dict.fromkeys(keys) if k in live]
        self.records.extend((k, None) for k in gone)
        assert store.delete(keys, durability) == len(gone)
        if durability != "none":
            self.durable = len(self.records)

    def state(self, upto: int) -> dict:
        st: dict = {}
        for k, v in self.records[:upto]:
            st[k] = v
        return {k: v for k, v in st.items() if v is not None}


def workload(store: ColdStore, model: Model) -> None:
    live = lambda: model.state(len(model.records))
    model.put(store, KEYS[0:3], 1, "group")
    model.put(store, KEYS[3:5], 1, "none")
    model.put(store, KEYS[5:6], 1, "sync")
    model.delete(store, [KEYS[1], KEYS[11]], live(), "group")
    store.checkpoint()
    model.durable = len(model.records)
    model.put(store, KEYS[0:2], 2, "group")  # overwrites
    model.put(store, KEYS[6:9], 1, "none")
    model.put(store, KEYS[9:10], 1, "sync")
    model.delete(store, KEYS[3:5], live(), "group")
    model.put(store, KEYS[10:12], 1, "group")
    store.compact()
    model.durable = len(model.records)
    model.put(store, KEYS[2:4], 3, "none")
    model.delete(store, [KEYS[0]], live(), "none")
    model.put(store, KEYS[4:6], 3, "group")
    # KEYS[8]'s DELETE lands in a segment that dies (its other records are overwritten) while
    # the older segment holding KEYS[8]'s PUT lives on for KEYS[9]: the checkpoint's GC must
    # carry the tombstone forward (C6) or a rebuilt index brings KEYS[8] back
    for salt in (4, 5):
        model.put(store, KEYS[10:12], salt, "none")
    model.delete(store, [KEYS[8]], live(), "group")
    for salt in (7, 8):
        model.put(store, KEYS[10:12], salt, "none")
    store.checkpoint()
    model.durable = len(model.records)


def open_store(path, fs=None) -> ColdStore:
    # small segments: the workload rotates through several and compaction deletes some
    return ColdStore.open(path, TINY, fs=fs, segment_bytes=1024, flush_interval_s=None)


def observe(store: ColdStore) -> dict:
    out = np.zeros((len(KEYS), TINY.page_bytes), dtype=np.uint8)
    found = store.get_into(KEYS, out)
    assert found == store.contains(KEYS)
    return {k: out[i].tobytes() for i, k in enumerate(KEYS) if found[i]}


def rebuild_and_observe(path, then_put: bool = False) -> dict:
    """Check of C6: the index removed, the store reopened from the log alone; ``then_put``:
    show that the rebuilt store keeps working."""
    shutil.rmtree(path / "index")
    store = open_store(path)
    try:
        got = observe(store)
        rep = store.verify()
        assert rep.ok, rep.problems
        if then_put:
            store.put([KEYS[0]], pages_for([KEYS[0]], 9), None, "sync")
        return got
    finally:
        store.close()


def count_points(tmp_path, close: bool = True) -> int:
    """I/O points of opening the store and running the workload (and closing it)."""
    fs = FaultFs()
    store = open_store(tmp_path / "count", fs)
    model = Model()
    workload(store, model)
    before_close = fs.num_points
    store.close()
    return fs.num_points if close else before_close


def test_workload_without_crash_reads_back(tmp_path):
    # Scenario: the workload alone, then a clean reopen: the final state, verify clean.
    store = open_store(tmp_path / "db")
    model = Model()
    workload(store, model)
    want = model.state(len(model.records))
    store.close()
    store = open_store(tmp_path / "db")
    try:
        assert observe(store) == want
        assert_totals(store)
        assert sorted(want) == [KEYS[i] for i in (1, 2, 3, 4, 5, 6, 7, 9, 10, 11)]
        assert store.verify().ok
        assert store.stats()["segments_deleted"] >= 1  # compaction and checkpoints freed segments
    finally:
        store.close()
    assert rebuild_and_observe(tmp_path / "db") == want


@pytest.mark.slow
def test_crash_at_every_io_point(tmp_path):
    total = count_points(tmp_path)
    assert total > 40  # the workload really does I/O through the fault layer
    for point in range(1, total + 1):
        path = tmp_path / f"p{point}"
        snap = tmp_path / f"snap{point}"
        fs = FaultFs(crash_at=point)

        def snapshot(s, snap=snap):
            # a consistent copy (RocksDB's own checkpoint): a file copy of the live directory
            # races RocksDB's background compaction, which may delete an SST mid-copy
            shutil.rmtree(snap, ignore_errors=True)
            s.index.copy_to(str(snap))

        model = Model()
        crashed = False
        store = None
        try:
            store = open_store(path, fs)
            store.debug_on_index_flush = snapshot
            workload(store, model)
        except (SimulatedCrash, KvdbError):
            crashed = True
        assert crashed or point > total - 3, f"point {point} of {total} did not crash"
        if store is not None:
            store.debug_crash_close()
        mode = "drop" if point % 2 else "tear"
        fs.debug_crash(mode)
        rollback = (point // 2) % 2 == 1 and snap.exists()
        if rollback:
            shutil.rmtree(path / "index")
            shutil.copytree(snap, path / "index")
        store = open_store(path)
        try:
            got = observe(store)
            ok = [n for n in range(model.durable, len(model.records) + 1) if model.state(n) == got]
            assert ok, (f"crash at point {point}/{total} ({mode}, rollback={rollback}): state matches no "
                        f"prefix at or beyond the {model.durable} acknowledged records")
            rep = store.verify()
            assert rep.ok, (point, mode, rollback, rep.problems)
            assert_totals(store)  # the totals read back agree with the entries (C7)
        finally:
            store.close()
        rebuilt = rebuild_and_observe(path, then_put=True)
        assert rebuilt == got, f"crash at point {point}/{total}: the index rebuilt from the log differs"
        shutil.rmtree(path)
        shutil.rmtree(snap, ignore_errors=True)
