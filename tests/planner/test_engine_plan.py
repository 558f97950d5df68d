"""The engine acting on the plan (kvdb/db/plans/: waits.py E1-E4, prefixes.py X1-X3): a real
two-tier Db (the device tier is a CPU arena standing in for the GPU), time driven by an injected
clock."""

from __future__ import annotations

import threading
from functools import partial

import helpers
import pytest
import torch
from helpers import LAYOUT, Clock, agent_call, blocks_for, tiers

from kvdb.errors import InvalidInput, NotFound

#: the Db of these tests: 4 device pages (a CPU arena) over 8 host pages, no disk tier
open_db = partial(helpers.open_db, device_pages=4, device="cpu")


@pytest.mark.parametrize("policy", ["lru", "kvdb"])
def test_waiting_agent_moves_down_under_pressure_and_back_before_its_return(tmp_path, policy):
    # Scenario (E1, E2): 6 device pages. Agent a stores 3 blocks and waits 60 s on a tool.
    # Agent b's 3 blocks fill the device: a's private blocks go to host (a planned offload,
    # not a capacity eviction). Just before a's predicted return minus the lead, nothing
    # moves; at it, a's chain comes back to the device; a's call finds all 3 there.
    clock = Clock()
    with open_db(tmp_path, clock, device_pages=6, replacer=policy) as db:
        ka = db.block_keys(list(range(12)), tenant="t")
        kb = db.block_keys(list(range(100, 112)), tenant="t")
        db.begin_session("sa", tenant="t")
        db.begin_session("sb", tenant="t")
        agent_call(db, "sa", "a", ka, blocks_for(3, 1), wait_s=60.0)
        db.run_plans()
        assert tiers(db, ka) == ["device"] * 3  # room left: nothing moves
        agent_call(db, "sb", "b", kb, blocks_for(3, 2))
        db.run_plans()
        assert tiers(db, ka) == ["host"] * 3 and tiers(db, kb) == ["device"] * 3
        st = db.stats()
        assert st["plans"]["planned_offloads"] == 1 and st["plans"]["planned_offload_blocks"] == 3
        assert st["tiers"]["device"]["evictions"] == 0 and st["tiers"]["device"]["demotions"] == 3
        ex = db.explain(session_id="sa")["agents"][0]
        assert ex["state"] == "waiting" and ex["offloaded"] and not ex["prefetched"]
        assert ex["tiers"]["host"] == 3 and 59.0 < ex["return_in_s"] <= 60.0
        due = ex["prefetch_in_s"]
        assert 0 < due < 60.0
        clock.t += due - 0.01
        db.run_plans()
        assert tiers(db, ka) == ["host"] * 3 and db.stats()["plans"]["planned_prefetches"] == 0
        clock.t += 0.02
        db.run_plans()
        assert tiers(db, ka) == ["device"] * 3
        out = torch.empty((3, *LAYOUT.block_shape))
        db.get_blocks(ka, out=out)
        assert torch.equal(out, blocks_for(3, 1))  # bytes survive both moves
        clock.t += 1.0
        db.call_started("sa", agent_id="a")
        p = db.stats()["plans"]
        assert (p["planned_prefetches"], p["planned_prefetch_blocks"], p["planned_prefetch_hits"]) == (1, 3, 3)
        assert (p["planned_prefetch_misses"], p["late_prefetches"], p["early_calls"]) == (0, 0, 0)
        assert p["waiting_agents"] == 0 and p["timers"] == 0


def test_shared_blocks_stay_and_host_pressure_goes_to_disk(tmp_path):
    # Scenario (E1): a and b share their first block (a system prompt); device 4, host 2,
    # disk on. a waits 120 s: only its 2 private blocks move, and since the host tier has no
    # 2 free frames and the wait is long they go to disk; the shared block stays on the
    # device. The reload from disk gets an earlier deadline.
    clock = Clock()
    with open_db(tmp_path, clock, host_pages=2, disk_bytes=None) as db:
        ka = db.block_keys(list(range(12)), tenant="t")
        kb = ka[:1] + db.block_keys(list(range(4)) + list(range(200, 204)), tenant="t")[1:]
        b = blocks_for(3, 3)
        db.put_blocks(db.block_keys(list(range(300, 308)), tenant="t"), blocks_for(2, 9))  # fill the host
        db.begin_session("s", tenant="t")
        agent_call(db, "s", "b", kb, torch.cat([b[:1], blocks_for(1, 4)]))
        agent_call(db, "s", "a", ka, b, wait_s=120.0)
        assert db.stats()["tiers"]["device"]["pages"] == 4  # full: pressure at a's wait
        db.run_plans()
        assert tiers(db, ka) == ["device", None, None]
        assert all(db.contains(k) for k in ka)  # on disk, nothing lost (E4)
        p = db.stats()["plans"]
        assert p["planned_offload_blocks"] == p["planned_disk_offload_blocks"] == 2
        plan = db._agents["s"]["a"]
        lead = plan.return_s - plan.timer.due_s
        assert lead > 2 * 3 * db._s_per_page + 0.25  # disk blocks count at the disk's rate
        clock.t += 120.0
        db.run_plans()
        assert tiers(db, ka) == ["device"] * 3
        out = torch.empty((3, *LAYOUT.block_shape))
        db.get_blocks(ka, out=out)
        assert torch.equal(out, b)


