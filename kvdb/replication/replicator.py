"""Replicator: everything a Db needs to share blocks across nodes, behind four calls.

A Db opened with ``peers=`` / ``replicas=`` owns one Replicator and forwards to it:

    db.push(keys, peer)            -> Replicator.push: pins the pages, sends them in place
    db.sync_replicas(timeout_s)    -> Replicator.sync_replicas: waits for every follower
    db.reseed_replica(addr)        -> Replicator.reseed: replace a follower's state by a copy
    a local miss in match_prefix   -> Replicator.fetch_missing: asks the peers, stores the hits
    db.close()                     -> Replicator.close

It uses only the Db's public API; ``log_source_for`` reads the log through ``db.cold_store``
(its directory and durable lsn), and the replication slots become the cold tier's retention
floor, so compaction keeps what a follower still needs.
"""

from __future__ import annotations

import socket
import threading

from kvdb.cold.export import key_check
from kvdb.errors import InvalidInput, KvdbError, ReplicationError
from kvdb.replication.channel import load_secret
from kvdb.replication.peer import Peer, PushResult
from kvdb.replication.shipping import LogShipper, retained_lsn
from kvdb.replication.transport import Transport
from kvdb.wal.source import SegmentLogSource


def log_source_for(db) -> SegmentLogSource:
    """The Db's log as a LogSource: its ``wal/`` segments, up to the writer's durable lsn (S3)."""
    cold = db.cold_store
    if cold is None:
        raise InvalidInput("replicas= needs the disk tier (open with disk_bytes != 0): followers are fed from the log")
    return SegmentLogSource(cold.wal_dir, durable=lambda: cold.durable_lsn)


class Replicator:
    def __init__(self, db, *, replicas=(), peers=(), secret_file=None, secret: bytes | None = None,
                 transport: Transport | str | None = None, node: str | None = None) -> None:
        self.db = db
        self.secret = secret if secret is not None else load_secret(secret_file)
        self.transport = transport
        self.node = node or f"{socket.gethostname()}:{db.path}"
        self.peer_addrs = list(peers)
        self._lock = threading.Lock()  # guards _peers
        self._peers: dict[str, tuple[threading.Lock, Peer]] = {}
        self.shipper: LogShipper | None = None
        if replicas:
            state_dir = db.path / "replication"
            # replication slots: compaction keeps every segment a follower still needs (S4)
            log_source = log_source_for(db)  # checks that the Db has a log
            db.cold_store.set_retention(lambda: retained_lsn(state_dir))
            # an encrypted log ships sealed; its key check tells a follower without the key (sink.py)
            self.shipper = LogShipper(log_source, list(replicas), self.secret,
                                      state_dir=db.path / "replication", node=self.node,
                                      transport=transport, page_bytes=db.layout.page_bytes,
                                      store=db.cold_store, seal_check=key_check(db.cold_store)).start()

    # ------------------------------------------------------------------ peers

    def _peer(self, addr: str) -> tuple[threading.Lock, Peer]:
        with self._lock:
            entry = self._peers.get(addr)
            if entry is not None and not entry[1].channel.closed:
                return entry
        peer = Peer(addr, secret=self.secret, transport=self.transport, node=self.node)
        with self._lock:
            entry = (threading.Lock(), peer)
            self._peers[addr] = entry
        return entry

    def _call(self, addr: str, fn):
        lock, peer = self._peer(addr)
        with lock:
            try:
                return fn(peer)
            except ReplicationError:
                peer.close()  # the next call reconnects
                raise

    # ------------------------------------------------------------------ the Db's calls

    def push(self, keys, peer: str, *, durability: str = "sync") -> PushResult:
        """Send the stored blocks of ``keys`` to ``peer``; returns when durable there. The pages
        are pinned and sent from the arena in place (host tier) or copied to the host first."""
        keys = list(keys)
        with self.db.pin(keys) as pinned:
            arena = [p for p in pinned if p.device.type == "cpu"]
            pages = [p if p.device.type == "cpu" else p.cpu() for p in pinned]

            def send(peer_conn: Peer) -> PushResult:
                if peer_conn.uses_engine:
                    for p in arena:  # the host arena stays registered (once per storage, not per push)
                        peer_conn.transport.register(p)
                return peer_conn.push(keys, pages, durability=durability)

            return self._call(peer, send)

    def sync_replicas(self, timeout_s: float) -> int:
        """Write back and fsync everything written so far (``db.flush``), then wait until every
        follower confirmed it; returns the lsn they all hold."""
        if self.shipper is None:
            return 0
        self.db.flush()
        self.shipper.notify()
        return self.shipper.sync(timeout_s)

    def fetch_missing(self, keys, local: int | None = None) -> int:
        """After a local miss: fetch the missing suffix of ``keys`` from the first peer that has
        it, store it locally (durability none) and return how many leading keys are now local.
        ``local``: how many leading keys the caller already found locally (else a peek finds out)."""
        keys = list(keys)
        if local is None:
            local = self.db.match_prefix(keys, peek=True)
        if local == len(keys) or not self.peer_addrs:
            return local
        rest = keys[local:]
        lay = self.db.layout
        for addr in self.peer_addrs:
            try:
                hits, rows = self._call(addr, lambda p: p.lookup(rest))
            except (ReplicationError, OSError):
                continue  # a peer that is down is a miss, not an error
            if hits:
                blocks = rows.view(lay.dtype).view(hits, *lay.block_shape)
                self.db.put_blocks(rest[:hits], blocks, durability="none")
                return local + hits
        return local

    def reseed(self, addr: str) -> None:
        """Re-seed follower ``addr`` from a full copy (reseed.py), whatever log it holds."""
        if self.shipper is None:
            raise InvalidInput("this Db ships its log to no follower (open it with replicas=)")
        self.shipper.reseed(addr)

    def status(self) -> dict:
        return {"node": self.node, "peers": list(self.peer_addrs),
                "followers": self.shipper.status() if self.shipper is not None else []}

    def close(self) -> None:
        if self.shipper is not None:
            self.shipper.stop()
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for _, p in peers:
            try:
                p.close()
            except KvdbError:
                pass
