"""The planner: workflows, hints, session events, policies and EXPLAIN (pure: no I/O).

The engine holds a ``Planner`` (kvdb.planner.sessions) and builds its replacers with
``make_policy``; the simulator (kvdb/sim/) drives the same objects.
"""

from kvdb.planner.hints import HintOutcome, check_hint, check_hints
from kvdb.planner.policies import POLICIES, make_policy
from kvdb.planner.sessions import Planner, Session
from kvdb.planner.workflow import Node, Workflow

__all__ = ["HintOutcome", "Node", "POLICIES", "Planner", "Session", "Workflow", "check_hint", "check_hints",
           "make_policy"]
