"""Opening without a scan (issue 12, item 1; C7 in kvdb/cold/apply.py): an open reads the
per-segment live totals back from the index and replays only the log after ``Mapplied``; it
never decodes the index entry of every block. A legacy index (no ``Mapplied``) is scanned once
and carries its totals from then on; a bounded store evicts in log order after a reopen."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvdb.cold import ColdStore
from kvdb.cold import index as index_module
from kvdb.cold.index import Index
from kvdb.errors import CorruptionError
from kvdb.format import index_value as iv

from cold_fixtures import TINY, assert_totals, key, pages_for

RECORD_BYTES = 53 + TINY.page_bytes


def _open(path, **kw) -> ColdStore:
    return ColdStore.open(path, TINY, flush_interval_s=None, segment_bytes=64 << 10, **kw)


def _fill(path, n: int, **kw) -> list[bytes]:
    keys = [key(i) for i in range(n)]
    with _open(path, **kw) as s:
        for i in range(0, n, 500):
            s.put(keys[i:i + 500], pages_for(keys[i:i + 500]), durability="none")
    return keys


@pytest.fixture
def decoded(monkeypatch):
    """Counts the index entries decoded (every per-block read of the index goes through here)."""
    calls = {"n": 0}
    real = iv.decode_entry

    def counting(buf):
        calls["n"] += 1
        return real(buf)

    monkeypatch.setattr(iv, "decode_entry", counting)
    monkeypatch.setattr(index_module, "decode_entry", counting)
    return calls


def test_a_clean_reopen_decodes_no_entry_per_block(tmp_path, decoded):
    keys = _fill(tmp_path, 3000)
    decoded["n"] = 0
    with _open(tmp_path) as s:
        opened = decoded["n"]
        st = s.stats()
        assert st["pages"] == 3000 and st["bytes"] == 3000 * RECORD_BYTES
        assert st["segments"] >= 5  # the totals span several segments
        assert_totals(s)
        assert all(s.contains(keys[::97]))
    assert opened <= 1  # the key check peeks at the first entry, nothing else


def test_a_crash_replays_only_what_the_index_lacks(tmp_path, decoded):
    keys = _fill(tmp_path, 2000)
    with _open(tmp_path) as s:
        s.put(keys[:300], pages_for(keys[:300], 1), durability="sync")  # overwrites
        s.delete(keys[300:400], durability="sync")
        s.debug_crash_close()
    decoded["n"] = 0
    with _open(tmp_path) as s:
        opened = decoded["n"]
        assert s.stats()["pages"] == 1900 and s.stats()["bytes"] == 1900 * RECORD_BYTES
        assert s.recovery.records_replayed >= 300
        assert_totals(s)
    assert opened <= 1


def test_a_legacy_index_is_scanned_once_then_carries_its_totals(tmp_path, decoded):
    _fill(tmp_path, 1500)
    idx = Index(str(tmp_path / "index"))  # made as an index written before Mapplied existed
    try:
        ops = [(iv.APPLIED_KEY, None)] + [(iv.LIVE_PREFIX + k, None) for k, _v in idx.items(iv.LIVE_PREFIX)]
        assert len(ops) > 1
        idx.write(ops)
        idx.flush()
    finally:
        idx.close()
    decoded["n"] = 0
    with _open(tmp_path) as s:
        assert decoded["n"] >= 1500  # the one scan
        assert s.stats()["pages"] == 1500
        assert_totals(s)
    decoded["n"] = 0
    with _open(tmp_path) as s:
        assert decoded["n"] <= 1 and s.stats()["pages"] == 1500


def test_a_rebuilt_index_carries_totals(tmp_path):
    keys = _fill(tmp_path, 1200)
    with _open(tmp_path) as s:
        s.delete(keys[:200], durability="sync")
    shutil.rmtree(tmp_path / "index")
    with _open(tmp_path) as s:
        assert s.stats()["pages"] == 1000
        assert_totals(s)
        assert s.index.get(iv.APPLIED_KEY) is not None


def test_a_bounded_store_evicts_in_log_order_after_a_reopen(tmp_path):
    bound = 1000 * RECORD_BYTES
    keys = _fill(tmp_path, 1000, disk_bytes=bound)
    with _open(tmp_path, disk_bytes=bound) as s:
        s.put(keys[:100], pages_for(keys[:100], 1), durability="sync")  # the first 100 are young again
    with _open(tmp_path, disk_bytes=bound) as s:
        new = [key(5000 + i) for i in range(150)]
        s.put(new, pages_for(new), durability="sync")
        alive = s.contains(keys)
        assert alive[:100] == [True] * 100  # rewritten after the others: kept
        assert alive[100:250] == [False] * 150 and all(alive[250:])  # the oldest records went
        assert s.stats()["bytes"] <= bound and s.stats()["evictions"] == 150
        assert_totals(s)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_put_if_absent_writes_only_new_keys_with_one_lookup(tmp_path, codec):
    # the Db's disk-tier put: keys already stored stay as they are (no second copy in the log),
    # and the old locations found by that one lookup serve the append's bookkeeping
    with ColdStore.open(tmp_path, TINY, flush_interval_s=None, codec=codec) as s:
        keys = [key(i) for i in range(10)]
        s.put(keys[:4], pages_for(keys[:4]), durability="sync")
        before = s.writer.next_lsn
        written = s.put(keys, pages_for(keys, 1), durability="sync", if_absent=True)
        assert written == [False] * 4 + [True] * 6
        assert s.writer.next_lsn == before + 6  # six records, none for the keys already there
        out = np.zeros((10, TINY.page_bytes), np.uint8)
        assert s.get_into(keys, out) == [True] * 10
        assert (out[:4] == pages_for(keys[:4])).all() and (out[4:] == pages_for(keys[4:], 1)).all()
        assert s.put(keys[:3], pages_for(keys[:3]), durability="sync", if_absent=True) == [False] * 3
        assert s.stats()["pages"] == 10
        assert_totals(s)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_lookup_the_log_outran_is_made_again(tmp_path, codec):
    # between encode_new's lookup and the append another put writes the same key: the batch's
    # carried locations are stale (the log moved on), so the append looks again; the totals stay
    # exact (a stale lookup would count the key twice)
    with ColdStore.open(tmp_path, TINY, flush_interval_s=None, codec=codec) as s:
        keys = [key(i) for i in range(5)]
        items, written = s.appender.encode_new(keys, pages_for(keys), None, 0, True)
        assert written == [True] * 5 and items.olds == [None] * 5
        s.put(keys[:2], pages_for(keys[:2], 2), durability="sync")  # the log moves on
        s.appender.append_puts(items)
        s.flush()
        assert s.stats()["pages"] == 5 and s.stats()["bytes"] == 5 * s.lookup(keys)[0].record_bytes
        assert_totals(s)


def test_verify_reports_totals_that_disagree_with_the_entries(tmp_path):
    keys = _fill(tmp_path, 600)
    with _open(tmp_path) as s:
        assert s.verify().ok
        (e,) = s.lookup(keys[:1])
        s.index.write([(iv.live_key(e.segment_no), iv.encode_segment_live(5, 1))])  # a damaged total
        rep = s.verify()
        assert not rep.ok and any(f"live totals of segment {e.segment_no}" in p for p in rep.problems)
    shutil.rmtree(tmp_path / "index")  # the remedy: rebuilt from the log
    with _open(tmp_path) as s:
        assert s.verify().ok and s.stats()["pages"] == 600


def test_totals_that_would_go_negative_are_corruption_not_a_crash(tmp_path):
    # a damaged total (1 block where hundreds live) and a replay that deletes 2 of that
    # segment's blocks: the open refuses with CorruptionError naming the remedy
    keys = _fill(tmp_path, 600)
    s = _open(tmp_path)
    (e,) = s.lookup(keys[:1])
    s.index.copy_to(str(tmp_path / "snap"))  # the index as a crash could leave it: before the delete
    s.delete(keys[:2], durability="sync")
    s.debug_crash_close()
    shutil.rmtree(tmp_path / "index")
    shutil.copytree(tmp_path / "snap", tmp_path / "index")
    idx = Index(str(tmp_path / "index"))
    try:
        idx.write([(iv.live_key(e.segment_no), iv.encode_segment_live(5, 1))])
        idx.flush()
    finally:
        idx.close()
    with pytest.raises(CorruptionError, match="live totals of segment"):
        _open(tmp_path)
    shutil.rmtree(tmp_path / "index")
    with _open(tmp_path) as s:
        assert s.stats()["pages"] == 598 and s.verify().ok
