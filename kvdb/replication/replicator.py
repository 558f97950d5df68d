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

Peers that refuse this node (``counters``, in ``status()`` and the Db's ``stats()["replication"]``):
a peer or follower that fails authentication (another secret) is counted in ``auth_failures``
(also per peer: ``status()["peer_errors"]``) and logged once per peer until it authenticates
again; ``push`` and ``sync_replicas`` raise ``AuthError``, a lookup (``fetch_missing``) counts it
as a miss. Connections a peer refused at its cap (``rejected_connections``), handshakes past the
deadline (``handshake_timeouts``), oversize or malformed handshake frames (``oversize_frames``,
``malformed_frames``) and peers of another namespace (``namespace_refusals``: no block is pushed
to or fetched from them; followers that refused this leader's namespace, key secret included,
are added there, and ``sync_replicas`` raises ``NamespaceError`` naming them) are counted the
same way.
"""

from __future__ import annotations

import logging
import socket
import threading

from kvdb.cold.export import key_check
from kvdb.errors import AuthError, InvalidInput, KvdbError, NamespaceError, ReplicationError
from kvdb.replication.channel import HandshakeTimeout, RemoteError, load_secret
from kvdb.replication.namespace import mismatch, namespace_of
from kvdb.replication.peer import Peer, PushResult
from kvdb.replication.protocol import ErrorCode, FrameError, OversizeFrame
from kvdb.replication.shipping import LogShipper
from kvdb.replication.slots import retained_lsn
from kvdb.replication.transport import Transport
from kvdb.wal.source import SegmentLogSource

log = logging.getLogger("kvdb.replication")

COUNTERS = ("auth_failures", "rejected_connections", "handshake_timeouts", "oversize_frames", "malformed_frames",
            "namespace_refusals")


def _counter_of(e: BaseException) -> str | None:
    """The counter a failed connection to a peer goes to (None: the peer is down or went away)."""
    if isinstance(e, AuthError):
        return "auth_failures"
    if isinstance(e, NamespaceError):
        return "namespace_refusals"
    if isinstance(e, HandshakeTimeout):
        return "handshake_timeouts"
    if isinstance(e, OversizeFrame):
        return "oversize_frames"
    if isinstance(e, FrameError):
        return "malformed_frames"
    if isinstance(e, RemoteError) and e.code == ErrorCode.BUSY:
        return "rejected_connections"
    return None


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
        self.namespace = namespace_of(db)
        self._lock = threading.Lock()  # guards _peers, counters, _peer_errors, _warned, servers
        self._peers: dict[str, tuple[threading.Lock, Peer]] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._peer_errors: dict[str, dict] = {}  # addr -> {counter: n, "last_error": str}
        self._warned: set[str] = set()  # peers whose refusal was logged (until they answer again)
        self.servers: list = []  # NodeServers serving this Db (node.py registers them): their counters in status()
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
                                      store=db.cold_store, seal_check=key_check(db.cold_store),
                                      namespace=self.namespace).start()

    # ------------------------------------------------------------------ peers

    def _peer(self, addr: str) -> tuple[threading.Lock, Peer]:
        with self._lock:
            entry = self._peers.get(addr)
            if entry is not None and not entry[1].channel.closed:
                return entry
        try:
            peer = Peer(addr, secret=self.secret, transport=self.transport, node=self.node)
        except ReplicationError as e:
            self._failed(addr, e)
            raise
        why = mismatch(self.namespace, peer.channel.peer_meta.get("namespace"), us="this Db", them=f"peer {addr}")
        if why is not None:
            peer.close()
            e = NamespaceError(f"{why}; no block is pushed to or fetched from it")
            self._failed(addr, e)
            raise e
        with self._lock:
            entry = (threading.Lock(), peer)
            self._peers[addr] = entry
            self._warned.discard(addr)  # it answers again: a later refusal is logged again
        return entry

    def _failed(self, addr: str, e: ReplicationError) -> None:
        """Count a peer's refusal (see the module doc); log it once per peer."""
        counter = _counter_of(e)
        if counter is None:
            return
        with self._lock:
            self.counters[counter] += 1
            per = self._peer_errors.setdefault(addr, {})
            per[counter] = per.get(counter, 0) + 1
            per["last_error"] = str(e)
            first = addr not in self._warned
            self._warned.add(addr)
        if first:
            log.warning("replication peer %s: %s (%s; logged once until it answers again)", addr, e, counter)

    def _call(self, addr: str, fn):
        lock, peer = self._peer(addr)
        with lock:
            try:
                return fn(peer)
            except ReplicationError as e:
                peer.close()  # the next call reconnects
                self._failed(addr, e)
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

    def counters_snapshot(self) -> dict:
        """This node's refusals by its peers and followers (COUNTERS, summed over both), and the
        streams its followers refused."""
        with self._lock:
            out = dict(self.counters)
        ship = self.shipper.counters() if self.shipper is not None else {}
        out["auth_failures"] += ship.get("auth_failures", 0)
        out["refused_streams"] = ship.get("refused_streams", 0)
        out["namespace_refusals"] += ship.get("namespace_refusals", 0)  # followers of another namespace
        return out

    def status(self) -> dict:
        with self._lock:
            peer_errors = {a: dict(v) for a, v in self._peer_errors.items()}
            servers = list(self.servers)
        out = {"node": self.node, "namespace": self.namespace, "peers": list(self.peer_addrs),
               "followers": self.shipper.status() if self.shipper is not None else [],
               "counters": self.counters_snapshot(), "peer_errors": peer_errors}
        if servers:  # NodeServers serving this Db: what unauthenticated and authenticated peers did there
            out["servers"] = [srv.endpoint_status() for srv in servers]
        return out

    def add_server(self, server) -> None:
        with self._lock:
            self.servers.append(server)

    def remove_server(self, server) -> None:
        with self._lock:
            if server in self.servers:
                self.servers.remove(server)

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
