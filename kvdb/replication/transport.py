"""Data plane: how block bytes move between nodes.

Two transports behind one interface:

``MooncakeTransport`` (the default wherever the ``mooncake-transfer-engine-non-cuda`` wheel
imports) drives the Mooncake Transfer Engine: each node initialises one engine with
``P2PHANDSHAKE`` metadata (no etcd), protocol ``rdma`` when an RDMA NIC is present
(``/sys/class/infiniband`` is not empty) and ``tcp`` otherwise. The receiver registers a landing
region with the engine and names it in a REGION reply (``{"kind": "mooncake", "session":
"host:rpc_port"}`` plus the address); the sender registers its source memory (the caller's
pages tensor or the host arena, once, not a copy) and issues one batched one-sided write, then
sends a small authenticated control message with each block's XXH3-128 digest. The engine itself
has no authentication: anyone who can reach its port may write into registered memory, so a node
only stores landed bytes whose digest matches the HMAC-tagged control message, and the engine's
port must stay on a trusted fabric (docs/replication.md).

``TcpTransport`` is for platforms without the wheel: the bytes travel inline in the
HMAC-tagged control frame itself (``"inline": true``), sent straight from the source memory with
``sendmsg`` and received straight into a fresh tensor.

A pair of nodes uses the engine only when both ends have it; otherwise the inline path.
``KVDB_REPLICATION_TRANSPORT=tcp`` forces the inline path (``mooncake`` forbids the fallback).

The engine's own log (glog, C++) is quiet unless asked for: it reads ``MC_LOG_LEVEL`` (TRACE,
INFO, WARNING, ERROR; INFO by default, ~10 lines per engine started) when its module loads and
ignores ``GLOG_minloglevel``. Unless the user set one of the two, kvdb sets ``MC_LOG_LEVEL=ERROR``
before the import and keeps the start-up chatter (glog's "Logging before InitGoogleLogging"
banner, a "Local segment descriptor not found" the engine logs as an error on every first start)
out of stderr, reporting it only when the start fails. ``GLOG_minloglevel`` alone is mapped onto
``MC_LOG_LEVEL`` (0 INFO, 1 WARNING, 2+ ERROR); ``MC_LOG_LEVEL=INFO`` brings everything back.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvdb.errors import InvalidInput, ReplicationError

_TE_BATCH_ENTRIES = 256  # entries per batch_transfer_sync_write call


@dataclass
class Region:
    """Landing memory a receiver exposes for one connection; ``tensor`` is None when inline."""

    tensor: torch.Tensor | None
    addr: int
    nbytes: int


def rdma_available() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


_GLOG_LEVELS = {"0": "INFO", "1": "WARNING"}  # 2 and above: ERROR
# a glog line (``E1202 07:17:15.173599 32376 file.cpp:1098] ...``) or its pre-init banner
_GLOG_LINE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|WARNING: Logging before InitGoogleLogging)")


def engine_log_quiet() -> bool:
    """Set the engine's log level from the environment (before its module loads); True when the
    user asked for nothing and kvdb quiets it (see the module doc). Children inherit the choice."""
    if os.environ.get("KVDB_QUIET_MC_LOG") == "1" and os.environ.get("MC_LOG_LEVEL") == "ERROR":
        return True  # set by kvdb, in this process or a parent
    if "MC_LOG_LEVEL" in os.environ:
        return False
    glog = os.environ.get("GLOG_minloglevel")
    if glog is not None:
        os.environ["MC_LOG_LEVEL"] = _GLOG_LEVELS.get(glog.strip(), "ERROR")
        return False
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    os.environ["KVDB_QUIET_MC_LOG"] = "1"
    return True


@contextmanager
def _engine_start_log(quiet: bool):
    """While the engine starts: when ``quiet``, fd 2 goes to a scratch file; glog lines end in
    ``box`` (for an error message), any other line is passed on to stderr."""
    box: list[str] = []
    if not quiet:
        yield box
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            for line in f.read().decode(errors="replace").splitlines():
                if _GLOG_LINE.match(line):
                    box.append(line)
                else:
                    sys.stderr.write(line + "\n")


def mooncake_import_error() -> str | None:
    """None when the Transfer Engine imports here, else why not (for skip messages and logs)."""
    engine_log_quiet()
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # ImportError, or OSError when libibverbs1 / librdmacm1 are missing
        return f"{type(e).__name__}: {e}"
    return None


class Transport(ABC):
    """Moves byte ranges from local memory into a peer's landing region."""

    kind: str  # "mooncake" or "tcp"
    protocol: str  # the wire under it: "rdma" or "tcp"

    @abstractmethod
    def descriptor(self) -> dict:
        """What a peer needs to address this node's registered memory."""

    @abstractmethod
    def open_region(self, nbytes: int) -> Region:
        """Allocate landing memory of ``nbytes`` that peers may write into."""

    def close_region(self, region: Region) -> None:
        pass

    def register(self, tensor: torch.Tensor) -> bool:
        """Make ``tensor``'s memory a valid source (no copy); True when newly registered."""
        return False

    def register_range(self, ptr: int, nbytes: int, owner) -> bool:
        """Like ``register`` for raw memory (an mmap); ``owner`` stays alive while registered."""
        return False

    def unregister(self, tensor: torch.Tensor) -> None:
        pass

    def unregister_range(self, ptr: int) -> None:
        pass

    def can_write_to(self, peer: dict | None) -> bool:
        return False

    def write_async(self, peer: dict, srcs: list[tuple[int, int]], dst_addrs: list[int]):
        """Start a one-sided write of each (ptr, nbytes) source to the matching peer address."""
        raise ReplicationError(f"the {self.kind} transport cannot write into peer memory")

    def wait(self, handle) -> None:
        """Block until the write ``handle`` names is complete; ReplicationError if it failed."""

    def write(self, peer: dict, srcs: list[tuple[int, int]], dst_addrs: list[int]) -> None:
        """One-sided synchronous write."""
        self.wait(self.write_async(peer, srcs, dst_addrs))

    def close(self) -> None:
        pass


