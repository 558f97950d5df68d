"""kvdb: an embedded storage engine for LLM KV-cache blocks.

    import kvdb, torch
    layout = kvdb.BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16,
                              dtype=torch.bfloat16)
    with kvdb.open(path, layout=layout, model_id="llama-3-8b", host_bytes=4 << 30) as db:
        keys = db.block_keys(token_ids, tenant="acme")
        db.put_blocks(keys, blocks)
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Callable, Sequence

from kvdb import compiled, errors  # compiled first: KVDB_PURE_PYTHON applies to every module after it

if TYPE_CHECKING:
    import torch

    from kvdb.buffer_pool.replacer import Replacer
    from kvdb.db import Db, PinnedPages
    from kvdb.format.layout import BlockLayout
    from kvdb.types import BlockKey

__version__ = "0.1.0"

__all__ = ["BlockKey", "BlockLayout", "Db", "PinnedPages", "errors", "open", "__version__"]

# imported on first use (PEP 562): ``import kvdb`` and ``kvdb --version`` / ``--help`` stay free
# of torch, which the Db, the layout and the key types need
_LAZY = {"Db": "kvdb.db", "PinnedPages": "kvdb.db", "BlockLayout": "kvdb.format.layout", "BlockKey": "kvdb.types"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvdb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def open(  # noqa: A001 - mirrors sqlite3.connect / rocksdb open
    path: str | os.PathLike,
    *,
    layout: BlockLayout | None = None,
    model_id: str | None = None,
    host_bytes: int | str = 1 << 30,
    device_bytes: int | str = 0,
    device: str | torch.device | None = None,
    replacer: str | Callable[[int], Replacer] = "lru",
    durability: str = "none",
    disk_bytes: int | str | None = None,
    codec: str = "raw",
    encryption_key_file: str | os.PathLike | None = None,
    key_secret: bytes | None = None,
    key_algo: str = "sha256",
    model_revision: str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    pp_rank: int | None = None,
    pp_size: int | None = None,
    device_free_fraction: float = 0.0,
    clock: Callable[[], float] | None = None,
    session_idle_s: float | None = 3600.0,
    max_space_amp: float | None = 2.0,
    read_only: bool = False,
    writeback_s: float | None = 1.0,
    peers: Sequence[str] = (),
    replicas: Sequence[str] = (),
    replication_secret_file: str | os.PathLike | None = None,
    replication_transport: str | None = None,
    shared: str | None = None,
    shared_bytes: int | str = 0,
) -> Db:
    """Open (creating when new) the kvdb data directory at ``path``.

    A new directory needs ``layout`` (a :class:`BlockLayout`) and ``model_id``; a reopened one
    takes both from its ``MANIFEST.json`` and refuses different ones. Tiers: ``host_bytes``,
    ``device_bytes`` (on ``device``; a device tier needs CUDA unless ``device="cpu"``) and
    ``disk_bytes`` (None: unbounded; 0: no disk tier), each an int or a string such as "4GiB".
    ``replacer`` picks the eviction policy (a name from kvdb/planner/policies/ or a factory
    ``num_frames -> Replacer``); ``durability`` the default of ``put_blocks`` ("none", "group",
    "sync"); ``codec`` ("raw", "zstd") and ``encryption_key_file`` the disk tier's payloads.
    Keys: ``key_secret`` (default: the directory's ``KEY_SECRET``), ``key_algo``,
    ``model_revision`` and the parallel ranks ``tp_rank`` / ``tp_size`` / ``pp_rank`` /
    ``pp_size`` (0 <= rank < size) namespace them. ``device_free_fraction``: device frames kept
    free by demotion; ``clock``: the plans' time base (default ``time.monotonic``);
    ``session_idle_s``: idle sessions end after it (None: never); ``max_space_amp``: the disk
    tier compacts past it (None: only ``kvdb compact``); ``read_only``: inspection, no byte
    written; ``writeback_s``: pages put with durability "none" reach the disk tier within about
    this many seconds (the background writer, kvdb/db/writeback.py; None: only on eviction,
    flush and close). Every option is documented with :class:`Db` (kvdb/db/core.py).

    Replication (kvdb/replication/, attached to the Db from above): ``peers`` ("host:port")
    serve local lookup misses, ``replicas`` are followers the log ships to, both with the
    shared secret in ``replication_secret_file``; ``replication_transport`` picks the data
    plane ("auto", "mooncake", "tcp": kvdb/replication/transport.py).

    Shared tier (kvdb/shared/, docs/shared.md): ``shared="mooncake://HOST:PORT"`` (a Mooncake
    Store master; options as a query: ``?protocol=rdma&device=mlx5_0``) publishes new blocks to
    the pool in the background and serves lookup misses from it; ``shared_bytes`` is the memory
    this process lends the pool (0: a pure client). Without ``shared`` nothing Mooncake loads."""
    from kvdb.db import Db

    shared_cfg = None
    if shared is not None or shared_bytes not in (0, "0"):
        from kvdb.shared.url import parse_shared  # checked before the directory is touched

        if shared is None:
            raise errors.InvalidInput("shared_bytes= needs shared='mooncake://HOST:PORT'")
        if read_only:
            raise errors.InvalidInput("a read_only Db has no shared tier; open it without shared=")
        shared_cfg = parse_shared(shared, shared_bytes)

    db = Db(path, layout=layout, model_id=model_id, host_bytes=host_bytes, device_bytes=device_bytes, device=device,
            replacer=replacer, key_secret=key_secret, key_algo=key_algo, model_revision=model_revision,
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, durability=durability,
            disk_bytes=disk_bytes, codec=codec, encryption_key_file=encryption_key_file,
            device_free_fraction=device_free_fraction, clock=clock, session_idle_s=session_idle_s,
            max_space_amp=max_space_amp, read_only=read_only, writeback_s=writeback_s)
    if peers or replicas or replication_secret_file is not None:
        try:
            from kvdb.replication.attach import attach_replication  # only for a replicated Db

            attach_replication(db, peers, replicas, replication_secret_file, replication_transport)
        except BaseException:
            db.close()
            raise
    if shared_cfg is not None:
        try:
            from kvdb.shared.attach import attach_shared  # only for a Db with a shared tier

            attach_shared(db, shared_cfg, encryption_key_file)
        except BaseException:
            db.close()
            raise
    return db
