"""The planner's engine API on the Db: sessions, workflows, hints, call events, EXPLAIN.

A mixin of ``kvdb.db.core.Db``; every method runs under the Db's lock and forwards to its
``Planner`` (kvdb/planner/sessions.py), which informs every tier's replacer.
"""

from __future__ import annotations

from kvdb.planner.hints import HintOutcome


class SessionsMixin:
    def begin_session(self, session_id: str, *, tenant: str | None = None, workflow=None,
                      now_s: float | None = None) -> None:
        """Open an agent session, optionally with its declared workflow (DAG of LLM calls and
        tool waits: a list of ``{"id", "agent_id", "deps"}`` nodes or ``{"nodes": [...]}``)."""
        self._check()
        with self._lock:
            self.planner.begin_session(session_id, tenant=tenant, workflow=workflow, now_s=now_s)

    def hint(self, session_id: str, *, now_s: float | None = None, **hints) -> list[HintOutcome]:
        """Advisory hints (``expected_tool_duration_s``, ``ttl_s``, ``priority``, ``prefix_hash``,
        ``tool``); each comes back accepted, clipped or rejected with the reason."""
        self._check()
        with self._lock:
            return self.planner.hint(session_id, now_s=now_s, **hints)

    def call_started(self, session_id: str | None, *, node_id: str | None = None, agent_id: str | None = None,
                     tenant: str | None = None, hints=None, now_s: float | None = None):
        """An LLM call arrives: returns ``(ctx, hint_outcomes)``; pass ``ctx`` to the call's
        ``match_prefix`` and ``put_blocks`` so the policy knows whose blocks these are."""
        self._check()
        with self._lock:
            return self.planner.call_started(session_id, node_id=node_id, agent_id=agent_id, tenant=tenant,
                                             hints=hints, now_s=now_s)

    def call_finished(self, session_id: str | None, *, node_id: str | None = None, agent_id: str | None = None,
                      hints=None, now_s: float | None = None) -> None:
        self._check()
        with self._lock:
            self.planner.call_finished(session_id, node_id=node_id, agent_id=agent_id, hints=hints, now_s=now_s)

    def end_session(self, session_id: str, *, now_s: float | None = None) -> None:
        self._check()
        with self._lock:
            self.planner.end_session(session_id, now_s=now_s)

    def explain(self, workflow) -> dict:
        """The plan of a workflow spec as a tree (what ``kvdb explain`` prints)."""
        return self.planner.explain(workflow)
