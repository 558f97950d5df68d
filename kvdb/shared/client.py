"""The Mooncake Store's Python client, as kvdb uses it: imported only here and only when a Db is
opened with ``shared=`` (``import kvdb`` and a Db without it never load Mooncake).

The client returns codes and never raises (docs/shared.md). Codes as kvdb reads them: a
non-negative get result is the object's size; OBJECT_NOT_FOUND is a miss; NO_SPACE is a full
pool (the put is dropped); codes at or below RPC_FAIL say the master or a storage node cannot be
reached (the breaker counts them); every other negative code (a lease refused, a replica not
ready, a buffer too small) is a miss for that key. kvdb never calls ``remove(force=True)``,
``remove_all`` or ``remove_by_regex`` (S6).
"""

from __future__ import annotations

import os

from kvdb.errors import InvalidInput
from kvdb.shared.url import SharedConfig

OBJECT_NOT_FOUND = -704
NO_SPACE = -200
RPC_FAIL = -900
#: local buffer the client keeps for transfers from unregistered memory (kvdb registers its own)
LOCAL_BUFFER_BYTES = 16 << 20


def mooncake_store_error() -> str | None:
    """None when the Store client imports here, else why not (for skip messages and errors)."""
    _quiet_log()
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # ImportError, or OSError when a shared library is missing
        return f"{type(e).__name__}: {e}"
    return None


def _quiet_log() -> None:
    # the Store's glog chatter (one banner per client) stays off stderr unless asked for, as
    # for the Transfer Engine (kvdb/replication/transport.py)
    if "MC_LOG_LEVEL" not in os.environ and "GLOG_minloglevel" not in os.environ:
        os.environ["MC_LOG_LEVEL"] = "ERROR"


def unreachable(code: int) -> bool:
    """Whether a per-key code says the pool itself could not be reached."""
    return code <= RPC_FAIL


class StoreClient:
    """One Store client: setup against the master, registered buffers, the batched calls kvdb
    makes. Every method may block (the master dead: ~4.3 s); call them through ``Calls.run``."""

    def __init__(self, cfg: SharedConfig) -> None:
        why = mooncake_store_error()
        if why is not None:
            raise InvalidInput(f"shared= needs the Mooncake Store client (pip install "
                               f"mooncake-transfer-engine-non-cuda): {why}")
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        self.cfg = cfg
        self._registered: list[int] = []

    def setup(self) -> int:
        c = self.cfg
        return self._store.setup(c.local, "P2PHANDSHAKE", c.lend_bytes, LOCAL_BUFFER_BYTES, c.protocol, c.device,
                                 c.master)

    def register(self, ptr: int, nbytes: int) -> int:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc == 0:
            self._registered.append(ptr)
        return rc

    def put_from(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._store.batch_put_from(names, ptrs, sizes)

    def get_into(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._store.batch_get_into(names, ptrs, sizes)

    def get_into_parts(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Each object into several buffers in order (its header here, its page there)."""
        return self._store.batch_get_into_multi_buffers(names, ptrs, sizes)

    def remove(self, names: list[str]) -> list[int]:
        """Remove objects, never forcing: one under a lease stays (its code says so)."""
        return self._store.batch_remove(names, False)

    def exists(self, name: str) -> int:
        """1 / 0, negative when the master cannot answer. Probes only names never stored (no
        lease is granted on a miss: Mooncake issue 2187)."""
        return self._store.is_exist(name)

    def close(self) -> None:
        for ptr in self._registered:
            self._store.unregister_buffer(ptr)
        self._registered.clear()
        self._store.close()
