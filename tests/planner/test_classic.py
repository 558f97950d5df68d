"""The classic baselines (kvdb/planner/policies/: lirs, lrfu, s3fifo, sieve, twoq, wtinylfu) on
small hand-worked sequences from their papers' descriptions; the shared interface contract
(R1-R4) for every one of them is in tests/test_replacer.py."""

from __future__ import annotations

import pytest

from kvdb.errors import InvalidInput
from kvdb.planner.policies import (
    LirsReplacer,
    LrfuReplacer,
    LruReplacer,
    S3FifoReplacer,
    SieveReplacer,
    TwoQReplacer,
    WTinyLfuReplacer,
)


def one_by_one(r, frames, ids=None) -> None:
    for i, f in enumerate(frames):
        r.record_access([f], ids=None if ids is None else [ids[i]])


# ---------------------------------------------------------------- SIEVE


def test_sieve_hand_skips_visited_and_stays_put():
    # Scenario: 0..3 enter in order (tail 0 .. head 3); 0 and 2 are hit. The hand clears 0's
    # bit, evicts 1 and stays at 2; after 4 enters, it clears 2, evicts 3, then moves on to 4;
    # past the head it starts again at the tail, where 0 (bit cleared) is the victim.
    r = SieveReplacer(6)
    one_by_one(r, [0, 1, 2, 3])
    r.record_access([0])
    r.record_access([2])
    assert r.evict() == 1
    assert r.debug_order() == [0, 2, 3] and r.debug_hand() == 2
    r.record_access([4])
    assert r.evict() == 3
    assert r.debug_hand() == 4
    assert r.evict() == 4
    assert r.debug_hand() is None
    assert r.evict() == 0
    assert r.evict() == 2
    assert r.evict() is None


def test_sieve_hit_does_not_move_but_lru_does():
    # Scenario: the same accesses, SIEVE against LRU: a hit on the oldest block keeps it for one
    # pass in both, but SIEVE keeps insertion order (the next new block is judged before it).
    s, lru = SieveReplacer(4), LruReplacer(4)
    for r in (s, lru):
        one_by_one(r, [0, 1, 2])
        r.record_access([0])
    assert [s.evict(), s.evict(), s.evict()] == [1, 2, 0]
    assert [lru.evict(), lru.evict(), lru.evict()] == [1, 2, 0]
    for r in (s, lru):
        one_by_one(r, [0, 1])
        r.record_access([0])
        r.record_access([2])
    assert s.evict() == 1  # 0's bit saves it, 1 goes
    assert lru.evict() == 1


# ---------------------------------------------------------------- S3-FIFO


def test_s3fifo_ghost_hit_goes_to_main():
    # Scenario: c = 10, so S holds 1 and G up to 9 ids. a is evicted from S unseen again (to G);
    # when a comes back into another frame it enters M directly, and G forgets it.
    r = S3FifoReplacer(12, capacity_frames=10)
    assert (r.small_frames, r.ghost_limit) == (1, 9)
    one_by_one(r, [0, 1], ["a", "b"])
    assert r.evict() == 0
    assert r.debug_queues() == ([1], [], ["a"])
    r.record_access([5], ids=["a"])
    assert r.debug_queues() == ([1], [5], [])


def test_s3fifo_accessed_small_block_moves_to_main_and_main_reinserts():
    # Scenario: b is hit while in S, so S's eviction moves it to M (freq reset) and evicts the
    # next S block c instead; in M, a block with freq > 0 is reinserted once per unit of freq.
    r = S3FifoReplacer(12, capacity_frames=10)
    one_by_one(r, [1, 2], ["b", "c"])
    r.record_access([1])  # b: freq 1
    assert r.evict() == 2  # b moved to M, c (freq 0) evicted to G
    assert r.debug_queues() == ([], [1], ["c"])
    r.record_access([2], ids=["c"])  # ghost hit: M = [b, c]
    r.record_access([2])  # c: freq 1
    assert r.evict() == 1  # S is empty: M's tail b has freq 0 and goes
    assert r.evict() == 2  # c was reinserted once (freq 1 -> 0), then goes
    assert r.evict() is None


# ---------------------------------------------------------------- 2Q


