"""The plans: the planner's engine API on the Db, and the engine carrying out the plan.

Parts of the class ``kvdb.db.core.Db``, one module per invariant family: ``sessions`` (the
calls: begin_session, hint, call_started, call_finished, end_session, explain, run_plans),
``chains`` (agent chains, private blocks), ``waits`` (tool waits, E1-E4), ``prefixes``
(shared prefixes, X1-X3), ``expiry`` (idle expiry, S1-S3).
"""

from kvdb.db.plans.sessions import PlansMixin

__all__ = ["PlansMixin"]
