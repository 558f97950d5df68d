"""The planner's engine-side API: sessions, hints, workflow progress, EXPLAIN.

A Db holds one ``Planner`` and delegates to it (the simulator does the very same, so a
replay exercises this code path):

    planner = Planner(replacers=[device_replacer, host_replacer])
    planner.begin_session("s1", tenant="acme", workflow=[{"id": "a", "agent_id": "x"}])
    ctx, outcomes = planner.call_started("s1", node_id="a", hints={...})
    replacer.record_access(frames, keys, ctx)          # the Db's lookup of the call's blocks
    planner.call_finished("s1", node_id="a")
    planner.hint("s1", expected_tool_duration_s=30)    # -> [HintOutcome, ...]
    planner.end_session("s1")

Session states (a session id can be reused after it ended)::

    (unknown) --begin_session--> OPEN --end_session--> (unknown)
                                  |
                                  +--expire_session (idle: the Db's mover, kvdb/db/plans/expiry.py)--> (unknown)
    call_started / call_finished / hint on an unknown id: NotFound, except call_started,
    which opens the session implicitly (Mooncake traces carry no session lines).
    An expired session is an ended one (the same ``SessionEnded`` event); the planner only
    remembers the last ``EXPIRED_KEPT`` expired ids so that NotFound can say why.

Activity: ``Session.last_active_s`` is the time of the session's latest begin_session /
call_started / call_finished / hint (and, set by the Db through ``touch``, of a lookup or
put in its context); ``Session.ttl_s`` its latest usable ``ttl_s`` hint, session or call.

Every method takes ``now_s`` (seconds, monotone); None reads the planner's clock.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvdb.buffer_pool.replacer import AccessContext, Replacer
from kvdb.errors import InvalidInput, NotFound
from kvdb.keys import check_tenant
from kvdb.planner.events import CallFinished, CallStarted, HintGiven, SessionBegan, SessionEnded
from kvdb.planner.hints import HintOutcome, check_hints
from kvdb.planner.workflow import Workflow

EXPIRED_KEPT = 1024  # expired ids remembered for NotFound's message (a bounded record, not state)


@dataclass
class CallContext(AccessContext):
    """The AccessContext of one call from ``call_started``: also names the agent and node, so
    the engine can tell which agent's chain the call's blocks form (kvdb/db/plans/chains.py)."""

    agent_id: str | None = None
    node_id: str | None = None


@dataclass
class Session:
    session_id: str
    tenant: str | None
    workflow: Workflow | None
    opened_s: float
    hints: dict[str, Any] = field(default_factory=dict)  # latest accepted/clipped values
    num_calls: int = 0
    last_active_s: float = 0.0  # latest activity (see the module doc), on the planner's time base
    ttl_s: float | None = None  # latest usable ttl_s hint (session or call), seconds


def as_workflow(session_id: str, workflow: Any) -> Workflow | None:
    """Accept a Workflow, a list of node dicts or {"nodes": [...]}; validate (W1, W2)."""
    if workflow is None:
        return None
    if isinstance(workflow, Workflow):
        return workflow.fresh()  # replays of one parsed trace must not share progress
    if isinstance(workflow, Mapping):
        if "nodes" not in workflow:
            raise InvalidInput(f"session {session_id!r}: a workflow object needs 'nodes'")
        workflow = workflow["nodes"]
    return Workflow.from_spec(session_id, workflow, where=f"session {session_id!r}")


def check_now(now_s: Any) -> float:
    """A caller's ``now_s``: a finite number of seconds; InvalidInput otherwise."""
    if isinstance(now_s, bool) or not isinstance(now_s, (int, float)):
        raise InvalidInput(f"now_s must be a number of seconds or None (the clock), got {type(now_s).__name__}")
    try:
        t = float(now_s)
    except OverflowError:
        t = math.inf
    if not math.isfinite(t):
        raise InvalidInput(f"now_s must be a finite number of seconds, got {now_s!r:.40}")
    return t


def check_session_args(session_id: Any, tenant: Any = None, *, optional: bool = False, **ids: Any) -> None:
    """A session id (a non-empty string; None too when ``optional``), a tenant (None or a key
    space's tenant: kvdb/keys.py ``check_tenant``) and ``ids`` (``agent_id``, ``node_id``: None
    or a non-empty string); InvalidInput before anything changes."""
    if not (optional and session_id is None) and (not isinstance(session_id, str) or not session_id):
        raise InvalidInput(f"a session id must be a non-empty string, got {session_id!r}")
    if tenant is not None:
        check_tenant(tenant)
    for name, v in ids.items():
        if v is not None and (not isinstance(v, str) or not v):
            raise InvalidInput(f"{name} must be a non-empty string or None, got {v!r}")


