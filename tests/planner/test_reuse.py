"""The hint-less reuse estimator (kvdb.planner.policies.reuse) and its use by the kvdb policy."""

from __future__ import annotations

import json
import math

import pytest

from kvdb.planner.policies import make_policy
from kvdb.planner.policies.reuse import EPOCH, ReuseEstimator
from kvdb.sim.replay import replay
from kvdb.sim.trace import parse_trace


def test_history_keeps_counts_of_evicted_blocks_fifo():
    assert (ReuseEstimator(1000).capacity, ReuseEstimator(10 ** 6).capacity) == (32000, 1 << 18)
    est = ReuseEstimator(2, history_mult=2)  # 4 ids
    for i, bid in enumerate("abcde"):
        est.remember(bid, i + 1, float(i))
    assert len(est) == 4
    assert est.recall("a", 10.0) == 0  # the oldest id fell out
    assert est.recall("c", 10.0) == 3 and est.recall("c", 11.0) == 0  # recalled once, then resident
    est.remember("b", 7, 12.0)  # re-remembered: moves to the young end
    est.remember("f", 1, 13.0)
    est.remember("g", 1, 14.0)
    assert est.recall("d", 15.0) == 0 and est.recall("b", 15.0) == 7


@pytest.mark.parametrize("tc, alpha", [
    (10.0, 3.0),  # the cache keeps blocks far shorter than they take to return: steep
    (50.0, 1.0 + 2 ** (26.5 / 4) / 50.0 - 1.5),  # in between
    (200.0, 1.0),  # it keeps them about as long: counts weigh linearly
    (math.inf, 1.0),  # nothing evicted yet: unchanged
])
def test_alpha_from_median_gap_over_tc(tc, alpha):
    est = ReuseEstimator(4)
    for _ in range(EPOCH - 1):
        est.observe_gap(100.0)  # quarter-octave bin 27: [2^6.5, 2^6.75)
    assert not est.epoch_due()
    est.observe_gap(0.25)
    assert est.epoch_due()
    est.update(tc)
    assert not est.epoch_due()
    assert est.median_gap_s == 2 ** (26.5 / 4)
    assert est.alpha == pytest.approx(alpha, abs=1e-12)
    assert est.value(100, 64) == pytest.approx(64 ** alpha)


def test_kvdb_recalls_a_block_count_after_many_evictions():
    r = make_policy("kvdb", 4)
    for _ in range(3):
        r.record_access([0], ["hot"])
    assert r.debug_value(0) == 3.0
    assert r.evict() == 0
    for i in range(60):  # 60 other ids pass through: 15 times the frames, under the history
        r.record_access([1 + i % 3], [f"x{i}"])
        if r.num_evictable() > 2:
            r.evict()
    r.record_access([0], ["hot"])
    assert r.debug_value(0) == 4.0


def _trace(calls):
    return parse_trace("\n".join(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(h),
                                              "output_length": 1, "hash_ids": h})
                                  for i, h in enumerate(calls)))


def test_kvdb_keeps_a_chain_it_remembers_across_long_scans():
    # a chain used twice 2 calls apart, then 10 one-shot calls (30 ids: 4x the frames) before it
    # returns; 5 blocks of cache. Its count survives the scans, so it is kept across the short
    # gaps (3 hits each: its last block is a call's last block, value 0); a ghost table of one
    # cache's worth forgot it and got 16 hits, LRU none.
    calls, nxt = [], 100
    for _ in range(10):
        for gap in (2, 10):
            calls.append([0, 1, 2, 3])
            for _ in range(gap):
                calls.append([nxt, nxt + 1, nxt + 2])
                nxt += 3
    t = _trace(calls)
    assert (replay(t, "lru", 5).hits, replay(t, "kvdb", 5).hits) == (0, 49)


def test_first_access_value_learns_which_call_lengths_come_back():
    assert [ReuseEstimator.klass(b) for b in (1, 2, 3, 64, 10 ** 6)] == [0, 4, 6, 24, 47]
    est = ReuseEstimator(1, history_mult=1)  # one id of history
    for i in range(10):  # blocks first seen in 4-block calls (class 8) all come back
        est.remember(("a", i), 1, 0.0, ReuseEstimator.klass(4))
        assert est.recall(("a", i), 1.0) == 1
    for i in range(11):  # blocks of 8-block calls (class 12) are forgotten unseen
        est.remember(("b", i), 1, 0.0, ReuseEstimator.klass(8))
    est.remember(("c", 0), 2, 0.0)  # not a first-seen block: no class, pushes b10 out
    assert [est.first_value(k) for k in (8, 12, 20)] == [1.0, 1.0, 1.0]  # nothing learned yet
    est.update(math.inf)
    # P = 10 / 21 overall; each class's rate is pulled to it by 20 pseudo-observations
    p = 10 / 21
    assert est.first_value(8) == pytest.approx((10 + 20 * p) / 30 / p)
    assert est.first_value(12) == pytest.approx((20 * p) / 31 / p)
    assert est.first_value(20) == pytest.approx(1.0)
