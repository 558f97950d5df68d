"""Automatic compaction (ColdStore ``max_space_amp``, ``maybe_compact``; the Db's default).

Overwritten and deleted blocks leave dead bytes in their segments; past ``max_space_amp`` x the
live bytes (and one segment's worth of garbage) the store compacts on its own, and every live
block still reads back bit-exact."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from cold_fixtures import TINY, key, pages_for

import kvdb
from kvdb.cold import checkpoint as checkpoint_mod
from kvdb.cold.store import ColdStore
from kvdb.errors import InvalidInput

SEG = 8 << 10  # 8 KiB segments: ~45 tiny records each


def _open(path, **kw):
    kw.setdefault("segment_bytes", SEG)
    kw.setdefault("flush_interval_s", None)
    return ColdStore.open(path, TINY, **kw)


def _read_all(store, keys):
    out = np.zeros((len(keys), TINY.page_bytes), dtype=np.uint8)
    ok = store.get_into(keys, out)
    return ok, out


def _overwrite(store, keys, rounds):
    for salt in range(rounds):
        store.put(keys, pages_for(keys, salt), durability="group")
    return pages_for(keys, rounds - 1)


def test_overwrites_past_the_bound_are_compacted_and_read_back_exact(tmp_path):
    s = _open(tmp_path / "c", max_space_amp=2.0)
    keys = [key(i) for i in range(60)]
    want = _overwrite(s, keys, 6)  # 6 versions: ~5/6 of the log is dead
    before = s.space()
    assert before["log_bytes"] > 2.0 * before["live_bytes"] and before["dead_bytes"] >= SEG
    out = s.maybe_compact()
    assert out is not None and out["segments_deleted"] >= 1 and out["bytes_reclaimed"] > 0
    after = s.space()
    assert after["log_bytes"] < before["log_bytes"]
    # what is left: the live bytes, segments under half dead, and the active segment
    assert after["log_bytes"] <= 2.0 * after["live_bytes"] + 2 * SEG
    assert s.stats()["auto_compactions"] == 1
    assert s.maybe_compact() is None  # nothing due any more
    ok, got = _read_all(s, keys)
    assert all(ok) and np.array_equal(got, want)
    assert s.verify().problems == []
    s.close()
    s = _open(tmp_path / "c")  # and after a reopen
    ok, got = _read_all(s, keys)
    assert all(ok) and np.array_equal(got, want)
    assert s.stats()["auto_compactions"] == 1  # saved with the other counters
    s.close()


def test_deletes_make_space_amp_too(tmp_path):
    s = _open(tmp_path / "c", max_space_amp=1.5)
    keys = [key(i) for i in range(200)]
    s.put(keys, pages_for(keys), durability="group")
    s.delete(keys[::2], durability="group")  # every other block of every segment dies
    assert s.maybe_compact() is not None
    ok, got = _read_all(s, keys[1::2])
    assert all(ok) and np.array_equal(got, pages_for(keys)[1::2])
    assert not any(s.contains(keys[::2]))
    s.close()


def test_under_the_bound_nothing_runs(tmp_path):
    s = _open(tmp_path / "c", max_space_amp=4.0)
    keys = [key(i) for i in range(60)]
    _overwrite(s, keys, 3)  # ~2/3 dead: amplification ~3 < 4
    assert s.maybe_compact() is None
    assert s.stats()["auto_compactions"] == 0
    s.close()
    s = _open(tmp_path / "d", max_space_amp=None)
    _overwrite(s, keys, 6)
    assert s.maybe_compact() is None  # off
    s.close()


@pytest.mark.parametrize("bad", [1.0, 0.5, -2, float("nan"), float("inf"), True, "2"])
def test_bad_bounds_are_refused(tmp_path, bad):
    with pytest.raises(InvalidInput, match="max_space_amp"):
        _open(tmp_path / "c", max_space_amp=bad)
    before = threading.active_count()
    for disk_bytes in (None, 0):  # checked by the Db itself, before any thread starts
        with pytest.raises(InvalidInput, match="max_space_amp"):
            kvdb.open(tmp_path / "db", layout=TINY, model_id="t", host_bytes=1 << 16, disk_bytes=disk_bytes,
                      max_space_amp=bad)
    assert threading.active_count() == before


def test_a_held_log_is_not_compacted_in_a_loop(tmp_path):
    # a log reader (a replication slot) that has confirmed nothing keeps every segment: one
    # compaction moves the live blocks out, then the next waits until the log grew a segment
    s = _open(tmp_path / "c", max_space_amp=2.0)
    s.set_retention(lambda: 0)
    keys = [key(i) for i in range(60)]
    want = _overwrite(s, keys, 6)
    assert s.maybe_compact() is not None
    n_segments = s.stats()["segments"]
    assert s.maybe_compact() is None  # held: nothing to gain until the log grows
    assert s.stats()["segments"] == n_segments
    more = [key(1000 + i) for i in range(120)]
    s.put(more, pages_for(more), durability="group")  # > one segment more
    assert s.maybe_compact() is not None  # allowed again (and finds nothing to copy)
    ok, got = _read_all(s, keys)
    assert all(ok) and np.array_equal(got, want)
    s.close()


def test_the_flusher_compacts_while_writers_run(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_mod, "AUTO_COMPACT_CHECK_S", 0.0)
    s = _open(tmp_path / "c", max_space_amp=2.0, flush_interval_s=0.005)
    keys = [key(i) for i in range(60)]
    errors: list[BaseException] = []
    stop = threading.Event()
    latest = {}

    def writer():
        salt = 0
        try:
            while not stop.is_set():
                s.put(keys, pages_for(keys, salt), durability="group")
                latest["salt"] = salt
                salt += 1
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 60
    while s.stats()["auto_compactions"] < 2 and time.monotonic() < deadline and not errors:
        time.sleep(0.01)
    stop.set()
    t.join()
    assert not errors
    assert s.stats()["auto_compactions"] >= 2
    ok, got = _read_all(s, keys)
    assert all(ok) and np.array_equal(got, pages_for(keys, latest["salt"]))
    s.close()
    s = _open(tmp_path / "c")
    assert s.verify().problems == []
    s.close()


def test_the_db_compacts_its_disk_tier_by_default(tmp_path):
    db = kvdb.open(tmp_path / "db", layout=TINY, model_id="t", host_bytes=1 << 16, disk_bytes=1 << 20)
    cold = db._cold
    assert cold.max_space_amp == 2.0
    db.close()
    db = kvdb.open(tmp_path / "db", layout=TINY, model_id="t", host_bytes=1 << 16, disk_bytes=1 << 20, max_space_amp=None)
    assert db._cold.max_space_amp is None
    db.close()


def test_a_log_that_shrank_is_watched_again(tmp_path):
    # held: the run cannot shrink the log, the next waits; released and checkpointed: the log
    # shrinks, and the next overwrites past the bound are compacted without waiting for the
    # log to regrow to its held size
    s = _open(tmp_path / "c", max_space_amp=2.0)
    s.set_retention(lambda: 0)
    keys = [key(i) for i in range(60)]
    _overwrite(s, keys, 8)
    assert s.maybe_compact() is not None
    held = s.space()["log_bytes"]
    s.set_retention(None)
    s.checkpoint()  # the slot let go: the dead segments go
    assert s.space()["log_bytes"] < held / 2
    assert s.maybe_compact() is None  # the flusher's next look: under the bound, and it saw the log shrink
    want = _overwrite(s, keys, 4)
    assert s.space()["log_bytes"] < held
    assert s.maybe_compact() is not None
    ok, got = _read_all(s, keys)
    assert all(ok) and np.array_equal(got, want)
    s.close()


def test_a_bound_under_two_is_reached(tmp_path):
    # overwrite every third block: every sealed segment is about a third dead, under the half
    # that the default bound asks before copying; a bound of 1.2 copies segments 1/6 dead
    s = _open(tmp_path / "c", max_space_amp=1.2)
    keys = [key(i) for i in range(300)]
    s.put(keys, pages_for(keys), durability="group")
    s.put(keys[::3], pages_for(keys[::3], 1), durability="group")
    sp = s.space()
    assert sp["log_bytes"] > 1.2 * sp["live_bytes"] and sp["reclaimable_bytes"] >= SEG
    assert s.maybe_compact() is not None
    after = s.space()
    assert after["log_bytes"] <= 1.2 * after["live_bytes"] + SEG  # + the active segment
    want = pages_for(keys)
    want[::3] = pages_for(keys[::3], 1)
    ok, got = _read_all(s, keys)
    assert all(ok) and np.array_equal(got, want)
    s.close()
    s = _open(tmp_path / "d", max_space_amp=2.0)  # the default bound: a third dead is left alone
    s.put(keys, pages_for(keys), durability="group")
    s.put(keys[::3], pages_for(keys[::3], 1), durability="group")
    assert s.space()["reclaimable_bytes"] == 0 and s.maybe_compact() is None
    s.close()


def test_eviction_follows_the_log_and_moved_blocks_count_from_their_copy(tmp_path):
    # under disk_bytes the oldest records of the log go first (kvdb/cold/live.py): a block that
    # compaction copied to the log's head is as young as its copy, younger than blocks written
    # before the compaction
    s = _open(tmp_path / "c", max_space_amp=2.0, disk_bytes=64000)  # ~350 tiny records
    old = [key(i) for i in range(40)]
    hot = [key(1000 + i) for i in range(40)]
    for r in range(10):  # each segment: a few old blocks among hot versions that die
        s.put(old[4 * r:4 * r + 4], pages_for(old[4 * r:4 * r + 4]), durability="group")
        s.put(hot, pages_for(hot, r), durability="group")
    middle = [key(2000 + i) for i in range(100)]  # written after the old ones, dense segments
    s.put(middle, pages_for(middle), durability="group")
    before = s.writer.next_lsn
    out = s.maybe_compact()
    assert out is not None and out["records_copied"] >= 30  # the old blocks moved to the log's head
    assert s.stats()["evictions"] == 0
    with s.writer.lock:
        order = [c[0] for c in s.live.scan()]  # the live blocks in log order
    moved = {k for k, e in zip(old, s.lookup(old)) if e.lsn >= before}
    assert len(moved) >= 30 and set(order[-len(moved):]) == moved  # the copies are the youngest
    newer = [key(3000 + i) for i in range(220)]  # over the bound by ~47 blocks
    for i in range(0, len(newer), 20):
        s.put(newer[i:i + 20], pages_for(newer[i:i + 20]), durability="group")
    evicted = s.stats()["evictions"]
    assert 40 < evicted < 80
    assert [not a for a in s.contains(order)] == [True] * evicted + [False] * (len(order) - evicted)
    assert any(not a for a in s.contains(middle)) and all(s.contains(list(moved)))
    assert all(s.contains(newer)) and s.stats()["bytes"] <= 64000
    s.close()


def test_an_auto_compaction_survives_a_crash_in_the_counters(tmp_path):
    s = _open(tmp_path / "c", max_space_amp=2.0)
    keys = [key(i) for i in range(60)]
    _overwrite(s, keys, 6)
    assert s.maybe_compact() is not None
    s.debug_crash_close()
    s = _open(tmp_path / "c")
    assert s.stats()["auto_compactions"] == 1  # saved by the run's own checkpoint
    s.close()


def test_close_stops_a_running_compaction_between_chunks(tmp_path, monkeypatch):
    from kvdb.cold import compact as compact_mod

    monkeypatch.setattr(compact_mod, "CHUNK_BYTES", 1)  # one block per chunk
    s = _open(tmp_path / "c", max_space_amp=2.0)
    keys = [key(i) for i in range(200)]
    s.put(keys, pages_for(keys), durability="group")
    s.delete(keys[::2], durability="group")
    moved = []
    real = compact_mod._move_chunk

    def move_then_stop(store, seg, chunk, out):
        moved.append(len(chunk))
        store.ckpt.stopping.set()  # as close() does
        return real(store, seg, chunk, out)

    monkeypatch.setattr(compact_mod, "_move_chunk", move_then_stop)
    out = s.maybe_compact()
    assert out is not None and len(moved) == 1 and out["records_copied"] == 1
    s.close()
    s = _open(tmp_path / "c")
    ok, got = _read_all(s, keys[1::2])
    assert all(ok) and np.array_equal(got, pages_for(keys)[1::2])
    assert s.verify().problems == []
    s.close()