def test_cancel_paths(tmp_path):
    # Scenario (E3): four agents wait on tools, device full. end_session cancels one plan,
    # a new hint moves another's timer, a call before the deadline is early, a call after it
    # whose move has not run yet (the mover is held) is late.
    clock = Clock()
    with open_db(tmp_path, clock, device_pages=8, host_pages=16) as db:
        keys = {a: db.block_keys(list(range(i * 100, i * 100 + 8)), tenant="t") for i, a in enumerate("wxyz")}
        for i, a in enumerate("wxyz"):
            db.begin_session(a, tenant="t")
            agent_call(db, a, a, keys[a], blocks_for(2, i), wait_s=100.0)
        db.run_plans()
        p = db.stats()["plans"]
        assert p["waits"] == 4 and p["timers"] == 4
        db.end_session("w")
        out = db.hint("x", expected_tool_duration_s=500.0)  # x finished last in its session
        assert [o.status for o in out] == ["accepted"]
        assert db.stats()["plans"]["replanned_waits"] == 1
        clock.t += 50.0
        db.call_started("y", agent_id="y")  # early
        clock.t += 60.0  # past every first deadline
        hold = threading.Event()
        db._mover.submit(hold.wait)  # the mover is busy: z's due move cannot run yet
        try:
            db.call_started("z", agent_id="z")  # late
        finally:
            hold.set()
        db.run_plans()
        p = db.stats()["plans"]
        assert (p["cancelled_prefetches"], p["early_calls"], p["late_prefetches"]) == (1, 1, 1)
        assert p["planned_prefetches"] == 0 and p["timers"] == 1  # only x's, now at +500 s
        ex = db.explain(session_id="x")["agents"][0]
        assert ex["state"] == "waiting" and 389.0 < ex["return_in_s"] <= 390.0
        clock.t += 400.0
        db.run_plans()
        assert db.stats()["plans"]["planned_prefetches"] == 1 and tiers(db, keys["x"]) == ["device"] * 2


def test_workflow_tool_node_is_a_wait(tmp_path):
    # Scenario: a declared workflow a -> tool t (40 s) -> b, one agent x, 4 device pages. After
    # a finishes, x waits ~40 s without any hint; another session fills the device and x's
    # blocks go to host; they are back before b. After b, x has nothing left: no timer.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        db.begin_session("s", tenant="t", workflow=[
            {"id": "a", "agent_id": "x"},
            {"id": "t", "agent_id": "x", "kind": "tool", "deps": ["a"], "expected_duration_s": 40},
            {"id": "b", "agent_id": "x", "deps": ["t"]}])
        keys = db.block_keys(list(range(8)), tenant="t")
        ctx, _ = db.call_started("s", node_id="a")
        db.put_blocks(keys, blocks_for(2), ctx=ctx)
        db.call_finished("s", node_id="a")
        ex = db.explain(session_id="s")["agents"][0]
        assert ex["agent_id"] == "x" and ex["state"] == "waiting" and 39.0 < ex["return_in_s"] <= 40.0
        db.begin_session("o", tenant="t")
        agent_call(db, "o", "y", db.block_keys(list(range(50, 58)), tenant="t"), blocks_for(2, 1))
        db.run_plans()
        assert tiers(db, keys) == ["host", "host"]
        clock.t += 40.0
        db.run_plans()
        assert tiers(db, keys) == ["device", "device"]
        ctx, _ = db.call_started("s", node_id="b")
        db.match_prefix(keys, ctx=ctx)
        db.call_finished("s", node_id="b")
        p = db.stats()["plans"]
        assert (p["planned_offload_blocks"], p["planned_prefetch_hits"], p["early_calls"], p["timers"]) == (2, 2, 0, 0)
        assert db.explain(session_id="s")["agents"][0]["state"] == "idle"


