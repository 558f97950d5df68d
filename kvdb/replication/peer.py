"""Client side of node-to-node sharing: push blocks to a peer, look blocks up on a peer.

Push (prefill node -> decode node), over one authenticated channel::

    OPEN_REGION {bytes}            ->   REGION {transport, addr, bytes}   (window x chunk slots)
    TE write chunk 0 -> slot 0 (async); digests of chunk 0 while it moves
    TE write chunk 1 -> slot 1 (async); digests of chunk 1
    chunk 0 written:  PUT_BLOCKS {offset, digests} + keys   ->
    ...                            <-   PUT_ACK chunk 0   (durable on the peer)
    TE write chunk 4 -> slot 0 (only after chunk 0's ack) ...

Zero-copy landing: when the peer offers it (``frames`` in its welcome), the push first sends
``RESERVE_FRAMES {chunks}`` and the peer answers ``FRAMES`` naming host-arena frames reserved for
every block; each chunk is written straight into its frames and the peer, after the digest
check, commits them as pages in place (no copy out of a landing region; node.py N4). When the
peer cannot reserve them (``frames: null``) the push uses the landing region below.

The landing region holds ``window`` chunks (default 4 x 32 MiB): the peer stores chunk k while
the engine moves the next ones, and up to two engine writes are in flight. Measured on 2 busy
cores (docs/replication.md): 4 x 32 MiB gave push/engine 0.75-0.97, 2 x 64 MiB 0.60-0.87,
4 x 16 MiB 0.48-0.91, 8 x 8 MiB 0.64-0.99 -- larger engine batches are cheaper, a smaller last
chunk shortens the unoverlapped tail (the peer storing it). On the inline (plain TCP) path the
data follows the keys in each PUT_BLOCKS frame under the same window.

Invariants:
  P1. ``push`` returns only after the peer acknowledged every chunk, and the peer acknowledges a
      chunk only after ``put_blocks`` with the requested durability returned there.
  P2. A block that crossed the engine is stored only if its bytes match the XXH3-128 digest
      the sender computed from the source (carried in the HMAC-tagged PUT_BLOCKS); otherwise
      nothing of that chunk is stored and the push raises ``ReplicationError``. Inline blocks
      are covered by the frame's HMAC itself. XXH3 rather than CRC-32C: ~3x faster here, and on
      2 cores every byte hashed is taken from the transfer (crc32c held push at 0.6x the
      engine's write, the goal is 0.8x). It guards against damage, not against an attacker who
      can write into registered memory: the engine's port must be on a trusted fabric.
  P3. Landing slot k % window is rewritten only after chunk k - window's ack (no torn reuse).
  P4. A push that fails waits for its engine writes still in flight before it raises, so no
      write of an abandoned push lands after the peer reused the memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import xxhash

from kvdb.errors import InvalidInput, ReplicationError
from kvdb.replication.channel import connect, load_secret
from kvdb.replication.protocol import MsgType
from kvdb.replication.transport import Transport, get_transport
from kvdb.types import KEY_BYTES

DEFAULT_CHUNK_BYTES = 32 << 20  # bytes per PUT_BLOCKS chunk
DEFAULT_WINDOW = 4  # chunks sent and not yet acknowledged; the landing region holds this many
DURABILITY = ("none", "group", "sync")


def encode_keys(keys) -> bytes:
    raw = []
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            raise InvalidInput(f"key {i} must be {KEY_BYTES} bytes, got {type(k).__name__} {k!r:.40}")
        raw.append(bytes(k))
    return b"".join(raw)


def decode_keys(blob, n: int) -> list[bytes]:
    raw = bytes(blob[: n * KEY_BYTES])
    if len(raw) != n * KEY_BYTES:
        raise ReplicationError(f"corrupted message: expected {n} keys, got {len(raw)} key bytes")
    return [raw[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(n)]


def block_digests(rows) -> list[str]:
    """XXH3-128 (hex) of each block: rows of a [n, page_bytes] uint8 tensor or a list of 1-D ones."""
    return [xxhash.xxh3_128_hexdigest(r.numpy()) for r in rows]


@dataclass
class PushResult:
    num_blocks: int
    num_bytes: int
    transport: str  # "mooncake" or "tcp" (inline)


class Peer:
    """An authenticated connection to one node; thread-compatible (one caller at a time)."""

    def __init__(
        self,
        addr: str,
        *,
        secret: bytes | None = None,
        secret_file=None,
        transport: Transport | str | None = None,
        node: str = "",
        timeout_s: float = 60.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if secret is None:
            secret = load_secret(secret_file)
        self.addr = addr
        self.channel = connect(addr, secret, node=node, timeout_s=timeout_s)
        if isinstance(transport, Transport):
            self.transport = transport
        else:
            local_host = self.channel.sock.getsockname()[0]
            self.transport = get_transport(transport, local_host=local_host)
        self.peer_transport = self.channel.peer_meta.get("transport") or {}
        self.peer_layout = self.channel.peer_meta.get("layout")
        self.chunk_bytes = int(chunk_bytes)
        self.window = max(1, int(window))
        self._region: dict | None = None  # the peer's landing region for this connection
        self._region_asked = 0  # bytes asked for it
        self._recv: torch.Tensor | None = None  # registered buffer the peer writes lookups into

    @property
    def uses_engine(self) -> bool:
        return self.transport.can_write_to(self.peer_transport)

    def close(self) -> None:
        self.channel.close()
        if self._recv is not None:
            self.transport.unregister(self._recv)
            self._recv = None

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ push

    def landing_region(self, nbytes: int) -> dict:
        """The peer's landing region for this connection, re-asked only for more than before
        (the peer may grant less than asked: its cap; the push then uses smaller chunks)."""
        if self._region is None or self._region_asked < nbytes:
            self.channel.send(MsgType.OPEN_REGION, {"bytes": nbytes})
            reply = self.channel.expect(MsgType.REGION)
            self._region, self._region_asked = reply.meta, nbytes
        return self._region

    def push(self, keys, pages, *, durability: str = "sync") -> PushResult:
        """Store ``pages[i]`` under ``keys[i]`` on the peer; returns once durable there (P1).

        ``pages``: a contiguous host tensor [n, ...] (any dtype; each row one block), or a list
        of n contiguous host tensors, one block each (e.g. pinned arena pages: sent in place)."""
        if durability not in DURABILITY:
            raise InvalidInput(f"durability must be one of {DURABILITY}, got {durability!r}")
        keys = list(keys)
        n = len(keys)
        rows = _as_rows(pages)
        if len(rows) != n:
            raise InvalidInput(f"{n} keys but {len(rows)} pages")
        if n == 0:
            return PushResult(0, 0, self.transport.kind)
        page_bytes = rows[0].numel()
        if any(r.numel() != page_bytes for r in rows):
            raise InvalidInput("pages differ in size; every block of one layout has the same bytes")
        if self.peer_layout and self.peer_layout.get("page_bytes") not in (None, page_bytes):
            raise InvalidInput(
                f"pages are {page_bytes} bytes but {self.addr} stores {self.peer_layout['page_bytes']}-byte "
                "blocks (another layout)"
            )
        key_blob = encode_keys(keys)
        per_chunk = max(1, min(n, self.chunk_bytes // page_bytes))
        engine = self.uses_engine
        window = self.window  # chunks not yet acknowledged (P3)
        region = None
        registered: list[torch.Tensor] = []
        frames = None
        if engine and self.channel.peer_meta.get("frames"):
            frames = self._reserve_frames(n, per_chunk, page_bytes)
        if frames is not None:
            region = {"transport": frames["transport"]}
        elif engine:
            num_chunks = -(-n // per_chunk)
            region = self.landing_region(min(window, num_chunks) * per_chunk * page_bytes)
            slots = int(region["bytes"]) // page_bytes
            if slots < 1:
                raise ReplicationError(f"{self.addr} offered a landing region smaller than one block")
            per_chunk = min(per_chunk, slots)
            window = max(1, min(window, slots // per_chunk))
        if engine:
            seen: set[int] = set()
            for r in rows:  # one registration per backing storage (an arena: once, ever)
                sp = r.untyped_storage().data_ptr()
                if sp not in seen:
                    seen.add(sp)
                    if self.transport.register(r):
                        registered.append(r)
        try:
            self._push_chunks(key_blob, rows, page_bytes, durability, per_chunk, window, region,
                              frames["addrs"] if frames is not None else None)
        finally:
            for r in registered:
                self.transport.unregister(r)
        return PushResult(n, n * page_bytes, "mooncake" if engine else "tcp")

    def _reserve_frames(self, n: int, per_chunk: int, page_bytes: int) -> dict | None:
        """Ask the peer to reserve arena frames for every block of this push; None when it
        cannot (the landing region is used then). Returns the engine descriptor and, per chunk,
        the destination address of each block."""
        chunks = [min(per_chunk, n - s) for s in range(0, n, per_chunk)]
        self.channel.send(MsgType.RESERVE_FRAMES, {"chunks": chunks})
        reply = self.channel.expect(MsgType.FRAMES)
        got = reply.meta.get("frames")
        if got is None:
            return None
        base, page = reply.meta.get("base"), reply.meta.get("page_bytes")
        if not isinstance(got, list) or [len(f) if isinstance(f, list) else -1 for f in got] != chunks \
                or not isinstance(base, int) or page != page_bytes:
            self.channel.close()
            raise ReplicationError(f"{self.addr} answered RESERVE_FRAMES with a malformed frame list")
        return {"transport": reply.meta.get("transport"),
                "addrs": [[base + int(f) * page_bytes for f in fr] for fr in got]}

    def _push_chunks(self, key_blob: bytes, rows: list[torch.Tensor], page_bytes: int, durability: str,
                     per_chunk: int, window: int, region: dict | None, frame_addrs: list | None) -> None:
        """Send chunks, at most ``window`` unacknowledged (P3: slot k % window is rewritten only
        after chunk k - window's ack). Engine path: up to two writes in flight; each chunk's
        digests are computed while its own transfer runs, and it is announced (PUT_BLOCKS) once
        its write completed and the next one is already submitted. ``frame_addrs``: chunk k
        lands at ``frame_addrs[k]`` (reserved arena frames) instead of a region slot."""
        pending: deque = deque()  # engine: (chunk, write handle, meta, keys) submitted, not announced
        try:
            self._push_pipeline(key_blob, rows, page_bytes, durability, per_chunk, window, region,
                                frame_addrs, pending)
        except BaseException:
            for _, handle, _, _ in pending:  # P4
                try:
                    self.transport.wait(handle)
                except ReplicationError:
                    pass
            raise

    def _push_pipeline(self, key_blob, rows, page_bytes, durability, per_chunk, window, region,
                       frame_addrs, pending: deque) -> None:
        n = len(rows)
        acks: deque[int] = deque()  # announced chunks awaiting PUT_ACK, oldest first

        def announce() -> None:
            chunk, handle, meta, ck = pending[0]
            self.transport.wait(handle)
            pending.popleft()
            self.channel.send(MsgType.PUT_BLOCKS, meta, [ck])
            acks.append(chunk)

        for chunk, start in enumerate(range(0, n, per_chunk)):
            stop = min(n, start + per_chunk)
            while len(acks) + len(pending) >= window:
                if acks:
                    self._wait_ack(acks.popleft())
                else:
                    announce()
            part = rows[start:stop]
            meta = {"chunk": chunk, "blocks": len(part), "page_bytes": page_bytes, "durability": durability}
            ck = key_blob[start * KEY_BYTES : stop * KEY_BYTES]
            if region is None:
                meta.update(inline=True)  # the frame's HMAC covers the data
                self.channel.send(MsgType.PUT_BLOCKS, meta, [ck, *[r.numpy() for r in part]])
                acks.append(chunk)
                continue
            if frame_addrs is not None:
                dst = frame_addrs[chunk]
                meta.update(landing="frames")
            else:
                offset = (chunk % window) * per_chunk * page_bytes
                base = int(region["addr"]) + offset
                dst = [base + i * page_bytes for i in range(len(part))]
                meta.update(offset=offset)
            handle = self.transport.write_async(region["transport"], [(r.data_ptr(), page_bytes) for r in part], dst)
            pending.append((chunk, handle, None, ck))
            meta.update(inline=False, digests=block_digests(part))  # overlaps the transfer
            pending[-1] = (chunk, handle, meta, ck)
            if len(pending) >= 2:
                announce()
        while pending:
            announce()
        while acks:
            self._wait_ack(acks.popleft())

    def _wait_ack(self, chunk: int) -> None:
        ack = self.channel.expect(MsgType.PUT_ACK)
        if ack.meta.get("chunk") != chunk:
            self.channel.close()
            raise ReplicationError(f"{self.addr} acknowledged chunk {ack.meta.get('chunk')}, expected {chunk}")

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys, *, fetch: bool = True) -> tuple[int, torch.Tensor | None]:
        """Longest prefix of ``keys`` the peer holds and, with ``fetch``, those blocks as a
        [hits, page_bytes] uint8 tensor (view it in the layout).

        With the engine on both ends the peer writes the blocks into this connection's
        registered receive buffer and sends their XXH3-128 digests, checked here; the tensor
        is then a view of that buffer, valid until the next ``lookup`` on this Peer (copy or
        store it first). Otherwise the blocks come inline in the HMAC-tagged reply."""
        keys = list(keys)
        meta = {"keys": len(keys), "fetch": bool(fetch)}
        page = int((self.peer_layout or {}).get("page_bytes") or 0)
        if fetch and keys and page and self.uses_engine:
            need = len(keys) * page
            if self._recv is None or self._recv.numel() < need:
                if self._recv is not None:
                    self.transport.unregister(self._recv)
                self._recv = torch.empty(need, dtype=torch.uint8)
                self.transport.register(self._recv)
            meta["region"] = {"transport": self.transport.descriptor(), "addr": self._recv.data_ptr(),
                              "bytes": self._recv.numel()}
        self.channel.send(MsgType.LOOKUP, meta, [encode_keys(keys)])
        reply = self.channel.expect(MsgType.LOOKUP_REPLY)
        hits = int(reply.meta.get("hits", 0))
        if hits < 0 or hits > len(keys):
            raise ReplicationError(f"{self.addr} reported {hits} hits for {len(keys)} keys")
        if not fetch or hits == 0:
            return hits, None
        page_bytes = int(reply.meta["page_bytes"])
        if reply.meta.get("via") == "engine":
            if self._recv is None or hits * page_bytes > self._recv.numel():
                raise ReplicationError(f"{self.addr} wrote {hits} blocks past this node's receive buffer")
            rows = self._recv[: hits * page_bytes].reshape(hits, page_bytes)
            if block_digests(rows) != reply.meta.get("digests"):
                raise ReplicationError(f"blocks {self.addr} wrote through the engine fail their XXH3-128 digests")
            return hits, rows
        blob = reply.blob
        if blob.nbytes != hits * page_bytes:
            raise ReplicationError(f"{self.addr} sent {blob.nbytes} bytes for {hits} blocks of {page_bytes}")
        return hits, torch.frombuffer(blob, dtype=torch.uint8).reshape(hits, page_bytes)

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        self.channel.send(MsgType.STATUS, {})
        return self.channel.expect(MsgType.STATUS_REPLY).meta

    def ping(self) -> None:
        self.channel.send(MsgType.PING, {})
        self.channel.expect(MsgType.PONG)


def _as_rows(pages) -> list[torch.Tensor]:
    """1-D uint8 views of each block (no copy); clear errors for device or strided memory."""
    items = list(pages) if isinstance(pages, (list, tuple)) else None
    if items is None:
        if not isinstance(pages, torch.Tensor):
            raise InvalidInput(f"pages must be a torch.Tensor or a list of them, got {type(pages).__name__}")
        _check_host(pages)
        if pages.dim() == 0:
            raise InvalidInput("pages must have a leading block dimension")
        flat = pages.view(torch.uint8).reshape(pages.shape[0], -1) if pages.numel() else pages.reshape(0, 0)
        return list(flat)
    out = []
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"pages must be tensors, got {type(t).__name__}")
        _check_host(t)
        out.append(t.view(torch.uint8).reshape(-1))
    return out


def _check_host(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise InvalidInput(f"push sends host memory; got pages on {t.device} (copy them to the host)")
    if not t.is_contiguous():
        raise InvalidInput("push needs contiguous pages (call .contiguous() first)")


def push(keys, pages, peer: str, *, secret_file=None, secret: bytes | None = None,
         durability: str = "sync", transport: Transport | str | None = None) -> PushResult:
    """One-shot push of ``pages`` under ``keys`` to ``peer`` (``host:port``); durable on return."""
    with Peer(peer, secret=secret, secret_file=secret_file, transport=transport) as p:
        return p.push(keys, pages, durability=durability)
