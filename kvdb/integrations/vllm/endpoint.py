"""The worker's local endpoint: the Unix socket on which the scheduler half of vLLM's connector
asks the worker's ``KvdbService`` (vLLM's multi-process mode; kvdb/integrations/vllm/service.py).

Name: nobody else can guess or squat it
    Each time the worker starts it writes a fresh 32-byte random secret to ``PATH/vllm.key``
    (mode 0600, through a temporary file and a rename; removed at close) and binds a socket in
    the abstract namespace named from a hash of it. The scheduler half knows ``PATH`` from the
    same kv_connector_extra_config and reads the secret when it connects (again after each lost
    connection: a restarted worker has a new one); it refuses a key file that another user owns
    or could read. Another user can learn the name only once it is bound (``/proc/net/unix``),
    too late to bind it first, and an old name is worth nothing to a later worker. Not a
    filesystem socket in ``PATH``: ``sun_path`` holds 107 bytes (data directories are often
    deeper), a killed worker leaves the file behind, and some filesystems hold no sockets.

Identity, both ways
    The server serves a peer whose ``SO_PEERCRED`` uid is its own; the client talks only to a
    server whose uid is its own. Then a challenge: each side sends a random nonce and proves that
    it holds the secret with an HMAC-SHA256 of both nonces and its role. A failed proof closes the
    connection (counted ``auth_failures``; on the client an ``EndpointError``, so a miss).

Bounds on what clients can hold (each refusal counted: ``KvdbService.stats()["endpoint"]``)
    processes   the engine's own processes -- this one and its parent (vLLM's multiproc executor
                starts the worker from the EngineCore process, where the scheduler half lives) --
                have ``engine_connections`` of their own. Other processes share
                ``max_connections`` (handshaking or serving, at most ``per_process`` each, at most
                ``max_handshakes`` not yet authenticated): whatever they hold, the scheduler still
                reaches the worker. One thread per connection, so threads are bounded too.
    handshake   ``handshake_timeout_s`` for the whole of it, frames of at most HANDSHAKE_MAX_BYTES
    frames      the 4-byte length is checked before any of the body is read (over MAX_FRAME:
                closed, ``oversize_frames``); the declared length is first reserved from
                ``max_inflight`` bytes shared by every connection, of which other processes may use
                all but MAX_FRAME (none left: closed, ``busy_frames``); the body is read as it
                arrives, and a frame begun must end within ``frame_timeout_s`` (``frame_timeouts``)
    nesting     a frame nested deeper than MAX_DEPTH is answered ``{"error": ...}`` without being
                parsed (``deep_frames``: no RecursionError); the connection goes on
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time

import numpy as np

from kvdb.errors import EndpointError, FrameTooLarge
from kvdb.threads import join_all

log = logging.getLogger("kvdb.vllm")

MAX_FRAME = 16 << 20
MAX_DEPTH = 64
HANDSHAKE_MAX_BYTES = 1024
KEY_FILE = "vllm.key"
_LEN = struct.Struct(">I")
_CHUNK = 1 << 20
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
COUNTERS = {
    "connections": "connections accepted",
    "refused_connections": "connections refused: another process's share of the socket is full",
    "foreign_peers": "connections refused: the peer runs as another user",
    "auth_failures": "peers that did not prove they hold the data directory's secret",
    "handshake_timeouts": "peers that did not finish the handshake in time",
    "oversize_frames": "frames declaring more than the limit (connection closed before the body)",
    "busy_frames": "frames refused: the bytes in flight across connections are at their cap",
    "frame_timeouts": "frames begun and not finished in time",
    "deep_frames": "frames nested too deep (answered with an error, not parsed)",
    "malformed_frames": "frames that are not a JSON object (answered with an error)",
}


# ------------------------------------------------------------------ the secret and the name
def key_path(path: str) -> str:
    return os.path.join(os.path.realpath(path), KEY_FILE)


def write_key(path: str) -> bytes:
    """A fresh secret in ``PATH/vllm.key``, readable by this user only."""
    secret = secrets.token_bytes(32)
    final = key_path(path)
    tmp = f"{final}.{os.getpid()}.tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secret.hex().encode())
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except OSError as e:
        raise EndpointError(f"kvdb: cannot write the connector's key file {final}: {e.strerror or e}") from None
    return secret


def read_key(path: str) -> bytes:
    """The worker's secret, from a key file this user owns and nobody else can read."""
    p = key_path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise EndpointError(f"no {p}: the worker that owns the Db has not started, or has stopped") from None
    except OSError as e:
        raise EndpointError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise EndpointError(f"{p} is not private to this user (owner uid {st.st_uid}, mode "
                                f"{st.st_mode & 0o777:o}): not trusted; remove it and restart vLLM")
        data = os.read(fd, 256)
    finally:
        os.close(fd)
    try:
        secret = bytes.fromhex(data.decode())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != 32:
        raise EndpointError(f"{p} does not hold a key (64 hex digits)")
    return secret


