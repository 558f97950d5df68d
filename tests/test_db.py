"""The public API of kvdb.Db on small pools: exact tiers, evictions, pins and every kind of bad input."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import LAYOUT, PAGE, blocks_for, open_db, tiers

import kvdb
from kvdb.errors import CapacityError, DbLockedError, InvalidInput, KvdbError, NotFound


def test_put_match_get_roundtrip(tmp_path):
    # Scenario: 5 blocks of one prompt into an 8-page host tier; all come back bit-exact.
    with open_db(tmp_path) as db:
        keys = db.block_keys(list(range(22)))  # 22 tokens -> 5 full blocks of 4
        assert len(keys) == 5
        blocks = blocks_for(5)
        assert db.put_blocks(keys, blocks) == 5
        assert db.put_blocks(keys, blocks) == 0  # already stored: skipped
        assert db.match_prefix(keys) == 5
        out = torch.zeros((6, *LAYOUT.block_shape))
        db.get_blocks(keys[1:4], out=out)
        assert torch.equal(out[:3], blocks[1:4])
        assert torch.count_nonzero(out[3:]) == 0
        s = db.stats()["tiers"]["host"]
        assert (s["pages"], s["capacity_pages"], s["bytes"], s["hits"], s["misses"]) == (5, 8, 5 * PAGE, 5, 0)


def test_match_prefix_stops_at_first_gap(tmp_path):
    # Scenario: blocks 0, 1 and 3 stored; the prefix is 2 and the lookup counts one miss.
    with open_db(tmp_path) as db:
        keys = db.block_keys(list(range(16)))
        b = blocks_for(4)
        db.put_blocks([keys[0], keys[1], keys[3]], b[[0, 1, 3]])
        assert db.match_prefix(keys) == 2
        assert db.match_prefix(keys[2:]) == 0
        st = db.stats()
        assert st["tiers"]["host"]["hits"] == 2
        assert st["tiers"]["host"]["misses"] == 2
        assert st["lookup_misses"] == 2


def test_lru_eviction_order_exact(tmp_path):
    # Scenario: 3-page host tier; a, b, c stored; a read; d stored -> b (least recent) evicted.
    with open_db(tmp_path, host_pages=3) as db:
        ks = [db.block_keys(list(range(100 * i, 100 * i + 4)))[0] for i in range(4)]
        b = blocks_for(4)
        for i in range(3):
            db.put_blocks([ks[i]], b[i : i + 1])
        out = torch.empty((1, *LAYOUT.block_shape))
        db.get_blocks([ks[0]], out=out)
        db.put_blocks([ks[3]], b[3:4])
        assert [db.match_prefix([k]) for k in ks] == [1, 0, 1, 1]
        assert db.stats()["tiers"]["host"]["evictions"] == 1


def test_device_tier_demotes_to_host(tmp_path):
    # Scenario: 2 device pages (on the CPU here) over 4 host pages; the third put demotes the
    # least recent device page to the host tier, where it stays readable bit-exact.
    with open_db(tmp_path, host_pages=4, device_pages=2, device="cpu") as db:
        ks = [db.block_keys(list(range(10 * i, 10 * i + 4)))[0] for i in range(3)]
        b = blocks_for(3)
        for i in range(3):
            db.put_blocks([ks[i]], b[i : i + 1])
        with db.pin(ks) as pages:
            assert pages.tiers == ["host", "device", "device"]
            for i in range(3):
                assert torch.equal(pages[i], b[i])
        st = db.stats()["tiers"]
        assert (st["device"]["pages"], st["host"]["pages"], st["device"]["demotions"]) == (2, 1, 1)
        assert db.prefetch([ks[0]]) == 1  # host -> device, demoting the LRU device page
        assert db.stats()["tiers"]["device"]["promotions"] == 1
        out = torch.empty((3, *LAYOUT.block_shape))
        db.get_blocks(ks, out=out)
        assert torch.equal(out, b)


def test_pinned_pages_are_never_evicted(tmp_path):
    # Scenario: 2-page host tier, both pages pinned; new puts bypass memory instead of evicting.
    with open_db(tmp_path, host_pages=2) as db:
        keys = db.block_keys(list(range(16)))
        b = blocks_for(4)
        db.put_blocks(keys[:2], b[:2])
        with db.pin(keys[:2]) as pages:
            view = pages[0]
            db.put_blocks(keys[2:], b[2:])
            assert db.match_prefix(keys) == 2
            assert torch.equal(view, b[0])
            assert db.stats()["tiers"]["host"]["pinned_pages"] == 2
        assert db.stats()["tiers"]["host"]["pinned_pages"] == 0
        db.put_blocks(keys[2:3], b[2:3])  # now a victim exists
        assert db.match_prefix(keys[2:3]) == 1


def test_pins_nest(tmp_path):
    with open_db(tmp_path, host_pages=1) as db:
        k = db.block_keys([1, 2, 3, 4])
        k2 = db.block_keys([5, 6, 7, 8])
        db.put_blocks(k, blocks_for(1))
        p1 = db.pin(k)
        p2 = db.pin(k)
        p1.release()
        db.put_blocks(k2, blocks_for(1, seed=1))
        assert db.match_prefix(k) == 1 and db.match_prefix(k2) == 0  # still pinned by p2
        p2.release()
        p2.release()  # idempotent
        db.put_blocks(k2, blocks_for(1, seed=1))
        assert db.match_prefix(k) == 0 and db.match_prefix(k2) == 1


def test_delete(tmp_path):
    with open_db(tmp_path) as db:
        keys = db.block_keys(list(range(12)))
        db.put_blocks(keys, blocks_for(3))
        assert db.delete([keys[1], db.block_keys([9, 9, 9, 9])[0]]) == 1
        assert db.match_prefix(keys) == 1
        with db.pin(keys[:1]):
            with pytest.raises(InvalidInput, match="pinned"):
                db.delete(keys[:1])
        assert db.stats()["tiers"]["host"]["pages"] == 2


def test_tenants_do_not_share_blocks(tmp_path):
    with open_db(tmp_path) as db:
        toks = list(range(8))
        a = db.block_keys(toks, tenant="acme")
        db.put_blocks(a, blocks_for(2))
        assert db.match_prefix(db.block_keys(toks, tenant="acme")) == 2
        assert db.match_prefix(db.block_keys(toks, tenant="globex")) == 0
        # a declared public system prompt is shared
        pa = db.block_keys(toks, tenant="acme", public_prefix_tokens=4)
        pg = db.block_keys(toks, tenant="globex", public_prefix_tokens=4)
        assert pa[0] == pg[0] and pa[1] != pg[1]


def test_bad_inputs_are_typed_and_lose_nothing(tmp_path):
    with open_db(tmp_path) as db:
        keys = db.block_keys(list(range(8)))
        good = blocks_for(2)
        db.put_blocks(keys, good)
        with pytest.raises(InvalidInput, match="dtype"):
            db.put_blocks(keys, good.to(torch.float16))
        with pytest.raises(InvalidInput, match="shape"):
            db.put_blocks(keys, good[:, :1])
        with pytest.raises(InvalidInput, match="shape"):
            db.put_blocks(keys[:1], good)  # counts differ
        with pytest.raises(InvalidInput, match="contiguous"):
            db.put_blocks(keys, good.transpose(3, 4).contiguous().transpose(3, 4))
        with pytest.raises(InvalidInput, match="meta"):  # a device no arena of this Db lives on
            db.put_blocks(keys, torch.empty(good.shape, device="meta"))
        with pytest.raises(InvalidInput, match="torch.Tensor"):
            db.put_blocks(keys, good.numpy())
        with pytest.raises(InvalidInput, match="16 bytes"):
            db.put_blocks([b"short", keys[1]], good)
        with pytest.raises(InvalidInput, match="uint32"):
            db.block_keys([1, 2, -3, 4])
        with pytest.raises(InvalidInput, match="uint32"):
            db.block_keys([1, 2, 3, 2**32])
        with pytest.raises(InvalidInput, match="durability"):
            db.put_blocks(keys, good, durability="fast")
        with pytest.raises(InvalidInput, match="disk tier"):
            db.put_blocks(keys, good, durability="sync")
        with pytest.raises(InvalidInput, match="positions"):
            db.put_blocks(keys, good, positions=[0])
        missing = db.block_keys(list(range(100, 104)))
        out = torch.zeros((2, *LAYOUT.block_shape))
        with pytest.raises(NotFound, match=missing[0].hex()):
            db.get_blocks([keys[0], missing[0]], out=out)
        assert torch.count_nonzero(out) == 0  # nothing written on a failed get
        with pytest.raises(KeyError):  # NotFound is also a KeyError
            db.get_blocks(missing, out=out)
        with pytest.raises(InvalidInput, match="shape"):
            db.get_blocks(keys, out=out[:1])
        with pytest.raises(NotFound):
            db.pin(missing)
        # everything stored before is intact
        db.get_blocks(keys, out=out)
        assert torch.equal(out, good)


def test_capacity_too_small(tmp_path):
    with pytest.raises(CapacityError, match="no page"):
        kvdb.open(tmp_path / "a", layout=LAYOUT, model_id="m", host_bytes=PAGE - 1, disk_bytes=0)
    with pytest.raises(CapacityError, match="device_bytes"):
        kvdb.open(tmp_path / "b", layout=LAYOUT, model_id="m", host_bytes=PAGE, device_bytes=10, disk_bytes=0)
    # a failed open releases the lock
    with kvdb.open(tmp_path / "a", layout=LAYOUT, model_id="m", host_bytes=PAGE, disk_bytes=0):
        pass


def test_reopen_checks_manifest(tmp_path):
    with open_db(tmp_path):
        pass
    with pytest.raises(InvalidInput, match="layout"):
        kvdb.open(tmp_path, layout=kvdb.BlockLayout(2, 2, 4, 8, torch.float32), model_id="test-model", disk_bytes=0)
    with pytest.raises(InvalidInput, match="model"):
        kvdb.open(tmp_path, layout=LAYOUT, model_id="other", disk_bytes=0)
    with pytest.raises(InvalidInput, match="key secret"):
        kvdb.open(tmp_path, layout=LAYOUT, model_id="test-model", key_secret=b"x" * 32, disk_bytes=0)
    with pytest.raises(InvalidInput, match="new data directory"):
        kvdb.open(tmp_path / "new", host_bytes=PAGE, disk_bytes=0)
    with kvdb.open(tmp_path, host_bytes=PAGE, disk_bytes=0) as db:  # layout from the manifest
        assert db.layout == LAYOUT and db.model_id == "test-model"


def test_same_keys_after_reopen(tmp_path):
    with open_db(tmp_path) as db:
        k1 = db.block_keys(list(range(8)), tenant="acme")
    with open_db(tmp_path) as db:
        assert db.block_keys(list(range(8)), tenant="acme") == k1


def test_second_open_is_refused_in_process_and_across_processes(tmp_path):
    db = open_db(tmp_path)
    try:
        with pytest.raises(DbLockedError, match="already open"):
            open_db(tmp_path)
        code = textwrap.dedent(f"""
            import torch, kvdb, sys
            from kvdb.errors import DbLockedError
            try:
                kvdb.open({str(tmp_path)!r}, disk_bytes=0, host_bytes=1 << 20)
            except DbLockedError as e:
                print("locked", e); sys.exit(0)
            sys.exit(1)
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "already open" in r.stdout
    finally:
        db.close()
    with open_db(tmp_path):
        pass


