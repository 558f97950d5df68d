"""NodeServer: a kvdb node that accepts pushes, lookups and log streams from its peers.

One accept thread; one thread per authenticated connection, which handles that connection's
requests strictly in order (so acknowledgements come back in request order). The node owns a
Db (``kvdb replicate serve --db PATH``) and calls only its public API:

    db.layout, db.put_blocks(keys, blocks, durability=...), db.match_prefix(keys),
    db.get_blocks(keys, out=...), db.stats()

and, for log shipping, a ``LogSink`` (shipping.py) that applies the leader's records.

Connection states::

    accepted --handshake ok--> serving --ERROR sent / peer closed / bad frame--> closed
        └--wrong secret: ERROR{AUTH}, counted in auth_failures--> closed

Invariants:
  N1. A PUT_ACK is sent only after ``put_blocks`` returned for every block of its chunk, with
      the durability the sender asked for (peer.py P1).
  N2. A chunk whose landed bytes fail their XXH3-128 digests is rejected whole (ERROR{CORRUPT});
      nothing of it is stored; the sender's push raises.
  N3. Any failure on one connection closes that connection only; the node keeps serving.
"""

from __future__ import annotations

import logging
import socket
import threading

import torch

from kvdb.errors import AuthError, InvalidInput, KvdbError, NotFound, ReplicationError
from kvdb.replication.channel import Channel, accept, parse_addr
from kvdb.replication.peer import DURABILITY, block_digests, decode_keys
from kvdb.replication.protocol import ErrorCode, Message, MsgType
from kvdb.replication.transport import Region, Transport, get_transport

log = logging.getLogger("kvdb.replication")

DEFAULT_REGION_MAX_BYTES = 256 << 20  # landing memory one connection may ask for
_FREE_REGIONS = 2  # released landing regions kept registered for the next connections


