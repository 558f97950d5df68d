"""The kvdb policy's guard (kvdb/planner/policies/adaptive.py): miniature simulations pick the
ordering online; where the planner's ideas are wrong the tier follows LRU."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from kvdb.planner.policies.adaptive import EPOCH, AdaptiveReplacer, sample_hash
from kvdb.sim.replay import policy_options, replay
from kvdb.sim.trace import parse_trace


def _trace(calls: list[list[int]]):
    return parse_trace("".join(json.dumps({"timestamp": i, "input_length": 16 * len(h), "output_length": 1,
                                            "hash_ids": h}) + "\n" for i, h in enumerate(calls)))


def _frequency_trap(seed: int, hot_calls: int = 3000, window_calls: int = 6000):
    """A hot set read thousands of times, then never again; after it, chains re-read a few times
    each within a sliding window that fits the cache: recency wins, counts mislead."""
    rng = random.Random(seed)
    calls = [[1_000_000 + rng.randrange(100)] for _ in range(hot_calls)]
    for i in range(window_calls):
        c = (i // 40) * 60 + rng.randrange(60)
        calls.append([c * 4 + k for k in range(4)])
    return _trace(calls)


def _hit(trace, policy: str, cap: int) -> float:
    return replay(trace, policy, cap, options=policy_options(policy, cap)).block_hit_ratio


def test_sample_hash_is_stable_across_processes():
    """The sample is a function of the ids alone: the same in every process (PYTHONHASHSEED
    randomises str/bytes hashes), so replays and engines repeat."""
    ids = [7, 2 ** 40 + 3, b"\x01\x02", ("tenant", 5), "s"]
    code = "from kvdb.planner.policies.adaptive import sample_hash as h; print([h(x) for x in %r])" % (ids,)
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {repr([sample_hash(x) for x in ids]) + "\n"}
    assert all(0 <= sample_hash(x) < 2 ** 32 for x in ids)
    # a quarter of ints fall under a quarter of the range: the sample is not biased by id order
    share = sum(sample_hash(i) < 2 ** 30 for i in range(20_000)) / 20_000
    assert 0.23 < share < 0.27


@pytest.mark.parametrize("seed,cap", [(11, 150), (12, 250)])
def test_guard_follows_lru_where_the_planner_loses(seed, cap):
    tr = _frequency_trap(seed)
    lru, planner, kvdb = _hit(tr, "lru", cap), _hit(tr, "planner", cap), _hit(tr, "kvdb", cap)
    assert planner < lru - 0.05  # the trap works: alone, the planner falls far below LRU
    # the guard brings it back; what it keeps losing is the time it takes to be sure (about one
    # decision window after the phase change), a share that shrinks as the trace grows
    assert kvdb >= lru - 0.02
    assert kvdb - planner >= 0.7 * (lru - planner)


def _probe(trace, cap: int, sized: bool = False) -> tuple[float, AdaptiveReplacer]:
    """Replay under the kvdb policy and hand back the guard itself, to read what it learned
    (``sized``: told the capacity, as ``kvdb sim`` tells it)."""
    from kvdb.planner import policies

    made = []

    def factory(n, **kw):
        made.append(AdaptiveReplacer(n, **({"capacity_frames": cap} if sized else {}), **kw))
        return made[-1]

    policies.POLICIES["_probe"] = factory
    try:
        return replay(trace, "_probe", cap).block_hit_ratio, made[0]
    finally:
        del policies.POLICIES["_probe"]


def test_guard_switches_to_lru_and_says_why():
    _, guard = _probe(_frequency_trap(13), 200)
    d = guard.describe()
    assert d["mode"] == "lru" and d["switches"] >= 1
    assert d["learned_capacity_blocks"] == 200  # learned from its own evictions, never told (S4)
    c = d["candidates"]
    assert c["lru"]["sampled_hit_ratio"] > c["gd"]["sampled_hit_ratio"]
    assert all(v["sampled_accesses"] > 0 for v in c.values())


def _small_steady_loss(seed: int, stable_share: float = 0.93):
    """Mostly calls that every ordering hits (one of 30 blocks that always fit), between them
    four frequency traps (a hot set read 200 times, then chains re-read within a window): the
    planner alone loses about a point and a half of hit ratio to LRU, steadily, at a score near 0.84."""
    rng = random.Random(seed)
    trap: list[list[int]] = []
    for phase in range(4):
        trap += [[10_000_000 + phase * 1000 + rng.randrange(100)] for _ in range(200)]
        for i in range(1500):
            c = phase * 100_000 + (i // 40) * 60 + rng.randrange(60)
            trap.append([c * 4 + k for k in range(4)])
    calls, j = [], 0
    while j < len(trap):
        if rng.random() < stable_share:
            calls.append([50_000_000 + rng.randrange(30)])
        else:
            calls.append(trap[j])
            j += 1
    return _trace(calls)


def test_a_small_steady_loss_is_caught():
    """The decision is a paired test: each candidate against the ordering in force, call by call
    (both minis see the same calls, so their difference varies far less than their hit counts).
    Here the planner alone stays ~0.015 below LRU at a score of ~0.84: a margin of 2 % of the
    score with Poisson noise (the rule before) would never switch; the paired test moves the
    tier off ``gd`` and within LRU - 0.005 (the issue's bound). (The agent workload this test
    used before, ``--shape agentic-mix --seed 31`` at 20 %, no longer makes the planner lose
    since an agent waiting on a tool keeps its plan: docs/planner.md.)"""
    tr = _small_steady_loss(31)
    cap = 150
    lru, planner = _hit(tr, "lru", cap), _hit(tr, "planner", cap)
    assert lru - 0.03 < planner < lru - 0.01  # a small, steady loss
    assert lru - planner < 0.02 * lru  # under the old rule's margin
    kvdb, guard = _probe(tr, cap)
    assert guard.switches >= 1 and guard.mode != "gd"
    assert kvdb >= lru - 0.005


def test_keeps_the_planner_where_it_wins():
    """Chains that return after a long gap: GreedyDual's counts keep them, LRU loses them;
    the guard never leaves the planner's ordering for LRU."""
    rng = random.Random(3)
    hot = [[k for k in range(8 * c, 8 * c + 8)] for c in range(20)]  # 160 blocks re-read often
    calls = []
    for i in range(8000):
        calls.append(rng.choice(hot) if i % 3 == 0 else [100_000 + 4 * i + k for k in range(4)])  # one-shot scans
    tr = _trace(calls)
    kvdb, guard = _probe(tr, 180)
    assert kvdb > _hit(tr, "lru", 180) + 0.05
    assert guard.mode != "lru"


