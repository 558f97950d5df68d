"""``kvdb bench scale``'s write-back figures: what a stop costs with dirty pages in DRAM.

* ``close_gbps``       ``Db.close()`` of a Db whose host tier holds ``writeback_mib`` of dirty
                       2 MiB pages (``put_blocks`` with durability ``none``): every page written
                       to the log, one fsync, the index checkpointed;
* ``raw_write_gbps``   the baseline: the same bytes appended to a new file in writes of 4 MiB,
                       then one ``fdatasync`` -- the disk's sequential write speed as a program
                       sees it through the page cache.

The two sides alternate which goes first; figures are medians of ``repeats``. Goal printed with
them: close >= 0.5 x raw.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

import numpy as np
import torch

import kvdb
from kvdb.format.layout import BlockLayout

#: 2 MiB pages (bf16: 32 layers x k/v x 16 tokens x 8 heads x 128), a Llama-3-8B block
PAGE2M = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
CLOSE_GOAL = 0.5
_WRITE = 4 << 20


def _blocks(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(-(1 << 15), 1 << 15, (n, *PAGE2M.block_shape), dtype=torch.int16, generator=g).view(PAGE2M.dtype)


def close_seconds(path: str, blocks: torch.Tensor, copies: int) -> float:
    """Seconds for ``close()`` of a Db holding ``copies`` x ``len(blocks)`` dirty pages."""
    n = copies * blocks.shape[0]
    db = kvdb.open(path, layout=PAGE2M, model_id="bench-writeback", host_bytes=(n + 8) * PAGE2M.page_bytes)
    for c in range(copies):
        keys = [c.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(blocks.shape[0])]
        db.put_blocks(keys, blocks)
    t0 = time.perf_counter()
    db.close()
    return time.perf_counter() - t0


def raw_write_seconds(path: str, src: np.ndarray, copies: int) -> float:
    """Seconds to append ``copies`` x ``src`` to a new file in 4 MiB writes, then fdatasync."""
    mv = memoryview(src.reshape(-1))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(copies):
            for at in range(0, len(mv), _WRITE):
                os.write(fd, mv[at : at + _WRITE])
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def bench_writeback(root: str, *, writeback_mib: int = 512, repeats: int = 3, tick=None) -> dict:
    per = 64  # pages per distinct batch (128 MiB), put again under other keys up to writeback_mib
    copies = max(1, (writeback_mib << 20) // (per * PAGE2M.page_bytes))
    blocks = _blocks(per)
    src = blocks.view(torch.uint8).reshape(per, PAGE2M.page_bytes).numpy()
    gb = copies * per * PAGE2M.page_bytes / 1e9
    close_s, raw_s = [], []
    for r in range(repeats):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            if side == 0:
                raw_s.append(raw_write_seconds(os.path.join(root, f"raw-{r}"), src, copies))
                os.unlink(os.path.join(root, f"raw-{r}"))
            else:
                path = os.path.join(root, f"wb-{r}")
                close_s.append(close_seconds(path, blocks, copies))
                shutil.rmtree(path, ignore_errors=True)
        if tick is not None:
            tick()
    close_gbps, raw_gbps = gb / statistics.median(close_s), gb / statistics.median(raw_s)
    return {
        "writeback_mib": copies * per * PAGE2M.page_bytes >> 20,
        "close_gbps": round(close_gbps, 3),
        "close_raw_write_gbps": round(raw_gbps, 3),
        "close_vs_raw": round(close_gbps / raw_gbps, 3),
        "close_gbps_runs": [round(gb / s, 3) for s in close_s],
        "close_raw_write_gbps_runs": [round(gb / s, 3) for s in raw_s],
        "close_goal_min": CLOSE_GOAL,
    }


__all__ = ["PAGE2M", "bench_writeback", "close_seconds"]