def test_bad_hints_are_rejected_and_plan_nothing(tmp_path):
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        db.begin_session("s", tenant="t")
        keys = db.block_keys(list(range(8)), tenant="t")
        agent_call(db, "s", "a", keys, blocks_for(2))
        out = db.hint("s", expected_tool_duration_s=-1)
        assert out[0].status == "rejected" and "negative" in out[0].reason
        assert db.hint("s", expected_tool_duration_s=float("nan"))[0].status == "rejected"
        out = db.call_finished("s", agent_id="a", hints={"expected_tool_duration_s": "soon"})
        assert out[0].status == "rejected"
        assert db.stats()["plans"]["waits"] == 0 and db.stats()["plans"]["timers"] == 0
        with pytest.raises(NotFound):
            db.hint("nope", expected_tool_duration_s=1)
        with pytest.raises(InvalidInput, match="no agent 'ghost'"):
            db.hint("s", agent_id="ghost", expected_tool_duration_s=1)
        with pytest.raises(InvalidInput, match="workflow spec or session_id"):
            db.explain()
        with pytest.raises(NotFound):
            db.explain(session_id="nope")
        assert db.stats()["hints"]["rejected"] == 3
        assert db.match_prefix(keys, peek=True) == 2  # nothing stored was touched


def _store_prefix_chain(db, sid, tenant, n_prefix=3, n_total=5):
    keys = db.block_keys(list(range(4 * n_total)), tenant=tenant)
    db.begin_session(sid, tenant=tenant)
    agent_call(db, sid, "a", keys, blocks_for(n_total, 5))
    db.end_session(sid)
    return keys, keys[n_prefix - 1]


def test_prefix_hash_resolves_protects_and_is_refcounted(tmp_path):
    # Scenario (X1): a chain of 5 blocks is stored by a call; two later sessions name its
    # first 3 blocks as their shared prefix. The prefix comes back to the device, is pinned
    # while either session is open and survives device pressure; it is released with the
    # last session.
    clock = Clock()
    with open_db(tmp_path, clock, device_pages=6, host_pages=8) as db:  # at most 3 pinned
        keys, last = _store_prefix_chain(db, "s0", "acme")
        db.offload(keys, to="host")
        out = db.begin_session("s1", tenant="acme", hints={"prefix_hash": last.hex()})
        assert [(o.name, o.status) for o in out] == [("prefix_hash", "accepted")]
        db.begin_session("s2", tenant="acme", hints={"prefix_hash": last.hex()})
        db.run_plans()
        assert tiers(db, keys) == ["device", "device", "device", "host", "host"]
        ex = db.explain(session_id="s1")["prefix"]
        assert ex == {"status": "resident", "blocks": 3, "sessions": 2, "protected_blocks": 3,
                      "tiers": {"device": 3, "host": 0, "disk": 0, "absent": 0}}
        other = db.block_keys(list(range(500, 520)), tenant="acme")
        db.put_blocks(other, blocks_for(5, 7))  # device pressure: the prefix stays
        assert tiers(db, keys[:3]) == ["device"] * 3
        assert db.stats()["plans"]["prefix_pinned_pages"] == 3
        db.end_session("s1")
        assert db.stats()["plans"]["prefix_pinned_pages"] == 3  # s2 still holds it
        db.end_session("s2")
        st = db.stats()
        assert st["plans"]["prefix_pinned_pages"] == 0 and st["tiers"]["device"]["pinned_pages"] == 0
        assert st["plans"]["prefixes"] == 0


def test_prefix_hash_as_engine_hash_and_delete_of_a_protected_key(tmp_path):
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        keys = db.engine_keys([11, 12, 13], tenant="acme")
        db.begin_session("s0", tenant="acme")
        agent_call(db, "s0", "a", keys, blocks_for(3))
        db.begin_session("s1", tenant="acme", hints={"prefix_hash": 12})
        db.run_plans()
        assert db.explain(session_id="s1")["prefix"]["blocks"] == 2
        assert db.delete([keys[1]]) == 1  # the Db's protection does not block a delete
        assert db.explain(session_id="s1")["prefix"]["status"] == "partial"
        db.end_session("s1")
        assert db.stats()["tiers"]["device"]["pinned_pages"] == 0


