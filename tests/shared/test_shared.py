"""The shared tier against a real Mooncake Store (docs/shared.md S1-S9; conftest.py starts it)."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from conftest import LAYOUT, make_blocks, run_engine
from engine import KEY_SECRET, digest, open_db, tokens
from kvdb.errors import NotFound
from kvdb.format import shared_object as fmt


def wait_for(cond, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def master_metric(pool, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{pool.port + 1}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_two_engines_share_blocks_bit_exact(pool, tmp_path):
    """S2/S3: a prefill engine (another process) puts and flushes; a decode engine finds the
    blocks through the pool, bit-exact, and they land in its host tier."""
    put = run_engine("put", tmp_path / "prefill", pool.url, 24, 5)
    assert put["shared"]["puts"] == 24 and put["shared"]["dropped_puts"] == 0
    with open_db(tmp_path / "decode", pool.url) as db:
        keys = db.block_keys(tokens(24, 5))
        assert db.match_prefix(keys) == 24
        out = torch.empty((24, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        db.get_blocks(keys, out=out)
        assert digest(out) == put["digest"]
        assert same(out, make_blocks(24, 5))
        st = db.stats()
        assert st["shared"]["hits"] == 24 and st["shared"]["corruptions"] == 0
        assert st["tiers"]["host"]["pages"] == 24  # landed in the host tier (S3)
        calls = st["shared"]["calls_calls"]
        assert db.match_prefix(keys) == 24 and db.stats()["shared"]["calls_calls"] == calls  # local now


def test_wait_published_hands_over_without_a_flush(pool, tmp_path):
    """S2: ``wait_published`` returns once the puts are in the pool; another engine finds them."""
    with open_db(tmp_path / "prefill", pool.url) as a, open_db(tmp_path / "decode", pool.url) as b:
        keys = a.block_keys(tokens(8, 11))
        a.put_blocks(keys, make_blocks(8, 11))
        assert a.wait_published(timeout_s=10) is True
        assert a.stats()["shared"]["puts"] == 8
        assert b.match_prefix(keys) == 8 and b.stats()["shared"]["hits"] == 8


def test_blocks_offered_twice_move_no_bytes(pool, tmp_path):
    blocks = make_blocks(8, 3)
    with open_db(tmp_path / "a", pool.url) as a:
        keys = a.block_keys(tokens(8, 3))
        a.put_blocks(keys, blocks)
        a.flush()
        a.put_blocks(keys, blocks)  # already stored: not offered again
        a.flush()
        assert a.stats()["shared"]["puts"] == 8
    ended = master_metric(pool, "master_batch_put_end_items_total")
    allocated = master_metric(pool, "master_allocated_bytes")
    with open_db(tmp_path / "b", pool.url) as b:  # another engine offers the same blocks
        b.put_blocks(keys, blocks)
        b.flush()
    assert master_metric(pool, "master_batch_put_end_items_total") == ended  # no transfer completed
    assert master_metric(pool, "master_allocated_bytes") == allocated


def test_duplicate_keys_in_one_batch(pool, tmp_path):
    """S6: a key twice in one put is published once; twice in one read, both rows are right
    (Mooncake issue 3876: the store itself fills only one)."""
    blocks = make_blocks(4, 9)
    with open_db(tmp_path / "a", pool.url) as a:
        keys = a.block_keys(tokens(4, 9))
        dup = [keys[0], keys[1], keys[0], keys[2], keys[1], keys[3]]
        a.put_blocks(dup, blocks[[0, 1, 0, 2, 1, 3]])
        a.flush()
        assert a.stats()["shared"]["puts"] == 4
    with open_db(tmp_path / "b", pool.url) as b:
        out = torch.zeros((6, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        b.get_blocks(dup, out=out)
        assert same(out, blocks[[0, 1, 0, 2, 1, 3]])
        assert b.stats()["shared"]["hits"] == 4


def test_forged_truncated_and_foreign_objects_are_misses(pool, tmp_path):
    """S5: bad objects written straight into the store are counted corruptions, never bytes."""
    blocks = make_blocks(5, 11)
    raw = pool.raw_client()
    with open_db(tmp_path / "a", pool.url) as a:
        keys = a.block_keys(tokens(5, 11))
        ns = a.stats()["shared"]["namespace"]
        names = fmt.object_names(ns, keys)
        obj = fmt.object_bytes(LAYOUT.page_bytes, False)
        good = np.zeros((5, obj), dtype=np.uint8)
        for i, k in enumerate(keys):
            good[i, fmt.HEADER_BYTES:] = blocks[i].view(torch.uint8).reshape(-1).numpy()
            fmt.write_header(good[i], k, LAYOUT.page_bytes, False)
        bad = good.copy()
        bad[0, 1000] ^= 1                                   # torn: digest fails
        bad[1, 8:24] = np.frombuffer(keys[0], np.uint8)     # another key's header (redigested)
        fmt.write_header(bad[1], keys[0], LAYOUT.page_bytes, False)
        raw.put(names[2], good[2, : obj // 2].tobytes())    # truncated
        raw.put(names[3], b"\x00" * obj)                     # not an object at all
        raw.put(names[0], bad[0].tobytes())
        raw.put(names[1], bad[1].tobytes())
        raw.put(names[4], good[4].tobytes())                 # a good one, to show reads work
    with open_db(tmp_path / "b", pool.url) as b:
        for i in range(4):
            assert b.match_prefix([keys[i]]) == 0
            with pytest.raises(NotFound):
                b.get_blocks([keys[i]], out=torch.empty((1, *LAYOUT.block_shape), dtype=LAYOUT.dtype))
        assert b.match_prefix([keys[4]]) == 1
        st = b.stats()["shared"]
        assert st["corruptions"] >= 4 and st["hits"] == 1
    raw.close()


def test_delete_under_a_readers_lease(pool, tmp_path):
    """S6: a delete removes without force; an object another engine just read (its lease) stays
    whole, and nobody gets an exception or torn bytes."""
    blocks = make_blocks(6, 13)
    with open_db(tmp_path / "a", pool.url) as a, open_db(tmp_path / "b", pool.url) as b:
        keys = a.block_keys(tokens(6, 13))
        a.put_blocks(keys, blocks)
        a.flush()
        assert b.match_prefix(keys) == 6  # b's get: a lease on every object
        assert a.delete(keys) == 6       # refused by the lease: no error
        assert a.stats()["shared"]["removes"] == 0
        out = torch.empty_like(blocks)
        b.get_blocks(keys, out=out)
        assert same(out, blocks)


def test_kill_master_trips_breaker_local_hits_stay_and_recovery(pool, tmp_path):
    """S8: the master SIGKILLed: pool calls stop after at most one deadline or three failures,
    the breaker is open, local hits keep working, threads stay bounded; the master back, the
    breaker's probe closes it and publishing resumes."""
    blocks = make_blocks(8, 17)
    with open_db(tmp_path / "a", pool.url) as db:
        keys = db.block_keys(tokens(8, 17))
        db.put_blocks(keys[:4], blocks[:4])
        db.flush()
        pool.kill(pool.master)
        other = db.block_keys(tokens(8, 18))
        for _ in range(50):  # lookups that miss locally: the pool would be asked
            assert db.match_prefix(other) == 0
            assert db.match_prefix(keys[:4]) == 4  # local hits are untouched
        db.put_blocks(keys[4:], blocks[4:])
        db.flush()
        st = db.stats()["shared"]
        assert st["breaker"] != "closed"
        assert st["calls_calls"] - st["calls_probes"] <= 6  # stopped calling the pool
        assert st["threads"] <= 4 and threading.active_count() < 40
        out = torch.empty_like(blocks)
        db.get_blocks(keys, out=out)
        assert same(out, blocks)
        pool.start_master()
        pool.wait_ready()
        more = db.block_keys(tokens(2, 19))

        def published() -> bool:
            db.match_prefix(other)  # lets a due probe run
            if db.stats()["shared"]["breaker"] != "closed":
                return False
            db.put_blocks(more, make_blocks(2, 19))
            db.flush()
            return db.stats()["shared"]["puts"] >= 6

        wait_for(published, "publishing after the master returned")