def test_closed_db_rejects_calls(tmp_path):
    db = open_db(tmp_path)
    keys = db.block_keys(list(range(4)))
    db.close()
    db.close()  # idempotent
    with pytest.raises(KvdbError, match="closed"):
        db.match_prefix(keys)


def test_blocks_from_bf16_and_arrays_of_keys(tmp_path):
    import numpy as np

    lay = kvdb.BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=2, dtype=torch.bfloat16)
    with kvdb.open(tmp_path, layout=lay, model_id="m", host_bytes=4 * lay.page_bytes, disk_bytes=0) as db:
        keys = db.block_keys(torch.tensor([[5, 6, 7, 8, 9]]))  # [1, n] tensors are accepted
        arr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, 16)
        b = torch.randn((2, *lay.block_shape)).to(torch.bfloat16)
        db.put_blocks(arr, b)
        out = torch.empty_like(b)
        db.get_blocks(keys, out=out)
        assert torch.equal(out.view(torch.int16), b.view(torch.int16))


def test_offload_and_async_prefetch(tmp_path):
    # Scenario: 3 pages on a 4-page device tier; offload two to host in the background, then
    # prefetch one back without waiting; bytes survive both moves.
    with open_db(tmp_path, host_pages=4, device_pages=4, device="cpu") as db:
        keys = db.block_keys(list(range(12)))
        b = blocks_for(3)
        db.put_blocks(keys, b)
        fut = db.offload(keys[1:], to="host", wait=False)
        assert fut.result() == 2
        with db.pin(keys) as p:
            assert p.tiers == ["device", "host", "host"]
        st = db.stats()["tiers"]
        assert (st["device"]["pages"], st["host"]["pages"], st["device"]["evictions"]) == (1, 2, 0)
        assert db.prefetch(keys[2:], wait=False).result() == 1
        with db.pin(keys) as p:
            assert p.tiers == ["device", "host", "device"]
        out = torch.empty_like(b)
        db.get_blocks(keys, out=out)
        assert torch.equal(out, b)
        with pytest.raises(InvalidInput, match="disk tier"):
            db.offload(keys, to="disk")
        with pytest.raises(InvalidInput, match="'host' or 'disk'"):
            db.offload(keys, to="gpu")