def test_before_its_first_decision_it_is_the_planner():
    """Until EPOCH sampled accesses the guard keeps exactly what the planner alone would."""
    rng = random.Random(5)
    calls = [[rng.randrange(120) for _ in range(4)] for _ in range(EPOCH // 4 - 2)]
    tr = _trace([list(dict.fromkeys(c)) for c in calls])
    runs = {}
    for policy in ("kvdb", "planner"):
        rows = []
        replay(tr, policy, 40, per_request=rows.append)
        runs[policy] = [r["hits"] for r in rows]
    assert runs["kvdb"] == runs["planner"] and sum(runs["kvdb"]) > 0


def test_pins_and_removal_reach_both_orderings():
    r = AdaptiveReplacer(4)
    r.record_access([0, 1, 2], [10, 11, 12])
    r.set_evictable(0, False)
    r._switch("lru")
    got = {r.evict(), r.evict()}
    assert got == {1, 2} and r.evict() is None and r.num_evictable() == 0
    r.set_evictable(0, True)
    r.remove(0)
    assert r.num_evictable() == 0 and r.evict() is None


def test_the_no_workflow_candidate_appears_with_the_first_workflow():
    """Until a session declares a workflow, ``nowf`` would decide exactly as ``gd``: it is not
    simulated (a Mooncake-style trace never pays for it); the first workflow makes it, as a
    copy of ``gd``'s mini cache, and from then on it learns on its own."""
    from kvdb.planner.sessions import Planner

    g = AdaptiveReplacer(64)
    assert set(g.describe()["candidates"]) == {"gd", "crf", "lru"}
    p = Planner([g], clock=lambda: 0.0)
    p.begin_session("plain", now_s=0.0)
    ctx, _ = p.call_started("plain", now_s=1.0)
    g.record_access([0, 1], [10, 11], ctx)
    assert "nowf" not in g.describe()["candidates"]
    p.begin_session("declared", workflow=[{"id": "a", "agent_id": "x"}], now_s=2.0)
    c = g.describe()["candidates"]
    assert set(c) == {"gd", "crf", "nowf", "lru"}
    assert c["nowf"] == c["gd"]  # the same past


def test_a_mini_treats_only_the_calls_own_last_block_as_partial():
    """The planner sends a call's last block first (H = L: it is almost always partial, and the
    next turn's longer prompt changes its hash). A mini cache sees a sample of the call; its last
    sampled block is usually a full block the next turn reads again, and must keep its value
    (else the minis misjudged the planner against LRU, kvdb/planner/policies/planned.py
    ``sampled_call``)."""
    guard = AdaptiveReplacer(2048, capacity_frames=1024)  # rate 1/8
    th = guard._threshold
    sampled = [i for i in range(2000) if sample_hash(i) < th]
    unsampled = [i for i in range(2000) if sample_hash(i) >= th]
    mini = guard._minis["gd"]
    # a call whose last block is not in the sample: every sampled block keeps a value above L
    call = [sampled[0], unsampled[0], sampled[1], unsampled[1], sampled[2], unsampled[2]]
    guard.record_access(list(range(6)), call)
    values = [mini.repl.debug_value(mini.table[b]) for b in sampled[:3]]
    assert min(values) > 0
    # a call that ends on a sampled block: that one is the call's partial block, at the floor
    call = [unsampled[3], sampled[3], unsampled[4], sampled[4]]
    guard.record_access(list(range(6, 10)), call)
    assert mini.repl.debug_value(mini.table[sampled[4]]) == 0
    assert mini.repl.debug_value(mini.table[sampled[3]]) > 0
    # the real tier's planner is told nothing: its last block is at the floor
    assert guard.planner.debug_value(9) == 0 and guard.planner.debug_value(5) == 0


def _agentic_mix(seed: int):
    from kvdb.sim.generator import generate, load_params

    return parse_trace("".join(json.dumps(r) + "\n" for r in generate(load_params(None, shape="agentic-mix", seed=seed))))


def _planner_and_calls(num_frames: int = 16):
    """A ``planner`` policy and ``call(session, frames, now, hints)``: one call through a Planner."""
    from kvdb.planner.policies import make_policy
    from kvdb.planner.sessions import Planner

    repl = make_policy("planner", num_frames)
    planner = Planner([repl], clock=lambda: 0.0)

    def call(sid, frames, now, hints=None):
        ctx, _ = planner.call_started(sid, agent_id="a" if sid else None, hints=hints or {}, now_s=now)
        repl.record_access(frames, [1000 + f for f in frames], ctx)
        planner.call_finished(sid, agent_id="a" if sid else None, hints=ctx.hints, now_s=now)

    return repl, call


def test_tc_learns_from_the_unplanned_blocks_a_planned_eviction_spares():
    """T1 (kvdb/planner/policies/planned.py): a planned block is evicted first when its plan lies
    beyond Tc; Tc learned only from unplanned victims, so once it was small nothing unplanned was
    evicted again and it never moved. Here Tc is 0 after the first evictions; blocks idle for ~1000 s must go
    before a chain planned 7 s ahead, once the first planned eviction has taught Tc their age."""
    repl, call = _planner_and_calls()
    call(None, [0, 1, 2], 0.0)  # read twice: worth more than the one-shot blocks below
    call(None, [0, 1, 2], 1.0)
    call(None, [3, 4, 5], 999.5)
    assert [repl.evict() for _ in range(4)] == [5, 2, 4, 3]  # two last blocks, then two one-shot: Tc = 0
    assert repl.debug_tc() == 0.0
    call("s", list(range(6, 14)), 1000.0, {"expected_tool_duration_s": 5.0})
    assert [repl.debug_plan(f) for f in range(6, 13)] == [1007.0] * 7
    # 13 is the call's last block; 12 the first planned victim (its plan lies beyond Tc = 0);
    # that eviction spared block 1, idle 999 s: Tc moves toward it, and the idle blocks go next
    assert [repl.evict() for _ in range(4)] == [13, 12, 1, 0]
    assert repl.debug_tc() > 7.0


def test_a_frame_pinned_before_its_first_access_is_aged_from_its_unpin():
    """A frame pinned while absent and unpinned gets a GreedyDual key; its age (which Tc learns
    from, T1 and rule 3) starts then, not at time 0 or at the frame's previous occupant."""
    repl, call = _planner_and_calls()
    t0 = 1_000_000.0
    for dt in (0.0, 0.5, 1.0):  # read three times: worth more than a frame just unpinned
        call(None, [0, 1, 2], t0 + dt)
    call(None, [3, 4, 5], t0 + 999.5)
    assert [repl.evict() for _ in range(4)] == [5, 2, 4, 3] and repl.debug_tc() == 0.0
    repl.set_evictable(15, False)  # absent: pinned for a load
    repl.set_evictable(15, True)  # unpinned before any access: the least valuable unplanned block
    call("s", list(range(6, 14)), t0 + 1000, {"expected_tool_duration_s": 5.0})
    assert [repl.evict(), repl.evict()] == [13, 12]  # the last block, then a planned one
    # that eviction spared frame 15, just unpinned (it was taken as 1,001,000 s old: Tc 50,050,
    # and the next victims were 15, 1, 0); the planned chain goes on going first
    assert repl.debug_tc() < 1.0
    assert [repl.evict() for _ in range(3)] == [11, 10, 9]


def test_turning_workflows_off_mid_run_plans_as_well_as_never_having_them(monkeypatch):
    """The guard turns planning from workflows off when ``nowf`` wins its samples. On this
    workload (agentic-mix, seed 702, 0.5 %) the planner switched at a fifth of the trace then
    hit 0.34 against 0.52 over the same calls for the planner without workflows from the start,
    and ``kvdb`` fell below LRU - 0.005: Tc had locked low (T1). The switched planner now keeps
    up, and the guard stays within LRU - 0.005."""
    from kvdb.sim import replay as rp

    tr = _agentic_mix(702)
    cap = max(1, int(tr.distinct_blocks() * 0.005))
    at = len(tr.calls) // 5
    make, made = rp.make_policy, []
    monkeypatch.setattr(rp, "make_policy", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    after = {}
    for name, opts in (("switched", {}), ("nowf", {"workflows": False})):
        hits = [0, 0]

        def per(d):
            if d["call"] == at and name == "switched":
                made[-1].set_workflows(False)
            if d["call"] >= at:
                hits[0] += d["hits"]
                hits[1] += d["blocks"]

        replay(tr, "planner", cap, per_request=per, options=opts)
        after[name] = hits[0] / hits[1]
    assert after["switched"] >= after["nowf"] - 0.02, after
    assert _hit(tr, "kvdb", cap) >= _hit(tr, "lru", cap) - 0.005


def test_at_rate_one_the_tier_stands_for_its_own_ordering():
    """G1: a tier of at most MIN_MINI_BLOCKS frames samples every block, so the mini of the
    ordering in force would repeat the tier: none is kept, the tier's own hits stand for it.
    A switch makes the mini of the ordering left from the tier as it is (its blocks, none
    pinned) and drops the mini of the one taken up."""
    g = AdaptiveReplacer(40, capacity_frames=32)
    assert g.rate == 1.0 and set(g._minis) == {"crf", "lru"}
    for i in range(6):
        g.record_access([4 * i + j for j in range(4)], [100 + 4 * i + j for j in range(4)])
    g.record_access([0, 1, 30], [100, 101, 500])  # hits 100 and 101, then a new block
    c = g.describe()["candidates"]
    assert set(c) == {"gd", "crf", "lru"}
    assert c["gd"]["sampled_accesses"] == 27 and c["gd"]["sampled_hit_ratio"] == 2 / 27
    assert c["gd"] == c["crf"] == c["lru"]  # every ordering held those blocks
    g.set_evictable(5, False)
    g._switch("lru")
    assert set(g._minis) == {"gd", "crf"}
    gd = g._minis["gd"]
    resident = {100 + f for f in range(24)} | {500}
    assert set(gd.table) == resident and all(gd.owner[f] == b for b, f in gd.table.items())
    assert gd.repl.num_evictable() == len(resident)  # the tier's pin is not the mini's
    victims = [gd.repl.evict() for _ in range(len(resident))]
    assert sorted(victims) == sorted(gd.table.values())  # it holds exactly the tier's frames
    assert g.describe()["candidates"]["gd"] == c["gd"]  # its past goes with it


def test_a_small_tier_replays_with_every_call_counted_for_each_ordering():
    """At rate 1 the minis have the tier's frames: a call of over twice the cache still
    reaches every mini, so no ordering is credited with hits the others never had a chance at."""
    rng = random.Random(11)
    calls = [list(range(1000 * i, 1000 * i + 70)) if i % 7 == 0 else [rng.randrange(40) for _ in range(3)]
             for i in range(600)]
    _, guard = _probe(_trace([list(dict.fromkeys(c)) for c in calls]), 20, sized=True)
    c = guard.describe()["candidates"]
    assert guard.rate == 1.0 and guard.epochs > 0
    assert len({v["sampled_accesses"] for v in c.values()}) == 1


def test_a_copy_of_the_tier_names_every_frame_it_may_evict_and_removals_reach_the_minis():
    """G1's copy leaves out a frame the tier holds without a block id (the pool pins a frame it
    inserted before the replacer hears of the access): a mini could not name it when evicting.
    At rate 1 a block removed from the tier (promoted, offloaded, deleted) leaves every mini
    too: the tier's hits see the removal, so the candidates' must."""
    g = AdaptiveReplacer(40, capacity_frames=32)
    g.record_access([0, 1, 2, 3], [100, 101, 102, 103])
    g.set_evictable(7, False)  # pinned before its first access
    g._switch("lru")
    gd = g._minis["gd"]
    assert 7 in gd.free and set(gd.table) == {100, 101, 102, 103}
    gd.trim(0)  # evicts every frame the copy holds: each must be one it can name
    assert gd.table == {} and gd.repl.evict() is None
    g.record_access([4, 5], [104, 105])
    assert all(104 in m.table for m in g._minis.values())
    g.remove(4)
    assert all(104 not in m.table and 105 in m.table for m in g._minis.values())
    assert g.describe()["candidates"]["lru"]["sampled_accesses"] == 6