def test_2q_a1out_promotes_and_a1in_hits_do_nothing():
    # Scenario: c = 8: Kin = 2, Kout = 4. A1in overflows, so its oldest (a) is paged out to
    # A1out; a referenced again enters Am. A hit in A1in (b) does not move b.
    r = TwoQReplacer(10, capacity_frames=8)
    assert (r.kin_frames, r.kout_ids) == (2, 4)
    one_by_one(r, [0, 1, 2], ["a", "b", "c"])
    assert r.evict() == 0
    assert r.debug_queues() == ([1, 2], ["a"], [])
    r.record_access([5], ids=["a"])
    r.record_access([1])
    assert r.debug_queues() == ([1, 2], [], [5])
    # A1in is at Kin, not above: the victim is Am's LRU block, which leaves no ghost
    assert r.evict() == 5
    assert r.debug_queues() == ([1, 2], [], [])
    r.record_access([3], ids=["d"])  # A1in above Kin again: b, its oldest, goes to A1out
    assert r.evict() == 1
    assert r.debug_queues() == ([2, 3], ["b"], [])


def test_2q_a1out_is_bounded():
    r = TwoQReplacer(10, capacity_frames=8)
    one_by_one(r, range(8), "abcdefgh")
    assert [r.evict() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    assert r.debug_queues()[1] == ["c", "d", "e", "f"]  # Kout = 4: a and b forgotten


# ---------------------------------------------------------------- LIRS


def test_lirs_ghost_hit_becomes_lir_and_stack_prunes():
    # Scenario: c = 3: one HIR frame, two LIR. A and B fill the LIR set; C and D enter as HIR.
    # C, evicted while in S, stays there as a ghost; C coming back is a ghost hit, so it becomes
    # LIR and A, the bottom LIR, becomes HIR. Touching B (now the bottom) prunes the HIR entry D
    # off the bottom of S; D stays resident in Q.
    r = LirsReplacer(5, capacity_frames=3)
    assert (r.lir_frames, r.hir_frames) == (2, 1)
    one_by_one(r, [0, 1, 2, 3], "ABCD")
    assert r.debug_stack() == [0, 1, 2, 3] and r.debug_queue() == [2, 3] and r.debug_lir() == [0, 1]
    assert r.evict() == 2
    assert r.debug_stack() == [0, 1, ("C",), 3]
    r.record_access([2], ids=["C"])
    assert r.debug_stack() == [1, 3, 2] and r.debug_queue() == [3, 0] and r.debug_lir() == [1, 2]
    r.record_access([1])  # B: the bottom LIR goes to the top; D is pruned off the bottom
    assert r.debug_stack() == [2, 1] and r.debug_queue() == [3, 0]
    r.record_access([3])  # D, HIR not in S: top of S, end of Q, still HIR
    assert r.debug_stack() == [2, 1, 3] and r.debug_queue() == [0, 3]
    assert r.evict() == 0  # A: not in S, so no ghost
    assert r.debug_stack() == [2, 1, 3]
    r.record_access([3])  # D is in S now: becomes LIR, C (the bottom LIR) becomes HIR
    assert r.debug_lir() == [1, 3] and r.debug_queue() == [2]


def test_lirs_ghosts_are_bounded():
    # Scenario: c = 3 with ghost_factor 1: at most 3 ghosts in S; the oldest is dropped.
    r = LirsReplacer(8, capacity_frames=3, ghost_factor=1)
    one_by_one(r, [0, 1], "AB")  # LIR
    for f, b in zip(range(2, 7), "CDEFG"):
        r.record_access([f], ids=[b])
        assert r.evict() == f
    assert r.debug_stack() == [0, 1, ("E",), ("F",), ("G",)]
    with pytest.raises(InvalidInput, match="ghost_factor"):
        LirsReplacer(4, ghost_factor=-1)


# ---------------------------------------------------------------- LRFU


def test_lrfu_crf_half_life_in_requests():
    # Scenario: half-life 1 request. 0 at t=1 and t=3, 1 at t=2: at t=3 CRF(0) = 1 + 2^-2,
    # CRF(1) = 2^-1, so 1 goes although 0's first reference is the oldest. Frames of one
    # request share its timestamp: a 3-block request ages the others by one tick, not three.
    r = LrfuReplacer(4, half_life_requests=1)
    r.record_access([0])
    r.record_access([1])
    r.record_access([0])
    assert r.debug_crf(0) == pytest.approx(1.25) and r.debug_crf(1) == pytest.approx(0.5)
    r.record_access([2, 3])  # one tick
    assert r.debug_crf(1) == pytest.approx(0.25)
    assert r.debug_crf(2) == r.debug_crf(3) == pytest.approx(1.0)
    assert [r.evict() for _ in range(4)] == [1, 0, 3, 2]  # R3 inside the request


@pytest.mark.parametrize("half_life, victim", [(1e9, 1), (0.01, 0)])
def test_lrfu_spans_lfu_to_lru(half_life, victim):
    # Scenario: 0 referenced twice, then 1 once. A huge half-life is LFU (1 goes), a tiny one
    # LRU (0, the least recent, goes).
    r = LrfuReplacer(2, half_life_requests=half_life)
    r.record_access([0])
    r.record_access([0])
    r.record_access([1])
    assert r.evict() == victim


def test_lrfu_keeps_history_of_evicted_blocks():
    # Scenario: a is evicted with CRF about 1; back in another frame it continues from its
    # history (about 2), where a new block z starts at 1. remove() keeps no history.
    r = LrfuReplacer(4, half_life_requests=1000)
    r.record_access([0], ids=["a"])
    r.record_access([1], ids=["b"])
    r.record_access([1], ids=["b"])
    assert r.evict() == 0
    r.record_access([2], ids=["a"])
    r.record_access([3], ids=["z"])
    assert r.debug_crf(2) == pytest.approx(2 ** (-4 / 1000) + 2 ** (-1 / 1000))  # refs at t=1, 4; now 5
    assert r.debug_crf(3) == pytest.approx(1.0)
    r.remove(3)
    r.record_access([3], ids=["z"])
    assert r.debug_crf(3) == pytest.approx(1.0)
    with pytest.raises(InvalidInput, match="half_life_requests"):
        LrfuReplacer(2, half_life_requests=0)


# ---------------------------------------------------------------- W-TinyLFU


def test_wtinylfu_rejects_one_hit_wonder():
    # Scenario: c = 10 (window 1, main 9). Ten blocks seen twice each fill the cache; a block
    # seen once (w) loses its duel with the main cache's victim and is evicted, where LRU would
    # have evicted the old block 0. A block seen three times (v) wins its duel.
    r = WTinyLfuReplacer(13, capacity_frames=10)
    assert (r.window_frames, r.main_frames, r.protected_frames) == (1, 9, 7)
    for f in range(10):
        r.record_access([f], ids=[f"x{f}"])
        r.record_access([f], ids=[f"x{f}"])
    r.record_access([10], ids=["w"])
    assert r.evict() == 9  # 0..8 moved into the empty main cache; x9 ties with x0 and loses
    assert r.debug_segments() == ([10], list(range(9)), [])
    r.record_access([11], ids=["w2"])
    assert r.evict() == 10  # the one-hit wonder w loses to x0 (seen twice)
    for _ in range(3):
        r.record_access([11], ids=["w2"])
    r.record_access([12], ids=["v"])
    assert r.evict() == 0  # w2 (seen 4 times) beats x0 and enters probation
    assert r.debug_segments() == ([12], [1, 2, 3, 4, 5, 6, 7, 8, 11], [])


def test_wtinylfu_probation_hit_promotes_and_protected_overflow_demotes():
    # Scenario: c = 5 (window 1, main 4 = probation + protected 3). Six blocks seen once: 0..3
    # move into the empty main cache, then 4 ties with 0 and loses. Hits in probation promote
    # to protected; the fourth promotion pushes protected's least recent (0) back.
    r = WTinyLfuReplacer(6, capacity_frames=5)
    one_by_one(r, range(6))
    assert r.evict() == 4
    assert r.debug_segments() == ([5], [0, 1, 2, 3], [])
    for f in range(4):
        r.record_access([f])
    assert r.debug_segments() == ([5], [0], [1, 2, 3])
