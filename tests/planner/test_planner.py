"""Workflows (W1-W3), hints (outcomes), the Planner API, policies (R1-R4) and EXPLAIN."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from helpers import ONLINE
from hypothesis import given
from hypothesis import strategies as st

from kvdb.buffer_pool.replacer import AccessContext
from kvdb.cli.main import cli
from kvdb.errors import InvalidInput, NotFound
from kvdb.planner.explain import explain
from kvdb.planner.hints import check_hint
from kvdb.planner.policies import make_policy
from kvdb.planner.sessions import Planner
from kvdb.planner.workflow import Workflow

DAG = [{"id": "p", "agent_id": "c"}, {"id": "a", "agent_id": "w", "deps": ["p"]},
       {"id": "t", "kind": "tool", "agent_id": "w", "deps": ["a"], "expected_duration_s": 30},
       {"id": "b", "agent_id": "w", "deps": ["t"]}, {"id": "g", "agent_id": "c", "deps": ["b"]}]


def test_steps_to_execution_w3():
    wf = Workflow.from_spec("s", DAG)
    assert wf.steps() == {"p": 0, "a": 1, "t": 2, "b": 3, "g": 4}
    assert wf.agent_steps() == {"c": 0, "w": 1}
    for n in ("p", "a", "t", "b", "g"):
        wf.mark_done(n)
    assert wf.agent_steps() == {"c": math.inf, "w": math.inf}


@pytest.mark.parametrize("nodes, needle", [
    ([{"id": "a"}, {"id": "a"}], "node 'a' is declared twice"),
    ([{"id": "a", "deps": ["x"]}], "node 'a' depends on 'x'"),
    ([{"id": "a", "deps": ["a"]}], "cycle through node 'a'"),
    ([{"id": "a", "kind": "sleep"}], "node 'a': kind 'sleep'"),
    ([{"id": "a", "kind": "tool", "expected_duration_s": -1}], "node 'a': expected_duration_s"),
    ("nope", "'nodes' must be a list"),
])
def test_bad_workflows_name_the_node(nodes, needle):
    with pytest.raises(InvalidInput, match=needle):
        Workflow.from_spec("s", nodes)


@pytest.mark.parametrize("name, value, status, used", [
    ("expected_tool_duration_s", 12.5, "accepted", 12.5),
    ("expected_tool_duration_s", -1, "rejected", None),
    ("expected_tool_duration_s", float("nan"), "rejected", None),
    ("expected_tool_duration_s", 1e9, "clipped", 86400.0),
    ("ttl_s", "10", "rejected", None),
    ("priority", 12, "clipped", 9),
    ("priority", -3, "clipped", 0),
    ("priority", 2.4, "clipped", 2),
    ("priority", float("inf"), "rejected", None),
    ("prefix_hash", "abc", "accepted", "abc"),
    ("colour", 1, "rejected", None),
])
def test_hint_outcomes(name, value, status, used):
    o = check_hint(name, value)
    assert (o.status, o.value) == (status, used)
    assert bool(o.reason) == (status != "accepted")


def test_planner_api_sessions_and_hints():
    seen = []

    class Spy(make_policy("lru", 4).__class__):
        def on_event(self, event):
            seen.append(type(event).__name__)

    p = Planner([Spy(4)], clock=lambda: 5.0)
    s = p.begin_session("s1", tenant="acme", workflow={"nodes": DAG})
    assert s.workflow.steps()["p"] == 0
    with pytest.raises(InvalidInput, match="already open"):
        p.begin_session("s1")
    ctx, outcomes = p.call_started("s1", node_id="p", hints={"priority": 3})
    assert (ctx.session_id, ctx.tenant, ctx.now_s, ctx.hints) == ("s1", "acme", 5.0, {"priority": 3})
    assert [o.status for o in outcomes] == ["accepted"]
    p.call_finished("s1", node_id="p")
    assert p.workflow_of("s1").steps()["a"] == 0
    out = p.hint("s1", expected_tool_duration_s=-2, ttl_s=60)
    assert [(o.name, o.status) for o in out] == [("expected_tool_duration_s", "rejected"), ("ttl_s", "accepted")]
    with pytest.raises(InvalidInput, match="node 'zz' is not in its declared workflow"):
        p.call_started("s1", node_id="zz")
    p.end_session("s1")
    with pytest.raises(NotFound):
        p.hint("s1", ttl_s=1)
    assert seen == ["SessionBegan", "CallStarted", "CallFinished", "HintGiven", "SessionEnded"]
    assert p.outcome_counts == {"accepted": 2, "clipped": 0, "rejected": 1}


@pytest.mark.parametrize("policy", ONLINE)
def test_policy_scenario_r3_deeper_first(policy):
    # Scenario: 4 frames, one call of 3 blocks; the first victim is its deepest block (R3)
    r = make_policy(policy, 4)
    r.record_access([0, 1, 2], ["a", "b", "c"], AccessContext(now_s=1.0))
    assert r.num_evictable() == 3
    r.set_evictable(2, False)
    assert r.num_evictable() == 2
    assert r.evict() == 1  # 2 is pinned (R1)
    r.set_evictable(2, True)  # where an unpinned frame re-enters is the policy's choice
    r.remove(0)
    assert r.evict() == 2
    assert r.evict() is None and r.num_evictable() == 0  # R2, R4


@pytest.mark.parametrize("policy", ONLINE)
@given(ops=st.lists(st.tuples(st.sampled_from(["acc", "pin", "unpin", "evict", "remove"]),
                              st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True)), max_size=40))
def test_policy_invariants_r1_r2_r4(policy, ops):
    r = make_policy(policy, 8)
    known: set[int] = set()
    pinned: set[int] = set()
    t = 0.0
    for op, frames in ops:
        f = frames[0]
        if op == "acc":
            t += 1.0
            r.record_access(frames, [f"id{x}" for x in frames], AccessContext(now_s=t, session_id=f"s{f % 2}",
                                                                               hints={"expected_tool_duration_s": 3.0}))
            known.update(frames)
        elif op in ("pin", "unpin") and f not in known:
            continue  # pinning a frame never accessed is left to each policy's convention
        elif op == "pin":
            r.set_evictable(f, False)
            pinned.add(f)
        elif op == "unpin":
            r.set_evictable(f, True)
            pinned.discard(f)
        elif op == "evict":
            v = r.evict()
            if v is None:
                assert not (known - pinned)
            else:
                assert v in known and v not in pinned  # R1
                known.discard(v)  # R2
        else:
            r.remove(f)
            known.discard(f)
            pinned.discard(f)
        assert r.num_evictable() == len(known - pinned)  # R4


def test_kvdb_policy_plans_by_hint():
    # Scenario: session a returns in 100 s, session b in 1 s; the furthest return goes first once
    # the unplanned pool is empty (Belady on the estimate), deeper first within a session.
    r = make_policy("kvdb", 8)
    r.record_access([0, 1, 2], [1, 2, 3], AccessContext(now_s=0.0, session_id="a", hints={"expected_tool_duration_s": 100.0}))
    r.record_access([3, 4, 5], [4, 5, 6], AccessContext(now_s=0.0, session_id="b", hints={"expected_tool_duration_s": 1.0}))
    # leaves (2, 5) are unplanned with H = L = 0 (junk): first out, equal keys by lower frame;
    # then planned blocks, furthest return first (a before b), deepest first within a session.
    assert [r.evict() for _ in range(6)] == [2, 5, 1, 0, 4, 3]
    assert r.predicted_return("a") == 100.0


def test_explain_tree_and_cli(tmp_path):
    spec = {"session_id": "x", "nodes": DAG}
    plan = explain(spec)
    root = plan["plan"][0]
    assert root["id"] == "p" and root["reuse"] == [{"blocks": 8, "from": "device", "what": "shared prefix"}]
    b = root["children"][0]["children"][0]["children"][0]
    assert b["id"] == "b" and b["start_s"] == 34.0
    assert b["reuse"][1] == {"blocks": 2, "from": "host", "what": "agent history"}
    assert b["prefetch_deadline_s"] == pytest.approx(34.0 - 2 * 512 * 131072 / 2.5e10, abs=1e-3)
    f = tmp_path / "wf.json"
    f.write_text(json.dumps(spec))
    res = CliRunner().invoke(cli, ["explain", str(f), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["makespan_s"] == plan["makespan_s"]
    f.write_text(json.dumps({"nodes": [{"id": "a", "deps": ["a"]}]}))
    res = CliRunner().invoke(cli, ["explain", str(f)])
    assert res.exit_code == 1 and "cycle through node 'a'" in res.output


def test_cli_sim_gen_json(tmp_path):
    trace = tmp_path / "t.jsonl"
    runner = CliRunner()
    res = runner.invoke(cli, ["gen", "--sessions", "4", "-o", str(trace)])
    assert res.exit_code == 0, res.output
    first = trace.read_text()
    runner.invoke(cli, ["gen", "--sessions", "4", "-o", str(trace)])
    assert trace.read_text() == first  # seeded
    per = tmp_path / "per.jsonl"
    res = runner.invoke(cli, ["sim", str(trace), "--policy", "kvdb", "--capacity", "20", "--json", "--per-request-out", str(per)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)
    for k in ("policy", "capacity_blocks", "requests", "accesses", "hits", "block_hit_ratio", "token_hit_ratio",
              "policy_us_per_access"):
        assert k in row
    lines = [json.loads(x) for x in per.read_text().splitlines()]
    assert len(lines) == row["requests"] and sum(x["hits"] for x in lines) == row["hits"]
    res = runner.invoke(cli, ["sim", str(trace), "--policy", "kvdb", "--policy", "tokencake", "--capacity-fraction",
                              "0.05", "--timed", "--json"])
    assert res.exit_code == 0 and [r["policy"] for r in json.loads(res.output)] == ["kvdb", "tokencake"]
    png = tmp_path / "hits.png"
    res = runner.invoke(cli, ["sim", str(trace), "--policy", "lru", "--policy", "belady", "--capacity", "10",
                              "--capacity", "40", "--plot", str(png)])
    assert res.exit_code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(res.output.splitlines()) == 5  # header + 2 policies x 2 capacities
    res = runner.invoke(cli, ["sim", str(trace), "--policy", "nope", "--capacity", "3"])
    assert res.exit_code == 2
    res = runner.invoke(cli, ["sim", str(trace), "--policy", "lru"])
    assert res.exit_code == 2 and "--capacity" in res.output



def test_mark_done_w4_and_next_start_w5():
    wf = Workflow.from_spec("s", DAG)
    wf.mark_done("p", 10.0)
    # p ends at 12 (llm 2 s): a starts at 12, ends 14; tool t 14-44; b 44-46; g at 46
    assert wf.agent_next_start(10.0, 2.0, 5.0) == {"c": 46.0, "w": 12.0}
    wf.mark_done("b", 50.0)  # W4: a and the tool t are done too
    assert wf.done == {"p", "a", "t", "b"}
    assert wf.agent_next_start(50.0, 2.0, 5.0) == {"c": 52.0, "w": math.inf}
    # a tool without an expected duration takes the default; an overdue one is still running
    wf2 = Workflow.from_spec("s", [{"id": "a", "agent_id": "w"}, {"id": "t", "kind": "tool", "deps": ["a"]},
                                   {"id": "b", "agent_id": "w", "deps": ["t"]}])
    wf2.mark_done("a", 0.0)
    assert wf2.agent_next_start(1.0, 2.0, 5.0) == {"w": 7.0}
    assert wf2.agent_next_start(20.0, 2.0, 5.0) == {"w": 20.0}


def test_sessions_start_from_a_fresh_workflow():
    wf = Workflow.from_spec("s", DAG)
    p = Planner(clock=lambda: 0.0)
    p.begin_session("s", workflow=wf)
    p.call_started("s", node_id="p")
    p.call_finished("s", node_id="p")
    assert p.workflow_of("s").done == {"p"} and wf.done == set()  # the declaration stays clean


def test_kvdb_plans_an_agent_for_its_next_node():
    # Scenario: 16 frames; agent w's chain (3 blocks) is planned for its next node (start 12 s);
    # c's chain for g (46 s). Under pressure c's blocks (further) go before w's, deepest first.
    r = make_policy("kvdb", 16)
    p = Planner([r], clock=lambda: 0.0)
    p.begin_session("s", workflow=DAG)
    ctx, _ = p.call_started("s", node_id="p", now_s=10.0)
    r.record_access([0, 1, 2, 3], ["c0", "c1", "c2", "cleaf"], ctx)
    p.call_finished("s", node_id="p", now_s=10.0)
    ctx, _ = p.call_started("s", node_id="a", now_s=12.0)
    r.record_access([4, 5, 6, 7], ["w0", "w1", "w2", "wleaf"], ctx)
    p.call_finished("s", node_id="a", now_s=12.0)
    assert r.predicted_return("s") is None  # no hint: only the workflow plans
    # estimates at 12 s: w's b at 44 (a ends 14, tool 30 s), c's g at 46
    assert [r.evict() for _ in range(8)] == [3, 7, 2, 1, 0, 6, 5, 4]  # leaves (junk), then c, then w


def test_kvdb_shared_block_is_planned_for_its_earliest_agent():
    # Scenario: agents c and w share the prefix blocks 0-1 (same system prompt). After p,
    # w's next node (a) starts at 12 s and c's (g) at 46 s: the shared blocks follow w (12),
    # c's private block follows c (46). When w has run a, its next start is b at 44 s, so the
    # shared blocks move to min(44, 46) = 44.
    r = make_policy("kvdb", 16)
    p = Planner([r], clock=lambda: 0.0)
    p.begin_session("s", workflow=DAG)
    ctx, _ = p.call_started("s", node_id="p", now_s=10.0)
    r.record_access([0, 1, 2, 3], ["sys0", "sys1", "c0", "cleaf"], ctx)
    p.call_finished("s", node_id="p", now_s=10.0)
    assert [r.debug_plan(f) for f in range(4)] == [46.0, 46.0, 46.0, None]  # only c so far
    ctx, _ = p.call_started("s", node_id="a", now_s=12.0)
    r.record_access([0, 1, 4, 5], ["sys0", "sys1", "w0", "wleaf"], ctx)
    p.call_finished("s", node_id="a", now_s=12.0)
    assert [r.debug_plan(f) for f in range(6)] == [44.0, 44.0, 46.0, None, 44.0, None]
    ctx, _ = p.call_started("s", node_id="b", now_s=44.0)
    r.record_access([0, 1, 4, 6, 7], ["sys0", "sys1", "w0", "w1", "wleaf2"], ctx)
    p.call_finished("s", node_id="b", now_s=44.0)
    # w has nothing left: its private blocks are released; the shared ones follow c's g (46)
    assert [r.debug_plan(f) for f in (0, 1, 2, 4, 6)] == [46.0, 46.0, 46.0, None, None]
    assert [r.evict() for _ in range(5)] == [6, 4, 7, 3, 5]  # released (-inf) first, then last blocks


def test_lfu_scenario():
    # Scenario: 8 frames; frame 0 touched twice, 1-2 once; victims: fewest accesses, then oldest, deeper first
    r = make_policy("lfu", 8)
    r.record_access([0, 1], ["a", "b"])
    r.record_access([0, 2], ["a", "c"])
    assert [r.evict() for _ in range(3)] == [1, 2, 0]


def test_kvflow_scenario_steps_to_execution():
    # Scenario: session s2 (no workflow) touches 2-3 first; then in session s agent c runs p
    # (frames 0-1). c's next node g is 3 steps away (a, t, b pending), s2's group has 0 steps:
    # c's more recent frames go first (steps beat recency), then plain LRU, deeper first.
    r = make_policy("kvflow", 16)
    p = Planner([r], clock=lambda: 0.0)
    ctx, _ = p.call_started("s2")
    r.record_access([2, 3], ["x0", "x1"], ctx)
    p.call_finished("s2")
    p.begin_session("s", workflow=DAG)
    ctx, _ = p.call_started("s", node_id="p")
    r.record_access([0, 1], ["c0", "c1"], ctx)
    p.call_finished("s", node_id="p")
    assert [r.evict() for _ in range(4)] == [1, 0, 3, 2]


def test_tokencake_scenario_offloads_waiting_sessions():
    # Scenario: a waits 100 s on a tool, b 10 s; c has no wait. Victims: a's private blocks
    # (furthest return, deepest first), then b's, then LRU; a shared block is never offloaded.
    r = make_policy("tokencake", 16)
    r.record_access([0, 1], ["sys", "a1"], AccessContext(now_s=0.0, session_id="a", hints={"expected_tool_duration_s": 100.0}))
    r.record_access([0, 2], ["sys", "b1"], AccessContext(now_s=0.0, session_id="b", hints={"expected_tool_duration_s": 10.0}))
    r.record_access([3], ["c1"], AccessContext(now_s=0.0, session_id="c"))
    assert [r.evict() for _ in range(4)] == [1, 2, 0, 3]
    assert r.predicted_return("a") == 100.0


def test_kvdb_infers_fan_in_without_a_workflow():
    # Scenario: no workflow. Coordinator c calls (no hint), then workers w1, w2 call with tool
    # waits of 30 s and 50 s after their 2 s LLM calls: each worker is planned for its tool's
    # return (32 s, 52 s); c is taken to wait for them: the last return + one LLM call (54 s).
    r = make_policy("kvdb", 16)
    p = Planner([r], clock=lambda: 0.0)
    ctx, _ = p.call_started("s", agent_id="c", now_s=0.0)
    r.record_access([0, 1, 2], ["c0", "c1", "cleaf"], ctx)
    assert r.debug_plan(0) is None  # nothing known yet
    ctx, _ = p.call_started("s", agent_id="w1", hints={"expected_tool_duration_s": 30.0}, now_s=0.0)
    r.record_access([3, 4], ["a0", "aleaf"], ctx)
    ctx, _ = p.call_started("s", agent_id="w2", hints={"expected_tool_duration_s": 50.0}, now_s=0.0)
    r.record_access([5, 6], ["b0", "bleaf"], ctx)
    assert [r.debug_plan(f) for f in range(7)] == [54.0, 54.0, None, 32.0, None, 52.0, None]