class Planner:
    def __init__(self, replacers: Iterable[Replacer] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self._replacers: list[Replacer] = list(replacers)
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, float] = OrderedDict()  # id -> when it expired (EXPIRED_KEPT)
        self.outcome_counts = {"accepted": 0, "clipped": 0, "rejected": 0}

    def attach(self, replacer: Replacer) -> None:
        self._replacers.append(replacer)

    def _now(self, now_s: float | None) -> float:
        return self._clock() if now_s is None else check_now(now_s)

    def now(self, now_s: float | None = None) -> float:
        """``now_s`` when given, else the planner's clock (the engine's time base)."""
        return self._now(now_s)

    def _emit(self, event: Any) -> None:
        for r in self._replacers:
            r.on_event(event)

    def get_session(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            pass
        if session_id in self._expired:
            raise NotFound(f"session {session_id!r} expired (idle past session_idle_s) and was ended at "
                           f"{self._expired[session_id]:.3f} s; begin_session (or call_started) opens it afresh")
        raise NotFound(f"no open session {session_id!r}; call begin_session first")

    def is_expired(self, session_id: str) -> bool:
        """The id's latest session expired (among the last ``EXPIRED_KEPT``) and none is open."""
        return session_id in self._expired and session_id not in self._sessions

    def touch(self, session: Session, now_s: float | None = None) -> None:
        """A lookup or put in the session's context: activity (O(1))."""
        session.last_active_s = self._now(now_s)

    def find_session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def begin_session(self, session_id: str, *, tenant: str | None = None, workflow: Any = None,
                      now_s: float | None = None) -> Session:
        check_session_args(session_id, tenant)
        if session_id in self._sessions:
            raise InvalidInput(f"session {session_id!r} is already open; end it before reusing the id")
        wf = as_workflow(session_id, workflow)
        now = self._now(now_s)
        s = Session(session_id, tenant, wf, now, last_active_s=now)
        self._sessions[session_id] = s
        self._expired.pop(session_id, None)
        self._emit(SessionBegan(session_id, now, tenant, wf))
        return s

    def _record(self, outcomes: Sequence[HintOutcome]) -> None:
        for o in outcomes:
            self.outcome_counts[o.status] += 1

    def check_call_hints(self, hints: Mapping[str, Any]) -> list[HintOutcome]:
        """Validate and count hints that come with a call's end (``call_finished``)."""
        _, outcomes = check_hints(hints)
        self._record(outcomes)
        return outcomes

    def revise(self, old: HintOutcome, new: HintOutcome) -> None:
        """The engine changed a hint's outcome after looking at it (an unknown prefix_hash is
        clipped): the counts follow."""
        self.outcome_counts[old.status] -= 1
        self.outcome_counts[new.status] += 1

    def hint(self, session_id: str, *, now_s: float | None = None, **hints: Any) -> list[HintOutcome]:
        """Advisory hints between calls; each gets an outcome (accepted / clipped / rejected)."""
        now = self._now(now_s)
        s = self.get_session(session_id)
        usable, outcomes = check_hints(hints)
        self._record(outcomes)
        s.hints.update(usable)
        s.last_active_s = now
        if "ttl_s" in usable:
            s.ttl_s = float(usable["ttl_s"])
        if usable:
            self._emit(HintGiven(session_id, now, usable))
        return outcomes

    def call_started(self, session_id: str | None, *, node_id: str | None = None, agent_id: str | None = None,
                     tenant: str | None = None, hints: Mapping[str, Any] | None = None,
                     positions: Sequence[int] | None = None,
                     now_s: float | None = None) -> tuple[AccessContext, list[HintOutcome]]:
        """A call arrived: returns the AccessContext for the replacer and the hint outcomes.
        Every argument is checked before anything changes (no session opened, nothing counted)."""
        now = self._now(now_s)
        check_session_args(session_id, tenant, optional=True, agent_id=agent_id, node_id=node_id)
        usable, outcomes = check_hints(hints or {})
        s = None if session_id is None else self._sessions.get(session_id)
        if s is not None and node_id is not None and s.workflow is not None and node_id not in s.workflow.nodes:
            raise InvalidInput(f"session {session_id!r}: node {node_id!r} is not in its declared workflow")
        self._record(outcomes)
        if session_id is not None:
            if s is None:
                s = self.begin_session(session_id, tenant=tenant, now_s=now)
            s.num_calls += 1
            s.last_active_s = now
            if "ttl_s" in usable:
                s.ttl_s = float(usable["ttl_s"])
            if node_id is not None and s.workflow is not None:
                if agent_id is None:
                    agent_id = s.workflow.nodes[node_id].agent_id
            tenant = tenant if tenant is not None else s.tenant
        self._emit(CallStarted(session_id, now, node_id, agent_id, usable))
        ctx = CallContext(now_s=now, session_id=session_id, tenant=tenant, positions=positions, hints=usable,
                          agent_id=agent_id, node_id=node_id)
        return ctx, outcomes

    def call_finished(self, session_id: str | None, *, node_id: str | None = None, agent_id: str | None = None,
                      hints: Mapping[str, Any] | None = None, now_s: float | None = None) -> None:
        now = self._now(now_s)
        check_session_args(session_id, optional=True, agent_id=agent_id, node_id=node_id)
        if session_id is not None:
            s = self._sessions.get(session_id)
            if s is not None:
                s.last_active_s = now
                if hints and "ttl_s" in hints:
                    s.ttl_s = float(hints["ttl_s"])
            if s is not None and node_id is not None and s.workflow is not None and node_id in s.workflow.nodes:
                s.workflow.mark_done(node_id, now)
        self._emit(CallFinished(session_id, now, node_id, agent_id, dict(hints or {})))

    def end_session(self, session_id: str, *, now_s: float | None = None) -> None:
        now = self._now(now_s)
        self.get_session(session_id)
        del self._sessions[session_id]
        self._emit(SessionEnded(session_id, now))

    def expire_session(self, session_id: str, *, now_s: float | None = None) -> None:
        """End an idle session exactly as ``end_session`` does, and remember that it expired."""
        self.end_session(session_id, now_s=now_s)
        self._expired[session_id] = self._now(now_s)
        self._expired.move_to_end(session_id)
        while len(self._expired) > EXPIRED_KEPT:
            self._expired.popitem(last=False)

    def explain(self, workflow: Mapping[str, Any]) -> dict[str, Any]:
        """The EXPLAIN tree for a workflow spec (kvdb.planner.explain documents it)."""
        from kvdb.planner.explain import explain

        return explain(workflow)

    def workflow_of(self, session_id: str) -> Workflow | None:
        s = self._sessions.get(session_id)
        return None if s is None else s.workflow