class NodeServer:
    """Serves one Db to authenticated peers on ``listen`` (``host:port``; port 0 picks one)."""

    def __init__(self, db, listen: str, secret: bytes, *, node: str | None = None,
                 transport: Transport | str | None = None, sink=None,
                 region_max_bytes: int = DEFAULT_REGION_MAX_BYTES) -> None:
        self.db = db
        self.secret = secret
        self.sink = sink  # LogSink for shipped log records (None: this node refuses log streams)
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
        self._lock = threading.Lock()  # guards counters and _channels
        self._channels: set[Channel] = set()
        self._free_regions: list[Region] = []  # landing regions of closed connections, for reuse
        self.counters = {"connections": 0, "auth_failures": 0, "corrupt_frames": 0, "blocks_received": 0,
                         "bytes_received": 0, "lookups": 0, "blocks_served": 0, "blocks_served_by_engine": 0,
                         "errors": 0}
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "NodeServer":
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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            chans = list(self._channels)
        for ch in chans:
            ch.close()
        if self._thread is not None:
            self._thread.join(5)

    def debug_drop_connections(self) -> int:
        """Test hook: close every open connection (a network drop); the node keeps listening."""
        with self._lock:
            chans = list(self._channels)
        for ch in chans:
            ch.close()
        return len(chans)

    def __enter__(self) -> "NodeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(conn, f"{addr[0]}:{addr[1]}"),
                             name=f"kvdb-conn-{addr[1]}", daemon=True).start()

    # ------------------------------------------------------------------ one connection

    def welcome(self) -> dict:
        lay = self.db.layout
        return {"node": self.node, "transport": self.transport.descriptor(),
                "layout": {**lay.to_dict(), "page_bytes": lay.page_bytes},
                "model_id": getattr(self.db, "model_id", None)}

    def _serve_conn(self, conn: socket.socket, peer: str) -> None:
        try:
            ch = accept(conn, peer, self.secret, self.welcome())
        except AuthError as e:
            self._count("auth_failures")
            log.warning("refused %s: %s", peer, e)
            return
        except ReplicationError as e:
            log.warning("handshake with %s failed: %s", peer, e)
            conn.close()
            return
        self._count("connections")
        with self._lock:
            self._channels.add(ch)
        region: Region | None = None
        staging: list[torch.Tensor] = []  # registered buffer lookups are sent from (this connection)
        try:
            while not ch.closed:
                try:
                    msg = ch.recv()
                except ReplicationError as e:
                    if not self._stopping and "corrupted" in str(e):
                        self._count("corrupt_frames")
                        log.warning("%s", e)
                    return
                try:
                    region = self._dispatch(ch, msg, region, staging)
                except _Refuse as e:
                    self._count("errors")
                    if e.code == ErrorCode.CORRUPT:
                        self._count("corrupt_frames")
                    log.warning("refusing %s from %s: %s", msg.type.name, peer, e.message)
                    ch.send_error(e.code, e.message)
                    return
                except ReplicationError as e:
                    log.warning("connection %s: %s", peer, e)
                    return
                except KvdbError as e:
                    self._count("errors")
                    log.warning("serving %s for %s failed: %s", msg.type.name, peer, e)
                    code = ErrorCode.INVALID if isinstance(e, InvalidInput) else ErrorCode.INTERNAL
                    ch.send_error(code, f"{type(e).__name__}: {e}")
                    return
        finally:
            ch.close()
            with self._lock:
                self._channels.discard(ch)
            if region is not None:
                self._release_region(region)
            for t in staging:
                self.transport.unregister(t)

    def _dispatch(self, ch: Channel, msg: Message, region: Region | None, staging: list) -> Region | None:
        t = msg.type
        if t == MsgType.PUT_BLOCKS:
            self._put_blocks(ch, msg, region)
        elif t == MsgType.OPEN_REGION:
            region = self._open_region(ch, msg, region)
        elif t == MsgType.LOOKUP:
            self._lookup(ch, msg, staging)
        elif t == MsgType.PING:
            ch.send(MsgType.PONG, {})
        elif t == MsgType.STATUS:
            ch.send(MsgType.STATUS_REPLY, self.status())
        elif t == MsgType.SHIP_HELLO:
            if self.sink is None:
                raise _Refuse(ErrorCode.INVALID, f"node {self.node} is not configured as a follower")
            self.sink.serve_stream(ch, msg, self._open_region_raw, self._release_region)
        else:
            raise _Refuse(ErrorCode.PROTOCOL, f"unexpected message {t.name}")
        return region

    def _open_region_raw(self, nbytes: int) -> Region:
        nbytes = min(max(nbytes, 1), self.region_max_bytes)
        with self._lock:  # reuse a released region: registered and already faulted in
            for i, r in enumerate(self._free_regions):
                if r.nbytes >= nbytes:
                    return self._free_regions.pop(i)
        return self.transport.open_region(nbytes)

    def _release_region(self, region: Region) -> None:
        with self._lock:
            self._free_regions.append(region)
            if len(self._free_regions) <= _FREE_REGIONS:
                return
            region = self._free_regions.pop(0)
        self.transport.close_region(region)

    def _open_region(self, ch: Channel, msg: Message, region: Region | None) -> Region:
        want = msg.meta.get("bytes")
        if not isinstance(want, int) or want <= 0:
            raise _Refuse(ErrorCode.PROTOCOL, f"OPEN_REGION asks for {want!r} bytes")
        if region is not None:
            self._release_region(region)
        region = self._open_region_raw(want)
        ch.send(MsgType.REGION, {"transport": self.transport.descriptor(), "addr": region.addr,
                                 "bytes": region.nbytes})
        return region

    def _put_blocks(self, ch: Channel, msg: Message, region: Region | None) -> None:
        lay = self.db.layout
        m = msg.meta
        n = m.get("blocks")
        durability = m.get("durability", "sync")
        if not isinstance(n, int) or n <= 0 or durability not in DURABILITY:
            raise _Refuse(ErrorCode.PROTOCOL, "PUT_BLOCKS needs a block count and a valid durability")
        page = lay.page_bytes
        if m.get("page_bytes") != page:
            raise _Refuse(ErrorCode.INVALID, f"blocks of {m.get('page_bytes')} bytes pushed to node "
                                             f"{self.node}, which stores {page}-byte blocks ({lay})")
        keys = decode_keys(msg.blob, n)
        if m.get("inline"):
            data = msg.blob[n * 16 :]
            if data.nbytes != n * page:
                raise _Refuse(ErrorCode.PROTOCOL, f"PUT_BLOCKS carries {data.nbytes} bytes for {n} blocks")
            rows = torch.frombuffer(data, dtype=torch.uint8).reshape(n, page)
        else:
            off = m.get("offset")
            if region is None or region.tensor is None or not isinstance(off, int) or off < 0 \
                    or off + n * page > region.nbytes:
                raise _Refuse(ErrorCode.PROTOCOL, "PUT_BLOCKS names bytes outside this connection's landing region")
            rows = region.tensor[off : off + n * page].reshape(n, page)
            digests = m.get("digests")
            if not isinstance(digests, list) or len(digests) != n:
                raise _Refuse(ErrorCode.PROTOCOL, "PUT_BLOCKS through the engine needs one digest per block")
            got = block_digests(rows)
            if got != digests:
                bad = [i for i, (a, b) in enumerate(zip(got, digests)) if a != b]
                raise _Refuse(ErrorCode.CORRUPT, f"{len(bad)} of {n} landed blocks fail their XXH3-128 digest "
                                                 f"(first: block {bad[0]}); nothing of this chunk was stored")
        blocks = rows.view(lay.dtype).view(n, *lay.block_shape)
        try:
            self.db.put_blocks(keys, blocks, durability=durability)
        except InvalidInput as e:
            raise _Refuse(ErrorCode.INVALID, str(e)) from None
        self._count("blocks_received", n)
        self._count("bytes_received", n * page)
        ch.send(MsgType.PUT_ACK, {"chunk": m.get("chunk"), "blocks": n})

    def _lookup(self, ch: Channel, msg: Message, staging: list) -> None:
        n = msg.meta.get("keys")
        if not isinstance(n, int) or n < 0:
            raise _Refuse(ErrorCode.PROTOCOL, "LOOKUP needs a key count")
        keys = decode_keys(msg.blob, n)
        self._count("lookups")
        hits = self.db.match_prefix(keys) if n else 0
        lay = self.db.layout
        page = lay.page_bytes
        if not msg.meta.get("fetch") or hits == 0:
            ch.send(MsgType.LOOKUP_REPLY, {"hits": hits, "page_bytes": page})
            return
        dest = msg.meta.get("region")
        engine = (isinstance(dest, dict) and self.transport.can_write_to(dest.get("transport"))
                  and isinstance(dest.get("addr"), int) and isinstance(dest.get("bytes"), int)
                  and hits * page <= dest["bytes"])
        if engine:  # read into this connection's registered staging buffer, then write it out
            if not staging or staging[0].numel() < hits * page:
                if staging:
                    self.transport.unregister(staging.pop())
                staging.append(torch.empty(max(hits, 1) * page, dtype=torch.uint8))
                self.transport.register(staging[0])
            out = staging[0][: hits * page].view(lay.dtype).view(hits, *lay.block_shape)
        else:
            out = torch.empty((hits, *lay.block_shape), dtype=lay.dtype)
        try:
            self.db.get_blocks(keys[:hits], out=out)
        except NotFound:  # evicted between match and read: report a miss, never partial bytes
            ch.send(MsgType.LOOKUP_REPLY, {"hits": 0, "page_bytes": page})
            return
        rows = out.view(torch.uint8).reshape(hits, page)
        self._count("blocks_served", hits)
        if engine:
            handle = self.transport.write_async(dest["transport"], [(r.data_ptr(), page) for r in rows],
                                                [dest["addr"] + i * page for i in range(hits)])
            digests = block_digests(rows)  # overlaps the transfer
            self.transport.wait(handle)
            self._count("blocks_served_by_engine", hits)
            ch.send(MsgType.LOOKUP_REPLY, {"hits": hits, "page_bytes": page, "via": "engine", "digests": digests})
        else:
            ch.send(MsgType.LOOKUP_REPLY, {"hits": hits, "page_bytes": page}, [rows.numpy()])

    def status(self) -> dict:
        with self._lock:
            counters = dict(self.counters)
        out = {"node": self.node, "address": self.address, "transport": self.transport.descriptor(),
               "counters": counters}
        if self.sink is not None:
            out["follower"] = self.sink.status()
        if self.leader_status is not None:
            out["followers"] = self.leader_status()
        try:
            out["db"] = self.db.stats()
        except KvdbError as e:
            out["db"] = {"error": str(e)}
        return out


class _Refuse(Exception):
    """A request this node will not serve: answered with ERROR{code} and the connection closed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