def test_device_watermark_demotes_in_background(tmp_path):
    # Scenario: 4 device pages with a 50 % free target; after filling 4 pages the mover demotes
    # the 2 least recent to the host tier so later puts find free device frames.
    with open_db(tmp_path, host_pages=4, device_pages=4, device="cpu", device_free_fraction=0.5) as db:
        keys = db.block_keys(list(range(16)))
        b = blocks_for(4)
        for i in range(4):
            db.put_blocks(keys[i : i + 1], b[i : i + 1])
        db.prefetch([], wait=True)  # a barrier: the mover runs jobs in order
        with db.pin(keys) as p:
            assert p.tiers == ["host", "host", "device", "device"]
        out = torch.empty_like(b)
        db.get_blocks(keys, out=out)
        assert torch.equal(out, b)


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "kvflow", "tokencake", "kvdb", "lirs", "lrfu", "s3fifo", "sieve",
                                    "2q", "wtinylfu"])
def test_every_engine_policy_keeps_bytes_exact(tmp_path, policy):
    # Scenario: 3 host pages under each engine policy, a session with a 2-node workflow and
    # 6 blocks put over two calls: whatever each policy evicts, what is present is exact,
    # and the prefix never claims an evicted block.
    with open_db(tmp_path, host_pages=3, replacer=policy) as db:
        db.begin_session("s", tenant="acme", workflow=[{"id": "a", "agent_id": "x"},
                                                       {"id": "b", "agent_id": "x", "deps": ["a"]}])
        keys = db.block_keys(list(range(24)), tenant="acme")
        b = blocks_for(6)
        ctx, _ = db.call_started("s", node_id="a", now_s=0.0)
        db.match_prefix(keys[:3], ctx=ctx)
        db.put_blocks(keys[:3], b[:3], positions=[0, 1, 2], ctx=ctx)
        db.call_finished("s", node_id="a", now_s=1.0)
        ctx, _ = db.call_started("s", node_id="b", now_s=2.0)
        n = db.match_prefix(keys, ctx=ctx)
        db.put_blocks(keys[n:], b[n:], positions=list(range(n, 6)), ctx=ctx)
        present = [k in db.pool for k in keys]
        assert sum(present) == 3
        out = torch.empty((1, *LAYOUT.block_shape))
        for i, k in enumerate(keys):
            if present[i]:
                db.get_blocks([k], out=out)
                assert torch.equal(out[0], b[i])
        assert db.match_prefix(keys) == present.index(False)  # 3 of 6 present: a gap exists
        db.end_session("s")
        assert db.stats()["sessions"] == 0


