"""``kvdb demo`` and ``kvdb bench ttft`` on small settings (kvdb/demo/, kvdb/cli/demo.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvdb.cli.main import cli
from kvdb.demo.agents import MARKER, DemoConfig, explain_spec, fresh_data_dir, run_demo, workflow_nodes
from kvdb.errors import InvalidInput

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small(tmp_path, **kw) -> DemoConfig:
    kw = {"rounds": 1, "workers": 2, "system_tokens": 256, "schema_tokens": 64, "role_tokens": 64,
          "tool_result_tokens": 48, "output_tokens": 4, **kw}
    return DemoConfig(data_dir=tmp_path / "demo", **kw)


def test_workflow_dag_shape(tmp_path):
    nodes = workflow_nodes(small(tmp_path, rounds=2))
    ids = [n["id"] for n in nodes]
    assert ids[:8] == ["plan1", "search1", "work1.1", "exec1.1", "fix1.1", "work1.2", "exec1.2", "fix1.2"]
    assert ids[8:10] == ["review1", "plan2"]
    by = {n["id"]: n for n in nodes}
    assert by["review1"]["deps"] == ["fix1.1", "fix1.2"] and by["plan2"]["deps"] == ["review1"]
    assert by["exec1.2"]["kind"] == "tool" and by["exec1.2"]["expected_duration_s"] > 0
    spec = explain_spec(small(tmp_path))
    blocks = {n["id"]: n.get("prompt_blocks") for n in spec["nodes"]}
    # planner: 256 + 64 shared, 64 role = 384 tokens; worker: + 4 plan + 48 search = 436;
    # fix: + 4 output + 48 tool result = 488; reviewer: 384 + 2 x 4 fix outputs = 392
    assert blocks == {"plan1": 24, "search1": None, "work1.1": 27, "exec1.1": None, "fix1.1": 30,
                      "work1.2": 27, "exec1.2": None, "fix1.2": 30, "review1": 24}
    assert spec["shared_prefix_blocks"] == 20


def test_demo_run_reuses_prefixes_and_agrees_with_full_prefill(tmp_path):
    res = run_demo(small(tmp_path))
    calls = {c["node"]: c for c in res["calls"]}
    assert list(calls) == ["plan1", "work1.1", "work1.2", "fix1.1", "fix1.2", "review1"] or \
        list(calls) == ["plan1", "work1.1", "work1.2", "fix1.2", "fix1.1", "review1"]  # fixes in tool-end order
    assert res["llm_calls"] == 6 and res["first_tokens_identical"] == 6
    # shared system + schema prefix (320 tokens) for every agent after the first call; a
    # worker's follow-up reuses its whole previous call: 436 prompt + 4 output -> 439 tokens in
    # the cache -> 27 full blocks = 432 tokens
    assert [calls[n]["cached_tokens"] for n in ("plan1", "work1.1", "work1.2", "fix1.1", "fix1.2", "review1")] == \
        [0, 320, 320, 432, 432, 320]
    for c in res["calls"]:
        assert c["device_tokens"] + c["host_tokens"] + c["disk_tokens"] == c["cached_tokens"]
    h = res["hit_tokens"]
    assert h["device"] + h["host"] + h["disk"] + h["recomputed"] == res["prompt_tokens"] == \
        384 + 436 * 2 + 488 * 2 + 392
    assert res["explain"]["session_id"] == "demo" and res["explain"]["plan"]
    png = (tmp_path / "demo" / "ttft.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert res["chart"] == str(tmp_path / "demo" / "ttft.png")


def test_demo_tools_arrive_reordered_and_canonical_rendering_never_breaks(tmp_path):
    # Scenario: 2 rounds, 1 worker (8 calls); every call's tools come back in a shuffled order,
    # and worker1 loads a fifth tool (16 more head tokens, sorted last) from round 2 on
    res = run_demo(small(tmp_path, rounds=2, workers=1))
    cb = res["cache_breaks"]
    assert cb["tool_orders"] > 1 and cb["tool_change_round"] == 2
    assert cb["canonical"]["calls"] == cb["raw"]["calls"] == res["llm_calls"] == 8
    assert (cb["canonical"]["breaks"], cb["canonical"]["tokens_lost"]) == (0, 0)
    assert cb["raw"]["breaks"] > 0 and cb["raw"]["tokens_lost"] > cb["raw"]["breaks"] * 64
    calls = {c["node"]: c for c in res["calls"]}
    # the added tool ends the head: worker1 keeps the shared 320 head tokens, then recomputes
    assert calls["work2.1"]["prompt_tokens"] > calls["fix1.1"]["prompt_tokens"] + 16
    assert calls["work2.1"]["cached_tokens"] == 320
    assert calls["plan2"]["cached_tokens"] > 320  # the planner's tool set did not change: its history is reused
    assert res["first_tokens_identical"] == 8


def test_demo_tiers_under_tight_capacity(tmp_path):
    # 6 device + 6 host pages for ~60 distinct blocks: blocks go down to disk and come back
    res = run_demo(small(tmp_path, device_pages=6, host_pages=6))
    assert res["first_tokens_identical"] == 6
    assert res["tiers"]["device"]["evictions"] > 0 and res["tiers"]["host"]["evictions"] > 0
    assert res["tiers"]["disk"]["pages"] > 0
    cached = [c["cached_tokens"] for c in res["calls"]]
    assert sum(cached) > 0 and all(c % 16 == 0 for c in cached)


def test_fresh_data_dir_refuses_foreign_data(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(InvalidInput, match="not a previous demo"):
        fresh_data_dir(foreign)
    assert (foreign / "precious.txt").read_text() == "keep me"
    old = tmp_path / "old-demo"
    old.mkdir()
    (old / MARKER).write_text("")
    (old / "stale").write_text("x")
    p = fresh_data_dir(old)
    assert sorted(x.name for x in p.iterdir()) == [MARKER]


def test_cli_demo_json(tmp_path):
    r = CliRunner().invoke(cli, ["demo", "--rounds", "1", "--workers", "1", "--output-tokens", "2",
                                 "--data-dir", str(tmp_path / "d"),
                                 "--chart", str(tmp_path / "c.png"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["llm_calls"] == 4 and res["first_tokens_identical"] == 4
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_MAGIC)
    r = CliRunner().invoke(cli, ["demo", "--rounds", "0"])
    assert r.exit_code == 2


def test_cli_bench_ttft_json(tmp_path):
    r = CliRunner().invoke(cli, ["bench", "ttft", "--prompt-tokens", "512", "--repeats", "1", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert list(res)[:7] == ["full_prefill_s", "suffix_prefill_s", "restore_host_s", "restore_disk_s",
                             "ideal_speedup", "host_speedup", "disk_speedup"]
    assert res["prompt_tokens"] == 512 and res["stored_tokens"] == 448
    for k in ("full_prefill_s", "suffix_prefill_s", "restore_host_s", "restore_disk_s"):
        assert res[k] > 0
    r = CliRunner().invoke(cli, ["bench", "ttft", "--stored-fraction", "1.5"])
    assert r.exit_code == 2 and "--stored-fraction" in r.output  # a usage error, caught while parsing (docs/style.md "CLI")
