"""A real Mooncake Store pool for tests: ``mooncake_master`` and storage processes in a private
network namespace, stopped by pid. Used by tests/shared/ and tests/integrations/ through the
fixtures of tests/conftest.py (``shared_netns``, ``pool_factory``, ``pool``).

The Store's listeners bind 0.0.0.0, so every pool runs inside a fresh network namespace with
only loopback up (kvdb/replication/netns.py), entered by the test's thread: the master, the
storage processes, child engines (vLLM's too) and the in-process client share it. Without the
Mooncake wheel (or without namespaces) the tests skip saying why, except under
KVDB_REQUIRE_VLLM=1 (CI), where they fail.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STORAGE_NODE = Path(__file__).with_name("mooncake_storage_node.py")
_ports = iter(range(50100, 60000, 2))  # master rpc port, metrics port + 1: one pair per pool


def master_binary() -> str | None:
    found = shutil.which("mooncake_master", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                    os.environ.get("PATH", "")]))
    if found:
        return found
    try:
        import mooncake

        p = Path(mooncake.__file__).parent / "mooncake_master"
        return str(p) if p.exists() else None
    except ImportError:
        return None


@functools.lru_cache(maxsize=1)
def why_no_pool() -> str | None:
    """None when a pool can run here, else the reason (for a skip message)."""
    from kvdb.replication.netns import netns_unavailable
    from kvdb.shared.client import mooncake_store_error

    why = mooncake_store_error()
    if why:
        return f"the Mooncake Store client does not import ({why})"
    ns = netns_unavailable()
    if ns:
        return f"the Store listens on 0.0.0.0 and no private network namespace is available ({ns})"
    if master_binary() is None:
        return "the Mooncake wheel has no mooncake_master binary"
    return None


def need_pool() -> None:
    why = why_no_pool()
    if why is not None:
        if os.environ.get("KVDB_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVDB_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL when the test process dies (PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


class Pool:
    """A master and storage processes on 127.0.0.1 inside the caller's network namespace."""

    def __init__(self, storage_bytes: list[int], lease_ms: int = 2000) -> None:
        self.port = next(_ports)
        self.lease_ms = lease_ms
        self.url = f"mooncake://127.0.0.1:{self.port}"
        self.master: subprocess.Popen | None = None
        self.storage: list[subprocess.Popen] = []
        self.start_master()
        for nbytes in storage_bytes:
            self.add_storage(nbytes)
        self.wait_ready()

    def start_master(self) -> None:
        self.master = subprocess.Popen(
            [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
             f"--default_kv_lease_ttl={self.lease_ms}", "--client_ttl=3", f"--metrics_port={self.port + 1}",
             "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def add_storage(self, nbytes: int) -> None:
        p = subprocess.Popen([sys.executable, str(STORAGE_NODE), str(self.port), str(nbytes)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = p.stdout.readline().strip()
        assert line == "ready", f"storage process: {line!r}"
        self.storage.append(p)

    def raw_client(self):
        """A raw Store client (a pure client) for writing bad objects straight into the pool."""
        from mooncake.store import MooncakeDistributedStore

        c = MooncakeDistributedStore()
        assert c.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{self.port}") == 0
        return c

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        c = self.raw_client()
        deadline = time.monotonic() + timeout_s
        while c.is_exist("probe") < 0:
            assert time.monotonic() < deadline, "the master never answered"
            time.sleep(0.05)
        c.close()

    def kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for p in [self.master, *self.storage]:
            if p is not None:
                self.kill(p)
