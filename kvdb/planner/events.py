"""Runtime events the planner (and the simulator) feed to policies through ``on_event``.

Order for one call: ``CallStarted`` (before its blocks are looked up), then the replacer's
``record_access`` with the call's frames, then ``CallFinished``. Policies that do not plan
ignore all of them (Replacer.on_event is a no-op by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdb.planner.workflow import Workflow


@dataclass(frozen=True)
class SessionBegan:
    session_id: str
    now_s: float
    tenant: str | None = None
    workflow: Workflow | None = None


@dataclass(frozen=True)
class CallStarted:
    session_id: str | None
    now_s: float
    node_id: str | None = None
    agent_id: str | None = None
    hints: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallFinished:
    session_id: str | None
    now_s: float
    node_id: str | None = None
    agent_id: str | None = None
    hints: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionEnded:
    session_id: str
    now_s: float


@dataclass(frozen=True)
class HintGiven:
    """Hints that arrived between calls (engine API ``Planner.hint``); already validated."""

    session_id: str
    now_s: float
    hints: dict[str, Any] = field(default_factory=dict)
