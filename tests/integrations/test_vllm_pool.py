"""kvdb's plans on vLLM's own KV pool (kvdb/integrations/vllm/pool.py, P1-P5), against vLLM's
real ``BlockPool`` constructed directly (no engine), and the worker's answer that drives them
(kvdb/integrations/vllm/service.py: ``demote``, ``prefix_blocks``, ``session_ended``)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import kvdb

pytestmark = pytest.mark.vllm
if os.environ.get("KVDB_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from kvdb.integrations.vllm.pool import PoolOps  # noqa: E402
from kvdb.integrations.vllm.settings import Settings  # noqa: E402
from kvdb.errors import InvalidInput  # noqa: E402

N = 16  # blocks; block 0 is vLLM's null block


def h(i: int) -> bytes:
    return bytes([i]) * 32


def run_request(pool: BlockPool, n: int, first_hash: int) -> list[tuple[int, bytes]]:
    """A request that computed ``n`` full blocks, cached them and finished, as the scheduler does:
    allocated, hashed, freed in reverse (vLLM frees a request's tail first)."""
    blocks = pool.get_new_blocks(n)
    out = []
    for k, b in enumerate(blocks):
        pool._insert_block_hash(make_block_hash_with_group_id(h(first_hash + k), 0), b, None)
        out.append((b.block_id, h(first_hash + k)))
    pool.free_blocks(reversed(blocks))
    return out


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def consistent(pool: BlockPool) -> bool:
    free = pool.free_block_queue.get_all_free_blocks()
    return len(free) == pool.get_num_free_blocks() and all(b.ref_cnt == 0 for b in free)


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=16)


def test_demote_puts_the_blocks_first_among_cached_ones_deepest_first_and_keeps_their_hash(pool):
    b = run_request(pool, 3, 20)  # someone else's blocks, freed earlier (older in vLLM's LRU)
    a = run_request(pool, 4, 10)  # the waiting agent's
    empties = [i for i in queue_ids(pool) if pool.blocks[i].block_hash is None]
    ops = PoolOps(pool)
    ops.demote(a)
    ops.apply()
    ids = [bid for bid, _ in a]
    assert queue_ids(pool) == empties + ids[::-1] + [bid for bid, _ in b][::-1]  # P3
    assert all(pool.blocks[i].block_hash == make_block_hash_with_group_id(hh, 0) for i, hh in a)
    assert pool.get_cached_block(h(10), [0])[0].block_id == ids[0]  # still a prefix hit
    assert consistent(pool)
    assert ops.stats()["demoted_blocks"] == 4 and ops.stats()["demote_ops"] == 1
    # the next allocations past the empty blocks take a's deepest blocks; b stays cached
    pool.get_new_blocks(len(empties) + 2)
    assert pool.get_cached_block(h(13), [0]) is None and pool.get_cached_block(h(12), [0]) is None
    assert pool.get_cached_block(h(10), [0]) is not None
    assert all(pool.get_cached_block(h(20 + k), [0]) is not None for k in range(3))


def test_without_demote_vllm_evicts_the_older_request_first(pool):
    """The baseline the demote changes: vLLM's LRU keeps the most recently freed blocks."""
    run_request(pool, 3, 20)
    run_request(pool, 4, 10)
    empties = sum(pool.blocks[i].block_hash is None for i in queue_ids(pool))
    pool.get_new_blocks(empties + 2)
    assert pool.get_cached_block(h(22), [0]) is None and pool.get_cached_block(h(21), [0]) is None
    assert all(pool.get_cached_block(h(10 + k), [0]) is not None for k in range(4))


