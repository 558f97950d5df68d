"""``kvdb gen``'s workload shapes (kvdb/sim/shapes.py): each option changes the trace the way its
doc says and nothing else, every shaped trace reads back through the trace reader and replays,
and the seed decides the trace."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import defaultdict

import pytest

from kvdb.errors import InvalidInput
from kvdb.sim.generator import generate, load_params
from kvdb.sim.replay import replay
from kvdb.sim.trace import Call, WorkflowLine, parse_trace


def _lines(**kw) -> list[dict]:
    return list(generate(load_params(None, **kw)))


def _trace(lines: list[dict]):
    return parse_trace("\n".join(json.dumps(x) for x in lines))  # the reader checks every line


def _calls(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "hash_ids" in x]


def _workflows(lines: list[dict]) -> dict[str, list[dict]]:
    return {x["session_id"]: x["nodes"] for x in lines if x.get("type") == "workflow"}


def _digest(lines: list[dict]) -> str:
    h = hashlib.sha256()
    for x in lines:
        h.update((json.dumps(x, separators=(",", ":")) + "\n").encode())
    return h.hexdigest()


def _breaks(calls: list[dict]) -> tuple[int, int]:
    """(calls whose full blocks do not extend the same session's and agent's previous call's, calls
    that have such a previous call); a call's last block is partial and never carried on."""
    prev: dict[tuple, list] = {}
    broken = n = 0
    for c in calls:
        key = (c["session_id"], c["agent_id"])
        full = c["hash_ids"][:-1]
        if key in prev:
            n += 1
            p = prev[key]
            broken += full[: len(p)] != p
        prev[key] = full
    return broken, n


def test_shapes_off_leave_the_trace_byte_for_byte():
    # Scenario: the digests of traces written before the shapes existed (the same generator
    # parameters): every shape off by default changes no byte.
    assert _digest(_lines(sessions=6)) == "3ff28a8290a5fa85e85838b610362083ad1d5e7234b2ce460685834e9744ac4f"
    assert _digest(_lines(sessions=6, seed=3, hint_noise_sigma=0.7)) == \
        "2480cfd16f18f3cb3b0aa1c7b0b6861a32c633168615036df5fe2b7a1e6d2454"
    assert _digest(_lines(sessions=6, hints=False)) == "6dc82d3b772d9d61827cc2932d704a828ba3e1d7e162303ac137048533931cff"
    assert _breaks(_calls(_lines(sessions=20))) [0] == 0  # without breaks every prompt extends the last


@pytest.mark.parametrize("p", [0.1, 0.3, 0.6])
def test_chain_breaks_happen_at_their_probability_and_change_only_the_blocks(p):
    # Scenario: 60 sessions (1,434 calls with a previous call by the same agent) at break
    # probability p: the fraction of calls that do not extend that previous call is p within
    # 4 standard deviations; timestamps, agents, nodes and hints are those of the unbroken trace.
    base, lines = _lines(sessions=60), _lines(sessions=60, chain_break_prob=p)
    broken, n = _breaks(_calls(lines))
    assert n == 1434
    assert abs(broken / n - p) < 4 * (p * (1 - p) / n) ** 0.5
    strip = lambda x: {k: v for k, v in x.items() if k not in ("hash_ids", "input_length")}  # noqa: E731
    assert [strip(x) for x in lines] == [strip(x) for x in base]
    _trace(lines)


def test_chain_break_inserts_context_before_the_agents_own_history():
    # Scenario: every repeat call breaks (p = 1). The system prompt, tool schemas and task stay
    # shared with the previous call; the blocks after them change, so the history that follows
    # the new context has new ids; the next call starts from new context again.
    lines = _calls(_lines(sessions=8, chain_break_prob=1.0, system_prompt_blocks=8, tool_schema_blocks=3,
                          tools_per_agent=2, task_blocks=[2, 2]))
    head = 8 + 2 * 3 + 2
    prev: dict[tuple, list] = {}
    checked = 0
    for c in lines:
        key = (c["session_id"], c["agent_id"])
        ids = c["hash_ids"]
        if key in prev and key[1] != "coordinator":  # workers: 8 sys + 2 tools x 3 + 2 task blocks
            p = prev[key]
            assert ids[:head] == p[:head]
            assert ids[head] != p[head]  # new shared context where the old context / history began
            assert not set(ids[head:]) & set(p[head:])
            checked += 1
        prev[key] = ids
    assert checked > 50