def socket_name(secret: bytes) -> bytes:
    """The abstract-namespace socket name of the worker holding ``secret``."""
    return b"\0kvdb-vllm-" + hashlib.sha256(b"kvdb vllm socket\0" + secret).hexdigest()[:40].encode()


def proof(secret: bytes, role: bytes, mine: bytes, theirs: bytes) -> str:
    return hmac.new(secret, role + b"\0" + mine + theirs, hashlib.sha256).hexdigest()


def peer_creds(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


# ------------------------------------------------------------------ frames
def encode(obj: dict, limit: int = MAX_FRAME) -> bytes:
    data = json.dumps(obj, default=str).encode()
    if len(data) > limit:
        raise FrameTooLarge(f"a request of {len(data)} bytes is over the connector socket's {limit}-byte frame limit")
    return _LEN.pack(len(data)) + data


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    """``n`` bytes as they arrive (no buffer sized from what the peer declared), by ``deadline``."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return buf


def recv_obj(sock: socket.socket, limit: int, deadline: float | None) -> dict:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if n > limit:
        raise _Oversize(f"a frame of {n} bytes is over the {limit}-byte limit")
    obj = json.loads(recv_exact(sock, n, deadline))
    if not isinstance(obj, dict):
        raise ValueError("a frame must hold a JSON object")
    return obj


class _Oversize(ConnectionError):
    pass


def depth(data: bytes | bytearray) -> int:
    """How deep ``[`` and ``{`` nest in a JSON text (outside its strings), without parsing it."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return MAX_DEPTH  # cannot be deeper
    a = np.frombuffer(_STRING.sub(b"", data).translate(None, _NOT_BRACKET), dtype=np.uint8)
    if a.size == 0:
        return 0
    steps = np.where((a == ord("[")) | (a == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


# ------------------------------------------------------------------ the server
class Server:
    """Serves ``handler(dict) -> dict`` to the scheduler half; one thread per connection, bounded
    as the module docstring says."""

    def __init__(self, handler, path: str) -> None:
        self.handler = handler
        self.path = path
        self.max_connections, self.per_process, self.max_handshakes, self.engine_connections = 16, 4, 8, 4
        self.max_inflight = 4 * MAX_FRAME
        self.handshake_timeout_s = 5.0
        self.frame_timeout_s = 30.0
        self.engine_pids = {os.getpid(), os.getppid()}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()  # guards the counts below and counters
        self._by_pid: dict[int, int] = {}
        self._engine_open = self._others_open = self._handshaking = 0
        self._inflight = self._inflight_others = 0
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []  # close() joins them (kvdb/threads.py)
        self._closed = False
        self.secret = write_key(path)
        self.name = socket_name(self.secret)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.name)
        except OSError as e:
            self.sock.close()
            raise EndpointError(
                f"kvdb: cannot serve the vLLM scheduler for {path}: {e.strerror or e} (the socket "
                f"@{self.name[1:].decode()} is held by another process); a fresh name is drawn at each start, so "
                "start vLLM again, and find the holder with `ss -xlp | grep kvdb-vllm` if it recurs") from None
        self.sock.listen(64)
        self._thread = threading.Thread(target=self._accept, name="kvdb-vllm-lookup", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- counting
    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1
            n = self.counters[name]
        if name != "connections" and n & (n - 1) == 0:  # 1, 2, 4, 8, ...
            log.warning("kvdb: connector socket: %s (%d so far)", COUNTERS[name], n)

    def status(self) -> dict:
        with self._lock:
            return {"counters": dict(self.counters),
                    "open": {"engine": self._engine_open, "others": self._others_open,
                             "handshaking": self._handshaking},
                    "inflight_bytes": self._inflight,
                    "limits": {"max_connections": self.max_connections, "per_process": self.per_process,
                               "max_handshakes": self.max_handshakes, "engine_connections": self.engine_connections,
                               "max_frame": MAX_FRAME, "max_inflight": self.max_inflight, "max_depth": MAX_DEPTH}}

    def _admit(self, pid: int, engine: bool) -> bool:
        with self._lock:
            if engine:
                if self._engine_open >= self.engine_connections:
                    return False
                self._engine_open += 1
            else:
                if (self._others_open >= self.max_connections or self._handshaking >= self.max_handshakes
                        or self._by_pid.get(pid, 0) >= self.per_process):
                    return False
                self._others_open += 1
                self._handshaking += 1
                self._by_pid[pid] = self._by_pid.get(pid, 0) + 1
            return True

    def _leave(self, pid: int, engine: bool, handshaking: bool) -> None:
        with self._lock:
            if engine:
                self._engine_open -= 1
                return
            self._others_open -= 1
            self._handshaking -= handshaking
            left = self._by_pid[pid] - 1
            if left:
                self._by_pid[pid] = left
            else:
                del self._by_pid[pid]

    def _reserve(self, n: int, engine: bool) -> bool:
        with self._lock:
            if self._inflight + n > self.max_inflight:
                return False
            if not engine and self._inflight_others + n > self.max_inflight - MAX_FRAME:
                return False
            self._inflight += n
            self._inflight_others += 0 if engine else n
            return True

    def _release(self, n: int, engine: bool) -> None:
        with self._lock:
            self._inflight -= n
            self._inflight_others -= 0 if engine else n

    # -------------------------------------------------------------- connections
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                pid, uid = peer_creds(conn)
            except OSError:
                conn.close()
                continue
            if uid != os.getuid():  # T1
                conn.close()
                self._count("foreign_peers")
                continue
            engine = pid in self.engine_pids
            if not self._admit(pid, engine):
                conn.close()
                self._count("refused_connections")
                continue
            self._count("connections")
            self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn, pid, engine), name="kvdb-vllm-conn", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            try:
                t.start()
            except RuntimeError:  # no thread to be had: undo the admission, refuse it like one over the cap
                self._leave(pid, engine, not engine)
                self._conns.discard(conn)
                conn.close()
                self._count("refused_connections")

    def _handshake(self, conn: socket.socket) -> bool:
        deadline = time.monotonic() + self.handshake_timeout_s
        hello = recv_obj(conn, HANDSHAKE_MAX_BYTES, deadline)
        theirs = bytes.fromhex(str(hello.get("nonce", "")))
        if len(theirs) != 16:
            raise ValueError("a hello needs a 16-byte nonce")
        mine = secrets.token_bytes(16)
        conn.sendall(encode({"nonce": mine.hex(), "proof": proof(self.secret, b"server", theirs, mine)}))
        got = recv_obj(conn, HANDSHAKE_MAX_BYTES, deadline)
        if not hmac.compare_digest(str(got.get("proof", "")), proof(self.secret, b"client", mine, theirs)):
            self._count("auth_failures")
            with contextlib.suppress(OSError):
                conn.sendall(encode({"error": "wrong proof: this peer does not hold the worker's secret"}))
            return False
        conn.sendall(encode({"ok": True}))
        return True

    def _serve(self, conn: socket.socket, pid: int, engine: bool) -> None:
        handshaking = not engine
        try:
            try:
                if not self._handshake(conn):
                    return
            except TimeoutError:
                self._count("handshake_timeouts")
                return
            if handshaking:
                with self._lock:
                    self._handshaking -= 1
                handshaking = False
            while not self._closed:
                conn.settimeout(None)
                first = conn.recv(1)  # between frames a connection may idle
                if not first:
                    return
                deadline = time.monotonic() + self.frame_timeout_s
                (n,) = _LEN.unpack(first + recv_exact(conn, _LEN.size - 1, deadline))
                if n > MAX_FRAME:
                    self._count("oversize_frames")
                    return
                if not self._reserve(n, engine):
                    self._count("busy_frames")
                    return
                try:
                    reply = self._answer(recv_exact(conn, n, deadline))
                finally:
                    self._release(n, engine)
                conn.settimeout(self.frame_timeout_s)
                try:
                    data = encode(reply)
                except FrameTooLarge as e:
                    data = encode({"error": str(e)})
                conn.sendall(data)
        except TimeoutError:
            self._count("frame_timeouts")
        except _Oversize:
            self._count("oversize_frames")
        except (OSError, ConnectionError):
            pass
        except ValueError:  # a malformed handshake frame
            self._count("malformed_frames")
        finally:
            self._leave(pid, engine, handshaking)
            self._conns.discard(conn)
            conn.close()

    def _answer(self, body: bytearray) -> dict:
        if depth(body) > MAX_DEPTH:
            self._count("deep_frames")
            return {"error": f"a frame nested deeper than {MAX_DEPTH} levels is refused"}
        try:
            obj = json.loads(body)
        except ValueError as e:
            obj = e
        if not isinstance(obj, dict):
            self._count("malformed_frames")
            return {"error": "a frame must hold a JSON object"}
        return self.handler(obj)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in list(self._conns):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        join_all(self._threads, 5)
        with contextlib.suppress(OSError):
            os.unlink(key_path(self.path))


# ------------------------------------------------------------------ the client
def connect(path: str, timeout_s: float) -> socket.socket:
    """A connection to the worker of the Db at ``path``, both sides checked (the module docstring);
    ``EndpointError`` or ``OSError`` when there is no such worker or it is not to be trusted."""
    secret = read_key(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout_s)
        s.connect(socket_name(secret))
        _pid, uid = peer_creds(s)
        if uid != os.getuid():
            raise EndpointError(f"the connector's socket is held by uid {uid}, not this user: not trusted")
        deadline = time.monotonic() + timeout_s
        mine = secrets.token_bytes(16)
        s.sendall(encode({"nonce": mine.hex()}))
        got = recv_obj(s, HANDSHAKE_MAX_BYTES, deadline)
        theirs = bytes.fromhex(str(got.get("nonce", "")))
        if not hmac.compare_digest(str(got.get("proof", "")), proof(secret, b"server", mine, theirs)):
            raise EndpointError("the process on the connector's socket does not hold the worker's secret: not trusted")
        s.sendall(encode({"proof": proof(secret, b"client", theirs, mine)}))
        ok = recv_obj(s, HANDSHAKE_MAX_BYTES, deadline)
        if ok.get("ok") is not True:
            raise EndpointError(f"the worker refused this connection: {ok.get('error')}")
        return s
    except BaseException:
        s.close()
        raise


class ServiceClient:
    """The scheduler's view of a service in another process. A call that cannot reach the worker
    within ``timeout_s`` returns None (the caller treats it as a miss) and the next call
    reconnects. A request over the frame limit raises ``FrameTooLarge`` before anything is sent."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.failures = 0

    def call(self, msg: dict) -> dict | None:
        data = encode(msg)
        with self._lock:
            for attempt in range(2):  # a dropped connection is retried once on a fresh one
                try:
                    if self._sock is None:
                        self._sock = connect(self.path, self.timeout_s)
                    self._sock.settimeout(self.timeout_s)
                    self._sock.sendall(data)
                    return recv_obj(self._sock, MAX_FRAME, time.monotonic() + self.timeout_s)
                except (OSError, ConnectionError, ValueError, EndpointError) as e:
                    self.close_locked()
                    if attempt == 1 or isinstance(e, EndpointError):
                        self.failures += 1
                        if self.failures in (1, 10, 100) or self.failures % 1000 == 0:
                            log.warning("kvdb: the worker's Db did not answer (%s); %d lookups missed so far",
                                        e, self.failures)
                        return None
            return None

    def close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
