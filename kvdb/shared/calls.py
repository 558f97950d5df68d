"""Every pool call under kvdb's own deadline, on a fixed set of workers, behind a circuit breaker.

The Store's client never raises; against a dead master some calls stall ~4.3 s whatever its
own timeout says. So no kvdb thread calls it directly (docs/shared.md S8):

* ``Calls.run(fn)`` hands ``fn`` to one of ``workers`` threads (started on first use, never more)
  and waits at most ``deadline_s``. A call still running then is left to finish on its worker
  (it keeps that worker, and whatever memory ``fn`` uses, until it returns: ``on_late`` runs
  then) and the caller gets ``LATE``. When every worker is busy the caller gets ``BUSY`` at once:
  callers never queue behind stuck calls, and stuck calls never make more threads.
* The breaker: ``LATE`` opens it at once, and so do ``TRIP_AFTER`` failures in a row
  (``fail()``: a call whose codes say the pool is unreachable). While open every ``run`` is
  ``OPEN`` without a call, and once every ``probe_s`` one ``probe`` call runs (in the
  background, on a worker); its success closes the breaker. The probe interval doubles up to
  ``MAX_PROBE_S`` while probes fail.

States
      closed ──LATE, or TRIP_AFTER failures──> open ──probe_s──> probing ──probe ok──> closed
                                                 ^──────────────probe failed──────────┘
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

OK, LATE, BUSY, OPEN = "ok", "late", "busy", "open"
TRIP_AFTER = 3
PROBE_S = 0.5
MAX_PROBE_S = 4.0


class _Job:
    __slots__ = ("fn", "on_done", "done", "result", "error", "abandoned", "finished")

    def __init__(self, fn, on_done) -> None:
        self.fn, self.on_done = fn, on_done
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self.abandoned = False  # its caller gave up at the deadline: on_done is the worker's to run
        self.finished = False


class Calls:
    def __init__(self, workers: int, deadline_s: float, probe: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic, name: str = "kvdb-shared") -> None:
        self.workers = workers
        self.deadline_s = deadline_s
        self._probe_fn = probe
        self._clock = clock
        self._name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._mu = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self.state = "closed"  # closed / open / probing
        self._fails = 0
        self._probe_s = PROBE_S
        self._next_probe = 0.0
        self.counts = {"calls": 0, "late": 0, "busy": 0, "refused": 0, "failures": 0, "trips": 0, "probes": 0}

    # ------------------------------------------------------------------ workers

    def _worker(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                job.error = e
            with self._mu:
                job.finished = True
                late = job.abandoned
            job.done.set()
            if late and job.on_done is not None:
                try:
                    job.on_done()
                except Exception:  # noqa: BLE001 - a release must not kill the worker
                    pass
            with self._mu:
                self._idle += 1

    def _submit(self, fn, on_done, detached: bool = False) -> _Job | None:
        """Queue ``fn`` for an idle worker (starting one while fewer than ``workers`` run); None
        when every worker is busy or the Calls is closed."""
        with self._mu:
            if self._closed:
                return None
            if self._idle == 0:
                if len(self._threads) >= self.workers:
                    return None
                t = threading.Thread(target=self._worker, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                self._idle += 1
                t.start()
            self._idle -= 1
            job = _Job(fn, on_done)
            job.abandoned = detached
            self._q.put(job)
            return job

    def threads(self) -> int:
        """Worker threads started (never more than ``workers``)."""
        return len(self._threads)

    # ------------------------------------------------------------------ the breaker

    def _allow(self) -> bool:
        with self._mu:
            if self.state == "closed":
                return True
            if self.state == "open" and self._clock() >= self._next_probe:
                self.state = "probing"
                start = True
            else:
                start = False
        if start:
            self._start_probe()
        return False

    def _start_probe(self) -> None:
        self.counts["probes"] += 1
        res: dict = {}

        def probe() -> None:
            res["ok"] = bool(self._probe_fn())

        def done() -> None:
            ok = res.get("ok", False)
            with self._mu:
                if ok:
                    self.state, self._fails, self._probe_s = "closed", 0, PROBE_S
                else:
                    self.state = "open"
                    self._probe_s = min(self._probe_s * 2, MAX_PROBE_S)
                    self._next_probe = self._clock() + self._probe_s

        job = self._submit(probe, done, detached=True)  # nobody waits: its worker reports it
        if job is None:  # every worker stuck: try again later
            with self._mu:
                self.state = "open"
                self._next_probe = self._clock() + self._probe_s

    def trip(self) -> None:
        """Open the breaker (a late call, failures in a row, or a pool not reachable at open)."""
        with self._mu:
            if self.state == "closed":
                self.state = "open"
                self.counts["trips"] += 1
                self._next_probe = self._clock() + self._probe_s

    def fail(self) -> None:
        """A call answered, with codes saying the pool is unreachable."""
        self.counts["failures"] += 1
        self._fails += 1
        if self._fails >= TRIP_AFTER:
            self.trip()

    def succeed(self) -> None:
        self._fails = 0

    # ------------------------------------------------------------------ calls

    def run(self, fn: Callable[[], object], on_late: Callable[[], None] | None = None) -> tuple[str, object]:
        """(OK, fn's result) within the deadline; else (LATE | BUSY | OPEN, None). The memory
        ``fn`` uses stays the caller's to release, but after LATE: then ``fn`` still runs on its
        worker, which calls ``on_late`` once ``fn`` has returned (release it there)."""
        if not self._allow():
            self.counts["refused"] += 1
            return OPEN, None
        job = self._submit(fn, on_late)
        if job is None:
            self.counts["busy"] += 1
            return BUSY, None
        self.counts["calls"] += 1
        if not job.done.wait(self.deadline_s):
            with self._mu:
                late = not job.finished
                job.abandoned = late
            if late:
                self.counts["late"] += 1
                self.trip()
                return LATE, None
        if job.error is not None:
            raise job.error
        return OK, job.result

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the workers: idle ones exit at once; one stuck in a call is left (a daemon) and
        exits when its call returns."""
        with self._mu:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._q.put(None)
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
