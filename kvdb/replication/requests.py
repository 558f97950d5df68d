"""What a node does for an authenticated peer: the requests of one connection, in order.

Part of the class ``kvdb.replication.node.NodeServer`` (a mixin): node.py accepts connections,
bounds them and runs the handshake; each authenticated connection's thread then comes here.

    PUT_BLOCKS      store pushed blocks: inline, from the landing region (digests checked), or
                    committed in place from reserved arena frames (N1, N2, N4)
    RESERVE_FRAMES  reserve host-arena frames for a push and name them (N4)
    OPEN_REGION     this connection's landing region (regions of closed connections are reused)
    LOOKUP          the longest stored prefix of some keys; with ``fetch``, its blocks
    PING, STATUS    liveness; the node's status
    SHIP_HELLO      a log stream for as long as it lasts (the node's LogSink, sink.py)

A request the node will not serve is answered ERROR{code} and closes that connection only (N3).
The invariants N1-N5 are in node.py's header.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from kvdb.errors import CapacityError, InvalidInput, KvdbError, NotFound, ReplicationError
from kvdb.replication.channel import Channel
from kvdb.replication.peer import DURABILITY, block_digests, decode_keys
from kvdb.replication.protocol import ErrorCode, Message, MsgType, OversizeFrame
from kvdb.replication.transport import Region

log = logging.getLogger("kvdb.replication")

_FREE_REGIONS = 2  # released landing regions kept registered for the next connections


class NodeRequests:
    """The request side of NodeServer (node.py holds its state: db, transport, counters, locks)."""

    def _serve_requests(self, ch: Channel, peer: str) -> None:
        """An authenticated connection's requests, in order, until it closes or fails (N3);
        then what it held is released (N4)."""
        state = _ConnState()
        try:
            while not ch.closed:
                try:
                    msg = ch.recv()
                except ReplicationError as e:
                    if not self._stopping and "corrupted" in str(e):
                        self._count("corrupt_frames")
                        if isinstance(e, OversizeFrame):
                            self._count("oversize_frames")
                        log.warning("%s", e)
                    return
                try:
                    if msg.type == MsgType.SHIP_HELLO:  # a stream for as long as it lasts; may swap the Db
                        self._dispatch(ch, msg, state)
                    else:
                        with self._db_use():
                            self._dispatch(ch, msg, state)
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
            self._close_conn(ch)
            if state.region is not None:
                self._release_region(state.region)
            for t in state.staging:
                self.transport.unregister(t)
            if state.frames:  # N4: an engine write may still be on its way into them
                held = list(state.frames.values())
                timer = threading.Timer(self.late_write_grace_s, self._release_frames, args=(held, state.frames_db))
                timer.daemon = True
                timer.start()

    def _dispatch(self, ch: Channel, msg: Message, state: _ConnState) -> None:
        t = msg.type
        if t == MsgType.PUT_BLOCKS:
            self._put_blocks(ch, msg, state)
        elif t == MsgType.RESERVE_FRAMES:
            self._reserve_frames(ch, msg, state)
        elif t == MsgType.OPEN_REGION:
            state.region = self._open_region(ch, msg, state.region)
        elif t == MsgType.LOOKUP:
            self._lookup(ch, msg, state.staging)
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

    def _release_frames(self, held: list, db=None) -> None:
        for res in held:
            try:
                (db or self.db).release_frames(res)
            except KvdbError:  # the Db closed meanwhile (its arena went with it) or already released
                pass

    def _reserve_frames(self, ch: Channel, msg: Message, state: _ConnState) -> None:
        """RESERVE_FRAMES {chunks}: reserve host-arena frames for each chunk of a push and name
        them (N4), or answer ``frames: null`` (the sender then uses the landing region)."""
        chunks = msg.meta.get("chunks")
        if not isinstance(chunks, list) or not chunks or any(not isinstance(c, int) or c <= 0 for c in chunks):
            raise _Refuse(ErrorCode.PROTOCOL, f"RESERVE_FRAMES needs block counts per chunk, got {chunks!r}")
        self._release_frames(list(state.frames.values()), state.frames_db)  # a previous push is over
        state.frames.clear()
        state.frames_db = self.db
        total = sum(chunks)
        page = self.db.layout.page_bytes
        reason = None
        if not self._frames_ok:
            reason = "this node does not land pushes in its arena"
        elif total * page > self.region_max_bytes or 2 * total > self._host_frames:
            reason = f"{total} blocks exceed the frames one push may reserve"
        else:
            try:
                res = self.db.reserve_frames(total)
            except CapacityError as e:
                reason = str(e)
        if reason is not None:
            ch.send(MsgType.FRAMES, {"frames": None, "reason": reason})
            return
        with self._lock:
            arena = self._arena
        if arena is None:
            if self.transport.register(res.arena):
                with self._lock:
                    self._arena = res.arena
        start = 0
        for i, c in enumerate(chunks):
            state.frames[i] = res[start : start + c]
            start += c
        ch.send(MsgType.FRAMES, {"transport": self.transport.descriptor(), "base": res.arena.data_ptr(),
                                 "page_bytes": page, "frames": [state.frames[i].frames for i in range(len(chunks))]})

    def _put_blocks(self, ch: Channel, msg: Message, state: _ConnState) -> None:
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
        if m.get("landing") == "frames":
            self._commit_frames(ch, m, keys, state, durability)
            return
        region = state.region
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

    def _commit_frames(self, ch: Channel, m: dict, keys: list, state: _ConnState, durability: str) -> None:
        """A chunk that landed in reserved arena frames: digests, then commit in place (N2, N4)."""
        n = len(keys)
        res = state.frames.pop(m.get("chunk"), None) if isinstance(m.get("chunk"), int) else None
        if res is None or len(res) != n:
            if res is not None:
                self.db.release_frames(res)
            raise _Refuse(ErrorCode.PROTOCOL, f"PUT_BLOCKS names chunk {m.get('chunk')!r} of {n} blocks, "
                                              "which has no frames reserved on this connection")
        digests = m.get("digests")
        got = block_digests(res.rows) if isinstance(digests, list) and len(digests) == n else None
        if got != digests:
            self.db.release_frames(res)
            if got is None:
                raise _Refuse(ErrorCode.PROTOCOL, "PUT_BLOCKS through the engine needs one digest per block")
            bad = [i for i, (a, b) in enumerate(zip(got, digests)) if a != b]
            raise _Refuse(ErrorCode.CORRUPT, f"{len(bad)} of {n} landed blocks fail their XXH3-128 digest "
                                             f"(first: block {bad[0]}); nothing of this chunk was stored")
        try:
            self.db.commit_frames(keys, res, durability=durability)  # uses the reservation up
        except InvalidInput as e:
            raise _Refuse(ErrorCode.INVALID, str(e)) from None
        page = self.db.layout.page_bytes
        self._count("blocks_received", n)
        self._count("blocks_landed_in_arena", n)
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


@dataclass
class _ConnState:
    """What one connection holds on this node."""

    region: Region | None = None  # its landing region
    staging: list = field(default_factory=list)  # registered buffer lookups are sent from
    frames: dict = field(default_factory=dict)  # chunk -> ReservedFrames of the current push
    frames_db: object = None  # the Db those frames belong to (a re-seed may replace self.db)


class _Refuse(Exception):
    """A request this node will not serve: answered with ERROR{code} and the connection closed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
