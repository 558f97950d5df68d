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
    assert r.newcomer_reuse() == {"first_calls": 0.0, "read_prefix": 0.0, "p_read": 0.5}
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
    assert r._prefixes.prefix(("s9", "w")) == [] and ("s9", "w") not in r._prefixes.provisional


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
    assert r.describe()["newcomers"] == {"first_calls": 2.0, "read_prefix": 2.0, "p_read": 0.75}
