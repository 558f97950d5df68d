"""Idle expiry: a session nobody ends is ended by the Db once it has been idle long enough.

Part of the class ``kvdb.db.core.Db`` (a mixin of kvdb/db/plans/; the Db's lock guards it).

Idle expiry (``kvdb.open(..., session_idle_s=)``; None: never)
  S1  a session's *deadline* is the latest of: its last activity (begin_session, call_started,
      call_finished, hint, a lookup or put with its context: ``Session.last_active_s``) +
      ``session_idle_s``; that activity + its latest ``ttl_s`` hint; and, for each agent in a
      planned tool wait, its predicted return R + ``session_idle_s`` (the slack: idle time
      counts from when the agent should have come back).
  S2  at or after its deadline the session is ended exactly as ``end_session`` ends it
      (``_end_session_locked``: timers cancelled, chains dropped, prefix pins released,
      ``SessionEnded`` to the planner) and counted in ``expired_sessions``. Afterwards its id
      is an ended one's: hint / end_session / explain raise NotFound (saying it expired),
      call_started opens a fresh session.
  S3  the cost: activity writes one timestamp (O(1), nothing else per put); a heap holds one
      entry per open session (``(check_s, seq, sid)``; entries of ended sessions are dropped
      lazily, the heap rebuilt when they outnumber the live ones), and one mover timer (kind
      ``"expiry"``) is due at the heap's earliest check. The sweep re-checks a due entry: an
      expired session ends, a live one goes back at its deadline but at most one idle period
      ahead. Why that bound: an entry must never be later than the deadline, and a deadline
      can drop (a wait ends early, a shorter wait or ttl_s replaces a longer one) -- but only
      through activity, which puts it at least an idle period past the sweep. A long wait
      costs one re-check per idle period. No thread of its own.

The bound on open sessions
  S4  at most ``MAX_OPEN_SESSIONS`` sessions are open: the one that opens past it ends the open
      session whose deadline (S1) comes first -- the one expiry would end first -- exactly as
      S2 ends it, counted in ``evicted_sessions``, so ids nobody ends (a client that sends a
      fresh ``session_id`` with every request) cost bounded memory. Finding it walks the heap
      from its top: an entry earlier than its session's deadline goes back at the deadline, so
      the first entry that is due at its own deadline is the earliest of all (every entry is
      at or before its deadline, S3). With ``session_idle_s=None`` (no heap) it is the session
      least recently active, by a scan.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

#: sessions open at once (S4); the oldest by deadline is ended past it
MAX_OPEN_SESSIONS = 16384


class ExpiryMixin:
    def _init_expiry(self) -> None:
        # _session_idle_s is set by Db.__init__ before _open
        self._idle_heap: list[tuple[float, int, str]] = []  # (check at, seq, session id)
        self._idle_entry: dict[str, int] = {}  # open session -> seq of its live heap entry
        self._idle_seq = itertools.count()
        self._idle_timer: Any = None  # the mover timer of the next sweep
        self._idle_stale = 0  # heap entries of sessions that ended before their check

    def _watch_idle(self, sid: str) -> None:
        """A session opened: its first check is one idle period from now (S3)."""
        idle = self._session_idle_s
        if idle is None:
            return
        seq = next(self._idle_seq)
        self._idle_entry[sid] = seq
        heapq.heappush(self._idle_heap, (self._clock() + idle, seq, sid))
        self._arm_idle_timer()

    def _arm_idle_timer(self) -> None:
        heap = self._idle_heap
        if self._idle_stale > 64 and self._idle_stale > len(self._idle_entry):  # S3: drop ended sessions' entries
            live = self._idle_entry
            self._idle_heap = heap = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(heap)
            self._idle_stale = 0
        t = self._idle_timer
        if not heap:
            return
        if t is not None and not t.ran and not t.cancelled and t.due_s <= heap[0][0]:
            return
        if t is not None:
            t.cancel()
        self._idle_timer = self._mover.schedule(heap[0][0], self._expiry_job, kind="expiry")

    def _session_deadline(self, sid: str, s) -> float:
        """S1: when the session expires if nothing happens meanwhile (the Db's time base)."""
        idle = self._session_idle_s
        d = s.last_active_s + max(idle, s.ttl_s or 0.0)
        for plan in self._agents.get(sid, {}).values():
            if plan.return_s is not None:
                d = max(d, plan.return_s + idle)
        return d

    def _expiry_job(self) -> None:
        """The sweep (a mover timer): end each due session that has stayed idle (S2)."""
        with self._lock:
            if self._state != "open":
                return
            now = self._clock()
            heap, live = self._idle_heap, self._idle_entry
            while heap and heap[0][0] <= now:
                _, seq, sid = heapq.heappop(heap)
                if live.get(sid) != seq:
                    self._idle_stale -= 1
                    continue
                s = self.planner.find_session(sid)
                if s is None:  # cannot happen: the Db ends the planner's sessions itself
                    del live[sid]
                    continue
                deadline = self._session_deadline(sid, s)
                if deadline > now:  # at most an idle period ahead: see S3
                    heapq.heappush(heap, (min(deadline, now + self._session_idle_s), seq, sid))
                    continue
                self.planner.expire_session(sid, now_s=now)
                self._end_session_locked(sid)
                self._idle_stale -= 1  # its entry is already out of the heap
                self._plan_stats["expired_sessions"] += 1
            self._idle_timer = None
            self._arm_idle_timer()

    def _bound_sessions(self, opened: str) -> None:
        """S4: a session just opened; past the bound, end the one whose deadline comes first
        (never ``opened`` itself)."""
        if self.planner.num_sessions <= MAX_OPEN_SESSIONS:
            return
        victim = self._first_deadline(opened)
        if victim is None:
            return
        self.planner.expire_session(victim)
        self._end_session_locked(victim)
        self._plan_stats["evicted_sessions"] += 1

    def _first_deadline(self, opened: str) -> str | None:
        heap, live = self._idle_heap, self._idle_entry
        if self._session_idle_s is None:  # no heap: the least recently active, by a scan
            sessions = self.planner._sessions
            others = (sid for sid in sessions if sid != opened)
            return min(others, key=lambda sid: sessions[sid].last_active_s, default=None)
        skipped = []
        try:
            while heap:
                check, seq, sid = heap[0]
                if live.get(sid) != seq:
                    heapq.heappop(heap)
                    self._idle_stale -= 1
                    continue
                s = self.planner.find_session(sid)
                if sid == opened or s is None:
                    skipped.append(heapq.heappop(heap))
                    continue
                deadline = self._session_deadline(sid, s)
                if deadline > check:
                    heapq.heapreplace(heap, (deadline, seq, sid))
                    continue
                return sid
            return None
        finally:
            for e in skipped:
                heapq.heappush(heap, e)
