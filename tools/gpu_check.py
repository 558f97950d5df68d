"""One prepared script for a GPU machine: the CUDA tests, then host<->device copy figures.

    python tools/gpu_check.py [--json]

Figures (batches of 64 blocks of 2 MiB, bf16 Llama-3-8B layout):
  raw_h2d_gbps / raw_d2h_gbps   torch copy_ between a pinned host tensor and a device tensor
                                of the same bytes (the baseline)
  put_h2d_gbps                  db.put_blocks from pinned host blocks into the CUDA device tier
  get_d2h_gbps                  db.get_blocks from the device tier into a pinned host tensor
  demote_gbps / promote_gbps    device -> host (offload) and host -> device (prefetch) moves
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import torch


def _timed(fn, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def figures(batch: int = 64) -> dict:
    import kvdb
    from kvdb.bench.datapath import BENCH_LAYOUT as lay

    nbytes = batch * lay.page_bytes
    host = torch.empty((batch, *lay.block_shape), dtype=lay.dtype, pin_memory=True)
    host.view(torch.int16).random_(-1000, 1000)
    dev = torch.empty_like(host, device="cuda")
    out = {"block_bytes": lay.page_bytes, "blocks": batch,
           "raw_h2d_gbps": nbytes / _timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9,
           "raw_d2h_gbps": nbytes / _timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9}
    with tempfile.TemporaryDirectory() as d:
        with kvdb.open(d, layout=lay, model_id="gpu-check", host_bytes=4 * nbytes, device_bytes=2 * nbytes,
                       device="cuda", disk_bytes=0) as db:
            keys = db.block_keys(torch.arange(batch * lay.block_tokens * 8))
            rounds = [keys[i * batch : (i + 1) * batch] for i in range(8)]
            it = iter(rounds)
            out["put_h2d_gbps"] = nbytes / _timed(lambda: db.put_blocks(next(it), host), repeats=1) / 1e9
            ks = rounds[0]
            pinned_out = torch.empty_like(host).pin_memory()
            out["get_d2h_gbps"] = nbytes / _timed(lambda: db.get_blocks(ks, out=pinned_out)) / 1e9
            out["demote_gbps"] = nbytes / _timed(lambda: db.offload(ks, to="host"), repeats=1) / 1e9
            out["promote_gbps"] = nbytes / _timed(lambda: db.prefetch(ks), repeats=1) / 1e9
            ok = torch.equal(pinned_out.view(torch.int16), host.view(torch.int16))
            out["bit_exact"] = bool(ok)
    out["device_name"] = torch.cuda.get_device_name()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"])
    res = figures()
    print(json.dumps(res, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
