"""The prompt workload (``kvdb gen --prompts``) and ``kvdb bench cache-break`` on a small run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvdb.cli.main import cli
from kvdb.errors import InvalidInput
from kvdb.prompts import render
from kvdb.sim import prompt_gen


def enc(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def calls(**kw):
    return list(prompt_gen.generate(prompt_gen.load_params(sessions=2, calls=6, **kw)))[1:]


def tool_orders(lines):
    return [[t["name"] for t in c["parts"]["tools"]] for c in lines]


def test_the_seed_decides_the_trace_and_noise_only_serialisation():
    assert calls(seed=3) == calls(seed=3) and calls(seed=3) != calls(seed=4)
    noisy = calls(seed=3, tool_order_churn=1.0, json_key_noise=1.0, tool_list_change=0.5)
    clean = calls(seed=3, tool_list_change=0.5)
    assert prompt_gen.clean(prompt_gen.load_params(seed=3, tool_order_churn=1.0, json_key_noise=1.0, tool_list_change=0.5)) \
        == prompt_gen.load_params(seed=3, tool_list_change=0.5)
    assert any(c["tools_changed"] for c in noisy)
    assert [c["tools_changed"] for c in noisy] == [c["tools_changed"] for c in clean]
    # the same content: canonical rendering cannot tell them apart; raw rendering can
    assert all(render(a["parts"], encode=enc).token_ids == render(b["parts"], encode=enc).token_ids
               for a, b in zip(noisy, clean))
    assert any(render(a["parts"], encode=enc, canonical=False).token_ids
               != render(b["parts"], encode=enc, canonical=False).token_ids for a, b in zip(noisy, clean))
    assert tool_orders(noisy) != tool_orders(clean)
    # no noise: the servers' own order, the same for every call of a session
    assert len({tuple(o) for o in tool_orders(calls(seed=3))}) == 1


def test_gen_prompts_cli(tmp_path):
    out = tmp_path / "p.jsonl"
    r = CliRunner().invoke(cli, ["gen", "--prompts", "--seed", "5", "--sessions", "2", "--tool-order-churn", "0.5",
                                 "--json-key-noise", "0.2", "--tool-list-change", "0.1", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    params, lines = prompt_gen.read_trace(str(out))
    assert params["tool_order_churn"] == 0.5 and len(lines) == 2 * params["calls"]
    assert lines == list(prompt_gen.generate(params))[1:]
    bad = CliRunner().invoke(cli, ["gen", "--json-key-noise", "0.2", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--json-key-noise needs --prompts" in bad.output
    bad = CliRunner().invoke(cli, ["gen", "--prompts", "--tool-list-change", "1.5", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--tool-list-change" in bad.output  # a usage error, refused while parsing
    (tmp_path / "junk.jsonl").write_text('{"type": "call"}\n')
    with pytest.raises(InvalidInput, match="not a kvdb prompt trace"):
        prompt_gen.read_trace(str(tmp_path / "junk.jsonl"))


@pytest.mark.parametrize("kw, match", [({"calls": 0}, "calls"), ({"tool_order_churn": -0.1}, "probability"),
                                       ({"system_words": [5]}, "system_words"), ({"colour": 1}, "unknown")])
def test_bad_workload_params(kw, match):
    with pytest.raises(InvalidInput, match=match):
        prompt_gen.load_params(**kw)


def test_bench_cache_break_small_run():
    pytest.importorskip("tokenizers")
    r = CliRunner().invoke(cli, ["bench", "cache-break", "--seed", "5", "--level", "high", "--sessions", "3",
                                 "--calls", "5", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    for mode in ("clean", "raw", "canonical", "first_seen"):
        assert 0.0 <= res[f"hit_rate_{mode}"]["high"] <= 1.0
    assert res["hit_rate_raw"]["high"] < res["hit_rate_canonical"]["high"]
    assert res["breaks_per_call"]["raw"]["high"] > res["breaks_per_call"]["canonical"]["high"]
    assert res["tokens_per_call"]["canonical"]["high"] < res["tokens_per_call"]["raw"]["high"]
    assert res["timed_calls"] == 15 and res["tokenizer"]["trained_on_seed"] not in res["seeds"]
    for k in ("render_ms_per_call", "block_keys_ms_per_call", "tokenizer_ms_per_call", "render_keys_vs_tokenizer"):
        assert res[k] > 0
    bad = CliRunner().invoke(cli, ["bench", "cache-break", "--level", "extreme"])
    assert bad.exit_code == 2 and "extreme" in bad.output
