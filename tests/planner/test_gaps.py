"""The next-call estimator (kvdb.planner.policies.gaps) and its use by the kvdb policy for
sessions without a declared workflow."""

from __future__ import annotations

import math

import pytest

from kvdb.planner.policies import make_policy
from kvdb.planner.policies.gaps import MIN_OBS, GapEstimator, gap_bin
from kvdb.planner.sessions import Planner


def test_median_by_context_with_fallback():
    g = GapEstimator()
    specific, general = ("free", "w", 3), ("free",)
    for _ in range(MIN_OBS - 1):
        g.observe((specific, general), 10.0)
    assert g.predict((specific, general)) is None  # too few observations anywhere
    g.observe((specific, general), 10.0)
    assert g.predict((specific, general)) == pytest.approx(10.0)  # the median bin's own mean
    assert g.predict((("free", "w", 4), general)) == pytest.approx(10.0)  # falls back
    for _ in range(MIN_OBS + 1):
        g.observe((("free", "c", 1), general), 100.0)
    # the general context now holds 4 x 10 s and 5 x 100 s: its median is 100 s
    assert g.predict((("free", "x", 0), general)) == pytest.approx(100.0)
    assert g.predict((specific, general)) == pytest.approx(10.0)


def test_p_next_counts_sessions_that_ended_first():
    g = GapEstimator()
    ctx = (("fan-in", "w", 1),)
    assert g.p_next(ctx) == 1.0  # nothing known
    for _ in range(MIN_OBS):
        g.observe(ctx, 5.0)
    assert g.p_next(ctx) == pytest.approx(5 / 6)  # one pseudo-observation of each outcome
    for _ in range(MIN_OBS):
        g.missed(ctx)
    assert g.p_next(ctx) == pytest.approx(5 / 10)


def test_gap_bins_are_two_octaves_wide():
    assert [gap_bin(x) for x in (None, 0.5, 1.0, 3.9, 4.0, 15.9, 16.0)] == [-1, 0, 1, 1, 2, 2, 3]


def test_kvdb_learns_an_agents_rhythm_without_a_workflow():
    # Scenario: no workflow, no hints; agent w of session s calls every 10 s with chain
    # [x0, x1, leaf]. Its first MIN_OBS calls teach the estimator (unplanned until then);
    # from then on its chain is planned for now + 10 s stretched by 1 / P(call again) ** 2,
    # P = (4 + 1) / (4 + 0 + 2). The leaf is never planned.
    r = make_policy("kvdb", 16)
    p = Planner([r], clock=lambda: 0.0)
    for i in range(MIN_OBS + 1):
        ctx, _ = p.call_started("s", agent_id="w", now_s=10.0 * i)
        r.record_access([0, 1, 2 + i], ["x0", "x1", f"leaf{i}"], ctx)
        p.call_finished("s", agent_id="w", now_s=10.0 * i)
        if i < MIN_OBS:
            assert r.debug_plan(0) is None, i
    t = 10.0 * MIN_OBS + 10.0 / (5 / 6) ** 2
    assert [r.debug_plan(f) for f in (0, 1, 2 + MIN_OBS)] == [pytest.approx(t), pytest.approx(t), None]
    # the session ends: its blocks are released (H = -inf: first to go)
    p.end_session("s", now_s=100.0)
    assert (r.debug_plan(0), r.debug_value(0), r.debug_value(1)) == (None, -math.inf, -math.inf)


def test_fan_in_waiter_keeps_its_own_estimate_once_it_proved_closer():
    # Scenario: coordinator c calls, then worker w (hint 30 s after its 2 s call: back at 34 s).
    # w's call at 34 s finds nobody waiting ("free": it joins the session's next wait). At 36 s
    # v's hint starts a new wait, which re-plans w for its end (fan-in, 36 + 2 + 50 + 2 s); but
    # w calls at once, so its own estimate came closer. The same pattern again (w free at 90 s,
    # v's hint at 92 s): w keeps its own estimate (none learned yet: unplanned).
    r = make_policy("kvdb", 64)
    p = Planner([r], clock=lambda: 0.0)

    def call(agent, t, frames, ids, hints=None):
        ctx, _ = p.call_started("s", agent_id=agent, hints=hints or {}, now_s=t)
        r.record_access(frames, ids, ctx)
        p.call_finished("s", agent_id=agent, hints=ctx.hints, now_s=t)

    call("c", 0.0, [0, 1], ["c0", "cl0"])
    call("w", 2.0, [2, 3], ["w0", "wl0"], {"expected_tool_duration_s": 30.0})
    assert (r.debug_plan(2), r.debug_plan(0)) == (34.0, 36.0)  # w's return, c waits for it
    call("w", 34.0, [2, 4, 5], ["w0", "w1", "wl1"])
    call("v", 36.0, [6, 7], ["v0", "vl0"], {"expected_tool_duration_s": 50.0})
    assert r.debug_plan(4) == 90.0  # w taken to wait for v (fan-in)
    call("w", 36.0, [2, 4, 8, 9], ["w0", "w1", "w2", "wl2"])
    call("w", 90.0, [2, 4, 8, 10, 11], ["w0", "w1", "w2", "w3", "wl3"])
    call("v", 92.0, [6, 12, 13], ["v0", "v1", "vl1"], {"expected_tool_duration_s": 50.0})
    assert r.debug_plan(10) is None  # not re-planned for v's wait (146 s)