def test_a_reused_block_id_is_not_touched(pool):
    a = run_request(pool, 3, 10)
    blocks = pool.get_new_blocks(pool.get_num_free_blocks())  # every block reused: a's hashes go
    for k, b in enumerate(blocks):
        pool._insert_block_hash(make_block_hash_with_group_id(h(100 + k), 0), b, None)
    pool.free_blocks(blocks)
    assert {bid for bid, _ in a} <= {b.block_id for b in blocks}
    ops = PoolOps(pool, cap=4)
    before = queue_ids(pool)
    ops.demote(a)
    ops.pin("s", a)
    ops.apply()
    assert queue_ids(pool) == before  # P2
    st = ops.stats()
    assert st["demoted_blocks"] == 0 and st["pinned_blocks"] == 0 and st["stale_blocks"] == 6


def test_blocks_a_running_request_holds_stay_where_they_are(pool):
    a = run_request(pool, 3, 10)
    held = pool.get_cached_block(h(10), [0])
    pool.touch(held)  # a new request hit block 0 of a
    ops = PoolOps(pool)
    ops.demote(a)
    ops.apply()
    assert held[0].ref_cnt == 1 and held[0].block_id not in queue_ids(pool)
    assert ops.stats()["demote_in_use"] == 1 and ops.stats()["demoted_blocks"] == 2
    assert consistent(pool)


def test_ops_wait_for_apply_on_the_engine_thread(pool):
    a = run_request(pool, 3, 10)
    before = queue_ids(pool)
    ops = PoolOps(pool, cap=2)
    t = threading.Thread(target=lambda: (ops.demote(a), ops.pin("s", a)))
    t.start()
    t.join()
    assert queue_ids(pool) == before and ops.stats()["queued_ops"] == 2  # P1
    assert ops.apply() == 2 and ops.stats()["queued_ops"] == 0


def test_pin_is_refcounted_per_session_capped_and_unpinned_at_the_tail(pool):
    p = run_request(pool, 4, 10)  # a shared prefix
    ops = PoolOps(pool, cap=3)
    ops.pin("s1", p)
    ops.pin("s2", p[:2])
    ops.apply()
    pinned = [bid for bid, _ in p[:3]]
    assert [pool.blocks[i].ref_cnt for i in pinned] == [1, 1, 1]  # P4: once, whatever the sessions
    assert pool.blocks[p[3][0]].ref_cnt == 0 and ops.stats()["pin_capped"] == 1
    assert not set(pinned) & set(queue_ids(pool)) and consistent(pool)
    assert pool.reset_prefix_cache() is False  # vLLM refuses while anything is held
    pool.get_new_blocks(pool.get_num_free_blocks())  # everything else is reused
    assert all(pool.get_cached_block(h(10 + k), [0]) is not None for k in range(3))
    ops.unpin("s1")
    ops.apply()
    assert [pool.blocks[i].ref_cnt for i in pinned] == [1, 1, 0]  # s2 still holds blocks 0 and 1
    assert queue_ids(pool)[-1] == pinned[2] and pool.blocks[pinned[2]].block_hash is not None
    ops.unpin_all()  # P5: the connector's shutdown
    assert ops.stats()["pinned_blocks"] == 0 and ops.stats()["unpinned_blocks"] == 3
    assert consistent(pool)


def test_pins_are_released_after_the_session_idles(pool):
    p = run_request(pool, 2, 10)
    now = [0.0]
    ops = PoolOps(pool, cap=4, idle_s=10.0, clock=lambda: now[0])
    ops.pin("s", p)
    ops.apply()
    assert ops.stats()["pinned_blocks"] == 2
    now[0] = 11.0
    ops.apply()
    assert ops.stats()["pinned_blocks"] == 0 and pool.reset_prefix_cache() is True


def test_the_cap_never_exceeds_half_the_pool(pool):
    assert PoolOps(pool, cap=1000).cap == (N - 1) // 2
    assert PoolOps(pool).cap == 0


def test_settings():
    s = Settings.from_extra({"path": "kv"})
    assert (s.pool_demote, s.pool_pin_blocks) == (True, 0)
    s = Settings.from_extra({"path": "kv", "pool_demote": False, "pool_pin_blocks": 64})
    assert (s.pool_demote, s.pool_pin_blocks) == (False, 64)
    for bad in ({"pool_demote": 1}, {"pool_pin_blocks": -1}, {"pool_pin_blocks": True}):
        with pytest.raises(InvalidInput):
            Settings.from_extra({"path": "kv", **bad})


