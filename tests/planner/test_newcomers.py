"""Newcomers (kvdb/planner/policies/newcomers.py and agentplans.py, N1): an agent of a workflow
that has not called yet is planned, for its estimated start, to read the prefix its kind read in
sessions like its own (same first block); whether newcomers do is learned."""

from __future__ import annotations

import pytest

from kvdb.planner.policies import make_policy
from kvdb.planner.policies.newcomers import MAX_ROLES, SessionPrefixes
from kvdb.planner.sessions import Planner

DAG = [{"id": "p", "agent_id": "c"}, {"id": "a", "agent_id": "w", "deps": ["p"]}]
SYS_C, SYS_W0, SYS_W1 = 0, 1, 2  # frames of the coordinator's and the worker's system prompts (frame f holds block f)


def _planner(policy: str = "planner", n: int = 64):
    r = make_policy(policy, n)
    return r, Planner([r], clock=lambda: 0.0)


def _call(r, p, sid: str, node: str, agent: str, chain: list[int], now: float) -> None:
    ctx, _ = p.call_started(sid, node_id=node, agent_id=agent, now_s=now)
    r.record_access(chain, chain, ctx)
    p.call_finished(sid, node_id=node, agent_id=agent, now_s=now)


def _session(r, p, sid: str, now: float, coord: list[int], worker: list[int] | None, end: bool = True) -> None:
    """One session of DAG: the coordinator calls at ``now``, its worker 2 s later (its start, W5)."""
    p.begin_session(sid, workflow=DAG, now_s=now)
    _call(r, p, sid, "p", "c", coord, now)
    if worker is not None:
        _call(r, p, sid, "a", "w", worker, now + 2.0)
    if end:
        p.end_session(sid, now_s=now + 3.0)


def _two_sessions(r, p) -> None:
    """s1 and s2: their first calls form the roles' prefixes (c: [SYS_C], w: [SYS_W0, SYS_W1])."""
    _session(r, p, "s1", 10.0, [SYS_C, 3, 4], [SYS_W0, SYS_W1, 5, 6])
    _session(r, p, "s2", 20.0, [SYS_C, 7, 8], [SYS_W0, SYS_W1, 9, 10])


def test_a_newcomer_is_planned_to_read_what_its_kind_read():
    r, p = _planner()
    _session(r, p, "s1", 10.0, [SYS_C, 3, 4], [SYS_W0, SYS_W1, 5, 6])
    _session(r, p, "s2", 20.0, [SYS_C, 7, 8], None, end=False)
    # one first call of w says nothing about what w's first calls share: nothing is planned yet
    assert ("s2", "w") not in r._prefixes.provisional and r.debug_plan(SYS_W0) is None
    _call(r, p, "s2", "a", "w", [SYS_W0, SYS_W1, 9, 10], 22.0)
    p.end_session("s2", now_s=23.0)
    assert [r.debug_plan(f) for f in (SYS_W0, SYS_W1)] == [None, None]  # s1 and s2 ended: nobody wants them
    assert r.newcomer_reuse() == {"first_calls": 0.0, "read_prefix": 0.0, "p_read": 0.5, "sibling_first_calls": 0.0,
                                  "sibling_read": 0.0, "p_sibling_read": 0.5, "p_extension_read": 0.5}
    _session(r, p, "s3", 30.0, [SYS_C, 11, 12], None, end=False)
    # s3's coordinator began with its role's prefix (a read: P = 2/3); w starts at 32 (W5), and
    # the plan's distance from now is stretched by 1 / P ** 2. The worker's own blocks are not in it.
    assert r.newcomer_reuse()["first_calls"] == 1.0 and r.newcomer_reuse()["read_prefix"] == 1.0
    assert [r.debug_plan(f) for f in (SYS_W0, SYS_W1)] == [pytest.approx(30.0 + 2.0 / (2 / 3) ** 2)] * 2
    assert [r.debug_plan(f) for f in (5, 9)] == [None, None]


def test_the_first_call_replaces_the_provisional_chain():
    r, p = _planner()
    _two_sessions(r, p)
    _session(r, p, "s3", 30.0, [SYS_C, 11, 12], None, end=False)
    assert ("s3", "w") in r._prefixes.provisional
    _call(r, p, "s3", "a", "w", [SYS_W0, 13, 14], 32.0)  # w reads only part of it: a miss
    est = r.newcomer_reuse()
    assert est["first_calls"] == 2.0 and est["read_prefix"] == 1.0
    assert not r._prefixes.provisional and r._agent_chain[("s3", "w")][0][0] == SYS_W0
    assert r.orphan_reuse()["orphaned"] == 0.0  # what it left out of the provisional chain is no orphan (O1)
    assert r._prefixes._ids[(SYS_C, "w")] == [SYS_W0]  # the role's prefix shrinks to what it read


