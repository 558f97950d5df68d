"""Authenticated control channel between two kvdb nodes (frames: protocol.py).

Handshake (mutual HMAC-SHA256 challenge-response over a shared secret file)::

    client                                   server
      HELLO {version, node, nonce_c}  ---->
                                      <----  CHALLENGE {nonce_s, proof_s}
      check proof_s                          proof_s = HMAC(secret, "kvdb-server" || nc || ns)
      RESPONSE {proof_c}              ---->  proof_c = HMAC(secret, "kvdb-client" || nc || ns)
                                             check proof_c, else ERROR{AUTH} and close
                                      <----  WELCOME {node, transport}   (first session frame)

Session keys: k_c2s = HMAC(secret, "kvdb-c2s" || nc || ns), k_s2c likewise with "kvdb-s2c".
Every frame after RESPONSE is tagged with its direction's key, so each message is
authenticated; the sequence number in the tagged header defeats replay and reordering. Fresh
nonces on both sides make every session's keys distinct.

Invariants:
  I1. No frame is acted upon before its tag and sequence number are checked.
  I2. A peer without the secret never reaches a session: the client raises ``AuthError`` when
      the server's proof is wrong or when the server refuses it; the server refuses a wrong
      proof with ERROR{AUTH}.
  I3. A frame that fails any check raises ``ReplicationError`` and the channel is closed:
      after a damaged frame the byte stream cannot be trusted to be in sync.
  I4. Until the peer is authenticated (the server: its RESPONSE checked; the client: the
      server's proof checked) this side reads at most ``PREAUTH_MAX_BYTES`` from it in all; a
      frame declaring more is refused from its header (``OversizeFrame``), nothing of its body
      read or allocated. The whole handshake runs under one deadline (``accept`` /
      ``connect``'s ``timeout_s``), not a timeout per ``recv``: a peer trickling bytes is cut
      when the deadline passes (``HandshakeTimeout``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from kvdb.errors import AuthError, InvalidInput, ReplicationError
from kvdb.replication.protocol import (
    HANDSHAKE_KEY,
    HEADER_BYTES,
    PREAUTH_MAX_BYTES,
    PROTOCOL_VERSION,
    TAG_BYTES,
    ErrorCode,
    FrameError,
    Message,
    MsgType,
    OversizeFrame,
    compute_tag,
    decode_header,
    decode_meta,
    encode_header,
    encode_meta,
)

MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
_LARGE_BLOB_BYTES = 1 << 16  # blobs above this land in an uninitialised tensor, not a bytearray
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0  # the whole handshake, from accept to WELCOME


class HandshakeTimeout(ReplicationError):
    """The peer did not complete the handshake before its deadline."""


class RemoteError(ReplicationError):
    """The peer answered with ERROR{code} and closed (``code``: protocol.ErrorCode)."""

    def __init__(self, code, message: str) -> None:
        super().__init__(message)
        self.code = code


def load_secret(path) -> bytes:
    """Read a shared secret file (surrounding whitespace stripped); at least 16 bytes."""
    if path is None:
        raise AuthError("no replication secret configured: pass a secret file shared by all nodes")
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise AuthError(f"cannot read the replication secret file {str(path)!r}: {e.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(
            f"the replication secret in {str(path)!r} has {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES} random bytes (e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
        )
    return secret


def _mac(secret: bytes, label: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(secret, label + nc + ns, hashlib.sha256).digest()


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port) with a clear error on anything else."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidInput(f"peer address {addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class Channel:
    """One authenticated, sequenced frame stream over a connected socket (thread-safe sends)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.peer_node = ""
        self.peer_meta: dict = {}  # the peer's WELCOME (client side)
        self.local_meta: dict = {}  # the WELCOME this side sent (server side)
        self._send_key = HANDSHAKE_KEY
        self._recv_key = HANDSHAKE_KEY
        self._send_seq = 0  # next sequence number to send; guarded by _send_lock
        self._recv_seq = 0  # next sequence number expected; only the receiving thread touches it
        self._send_lock = threading.Lock()  # guards the socket's send side and _send_seq
        self._corrupt_next = False
        self.closed = False
        # I4: bytes this side may still read before the peer is authenticated (None: it is)
        self._preauth_left: int | None = PREAUTH_MAX_BYTES
        self._deadline: float | None = None  # monotonic deadline of the handshake (I4)

    # ------------------------------------------------------------------ frames

    def send(self, mtype: MsgType, meta: dict | None = None, blobs=()) -> None:
        """Send one frame; ``blobs`` are buffers sent back to back as the blob, never joined."""
        meta_raw = encode_meta(meta or {})
        parts = [memoryview(b).cast("B") for b in blobs]
        blob_bytes = sum(p.nbytes for p in parts)
        with self._send_lock:
            if self.closed:
                raise ReplicationError(f"connection to {self.peer} is closed")
            header = encode_header(mtype, self._send_seq, len(meta_raw), blob_bytes)
            tag = compute_tag(self._send_key, header, meta_raw, parts)
            if self._corrupt_next:  # test hook: damage the frame after tagging it
                self._corrupt_next = False
                meta_raw = bytes([meta_raw[0] ^ 0x01]) + meta_raw[1:]
            self._send_seq += 1
            try:
                self._sendall([header, meta_raw, *parts, tag])
            except OSError as e:
                self._close_locked()
                raise ReplicationError(f"connection to {self.peer} lost while sending: {e}") from None

    def _sendall(self, bufs) -> None:
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            sent = self.sock.sendmsg(views[:64])
            while sent and views:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    @staticmethod
    def _buffer(n: int) -> memoryview:
        """Where every received byte lands: ``n`` bytes (the largest is a frame's checked length)."""
        if n > _LARGE_BLOB_BYTES:
            return memoryview(torch.empty(n, dtype=torch.uint8).numpy()).cast("B")
        return memoryview(bytearray(n))

    def _recv_exact(self, n: int, into=None) -> memoryview:
        if into is None:
            into = self._buffer(n)
        got = 0
        while got < n:
            if self._deadline is not None:  # I4: the handshake's deadline, not one per recv
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("handshake deadline passed")
                self.sock.settimeout(left)
            k = self.sock.recv_into(into[got:], n - got)
            if k == 0:
                raise ConnectionResetError("peer closed the connection")
            got += k
        return into

    def recv(self) -> Message:
        """Receive and check one frame (I1); ERROR frames raise the error they carry."""
        if self.closed:
            raise ReplicationError(f"connection to {self.peer} is closed")
        try:
            left = self._preauth_left
            if left is not None and left < HEADER_BYTES + TAG_BYTES:
                raise OversizeFrame(f"oversize handshake: {self.peer} sent {PREAUTH_MAX_BYTES - left} bytes "
                                    f"without authenticating (at most {PREAUTH_MAX_BYTES})")
            header = bytes(self._recv_exact(HEADER_BYTES))
            max_body = None if left is None else left - HEADER_BYTES - TAG_BYTES
            mtype, seq, meta_bytes, blob_bytes = decode_header(header, max_body)  # I4: before any body byte
            if left is not None:
                self._preauth_left = left - (HEADER_BYTES + meta_bytes + blob_bytes + TAG_BYTES)
            meta_raw = self._recv_exact(meta_bytes)
            blob = self._recv_exact(blob_bytes)
            tag = bytes(self._recv_exact(TAG_BYTES))
        except ReplicationError:
            self.close()
            raise
        except socket.timeout:
            self.close()
            if self._deadline is not None:
                raise HandshakeTimeout(f"{self.peer} did not complete the handshake in time; connection closed") \
                    from None
            raise ReplicationError(f"timed out waiting for {self.peer}") from None
        except OSError as e:
            self.close()
            raise ReplicationError(f"connection to {self.peer} lost: {e}") from None
        if not hmac.compare_digest(tag, compute_tag(self._recv_key, header, meta_raw, [blob])):
            self.close()
            raise FrameError(
                f"corrupted message from {self.peer}: its HMAC-SHA256 tag does not match "
                "(damaged in transit, tampered with, or a peer with another session); connection closed"
            )
        if seq != self._recv_seq:
            self.close()
            raise FrameError(
                f"message from {self.peer} has sequence number {seq}, expected {self._recv_seq} "
                "(replayed or reordered); connection closed"
            )
        self._recv_seq += 1
        try:
            msg = Message(MsgType(mtype), decode_meta(meta_raw), blob, seq)
        except FrameError:
            self.close()
            raise
        if msg.type == MsgType.ERROR:
            self.close()
            code = msg.meta.get("code")
            text = str(msg.meta.get("message", "no reason given"))[:2000]
            if code == ErrorCode.AUTH:
                raise AuthError(f"{self.peer} refused authentication: {text}")
            if code == ErrorCode.BUSY:
                raise RemoteError(code, f"{self.peer} refused the connection: {text}")
            raise RemoteError(code, f"{self.peer} reported an error: {text}")
        return msg

    def expect(self, *types: MsgType) -> Message:
        msg = self.recv()
        if msg.type not in types:
            self.close()
            names = "/".join(t.name for t in types)
            raise FrameError(f"{self.peer} sent {msg.type.name} where {names} was expected")
        return msg

    def send_error(self, code: ErrorCode, message: str) -> None:
        """Best effort: tell the peer why it is being dropped, then close."""
        try:
            self.send(MsgType.ERROR, {"code": int(code), "message": message})
        except ReplicationError:
            pass
        self.close()

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()

    def close(self) -> None:
        # shutdown first so a thread blocked in recv on this socket wakes up
        self._close_locked()

    def debug_corrupt_next_send(self) -> None:
        """Test hook: flip one bit of the next frame after its tag is computed."""
        self._corrupt_next = True

    def set_timeout(self, timeout_s: float | None) -> None:
        self.sock.settimeout(timeout_s)

    # ------------------------------------------------------------------ handshake

    def _switch_keys(self, send_key: bytes, recv_key: bytes) -> None:
        """The peer is authenticated: session keys from here on, and the protocol's own limits
        instead of the pre-authentication cap (I4)."""
        self._send_key, self._recv_key = send_key, recv_key
        self._preauth_left = None

    def _start_deadline(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s
        self.sock.settimeout(timeout_s)

    def _end_deadline(self, timeout_s: float | None) -> None:
        self._deadline = None
        self.sock.settimeout(timeout_s)


def connect(addr: str, secret: bytes | None, *, node: str = "", timeout_s: float = 30.0) -> Channel:
    """Open an authenticated channel to ``addr`` (``host:port``); AuthError on a secret mismatch.
    ``timeout_s`` bounds the connect and, as one deadline, the whole handshake; then each
    receive on the channel."""
    host, port = parse_addr(addr)
    if not secret:
        raise AuthError(f"no replication secret configured for {addr}: pass the cluster's secret file")
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise ReplicationError(f"cannot connect to {addr}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client_handshake(sock, addr, secret, node=node, timeout_s=timeout_s)


def client_handshake(sock: socket.socket, addr: str, secret: bytes, *, node: str = "",
                     timeout_s: float | None = None) -> Channel:
    """Client side of the handshake on a connected socket (see the module doc); ``timeout_s``:
    the deadline of the whole handshake (I4), and the socket's timeout afterwards."""
    ch = Channel(sock, addr)
    if timeout_s is not None:
        ch._start_deadline(timeout_s)
    nc = os.urandom(NONCE_BYTES)
    ch.send(MsgType.HELLO, {"version": PROTOCOL_VERSION, "node": node, "nonce": nc.hex()})
    msg = ch.expect(MsgType.CHALLENGE)
    try:
        ns = bytes.fromhex(msg.meta["nonce"])
        proof_s = bytes.fromhex(msg.meta["proof"])
    except (KeyError, TypeError, ValueError):
        ch.close()
        raise FrameError(f"{addr} sent a malformed CHALLENGE") from None
    if len(ns) != NONCE_BYTES or not hmac.compare_digest(proof_s, _mac(secret, b"kvdb-server", nc, ns)):
        ch.send_error(ErrorCode.AUTH, "the server's proof does not match this client's secret")
        raise AuthError(f"authentication with {addr} failed: the two nodes hold different shared secrets "
                        "(check the secret file on both)")
    ch.send(MsgType.RESPONSE, {"proof": _mac(secret, b"kvdb-client", nc, ns).hex()})
    ch._switch_keys(_mac(secret, b"kvdb-c2s", nc, ns), _mac(secret, b"kvdb-s2c", nc, ns))
    welcome = ch.expect(MsgType.WELCOME)
    ch.peer_node = str(welcome.meta.get("node", ""))
    ch.peer_meta = welcome.meta
    if timeout_s is not None:
        ch._end_deadline(timeout_s)
    return ch


def accept(sock: socket.socket, peer: str, secret: bytes, welcome: dict | Callable[[], dict], *,
           timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> Channel:
    """Server side of the handshake on an accepted socket: AuthError for a wrong proof,
    HandshakeTimeout past ``timeout_s`` (the whole handshake, I4), FrameError /
    OversizeFrame for a malformed or oversize frame, ReplicationError when the peer went away.
    ``welcome`` (or what it returns, called only once the peer is authenticated) is sent as
    WELCOME. At most ``PREAUTH_MAX_BYTES`` are read before the peer is authenticated."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ch = Channel(sock, peer)
    ch._start_deadline(timeout_s)
    hello = ch.expect(MsgType.HELLO)
    if hello.meta.get("version") != PROTOCOL_VERSION:
        ch.send_error(ErrorCode.VERSION, f"unsupported protocol version {str(hello.meta.get('version'))[:40]!r}")
        raise FrameError(f"{peer} speaks protocol version {str(hello.meta.get('version'))[:40]!r}")
    try:
        nc = bytes.fromhex(hello.meta["nonce"])
    except (KeyError, TypeError, ValueError):
        nc = b""
    if len(nc) != NONCE_BYTES:
        ch.send_error(ErrorCode.PROTOCOL, "HELLO carries no valid nonce")
        raise FrameError(f"{peer} sent a malformed HELLO")
    ns = os.urandom(NONCE_BYTES)
    ch.send(MsgType.CHALLENGE, {"nonce": ns.hex(), "proof": _mac(secret, b"kvdb-server", nc, ns).hex()})
    resp = ch.expect(MsgType.RESPONSE)
    try:
        proof_c = bytes.fromhex(resp.meta["proof"])
    except (KeyError, TypeError, ValueError):
        proof_c = b""
    if not hmac.compare_digest(proof_c, _mac(secret, b"kvdb-client", nc, ns)):
        ch.send_error(ErrorCode.AUTH, "wrong shared secret")
        raise AuthError(f"{peer} failed authentication (wrong or no shared secret)")
    ch.peer_node = str(hello.meta.get("node", ""))[:256]
    ch._switch_keys(_mac(secret, b"kvdb-s2c", nc, ns), _mac(secret, b"kvdb-c2s", nc, ns))
    ch._end_deadline(None)
    meta = welcome() if callable(welcome) else welcome
    ch.send(MsgType.WELCOME, meta)
    ch.local_meta = meta
    return ch