def test_session_api_and_hint_outcomes(tmp_path):
    with open_db(tmp_path, replacer="kvdb") as db:
        db.begin_session("s1", tenant="acme")
        out = db.hint("s1", expected_tool_duration_s=30, ttl_s=-1, priority=99, colour="red")
        assert [(o.name, o.status) for o in out] == [("expected_tool_duration_s", "accepted"), ("ttl_s", "rejected"),
                                                     ("priority", "clipped"), ("colour", "rejected")]
        assert db.hint("s1", expected_tool_duration_s=float("nan"))[0].status == "rejected"
        assert db.stats()["hints"] == {"accepted": 1, "clipped": 1, "rejected": 3}
        with pytest.raises(InvalidInput, match="already open"):
            db.begin_session("s1")
        with pytest.raises(InvalidInput, match="cycl|cycle"):
            db.begin_session("s2", workflow=[{"id": "a", "agent_id": "x", "deps": ["b"]},
                                             {"id": "b", "agent_id": "x", "deps": ["a"]}])
        with pytest.raises(NotFound):
            db.hint("nope", ttl_s=1)
        db.end_session("s1")
        with pytest.raises(NotFound):
            db.end_session("s1")
    with pytest.raises(InvalidInput, match="replay"):
        open_db(tmp_path / "b", replacer="belady")
    with pytest.raises(InvalidInput, match="unknown policy"):
        open_db(tmp_path / "c", replacer="fifo")


