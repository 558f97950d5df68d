"""Replication on the Db: push to a peer, log-shipping followers, remote lookup on a miss.

A mixin of ``kvdb.db.core.Db``; the machinery is kvdb/replication/ (Replicator), imported only
when a Db is opened with replication, since that layer sits above the Db.
"""

from __future__ import annotations

from kvdb.errors import InvalidInput
from kvdb.keys import normalize_keys
from kvdb.types import DURABILITIES


class ReplicationMixin:
    def _open_replication(self, peers, replicas, secret_file, transport):
        if secret_file is None:
            raise InvalidInput("peers= / replicas= need replication_secret_file= (a shared secret, the same on every node)")
        for addr in [*peers, *replicas]:
            if not isinstance(addr, str) or ":" not in addr:
                raise InvalidInput(f"a peer address is 'host:port', got {addr!r}")
        from kvdb.replication.replicator import (
            Replicator,  # the replication layer sits above the Db
        )

        return Replicator(self, replicas=list(replicas), peers=list(peers), secret_file=secret_file,
                          transport=transport)


    @property
    def cold_store(self):
        """The disk tier (kvdb.cold.store.ColdStore), None when it is off (disk_bytes=0)."""
        return self._cold

    def push(self, keys, peer: str, *, durability: str = "sync"):
        """Send the stored blocks of ``keys`` to ``peer`` ("host:port" of a ``kvdb replicate
        serve`` node or a Db with replication); returns when they are durable there."""
        self._check()
        if durability not in DURABILITIES:
            raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
        return self._need_replicator().push(normalize_keys(keys), peer, durability=durability)

    def sync_replicas(self, timeout_s: float = 30.0) -> int:
        """Wait until every follower confirmed everything written so far; returns that LSN.
        ReplicationError names the followers still behind after ``timeout_s``."""
        self._check()
        return self._need_replicator().sync_replicas(timeout_s)

    def reseed_replica(self, addr: str) -> None:
        """Replace follower ``addr``'s state by a full copy of this Db, then stream the log from
        there (also when it holds another leader's log); one only behind the log is re-seeded
        without asking. Progress: ``replication_status()["followers"][i]["reseed"]``."""
        self._check()
        self._need_replicator().reseed(addr)

    def replication_status(self) -> dict:
        self._check()
        return self._need_replicator().status()

    def _need_replicator(self):
        if self._replicator is None:
            raise InvalidInput("this Db has no replication: open it with replication_secret_file= (and peers= / replicas=)")
        return self._replicator
