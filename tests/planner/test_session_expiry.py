"""Idle expiry of sessions (kvdb/db/plans/expiry.py S1-S3): a session nobody ends is ended by the
Db's mover once idle, exactly as end_session ends it. Time is an injected clock."""

from __future__ import annotations

import math
import tempfile
from functools import partial

import helpers
import pytest
from helpers import Clock, agent_call, blocks_for, tiers
from hypothesis import given
from hypothesis import strategies as st

from kvdb.errors import InvalidInput, NotFound

IDLE_S = 100.0


#: the Db of these tests: 6 device pages (a CPU arena) over 8 host pages, no disk tier
open_db = partial(helpers.open_db, device_pages=6, device="cpu", session_idle_s=IDLE_S)


def is_open(db, sid) -> bool:
    try:
        db.explain(session_id=sid)
    except NotFound:
        return False
    return True


def test_idle_session_expires_and_releases_its_prefix_pins_and_plans(tmp_path):
    # Scenario (S1, S2, X1): s1 names a stored 3-block chain as its shared prefix (pinned on
    # the device) and its agent waits 10 s on a tool (a prefetch timer). Nobody ends s1. Just
    # before an idle period has passed, everything holds; at it, the mover ends s1: the pins,
    # the prefix, the wait and its timer are gone, and device pressure now evicts the prefix.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        keys = db.block_keys(list(range(20)), tenant="acme")
        db.begin_session("s0", tenant="acme")
        agent_call(db, "s0", "a", keys, blocks_for(5, 5))
        db.end_session("s0")
        db.begin_session("s1", tenant="acme", hints={"prefix_hash": keys[2].hex()})
        mine = db.block_keys(list(range(300, 308)), tenant="acme")
        agent_call(db, "s1", "a", mine, blocks_for(2, 6), wait_s=10.0)
        t0 = clock.t  # the last activity; the wait returns at t0 + 10
        db.run_plans()
        p = db.stats()["plans"]
        assert (p["prefix_pinned_pages"], p["prefixes"], p["waiting_agents"], p["expired_sessions"]) == (3, 1, 1, 0)

        for dt in (IDLE_S, IDLE_S + 10.0 - 0.01):  # idle, but the wait's return + IDLE_S is ahead
            clock.t = t0 + dt
            db.run_plans()
            assert is_open(db, "s1") and db.stats()["sessions"] == 1
        clock.t = t0 + IDLE_S + 10.0
        db.run_plans()
        st_ = db.stats()
        p = st_["plans"]
        assert st_["sessions"] == 0 and p["expired_sessions"] == 1
        assert (p["prefix_pinned_pages"], p["prefixes"], p["waiting_agents"], p["timers"]) == (0, 0, 0, 0)
        assert st_["tiers"]["device"]["pinned_pages"] == 0
        with pytest.raises(NotFound, match="expired"):
            db.explain(session_id="s1")
        with pytest.raises(NotFound, match="expired"):
            db.hint("s1", ttl_s=5)
        with pytest.raises(NotFound, match="expired"):
            db.end_session("s1")

        assert tiers(db, keys[:3]) == ["device"] * 3
        other = db.block_keys(list(range(500, 524)), tenant="acme")
        db.put_blocks(other, blocks_for(6, 7))  # fills the device: unpinned, the prefix goes down
        assert "device" not in tiers(db, keys[:3])


def test_activity_keeps_a_session_alive_puts_and_lookups_included(tmp_path):
    # Scenario (S1): every kind of activity restarts the idle period: a hint, a call's end,
    # and a put or a lookup with the call's context (without any other call).
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        keys = db.block_keys(list(range(16)), tenant="t")
        db.begin_session("s", tenant="t")
        ctx, _ = db.call_started("s", agent_id="a")
        clock.t += 90.0
        db.put_blocks(keys[:2], blocks_for(2, 1), positions=[0, 1], ctx=ctx)
        clock.t += 90.0  # 180 s since the call started, 90 s since the put
        db.run_plans()
        assert is_open(db, "s")
        assert db.match_prefix(keys, ctx=ctx) == 2
        clock.t += 90.0
        db.run_plans()
        assert is_open(db, "s")
        db.call_finished("s", agent_id="a")
        clock.t += 90.0
        db.run_plans()
        db.hint("s", priority=1)
        clock.t += 99.0
        db.run_plans()
        assert is_open(db, "s") and db.stats()["plans"]["expired_sessions"] == 0
        clock.t += 1.0
        db.run_plans()
        assert not is_open(db, "s") and db.stats()["plans"]["expired_sessions"] == 1
        # an expired id is an ended one: call_started opens it afresh
        ctx, _ = db.call_started("s", agent_id="a", tenant="t")
        assert is_open(db, "s") and db.explain(session_id="s")["agents"][0]["chain_blocks"] == 0
        assert db.match_prefix(keys, ctx=ctx) == 2  # the blocks are the cache's, not the session's