# ------------------------------------------------------------------ the worker's answer
BT = 16
LAYOUT = kvdb.BlockLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=BT, dtype=torch.float32)


def test_the_worker_names_a_waiting_agents_stored_private_blocks(served):
    db, hashes = served.db, [h(i) for i in range(1, 7)]
    db.put_blocks(db.engine_keys(hashes[:5], tenant="default"), torch.zeros(5, *LAYOUT.block_shape))
    call = {"op": "lookup", "tenant": "default", "hashes": hashes}
    served.call(dict(call, req="other", hashes=hashes[:2], params={"session_id": "s2", "agent_id": "b"}))  # 0-1
    served.call(dict(call, req="r1", params={"session_id": "s1", "agent_id": "a", "expected_tool_duration_s": 30}))
    got = served.call({"op": "finished", "req": "r1", "hashes": hashes, "pool": True})
    assert [o["status"] for o in got["hints"]] == ["accepted"]
    # stored (0-4), not in agent b's open chain; block 5 is not stored (I2)
    assert got["demote"] == [2, 3, 4]
    served.call(dict(call, req="r2", params={"session_id": "s1", "agent_id": "a"}))  # no tool wait
    assert served.call({"op": "finished", "req": "r2", "hashes": hashes, "pool": True})["demote"] == []
    served.call(dict(call, req="r3", params={"session_id": "s1", "agent_id": "a", "end_session": True}))
    got = served.call({"op": "finished", "req": "r3", "hashes": hashes, "pool": True, "pool_stats": {"x": 1}})
    assert got["session_ended"] is True and got["demote"] == [2, 3, 4] and got["hints"] == []
    assert served.stats()["pool"] == {"x": 1}
    with pytest.raises(kvdb.errors.NotFound):
        db.explain(session_id="s1")


def test_a_prefix_hash_names_blocks_by_vllms_hash_or_kvdbs_key(served):
    db, hashes = served.db, [h(i) for i in range(1, 7)]
    keys = db.engine_keys(hashes, tenant="default")
    for name, value in (("vllm hash", hashes[2].hex()), ("kvdb key", keys[2].hex())):
        got = served.call({"op": "lookup", "req": name, "tenant": "default", "hashes": hashes,
                           "params": {"session_id": name, "prefix_hash": value}})
        assert got["prefix_blocks"] == 3, name
        assert [o["hint"] for o in got["hints"]] == ["prefix_hash"], name
        # the Db sees it under its kvdb key (resolved by this very lookup: clipped until then, X2)
        assert got["hints"][0]["value"] == keys[2].hex(), name
        assert db.stats()["plans"]["prefixes_resolved"] >= 1
    got = served.call({"op": "lookup", "req": "none", "tenant": "default", "hashes": hashes,
                       "params": {"session_id": "x", "prefix_hash": "ab" * 32}})
    assert "prefix_blocks" not in got


# ------------------------------------------------------------------ through a real engine
@pytest.mark.slow
def test_a_real_engine_demotes_a_waiting_agents_blocks(tmp_path):
    """One process (the tiny Llama): another session's call, then a 2048-token call that ends with
    a 30 s tool-wait hint; the next request's lookup runs the queued demote: the agent's 16
    blocks lead vLLM's cached blocks, ahead of the older session's (LRU alone: behind them)."""
    from kvdb.bench.tiny_llama import build_tiny_llama

    from .test_vllm import drive

    got = drive("demote", build_tiny_llama(tmp_path / "model"), tmp_path / "db")
    st = got["pool"]
    assert st["demote_ops"] == 1 and st["demoted_blocks"] == 16 and st["queued_ops"] == 0
    assert got["agent_cached"] == 16 and got["leading_cached_of_agent"] == 16
    assert got["cached"] > 16  # the other request's blocks are behind them
