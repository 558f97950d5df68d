"""``kvdb bench scale``'s ingest and open figures (issue 12 items 2 and 5), each against a
baseline from the same run.

* ``ingest_gbps``           ``Db.put_blocks(tier="disk", durability="none")`` of fresh keys in
                            batches of ``batch_mib``, then one ``Db.flush`` (fsync, index applied),
                            into a new store;
* ``raw_write_gbps``        the baseline: the same page bytes appended to a new file with one
                            ``write`` per batch, then one ``fdatasync``; the same durability as
                            ``none``: meanwhile a thread fdatasyncs every 50 ms, as the store's
                            flusher does;
* ``ingest_us_per_block``   process CPU time (every thread: the flusher's too) per block of the
                            ingest; ``raw_write_us_per_block`` the same for the baseline, and
                            ``ingest_cpu_beyond_raw_us`` their difference: the store's CPU per
                            block beyond writing the bytes (goal <= 5 us);
* ``index_us_per_block``    what one RocksDB entry per block costs by itself, measured beside
                            it: the index work one fresh block takes through the store's own
                            Index (kvdb/cold/index.py: rocksdict, its options, its Python step
                            per key) -- the multi-get of its absent key (the old-location
                            lookup, in the caller's thread:
                            ``index_lookup_us_per_block``) and one 48-byte entry in a write
                            batch (the flusher's thread) -- in put-sized batches into a new
                            index (the store's apply batches are whatever became durable since
                            the last); ``goal_budget_us_per_block`` is what the goal leaves for
                            all of the store's work per block beyond the raw write: the
                            baseline's wall time per block x (1 / goal - 1). The index's part
                            can overlap the writes only on a core they leave idle.

The open figures are kvdb/bench/reopen.py's.

Phases alternate which side goes first; figures are medians of ``repeats``. Goals printed with
them: ingest >= 0.8 x raw at 4 KiB and >= 0.9 x at 64 KiB.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time

import numpy as np
import torch

import kvdb
from kvdb.cold.index import Index
from kvdb.format import index_value as iv
from kvdb.format.layout import BlockLayout

#: 4 KiB pages (bf16: 2 layers x k/v x 8 tokens x 1 head x 64) and 64 KiB pages (kvdb/bench/scale.py's)
PAGE4K = BlockLayout(num_layers=2, num_kv_heads=1, head_dim=64, block_tokens=8)
PAGE64K = BlockLayout(num_layers=4, num_kv_heads=2, head_dim=128, block_tokens=16)
INGEST_GOALS = {4096: 0.8, 65536: 0.9}
#: how often the store's flusher fsyncs ``none`` writes (kvdb/cold/store.py's default), and so the baseline
FLUSH_INTERVAL_S = 0.05


def _keys(n: int, tag: int) -> list[bytes]:
    return [tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)]


def _store_side(path: str, lay: BlockLayout, keys: list[bytes], blocks: torch.Tensor) -> tuple[float, float]:
    """(wall s, CPU s) of the ingest into a new store at ``path``."""
    batch = blocks.shape[0]
    with kvdb.open(path, layout=lay, model_id="bench-ingest", host_bytes=16 * lay.page_bytes) as db:
        t0, c0 = time.perf_counter(), time.process_time()
        for b in range(0, len(keys), batch):
            db.put_blocks(keys[b : b + batch], blocks, tier="disk", durability="none")
        db.flush()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert db.stats()["tiers"]["disk"]["pages"] == len(keys)
    return wall, cpu


def _index_side(path: str, keys: list[bytes], batch: int) -> tuple[float, float]:
    """(wall s of the lookups, wall s of the writes) of indexing ``keys`` as fresh blocks,
    ``batch`` at a time, in a new index through the store's own Index (kvdb/cold/index.py): the
    multi-get of their (absent) old entries (``get_values``) and a write batch of one 48-byte
    entry each (``write``)."""
    value = bytes(iv.ENTRY_BYTES)
    index = Index(path)
    looked = wrote = 0.0
    try:
        for b in range(0, len(keys), batch):
            part = keys[b : b + batch]
            t0 = time.perf_counter()
            index.get_values(part)
            t1 = time.perf_counter()
            index.write([(iv.block_key(k), value) for k in part])
            looked, wrote = looked + t1 - t0, wrote + time.perf_counter() - t1
        return looked, wrote
    finally:
        index.close()


def _raw_side(path: str, src: np.ndarray, batches: int, sync_every_s: float) -> tuple[float, float]:
    """(wall s, CPU s) of appending ``src`` ``batches`` times to a new file, a thread calling
    fdatasync every ``sync_every_s`` meanwhile (as the store's flusher does for ``none`` writes),
    then one fdatasync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
    stop = threading.Event()

    def flusher() -> None:
        while not stop.wait(sync_every_s):
            os.fdatasync(fd)

    th = threading.Thread(target=flusher, daemon=True)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        th.start()
        for _ in range(batches):
            mv = memoryview(src).cast("B")
            while mv.nbytes:
                mv = mv[os.write(fd, mv):]
        stop.set()
        th.join()
        os.fdatasync(fd)
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        stop.set()
        if th.is_alive():
            th.join()
        os.close(fd)


def bench_ingest(root: str, *, ingest_mib: int = 128, batch_mib: int = 32, repeats: int = 3, tick=None) -> dict:
    """The ingest figures for 4 KiB and 64 KiB pages, scratch files under ``root``."""
    out: dict = {}
    met = True
    for lay in (PAGE4K, PAGE64K):
        page = lay.page_bytes
        batch = max(1, (min(batch_mib, ingest_mib) << 20) // page)
        n = max(batch, (ingest_mib << 20) // page // batch * batch)
        g = torch.Generator().manual_seed(page)
        blocks = torch.randint(-(1 << 15), 1 << 15, (batch, *lay.block_shape), dtype=torch.int16, generator=g).view(lay.dtype)
        src = blocks.view(torch.uint8).reshape(batch, page).numpy()
        keys = _keys(n, 2)
        store, raw, index = [], [], []
        for r in range(repeats):
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                path = os.path.join(root, f"ingest-{page}-{r}-{side}")
                try:
                    if side == 0:
                        raw.append(_raw_side(path, src, n // batch, FLUSH_INTERVAL_S))
                    else:
                        store.append(_store_side(path, lay, keys, blocks))
                finally:
                    if os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                    elif os.path.exists(path):
                        os.remove(path)
            path = os.path.join(root, f"index-{page}-{r}")
            try:
                index.append(_index_side(path, keys, batch))
            finally:
                shutil.rmtree(path, ignore_errors=True)
            if tick is not None:
                tick()
        gb = n * page / 1e9
        ingest = gb / statistics.median(w for w, _c in store)
        raw_gbps = gb / statistics.median(w for w, _c in raw)
        us = statistics.median(c for _w, c in store) / n * 1e6
        raw_us = statistics.median(c for _w, c in raw) / n * 1e6
        kib = f"{page >> 10}k"
        out[f"ingest_{kib}"] = {
            "page_bytes": page, "blocks": n, "batch_pages": batch,
            "ingest_gbps": round(ingest, 3), "raw_write_gbps": round(raw_gbps, 3),
            "ingest_vs_raw": round(ingest / raw_gbps, 3),
            "ingest_gbps_runs": [round(gb / w, 3) for w, _c in store],
            "raw_write_gbps_runs": [round(gb / w, 3) for w, _c in raw],
            "ingest_us_per_block": round(us, 2), "raw_write_us_per_block": round(raw_us, 2),
            "ingest_cpu_beyond_raw_us": round(us - raw_us, 2),
            "index_us_per_block": round(statistics.median(a + b for a, b in index) / n * 1e6, 2),
            "index_lookup_us_per_block": round(statistics.median(a for a, _b in index) / n * 1e6, 2),
            "goal_budget_us_per_block": round(statistics.median(w for w, _c in raw) / n * 1e6
                                              * (1 / INGEST_GOALS[page] - 1), 2),
        }
        met = met and ingest >= INGEST_GOALS[page] * raw_gbps and us - raw_us <= 5.0
    out["ingest_goals"] = {"ingest_vs_raw_min_4k": INGEST_GOALS[4096], "ingest_vs_raw_min_64k": INGEST_GOALS[65536],
                           "ingest_cpu_beyond_raw_us_max": 5.0, "met": bool(met)}
    return out


__all__ = ["PAGE4K", "PAGE64K", "bench_ingest"]
