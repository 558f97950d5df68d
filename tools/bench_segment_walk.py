"""What segment GC's header walk costs (docs/durability.md, C6), next to its baseline.

    python tools/bench_segment_walk.py [--mib 256] [--segment-mib 64] [--dir D]

For 4 KiB and 2 MiB pages: writes ``--mib`` of pages with a third of them deleted, then per
sealed segment times ``summarize_segment`` (the walk ``carry_forward`` does) against a plain
sequential read of the same file (the baseline), page cache warm, and prints the medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from kvdb.format.layout import BlockLayout
from kvdb.cold import ColdStore
from kvdb.format.record import segment_name
from kvdb.wal.reader import summarize_segment


def run(layout: BlockLayout, total_mib: int, segment_mib: int, parent: str | None) -> None:
    d = tempfile.mkdtemp(prefix="kvdb-walk-", dir=parent)
    try:
        s = ColdStore.open(d, layout, segment_bytes=segment_mib << 20, flush_interval_s=None)
        n = (total_mib << 20) // layout.page_bytes
        batch = max(1, (8 << 20) // layout.page_bytes)
        pages = np.random.default_rng(0).integers(0, 256, (batch, layout.page_bytes), dtype=np.uint8)
        for _ in range(0, n, batch):
            keys = [os.urandom(16) for _ in range(batch)]
            s.put(keys, pages, durability="none")
            s.delete(keys[::3], durability="none")
        s.flush()
        segs = s.segments.list()[:-1]
        s.close()
        base, walk = [], []
        for seg in segs:
            p = os.path.join(d, "wal", segment_name(seg))
            t = time.perf_counter()
            with open(p, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass
            base.append(time.perf_counter() - t)
            t = time.perf_counter()
            sm = summarize_segment(p, seg)
            walk.append(time.perf_counter() - t)
            assert sm.complete
        print(f"{layout.page_bytes}-byte pages, {len(segs)} segments of {segment_mib} MiB, "
              f"{len(sm.put_keys)} PUTs each: plain read {statistics.median(base) * 1e3:.1f} ms, "
              f"summarize_segment {statistics.median(walk) * 1e3:.1f} ms (medians per segment)")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--segment-mib", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    a = ap.parse_args()
    run(BlockLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16), a.mib, a.segment_mib, a.dir)
    run(BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16), a.mib, a.segment_mib, a.dir)


if __name__ == "__main__":
    main()
