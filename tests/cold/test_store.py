"""ColdStore behaviour: round trips, durability modes, reopen, stats, encryption, the disk
bound, metadata records, locking, bad input, concurrency, compaction."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest
import torch

from kvdb.format.layout import BlockLayout
from kvdb.cold import ColdStore
from kvdb.errors import CapacityError, DbLockedError, InvalidInput

from cold_fixtures import TINY, key, pages_for


def open_store(path, **kw) -> ColdStore:
    kw.setdefault("flush_interval_s", None)
    return ColdStore.open(path, TINY, **kw)


def read(store, keys):
    out = np.full((len(keys), TINY.page_bytes), 0xAA, dtype=np.uint8)
    found = store.get_into(keys, out)
    return found, out


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_round_trip_and_reopen(tmp_path, codec):
    # Scenario: 6 pages put under group, 2 overwritten, 1 deleted, clean close, reopen.
    keys = [key(i) for i in range(6)]
    with open_store(tmp_path, codec=codec) as s:
        s.put(keys, pages_for(keys), list(range(6)), "group")
        s.put(keys[:2], pages_for(keys[:2], salt=1), None, "sync")
        assert s.delete([keys[5], key(99)]) == 1
        found, out = read(s, keys + [key(99)])
        assert found == [True] * 5 + [False, False]
        assert (out[:2] == pages_for(keys[:2], salt=1)).all()
        assert (out[2:5] == pages_for(keys[2:5])).all()
        assert (out[5:] == 0xAA).all()  # absent keys leave their rows untouched
        before = s.stats()
    with open_store(tmp_path, codec=codec) as s:
        after = s.stats()
        for k in ("pages", "bytes", "hits", "misses", "corruptions", "evictions", "puts", "deletes"):
            assert after[k] == before[k], k
        assert after["pages"] == 5 and after["hits"] == 5 and after["misses"] == 2 and after["puts"] == 8
        found, out = read(s, keys)
        assert found == [True] * 5 + [False]
        assert (out[2:5] == pages_for(keys[2:5])).all()
        assert s.contains(keys) == [True] * 5 + [False]
        assert s.verify().ok


def test_zstd_planes_shrink_bf16_pages(tmp_path):
    # Scenario: bf16 values of a smooth distribution: the high-byte plane compresses.
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)
    vals = torch.randn((4, layout.page_bytes // 2), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    pages = vals.view(torch.uint8).numpy().reshape(4, layout.page_bytes).copy()
    keys = [key(i) for i in range(4)]
    sizes = {}
    for codec in ("raw", "zstd"):
        with ColdStore.open(tmp_path / codec, layout, codec=codec, flush_interval_s=None) as s:
            s.put(keys, pages, None, "group")
            out = np.zeros_like(pages)
            assert s.get_into(keys, out) == [True] * 4
            assert (out == pages).all()
            sizes[codec] = s.stats()["bytes"]
    assert sizes["raw"] == 4 * (53 + layout.page_bytes)
    assert sizes["zstd"] < 0.85 * sizes["raw"]


def test_none_durability_is_visible_at_once_and_durable_after_flush(tmp_path):
    keys = [key(i) for i in range(3)]
    s = open_store(tmp_path)
    s.put(keys, pages_for(keys), None, "none")
    assert s.stats()["durable_lsn"] == 0  # nothing fsynced yet
    assert read(s, keys)[0] == [True] * 3
    s.flush()
    assert s.stats()["durable_lsn"] == 3
    s.debug_crash_close()  # no checkpoint: reopen replays the log
    with open_store(tmp_path) as s:
        assert s.stats()["recovery"]["records_replayed"] == 3
        found, out = read(s, keys)
        assert found == [True] * 3 and (out == pages_for(keys)).all()


def test_sync_puts_fsync_each_call(tmp_path):
    with open_store(tmp_path) as s:
        f0 = s.stats()["fsyncs"]
        for i in range(4):
            s.put([key(i)], pages_for([key(i)]), None, "sync")
        assert s.stats()["fsyncs"] - f0 == 4


def test_bad_input_is_refused_and_loses_nothing(tmp_path):
    with open_store(tmp_path) as s:
        s.put([key(1)], pages_for([key(1)]), None, "group")
        good = pages_for([key(2)])
        bad_calls = [
            lambda: s.put([key(2)], good.astype(np.int16), None, "group"),
            lambda: s.put([key(2)], good[:, :64], None, "group"),
            lambda: s.put([key(2)], good[:, ::2].copy().repeat(2, axis=1)[:, ::1][:, :TINY.page_bytes].T.T[:, ::-1], None, "group"),
            lambda: s.put([key(2), key(3)], good, None, "group"),
            lambda: s.put([b"short"], good, None, "group"),
            lambda: s.put([key(2)], good, None, "eventually"),
            lambda: s.put([key(2), key(2)], np.vstack([good, good]), None, "group"),
            lambda: s.put([key(2)], good, [1, 2], "group"),
            lambda: s.get_into([key(1)], np.zeros((1, 10), dtype=np.uint8)),
            lambda: s.put_metadata("weather", b"x", b"y"),
        ]
        for call in bad_calls:
            with pytest.raises(InvalidInput):
                call()
        assert s.contains([key(1), key(2)]) == [True, False]
        assert not s.failed
    with pytest.raises(InvalidInput):
        open_store(tmp_path, codec="lz4")


def test_second_open_of_the_same_path_is_refused(tmp_path):
    with open_store(tmp_path):
        with pytest.raises(DbLockedError):
            open_store(tmp_path)


def test_encryption_keeps_no_plaintext_and_refuses_a_wrong_key(tmp_path):
    kf = tmp_path / "key"
    kf.write_bytes(bytes(range(32)))
    other = tmp_path / "other"
    other.write_text("ab" * 32)
    db = tmp_path / "db"
    keys = [key(i) for i in range(3)]
    pages = pages_for(keys)
    for codec in ("raw", "zstd"):
        with open_store(db / codec, encryption_key_file=str(kf), codec=codec) as s:
            s.put(keys, pages, [0, 1, 2], "group")
            assert s.stats()["encrypted"]
        with open_store(db / codec, encryption_key_file=str(kf)) as s:
            found, out = read(s, keys)
            assert found == [True] * 3 and (out == pages).all()
        with pytest.raises(InvalidInput, match="does not match"):
            open_store(db / codec, encryption_key_file=str(other))
        with pytest.raises(InvalidInput, match="encrypted"):
            open_store(db / codec)
    for root, _dirs, files in os.walk(db):
        for f in files:
            blob = open(os.path.join(root, f), "rb").read()
            for p in pages:
                assert p[:32].tobytes() not in blob, f
    (tmp_path / "short").write_bytes(b"123")
    with pytest.raises(InvalidInput, match="32 raw bytes"):
        open_store(tmp_path / "x", encryption_key_file=str(tmp_path / "short"))


def test_disk_bound_evicts_oldest_first(tmp_path):
    rec = 53 + TINY.page_bytes  # 181 bytes per raw record
    with pytest.raises(CapacityError):
        open_store(tmp_path / "small", disk_bytes=100)
    with open_store(tmp_path / "db", disk_bytes=4 * rec) as s:
        keys = [key(i) for i in range(7)]
        s.put(keys[:3], pages_for(keys[:3]), None, "group")
        s.put(keys[3:5], pages_for(keys[3:5]), None, "group")  # evicts key 0
        assert s.contains(keys) == [False, True, True, True, True, False, False]
        s.put(keys[1:2], pages_for(keys[1:2], salt=5), None, "group")  # an overwrite needs no room
        assert s.contains(keys) == [False, True, True, True, True, False, False]
        s.put(keys[5:7], pages_for(keys[5:7]), None, "group")  # evicts keys 2 and 3 (1 was rewritten)
        assert s.contains(keys) == [False, True, False, False, True, True, True]
        st = s.stats()
        assert st["evictions"] == 3 and st["bytes"] == 4 * rec and st["pages"] == 4
        big = [key(100 + i) for i in range(6)]
        s.put(big, pages_for(big), None, "group")  # a batch over the bound keeps its last 4
        assert s.contains(big) == [False, False, True, True, True, True]
        assert s.stats()["evictions"] == 3 + 4 + 2
    with open_store(tmp_path / "db", disk_bytes=4 * rec) as s:
        assert s.stats()["pages"] == 4 and s.stats()["bytes"] == 4 * rec


def test_metadata_records_survive_reopen(tmp_path):
    with open_store(tmp_path) as s:
        s.put_metadata("session", b"agent-1", b'{"round": 3}')
        s.put_metadata("ttl", key(1), (123).to_bytes(8, "little"), durability="sync")
        s.put_metadata("lease", key(2), b"engine-0")
        s.put_metadata("lease", key(2), b"")  # removed
        assert s.find_metadata("session", b"agent-1") == b'{"round": 3}'
    with open_store(tmp_path) as s:
        assert s.find_metadata("session", b"agent-1") == b'{"round": 3}'
        assert s.find_metadata("ttl", key(1)) == (123).to_bytes(8, "little")
        assert s.find_metadata("lease", key(2)) is None


def test_many_writer_threads_share_fsyncs(tmp_path):
    # Scenario: 8 threads x 25 single-page group puts; every page reads back.
    n_threads, per = 8, 25
    with open_store(tmp_path) as s:
        f0 = s.stats()["fsyncs"]

        def writer(t):
            for i in range(per):
                k = key(t * 1000 + i)
                s.put([k], pages_for([k]), None, "group")

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        keys = [key(t * 1000 + i) for t in range(n_threads) for i in range(per)]
        found, out = read(s, keys)
        assert all(found) and (out == pages_for(keys)).all()
        assert s.stats()["fsyncs"] - f0 <= n_threads * per
        assert s.stats()["durable_lsn"] == n_threads * per


def test_compaction_reclaims_dead_segments(tmp_path):
    # Scenario: 40 pages over ~8 segments, 30 deleted, compaction keeps the 10 and frees the rest.
    keys = [key(i) for i in range(40)]
    with open_store(tmp_path, segment_bytes=1024) as s:
        s.put(keys, pages_for(keys), None, "group")
        s.delete(keys[:30])
        before = s.stats()
        calls = []
        res = s.compact(progress=lambda done, total: calls.append((done, total)))
        after = s.stats()
        assert res["records_copied"] <= 10 and res["segments_deleted"] >= 5
        assert after["log_bytes"] < before["log_bytes"]
        assert calls[-1][0] == calls[-1][1]
        found, out = read(s, keys)
        assert found == [False] * 30 + [True] * 10
        assert (out[30:] == pages_for(keys[30:])).all()
        assert s.verify().ok
    with open_store(tmp_path, segment_bytes=1024) as s:
        found, out = read(s, keys[30:])
        assert all(found) and (out == pages_for(keys[30:])).all()
        assert s.verify().ok


def test_compaction_deletes_ttl_expired_blocks(tmp_path):
    # Scenario: keys 0..3 with TTLs 100, 200, 300 ns and none; compaction at now=250 drops 0 and 1.
    keys = [key(i) for i in range(4)]
    with open_store(tmp_path) as s:
        s.put(keys, pages_for(keys), None, "group")
        for i, t in enumerate((100, 200, 300)):
            s.put_metadata("ttl", keys[i], t.to_bytes(8, "little"))
        res = s.compact(now_ns=250)
        assert res["ttl_expired"] == 2
        assert s.contains(keys) == [False, False, True, True]
        assert s.find_metadata("ttl", keys[0]) is None
        assert s.find_metadata("ttl", keys[2]) == (300).to_bytes(8, "little")
    with open_store(tmp_path) as s:
        assert s.contains(keys) == [False, False, True, True]


def test_sliced_read_ahead_of_back_to_back_records(tmp_path, monkeypatch):
    # Scenario: 40 raw records back to back read in slices of 5 by the read-ahead thread; record 17
    # has a flipped payload bit: exactly that one is a miss and a corruption.
    import kvdb.cold.read as read_mod

    monkeypatch.setattr(read_mod, "READ_SLICE_BYTES", 5 * (53 + TINY.page_bytes))
    keys = [key(i) for i in range(40)]
    with open_store(tmp_path) as s:
        s.put(keys, pages_for(keys), None, "sync")
    seg = tmp_path / "wal" / "00000001.log"
    with open(seg, "r+b") as f:
        f.seek(32 + 17 * (53 + TINY.page_bytes) + 53 + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x20]))
    with open_store(tmp_path) as s:
        found, out = read(s, list(reversed(keys)))  # lookup order need not match log order
        want = pages_for(list(reversed(keys)))
        assert found == [i != 22 for i in range(40)]
        assert (out[[i for i in range(40) if i != 22]] == want[[i for i in range(40) if i != 22]]).all()
        assert (out[22] == 0).all()
        assert s.stats()["corruptions"] == 1


def test_on_ready_tells_each_checked_hit_once_a_slice_at_a_time(tmp_path, monkeypatch):
    # Scenario: records 0..9 back to back read in slices of 3 (4 slices), record 30 alone (the
    # per-entry path), record 4 damaged, one key absent. on_ready hears of every hit exactly
    # once, in slices as they are checked (3 or fewer at a time, run order), the lone record
    # last; never of the damaged or the absent key. Its promotion (kvdb/db/read.py) relies on it.
    import kvdb.cold.read as read_mod

    monkeypatch.setattr(read_mod, "READ_SLICE_BYTES", 3 * (53 + TINY.page_bytes))
    keys = [key(i) for i in range(40)]
    with open_store(tmp_path) as s:
        s.put(keys, pages_for(keys), None, "sync")
    with open(tmp_path / "wal" / "00000001.log", "r+b") as f:
        f.seek(32 + 4 * (53 + TINY.page_bytes) + 53 + 1)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    ask = [keys[30]] + keys[:10] + [key(99)]
    told: list[list[int]] = []
    with open_store(tmp_path) as s:
        out = np.zeros((len(ask), TINY.page_bytes), dtype=np.uint8)
        found = s.get_into(ask, out, on_ready=lambda idx: told.append(list(idx)))
    assert found == [True] * 5 + [False] + [True] * 5 + [False]
    flat = [i for part in told for i in part]
    assert sorted(flat) == [i for i, f in enumerate(found) if f]  # each hit once, nothing else
    assert told[-1] == [0] and all(len(part) <= 3 for part in told[:-1])
    assert flat[:-1] == sorted(flat[:-1])  # the run's slices in file order
    assert (out[[i for i, f in enumerate(found) if f]] == pages_for([k for k, f in zip(ask, found) if f])).all()


def test_encrypted_store_reopens_after_a_crash_before_any_checkpoint(tmp_path):
    # The key check lives in the index, whose WAL is off: it must be flushed at creation.
    kf = tmp_path / "key"
    kf.write_bytes(bytes(range(32)))
    s = open_store(tmp_path / "db", encryption_key_file=str(kf))
    shutil.copytree(tmp_path / "db" / "index", tmp_path / "flushed")  # what a crash keeps of RocksDB
    s.put([key(1)], pages_for([key(1)]), None, "sync")
    s.debug_crash_close()
    shutil.rmtree(tmp_path / "db" / "index")
    shutil.copytree(tmp_path / "flushed", tmp_path / "db" / "index")
    with open_store(tmp_path / "db", encryption_key_file=str(kf)) as s:
        found, out = read(s, [key(1)])
        assert found == [True] and (out == pages_for([key(1)])).all()


def test_background_flusher_makes_none_writes_durable_and_checkpoints(tmp_path):
    # Scenario: flusher every 10 ms, checkpoint after 1 KiB of log; 10 "none" puts of 181 bytes.
    import time

    keys = [key(i) for i in range(10)]
    s = ColdStore.open(tmp_path, TINY, flush_interval_s=0.01, checkpoint_bytes=1024)
    try:
        s.put(keys, pages_for(keys), None, "none")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (s.stats()["durable_lsn"] < 10 or s.stats()["checkpoint_lsn"] < 10):
            time.sleep(0.01)
        st = s.stats()
        assert st["durable_lsn"] >= 10 and st["checkpoint_lsn"] >= 10
    finally:
        s.debug_crash_close()
    with open_store(tmp_path) as s:
        assert s.stats()["recovery"]["records_replayed"] <= 1  # at most the checkpoint record itself
        found, out = read(s, keys)
        assert all(found) and (out == pages_for(keys)).all()