def test_kill_storage_process_is_a_miss(pool_factory, tmp_path):
    """S1: a storage process SIGKILLed loses its objects: a miss (or an object from the other
    one), never an exception, never wrong bytes."""
    pool = pool_factory(storage_bytes=[32 << 20, 32 << 20])
    blocks = make_blocks(16, 21)
    with open_db(tmp_path / "a", pool.url) as a:
        keys = a.block_keys(tokens(16, 21))
        a.put_blocks(keys, blocks)
        a.flush()
    pool.kill(pool.storage[0])
    with open_db(tmp_path / "b", pool.url) as b:
        n = b.match_prefix(keys)
        out = torch.empty_like(blocks)
        got = b.get_prefix(keys, out=out)
        assert got >= n and same(out[:got], blocks[:got])
        assert b.stats()["shared"]["threads"] <= 4


def test_pool_three_times_too_small(pool_factory, tmp_path):
    """S9: a full pool drops puts (counted); every read is still right."""
    pool = pool_factory(storage_bytes=[16 << 20])
    blocks = make_blocks(192, 23)  # 48 MiB of pages for 16 MiB of pool
    with open_db(tmp_path / "a", pool.url, disk_bytes=None) as a:
        keys = a.block_keys(tokens(192, 23))
        for i in range(0, 192, 32):
            a.put_blocks(keys[i : i + 32], blocks[i : i + 32])
            a.flush()
        st = a.stats()["shared"]
        assert st["dropped_puts"] > 0 and st["puts"] + st["dropped_puts"] == 192
        out = torch.empty_like(blocks)
        a.get_blocks(keys, out=out)  # the local log has them all (S1)
        assert same(out, blocks)
    with open_db(tmp_path / "b", pool.url, disk_bytes=0) as b:
        out = torch.empty_like(blocks)
        got = b.get_prefix(keys, out=out)
        assert same(out[:got], blocks[:got])