def test_get_prefix_stops_at_first_unreadable_block(tmp_path):
    # Scenario: blocks 0-4 stored, block 2 deleted: get_prefix copies 2 and returns 2; with the
    # disk tier on, a block only on disk continues the run.
    with open_db(tmp_path, host_pages=8) as db:
        keys = db.block_keys(list(range(20)))
        b = blocks_for(5)
        db.put_blocks(keys, b)
        db.delete([keys[2]])
        out = torch.zeros_like(b)
        assert db.get_prefix(keys, out=out) == 2
        assert torch.equal(out[:2], b[:2]) and torch.count_nonzero(out[2:]) == 0
    with kvdb.open(tmp_path / "d", layout=LAYOUT, model_id="m", host_bytes=2 * PAGE) as db:
        keys = db.block_keys(list(range(20)))
        b = blocks_for(5)
        db.put_blocks(keys, b)  # 3 of them go straight to disk
        db.delete([keys[4]])
        out = torch.zeros_like(b)
        assert db.get_prefix(keys, out=out) == 4
        assert torch.equal(out[:4], b[:4])


def test_peek_has_no_side_effects(tmp_path):
    with open_db(tmp_path, host_pages=2) as db:
        ks = [db.block_keys(list(range(10 * i, 10 * i + 4)))[0] for i in range(3)]
        db.put_blocks(ks[:1], blocks_for(1))
        db.put_blocks(ks[1:2], blocks_for(1))
        before = db.stats()["tiers"]["host"]
        assert db.contains(ks[0]) and db.match_prefix(ks[:1], peek=True) == 1
        assert db.stats()["tiers"]["host"] == before  # no hits counted
        db.put_blocks(ks[2:], blocks_for(1))  # evicts ks[0]: the peek did not make it recent
        assert not db.contains(ks[0]) and db.contains(ks[1])


def test_durable_put_persists_a_dirty_resident_block(tmp_path):
    # Scenario: a block put with durability "none" lives only in memory; putting it again with
    # "sync" must make it durable even though it is already stored.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=4 * PAGE) as db:
        keys = db.block_keys(list(range(8)))
        b = blocks_for(2)
        db.put_blocks(keys, b)
        assert db.cold_store.contains(keys) == [False, False]
        assert db.put_blocks(keys, b, durability="sync") == 0  # nothing new ...
        assert db.cold_store.contains(keys) == [True, True]  # ... but now durable
        assert [(db.pool.tier_of(k), db.pool.is_dirty(k)) for k in keys] == [(1, False)] * 2  # host, clean


def test_open_under_inference_mode(tmp_path):
    # Scenario: engines call the Db under torch.inference_mode(), but the Db's mover writes its
    # arenas from its own thread, outside that (thread-local) mode, so arenas made as inference
    # tensors would refuse every move. 2 device + 2 host pages, no disk tier: 4 blocks fill
    # both; prefetching block 2 moves it up (block 1, least recent on the device, goes down to
    # the host, whose least recent block 3 is dropped). Then, on a Db opened normally, an
    # offload called under the mode moves 2 device blocks down. Every byte survives the moves.
    b = blocks_for(4)
    with torch.inference_mode():
        with open_db(tmp_path, host_pages=2, device_pages=2, device="cpu") as db:
            keys = db.block_keys(list(range(16)))
            assert db.put_blocks(keys, b) == 4
            assert tiers(db, keys) == ["device", "device", "host", "host"]
            assert [db.prefetch([k]) for k in keys] == [0, 0, 1, 0]  # moved up: block 2 only
            assert tiers(db, keys) == ["device", "host", "device", None]
            out = torch.zeros_like(b)
            assert db.get_prefix(keys, out=out) == 3
            assert torch.equal(out[:3], b[:3])
    with open_db(tmp_path, host_pages=2, device_pages=2, device="cpu") as db:
        keys = db.block_keys(list(range(8)))
        b = blocks_for(2, seed=1)
        db.put_blocks(keys, b)
        assert tiers(db, keys) == ["device", "device"]
        with torch.inference_mode():
            assert db.offload(keys, to="host") == 2
        assert tiers(db, keys) == ["host", "host"]
        out = torch.zeros_like(b)
        db.get_blocks(keys, out=out)
        assert torch.equal(out, b)


def test_pin_prefix_pins_the_readable_run(tmp_path):
    # Scenario: 5 blocks, 3 on disk (2-page host tier), block 3 deleted: pin(prefix=True) pins
    # blocks 0-2 (loading the disk ones), and nothing stays pinned after release.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=4 * PAGE) as db:
        keys = db.block_keys(list(range(20)))
        b = blocks_for(5)
        db.put_blocks(keys[:2], b[:2])
        db.put_blocks(keys[2:], b[2:], tier="disk")
        db.delete([keys[3]])
        with db.pin(keys, prefix=True) as p:
            assert len(p) == 3
            assert all(torch.equal(p[i], b[i]) for i in range(3))
        with pytest.raises(NotFound):
            db.pin(keys)
        assert db.stats()["tiers"]["host"]["pinned_pages"] == 0
