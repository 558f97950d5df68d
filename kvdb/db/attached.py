"""What layers above the Db attach to it: replication (kvdb/replication/attach.py).

Part of the class ``kvdb.db.core.Db`` (a mixin). The Db imports nothing from those layers;
``kvdb.open(..., peers=, replicas=)`` opens the Db, then attaches the replication layer's
object with ``attach_replication``. The Db then

* forwards ``push`` / ``sync_replicas`` / ``reseed_replica`` / ``replication_status`` to it
  (InvalidInput while nothing is attached);
* after a lookup that found only ``local`` leading keys, asks the attached ``on_miss(keys,
  local)`` for more (it stores what it finds through the Db's own API and returns how many
  leading keys are local now; ``stats()["remote_hits"]`` counts the difference);
* closes it in ``close``, once the mover has stopped and before dirty pages are written back
  and the cold tier closes;
* shows its ``counters_snapshot()`` (peers that refused this node: wrong secret, caps,
  another namespace) as ``stats()["replication"]``.

The shared tier (kvdb/shared/, ``kvdb.open(..., shared=)``) attaches with ``attach_shared``;
the Db then offers it the blocks each ``put_blocks`` stored new (``offer``), waits for their
publication in ``flush`` and ``Db.wait_published`` (``wait_published``), asks it before
replication for a lookup's missing leading keys (``fetch_prefix``) and, before a read, for keys
on no local tier (``fetch_any``), tells it of deletes (``remove``), shows ``stats()["shared"]``
and closes it first in ``close`` (docs/shared.md).
"""

from __future__ import annotations

import math

from typing import Callable

from kvdb.errors import InvalidInput
from kvdb.keys import normalize_keys
from kvdb.types import DURABILITIES


class AttachedMixin:
    def _init_attached(self) -> None:
        # the attached replication object (push, sync_replicas, reseed, status, counters_snapshot, close)
        self._replication = None
        self._on_miss: Callable[[list, int], int] | None = None
        self._remote_hits = 0
        self._shared = None  # the shared tier (kvdb/shared/tier.py), when open with shared=

    def attach_replication(self, replication, *, on_miss: Callable[[list, int], int] | None = None) -> None:
        """Attach the replication layer's object (once); ``on_miss`` serves lookup misses."""
        self._check()
        if self._replication is not None:
            raise InvalidInput("this Db already has replication attached")
        self._replication = replication
        self._on_miss = on_miss

    def attach_shared(self, shared) -> None:
        """Attach the shared tier (once; kvdb/shared/attach.py)."""
        self._check()
        if self._shared is not None:
            raise InvalidInput("this Db already has a shared tier attached")
        self._shared = shared

    def _offer_shared(self, keys: list, pages, rows: list[int]) -> None:
        """Hand the rows a put stored new to the shared tier (it copies them and returns)."""
        if self._shared is not None and rows:
            self._shared.offer([keys[i] for i in rows], self._select(pages, rows))  # kvdb/db/write.py

    def wait_published(self, timeout_s: float | None = None) -> bool:
        """Wait until every block put so far is published to the shared tier or dropped (counted),
        without ``flush``'s write-back to disk: a prefill engine calls it before handing a request
        over through the pool. True at once without a shared tier; False when ``timeout_s`` ran out."""
        self._check()
        if timeout_s is not None:
            _check_timeout(timeout_s, "None or ")
        shared = self._shared
        return True if shared is None else shared.wait_published(timeout_s)

    def _fill_from_shared(self, keys: list) -> None:
        """Before a read: fetch the keys held on no local tier from the shared tier."""
        if self._shared is None:
            return
        with self._lock:
            self._check()
            absent = [keys[i] for i in self.pool.absent_rows(keys)]
        if absent and self._cold is not None:
            absent = [k for k, d in zip(absent, self._cold_call(self._cold.contains, absent)) if not d]
        if absent:
            self._shared.fetch_any(absent)

    def _on_lookup_miss(self, keys: list, local: int) -> int:
        if self._shared is not None:
            local = self._shared.fetch_prefix(keys, local)
            if local == len(keys):
                return local
        if self._on_miss is None:
            return local
        now = self._on_miss(keys, local)
        self._remote_hits += now - local
        return now

    def _attached_stats(self) -> dict:
        replication, shared = self._replication, self._shared
        out = {"replication": replication.counters_snapshot()} if replication is not None else {}
        if shared is not None:
            out["shared"] = shared.stats()
        return out

    def _close_attached(self) -> None:
        shared, self._shared = getattr(self, "_shared", None), None
        if shared is not None:
            shared.close()
        replication, self._replication, self._on_miss = getattr(self, "_replication", None), None, None
        if replication is not None:
            replication.close()

    def push(self, keys, peer: str, *, durability: str = "sync"):
        """Send the stored blocks of ``keys`` to ``peer`` ("host:port" of a ``kvdb replicate
        serve`` node or a Db with replication); returns when they are durable there."""
        self._check()
        if durability not in DURABILITIES:
            raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
        if not isinstance(peer, str) or not peer:
            raise InvalidInput(f"peer must be a 'host:port' string, got {peer!r}")
        keys = normalize_keys(keys)
        return self._need_replication().push(keys, peer, durability=durability)

    def sync_replicas(self, timeout_s: float = 30.0) -> int:
        """Wait until every follower confirmed everything written so far; returns that LSN.
        ReplicationError names the followers still behind after ``timeout_s``."""
        self._check()
        _check_timeout(timeout_s)  # before the flush it starts with
        return self._need_replication().sync_replicas(timeout_s)

    def reseed_replica(self, addr: str) -> None:
        """Replace follower ``addr``'s state by a full copy of this Db, then stream the log from
        there (also when it holds another leader's log); one only behind the log is re-seeded
        without asking. Progress: ``replication_status()["followers"][i]["reseed"]``."""
        self._check()
        self._need_replication().reseed(addr)

    def replication_status(self) -> dict:
        self._check()
        return self._need_replication().status()

    def _need_replication(self):
        if self._replication is None:
            raise InvalidInput("this Db has no replication: open it with replication_secret_file= "
                               "(and peers= / replicas=)")
        return self._replication


def _check_timeout(timeout_s, may_be: str = "") -> None:
    """A finite number of seconds >= 0 (an int past float's range is no timeout either), else
    InvalidInput."""
    try:
        ok = not isinstance(timeout_s, bool) and isinstance(timeout_s, (int, float)) and 0 <= timeout_s < math.inf
        ok = ok and math.isfinite(float(timeout_s))
    except OverflowError:
        ok = False
    if not ok:
        raise InvalidInput(f"timeout_s must be {may_be}a finite number of seconds >= 0, got {timeout_s!r:.40}")
