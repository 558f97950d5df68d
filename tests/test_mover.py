"""The Db's background mover (kvdb/db/mover.py): jobs in order, timers by due time on an
injected clock, cancel, shutdown."""

from __future__ import annotations

import threading

import pytest
from helpers import Clock

from kvdb.db.mover import Mover
from kvdb.errors import KvdbError


def test_jobs_run_in_submission_order_and_return_results():
    m = Mover(Clock(0.0))
    try:
        seen = []
        futs = [m.submit(seen.append, i) for i in range(20)]
        assert [f.result(timeout=5) for f in futs] == [None] * 20
        assert seen == list(range(20))
        assert m.submit(lambda a, b: a + b, 2, 3).result(timeout=5) == 5
        with pytest.raises(ZeroDivisionError):
            m.submit(lambda: 1 / 0).result(timeout=5)
        assert m.submit(lambda: "still running").result(timeout=5) == "still running"  # survives a failed job
    finally:
        m.shutdown()


def test_timers_run_when_due_in_due_order_and_cancel():
    # Scenario: timers at 30, 10, 20 and a cancelled one at 5; the clock moves by hand.
    clock = Clock(0.0)
    m = Mover(clock)
    try:
        seen = []
        m.schedule(30.0, seen.append, "c")
        m.schedule(10.0, seen.append, "a")
        m.schedule(20.0, seen.append, "b")
        t = m.schedule(5.0, seen.append, "x")
        assert t.cancel() and m.num_timers == 3
        m.run_due()
        assert seen == []
        clock.t = 20.0  # b is due at this very moment: it runs too
        m.run_due()
        assert seen == ["a", "b"]
        clock.t = 100.0
        m.run_due()
        assert seen == ["a", "b", "c"] and m.num_timers == 0
        done = m.schedule(0.0, seen.append, "late")
        m.run_due()
        assert seen[-1] == "late" and not done.cancel()  # it ran: too late to cancel
        m.schedule(0.0, lambda: 1 / 0)
        m.run_due()
        assert m.failed_timers == 1 and isinstance(m.last_error, ZeroDivisionError)
    finally:
        m.shutdown()


def test_jobs_and_timers_run_in_clock_order_and_shutdown_drops_timers():
    # Scenario: job1 submitted at t=0, a timer due at 1, the clock moves to 2, job2 submitted:
    # job1 (due at 0), the timer (1), job2 (2) -- whatever the order the mover sees them in.
    clock = Clock(0.0)
    m = Mover(clock)
    seen = []
    hold = threading.Event()
    m.submit(hold.wait)
    m.submit(seen.append, "job1")
    m.schedule(1.0, seen.append, "timer")
    clock.t = 2.0
    m.submit(seen.append, "job2")
    hold.set()
    m.run_due()
    assert seen == ["job1", "timer", "job2"]
    t = m.schedule(50.0, seen.append, "never")
    m.submit(seen.append, "queued")
    m.shutdown()
    assert seen[-1] == "queued" and t.cancelled
    with pytest.raises(KvdbError, match="closed"):
        m.submit(seen.append, 1)


def test_cancelled_timers_do_not_pile_up_in_the_heap():
    # Scenario (I1): a planner reschedules one far-future deadline 10 000 times (cancel, then
    # schedule again) next to 3 live timers; the heap never holds more than twice the live timers.
    clock = Clock(0.0)
    m = Mover(clock)
    try:
        seen = []
        for i in range(3):
            m.schedule(1e9 + i, seen.append, f"live{i}")
        t = m.schedule(1e9, seen.append, "moving")
        peak = 0
        for i in range(10_000):
            assert t.cancel()
            assert t.cancel()  # idempotent: counted once
            t = m.schedule(1e9 + 10 + i, seen.append, f"moving{i}")
            peak = max(peak, m.debug_heap_entries)
            assert m.debug_heap_entries <= 2 * m.num_timers
        assert m.num_timers == 4 and m.count_timers("plan") == 4 and peak <= 8
        # Cancel the moving one; the live ones run and nothing is left behind.
        assert t.cancel()
        clock.t = 2e9
        m.run_due()
        assert sorted(seen) == ["live0", "live1", "live2"] and m.num_timers == 0
        assert m.debug_heap_entries == 0
        # A timer that ran cannot be cancelled, and cancelling it leaves the count alone.
        done = m.schedule(0.0, seen.append, "ran")
        m.run_due()
        assert not done.cancel() and m.num_timers == 0 and m.debug_heap_entries == 0
    finally:
        m.shutdown()


def test_cancel_races_with_due_timers_and_the_count_stays_exact():
    # Scenario: 2 000 due timers; another thread cancels every other one while the mover runs
    # them. A cancel that returned True never ran, one that returned False did, and afterwards
    # the heap is empty with no cancelled entry left counted.
    clock = Clock(0.0)
    m = Mover(clock)
    try:
        ran = set()
        timers = [m.schedule(float(i % 7), ran.add, i) for i in range(2000)]
        clock.t = 10.0
        m.poke()
        cancelled = {i for i, t in enumerate(timers) if i % 2 == 0 and t.cancel()}
        m.run_due()
        assert not (cancelled & ran)
        assert ran | cancelled == set(range(2000))
        assert m.num_timers == 0 and m.debug_heap_entries == 0
    finally:
        m.shutdown()
