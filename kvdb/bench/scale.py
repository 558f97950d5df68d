"""``kvdb bench scale``: the disk tier's read and ingest paths against plain file I/O of the same bytes.

Figures measured in one run (issue 12, item 5). The ingest figures (``ingest_4k``,
``ingest_64k``: ``ingest_gbps`` vs ``raw_write_gbps``, ``ingest_us_per_block`` vs
``raw_write_us_per_block``) come from kvdb/bench/ingest.py, the open figures (``open_10k_s``,
``open_1m_s`` vs ``rocksdb_open_1m_s``, memory per block) from kvdb/bench/reopen.py (see
there); the read figures:

* ``read_gbps``         ``Db.get_blocks`` of 64 KiB pages from the disk tier in batches, into a
                        preallocated CPU ``out`` (promotion into the host tier included), the
                        segment files' page cache dropped first (fdatasync, posix_fadvise DONTNEED);
* ``read_small_host_gbps`` the same reads with a host tier of a quarter of one batch (a
                        disk-heavy deployment: small DRAM, a long prompt's load bigger than it);
* ``raw_read_gbps``     the baseline: ``preadv`` of the same record extents (adjacent records
                        in one call, into one preallocated buffer), page cache dropped the same way;
* ``get1_p50_us``       median of one block per ``get_blocks`` call, cold (a fresh Db: nothing in
                        memory, page cache dropped), keys in a shuffled order;
* ``file_get1_p50_us``  the baseline: one file per block holding the same bytes (the design of a
                        plain one-file-per-block cache), open + ``preadv`` + close per block, cold.

Each phase runs ``repeats`` times, the baseline and the store alternating first; the figures are
medians. Goals printed with them: read >= 0.9 x raw, read with the small host tier >= 0.5 x
raw, get1 <= 1.1 x file get1. The write-back figures (``close_gbps`` vs ``close_raw_write_gbps``,
goal >= 0.5 x) are kvdb/bench/writeback.py's. The page cache
can be dropped only where the filesystem honours DONTNEED (tmpfs does not: then both sides read
memory and the ratios compare CPU paths).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

import kvdb
from kvdb.bench.ingest import PAGE64K, bench_ingest
from kvdb.bench.reopen import bench_open
from kvdb.bench.writeback import bench_writeback
from kvdb.cold.read import run_bounds
from kvdb.format.index_value import entry_table
from kvdb.fs import drop_page_cache


def _drop_dir(d: str) -> None:
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            drop_page_cache(p)


def _keys(n: int, tag: int) -> list[bytes]:
    return [tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)]


def _open(path: str, host_pages: int):
    return kvdb.open(path, layout=PAGE64K, model_id="bench-scale", host_bytes=host_pages * PAGE64K.page_bytes)


def _runs(entries) -> list[tuple[int, int, int, int]]:
    """(segment, offset, bytes, records) per run of back-to-back records, in key order (the
    bench's records are all one size: kvdb/cold/read.py ``run_bounds``)."""
    tab, _ = entry_table(entries)
    want = int(tab["record_bytes"][0])
    seg, off = tab["segment_no"].astype(np.int64), tab["offset"].astype(np.int64)
    return [(int(seg[a]), int(off[a]), (z - a) * want, z - a) for a, z in run_bounds(seg, off, want)]


def write_store(path: str, n: int, batch_pages: int):
    """A store at ``path`` of ``n`` 64 KiB pages (``batch_pages`` random pages written over and
    over, to the disk tier, ``durability="group"``), as the read figures read it. Returns (keys,
    the pages, the log directory, {segment: path}, the ``_runs`` of each batch of keys)."""
    lay = PAGE64K
    keys = _keys(n, 1)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(-(1 << 15), 1 << 15, (batch_pages, *lay.block_shape), dtype=torch.int16,
                           generator=g).view(lay.dtype)
    with _open(path, 16) as db:
        for b in range(0, n, batch_pages):
            db.put_blocks(keys[b : b + batch_pages], blocks, tier="disk", durability="group")
        db.flush()
        cold = db._cold
        wal_dir = cold.wal_dir
        entries = cold.lookup(keys)
        segs = {e.segment_no: cold.reader.segments.path(e.segment_no) for e in entries}
    return keys, blocks, wal_dir, segs, [_runs(entries[b : b + batch_pages]) for b in range(0, n, batch_pages)]


def raw_read(segs: dict[int, str], batches: list, buf: np.ndarray, wal_dir: str) -> float:
    """Seconds to ``preadv`` every run of ``batches`` (``_runs`` per batch) into ``buf``, one
    call a run, page cache dropped first: the read figures' baseline (``raw_read_gbps``)."""
    _drop_dir(wal_dir)
    fds = {s: os.open(p, os.O_RDONLY) for s, p in segs.items()}
    try:
        t0 = time.perf_counter()
        for runs in batches:
            at = 0
            for seg, off, nbytes, _recs in runs:
                got = os.preadv(fds[seg], [memoryview(buf)[at : at + nbytes]], off)
                assert got == nbytes
                at += nbytes
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def store_read(path: str, keys: list[bytes], out: torch.Tensor, wal_dir: str, host_pages: int | None = None) -> float:
    """Seconds for ``Db.get_blocks`` of every key, ``len(out)`` a call, into ``out`` from a fresh
    Db (host room for two batches unless ``host_pages`` says otherwise: each is promoted, as
    much as fits), page cache dropped after its warm-up (``read_gbps``)."""
    batch = out.shape[0]
    with _open(path, 2 * batch if host_pages is None else host_pages) as db:
        db.get_blocks(keys[:1], out[:1])  # warm-up: fds, threads
        _drop_dir(wal_dir)
        t0 = time.perf_counter()
        for b in range(0, len(keys), batch):
            db.get_blocks(keys[b : b + batch], out)
        return time.perf_counter() - t0


def bench_scale(*, total_mib: int = 256, batch_pages: int = 256, get1_blocks: int = 256, repeats: int = 3,
                ingest_mib: int = 128, open_blocks: int = 10_000, open_large_blocks: int = 1_000_000,
                writeback_mib: int = 512, dir_path: str | None = None, progress=None) -> dict:
    """Every figure; ``ingest_mib=0`` / ``open_blocks=0`` / ``writeback_mib=0`` leave the ingest /
    open / write-back figures out."""
    lay = PAGE64K
    page = lay.page_bytes
    n = max(batch_pages, (total_mib << 20) // page // batch_pages * batch_pages)
    root = tempfile.mkdtemp(prefix="kvdb-bench-scale-", dir=dir_path)
    steps, done = repeats * 2 + (repeats * 2 if ingest_mib else 0) + (repeats if writeback_mib else 0), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, steps)

    try:
        path = os.path.join(root, "db")
        keys, blocks, wal_dir, segs, batches = write_store(path, n, batch_pages)
        # one file per block for the get1 baseline: the same bytes, fsynced
        files_dir = os.path.join(root, "files")
        os.makedirs(files_dir)
        src = blocks.view(torch.uint8).reshape(batch_pages, page).numpy()
        for i in range(get1_blocks):
            with open(os.path.join(files_dir, keys[i].hex()), "wb") as f:
                f.write(src[i % batch_pages].tobytes())
                f.flush()
                os.fsync(f.fileno())
        order = np.random.default_rng(1).permutation(get1_blocks).tolist()

        raw_s, read_s, small_s, file_us, get1_us = [], [], [], [], []
        small_host = max(1, batch_pages // 4)
        out = torch.empty((batch_pages, *lay.block_shape), dtype=lay.dtype)
        raw_buf = np.empty(batch_pages * (page + 4096), dtype=np.uint8)
        for r in range(repeats):
            for side in ((0, 1, 2) if r % 2 == 0 else (2, 1, 0)):
                if side == 0:  # baseline: preadv of the same extents
                    raw_s.append(raw_read(segs, batches, raw_buf, wal_dir))
                else:  # the Db, fresh: nothing in memory (side 2: a host tier smaller than a batch)
                    out.zero_()
                    got = store_read(path, keys, out, wal_dir, None if side == 1 else small_host)
                    (read_s if side == 1 else small_s).append(got)
                    assert torch.equal(out.view(torch.uint8).reshape(batch_pages, page)[0], torch.from_numpy(src[0]))
            tick()
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                one = np.empty(page, dtype=np.uint8)
                if side == 0:  # baseline: one file per block
                    for i in range(get1_blocks):
                        drop_page_cache(os.path.join(files_dir, keys[i].hex()))
                    for i in order:
                        t0 = time.perf_counter()
                        fd = os.open(os.path.join(files_dir, keys[i].hex()), os.O_RDONLY)
                        try:
                            got = os.preadv(fd, [one], 0)
                        finally:
                            os.close(fd)
                        file_us.append((time.perf_counter() - t0) * 1e6)
                        assert got == page
                else:
                    with _open(path, max(16, get1_blocks + 1)) as db:
                        o1 = torch.empty((1, *lay.block_shape), dtype=lay.dtype)
                        db.get_blocks(keys[n - 1 : n], o1)  # warm-up: fds (a key not timed)
                        _drop_dir(wal_dir)
                        for i in order:
                            t0 = time.perf_counter()
                            db.get_blocks(keys[i : i + 1], o1)
                            get1_us.append((time.perf_counter() - t0) * 1e6)
            tick()
        extra = bench_ingest(root, ingest_mib=ingest_mib, repeats=repeats, tick=tick) if ingest_mib else {}
        if open_blocks:
            extra.update(bench_open(root, small_blocks=open_blocks, large_blocks=open_large_blocks, repeats=repeats))
        if writeback_mib:
            extra.update(bench_writeback(root, writeback_mib=writeback_mib, repeats=repeats, tick=tick))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = n * page / 1e9
    raw_gbps = gb / statistics.median(raw_s)
    read_gbps = gb / statistics.median(read_s)
    small_gbps = gb / statistics.median(small_s)
    g1, f1 = statistics.median(get1_us), statistics.median(file_us)
    res = {
        "page_bytes": page,
        "pages": n,
        "batch_pages": batch_pages,
        "repeats": repeats,
        "read_gbps": round(read_gbps, 3),
        "raw_read_gbps": round(raw_gbps, 3),
        "read_vs_raw": round(read_gbps / raw_gbps, 3),
        "read_gbps_runs": [round(gb / s, 3) for s in read_s],
        "read_small_host_gbps": round(small_gbps, 3),
        "read_small_host_vs_raw": round(small_gbps / raw_gbps, 3),
        "read_small_host_pages": small_host,
        "read_small_host_gbps_runs": [round(gb / s, 3) for s in small_s],
        "raw_read_gbps_runs": [round(gb / s, 3) for s in raw_s],
        "get1_blocks": get1_blocks,
        "get1_p50_us": round(g1, 1),
        "file_get1_p50_us": round(f1, 1),
        "get1_vs_file": round(g1 / f1, 3),
        **extra,
    }
    goals = {"read_vs_raw_min": 0.9, "read_small_host_vs_raw_min": 0.5, "get1_vs_file_max": 1.1}
    met = read_gbps >= 0.9 * raw_gbps and small_gbps >= 0.5 * raw_gbps and g1 <= 1.1 * f1
    if "close_vs_raw" in res:
        goals["close_vs_raw_min"] = res.pop("close_goal_min")
        met = met and res["close_vs_raw"] >= goals["close_vs_raw_min"]
    res["goals"] = {**goals, "met": bool(met)}
    return res


__all__ = ["PAGE64K", "bench_scale"]
