"""kvdb inside a real vLLM (the CPU build), end to end: kvdb/integrations/vllm/.

A tiny random-weight Llama (4 layers, 2 kv heads, head dim 64, fp32) is written locally; vLLM's
CPU block size is 128 tokens, so a 2048-token prompt is 16 blocks and at most 15 (1920 tokens)
can be loaded (the last token is always computed, connector I1). Each scenario runs in its own
interpreter (tests/integrations/vllm_driver.py): the Db is owned by vLLM's worker, and an engine
holds its process for good.

    first    -> P: 0 cached, then 1920 from kvdb with the same tokens; loaded blocks == stored
                blocks bit for bit; cache_salt tenants; hints through kv_transfer_params
    (here)   stored blocks == transformers' K (after RoPE) and V; one byte of P2's block 5 flipped
    restart  -> a new process: P 1920 from disk; P2's hit ends at block 5, same tokens, healed
    mp       -> vLLM's default multi-process mode: the same hits through the worker's socket
    prompts  -> rendered prompts: tools reordered, canonical render -> a hit and no break; raw -> a break
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvdb
from kvdb.bench.tiny_llama import build_tiny_llama

from .helpers import corrupt_block

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if os.environ.get("KVDB_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

DRIVER = Path(__file__).with_name("vllm_driver.py")
BT, FULL, LOADABLE = 128, 16, 15
BAD = 5  # the block of P2 whose bytes are flipped on disk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def drive(scenario: str, model: Path, path: Path) -> dict:
    out = path.parent / f"{path.name}-{scenario}.json"
    p = subprocess.run([sys.executable, str(DRIVER), scenario, str(model), str(path), str(out)],
                       capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0 and out.exists(), f"{scenario} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict:
    """first, then P2's block BAD corrupted on disk, then restart; all on one data directory."""
    path = tmp_path_factory.mktemp("vllm") / "db"
    first = drive("first", model_dir, path)
    sys.path.insert(0, str(DRIVER.parent))
    import vllm_driver as d

    with kvdb.open(path) as db:
        keys = db.engine_keys([bytes.fromhex(h) for h in d.vllm_hashes(d.P2)])
        blk = torch.empty((1, *db.layout.block_shape), dtype=db.layout.dtype)
        db.get_blocks(keys[BAD:BAD + 1], out=blk)
    corrupt_block(path, blk)
    restart = drive("restart", model_dir, path)
    return {"first": first, "restart": restart, "path": path, "p2_keys": keys, "driver": d}


def test_one_process_second_run_loads_1920_tokens_with_identical_output(runs):
    cold, warm = runs["first"]["p"]
    assert cold["cached"] == 0 and cold["kvdb"]["hit_tokens"] == 0
    assert warm["cached"] == LOADABLE * BT == 1920
    assert warm["kvdb"]["hit_tokens"] == 1920
    assert warm["tokens"] == cold["tokens"] and len(cold["tokens"]) == 16


def test_restored_kv_is_the_stored_blocks_bit_for_bit(runs):
    assert runs["first"]["compared_blocks"] == LOADABLE
    assert runs["first"]["bit_exact"] is True


def test_stored_blocks_match_a_transformers_recomputation(runs, model_dir):
    import transformers

    d = runs["driver"]
    with kvdb.open(runs["path"]) as db:
        keys = db.engine_keys([bytes.fromhex(h) for h in runs["first"]["hashes_p"]])
        assert len(keys) == FULL and db.match_prefix(keys, peek=True) == FULL  # every full block was saved
        blocks = torch.empty((FULL, *db.layout.block_shape), dtype=db.layout.dtype)
        db.get_blocks(keys, out=blocks)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([d.P]), use_cache=True).past_key_values
    # kvdb block [n, layers, 2, bt, heads, dim] vs transformers [1, heads, tokens, dim] per layer
    ours = blocks.permute(1, 2, 0, 3, 4, 5).reshape(4, 2, FULL * BT, 2, 64)
    for layer, lc in enumerate(cache.layers):
        for kv, ref in enumerate((lc.keys, lc.values)):
            ref = ref[0].permute(1, 0, 2)  # [tokens, heads, dim]
            diff = (ours[layer, kv] - ref).abs().max().item()
            assert diff <= 1e-4, f"layer {layer} {'KV'[kv]}: max |vLLM - transformers| = {diff}"


def test_a_new_process_loads_from_disk(runs):
    again = runs["restart"]["p"]
    assert again["cached"] == 1920 and again["kvdb"]["hit_tokens"] == 1920
    assert again["tokens"] == runs["first"]["p"][0]["tokens"]


