"""``kvdb bench vllm-agents`` at its quick size: every configuration runs through vLLM's OpenAI
server and the report has its keys (no timing asserts: the figures are for a quiet machine)."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if os.environ.get("KVDB_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")


def test_the_quick_bench_reports_every_configuration(tmp_path):
    import dataclasses

    from kvdb.bench.vllm_agents import CONFIGS, QUICK, bench_vllm_agents

    sz = dataclasses.replace(QUICK, gen_sessions=0)  # one short session per configuration
    res = bench_vllm_agents(sz, restarts=("kvdb_disk",), data_dir=str(tmp_path))
    assert set(res["configs"]) == set(CONFIGS) | {"kvdb_disk_restart"}
    for name, c in res["configs"].items():
        assert c["errors"] == 0 and c["requests"] > 0, name
        for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "total_s", "prompt_tokens",
                  "vllm_cache_tokens", "kvdb_tokens"):
            assert k in c, (name, k)
        if name.startswith("kvdb") and name != "kvdb_lru":  # kvdb_lru: no pool ops
            assert set(c["pool"]) >= {"demoted_blocks", "pinned_blocks", "stale_blocks"}, name
            assert c["connector"]["saved_blocks"] > 0 or name.endswith("_restart"), name
    assert res["outputs_identical"] is True
    assert res["workload"]["sessions"] == 1 and set(res["ratios"]) >= {"hints_vs_apc_equal_ttft", "hints_vs_lru_ttft"}
    assert res["configs"]["kvdb_lru"]["pool"] is None  # no hints, no pool ops