def test_newcomers_that_read_their_prefix_are_planned_closer():
    r, p = _planner()
    for i in range(8):
        _session(r, p, f"s{i}", 10.0 * i, [SYS_C, 3 * i + 4, 63], [SYS_W0, SYS_W1, 3 * i + 5, 62])
    est = r.newcomer_reuse()
    assert est["first_calls"] == 12 and est["read_prefix"] == 12 and est["p_read"] == pytest.approx(13 / 14)
    _session(r, p, "s9", 100.0, [SYS_C, 50, 51], None, end=False)
    assert r.debug_plan(SYS_W0) == pytest.approx(100.0 + 2.0 / (14 / 15) ** 2)


def test_a_role_whose_first_calls_share_nothing_plans_nothing():
    r, p = _planner()
    for i in range(4):  # every worker's first call begins with a block of its own
        _session(r, p, f"s{i}", 10.0 * i, [SYS_C, 3 * i + 4, 63], [3 * i + 5, 3 * i + 6, 62])
    _session(r, p, "s9", 100.0, [SYS_C, 50, 51], None, end=False)
    assert r._prefixes.plan_of(("s9", "w"))[0] == [] and ("s9", "w") not in r._prefixes.provisional


def test_sessions_that_begin_otherwise_do_not_share_prefixes():
    r, p = _planner()
    _two_sessions(r, p)
    _session(r, p, "t1", 30.0, [30, 31, 32], None, end=False)  # another app: its first block differs
    assert r.debug_plan(SYS_W0) is None and ("t1", "w") not in r._prefixes.provisional


def test_a_newcomer_that_does_not_come_counts_as_a_miss():
    r, p = _planner()
    _two_sessions(r, p)
    _session(r, p, "s3", 30.0, [SYS_C, 11, 12], None, end=False)
    assert r.newcomer_reuse()["first_calls"] == 1.0 and r.debug_plan(SYS_W0) is not None
    # far past the plan's deadline, another call of the session re-plans w (W5 says: at once)
    _call(r, p, "s3", "p", "c", [SYS_C, 11, 12, 15], 200.0)
    est = r.newcomer_reuse()
    assert est["first_calls"] == 2.0 and est["read_prefix"] == 1.0
    assert r.debug_plan(SYS_W0) == pytest.approx(200.0 + 2.0 / 0.5 ** 2)  # P = 2/4 now


def test_a_session_that_ends_forgets_its_provisional_agents():
    r, p = _planner()
    _two_sessions(r, p)
    _session(r, p, "s3", 30.0, [SYS_C, 11, 12], None, end=False)
    assert ("s3", "w") in r._prefixes.provisional
    p.end_session("s3", now_s=31.0)
    assert not r._prefixes.provisional and ("s3", "w") not in r._agent_chain
    assert [r.debug_plan(f) for f in (SYS_W0, SYS_W1)] == [None, None]


def test_role_prefixes_are_bounded():
    sp = SessionPrefixes()
    for i in range(MAX_ROLES + 10):
        sp.observe((f"s{i}", "w"), [(3 * i, 0), (3 * i + 1, 0), (3 * i + 2, 0)], [f"b{i}", "x", "leaf"])
    assert len(sp._ids) == len(sp._links) == len(sp._formed) == MAX_ROLES
    assert ("b0", "w") not in sp._ids and (f"b{MAX_ROLES + 9}", "w") in sp._ids


def test_explain_shows_the_newcomers_estimate():
    r, p = _planner("kvdb", 256)
    _two_sessions(r, p)
    _session(r, p, "s3", 30.0, [SYS_C, 11, 12], [SYS_W0, SYS_W1, 13, 14])
    got = r.describe()["newcomers"]
    assert {k: got[k] for k in ("first_calls", "read_prefix", "p_read")} == {"first_calls": 2.0, "read_prefix": 2.0, "p_read": 0.75}
    assert set(got) >= {"sibling_first_calls", "sibling_read", "p_sibling_read", "p_extension_read"}


# -- N2: parallel siblings ---------------------------------------------------------------------
FAN = [{"id": "p", "agent_id": "c"}, {"id": "a", "agent_id": "w1", "deps": ["p"]},
       {"id": "b", "agent_id": "w2", "deps": ["p"]}, {"id": "d", "agent_id": "w3", "deps": ["p"]},
       {"id": "t", "kind": "tool", "deps": ["p"]}]


def _frames(r, agent) -> list[int]:
    return [f for f, _ in r._agent_chain[agent]]


def test_workflow_parallel_names_the_pending_llm_siblings():
    from kvdb.planner.workflow import Workflow

    wf = Workflow.from_spec("s", FAN)
    assert wf.parallel("a") == ["w2", "w3"]  # the tool node shares the deps but runs no agent
    wf.mark_done("b")
    assert wf.parallel("a") == ["w3"] and wf.parallel("p") == []


