"""``kvdb bench cold``: the disk tier against raw file I/O of the same bytes, same filesystem.

Figures (all measured in one run; the latest in docs/benchmarks.md):

* ``raw_write_gbps``   write the pages to a plain file in batches, fdatasync after each batch;
* ``write_gbps``       ColdStore.put of the same batches under ``group`` (one shared fsync each);
* ``raw_read_gbps``    read the plain file back into a preallocated array, page cache dropped
                       first (posix_fadvise DONTNEED) so both reads come from the device;
* ``read_gbps``        ColdStore.get_into of the same pages, page cache dropped the same way;
* ``sync_ops_s``       one thread putting small blocks, each under ``sync`` (its own fsync);
* ``group_commit_ops_s`` 8 threads putting the same small blocks under ``group``;
* ``group_commit_native_ops_s`` the same with ``native_commit=True`` (the native committer's
                       fsyncs instead of the Python leader's; kvdb/wal/commit.py);
* ``ceiling_sync_ops_s`` / ``ceiling_group_ops_s`` the same two workloads with no Python in the
                       way (kvdb.native.commit_ceiling: C threads, the same record size, one
                       gathering leader per fsync): what this disk and scheduler allow.
                       ``ceiling_group_vs_sync`` is the ratio that protocol reaches with no Python
                       (a store whose ``sync`` pays Python can show a higher one);
                       ``group_vs_ceiling`` is the store's group rate against the C one;
* ``fsync_us``         median of a plain 4 KiB append + fdatasync on the same filesystem, taken
                       between the commit phases: the two rates above are read next to it (group
                       commit gains most when fsync is slow);
* ``recovery_s``       reopen after a crash (no checkpoint) with ``recovery_bytes`` of log to
                       replay, page cache dropped; ``recovery_raw_read_s`` is the baseline: a
                       plain sequential read of the same segment files, cache dropped too.

Goals printed with them: write >= 0.8 x raw write, read >= 0.8 x raw read, group >= 5 x sync,
recovery of 1 GiB <= 2 s.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np

from kvdb import native
from kvdb.format.layout import BlockLayout
from kvdb.cold.store import ColdStore
from kvdb.fs import drop_page_cache
from kvdb.format.record import PUT_FIXED_BYTES, RECORD_HEADER_BYTES

GIB = 1 << 30
#: Llama-3-8B in bf16, 16-token blocks: 2 MiB pages
BIG = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
#: small blocks for the commit-rate figures: 4 KiB pages
SMALL = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16)


def _drop_dir_cache(d: str) -> None:
    for name in os.listdir(d):
        drop_page_cache(os.path.join(d, name))


def _keys(n: int, tag: int) -> list[bytes]:
    return [tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)]


def bench_bandwidth(root: str, total_bytes: int, batch_pages: int) -> dict:
    page = BIG.page_bytes
    n_batches = max(1, total_bytes // (page * batch_pages))
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, (batch_pages, page), dtype=np.uint8)
    nbytes = n_batches * batch_pages * page

    raw_path = os.path.join(root, "raw.bin")
    store = ColdStore.open(os.path.join(root, "store"), BIG, segment_bytes=1 << 30, checkpoint_bytes=1 << 40)
    raw_write_s = write_s = raw_read_s = read_s = 0.0
    try:
        # batches alternate between the baseline and the store so that both see the same disk
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for b in range(n_batches):
                t0 = time.perf_counter()
                mv = memoryview(pages).cast("B")
                while mv.nbytes:
                    mv = mv[os.write(fd, mv):]
                os.fdatasync(fd)
                t1 = time.perf_counter()
                store.put(_keys(batch_pages, b), pages, None, "group")
                t2 = time.perf_counter()
                raw_write_s += t1 - t0
                write_s += t2 - t1
        finally:
            os.close(fd)

        out = np.empty_like(pages)
        store.flush()
        # warm-up, untimed: the first read of a store starts its read-ahead thread and opens
        # its segment fd; the baseline has nothing to warm
        assert all(store.get_into(_keys(2, 0), out[:2]))
        drop_page_cache(raw_path)
        _drop_dir_cache(store.wal_dir)
        fd = os.open(raw_path, os.O_RDONLY)
        hits = 0
        try:
            for b in range(n_batches):
                t0 = time.perf_counter()
                got = os.preadv(fd, [out], b * out.nbytes)
                t1 = time.perf_counter()
                hits += sum(store.get_into(_keys(batch_pages, b), out))
                t2 = time.perf_counter()
                raw_read_s += t1 - t0
                read_s += t2 - t1
                assert got == out.nbytes
        finally:
            os.close(fd)
        assert hits == n_batches * batch_pages and (out == pages).all()
    finally:
        store.close()
    gb = nbytes / 1e9
    return {
        "bytes": nbytes,
        "page_bytes": page,
        "batch_pages": batch_pages,
        "raw_write_gbps": round(gb / raw_write_s, 3),
        "write_gbps": round(gb / write_s, 3),
        "raw_read_gbps": round(gb / raw_read_s, 3),
        "read_gbps": round(gb / read_s, 3),
    }


def _fsync_samples_us(path: str, n: int) -> list[float]:
    """n plain 4 KiB appends, each followed by fdatasync (the cost a ``sync`` put pays)."""
    block = bytes(SMALL.page_bytes)
    out = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, block)
            os.fdatasync(fd)
            out.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.close(fd)
    return out


def _group_phase(store: ColdStore, page: np.ndarray, threads: int, n_per_thread: int, tag: int) -> tuple[float, int]:
    """``threads`` writers, each putting n_per_thread single blocks under group; returns
    (seconds, fsyncs). Ends with a flush: index updates left queued are part of the cost."""
    f0 = store.stats()["fsyncs"]
    barrier = threading.Barrier(threads + 1)

    def writer(t: int) -> None:
        ks = _keys(n_per_thread, tag + t)
        barrier.wait()
        for k in ks:
            store.put([k], page, None, "group")

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    store.flush()
    return time.perf_counter() - t0, store.stats()["fsyncs"] - f0


def bench_commits(root: str, threads: int, ops_per_thread: int, sync_ops: int, rounds: int = 4) -> dict:
    """Phases alternate (fsync probe, sync, group, group with the native committer, ...) so
    that all see the same disk."""
    rng = np.random.default_rng(1)
    page = rng.integers(0, 256, (1, SMALL.page_bytes), dtype=np.uint8)
    store = ColdStore.open(os.path.join(root, "small"), SMALL)
    native_store = ColdStore.open(os.path.join(root, "small-native"), SMALL, native_commit=True) if native.HAVE_NATIVE else None
    sync_s = group_s = nat_s = csync_s = cgroup_s = 0.0
    group_fsyncs = nat_fsyncs = cgroup_fsyncs = 0
    record = RECORD_HEADER_BYTES + PUT_FIXED_BYTES + SMALL.page_bytes  # one small put's log record
    fsync_us: list[float] = []
    per = ops_per_thread // rounds
    try:
        for r in range(rounds):
            fsync_us += _fsync_samples_us(os.path.join(root, "fsync-probe"), 25)
            keys = _keys(sync_ops // rounds, 10 + r)
            t0 = time.perf_counter()
            for k in keys:
                store.put([k], page, None, "sync")
            sync_s += time.perf_counter() - t0
            s, f = _group_phase(store, page, threads, per, 1000 * (r + 1))
            group_s, group_fsyncs = group_s + s, group_fsyncs + f
            if native_store is not None:
                s, f = _group_phase(native_store, page, threads, per, 1000 * (r + 1))
                nat_s, nat_fsyncs = nat_s + s, nat_fsyncs + f
                s, _f = native.commit_ceiling(os.path.join(root, f"ceiling-sync-{r}"), 1, sync_ops // rounds, record)
                csync_s += s
                s, f = native.commit_ceiling(os.path.join(root, f"ceiling-group-{r}"), threads, per, record)
                cgroup_s, cgroup_fsyncs = cgroup_s + s, cgroup_fsyncs + f
    finally:
        store.close()
        if native_store is not None:
            native_store.close()
    n_sync = rounds * (sync_ops // rounds)
    n_group = rounds * threads * per
    out = {
        "small_page_bytes": SMALL.page_bytes,
        "sync_ops_s": round(n_sync / sync_s, 1),
        "group_threads": threads,
        "group_commit_ops_s": round(n_group / group_s, 1),
        "group_ops_per_fsync": round(n_group / max(1, group_fsyncs), 2),
        "fsync_us": round(statistics.median(fsync_us), 1),
    }
    if native_store is not None:
        out["group_commit_native_ops_s"] = round(n_group / nat_s, 1)
        out["group_native_ops_per_fsync"] = round(n_group / max(1, nat_fsyncs), 2)
        out["ceiling_sync_ops_s"] = round(n_sync / csync_s, 1)
        out["ceiling_group_ops_s"] = round(n_group / cgroup_s, 1)
        out["ceiling_group_ops_per_fsync"] = round(n_group / max(1, cgroup_fsyncs), 2)
        out["ceiling_group_vs_sync"] = round(out["ceiling_group_ops_s"] / out["ceiling_sync_ops_s"], 2)
        out["group_vs_ceiling"] = round(out["group_commit_ops_s"] / out["ceiling_group_ops_s"], 2)
    return out


def bench_recovery(root: str, log_bytes: int) -> dict:
    page = BIG.page_bytes
    n = max(1, log_bytes // (page + 53))
    rng = np.random.default_rng(2)
    pages = rng.integers(0, 256, (64, page), dtype=np.uint8)
    path = os.path.join(root, "recovery")
    store = ColdStore.open(path, BIG, segment_bytes=256 << 20, checkpoint_bytes=1 << 40, flush_interval_s=None)
    done = 0
    while done < n:
        m = min(64, n - done)
        store.put(_keys(m, 1000 + done), pages[:m], None, "group")
        done += m
    store.debug_crash_close()  # no checkpoint: the whole log is replayed
    wal = os.path.join(path, "wal")
    # baseline: read the same segment files sequentially, page cache dropped
    _drop_dir_cache(wal)
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    for name in sorted(os.listdir(wal)):
        fd = os.open(os.path.join(wal, name), os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)
    raw_read_s = time.perf_counter() - t0
    _drop_dir_cache(wal)
    t0 = time.perf_counter()
    store = ColdStore.open(path, BIG, flush_interval_s=None)
    recovery_s = time.perf_counter() - t0
    r = store.recovery
    ok = store.stats()["pages"] == n
    store.close()
    return {"recovery_log_bytes": r.bytes_replayed, "recovery_records": r.records_replayed,
            "recovery_s": round(recovery_s, 3), "recovery_raw_read_s": round(raw_read_s, 3),
            "recovery_ok": ok}


def run(dir_path: str | None = None, total_bytes: int = 512 << 20, batch_pages: int = 32,
        threads: int = 8, ops_per_thread: int = 400, sync_ops: int = 400,
        recovery_bytes: int = GIB, progress=None, repeats: int = 5) -> dict:
    root = tempfile.mkdtemp(prefix="kvdb-bench-cold-", dir=dir_path)
    try:
        # each figure is the median of `repeats` interleaved runs: a shared disk's noise moves
        # single runs by 2x, and baseline and store stay paired within each run
        runs = []
        for r in range(repeats):
            sub = os.path.join(root, f"bw{r}")
            os.mkdir(sub)
            runs.append(bench_bandwidth(sub, max(total_bytes // repeats, BIG.page_bytes * batch_pages), batch_pages))
            shutil.rmtree(sub, ignore_errors=True)
        res = dict(runs[0])
        for k in ("raw_write_gbps", "write_gbps", "raw_read_gbps", "read_gbps"):
            res[k] = statistics.median(x[k] for x in runs)
        res["bytes"] = sum(x["bytes"] for x in runs)
        res["repeats"] = repeats
        res["write_vs_raw_runs"] = [round(x["write_gbps"] / x["raw_write_gbps"], 3) for x in runs]
        res["read_vs_raw_runs"] = [round(x["read_gbps"] / x["raw_read_gbps"], 3) for x in runs]
        if progress:
            progress()
        res.update(bench_commits(root, threads, ops_per_thread, sync_ops))
        if progress:
            progress()
        if recovery_bytes:
            res.update(bench_recovery(root, recovery_bytes))
        if progress:
            progress()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["write_vs_raw"] = statistics.median(res["write_vs_raw_runs"])
    res["read_vs_raw"] = statistics.median(res["read_vs_raw_runs"])
    res["group_vs_sync"] = round(res["group_commit_ops_s"] / res["sync_ops_s"], 2)
    goals = {
        "write_vs_raw >= 0.8": res["write_vs_raw"] >= 0.8,
        "read_vs_raw >= 0.8": res["read_vs_raw"] >= 0.8,
        "group_vs_sync >= 5": res["group_vs_sync"] >= 5,
    }
    if recovery_bytes:
        per_gib = res["recovery_s"] * GIB / max(1, res["recovery_log_bytes"])
        res["recovery_s_per_gib"] = round(per_gib, 3)
        goals["recovery_s_per_gib <= 2"] = per_gib <= 2.0
    res["goals"] = goals
    return res


__all__ = ["run"]