def test_tool_wait_longer_than_idle_keeps_the_session_until_return_plus_slack(tmp_path):
    # Scenario (S1): the agent waits 500 s on a tool; idle is 100 s. The session lives until
    # the predicted return + one idle period, not one idle period after the call.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        keys = db.block_keys(list(range(8)), tenant="t")
        db.begin_session("s", tenant="t")
        agent_call(db, "s", "a", keys, blocks_for(2, 3), wait_s=500.0)
        t0 = clock.t
        for dt in (IDLE_S, 500.0, 500.0 + IDLE_S - 0.01):
            clock.t = t0 + dt
            db.run_plans()
            assert is_open(db, "s"), dt
        assert db.explain(session_id="s")["agents"][0]["state"] == "waiting"
        clock.t = t0 + 500.0 + IDLE_S
        db.run_plans()
        assert not is_open(db, "s") and db.stats()["plans"]["expired_sessions"] == 1


def test_a_wait_cut_short_by_a_call_does_not_delay_expiry(tmp_path):
    # Scenario (S3): a sweep at t0 + 100 finds the session alive only through its agent's
    # 150 s wait (deadline t0 + 250). The agent's call then comes at t0 + 100 and ends the
    # wait: the deadline drops to t0 + 200, and the session expires there, not at t0 + 250.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        t0 = clock.t
        db.call_started("s", agent_id="a")
        db.call_finished("s", agent_id="a", hints={"expected_tool_duration_s": 150.0})
        clock.t = t0 + IDLE_S
        db.run_plans()
        assert is_open(db, "s")
        db.call_started("s", agent_id="a")
        db.call_finished("s", agent_id="a")
        clock.t = t0 + 2 * IDLE_S
        db.run_plans()
        assert not is_open(db, "s")


def test_ttl_hint_extends_the_session(tmp_path):
    # Scenario (S1): ttl_s=300 on a session hint (or on a call) stretches its idle period;
    # a session without one expires after the idle period.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        db.begin_session("ttl", tenant="t")
        assert db.hint("ttl", ttl_s=300.0)[0].status == "accepted"
        db.call_started("call-ttl", agent_id="a", tenant="t", hints={"ttl_s": 250.0})
        db.begin_session("plain", tenant="t")
        clock.t += IDLE_S
        db.run_plans()
        assert is_open(db, "ttl") and is_open(db, "call-ttl") and not is_open(db, "plain")
        clock.t += 150.0 - 0.01
        db.run_plans()
        assert is_open(db, "call-ttl")
        clock.t += 0.01
        db.run_plans()
        assert not is_open(db, "call-ttl") and is_open(db, "ttl")
        clock.t += 50.0
        db.run_plans()
        assert not is_open(db, "ttl") and db.stats()["plans"]["expired_sessions"] == 3


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.inf, math.nan, "60", True])
def test_bad_session_idle_values_raise(tmp_path, bad):
    with pytest.raises(InvalidInput, match="session_idle_s"):
        open_db(tmp_path, Clock(), session_idle_s=bad)


def test_none_never_expires_and_ints_are_seconds(tmp_path):
    clock = Clock()
    with open_db(tmp_path / "never", clock, session_idle_s=None) as db:
        db.begin_session("s")
        clock.t += 1e9
        db.run_plans()
        assert is_open(db, "s") and db.stats()["plans"]["expired_sessions"] == 0
    with open_db(tmp_path / "int", clock, session_idle_s=60) as db:
        db.begin_session("s")
        clock.t += 60
        db.run_plans()
        assert not is_open(db, "s")


# (op, session index, seconds the clock moves first, the op's duration: a tool wait or ttl_s)
OPS = st.lists(st.tuples(st.sampled_from(["begin", "call", "call", "hint", "end", "wait", "wait", "ttl"]),
                         st.integers(0, 1), st.sampled_from([0.0, 1.0, 40.0, 99.0, 100.0, 150.0, 200.0]),
                         st.sampled_from([50.0, 150.0, 250.0])), min_size=3, max_size=25)


