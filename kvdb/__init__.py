"""kvdb: an embedded storage engine for LLM KV-cache blocks.

    import kvdb, torch
    layout = kvdb.BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16,
                              dtype=torch.bfloat16)
    with kvdb.open(path, layout=layout, model_id="llama-3-8b", host_bytes=4 << 30) as db:
        keys = db.block_keys(token_ids, tenant="acme")
        db.put_blocks(keys, blocks)
"""

from kvdb import errors
from kvdb.buffer_pool.layout import BlockLayout
from kvdb.db import Db, PinnedPages, open
from kvdb.types import BlockKey

__version__ = "0.1.0"

__all__ = ["BlockKey", "BlockLayout", "Db", "PinnedPages", "errors", "open", "__version__"]
