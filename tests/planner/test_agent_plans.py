"""Agent-level plans (kvdb/planner/policies/agentplans.py): a private block follows its agent's
one heap entry, a shared block has its own; the victim is still the planned block wanted
furthest in the future, deepest first (P3), whatever order the agents were re-planned in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdb.planner.policies import make_policy
from kvdb.planner.sessions import Planner


def _calls(chains: list[list[int]], n: int = 64):
    """A planner whose agent i read ``chains[i]`` (frame f holds block id f; no workflow, no
    hints); returns it and the agents' keys."""
    r = make_policy("planner", n)
    p = Planner([r], clock=lambda: 0.0)
    p.begin_session("s")
    keys = []
    for i, chain in enumerate(chains):
        ctx, _ = p.call_started("s", agent_id=f"a{i}", now_s=1.0)
        r.record_access(chain, chain, ctx)
        p.call_finished("s", agent_id=f"a{i}", now_s=1.0)
        keys.append(("s", f"a{i}"))
    return r, keys


def test_replanning_an_agent_touches_only_its_shared_blocks():
    # a: frames 0..9 (9 is its call's last block: a leaf, never planned); b shares 0 and 1
    r, (a, b) = _calls([list(range(10)), [0, 1, 10, 11]])
    r._plan_agent(a, 50.0, 1.0)
    r._plan_agent(b, 80.0, 1.0)
    assert [r.debug_plan(f) for f in (0, 1, 2, 8, 9, 10, 11)] == [50.0, 50.0, 50.0, 50.0, None, 80.0, None]
    touched = []
    update = r._frame_update
    r._frame_update = lambda f: (touched.append(f), update(f))
    r._plan_agent(a, 120.0, 1.0)  # the same chain: its private blocks follow its heap entry
    assert sorted(touched) == [0, 1]
    assert [r.debug_plan(f) for f in (0, 1, 2, 8, 10)] == [80.0, 80.0, 120.0, 120.0, 80.0]


def test_victims_go_furthest_first_and_deepest_first_across_agents():
    r, (a, b) = _calls([list(range(6)), [0, 1, 10, 11]])
    r._plan_agent(a, 50.0, 1.0)
    r._plan_agent(b, 80.0, 1.0)
    r._plan_agent(a, 120.0, 1.0)  # now a's private blocks are wanted last, then b's, shared ones with b
    order = [r.evict() for _ in range(8)]
    assert set(order[:2]) == {5, 11}  # the calls' last blocks (junk) first
    assert order[2:] == [4, 3, 2, 10, 1, 0]
    assert r.evict() is None


def test_a_shared_block_turned_private_is_found_again():
    r, (a, b) = _calls([[0, 1, 2, 3], [0, 1, 4, 5]])
    r._plan_agent(a, 80.0, 1.0)
    r._plan_agent(b, 50.0, 1.0)
    order = [r.evict() for _ in range(4)]
    # the leaves, then a's own block; a's scan has passed 0 and 1 (b's, sooner), then b's own block
    assert set(order[:2]) == {3, 5} and order[2:] == [2, 4]
    r._plan_agent(b, None, 1.0)  # b lets go: 0 and 1 are a's alone, planned for 80
    assert [r.debug_plan(f) for f in (0, 1)] == [80.0, 80.0]
    assert [r.evict(), r.evict(), r.evict()] == [1, 0, None]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 4)), min_size=1, max_size=5),
       plans=st.lists(st.tuples(st.integers(0, 4), st.sampled_from([None, 10.0, 20.0, 30.0, 40.0, 50.0])),
                      min_size=1, max_size=12))
def test_every_planned_victim_is_wanted_furthest_then_deepest(shape, plans):
    """P3 against a brute-force reading of the same state, after any sequence of re-plans.
    Agent i's call reads a shared prefix (frames 0.., at the same depths in every call, as a
    system prompt is) of ``shape[i][0]`` blocks, then ``shape[i][1]`` blocks of its own."""
    chains = [list(range(k)) + [10 + 10 * i + j for j in range(m)] for i, (k, m) in enumerate(shape)]
    r, keys = _calls(chains)
    want: dict[tuple, float] = {}
    for i, t in plans:
        if i < len(keys):
            r._plan_agent(keys[i], t, 1.0)
            if t is None:
                want.pop(keys[i], None)
            else:
                want[keys[i]] = t
    last, leaf = {}, {}  # frame -> its depth in the last call that read it, and whether it ended that call
    for chain in chains:
        for j, f in enumerate(chain):
            last[f], leaf[f] = j, j == len(chain) - 1

    def plan_of(f):  # the earliest plan among the agents whose chain holds f; a leaf is never planned
        ts = [want[k] for k, c in zip(keys, chains) if f in c and k in want]
        return min(ts) if ts and not leaf[f] else None

    resident = set(last)
    planned = {f for f in resident if plan_of(f) is not None}
    while resident:
        f = r.evict()
        assert f in resident
        resident.discard(f)
        if f in planned and not (resident - planned):  # a planned victim, nothing else left
            best = max((plan_of(g), last[g]) for g in planned & (resident | {f}))
            assert (plan_of(f), last[f]) == best
        planned.discard(f)
    assert r.evict() is None


def test_an_expired_plan_unplans_its_blocks():
    r, (a,) = _calls([[0, 1, 2, 3]])
    r._plan_agent(a, 5.0, 1.0)
    assert r.debug_plan(0) == 5.0
    r._now = 1e6  # far past the plan's deadline
    r._expire_plans(r._now)
    assert [r.debug_plan(f) for f in range(4)] == [None] * 4
    assert sorted(r.evict() for _ in range(4)) == [0, 1, 2, 3]


def test_a_block_pinned_while_its_agent_was_scanned_is_found_once_unpinned():
    r, (a,) = _calls([[0, 1, 2, 3]])
    r._plan_agent(a, 500.0, 1.0)
    assert r.evict() == 3  # the call's last block
    r.set_evictable(2, False)
    assert r.evict() == 1  # the scan passes the pinned block
    r.set_evictable(2, True)
    assert [r.evict(), r.evict(), r.evict()] == [2, 0, None]


def test_a_planned_block_that_ends_another_call_stays_evictable():
    """Block 1 is planned for a's next call, then read as the last block of b's call."""
    r = make_policy("planner", 16)
    p = Planner([r], clock=lambda: 0.0)
    p.begin_session("s")
    for agent, chain in (("a", [0, 1, 2, 3]), ("b", [0, 1])):
        ctx, _ = p.call_started("s", agent_id=agent, now_s=1.0)
        r.record_access(chain, chain, ctx)
        p.call_finished("s", agent_id=agent, now_s=1.0)
        if agent == "a":
            r._plan_agent(("s", "a"), 500.0, 1.0)
    assert sorted(r.evict() for _ in range(4)) == [0, 1, 2, 3]
    assert r.evict() is None and r.num_evictable() == 0


@pytest.mark.parametrize("t", [None, float("inf")])
def test_a_released_agent_leaves_no_block_planned(t):
    r, (a,) = _calls([[0, 1, 2, 3]])
    r._plan_agent(a, 5.0, 1.0)
    r._plan_agent(a, t, 1.0)
    assert [r.debug_plan(f) for f in range(4)] == [None] * 4
    assert sorted(r.evict() for _ in range(4)) == [0, 1, 2, 3]
