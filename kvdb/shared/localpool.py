"""A private Mooncake Store pool on this machine: a ``mooncake_master`` and storage processes on
127.0.0.1, stopped by pid; for the shared tier's tests (tests/shared/conftest.py) and
``kvdb bench shared`` (kvdb/bench/shared.py).

The Store's listeners (the master's metrics server, every client's transfer engine) bind
0.0.0.0 whatever they are told, so a pool is only ever started inside a private network
namespace with only loopback up (``isolated()``, kvdb/netns.py): nothing it opens is
reachable from another machine. Where no namespace can be made (no CAP_SYS_ADMIN), ``isolated``
raises saying so instead of exposing the pool. Processes die with their parent
(``PR_SET_PDEATHSIG``). Nothing of Mooncake is imported until a pool is started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from itertools import count
from pathlib import Path

from kvdb.errors import InvalidInput
from kvdb.netns import die_with_parent  # noqa: F401  (its callers import it from here too)

_ports = count(50100, 2)  # master rpc port, metrics port + 1: one pair per pool of this process


def master_binary() -> str | None:
    """The ``mooncake_master`` next to this Python or in the Mooncake wheel; None without one."""
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


def pool_unavailable() -> str | None:
    """None when a private pool can be started here, else why not (skip and error messages)."""
    from kvdb.netns import netns_unavailable
    from kvdb.shared.client import mooncake_store_error

    why = mooncake_store_error()
    if why is not None:
        return f"the Mooncake Store client does not import ({why})"
    ns = netns_unavailable()
    if ns is not None:
        return f"the Store listens on 0.0.0.0 and no private network namespace is available ({ns})"
    if master_binary() is None:
        return "the Mooncake wheel has no mooncake_master binary"
    return None


@contextmanager
def isolated():
    """Run the body (the calling thread and what it starts) in a private network namespace with
    only loopback up; InvalidInput naming why when none can be made."""
    from kvdb.netns import private_netns

    why = pool_unavailable()
    if why is not None:
        raise InvalidInput(f"cannot start a private Mooncake pool: {why}")
    with private_netns():
        yield


class LocalPool:
    """A master and storage processes on 127.0.0.1 inside the caller's network namespace (enter
    ``isolated()`` first). ``url`` is the ``shared=`` option naming it."""

    def __init__(self, storage_bytes: list[int], lease_ms: int = 2000) -> None:
        self.port = next(_ports)
        self.lease_ms = lease_ms
        self.url = f"mooncake://127.0.0.1:{self.port}"
        self.master: subprocess.Popen | None = None
        self.storage: list[subprocess.Popen] = []
        try:
            self.start_master()
            for nbytes in storage_bytes:
                self.add_storage(nbytes)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def start_master(self) -> None:
        self.master = subprocess.Popen(
            [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
             f"--default_kv_lease_ttl={self.lease_ms}", "--client_ttl=3", f"--metrics_port={self.port + 1}",
             "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def add_storage(self, nbytes: int) -> None:
        p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("storage_node.py")), str(self.port),
                              str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.storage.append(p)
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"storage process: {line!r}")

    def raw_client(self, local_buffer_bytes: int = 16 << 20):
        """A raw Store client (a pure client): bad objects written straight into the pool, or the
        Store's own calls as a benchmark's baseline."""
        from mooncake.store import MooncakeDistributedStore

        c = MooncakeDistributedStore()
        rc = c.setup("127.0.0.1", "P2PHANDSHAKE", 0, local_buffer_bytes, "tcp", "", f"127.0.0.1:{self.port}")
        if rc != 0:
            raise RuntimeError(f"Store client setup: {rc}")
        return c

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        c = self.raw_client()
        deadline = time.monotonic() + timeout_s
        while c.is_exist("probe") < 0:
            if time.monotonic() >= deadline:
                c.close()
                raise RuntimeError("the master never answered")
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

    def __enter__(self) -> "LocalPool":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