class TcpTransport(Transport):
    """The inline fallback: bytes ride in the control frames (see module doc)."""

    kind = "tcp"
    protocol = "tcp"

    def descriptor(self) -> dict:
        return {"kind": "tcp"}

    def open_region(self, nbytes: int) -> Region:
        return Region(None, 0, 0)


class MooncakeTransport(Transport):
    """The Mooncake Transfer Engine with P2P handshake metadata."""

    kind = "mooncake"

    def __init__(self, local_host: str = "127.0.0.1", protocol: str | None = None) -> None:
        err = mooncake_import_error()
        if err is not None:
            raise ReplicationError(
                f"the Mooncake Transfer Engine is not usable here ({err}); install "
                "mooncake-transfer-engine-non-cuda and libibverbs1 librdmacm1, or use the tcp transport"
            )
        from mooncake.engine import TransferEngine

        self.protocol = protocol or ("rdma" if rdma_available() else "tcp")
        self.local_host = local_host
        with _engine_start_log(engine_log_quiet()) as log:
            self.engine = TransferEngine()
            rc = self.engine.initialize(local_host, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            said = f"; the engine said: {' | '.join(log[-5:])}" if log else ""
            raise ReplicationError(
                f"Mooncake Transfer Engine failed to initialise on {local_host} with protocol "
                f"{self.protocol} (rc={rc}){said}"
            )
        self.session_id = f"{local_host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()  # guards _registered
        # base address -> (nbytes, storage kept alive while registered)
        self._registered: dict[int, tuple[int, object]] = {}

    def descriptor(self) -> dict:
        return {"kind": "mooncake", "session": self.session_id, "protocol": self.protocol}

    def can_write_to(self, peer: dict | None) -> bool:
        return bool(peer) and peer.get("kind") == "mooncake" and peer.get("protocol") == self.protocol

    def _covered(self, ptr: int, nbytes: int) -> bool:
        return any(b <= ptr and ptr + nbytes <= b + n for b, (n, _) in self._registered.items())

    def register(self, tensor: torch.Tensor) -> bool:
        """Register the whole host storage behind ``tensor`` (an arena is registered once, not
        per page). Returns True when this call registered it (the caller then unregisters)."""
        if tensor.device.type != "cpu":
            raise InvalidInput(f"the Transfer Engine path sends host memory; got a tensor on {tensor.device}")
        storage = tensor.untyped_storage()
        return self.register_range(storage.data_ptr(), storage.nbytes(), storage)

    def register_range(self, ptr: int, nbytes: int, owner) -> bool:
        """Register ``nbytes`` of host memory at ``ptr``; ``owner`` (a storage, an mmap) is kept
        alive while registered. True when this call registered it."""
        with self._lock:
            if nbytes == 0 or self._covered(ptr, nbytes):
                return False
            rc = self.engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise ReplicationError(f"Transfer Engine could not register {nbytes} bytes (rc={rc})")
            self._registered[ptr] = (nbytes, owner)
            return True

    def unregister(self, tensor: torch.Tensor) -> None:
        self.unregister_range(tensor.untyped_storage().data_ptr())

    def unregister_range(self, ptr: int) -> None:
        with self._lock:
            if self._registered.pop(ptr, None) is not None:
                self.engine.unregister_memory(ptr)

    def open_region(self, nbytes: int) -> Region:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.register(t)
        return Region(t, t.data_ptr(), nbytes)

    def close_region(self, region: Region) -> None:
        if region.tensor is not None:
            self.unregister(region.tensor)

    def write_async(self, peer: dict, srcs: list[tuple[int, int]], dst_addrs: list[int]) -> list[int]:
        """Submit the write and return at once (batch ids for ``wait``): the caller overlaps
        CPU work -- digests of the same blocks -- with the transfer."""
        target = peer["session"]
        ids = []
        for i in range(0, len(srcs), _TE_BATCH_ENTRIES):
            part = srcs[i : i + _TE_BATCH_ENTRIES]
            bid = self.engine.batch_transfer_async_write(
                target, [p for p, _ in part], dst_addrs[i : i + _TE_BATCH_ENTRIES], [n for _, n in part]
            )
            if not bid:
                if ids:
                    self.engine.get_batch_transfer_status(ids)
                raise ReplicationError(f"Transfer Engine could not submit a write of {len(part)} ranges to "
                                       f"{target}; the peer may be down")
            ids.append(bid)
        return [target, *ids]

    def wait(self, handle: list) -> None:
        target, ids = handle[0], handle[1:]
        if ids and self.engine.get_batch_transfer_status(ids) != 0:
            raise ReplicationError(
                f"Transfer Engine write to {target} failed; the peer may have restarted or dropped its landing region"
            )

    def write(self, peer: dict, srcs: list[tuple[int, int]], dst_addrs: list[int]) -> None:
        self.wait(self.write_async(peer, srcs, dst_addrs))

    def close(self) -> None:
        with self._lock:
            for ptr in list(self._registered):
                self.engine.unregister_memory(ptr)
            self._registered.clear()


_shared: dict[tuple[str, str, int], Transport] = {}
_shared_lock = threading.Lock()


def transport_kind(requested: str | None = None) -> str:
    """Resolve ``auto`` / None / the environment override to "mooncake" or "tcp"."""
    kind = requested or os.environ.get("KVDB_REPLICATION_TRANSPORT", "auto")
    if kind not in ("auto", "mooncake", "tcp"):
        raise InvalidInput(f"unknown replication transport {kind!r}; one of auto, mooncake, tcp")
    if kind == "auto":
        return "mooncake" if mooncake_import_error() is None else "tcp"
    return kind


def get_transport(kind: str | None = None, local_host: str = "127.0.0.1") -> Transport:
    """The process's shared transport of ``kind`` bound to ``local_host`` in the calling
    thread's network namespace (created once)."""
    kind = transport_kind(kind)
    # one engine per network namespace: an engine listens only in the namespace it started in
    try:
        netns = os.stat("/proc/thread-self/ns/net").st_ino
    except OSError:
        netns = 0
    with _shared_lock:
        t = _shared.get((kind, local_host, netns))
        if t is None:
            t = MooncakeTransport(local_host) if kind == "mooncake" else TcpTransport()
            _shared[(kind, local_host, netns)] = t
        return t
