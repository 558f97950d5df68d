"""Sequential replay (S1-S4): exact hits on a hand-checked trace, the reference figures on the
shared Mooncake trace, no peeking, determinism and gap closure on generated agent traces."""

from __future__ import annotations

import json

import pytest
from helpers import ONLINE, replay_hits

from kvdb.errors import InvalidInput
from kvdb.sim.generator import load_params, trace_lines
from kvdb.sim.replay import capacity_for, gap_closure, replay
from kvdb.sim.trace import parse_trace

# Scenario: capacity 3; [0,1,2] [0,1,3] [4,5] [0,1,2]
SMALL = "\n".join(json.dumps({"timestamp": i, "hash_ids": ids})
                  for i, ids in enumerate([[0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2]]))


def test_small_trace_lru_and_belady_exact():
    t = parse_trace(SMALL)
    # LRU: call 2 evicts 2 (S3); call 3 evicts 3 then 1 (the deeper of the two oldest first)
    assert replay_hits(t, "lru", 3) == [0, 2, 0, 1]
    # Belady: call 2 drops 3 at once (never used again); call 3 drops 5 then 4 (ties -> deeper)
    assert replay_hits(t, "belady", 3) == [0, 2, 0, 3]
    r = replay(t, "belady", 3)
    assert (r.requests, r.accesses, r.hits) == (4, 11, 5)
    assert r.block_hit_ratio == pytest.approx(5 / 11)
    assert r.token_hit_ratio == pytest.approx(5 / 11)


def test_every_online_policy_runs_the_small_trace():
    t = parse_trace(SMALL)
    for p in ONLINE:
        hits = replay_hits(t, p, 3)
        assert hits[0] == 0 and hits[1] == 2, p  # nothing can be evicted before call 2's lookup


def test_bad_capacity_and_policy():
    t = parse_trace(SMALL)
    with pytest.raises(InvalidInput):
        replay(t, "lru", 0)
    with pytest.raises(InvalidInput, match="unknown policy"):
        replay(t, "fifo", 3)
    with pytest.raises(InvalidInput, match="capacity fraction"):
        capacity_for(t, 0)


@pytest.mark.parametrize(
    "cap, lru, belady",
    [(913, 0.0440, 0.1829), (1827, 0.0525, 0.2464), (3655, 0.0793, 0.3142), (9139, 0.1958, 0.3664)],
)
def test_reference_figures_on_the_conversation_trace(cap, lru, belady, conversation):
    assert round(replay(conversation, "lru", cap).block_hit_ratio, 4) == lru
    assert round(replay(conversation, "belady", cap).block_hit_ratio, 4) == belady


def test_capacity_fraction_matches_reference_capacities(conversation):
    assert [capacity_for(conversation, f) for f in (0.005, 0.01, 0.02, 0.05)] == [913, 1827, 3655, 9139]


def _agent_trace(workflows=True, **kw):
    p = load_params(None, sessions=12, **kw)
    return list(trace_lines(p, workflows))


@pytest.mark.parametrize("policy, workflows", [(p, True) for p in ONLINE] + [("kvdb", False)])
def test_no_peeking(policy, workflows):
    """S4: changing lines after call k never changes the hits of calls <= k (kvdb also
    without workflow lines: its next-call estimates are learned from earlier calls only)."""
    lines = _agent_trace(workflows)
    calls = [i for i, l in enumerate(lines) if "hash_ids" in l]
    k_line = calls[len(calls) // 2]
    k_call = len([i for i in calls if i <= k_line])
    changed = lines[: k_line + 1]
    for l in lines[k_line + 1:]:
        d = json.loads(l)
        if "hash_ids" in d:
            d["hash_ids"] = [h + 10_000_000 for h in d["hash_ids"][:2]]  # a different future
            d.pop("hints", None)
        changed.append(json.dumps(d))
    a = replay_hits(parse_trace("\n".join(lines)), policy, 40)
    b = replay_hits(parse_trace("\n".join(changed)), policy, 40)
    assert a[:k_call] == b[:k_call]
    assert a != b  # the change is visible later, so the test can fail


def test_replays_are_deterministic():
    t = parse_trace("\n".join(_agent_trace()))
    for p in ("kvdb", "kvflow", "tokencake", "arc"):
        a, b = [], []
        replay(t, p, 50, per_request=a.append)
        replay(t, p, 50, per_request=b.append)
        assert a == b


@pytest.mark.parametrize("workflows", [True, False])
def test_kvdb_never_below_lru_on_agent_traces(workflows):
    """Generated agent traces with exact, noisy (sigma = 1) and no hints, 1 % and 5 %, with
    and without their declared workflows."""
    for kw in ({}, {"hint_noise_sigma": 1.0}, {"hints": False}):
        t = parse_trace("\n".join(_agent_trace(workflows, **kw)))
        for f in (0.01, 0.05):
            cap = capacity_for(t, f)
            lru = replay(t, "lru", cap).block_hit_ratio
            best = replay(t, "belady", cap).block_hit_ratio
            got = replay(t, "kvdb", cap).block_hit_ratio
            assert got >= lru, (kw, f, got, lru)
            assert gap_closure(got, lru, best) >= 0


def test_gap_closure_edges():
    assert gap_closure(0.3, 0.2, 0.4) == pytest.approx(0.5)
    assert gap_closure(0.3, 0.2, 0.2) is None


def test_same_trace_replayed_twice_gives_the_same_hits():
    """Workflow progress lives in each replay's Planner, not in the parsed trace."""
    t = parse_trace("\n".join(_agent_trace()))
    for p in ("kvflow", "kvdb"):
        assert replay_hits(t, p, 40) == replay_hits(t, p, 40)


def test_timed_replay_kvdb_beats_kvflow_and_tokencake():
    """T1-T5 on a 24-session agent trace with hints: mean / p99 TTFT and mean JCT, 1 % and 5 %."""
    from kvdb.sim.timed import timed_replay

    t = parse_trace("\n".join(trace_lines(load_params(None, sessions=24))))
    for f in (0.01, 0.05):
        d = capacity_for(t, f)
        res = {p: timed_replay(t, p, d, 4 * d) for p in ("kvflow", "tokencake", "kvdb")}
        for other in ("kvflow", "tokencake"):
            assert res["kvdb"].ttft_mean_s < res[other].ttft_mean_s, (f, other)
            assert res["kvdb"].ttft_p99_s < res[other].ttft_p99_s, (f, other)
            assert res["kvdb"].jct_mean_s < res[other].jct_mean_s, (f, other)
        assert res["kvdb"].requests == len(t.calls) and res["kvdb"].sessions == 24
    with pytest.raises(InvalidInput, match="replay-only"):
        timed_replay(t, "belady", 10, 10)