def test_siblings_are_planned_to_read_what_the_first_of_them_read():
    r, p = _planner("planner", 256)
    p.begin_session("s1", workflow=FAN, now_s=10.0)
    _call(r, p, "s1", "p", "c", [0, 3, 4], 10.0)
    _call(r, p, "s1", "a", "w1", [1, 2, 5, 6, 7], 12.0)
    # w2 and w3 are due (their deps are done): planned to read w1's chain less its last block,
    # REPLAN_TOLERANCE_S away stretched by 1 / P ** 2 (P = 1/2 before any sibling called)
    assert ("s1", "w2") in r._prefixes.provisional and _frames(r, ("s1", "w3")) == [1, 2, 5, 6]
    assert [r.debug_plan(f) for f in (1, 2, 5, 6)] == [pytest.approx(12.0 + 0.5 / 0.5 ** 2)] * 4
    assert r.debug_plan(7) is None
    _call(r, p, "s1", "b", "w2", [1, 2, 5, 8, 9], 12.0)  # read 3 of the 4
    est = r.newcomer_reuse()
    assert est["sibling_first_calls"] == 1.0 and est["sibling_read"] == pytest.approx(0.75)
    assert _frames(r, ("s1", "w3")) == [1, 2, 5]  # the group's chain shrank to what both began with
    assert r.orphan_reuse()["orphaned"] == 0.0  # what w2 left of its provisional chain is no orphan
    # w3's P: the session's own siblings (0.75 of 1), the global rate (1.75 / 3) as a prior of weight 2
    p_w3 = (0.75 + 2 * 1.75 / 3) / 3
    assert r.debug_plan(1) == pytest.approx(12.0 + 0.5 / p_w3 ** 2)


def test_a_sibling_that_does_not_call_is_a_miss_and_is_not_planned_from_its_group_again():
    r, p = _planner("planner", 256)
    p.begin_session("s1", workflow=FAN, now_s=10.0)
    _call(r, p, "s1", "p", "c", [0, 3, 4], 10.0)
    _call(r, p, "s1", "a", "w1", [1, 2, 5, 6, 7], 12.0)
    assert r.debug_plan(1) is not None
    _call(r, p, "s1", "p", "c", [0, 3, 4, 10], 100.0)  # far past the plans' deadlines: w2 and w3 never came
    est = r.newcomer_reuse()
    assert est["sibling_first_calls"] == 2.0 and est["sibling_read"] == 0.0
    assert not r._prefixes.provisional and ("s1", "w2") not in r._agent_chain  # no role prefix to fall back to
    assert r.debug_plan(1) is None
    _call(r, p, "s1", "a", "w1", [1, 2, 5, 6, 11, 12], 101.0)  # the group's next call does not plan them again
    assert not r._prefixes.provisional and r.newcomer_reuse()["sibling_first_calls"] == 2.0


def _fan_session(r, p, sid: str, now: float, w1: list[int], w2: list[int]) -> None:
    p.begin_session(sid, workflow=FAN[:3], now_s=now)
    _call(r, p, sid, "p", "c", [0, 3, 4], now)
    _call(r, p, sid, "a", "w1", w1, now + 2.0)
    _call(r, p, sid, "b", "w2", w2, now + 2.0)
    p.end_session(sid, now_s=now + 3.0)


@pytest.mark.parametrize("shared_task", [False, True])
def test_a_first_siblings_chain_past_the_role_prefix_is_planned_only_while_siblings_read_it(shared_task):
    """w2's role prefix is [1, 2]. w1's chain goes on past it: with the session's task, which w2
    reads too (``shared_task``), or with w1's own blocks only. Which it is, is learned."""
    r, p = _planner("planner", 256)
    for i in range(3):
        task = [20 + 2 * i, 21 + 2 * i] if shared_task else [40 + 2 * i, 41 + 2 * i]
        _fan_session(r, p, f"s{i}", 10.0 * i, [1, 2, 20 + 2 * i, 21 + 2 * i, 60 + i, 63],
                     [1, 2, *task, 70 + i, 63])
    p_ext = r.newcomer_reuse()["p_extension_read"]  # s2 alone was scored: s0 and s1 formed the role prefix
    assert p_ext == pytest.approx((2 / 3 + 1) / 3 if shared_task else 1 / 3)
    p.begin_session("s9", workflow=FAN[:3], now_s=100.0)
    _call(r, p, "s9", "p", "c", [0, 3, 4], 100.0)
    _call(r, p, "s9", "a", "w1", [1, 2, 30, 31, 32, 33], 102.0)
    assert _frames(r, ("s9", "w2")) == ([1, 2, 30, 31, 32] if shared_task else [1, 2])


def test_a_group_of_another_kind_is_not_planned():
    """w2's role prefix begins with block 1; a group begun by a call of another kind (block 50) is not its."""
    r, p = _planner("planner", 256)
    for i in range(2):
        _fan_session(r, p, f"s{i}", 10.0 * i, [1, 2, 20 + i, 63], [1, 2, 30 + i, 63])
    p.begin_session("s9", workflow=FAN[:3], now_s=100.0)
    _call(r, p, "s9", "p", "c", [0, 3, 4], 100.0)
    _call(r, p, "s9", "a", "w1", [50, 51, 52, 63], 102.0)
    assert _frames(r, ("s9", "w2")) == [1, 2]
