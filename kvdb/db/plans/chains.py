"""Agent chains: which blocks are an agent's, and which are its alone.

Part of the class ``kvdb.db.core.Db`` (a mixin of kvdb/db/plans/; the Db's lock guards it).

Agent chains
    A call's blocks are the keys of the ``match_prefix`` and ``put_blocks`` made with the
    context ``call_started`` returned (chain order; a put extends the lookup's chain). An
    agent's *chain* is its latest call's. A block is *private* to an agent when no other
    open agent's chain holds it and it is in no protected shared prefix.
    The chains feed the waits (kvdb/db/plans/waits.py: an agent's private blocks are what
    moves down while it waits) and the shared prefixes (prefixes.py: a prefix hash resolves
    through the chains of the session's tenant).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvdb.planner.sessions import CallContext

RECENT_CHAINS = 256  # ended calls' chains kept for resolving prefix hashes


@dataclass(eq=False)  # identity: plans live in sets
class AgentPlan:
    """One (session, agent): its chain and, while it waits, its plan (E1-E3)."""

    session_id: str
    agent_id: str | None
    tenant: str
    chain: list = field(default_factory=list)  # keys of its latest call, chain order
    ctx: Any = None  # the CallContext of its latest call (identity: a stale context is ignored)
    fresh: bool = False  # no lookup or put of the latest call yet: the next one starts the chain
    in_call: bool = False
    pending_wait_s: float | None = None  # the call's hinted tool wait, applied at call_finished
    return_s: float | None = None  # predicted return on the Db's clock, while waiting
    timer: Any = None  # the prefetch Timer
    gen: int = 0  # bumped by every new plan or cancel: a stale job does nothing
    offloaded: bool = False
    prefetched: bool = False



class ChainsMixin:
    def _init_chains(self) -> None:
        self._agents: dict[str, dict[str | None, AgentPlan]] = {}  # session -> agent -> plan
        self._chain_refs: dict[bytes, int] = {}  # key -> open agents' chains holding it
        self._recent_chains: deque = deque(maxlen=RECENT_CHAINS)  # (tenant, tuple(keys))

    def _note_call_keys(self, ctx, keys: list) -> None:
        """A call's lookup or put: the keys join its agent's chain (the context of an earlier
        call, or of none, changes nothing)."""
        if not isinstance(ctx, CallContext) or ctx.session_id is None:
            return
        with self._lock:
            s = self.planner.find_session(ctx.session_id)
            if s is not None:
                s.last_active_s = self._clock()  # S1/S3: the one thing a put does for expiry
            plan = self._agents.get(ctx.session_id, {}).get(ctx.agent_id)
            if plan is None or plan.ctx is not ctx:
                return
            if plan.fresh:
                plan.fresh = False
                self._set_chain(plan, list(keys))
            else:
                chain = plan.chain
                if keys[: len(chain)] == chain:
                    self._set_chain(plan, list(keys))
                else:
                    have = set(chain)
                    self._set_chain(plan, chain + [k for k in keys if k not in have])
            sid = ctx.session_id
            if sid in self._pending_prefix:
                self._resolve_pending(sid)

    def _set_chain(self, plan: AgentPlan, keys: list) -> None:
        refs = self._chain_refs
        old, new = set(plan.chain), set(keys)
        for k in old - new:
            n = refs[k] - 1
            if n:
                refs[k] = n
            else:
                del refs[k]
        for k in new - old:
            refs[k] = refs.get(k, 0) + 1
        if plan.chain and keys[: len(plan.chain)] != plan.chain:
            self._recent_chains.append((plan.tenant, tuple(plan.chain)))
        plan.chain = keys

    def _private(self, plan: AgentPlan) -> list:
        refs, prot = self._chain_refs, self._protected
        return [k for k in plan.chain if refs.get(k, 0) <= 1 and k not in prot]
