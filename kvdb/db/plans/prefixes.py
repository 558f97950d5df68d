"""Shared prefixes: a session's declared prefix (system prompt, tool schemas) stays resident.

Part of the class ``kvdb.db.core.Db`` (a mixin of kvdb/db/plans/; the Db's lock guards it).

Shared prefixes (hint ``prefix_hash``)
    ``prefix_hash`` names a shared prefix (system prompt + tool schemas) by the key of its
    last block: a kvdb ``BlockKey`` (``db.block_keys(...)[-1]``; the hint check turns it into
    its 32 hex digits, kvdb/planner/hints.py) or those digits as a string,
    an integer is the engine's own hash of that block (mapped like ``db.engine_keys``, in the
    session's tenant). The Db resolves it through the chains it has seen in calls *of the
    session's tenant* (open agents' chains and the last ``RECENT_CHAINS`` ones): the prefix
    is that chain up to the named block. While at least one open session names it:
  X1  its blocks are prefetched toward the device (at resolution, and at each call of an
      interested session: before the session's first call) and protected: the Db pins their
      resident frames (a refcounted interest: one prefix, N sessions; released when the
      last of them ends), at most ``PREFIX_PIN_FRACTION`` of each tier's frames. A
      ``delete`` of a protected key drops the protection first.
  X2  a prefix hash the Db cannot resolve is *clipped*, never an error: nothing is protected,
      and it is resolved at a later call of the session whose chain holds it.
  X3  tenants: keys are tenant-salted and resolution looks only at the session tenant's
      chains, so another tenant's prefix hash resolves to nothing and ``explain`` shows no
      residency for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdb.buffer_pool.pool import HOST
from kvdb.keys import DEFAULT_TENANT
from kvdb.planner.hints import CLIPPED, REJECTED, HintOutcome
from kvdb.types import KEY_BYTES

PREFIX_PIN_FRACTION = 0.5  # at most this share of a tier's frames is pinned for prefixes


@dataclass
class SharedPrefix:
    tenant: str
    key: bytes  # its last block
    keys: tuple  # chain order
    sessions: set = field(default_factory=set)



class PrefixesMixin:
    def _init_prefixes(self) -> None:
        self._prefixes: dict[tuple, SharedPrefix] = {}  # (tenant, last key) -> prefix
        self._session_prefix: dict[str, tuple] = {}  # session -> (tenant, last key), resolved
        self._pending_prefix: dict[str, bytes] = {}  # session -> unresolved last key
        self._protected: dict[bytes, int] = {}  # key -> interested prefixes holding it
        self._pinned: dict[bytes, tuple] = {}  # key -> (tier, frame) the Db pinned for prefixes (one pin each)
        self._prefix_pinned = [0, 0]  # frames pinned for prefixes, per tier

    def _apply_prefix_outcomes(self, sid: str, outcomes: list[HintOutcome]) -> list[HintOutcome]:
        out = []
        for o in outcomes:
            if o.name == "prefix_hash" and o.status != REJECTED:
                o = self._declare_prefix(sid, o)
            out.append(o)
        return out

    def _declare_prefix(self, sid: str, o: HintOutcome) -> HintOutcome:
        tenant = self.planner.get_session(sid).tenant or DEFAULT_TENANT
        v = o.value
        if isinstance(v, int):
            key = self.keyspace.engine_keys([v], tenant)[0]
        else:
            try:
                key = bytes.fromhex(v)
            except ValueError:
                key = b""
            if len(key) != KEY_BYTES:
                new = HintOutcome(o.name, CLIPPED, v, "not a block key (32 hex digits) nor an engine hash (int): "
                                                      "nothing to protect")
                self.planner.revise(o, new)
                self._plan_stats["prefixes_unknown"] += 1
                return new
        if self._session_prefix.get(sid) == (tenant, key):
            return o  # named again (e.g. on every call): nothing changes
        first = self._pending_prefix.get(sid) != key
        if first:  # another prefix than before: the old interest goes
            self._pending_prefix.pop(sid, None)
            self._drop_prefix_interest(sid)
        if self._resolve(sid, tenant, key):
            self._pending_prefix.pop(sid, None)
            return o
        self._pending_prefix[sid] = key
        if first:
            self._plan_stats["prefixes_unknown"] += 1
        new = HintOutcome(o.name, CLIPPED, v, "unknown prefix for this session's tenant (no chain seen holds it): "
                                              "nothing protected yet; resolved when a call of the session stores it")
        self.planner.revise(o, new)
        return new

    def _resolve(self, sid: str, tenant: str, key: bytes) -> bool:
        pk = (tenant, key)
        p = self._prefixes.get(pk)
        if p is None:
            chains = [(p.tenant, p.chain) for agents in self._agents.values() for p in agents.values()]
            chains.extend(reversed(self._recent_chains))
            for t, chain in chains:
                if t == tenant and key in chain:
                    keys = tuple(chain[: list(chain).index(key) + 1])
                    break
            else:
                return False
            p = self._prefixes[pk] = SharedPrefix(tenant, key, keys)
            for k in keys:
                self._protected[k] = self._protected.get(k, 0) + 1
        p.sessions.add(sid)
        self._session_prefix[sid] = pk
        self._plan_stats["prefixes_resolved"] += 1
        self._mover.submit(self._prefix_job, pk)
        return True

    def _resolve_pending(self, sid: str) -> None:
        s = self.planner.find_session(sid)
        if s is not None and self._resolve(sid, s.tenant or DEFAULT_TENANT, self._pending_prefix[sid]):
            del self._pending_prefix[sid]

    def _drop_prefix_interest(self, sid: str) -> None:
        pk = self._session_prefix.pop(sid, None)
        p = self._prefixes.get(pk) if pk is not None else None
        if p is None:
            return
        p.sessions.discard(sid)
        if p.sessions:
            return
        del self._prefixes[pk]
        free = []
        for k in p.keys:
            n = self._protected[k] - 1
            if n:
                self._protected[k] = n
            else:
                del self._protected[k]
                free.append(k)
        self._unpin_prefix_keys(free)

    def _unpin_prefix_keys(self, keys) -> None:
        """Drop the Db's prefix pins on these keys (those it holds)."""
        for k in keys:
            loc = self._pinned.pop(k, None)
            if loc is not None:
                self.pool.unpin(*loc)
                self._prefix_pinned[loc[0].index] -= 1

    def _unprotect(self, keys) -> None:
        """Before a delete: the Db's own prefix pins on these keys go (X1)."""
        self._unpin_prefix_keys(keys)

    def _prefix_job(self, pk: tuple) -> None:
        """X1 on the mover: bring the prefix toward the device, then pin what is resident
        (each key once, whatever number of prefixes hold it)."""
        with self._lock:
            p = self._prefixes.get(pk)
            if self._state != "open" or p is None:
                return
            pinned = self._pinned
            self._unpin_prefix_keys([k for k in p.keys if k in pinned and pinned[k][0].index == HOST])  # pinned pages cannot move
            moved, _ = self._bring_up([k for k in p.keys if k not in pinned])
            self._plan_stats["prefix_prefetch_blocks"] += moved
            pool = self.pool
            for k in p.keys:
                t = pool.tier_of(k)
                if k in pinned or t is None:
                    continue
                if self._prefix_pinned[t] >= int(pool.num_frames(t) * PREFIX_PIN_FRACTION):
                    continue
                pinned[k] = pool.pin(k)
                self._prefix_pinned[t] += 1
