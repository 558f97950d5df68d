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
from typing import TYPE_CHECKING, Sequence

from kvdb import errors

if TYPE_CHECKING:
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
    peers: Sequence[str] = (),
    replicas: Sequence[str] = (),
    replication_secret_file: str | os.PathLike | None = None,
    replication_transport: str | None = None,
    **kwargs,
) -> Db:
    """Open (creating when new) the kvdb data directory at ``path``. See :class:`Db` for options.

    Replication (kvdb/replication/, attached to the Db from above): ``peers`` ("host:port")
    serve local lookup misses, ``replicas`` are followers the log ships to, both with the
    shared secret in ``replication_secret_file``; ``replication_transport`` picks the data
    plane ("auto", "mooncake", "tcp": kvdb/replication/transport.py)."""
    from kvdb.db import Db

    db = Db(path, **kwargs)
    if peers or replicas or replication_secret_file is not None:
        try:
            from kvdb.replication.attach import attach_replication  # only for a replicated Db

            attach_replication(db, peers, replicas, replication_secret_file, replication_transport)
        except BaseException:
            db.close()
            raise
    return db
