"""``kvdb bench datapath``: host-tier put / get bandwidth against torch ``copy_`` of the same bytes.

Baseline (docs/benchmarks.md): ``copy_`` of one batch into a preallocated tensor of the same size, timed
in the same process right before the Db runs. Figures are best-of-N per batch (bandwidth is a
property of the path, not of the noisiest moment on a shared 2-core machine).

``metadata_bytes_per_block`` is the Db's own Python-side memory per resident block (page
table, key objects, per-frame arrays, replacer), measured with tracemalloc over a Db holding
``meta_blocks`` tiny blocks. Arena memory is torch's and is not counted (it is the payload).
"""

from __future__ import annotations

import gc
import tempfile
import time
import tracemalloc

import torch

from kvdb.format.layout import BlockLayout
from kvdb.db import Db

BENCH_LAYOUT = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)


def bench_bandwidth(batch: int = 64, batches: int = 4, repeats: int = 5, layout: BlockLayout = BENCH_LAYOUT) -> dict:
    page = layout.page_bytes
    n_blocks = batch * batches
    src = torch.randint(-1000, 1000, (batch, *layout.block_shape), dtype=torch.int16).view(layout.dtype)
    dst = torch.zeros_like(src)  # zeros: faulted in, like the Db's arena
    out = torch.zeros_like(src)
    batch_bytes = batch * page

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as d:
        db = Db(d, layout=layout, model_id="bench-datapath", host_bytes=n_blocks * page, disk_bytes=0)
        try:
            tokens = torch.arange(n_blocks * layout.block_tokens * (repeats + 1))
            all_keys = db.block_keys(tokens)
            memcpy_times, put_times, get_times = [], [], []
            # interleaved, so the baseline and the Db see the same machine at the same moments
            for r in range(repeats):  # fresh keys each round: every put stores `batch` new blocks
                keys = all_keys[r * batch : (r + 1) * batch]
                memcpy_times.append(timed(lambda: dst.copy_(src)))
                stored = []
                put_times.append(timed(lambda: stored.append(db.put_blocks(keys, src))))
                if stored[0] != batch:
                    raise AssertionError(f"put stored {stored[0]} of {batch} blocks")
                get_times.append(timed(lambda: db.get_blocks(keys, out=out)))
            if not torch.equal(out.view(torch.int16), src.view(torch.int16)):
                raise AssertionError("get_blocks returned different bytes")
        finally:
            db.close()
    memcpy_s, get_s = min(memcpy_times), min(get_times)
    put_s = min(put_times)
    memcpy = batch_bytes / memcpy_s / 1e9
    return {
        "block_bytes": page,
        "blocks": batch,
        "batch_bytes": batch_bytes,
        "memcpy_gbps": round(memcpy, 3),
        "put_gbps": round(batch_bytes / put_s / 1e9, 3),
        "get_gbps": round(batch_bytes / get_s / 1e9, 3),
        "put_vs_memcpy": round(memcpy_s / put_s, 3),
        "get_vs_memcpy": round(memcpy_s / get_s, 3),
    }


def bench_metadata(meta_blocks: int = 1_000_000, batch: int = 65536) -> dict:
    """Python-side bytes per resident block with ``meta_blocks`` tiny blocks resident."""
    tiny = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=1, dtype=torch.float32)
    gc.collect()
    with tempfile.TemporaryDirectory() as d:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        db = Db(d, layout=tiny, model_id="bench-metadata", host_bytes=meta_blocks * tiny.page_bytes, disk_bytes=0)
        try:
            blocks = torch.zeros((batch, *tiny.block_shape), dtype=torch.float32)
            tokens = torch.arange(meta_blocks)
            for start in range(0, meta_blocks, batch):
                keys = db.block_keys(tokens[start : start + batch], tenant=f"t{start}")
                db.put_blocks(keys, blocks[: len(keys)])
                del keys
            gc.collect()
            resident = db.stats()["tiers"]["host"]["pages"]
            used = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
            db.close()
    return {"meta_blocks": resident, "metadata_bytes_per_block": round(used / max(1, resident), 1)}
