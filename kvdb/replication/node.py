"""NodeServer: a kvdb node that accepts pushes, lookups and log streams from its peers.

One accept thread; one thread per connection, which runs the handshake and then handles the
connection's requests strictly in order (so acknowledgements come back in request order; the
requests themselves: requests.py). The
node owns a Db (``kvdb replicate serve --db PATH``) and calls only its public API:

    db.layout, db.put_blocks(keys, blocks, durability=...), db.match_prefix(keys),
    db.get_blocks(keys, out=...), db.stats(),
    db.reserve_frames(n), db.commit_frames(keys, frames, durability=...), db.release_frames(frames)

and, for log shipping, a ``LogSink`` (shipping.py) that applies the leader's records.

Connection states (each way out of the handshake is counted in ``counters``)::

    accepted --over a cap: ERROR{BUSY}--> closed                       (rejected_connections)
       └--> handshaking --proof ok--> serving --ERROR sent / peer closed / bad frame--> closed
               ├--wrong secret: ERROR{AUTH}--> closed                  (auth_failures)
               ├--deadline passed--> closed                            (handshake_timeouts)
               ├--a frame declaring more than the cap--> closed        (oversize_frames)
               ├--a malformed or unexpected frame--> closed            (malformed_frames)
               └--peer closed / reset--> closed                        (handshakes_abandoned)

Limits on unauthenticated peers (the threat model: docs/replication.md): at most
``max_handshakes`` connections handshake at once and at most ``max_connections`` are open in
all (handshaking or serving), so threads are bounded too (one each, plus the accept thread); a
connection over either cap is answered ERROR{BUSY} and closed by the accept thread, without a
thread of its own. Each handshake reads at most ``PREAUTH_MAX_BYTES`` (channel.py I4) and
ends by ``handshake_timeout_s``, so unauthenticated peers hold at most ``max_handshakes *
PREAUTH_MAX_BYTES`` of frame buffers (1 MiB with the defaults) and nothing of the Db: the WELCOME
(layout, namespace) is built only for an authenticated peer.

Invariants:
  N1. A PUT_ACK is sent only after ``put_blocks`` returned for every block of its chunk, with
      the durability the sender asked for (peer.py P1).
  N2. A chunk whose landed bytes fail their XXH3-128 digests is rejected whole (ERROR{CORRUPT});
      nothing of it is stored; the sender's push raises.
  N3. Any failure on one connection closes that connection only; the node keeps serving.
  N4. Zero-copy landing (RESERVE_FRAMES): a push lands straight in host-arena frames reserved
      for it (the arena is registered with the engine once). A chunk's frames are committed
      only after its digests matched (else released: nothing visible); frames a connection
      still holds when it closes are released after a grace period, so that an engine write
      still in flight cannot land in a frame already reused for another page.
  N5. An unauthenticated peer gets nothing but CHALLENGE / ERROR frames: no Db call, no region,
      no log line per connection (refusals are logged at 1, 2, 4, 8, ... of each counter).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from kvdb.errors import AuthError, InvalidInput, KvdbError, ReplicationError
from kvdb.replication.attach import replicator_of
from kvdb.replication.channel import DEFAULT_HANDSHAKE_TIMEOUT_S, Channel, HandshakeTimeout, accept, parse_addr
from kvdb.replication.namespace import namespace_of
from kvdb.replication.protocol import PREAUTH_MAX_BYTES, ErrorCode, FrameError, OversizeFrame
from kvdb.replication.requests import NodeRequests
from kvdb.replication.transport import Region, Transport, get_transport
from kvdb.threads import join_all

log = logging.getLogger("kvdb.replication")

DEFAULT_REGION_MAX_BYTES = 256 << 20  # landing memory one connection may ask for
LATE_WRITE_GRACE_S = 2.0  # frames of a closed connection are released this long after it closed
DEFAULT_MAX_CONNECTIONS = 256  # open connections, handshaking or serving (one thread each)
DEFAULT_MAX_HANDSHAKES = 16  # connections not yet authenticated
_HANDSHAKE_OUTCOMES = ("auth_failures", "handshake_timeouts", "oversize_frames", "malformed_frames",
                       "handshakes_abandoned", "rejected_connections")


class NodeServer(NodeRequests):
    """Serves one Db to authenticated peers on ``listen`` (``host:port``; port 0 picks one).
    This module accepts, bounds and authenticates connections; requests.py serves them."""

    def __init__(self, db, listen: str, secret: bytes, *, node: str | None = None,
                 transport: Transport | str | None = None, sink=None,
                 region_max_bytes: int = DEFAULT_REGION_MAX_BYTES,
                 late_write_grace_s: float = LATE_WRITE_GRACE_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
                 handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> None:
        for name, v in (("max_connections", max_connections), ("max_handshakes", max_handshakes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInput(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(handshake_timeout_s, bool) or not isinstance(handshake_timeout_s, (int, float)) \
                or not 0 < handshake_timeout_s < float("inf"):
            raise InvalidInput(f"handshake_timeout_s must be a positive finite number, got {handshake_timeout_s!r}")
        self.max_connections = max_connections
        self.max_handshakes = min(max_handshakes, max_connections)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.db = db
        self.late_write_grace_s = float(late_write_grace_s)
        self.secret = secret
        self.sink = sink  # LogSink for shipped log records (None: this node refuses log streams)
        if sink is not None:
            sink.swap_db = self.swap_db  # a re-seed replaces the Db (reseed.py)
        self._gate = threading.Condition()  # guards _db_users and _swapping
        self._db_users = 0  # requests using self.db now
        self._swapping = False
        self.leader_status = None  # callable -> [follower dicts] when this node ships its own log
        host, port = parse_addr(listen)
        self.region_max_bytes = int(region_max_bytes)
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.listen(64)
        bound = self._sock.getsockname()
        self.address = f"{host}:{bound[1]}"
        self.node = node or self.address
        if isinstance(transport, Transport):
            self.transport = transport
        else:
            te_host = host if host not in ("", "0.0.0.0", "::") else socket.gethostbyname(socket.gethostname())
            self.transport = get_transport(transport, local_host=te_host)
        self._lock = threading.Lock()  # guards counters, _channels and _handshaking
        self._channels: set[Channel] = set()
        self._handshaking = 0  # accepted connections not yet authenticated (each has a thread)
        self._pending: set[socket.socket] = set()  # their sockets (stop() wakes them)
        self._conn_threads: set[threading.Thread] = set()  # live connection threads (stop() joins them)
        self._free_regions: list[Region] = []  # landing regions of closed connections, for reuse
        self.counters = {"connections": 0, **dict.fromkeys(_HANDSHAKE_OUTCOMES, 0), "corrupt_frames": 0,
                         "blocks_received": 0, "bytes_received": 0, "blocks_landed_in_arena": 0, "lookups": 0,
                         "blocks_served": 0, "blocks_served_by_engine": 0, "errors": 0}
        # the Replicator attached to this Db (attach.py), or the daemon's: its counters in status(),
        # and this server's in its replication_status()
        self.replicator = replicator_of(db)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._arena = None  # the Db's host arena, once registered with the engine (by this node)
        self._frames_ok = self.transport.kind == "mooncake" and hasattr(db, "reserve_frames")
        self._host_frames = 0
        if self._frames_ok:
            try:
                self._host_frames = int(db.stats()["tiers"]["host"]["capacity_pages"])
            except (KvdbError, KeyError, TypeError):
                self._frames_ok = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> NodeServer:
        if self.replicator is not None:
            self.replicator.add_server(self)
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvdb-node-{self.address}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        if self._thread is None:
            self.start()
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        self._stopping = True
        if self.replicator is not None:
            self.replicator.remove_server(self)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            chans = list(self._channels)
            pending = list(self._pending)
        for ch in chans:
            ch.close()
        for conn in pending:  # handshakes in progress wake up and end
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            threads = list(self._conn_threads)
        join_all(threads, 5)  # the connection threads too (kvdb/threads.py)
        if self._arena is not None:
            self.transport.unregister(self._arena)
            self._arena = None

    @contextlib.contextmanager
    def _db_use(self):
        """Around each request that uses ``self.db``: waits while a re-seed swaps it."""
        with self._gate:
            while self._swapping:
                self._gate.wait()
            self._db_users += 1
        try:
            yield
        finally:
            with self._gate:
                self._db_users -= 1
                self._gate.notify_all()

    def swap_db(self, reopen, keep: Channel | None = None):
        """A re-seed (sink.py): wait for the requests in progress, close every other connection
        (their pushes hold frames of this Db), close the Db, and serve ``reopen()``'s Db (which
        swaps the directory and opens it again). Returns the new Db."""
        with self._gate:
            self._swapping = True
            while self._db_users:
                self._gate.wait()
        try:
            with self._lock:
                chans = [c for c in self._channels if c is not keep]
            for c in chans:
                c.close()
            if self._arena is not None:  # the old arena goes with the old Db
                self.transport.unregister(self._arena)
                self._arena = None
            self.db.close()
            self.db = reopen()
            return self.db
        finally:
            with self._gate:
                self._swapping = False
                self._gate.notify_all()

    def debug_drop_connections(self) -> int:
        """Test hook: close every open connection (a network drop); the node keeps listening."""
        with self._lock:
            chans = list(self._channels)
        for ch in chans:
            ch.close()
        return len(chans)

    def __enter__(self) -> NodeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _count(self, name: str, n: int = 1) -> int:
        with self._lock:
            self.counters[name] += n
            return self.counters[name]

    def _refused(self, counter: str, peer: str, why) -> None:
        """Count a connection that ended without a session; log it at 1, 2, 4, 8, ... of its
        counter so a flood of hostile connections cannot flood the log (N5)."""
        n = self._count(counter)
        if n & (n - 1) == 0:
            log.warning("node %s refused %s (%s: %s); %d so far", self.node, peer, counter, why, n)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            with self._lock:
                busy = (self._handshaking >= self.max_handshakes
                        or self._handshaking + len(self._channels) >= self.max_connections)
                if not busy:
                    self._handshaking += 1
                    self._pending.add(conn)
            if not busy:
                t = threading.Thread(target=self._serve_conn, args=(conn, peer), name=f"kvdb-conn-{peer}",
                                     daemon=True)
                with self._lock:  # ended threads leave the set here (stop() must see one still unwinding)
                    self._conn_threads = {x for x in self._conn_threads if x.is_alive()}
                    self._conn_threads.add(t)
                try:
                    t.start()
                    continue
                except RuntimeError:  # no thread to be had: refuse it like one over the cap
                    with self._lock:
                        self._conn_threads.discard(t)
                        self._handshaking -= 1
                        self._pending.discard(conn)
            self._reject(conn, peer)

    def _reject(self, conn: socket.socket, peer: str) -> None:
        """Over a cap: a best-effort ERROR{BUSY} (never blocks the accept thread), then close."""
        self._refused("rejected_connections", peer, f"at the cap of {self.max_connections} connections / "
                                                    f"{self.max_handshakes} handshakes")
        try:
            conn.settimeout(0)
            Channel(conn, peer).send_error(ErrorCode.BUSY, f"node {self.node} is at its connection cap; retry later")
        except OSError:
            pass
        conn.close()

    def _handshake(self, conn: socket.socket, peer: str) -> Channel | None:
        """Run the server side of the handshake (channel.py I4); the channel, or None when the
        peer got no session (counted, connection closed)."""
        counter = None
        try:
            ch = accept(conn, peer, self.secret, self.welcome, timeout_s=self.handshake_timeout_s)
        except AuthError as e:
            counter, why = "auth_failures", e
        except HandshakeTimeout as e:
            counter, why = "handshake_timeouts", e
        except OversizeFrame as e:
            counter, why = "oversize_frames", e
        except FrameError as e:
            counter, why = "malformed_frames", e
        except ReplicationError as e:
            counter, why = "handshakes_abandoned", e
        except KvdbError as e:  # building the WELCOME failed (the Db closed meanwhile)
            counter, why = "errors", e
        except BaseException:
            with self._lock:
                self._handshaking -= 1
                self._pending.discard(conn)
            conn.close()
            raise
        with self._lock:
            self._handshaking -= 1
            self._pending.discard(conn)
            if counter is None:
                self._channels.add(ch)
                self.counters["connections"] += 1
                return ch
        conn.close()
        if not self._stopping:
            self._refused(counter, peer, why)
        return None

    # ------------------------------------------------------------------ one connection

    def welcome(self) -> dict:
        """The WELCOME an authenticated peer gets: this node, its transport, layout and namespace."""
        db = self.db
        lay = db.layout
        return {"node": self.node, "transport": self.transport.descriptor(),
                "layout": {**lay.to_dict(), "page_bytes": lay.page_bytes},
                "model_id": getattr(db, "model_id", None), "namespace": namespace_of(db), "frames": self._frames_ok}

    def _serve_conn(self, conn: socket.socket, peer: str) -> None:
        """A connection's thread: the handshake, then its requests in order (requests.py)."""
        ch = self._handshake(conn, peer)
        if ch is not None:
            self._serve_requests(ch, peer)

    def _close_conn(self, ch: Channel) -> None:
        ch.close()
        with self._lock:
            self._channels.discard(ch)

    def endpoint_status(self) -> dict:
        """The listener's side of status(): counters, open connections, limits."""
        with self._lock:
            counters = dict(self.counters)
            open_now = {"serving": len(self._channels), "handshaking": self._handshaking}
        return {"address": self.address, "counters": counters, "connections_open": open_now,
                "limits": {"max_connections": self.max_connections, "max_handshakes": self.max_handshakes,
                           "handshake_timeout_s": self.handshake_timeout_s, "preauth_max_bytes": PREAUTH_MAX_BYTES}}

    def status(self) -> dict:
        out = {"node": self.node, "transport": self.transport.descriptor(), **self.endpoint_status()}
        if self.sink is not None:
            out["follower"] = self.sink.status()
        if self.leader_status is not None:
            out["followers"] = self.leader_status()
        if self.replicator is not None:
            out["replicator"] = self.replicator.counters_snapshot()
        try:
            out["db"] = self.db.stats()
        except KvdbError as e:
            out["db"] = {"error": str(e)}
        return out