def test_a_flipped_byte_ends_the_hit_at_that_block_and_output_is_unchanged(runs):
    p2 = runs["restart"]["p2"]
    assert p2["kvdb"]["hit_tokens"] == BAD * BT
    assert p2["tokens"] == runs["first"]["p2"]["tokens"]
    # the damaged block was dropped and vLLM's recomputation of it saved again
    with kvdb.open(runs["path"]) as db:
        keys = runs["p2_keys"]
        assert db.match_prefix(keys, peek=True) == FULL
        blk = torch.empty((FULL, *db.layout.block_shape), dtype=db.layout.dtype)
        db.get_blocks(keys, out=blk)


def test_cache_salts_never_share_blocks(runs):
    a1, b, a2 = runs["first"]["salt"]
    assert a1["cached"] == 0  # P is stored for the default tenant only
    assert b["cached"] == 0 and b["kvdb"]["hit_tokens"] == 0
    assert a2["cached"] == 1920  # tenant-a's own blocks
    assert a1["tokens"] == b["tokens"] == a2["tokens"] == runs["first"]["p"][0]["tokens"]


def test_hints_in_kv_transfer_params_reach_the_planner(runs):
    first = runs["first"]
    got = {h["hint"]: h for h in first["hinted"]["kvdb"]["hints"]}
    assert got["ttl_s"]["status"] == "accepted" and got["priority"]["status"] == "accepted"
    assert got["expected_tool_duration_s"]["status"] == "accepted"
    assert got["bogus_hint"]["status"] == "rejected" and "unknown hint" in got["bogus_hint"]["reason"]
    plan = first["explain"]
    assert plan["session_id"] == "s1"
    (agent,) = plan["agents"]
    assert agent["agent_id"] == "planner" and agent["state"] == "waiting"
    assert 0 < agent["return_in_s"] <= 30.0  # the tool wait it was told about
    assert agent["chain_blocks"] == 1000 // BT


def test_malformed_hints_are_rejected_and_the_request_still_runs(runs):
    first = runs["first"]
    bad = first["malformed"]
    got = {h["hint"]: h for h in bad["kvdb"]["hints"]}
    assert got["session_id"]["status"] == "rejected"
    assert got["priority"]["status"] == "rejected"
    assert bad["tokens"] == first["hinted"]["tokens"]


def test_default_multiprocess_mode_gets_the_same_hits(model_dir, tmp_path, runs):
    cold, warm = drive("mp", model_dir, tmp_path / "db")["p"]
    assert cold["cached"] == 0
    assert warm["cached"] == 1920 and warm["kvdb"]["hit_tokens"] == 1920
    assert warm["tokens"] == cold["tokens"] == runs["first"]["p"][0]["tokens"]
    # the script ended with the engine running (vLLM stops its worker process): the blocks are on disk
    after = drive("stored", model_dir, tmp_path / "db")
    assert after["p_blocks"] >= LOADABLE and after["lock_free"], after


def test_rendered_prompts_share_the_prefix_when_canonical_and_break_when_raw(model_dir, tmp_path):
    # Scenario: an agent's second call gets its four tools back in reverse order and asks a new
    # question; the system prompt and tools are ~2.3 kB (one token per byte), the question ~30.
    got = drive("prompts", model_dir, tmp_path / "db")
    (c1, c2), (r1, r2) = got["canon"], got["raw"]
    assert c1["kvdb"]["hit_tokens"] == 0 and c1["kvdb"]["prompt"]["status"] == "noted"
    shared = c2["tool_end"] // BT * BT  # every full block before the question
    assert shared >= 8 * BT
    assert c2["kvdb"]["hit_tokens"] == c2["cached"] == shared
    assert c2["kvdb"]["prompt"] | {"status": "noted", "broke": False, "lost": 0} == c2["kvdb"]["prompt"]
    assert c2["kvdb"]["prompt"]["shared"] == c2["tool_end"] == c2["kvdb"]["prompt"]["could"]
    # raw: the reordered tools change the tokens right after the system prompt
    assert r2["kvdb"]["hit_tokens"] < 2 * BT
    assert r2["kvdb"]["prompt"]["broke"] is True and r2["kvdb"]["prompt"]["lost"] >= 6 * BT
    assert r2["kvdb"]["prompt"]["near_segments"] >= 3  # the tools are stored, after another context
    stats = got["stats"]
    assert (stats["calls"], stats["breaks"], stats["tokens_lost"]) == (4, 1, r2["kvdb"]["prompt"]["lost"])
    assert got["explain"]["canon"]["breaks"] == 0 and got["explain"]["raw"]["breaks"] == 1
    assert got["connector"]["noted_prompts"] == 4 and got["connector"]["ignored_prompts"] == 0
