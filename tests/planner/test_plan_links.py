"""How the planner links calls to the declared workflow, and when it stops trusting it
(issue 13: namespaced agent ids, ReAct loops inside a node, workflows that mislead)."""

from __future__ import annotations

import pytest

from kvdb.planner.policies import make_policy
from kvdb.planner.policies.nextuse import LLM_CALL_S
from kvdb.planner.sessions import Planner

DAG = [{"id": "p", "agent_id": "c"}, {"id": "a", "agent_id": "w", "deps": ["p"]},
       {"id": "t", "kind": "tool", "agent_id": "w", "deps": ["a"], "expected_duration_s": 30},
       {"id": "b", "agent_id": "w", "deps": ["t"]}, {"id": "g", "agent_id": "c", "deps": ["b"]}]


def _run(agent_ids: dict[str, str | None], hints_a: dict | None = None, **opts):
    """The two first calls of DAG (p by c, then a by w); the planner and its frames' plans."""
    r = make_policy("planner", 16, **opts)
    p = Planner([r], clock=lambda: 0.0)
    p.begin_session("s", workflow=DAG)
    ctx, _ = p.call_started("s", node_id="p", agent_id=agent_ids["p"], now_s=10.0)
    r.record_access([0, 1, 2, 3], ["sys0", "sys1", "c0", "cleaf"], ctx)
    p.call_finished("s", node_id="p", agent_id=agent_ids["p"], now_s=10.0)
    ctx, _ = p.call_started("s", node_id="a", agent_id=agent_ids["a"], hints=hints_a, now_s=12.0)
    r.record_access([0, 1, 4, 5], ["sys0", "sys1", "w0", "wleaf"], ctx)
    p.call_finished("s", node_id="a", agent_id=agent_ids["a"], hints=ctx.hints, now_s=12.0)
    return r, [r.debug_plan(f) for f in range(6)]


def test_a_namespaced_call_joins_its_nodes_agent():
    """Calls may name their agent in another namespace than the workflow's nodes; the node id
    links them, so the plans are those of the plain names (they were none at all)."""
    _, plain = _run({"p": None, "a": None})
    _, named = _run({"p": "c", "a": "w"})
    _, spaced = _run({"p": "app/s/c", "a": "app/s/w"})
    assert plain == named == spaced == [44.0, 44.0, 46.0, None, 44.0, None]


def test_a_tool_wait_inside_a_node_plans_the_agent_for_its_return():
    """A call that waits on a tool says its agent goes on after it (a ReAct loop inside node
    a): its chain is planned for the tool's return, not for its next node's start (44 s)."""
    _, plans = _run({"p": None, "a": None}, hints_a={"expected_tool_duration_s": 3.0})
    back = 12.0 + LLM_CALL_S + 3.0
    assert plans[4] == pytest.approx(back)  # w's private block
    assert plans[0] == plans[1] == pytest.approx(back)  # the shared prefix follows the earliest agent
    assert plans[2] == 46.0  # c's block still follows c's next node


def test_turning_workflows_off_drops_their_plans_and_links():
    r, plans = _run({"p": "app/s/c", "a": "app/s/w"})
    assert plans[4] == 44.0
    r.set_workflows(False)
    assert [r.debug_plan(f) for f in range(6)] == [None] * 6
    # a planner built without workflows never planned from them (it learns gaps instead)
    _, off = _run({"p": "app/s/c", "a": "app/s/w"}, workflows=False)
    assert 44.0 not in off and 46.0 not in off


def test_a_tool_wait_in_an_agents_last_node_survives_other_agents_finishing():
    """w's last node loops (ReAct): its call waits on a tool, so w calls again when the tool
    returns. Another agent's call finishing re-plans the session from the workflow, which has
    nothing left for w; that must not release w's chain while its own hint says it returns."""
    dag = [{"id": "p", "agent_id": "c"}, {"id": "a", "agent_id": "w", "deps": ["p"]},
           {"id": "x", "agent_id": "v", "deps": ["p"]}, {"id": "g", "agent_id": "c", "deps": ["a", "x"]}]
    r = make_policy("planner", 16)
    p = Planner([r], clock=lambda: 0.0)
    p.begin_session("s", workflow=dag)
    ctx, _ = p.call_started("s", node_id="p", agent_id="c", now_s=10.0)
    r.record_access([0, 1, 2, 3], ["sys0", "sys1", "c0", "cleaf"], ctx)
    p.call_finished("s", node_id="p", agent_id="c", now_s=10.0)
    ctx, _ = p.call_started("s", node_id="a", agent_id="w", hints={"expected_tool_duration_s": 3.0}, now_s=12.0)
    r.record_access([0, 1, 4, 5], ["sys0", "sys1", "w0", "wleaf"], ctx)
    p.call_finished("s", node_id="a", agent_id="w", hints=ctx.hints, now_s=12.0)
    back = 12.0 + LLM_CALL_S + 3.0
    assert r._agent_plan[("s", "w")] == pytest.approx(back)  # frame 4 is v's too until v calls (N2: w's sibling)
    ctx, _ = p.call_started("s", node_id="x", agent_id="v", now_s=13.0)
    r.record_access([0, 1, 6, 7], ["sys0", "sys1", "v0", "vleaf"], ctx)
    p.call_finished("s", node_id="x", agent_id="v", now_s=13.0)
    assert r.debug_plan(4) == pytest.approx(back)  # w still waits on its tool
    assert r.debug_value(4) > float("-inf")
    # w's next call carries no tool hint: its loop (and its last node) is over, its chain released
    ctx, _ = p.call_started("s", node_id="a", agent_id="w", now_s=back)
    r.record_access([0, 1, 4, 8, 9], ["sys0", "sys1", "w0", "w1", "wleaf2"], ctx)
    p.call_finished("s", node_id="a", agent_id="w", now_s=back)
    ctx, _ = p.call_started("s", node_id="x", agent_id="v", now_s=back + 1)
    r.record_access([0, 1, 6, 7], ["sys0", "sys1", "v0", "vleaf"], ctx)
    p.call_finished("s", node_id="x", agent_id="v", now_s=back + 1)
    assert r.debug_plan(8) is None