def test_apps_share_system_prompt_and_tool_blocks_across_sessions():
    # Scenario: 40 sessions over 3 apps, 2 system prompts each (coordinator; workers), 8 system
    # prompt blocks and a 16-block tool schema per app. Coordinators of one app start with the
    # same 24 blocks in every session; other apps' start differently; workers share their app's
    # tool blocks' content but under their own system prompt.
    lines = _lines(sessions=40, apps=3, app_system_prompts=2, system_prompt_blocks=8, app_tool_schema_blocks=16)
    calls = _calls(lines)
    by_first: dict[int, set[str]] = defaultdict(set)
    prefix: dict[int, set[tuple]] = defaultdict(set)
    for c in calls:
        if c["agent_id"] == "coordinator":
            by_first[c["hash_ids"][0]].add(c["session_id"])
            prefix[c["hash_ids"][0]].add(tuple(c["hash_ids"][:24]))
    assert len(by_first) == 3  # one coordinator system prompt per app
    assert all(len(v) == 1 for v in prefix.values())  # the whole 24-block head is shared
    assert sum(len(s) for s in by_first.values()) == 40 and min(len(s) for s in by_first.values()) >= 2
    worker_heads = {tuple(c["hash_ids"][:24]) for c in calls if c["agent_id"].startswith("worker")}
    assert len(worker_heads) == 3 and not worker_heads & set().union(*prefix.values())
    # the base generator's draws are untouched: the same calls at the same times
    base = _calls(_lines(sessions=40))
    assert [(c["timestamp"], c["session_id"], c["node_id"]) for c in calls] == \
        [(c["timestamp"], c["session_id"], c["node_id"]) for c in base]
    _trace(lines)


def test_more_apps_fewer_shared_heads_than_sessions():
    # Scenario: without apps every session's coordinator shares only the one system prompt
    # with other sessions (its tool schema follows); with apps, sessions share the tool block too.
    calls = _calls(_lines(sessions=30, apps=2, app_system_prompts=1, app_tool_schema_blocks=12))
    heads = defaultdict(set)
    for c in calls:
        heads[tuple(c["hash_ids"][:20])].add(c["session_id"])
    assert len(heads) == 2 and sum(len(s) for s in heads.values()) == 30  # coordinators and workers alike


@pytest.mark.parametrize("tail", ["lognormal", "pareto"])
def test_react_nodes_are_loops_of_one_to_four_calls_with_tool_waits(tail):
    # Scenario: 50 sessions of ReAct workers fanning in to a reviewer. Every worker and review
    # node runs 1-4 calls (all of them occur); every call but a node's last carries the wait that
    # follows it, and the next call of the node comes llm_call_s + that wait later; the plan
    # nodes are single calls; the reviewer depends on every worker of its round.
    lines = _lines(sessions=50, react=True, react_wait_tail=tail, tools=["search", "code_exec", "browser"],
                   tools_per_agent=2)
    wfs = _workflows(lines)
    calls = _calls(lines)
    by_node: dict[tuple, list[dict]] = defaultdict(list)
    for c in calls:
        by_node[(c["session_id"], c["node_id"])].append(c)
    counts = defaultdict(set)
    for (sid, node), cs in by_node.items():
        kind = node.split(".")[1][0]  # p(lan), w(orker), r(eview)
        counts[kind].add(len(cs))
        for a, b in zip(cs, cs[1:]):
            assert b["timestamp"] - a["timestamp"] == pytest.approx(2000 + 1000 * a["hints"]["expected_tool_duration_s"], abs=2)
        assert "hints" not in cs[-1]
    assert counts["p"] == {1} and counts["w"] == {1, 2, 3, 4} and counts["r"] == {1, 2, 3, 4}
    for sid, nodes in wfs.items():
        assert not [n for n in nodes if n.get("kind") == "tool"]
        for n in nodes:
            if n["id"].endswith(".review"):
                r = n["id"].split(".")[0]
                assert sorted(n["deps"]) == sorted(m["id"] for m in nodes if m["id"].startswith(f"{r}.w"))
                assert n["agent_id"] == "reviewer"
    # the waits' medians are the tools' 0.3 / 2 / 15 s; their tails are heavy (p99 / median)
    waits = defaultdict(list)
    for c in calls:
        if "hints" in c:
            waits[c["hints"]["tool"]].append(c["hints"]["expected_tool_duration_s"])
    for tool, median in (("search", 0.3), ("code_exec", 2.0), ("browser", 15.0)):
        w = sorted(waits[tool])
        assert len(w) > 150
        assert statistics.median(w) == pytest.approx(median, rel=0.3)
        assert w[int(0.99 * len(w))] / statistics.median(w) > 4
    _trace(lines)