def test_unknown_prefix_is_clipped_then_resolved_by_the_sessions_call(tmp_path):
    # Scenario (X2): the prefix is not stored yet: clipped, nothing lost; the session's own
    # call stores it and resolves it.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        keys = db.block_keys(list(range(12)), tenant="t")
        out = db.begin_session("s", tenant="t", hints={"prefix_hash": keys[1].hex()})
        assert out[0].status == "clipped" and "unknown prefix" in out[0].reason
        assert db.explain(session_id="s")["prefix"] == {"status": "unknown"}
        assert db.hint("s", prefix_hash="zz")[0].status == "clipped"  # not a key at all
        assert db.hint("s", prefix_hash=keys[1].hex())[0].status == "clipped"
        agent_call(db, "s", "a", keys, blocks_for(3))
        db.run_plans()
        ex = db.explain(session_id="s")["prefix"]
        assert ex["status"] == "resident" and ex["blocks"] == 2
        h = db.stats()["hints"]
        assert h == {"accepted": 0, "clipped": 3, "rejected": 0}


def test_prefix_hash_of_another_tenant_resolves_to_nothing(tmp_path):
    # Scenario (X3): tenant acme stores a prefix; a session of tenant evil names it by its
    # key and by the engine hash acme used: neither resolves, nothing is revealed or pinned.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        _, last = _store_prefix_chain(db, "s0", "acme")
        ek = db.engine_keys([77], tenant="acme")
        db.begin_session("s1", tenant="acme")
        agent_call(db, "s1", "a", ek, blocks_for(1))
        db.begin_session("e0", tenant="evil")
        never = db.hint("e0", prefix_hash="ab" * 16)[0]  # a key nobody stored: the reference answer
        for h in (last.hex(), 77):
            out = db.begin_session("e", tenant="evil", hints={"prefix_hash": h})
            assert (out[0].status, out[0].reason) == ("clipped", never.reason)  # same answer as for nothing
            assert db.explain(session_id="e")["prefix"] == db.explain(session_id="e0")["prefix"] == {"status": "unknown"}
            db.end_session("e")
        db.run_plans()
        st = db.stats()
        assert st["plans"]["prefixes"] == 0 and st["tiers"]["device"]["pinned_pages"] == 0
        db.begin_session("ok", tenant="acme", hints={"prefix_hash": 77})  # its own tenant: resolves
        assert db.explain(session_id="ok")["prefix"]["blocks"] == 1


def test_chain_is_the_latest_calls_and_a_stale_context_changes_nothing(tmp_path):
    # Scenario: agent a's call 1 looks up k1 and stores k1 + k2 (one chain); call 2 looks up k3;
    # a lookup with call 1's context after that leaves call 2's chain as it is.
    clock = Clock()
    with open_db(tmp_path, clock, device_pages=8) as db:
        db.begin_session("s", tenant="t")
        k = db.block_keys(list(range(16)), tenant="t")
        ctx1, _ = db.call_started("s", agent_id="a")
        db.match_prefix(k[:1], ctx=ctx1)
        db.put_blocks(k[:2], blocks_for(2), ctx=ctx1)
        assert db._agents["s"]["a"].chain == k[:2]
        db.call_finished("s", agent_id="a")
        ctx2, _ = db.call_started("s", agent_id="a")
        db.match_prefix(k[2:3], ctx=ctx2)
        db.match_prefix(k[:2], ctx=ctx1)
        assert db._agents["s"]["a"].chain == k[2:3]
        assert db.explain(session_id="s")["agents"][0]["chain_blocks"] == 1


def test_a_wait_said_during_the_call_starts_when_the_call_ends(tmp_path):
    # Scenario: the call's own hint (call_started) and a hint given while the call runs both
    # start the wait at call_finished, from the call's end.
    clock = Clock()
    with open_db(tmp_path, clock) as db:
        db.begin_session("s", tenant="t")
        k = db.block_keys(list(range(8)), tenant="t")
        ctx, _ = db.call_started("s", agent_id="a", hints={"expected_tool_duration_s": 10})
        db.put_blocks(k, blocks_for(2), ctx=ctx)
        assert db.explain(session_id="s")["agents"][0]["state"] == "in call"
        clock.t += 5.0
        db.call_finished("s", agent_id="a")
        a = db.explain(session_id="s")["agents"][0]
        assert a["state"] == "waiting" and 9.0 < a["return_in_s"] <= 10.0
        ctx, _ = db.call_started("s", agent_id="a")
        assert db.hint("s", agent_id="a", expected_tool_duration_s=30)[0].status == "accepted"
        assert db.explain(session_id="s")["agents"][0]["state"] == "in call"
        clock.t += 2.0
        db.call_finished("s", agent_id="a")
        a = db.explain(session_id="s")["agents"][0]
        assert a["state"] == "waiting" and 29.0 < a["return_in_s"] <= 30.0
        assert db.stats()["plans"]["waits"] == 2
