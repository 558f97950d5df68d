"""Fixtures for the shared-tier tests: a real Mooncake Store (``mooncake_master`` and storage
processes) in a private network namespace, stopped by pid.

The Store's listeners bind 0.0.0.0, so every pool runs inside a fresh network namespace with
only loopback up (kvdb/replication/netns.py), entered by the test's thread: the master, the
storage processes, child engines and the in-process client share it. Without the Mooncake
wheel (or without namespaces) the tests skip saying why, except under KVDB_REQUIRE_VLLM=1 (CI),
where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from kvdb import BlockLayout
from kvdb.replication.netns import netns_unavailable, private_netns
from kvdb.shared.client import mooncake_store_error

HERE = Path(__file__).resolve().parent
# 4 layers x 2 x 16 tokens x 8 heads x 128 dims x 2 bytes = 256 KiB pages (an engine's size)
LAYOUT = BlockLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)
_ports = iter(range(50100, 60000, 2))  # master rpc port, metrics port + 1: one pair per pool

_WHY = mooncake_store_error()
_WHY = _WHY and f"the Mooncake Store client does not import ({_WHY})"
if _WHY is None:
    _ns = netns_unavailable()
    _WHY = _ns and f"the Store listens on 0.0.0.0 and no private network namespace is available ({_ns})"


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


if _WHY is None and master_binary() is None:
    _WHY = "the Mooncake wheel has no mooncake_master binary"


def need_pool() -> None:
    if _WHY is not None:
        if os.environ.get("KVDB_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVDB_REQUIRE_VLLM=1 but {_WHY}")
        pytest.skip(_WHY)


def _die_with_parent() -> None:
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
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def add_storage(self, nbytes: int) -> None:
        p = subprocess.Popen([sys.executable, str(HERE / "storage_node.py"), str(self.port), str(nbytes)],
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


@pytest.fixture(scope="session")
def shared_netns():
    """One private namespace for every pool of the session: the Store client keeps process-wide
    connections and threads, made in the namespace they were first needed in, so each pool gets
    its own ports instead of its own namespace."""
    need_pool()
    with private_netns():
        yield


@pytest.fixture
def pool_factory(shared_netns):
    """``make(storage_bytes=[...])``: a fresh pool (master and storage processes) for this test,
    stopped by pid after it."""
    with ExitStack() as stack:
        def make(storage_bytes=(64 << 20,), **kw) -> Pool:
            p = Pool(list(storage_bytes), **kw)
            stack.callback(p.stop)
            return p

        yield make


@pytest.fixture
def pool(pool_factory):
    return pool_factory()


def make_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.block_shape), generator=g).to(LAYOUT.dtype)


def run_engine(*args: str, timeout_s: float = 60.0) -> dict:
    """Run tests/shared/engine.py in a child process (same namespace); its JSON answer."""
    r = subprocess.run([sys.executable, str(HERE / "engine.py"), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout_s, preexec_fn=_die_with_parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
