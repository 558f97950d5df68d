"""``kvdb bench shared --json``, tiny (2 pages, 1 round): it starts its own private pool, runs
both sides of each figure and reports every key (no timing asserts: kvdb/bench/shared.py).
``--no-vllm`` keeps it tiny; the vLLM figures have a test of their own (two engine starts, slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import need_pool

from kvdb.shared.localpool import die_with_parent

VLLM_KEYS = ["prompt_tokens", "stored_tokens", "repeats", "recompute_vs_pool", "recompute_vs_pool_runs",
             "pool_vs_prefix_hit", "pool_vs_prefix_hit_runs", "goals", "meets_goals", "cached_tokens",
             "published_blocks", "dropped_puts", "pool_hits", "corruptions", "wall_s", "b_recompute_vs_pool",
             "pool_vs_b_prefix_hit"] + [
    f"{name}_s{suf}" for name in ("recompute", "vllm_prefix_hit", "pool", "b_prefix_hit", "b_recompute")
    for suf in ("", "_runs", "_spread")]
KEYS = ["pages", "page_bytes", "repeats", "corruptions", "dropped_puts"] + [
    f"{pre}{name}{suf}" for name in ("put", "get")
    for pre, suf in [("", "_mbps"), ("", "_mbps_runs"), ("", "_mbps_spread"), ("store_", "_mbps"),
                     ("store_", "_mbps_runs"), ("store_", "_mbps_spread"), ("", "_vs_store"),
                     ("", "_vs_store_runs"), ("", "_goal"), ("", "_meets_goal")]]


def bench(tmp_path, *args: str, timeout: int = 120) -> dict:
    need_pool()
    # a process of its own: the bench makes its own network namespace, and the Store client
    # keeps connections in the namespace it first used (conftest.py)
    r = subprocess.run([sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "bench", "shared", "--json",
                        "--pages", "2", "--repeats", "1", "--dir", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=timeout, preexec_fn=die_with_parent,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_bench_shared_json_tiny(tmp_path):
    res = bench(tmp_path, "--no-vllm")
    assert "vllm" not in res
    assert [k for k in KEYS if k not in res] == []
    assert res["pages"] == 2 and res["repeats"] == 1 and res["page_bytes"] == 2 << 20
    assert len(res["put_mbps_runs"]) == 1 and len(res["store_get_mbps_runs"]) == 1
    assert res["corruptions"] == 0 and res["dropped_puts"] == 0
    assert os.listdir(tmp_path) == []  # the Dbs' directories are removed


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_bench_shared_vllm_tiny(tmp_path):
    """Engine A then engine B on the bench's pool, 2048-token prompts, one round: every key, B
    got the whole stored prefix from the pool (the bench refuses otherwise); no timing asserts."""
    if os.environ.get("KVDB_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
    res = bench(tmp_path, "--vllm", "--vllm-prompt-tokens", "2048", "--vllm-repeats", "1", timeout=540)
    v = res["vllm"]
    assert [k for k in VLLM_KEYS if k not in v] == []
    assert v["prompt_tokens"] == 2048 and v["stored_tokens"] == 1792 and v["repeats"] == 1
    assert v["cached_tokens"] == {"recompute": [0], "vllm_prefix_hit": [1792], "pool": [1792], "b_prefix_hit": [1792],
                                  "b_recompute": [0]}
    assert len(v["pool_s_runs"]) == 1 and v["pool_hits"] >= 14
    assert v["dropped_puts"] == 0 and v["corruptions"] == 0
    assert os.listdir(tmp_path) == []  # the engines' directories, the model and the key file are removed
