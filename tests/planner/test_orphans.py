"""Orphans (kvdb/planner/policies/orphans.py and planned.py, O1): blocks an agent's new call
left out of its chain, that no other agent plans and no other session read, are worth their
value times the learned P(an orphan is read again); below JUNK_P they are junk and go first."""

from __future__ import annotations

import pytest

from kvdb.planner.policies import make_policy
from kvdb.planner.policies.orphans import JUNK_P
from kvdb.planner.sessions import Planner


def _planner(n: int = 512):
    r = make_policy("planner", n)
    p = Planner([r], clock=lambda: 0.0)
    return r, p


def _call(r, p, sid: str, agent: str, chain: list[int], now: float, parts: int = 1) -> None:
    """One call of ``agent`` reading ``chain`` (frame f holds block id f), reported to the
    replacer in ``parts`` record_access calls, as the engine reports a lookup and then the rest."""
    if p.find_session(sid) is None:
        p.begin_session(sid, now_s=now)
    ctx, _ = p.call_started(sid, agent_id=agent, now_s=now)
    cut = len(chain) // parts if parts > 1 else len(chain)
    for lo in range(0, len(chain), cut):
        r.record_access(chain[lo:lo + cut], chain[lo:lo + cut], ctx)
    p.call_finished(sid, agent_id=agent, now_s=now)


def test_the_first_orphans_keep_half_their_value():
    r, p = _planner()
    _call(r, p, "s", "a", [0, 1, 2, 3, 4], 1.0)
    before = [r.debug_value(f) for f in (1, 2, 3)]
    assert all(v > 0 for v in before)
    _call(r, p, "s", "a", [0, 5, 6], 2.0)  # shared context inserted after block 0: 1-4 are gone for a
    assert r.orphan_reuse() == {"orphaned": 3.0, "revived": 0.0, "p_revive": pytest.approx(1 / 5)}
    # the prior (revived + 1) / (orphaned + 2) was 1/2 when they were made; 4 was the call's partial leaf
    assert [r.debug_value(f) for f in (1, 2, 3)] == pytest.approx([v / 2 for v in before])


def test_orphans_that_are_never_read_again_become_junk_and_go_first():
    r, p = _planner()
    _call(r, p, "other", "x", [400, 401, 402], 0.5)  # an unrelated block read once: 400, 401 keep a value
    for i in range(12):  # each call keeps block 0 and replaces the rest: two orphans a call
        b = 100 + 3 * i
        _call(r, p, "s", "a", [0, b, b + 1, b + 2], 1.0 + i)
    est = r.orphan_reuse()
    assert est["orphaned"] == 22 and est["revived"] == 0 and est["p_revive"] < JUNK_P
    _call(r, p, "s", "a", [0, 200, 201, 202], 20.0)
    last = (133, 134)  # the previous call's own blocks, orphaned by this one at P < JUNK_P
    assert [r.debug_value(f) for f in last] == [0.0, 0.0]
    assert r.debug_value(400) > 0 and r.debug_value(401) > 0
    order = []
    while 400 not in order and 401 not in order:
        order.append(r.evict())
    assert set(last) <= set(order)


def test_orphans_read_again_keep_their_value():
    r, p = _planner()
    for i in range(20):  # the agent goes back and forth between two continuations of block 0
        _call(r, p, "s", "a", [0, 1, 2, 3] if i % 2 == 0 else [0, 4, 5, 6], 1.0 + i)
    est = r.orphan_reuse()
    assert est["orphaned"] == 38 and est["revived"] == 36  # all but the last call's two
    assert est["p_revive"] > 0.9
    # the last call ([0, 4, 5, 6]) orphaned 1 and 2 at that P: most of their value is left
    assert r.debug_value(1) > 0.9 * r.debug_value(4) > 0


def test_an_evicted_orphan_read_again_counts():
    r, p = _planner()
    _call(r, p, "s", "a", [0, 1, 2, 3], 1.0)
    _call(r, p, "s", "a", [0, 5, 6], 2.0)  # orphans 1 and 2
    while r.evict() is not None:
        pass
    _call(r, p, "s", "a", [0, 1, 2, 3], 3.0)  # the old continuation comes back from the cold tier
    assert r.orphan_reuse()["revived"] == 2.0


def test_blocks_another_agent_plans_or_another_session_read_are_not_orphans():
    r, p = _planner()
    _call(r, p, "s", "a", [0, 1, 2, 3, 4], 1.0)
    _call(r, p, "s", "b", [0, 1, 7], 1.5)  # b's chain holds 1 too
    _call(r, p, "t", "c", [0, 1, 2, 9], 1.6)  # another session read 2
    _call(r, p, "s", "a", [0, 8, 10], 2.0)  # a leaves 1, 2, 3 (and its leaf 4) behind
    assert r.orphan_reuse()["orphaned"] == 1.0  # only 3


def test_a_call_reported_in_parts_orphans_only_what_the_whole_call_left_out():
    r, p = _planner()
    _call(r, p, "s", "a", [0, 1, 2, 3, 4], 1.0)
    # the engine reports the lookup's hits, then the rest: the first part alone leaves 2 and 3 out
    _call(r, p, "s", "a", [0, 1, 2, 3, 4, 5, 6], 2.0, parts=3)
    assert r.orphan_reuse()["orphaned"] == 0.0
    assert not any(r._orph[f] for f in range(7))


def test_a_session_that_ends_drops_its_pending_orphans():
    r, p = _planner()
    _call(r, p, "s", "a", [0, 1, 2, 3], 1.0)
    p.begin_session("t", now_s=1.0)
    ctx, _ = p.call_started("s", agent_id="a", now_s=2.0)
    r.record_access([0, 5], [0, 5], ctx)  # no CallFinished: the session ends first
    p.end_session("s", now_s=3.0)
    assert r._orph_pending == {}
    assert r.orphan_reuse()["orphaned"] == 0.0


def test_a_session_hint_does_not_plan_its_orphans():
    r, p = _planner()
    _call(r, p, "s", "a", [0, 1, 2, 3], 1.0)
    _call(r, p, "s", "a", [0, 5, 6, 7], 2.0)  # orphans 1 and 2
    assert r._orph[1] and r._orph[2]
    p.hint("s", now_s=3.0, expected_tool_duration_s=30.0)  # the session waits on a tool: its own blocks are planned
    assert r.debug_plan(5) is not None and r.debug_plan(6) is not None
    assert r.debug_plan(1) is None and r.debug_plan(2) is None


def test_the_guard_reports_the_estimate():
    r = make_policy("kvdb", 512)
    p = Planner([r], clock=lambda: 0.0)
    _call(r, p, "s", "a", [0, 1, 2, 3], 1.0)
    _call(r, p, "s", "a", [0, 5, 6], 2.0)
    assert r.describe()["orphans"] == {"orphaned": 2.0, "revived": 0.0, "p_revive": 0.25}
