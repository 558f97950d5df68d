"""The floor of a batch read from the disk tier: the least Python the same steps need, timed
against the store and against ``preadv`` of the same extents (issue 12, item 3 / ``read_gbps``).

    .venv/bin/python tools/read_floor.py [--mib 256] [--rounds 8] [--json]

Writes a store of 64 KiB pages as ``kvdb bench scale`` does (kvdb/bench/scale.py), then, page
cache dropped before each, reads it all back in batches of 256 pages, one round after another,
each round's variants in alternating order:

* ``raw``       ``preadv`` of the same record extents into one buffer (the bench's baseline);
* ``store``     ``Db.get_blocks`` (the bench's ``read_gbps``: lookup, checks, promotion);
* ``floor``     the same steps with no layer between them: one multi-get of the index, the
                entries viewed as a numpy array, each run read in slices of READ_SLICE_BYTES
                by one reader thread (kvdb/native.py ``preadv_rows``: head and page iovecs
                built natively, straight into ``out``'s rows), each slice checked as soon as
                it is read by the store's own check (kvdb/cold/read.py ``check_fields``),
                then its pages copied into host frames (the promotion);
* ``floor_nocopy``, ``floor_nocheck``, ``floor_bare``: the floor without the promotion's copy,
                without the checks, without either;
* ``whole``     the floor's steps without overlap: each run read by one ``preadv`` in the calling
                thread, then checked and copied;
* ``lookup_read`` ``raw``'s reads (one ``preadv`` of one buffer a run) behind the floor's lookup
                and reader thread: no per-record iovecs, checks or copies.

Prints per variant the median GB/s and the median of its per-round ratio to ``raw``. Where the
store sits near ``floor``, what is left between it and ``raw`` is the work itself (the checks,
the promotion's copy), not the store's code.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from kvdb import native
from kvdb.bench.ingest import PAGE64K
from kvdb.bench.scale import _drop_dir, _open, raw_read, store_read, write_store
from kvdb.cold.read import READ_SLICE_BYTES, check_fields, run_bounds
from kvdb.format.index_value import ENTRY_DTYPE
from kvdb.format.record import PUT_PAYLOAD_OFFSET

BATCH = 256
FLOORS = {"floor": (True, True, True), "floor_nocopy": (True, False, True), "floor_nocheck": (False, True, True),
          "floor_bare": (False, False, True), "whole": (True, True, False)}


def _done(value: int) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class Store:
    """A store of ``n`` pages written as the bench writes it, and what each variant reads with."""

    def __init__(self, root: str, mib: int) -> None:
        self.page = PAGE64K.page_bytes
        self.n = max(BATCH, (mib << 20) // self.page // BATCH * BATCH)
        self.path = os.path.join(root, "db")
        self.keys, blocks, self.wal_dir, self.segs, self.batches = write_store(self.path, self.n, BATCH)
        self.want = PUT_PAYLOAD_OFFSET + self.page
        self.raw_buf = np.empty(BATCH * (self.page + 4096), dtype=np.uint8)
        self.out = np.empty((BATCH, self.page), dtype=np.uint8)
        self.heads = np.empty((BATCH, PUT_PAYLOAD_OFFSET), dtype=np.uint8)
        self.host = np.ones((2 * BATCH, self.page), dtype=np.uint8)  # room for two batches, touched
        self.expect = blocks.view(torch.uint8).reshape(BATCH, self.page).numpy()

    def raw(self) -> float:
        return raw_read(self.segs, self.batches, self.raw_buf, self.wal_dir)

    def store(self) -> float:
        out = torch.from_numpy(self.out).view(PAGE64K.dtype).reshape(BATCH, *PAGE64K.block_shape)
        t = store_read(self.path, self.keys, out, self.wal_dir)
        assert np.array_equal(self.out, self.expect)
        return t

    @contextlib.contextmanager
    def _reading(self):
        """The store's index and a read fd per segment, the page cache dropped."""
        with _open(self.path, 16) as db:
            fds = {s: os.open(p, os.O_RDONLY) for s, p in self.segs.items()}
            try:
                _drop_dir(self.wal_dir)
                yield db._cold.index, fds
            finally:
                for fd in fds.values():
                    os.close(fd)

    def floor(self, check: bool, copy: bool, sliced: bool, pool) -> float:
        want, out, heads, host = self.want, self.out, self.heads, self.host
        rows = np.arange(BATCH, dtype=np.int64)
        per = max(1, READ_SLICE_BYTES // want) if sliced else BATCH
        with self._reading() as (index, fds):
            t0 = time.perf_counter()
            for b in range(0, self.n, BATCH):
                keys = self.keys[b : b + BATCH]
                e, seg, off = _lookup(index, keys)
                kv = np.frombuffer(b"".join(keys), dtype="V16")
                jobs = []
                for r0, r1 in run_bounds(seg, off, want):
                    for a in range(r0, r1, per):
                        z = min(r1, a + per)
                        args = (fds[int(seg[r0])], int(off[r0]) + (a - r0) * want, heads[a:z], out, rows[a:z])
                        fut = pool.submit(native.preadv_rows, *args) if sliced else _done(native.preadv_rows(*args))
                        jobs.append((a, z, fut))
                frame = (b // BATCH) % 2 * BATCH
                for a, z, fut in jobs:
                    if fut.result() != (z - a) * want:
                        raise OSError("short read")
                    if check and not check_fields(  # the store's own check (C3)
                            kv[a:z], e["record_bytes"][a:z].astype(np.int64), e["crc"][a:z], e["lsn"][a:z],
                            heads[a:z], out, rows[a:z], z - a).all():
                        raise AssertionError("a record failed its checks")
                    if copy:
                        host[frame + a : frame + z] = out[a:z]
            t = time.perf_counter() - t0
        assert np.array_equal(out, self.expect)
        return t

    def lookup_read(self, pool) -> float:
        """``raw``'s reads (one ``preadv`` a run, one buffer) behind the floor's lookup and reader
        thread, nothing checked or copied: what the lookup and the hand-off cost by themselves."""
        want, buf = self.want, memoryview(self.raw_buf)
        with self._reading() as (index, fds):
            t0 = time.perf_counter()
            for b in range(0, self.n, BATCH):
                _e, seg, off = _lookup(index, self.keys[b : b + BATCH])
                jobs = [(r1 - r0, pool.submit(os.preadv, fds[int(seg[r0])], [buf[r0 * want : r1 * want]], int(off[r0])))
                        for r0, r1 in run_bounds(seg, off, want)]
                for k, fut in jobs:
                    if fut.result() != k * want:
                        raise OSError("short read")
            return time.perf_counter() - t0


def _lookup(index, keys: list[bytes]):
    """A batch's index entries (one multi-get) as a numpy array, with their segments and offsets."""
    e = np.frombuffer(b"".join(index.get_values(keys)), dtype=ENTRY_DTYPE)
    return e, e["segment_no"].astype(np.int64), e["offset"].astype(np.int64)


def run(mib: int = 256, rounds: int = 8, dir_path: str | None = None, progress=None) -> dict:
    """{variant: {"gbps": median, "vs_raw": median per-round ratio, "runs": [GB/s ...]}}."""
    root = tempfile.mkdtemp(prefix="kvdb-read-floor-", dir=dir_path)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="floor-read")
    try:
        st = Store(root, mib)
        gb = st.n * st.page / 1e9
        names = ["raw", "store", "lookup_read", *FLOORS]
        runs: dict[str, list[float]] = {v: [] for v in names}
        for r in range(rounds):
            for v in names if r % 2 == 0 else names[::-1]:  # each drops the page cache first
                if v == "raw":
                    t = st.raw()
                elif v == "store":
                    t = st.store()
                elif v == "lookup_read":
                    t = st.lookup_read(pool)
                else:
                    t = st.floor(*FLOORS[v], pool)
                runs[v].append(gb / t)
            if progress is not None:
                progress(r + 1, rounds)
    finally:
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return {v: {"gbps": statistics.median(g), "vs_raw": statistics.median(a / b for a, b in zip(g, runs["raw"])),
                "runs": g} for v, g in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes of pages to read back per variant and round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.mib < 16 or args.rounds < 1:
        print("read_floor: --mib must be at least 16 and --rounds at least 1", file=sys.stderr)
        return 2
    res = run(args.mib, args.rounds, progress=None if args.json else lambda i, k: print(f"round {i}/{k}", file=sys.stderr))
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{'variant':<14} {'GB/s':>7} {'x raw':>7}")
        for v, r in res.items():
            print(f"{v:<14} {r['gbps']:>7.3f} {r['vs_raw']:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
