"""Fixtures for replication tests.

Every test that starts a Mooncake Transfer Engine runs inside a private network namespace with
only loopback up (``netns`` fixture): the engine binds 0.0.0.0 whatever it is told. The
namespace is entered by the test's thread, so node servers started from it (threads or
``kvdb replicate serve`` subprocesses) and the in-process engine share ONE namespace.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import helpers
import pytest
import torch

from kvdb import BlockLayout
from kvdb.bench.replication import die_with_parent
from kvdb.netns import netns_unavailable, private_netns
from kvdb.replication.transport import mooncake_import_error

SECRET = b"0123456789abcdef-test-cluster-secret"
#: the cluster's key secret: every node of a test cluster is given it (kvdb.open(key_secret=),
#: serve --key-secret-file), as docs/replication.md "One key namespace per cluster" asks; a
#: follower of another one refuses its leader (tests/replication/test_key_namespace.py)
KEY_SECRET = b"kvdb-test-cluster-key-secret-32b"
# 4 layers x 2 (k, v) x 16 tokens x 2 heads x 32 dims x 2 bytes = 16 KiB pages
LAYOUT = BlockLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_tokens=16, dtype=torch.bfloat16)
#: a Db of the replication tests: 64 host pages of LAYOUT over an unbounded disk tier, in the
#: cluster's key namespace
open_db = partial(helpers.open_db, layout=LAYOUT, host_pages=64, disk_bytes=None, key_secret=KEY_SECRET)
#: NodeProc's default key secret file: one holding KEY_SECRET, beside the cluster secret file
CLUSTER_KEYS = "cluster"

_NETNS_WHY = netns_unavailable()
_TE_WHY = mooncake_import_error()

# Without the engine nothing here listens beyond 127.0.0.1, so a namespace is only a must with it.
_ISOLATION_WHY = None if _NETNS_WHY is None or _TE_WHY is not None else (
    f"the Transfer Engine is installed and listens on 0.0.0.0, and no private network namespace "
    f"is available to contain it ({_NETNS_WHY})")
needs_netns = pytest.mark.skipif(_ISOLATION_WHY is not None, reason=_ISOLATION_WHY or "")
needs_te = pytest.mark.skipif(
    _TE_WHY is not None or _NETNS_WHY is not None,
    reason=f"Mooncake Transfer Engine unusable here ({_TE_WHY})" if _TE_WHY
    else f"the Transfer Engine listens on 0.0.0.0 and no private network namespace is available ({_NETNS_WHY})",
)

TRANSPORTS = [pytest.param("mooncake", marks=needs_te), pytest.param("tcp", marks=needs_netns)]


@pytest.fixture
def netns():
    """Run the test body inside a fresh network namespace (loopback only); where none can be
    made and the engine is not installed either, run it as is (only 127.0.0.1 listeners)."""
    if _ISOLATION_WHY is not None:
        pytest.skip(_ISOLATION_WHY)
    if _NETNS_WHY is not None:
        yield
        return
    with private_netns():
        yield


def write_key_secret_file(path, secret: bytes = KEY_SECRET):
    """A key secret file (``serve --key-secret-file``) at ``path``; returns ``path``."""
    path.write_bytes(secret)
    return path


@pytest.fixture
def secret_file(tmp_path):
    p = tmp_path / "cluster.secret"
    p.write_bytes(SECRET + b"\n")
    return p


def wait_for(cond, what: str, timeout_s: float = 30.0, poll_s: float = 0.02):
    """``cond()``'s first truthy value, polled every ``poll_s``; AssertionError naming ``what``
    after ``timeout_s`` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def make_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.block_shape), generator=g).to(LAYOUT.dtype)


def make_keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


class NodeProc:
    """A ``kvdb replicate serve`` subprocess (started inside the caller's namespace)."""

    def __init__(self, db_path, secret_file, *, port: int = 0, transport: str | None = None, disk_bytes=None,
                 wait: bool = True, replicas=(), key_secret_file=CLUSTER_KEYS, allow_foreign_keys: bool = False):
        if transport is None:  # never let a node start an engine where this process could not contain it
            transport = "auto" if _TE_WHY is None else "tcp"
        self.db_path, self.secret_file, self.transport, self.disk_bytes = db_path, secret_file, transport, disk_bytes
        self.replicas = list(replicas)
        if key_secret_file == CLUSTER_KEYS:  # the cluster's (KEY_SECRET); None: the Db's own
            key_secret_file = write_key_secret_file(Path(secret_file).parent / "cluster.keysecret")
        self.key_secret_file = key_secret_file  # --key-secret-file
        self.allow_foreign_keys = allow_foreign_keys  # --allow-foreign-keys: a raw byte mirror
        self.port = port
        self.spawn()
        if wait:
            self.wait_ready()

    def start(self) -> "NodeProc":
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        cmd = [sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "replicate", "serve",
               "--db", str(self.db_path), "--listen", f"127.0.0.1:{self.port}", "--secret-file",
               str(self.secret_file), "--transport", self.transport, "--json",
               "--layout", json.dumps(LAYOUT.to_dict()), "--model-id", "test-model",
               "--host-bytes", str(256 * LAYOUT.page_bytes)]
        if self.disk_bytes is not None:
            cmd += ["--disk-bytes", str(self.disk_bytes)]
        for r in self.replicas:
            cmd += ["--replica", r]
        if self.key_secret_file is not None:
            cmd += ["--key-secret-file", str(self.key_secret_file)]
        if self.allow_foreign_keys:
            cmd += ["--allow-foreign-keys"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     preexec_fn=die_with_parent)

    def wait_ready(self) -> "NodeProc":
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node for {self.db_path} exited with {self.proc.wait()} before listening")
        info = json.loads(line)
        self.address = info["address"]
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture
def nodes():
    started: list[NodeProc] = []

    def spawn(*args, **kw) -> NodeProc:
        n = NodeProc(*args, **kw)
        started.append(n)
        return n

    yield spawn
    for n in started:
        if n.proc.poll() is None:
            n.proc.kill()
            n.proc.wait()
