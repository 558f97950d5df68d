"""``kvdb bench scale``'s open figures (issue 12, items 1 and 5), each against a baseline from the
same run.

Two stores of small blocks (512-byte pages, ``OPEN_LAYOUT``) are written to the disk tier and
closed: ``small_blocks`` (10,000) and ``large_blocks`` (1,000,000 by default). Then, for each,
in a fresh process (Python, torch and kvdb imported before the clock starts):

* ``open_10k_s`` / ``open_1m_s``       ``kvdb.open`` of the closed store (after the open of an
                                        empty one: the modules and libraries a first open loads
                                        are not timed, nor counted below);
* ``rocksdb_open_10k_s`` / ``rocksdb_open_1m_s``  the baseline: rocksdict opening the store's
                                        index (PATH/disk/index), no scan;
* ``open_py_bytes_per_block``          Python heap the open of the large store holds
                                        (tracemalloc, in a process of its own: tracing slows
                                        allocation) per block on disk;
* ``open_rss_bytes_per_block``         the same process's resident memory growth over the open,
                                        per block (RocksDB's caches and the native library
                                        included: an upper bound).

Opens alternate which side goes first; figures are medians of ``repeats``. Goals printed with
them: ``open_1m_s <= 2 x open_10k_s`` and ``open_1m_s <= 3 x rocksdb_open_1m_s``; memory per
block <= 16 bytes. The stores are written with the page cache warm, as a restart finds them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

import torch

import kvdb
from kvdb.format.layout import BlockLayout

#: 512-byte pages: 1 layer x k/v x 8 tokens x 1 head x 16 dims x bf16
OPEN_LAYOUT = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=8)
MODEL_ID = "bench-open"
#: blocks per put_blocks call while writing the stores
FILL_BATCH = 16384

#: run in a child process: argv = mode (kvdb | rocksdb | memory), store path, layout JSON
_CHILD = r"""
import json, sys, tempfile, time, tracemalloc
import rocksdict, torch, kvdb
from kvdb.format.layout import BlockLayout

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

mode, path, lay = sys.argv[1], sys.argv[2], BlockLayout.from_dict(json.loads(sys.argv[3]))
out = {}
with tempfile.TemporaryDirectory() as warm:  # what a first open loads (modules, libraries), not timed
    if mode == "rocksdb":
        rocksdict.Rdict(warm + "/r", rocksdict.Options(raw_mode=True)).close()
    else:
        kvdb.open(warm + "/k", layout=lay, model_id=sys.argv[4], host_bytes=16 * lay.page_bytes).close()
if mode == "rocksdb":
    t0 = time.perf_counter()
    rd = rocksdict.Rdict(path + "/disk/index", rocksdict.Options(raw_mode=True))
    out["s"] = time.perf_counter() - t0
    rd.close()
else:
    if mode == "memory":
        tracemalloc.start()
    r0 = rss()
    t0 = time.perf_counter()
    db = kvdb.open(path, layout=lay, model_id=sys.argv[4], host_bytes=16 * lay.page_bytes)
    out["s"] = time.perf_counter() - t0
    out["rss"] = rss() - r0
    if mode == "memory":
        out["py"] = tracemalloc.get_traced_memory()[0]
    out["pages"] = db.stats()["tiers"]["disk"]["pages"]
    db.close()
print(json.dumps(out))
"""


def _child(mode: str, path: str) -> dict:
    lay = json.dumps(OPEN_LAYOUT.to_dict())
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode, path, lay, MODEL_ID], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the open bench's child ({mode}) failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fill(path: str, blocks: int) -> None:
    page = torch.zeros((min(blocks, FILL_BATCH), *OPEN_LAYOUT.block_shape), dtype=OPEN_LAYOUT.dtype)
    with kvdb.open(path, layout=OPEN_LAYOUT, model_id=MODEL_ID, host_bytes=16 * OPEN_LAYOUT.page_bytes) as db:
        for b in range(0, blocks, page.shape[0]):
            n = min(page.shape[0], blocks - b)
            keys = [(7).to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(b, b + n)]
            db.put_blocks(keys, page[:n], tier="disk", durability="none")


def _opens(path: str, blocks: int, repeats: int) -> tuple[float, float]:
    kv, rocks = [], []
    for r in range(repeats):
        for side in (("kvdb", "rocksdb") if r % 2 == 0 else ("rocksdb", "kvdb")):
            got = _child(side, path)
            if side == "kvdb":
                if got["pages"] != blocks:
                    raise RuntimeError(f"the reopened store holds {got['pages']} blocks, not {blocks}")
                kv.append(got["s"])
            else:
                rocks.append(got["s"])
    return statistics.median(kv), statistics.median(rocks)


def bench_open(root: str, *, small_blocks: int = 10_000, large_blocks: int = 1_000_000, repeats: int = 3,
               progress=None) -> dict:
    """The open figures (module doc); ``progress(step)`` after each phase, if given."""
    out: dict = {"open_small_blocks": small_blocks, "open_large_blocks": large_blocks,
                 "open_page_bytes": OPEN_LAYOUT.page_bytes}
    for label, n in (("10k", small_blocks), ("1m", large_blocks)):
        path = os.path.join(root, f"open-{label}")
        try:
            _fill(path, n)
            if progress is not None:
                progress(f"open: wrote {n} blocks")
            kv, rocks = _opens(path, n, repeats)
            out[f"open_{label}_s"], out[f"rocksdb_open_{label}_s"] = round(kv, 4), round(rocks, 4)
            if label == "1m":
                mem = _child("memory", path)
                out["open_py_bytes_per_block"] = round(mem["py"] / n, 2)
                out["open_rss_bytes_per_block"] = round(mem["rss"] / n, 2)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    out["open_1m_vs_10k"] = round(out["open_1m_s"] / out["open_10k_s"], 2)
    out["open_1m_vs_rocksdb"] = round(out["open_1m_s"] / out["rocksdb_open_1m_s"], 2)
    out["open_goals_met"] = bool(out["open_1m_vs_10k"] <= 2.0 and out["open_1m_vs_rocksdb"] <= 3.0
                                 and out["open_py_bytes_per_block"] <= 16)
    return out


__all__ = ["OPEN_LAYOUT", "bench_open"]
