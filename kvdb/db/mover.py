"""The Db's background mover: one thread that runs page moves in order, and a heap of timers.

Two kinds of work, both run on the one thread (so moves never race each other):

* **jobs** (``submit``): prefetch / offload / make-room requests; run in submission order.
* **timers** (``schedule``): jobs with a due time on the Db's clock -- the planner's prefetch
  deadlines and the sessions' idle-expiry checks (kvdb/db/plans/expiry.py). A cancelled timer
  never runs. Each timer has a ``kind`` (``"plan"``, ``"expiry"``) so that the stats can
  count them apart (``count_timers``).

Order: everything in clock order. A job counts as due when it was submitted; a timer once its
due time has come; the earliest due goes first (a job submitted before a deadline runs before
that deadline's timer, one submitted at or after it runs after: so ``run_due`` sees every
timer due by its call run).

Why one thread with a heap rather than a thread (or a ``threading.Timer``) per session: an
engine holds thousands of waiting agents, and a move must never overlap another move of the
same pages. The thread sleeps until the earliest due time, but at most ``MAX_SLEEP_S``: the
clock may be injected (tests, the demo's virtual clock) and jump without telling anyone;
``poke`` wakes it at once and ``run_due`` waits until everything due has run.

Lock order: ``_cv`` guards the queue and the heap only and is never held while a job runs,
so jobs may take the Db's lock (and submit or schedule more work) freely. ``Timer.cancel``
takes ``_cv`` too (it is reentrant), so a cancel and the mover starting that timer cannot
both win: a cancel that returns True means the job never runs.

Cancelled timers (I1): a cancelled timer stays in the heap (removing from the middle of a heap
is O(n)) but is counted; once the cancelled entries outnumber the live ones the heap is
rebuilt without them (checked after a cancel and after a live timer leaves). So the heap holds
at most ``2 * live`` entries however often the planner reschedules a deadline (rejected: popping cancelled entries only when they reach the
top -- a far-future deadline rescheduled a million times left a million dead entries).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from kvdb.errors import KvdbError

MAX_SLEEP_S = 0.5


class Timer:
    """A handle to a scheduled job; ``cancel()`` is idempotent and safe from any thread."""

    __slots__ = ("_mover", "args", "cancelled", "due_s", "fn", "kind", "ran")

    def __init__(self, due_s: float, fn: Callable, args: tuple, kind: str = "plan") -> None:
        self.due_s = due_s
        self.fn = fn
        self.args = args
        self.kind = kind
        self.cancelled = False
        self.ran = False
        self._mover: Mover | None = None  # the mover whose heap holds this timer; None once out of it

    def cancel(self) -> bool:
        """True when the job will not run (it had not started)."""
        mover = self._mover
        if mover is None:
            if self.ran:
                return False
            self.cancelled = True
            return True
        return mover._cancel(self)


class Mover:
    def __init__(self, clock: Callable[[], float], name: str = "kvdb-mover") -> None:
        self._clock = clock
        self._cv = threading.Condition()
        self._jobs: deque[tuple[float, Callable, tuple, Future]] = deque()  # (submitted at, ...)
        self._timers: list[tuple[float, int, Timer]] = []
        self._num_cancelled = 0  # cancelled timers still in _timers (I1)
        self._seq = itertools.count()
        self._closed = False
        self.failed_timers = 0  # timer jobs that raised (they have no waiter to tell)
        self.last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise KvdbError("the Db is closed: its background mover is shut down")
            self._jobs.append((self._clock(), fn, args, fut))
            self._cv.notify()
        return fut

    def schedule(self, due_s: float, fn: Callable, *args: Any, kind: str = "plan") -> Timer:
        t = Timer(float(due_s), fn, args, kind)
        with self._cv:
            if self._closed:
                t.cancelled = True
                return t
            t._mover = self
            heapq.heappush(self._timers, (t.due_s, next(self._seq), t))
            self._cv.notify()
        return t

    def poke(self) -> None:
        """The clock may have moved: look at the timers now."""
        with self._cv:
            self._cv.notify()

    def run_due(self) -> None:
        """Wait until every timer due by now and every job submitted before this call ran."""
        if threading.current_thread() is self._thread:
            return  # called from a job: it cannot wait for itself
        self.submit(_nothing).result()

    def _cancel(self, t: Timer) -> bool:
        with self._cv:
            if t.ran:
                return False
            if not t.cancelled:
                t.cancelled = True
                if t._mover is self:  # still in the heap
                    self._num_cancelled += 1
                    if 2 * self._num_cancelled > len(self._timers):
                        self._compact()
            return True

    def _compact(self) -> None:
        """Drop the cancelled timers from the heap (I1). Caller holds ``_cv``."""
        live = []
        for entry in self._timers:
            if entry[2].cancelled:
                entry[2]._mover = None
            else:
                live.append(entry)
        heapq.heapify(live)
        self._timers = live
        self._num_cancelled = 0

    @property
    def num_timers(self) -> int:
        with self._cv:
            return len(self._timers) - self._num_cancelled

    @property
    def debug_heap_entries(self) -> int:
        """Entries in the timer heap, cancelled ones included (I1 bounds it)."""
        with self._cv:
            return len(self._timers)

    def count_timers(self, kind: str) -> int:
        """Pending (not cancelled, not yet run) timers of one kind."""
        with self._cv:
            return sum(1 for _, _, t in self._timers if not t.cancelled and t.kind == kind)

    def _next(self) -> tuple[Callable, tuple, Future | None] | None:
        with self._cv:
            while True:
                while self._timers and self._timers[0][2].cancelled:
                    heapq.heappop(self._timers)[2]._mover = None
                    self._num_cancelled -= 1
                now = self._clock()
                if self._timers and self._timers[0][0] <= now and (not self._jobs
                                                                    or self._timers[0][0] <= self._jobs[0][0]):
                    t = heapq.heappop(self._timers)[2]
                    t.ran = True
                    t._mover = None
                    if 2 * self._num_cancelled > len(self._timers):
                        self._compact()
                    return t.fn, t.args, None
                if self._jobs:
                    return self._jobs.popleft()[1:]
                if self._closed:
                    return None
                wait = MAX_SLEEP_S
                if self._timers:
                    wait = min(wait, max(0.0, self._timers[0][0] - now))
                self._cv.wait(wait)

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            fn, args, fut = item
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue
            try:
                r = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter; timers have none
                if fut is not None:
                    fut.set_exception(e)
                else:
                    self.failed_timers += 1
                    self.last_error = e
            else:
                if fut is not None:
                    fut.set_result(r)

    def shutdown(self, wait: bool = True) -> None:
        """Run the queued jobs, drop the timers, stop the thread."""
        with self._cv:
            self._closed = True
            for _, _, t in self._timers:
                t.cancelled = True
                t._mover = None
            self._timers.clear()
            self._num_cancelled = 0
            self._cv.notify()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()


def _nothing() -> None:
    return None