def test_lookups_never_hold_off_eviction(pool_factory, tmp_path):
    """S7 (Mooncake issue 2187): one engine keeps a small pool full while another looks the
    same keys up over and over; the pool still evicts (the writer's later puts land), and the
    looker's pool calls stay a handful, not one per lookup."""
    pool = pool_factory(storage_bytes=[16 << 20], lease_ms=500)
    with open_db(tmp_path / "w", pool.url) as w, open_db(tmp_path / "r", pool.url, disk_bytes=0) as r:
        first = w.block_keys(tokens(24, 31))
        w.put_blocks(first, make_blocks(24, 31))
        w.flush()
        missing = r.block_keys(tokens(8, 99))
        for _ in range(200):
            r.match_prefix(first)
            r.match_prefix(missing)
        calls = r.stats()["shared"]["calls_calls"]
        assert calls < 40, calls

        def evicted_and_landed() -> bool:
            for j in range(4):
                ks = w.block_keys(tokens(24, 40 + j))
                w.put_blocks(ks, make_blocks(24, 40 + j))
                w.flush()
                for _ in range(20):
                    r.match_prefix(first)
            return master_metric(pool, "master_evicted_key_count") > 0

        assert evicted_and_landed() or wait_for(lambda: master_metric(pool, "master_evicted_key_count") > 0, "eviction")
        assert w.stats()["shared"]["puts"] > 48


def test_stats_metrics_and_cli_show_the_shared_tier(pool, tmp_path):
    from click.testing import CliRunner
    from prometheus_client import CollectorRegistry, generate_latest

    import kvdb.metrics
    from kvdb.cli.main import cli

    with open_db(tmp_path / "a", pool.url) as db:
        keys = db.block_keys(tokens(4, 51))
        db.put_blocks(keys, make_blocks(4, 51))
        db.flush()
        reg = CollectorRegistry()
        kvdb.metrics.register(db, reg)
        text = generate_latest(reg).decode()
        assert 'kvdb_shared_events_total{event="puts"} 4.0' in text
        assert "kvdb_shared_breaker_open 0.0" in text
    r = CliRunner().invoke(cli, ["stats", str(tmp_path / "a"), "--json"])
    assert r.exit_code == 0 and '"shared"' not in r.output  # read-only: no pool


def test_sealed_pages_through_the_pool(pool, tmp_path):
    """S4/S5 with encryption_key_file: the pool holds only sealed pages; an engine with the same
    key reads them back bit-exact (unsealed into its host frames), one with another key's
    namespace never sees them, and a sealed object torn in the pool is a corruption, a miss."""
    kf = tmp_path / "key"
    kf.write_bytes(bytes(range(32)))
    blocks = make_blocks(6, 11)
    with open_db(tmp_path / "a", pool.url, encryption_key_file=str(kf)) as a:
        keys = a.block_keys(tokens(6, 11))
        a.put_blocks(keys, blocks)
        a.flush()
        assert a.stats()["shared"]["puts"] == 6
        ns = a.stats()["shared"]["namespace"]
    raw = pool.raw_client()
    name = fmt.object_names(ns, keys[:1])[0]
    got = raw.get_batch([name])[0]
    assert len(got) == fmt.object_bytes(LAYOUT.page_bytes, True)
    assert blocks[0].contiguous().view(torch.uint8).numpy().tobytes()[:4096] not in got  # sealed
    with open_db(tmp_path / "b", pool.url, encryption_key_file=str(kf)) as b:
        assert b.match_prefix(keys) == 6
        out = torch.empty((6, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        b.get_blocks(keys, out=out)
        assert same(out, blocks) and b.stats()["shared"]["hits"] == 6
        # a tampered ciphertext under a new key, its header and digest rewritten to match: the
        # digest passes, AES-GCM does not
        other = b.block_keys(tokens(1, 99))
        row = np.frombuffer(got, dtype=np.uint8).copy()
        row[fmt.HEADER_BYTES + 100] ^= 1
        fmt.write_header(row, other[0], fmt.payload_bytes(LAYOUT.page_bytes, True), True)
        assert raw.put(fmt.object_names(ns, other)[0], row.tobytes()) == 0
        assert b.match_prefix(other) == 0
        st = b.stats()["shared"]
        assert st["corruptions"] == 1 and st["hits"] == 6
        assert b.stats()["tiers"]["host"]["pages"] == 6  # the tampered page's frame was released
    with open_db(tmp_path / "c", pool.url) as c:  # not sealed: another namespace
        assert c.match_prefix(keys) == 0 and c.stats()["shared"]["hits"] == 0
    raw.close()