def test_namespaced_agent_ids_differ_from_the_nodes_and_only_node_id_links_them():
    # Scenario: with namespaced ids only agent_id differs from the default trace; no call's
    # agent_id is any node's agent_id, and the node a call names belongs to that call's agent.
    base, lines = _lines(sessions=20), _lines(sessions=20, namespaced_agent_ids=True)
    assert [{k: v for k, v in x.items() if k != "agent_id"} for x in lines] == \
        [{k: v for k, v in x.items() if k != "agent_id"} for x in base]
    wfs = _workflows(lines)
    node_agents = {n["agent_id"] for nodes in wfs.values() for n in nodes}
    for c in _calls(lines):
        assert c["agent_id"] not in node_agents
        node = {n["id"]: n for n in wfs[c["session_id"]]}[c["node_id"]]
        assert c["agent_id"] == f"ns/{c['session_id']}/{node['agent_id']}"
    t = _trace(lines)
    assert isinstance(t.records[0], WorkflowLine)


@pytest.mark.parametrize("kw", [{"chain_break_prob": 0.3}, {"apps": 3}, {"react": True},
                                {"namespaced_agent_ids": True}])
def test_shaped_traces_are_seeded_and_replay(kw):
    a, b, c = _lines(sessions=5, **kw), _lines(sessions=5, **kw), _lines(sessions=5, seed=8, **kw)
    assert a == b and a != c
    t = _trace(a)
    assert all(isinstance(r, Call) or r.now_s >= 0 for r in t.records)
    for policy in ("lru", "kvdb", "belady"):
        r = replay(t, policy, 40)
        assert r.requests == len(_calls(a)) and 0 < r.hits < r.accesses


@pytest.mark.parametrize("kw, match", [
    ({"chain_break_prob": 1.5}, "probability"),
    ({"apps": -1}, "apps"),
    ({"react_calls": [0, 4]}, "react_calls"),
    ({"react_wait_tail": "weibull"}, "react_wait_tail"),
    ({"react_wait_medians_s": []}, "react_wait_medians_s"),
    ({"namespaced_agent_ids": 1}, "true or false"),
])
def test_bad_shape_parameters_are_refused(kw, match):
    with pytest.raises(InvalidInput, match=match):
        load_params(None, **kw)