@given(OPS)
def test_expiry_matches_a_model(ops):
    # Property (S1, S2): after any run of activity, ends, waits, ttl hints (each replacing
    # the last, shorter ones too) and clock moves, the open sessions are exactly those whose
    # deadline is still ahead; an expired one behaves as an ended one.
    clock = Clock()
    model: dict[str, list] = {}  # open session -> [last activity, ttl_s, its agent's return]
    expired = 0

    def deadline(last, ttl, ret):
        return max(last + max(IDLE_S, ttl or 0.0), -1.0 if ret is None else ret + IDLE_S)

    with tempfile.TemporaryDirectory() as d, open_db(d, clock, device_pages=0) as db:
        for op, i, dt, dur in ops:
            sid = f"s{i}"
            clock.t += dt
            db.run_plans()
            gone = [s for s, m in model.items() if deadline(*m) <= clock.t]
            expired += len(gone)
            for s in gone:
                del model[s]
            now = clock.t
            m = model.get(sid)
            if op == "begin":
                if m is not None:
                    with pytest.raises(InvalidInput):
                        db.begin_session(sid)
                else:
                    db.begin_session(sid)
                    model[sid] = [now, None, None]
            elif op == "call":  # opens an unknown (ended, expired) session implicitly; ends the wait
                db.call_started(sid, agent_id="a")
                db.call_finished(sid, agent_id="a")
                model[sid] = [now, None if m is None else m[1], None]
            elif m is None:
                with pytest.raises(NotFound):
                    db.hint(sid, priority=1) if op != "end" else db.end_session(sid)
            elif op == "end":
                db.end_session(sid)
                del model[sid]
            elif op == "ttl":
                db.hint(sid, ttl_s=dur)
                m[0], m[1] = now, dur
            elif op == "wait" and db.explain(session_id=sid)["agents"]:  # its agent waits dur from now
                db.hint(sid, agent_id="a", expected_tool_duration_s=dur)
                m[0], m[2] = now, now + dur
            else:
                db.hint(sid, priority=1)
                m[0] = now
            assert {s for s in ("s0", "s1") if is_open(db, s)} == set(model)
            assert db.stats()["plans"]["expired_sessions"] == expired


def test_ended_sessions_leave_no_expiry_state_behind(tmp_path):
    # Scenario (S3): 300 sessions open and end explicitly (the well-behaved client); the
    # expiry heap drops their entries instead of keeping them for an idle period each, and
    # the expiry timer is not counted among the plan's timers.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        for i in range(300):
            db.begin_session(f"s{i}")
            db.end_session(f"s{i}")
        db.begin_session("last")
        assert len(db._idle_heap) <= 2 * 64 + 2 and db._idle_entry.keys() == {"last"}
        assert db.stats()["plans"]["timers"] == 0 and db._mover.count_timers("expiry") == 1
        clock.t += IDLE_S
        db.run_plans()
        assert not db._idle_heap and db.stats()["sessions"] == 0
        assert db.stats()["plans"]["expired_sessions"] == 1


@pytest.mark.parametrize("idle_s", [IDLE_S, None])
def test_sessions_past_the_bound_end_the_one_due_first(tmp_path, monkeypatch, idle_s):
    # Scenario (S4): a client opens a fresh session with every request and never ends one.
    # Past MAX_OPEN_SESSIONS the Db ends the session whose deadline comes first -- the least
    # recently active, unless an agent's tool wait holds it -- counted in evicted_sessions.
    import kvdb.db.plans.expiry as expiry

    monkeypatch.setattr(expiry, "MAX_OPEN_SESSIONS", 4)
    clock = Clock()
    with helpers.open_db(tmp_path, clock, device_pages=6, device="cpu", session_idle_s=idle_s) as db:
        keys = db.block_keys(list(range(20)), tenant="acme")
        for i in range(4):
            clock.t += 1.0
            db.call_started(f"s{i}", agent_id="a", tenant="acme")
        clock.t += 1.0
        db.call_started("s0", agent_id="a", tenant="acme")  # s0 active again: s1 is now the oldest
        if idle_s is not None:  # s1's agent waits on a tool far past the others' deadlines
            db.call_finished("s1", agent_id="a", hints={"expected_tool_duration_s": 10 * IDLE_S})
            gone = ["s2", "s3"]
        else:
            gone = ["s1", "s2"]
        for i in (4, 5):
            clock.t += 1.0
            db.call_started(f"s{i}", agent_id="a", tenant="acme")
        p = db.stats()
        assert p["sessions"] == 4 and p["plans"]["evicted_sessions"] == 2
        assert [s for s in ("s0", "s1", "s2", "s3", "s4", "s5") if not is_open(db, s)] == gone
        db.call_started(gone[0], agent_id="a", tenant="acme", hints={"prefix_hash": keys[0].hex()})  # opens afresh
        assert is_open(db, gone[0]) and db.stats()["sessions"] == 4