def _heads(calls: list[dict], n_blocks: int) -> dict[str, list[tuple]]:
    """Per session, its coordinator's first ``n_blocks`` ids, call by call."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for c in calls:
        if c["agent_id"] == "coordinator":
            out[c["session_id"]].append(tuple(c["hash_ids"][:n_blocks]))
    return out


def test_tool_lists_change_once_mid_session_at_their_probability():
    # Scenario: 200 sessions, tool list change probability 0.4. The coordinator's head (8 system
    # prompt blocks, then its tool's 3 schema blocks) changes at most once per session, at a
    # round's plan after the first round, and never back; the system prompt never changes. The
    # fraction of sessions that change is 0.4 among those of 2 rounds or more.
    base, lines = _lines(sessions=200), _lines(sessions=200, tool_list_change_prob=0.4)
    calls = _calls(lines)
    heads = _heads(calls, 11)
    plans = {(c["session_id"], tuple(c["hash_ids"][:11])): c["node_id"]
             for c in reversed(calls) if c["agent_id"] == "coordinator"}
    rounds = {sid: 1 + max(int(n["id"][1:].split(".")[0]) for n in nodes) for sid, nodes in _workflows(lines).items()}
    changed = 0
    for sid, hs in heads.items():
        distinct = list(dict.fromkeys(hs))
        assert len(distinct) <= 2 and len({h[:8] for h in hs}) == 1
        if len(distinct) == 2:
            changed += 1
            assert hs == [distinct[0]] * hs.index(distinct[1]) + [distinct[1]] * (len(hs) - hs.index(distinct[1]))
            first_new = plans[(sid, distinct[1])]  # the earliest call with the new head
            assert first_new.endswith(".plan") and first_new != "r0.plan"
            assert rounds[sid] >= 2
    multi = sum(r >= 2 for r in rounds.values())
    assert abs(changed / multi - 0.4) < 4 * (0.4 * 0.6 / multi) ** 0.5
    strip = lambda x: {k: v for k, v in x.items() if k not in ("hash_ids", "input_length")}  # noqa: E731
    assert [strip(x) for x in lines] == [strip(x) for x in base]
    _trace(lines)


def test_changed_tool_lists_of_one_version_are_shared_across_sessions():
    # Scenario: one app, one tool-list variant, every session of 2+ rounds changes: each ends on
    # the same new 8 + 16-block head, which differs from the app's first head in the tool blocks.
    calls = _calls(_lines(sessions=20, apps=1, app_tool_schema_blocks=16, tool_list_change_prob=1.0,
                          tool_list_variants=1, rounds=[2, 4]))
    heads = _heads(calls, 24)
    assert len({hs[0] for hs in heads.values()}) == 1 and len({hs[-1] for hs in heads.values()}) == 1
    first, last = next(iter(heads.values()))[0], next(iter(heads.values()))[-1]
    assert first[:8] == last[:8] and first[8] != last[8]


def _declared(lines: list[dict]) -> list[float]:
    """Every declared tool duration, hints and workflow tool nodes, in trace order."""
    out = []
    for x in lines:
        if "hints" in x:
            out.append(x["hints"]["expected_tool_duration_s"])
        for n in x.get("nodes", []):
            if "expected_duration_s" in n:
                out.append(n["expected_duration_s"])
    return out


def _without_declared(lines: list[dict]) -> list[dict]:
    out = []
    for x in lines:
        x = json.loads(json.dumps(x))
        x.get("hints", {}).pop("expected_tool_duration_s", None)
        for n in x.get("nodes", []):
            n.pop("expected_duration_s", None)
        out.append(x)
    return out


def test_scaled_hints_change_only_the_declared_durations():
    # Scenario: hints scaled by 10: every declared duration (call hints and workflow tool nodes)
    # is ten times the true one (rounding to the ms aside); nothing else in the trace moves.
    base, lines = _lines(sessions=20), _lines(sessions=20, hint_scale=10.0)
    b, s = _declared(base), _declared(lines)
    assert len(b) == len(s) > 100
    assert all(abs(y - 10 * x) <= 0.006 for x, y in zip(b, s))
    assert _without_declared(lines) == _without_declared(base)
    _trace(lines)


def test_shuffled_hints_name_other_waits():
    # Scenario: shuffled hints: the declared durations are the true ones permuted across the
    # trace; a call's hint and its workflow tool node still agree with each other, but the hint
    # no longer matches the wait that follows the call.
    base, lines = _lines(sessions=20), _lines(sessions=20, hint_shuffle=True)
    assert sorted(_declared(lines)) == sorted(_declared(base)) and _declared(lines) != _declared(base)
    assert _without_declared(lines) == _without_declared(base)
    wfs = _workflows(lines)
    calls = _calls(lines)
    nxt = {(c["session_id"], c["node_id"]): c["timestamp"] for c in calls}
    wrong = hinted = 0
    for c in calls:
        if "hints" in c:
            hinted += 1
            tool = {n["id"]: n for n in wfs[c["session_id"]]}[c["node_id"][:-1] + "tool"]
            assert tool["expected_duration_s"] == c["hints"]["expected_tool_duration_s"]
            gap_s = (nxt[(c["session_id"], c["node_id"][:-1] + "b")] - c["timestamp"]) / 1000 - 2.0
            wrong += abs(gap_s - c["hints"]["expected_tool_duration_s"]) > 0.01
    assert wrong > 0.9 * hinted


def test_wrong_workflows_declare_phantom_nodes_at_their_probability():
    # Scenario: 200 sessions, wrong workflow probability 0.5: the sessions whose workflow declares
    # a phantom worker per round and a phantom round number 0.5 within 4 standard deviations; no
    # call names a phantom node; without the phantoms the workflows are the true ones.
    base, lines = _lines(sessions=200), _lines(sessions=200, wrong_workflow_prob=0.5)
    wfs, true = _workflows(lines), _workflows(base)
    called = {(c["session_id"], c["node_id"]) for c in _calls(lines)}
    wrong = 0
    for sid, nodes in wfs.items():
        ids = {n["id"] for n in nodes}
        phantom = ids - {n["id"] for n in true[sid]}
        rounds = 1 + max(int(n["id"][1:].split(".")[0]) for n in true[sid])
        if phantom:
            wrong += 1
            assert phantom == {f"r{rounds}.plan", f"r{rounds}.agg"} | {n for n in ids if n.endswith(".phantom")}
            assert len([n for n in phantom if n.endswith(".phantom")]) == rounds
            assert not {(sid, n) for n in phantom} & called
        assert [n for n in nodes if n["id"] not in phantom] == true[sid]
    assert abs(wrong / 200 - 0.5) < 4 * (0.25 / 200) ** 0.5
    assert _calls(lines) == _calls(base)
    _trace(lines)


def test_the_agentic_mix_preset_turns_on_every_shape_but_wrong_hints():
    p = load_params(None, shape="agentic-mix", sessions=30)
    assert p["chain_break_prob"] > 0 and p["apps"] > 1 and p["react"] and p["namespaced_agent_ids"]
    assert p["tool_list_change_prob"] > 0
    assert p["hint_scale"] == 1.0 and not p["hint_shuffle"] and p["wrong_workflow_prob"] == 0
    assert load_params(None, shape="agentic-mix", apps=7)["apps"] == 7  # explicit overrides win
    with pytest.raises(InvalidInput, match="unknown workload shape"):
        load_params(None, shape="nope")
    lines = list(generate(p))
    calls = _calls(lines)
    broken, n = _breaks(calls)
    assert 0.25 < broken / n < 0.5  # chain breaks, plus tool-list changes
    assert all(c["agent_id"].startswith("ns/") for c in calls)
    per_node = defaultdict(int)
    for c in calls:
        per_node[(c["session_id"], c["node_id"])] += 1
    assert max(per_node.values()) == 4
    assert len({c["hash_ids"][0] for c in calls}) <= 3 * p["apps"]  # apps' system prompts only
    t = _trace(lines)
    lru, kvdb_, belady = (replay(t, pol, 200).hits for pol in ("lru", "kvdb", "belady"))
    assert 0 < lru <= belady and 0 < kvdb_ <= belady


def test_gen_cli_writes_the_shaped_trace(tmp_path):
    from click.testing import CliRunner

    from kvdb.cli.main import cli

    runner = CliRunner()
    out = tmp_path / "t.jsonl"
    args = ["gen", "--sessions", "4", "--chain-breaks", "0.3", "--apps", "2", "--app-tool-blocks", "5", "--react",
            "--wait-tail", "pareto", "--namespaced-agents", "--tool-list-change", "0.5", "--hint-scale", "3",
            "--hint-shuffle", "--wrong-workflow", "0.5", "-o", str(out)]
    r = runner.invoke(cli, args)
    assert r.exit_code == 0, r.output
    want = _lines(sessions=4, chain_break_prob=0.3, apps=2, app_tool_schema_blocks=5, react=True,
                  react_wait_tail="pareto", namespaced_agent_ids=True, tool_list_change_prob=0.5, hint_scale=3.0,
                  hint_shuffle=True, wrong_workflow_prob=0.5)
    assert [json.loads(x) for x in out.read_text().splitlines()] == want
    r = runner.invoke(cli, ["gen", "--sessions", "4", "--shape", "agentic-mix", "--no-react", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert [json.loads(x) for x in out.read_text().splitlines()] == _lines(sessions=4, shape="agentic-mix", react=False)
    r = runner.invoke(cli, ["gen", "--prompts", "--chain-breaks", "0.3", "-o", str(out)])
    assert r.exit_code == 2 and "not --prompts" in r.output
