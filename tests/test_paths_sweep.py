"""The same blocks through every write and read path, ended every way (issue 45 item 7).

Features that have a fast path are also tried through their slow one, at sizes that take the
fast path (8 blocks of 1 MiB: over the log writer's 4 MiB write, so ``append_rows`` pipelines):

    pipelined   one put of all 8 blocks: PutRows, writes overlapped on the log's I/O thread
    one-write   one put per block: PutRows, each a single inline write
    per-record  codec "zstd": one encoded record at a time (PutItems, ``LogWriter.append``)
    spill       a host tier of two pages: the put itself evicts, the pool's spill callback writes

Each stop -- ``close()``, a plain exit, SIGKILL after the background writer's round, SIGKILL after
``group`` puts -- runs in a fresh process over one Db per path; the test reopens each and reads the
blocks back twice, through the coalesced read (one call, the reader's I/O thread) and one block
per call, and inside an exit hook of a fresh process (the reader's pool refuses work there).
Every path must give the same bytes on every stop. Other fast paths have their own sweeps: the
native committer writes the Python leader's bytes (tests/cold/test_group_commit.py), vLLM's
probed layouts match a transformers recomputation (tests/integrations/test_vllm.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import kvdb

pytestmark = pytest.mark.slow

PATHS = ["pipelined", "one-write", "per-record", "spill"]
N = 8
LAYOUT = kvdb.BlockLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)  # 1 MiB


def blocks() -> torch.Tensor:
    g = torch.Generator().manual_seed(45)
    return torch.randint(-(1 << 15), 1 << 15, (N, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)


def options(path: str) -> dict:
    return {"codec": "zstd" if path == "per-record" else "raw",
            "host_bytes": 2 * LAYOUT.page_bytes if path == "spill" else 64 * LAYOUT.page_bytes}


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from test_paths_sweep import LAYOUT, N, PATHS, blocks, options
    import kvdb
    root, how = sys.argv[2], sys.argv[3]
    durability = "group" if how == "kill-group" else "none"
    dbs = []
    for p in PATHS:
        db = kvdb.open(os.path.join(root, p), layout=LAYOUT, model_id="m", durability=durability,
                       writeback_s=0.2 if how == "kill-writer" else 3600.0, **options(p))
        keys, b = db.block_keys(list(range(N * 16))), blocks()
        if p == "one-write":
            for i in range(N):
                db.put_blocks(keys[i : i + 1], b[i : i + 1])
        else:
            db.put_blocks(keys, b)
        dbs.append(db)
    if how == "close":
        for db in dbs:
            db.close()
    elif how.startswith("kill"):
        if how == "kill-writer":
            time.sleep(2.0)
        os.kill(os.getpid(), signal.SIGKILL)
""")

_READ_AT_EXIT = textwrap.dedent("""
    import atexit, os, sys
    sys.path.insert(0, sys.argv[1])
    from test_paths_sweep import LAYOUT, N, blocks
    import kvdb, torch
    db = kvdb.open(sys.argv[2], layout=LAYOUT, model_id="m", host_bytes=2 * LAYOUT.page_bytes)

    def read():  # runs after concurrent.futures has stopped taking work
        out = torch.zeros_like(blocks())
        db.get_blocks(db.block_keys(list(range(N * 16))), out=out)
        print("same" if out.view(torch.int16).equal(blocks().view(torch.int16)) else "DIFFERENT", flush=True)

    atexit.register(read)
""")


@pytest.mark.parametrize("how", ["close", "exit", "kill-writer", "kill-group"])
def test_every_path_keeps_the_same_bytes_on_every_stop(tmp_path, how):
    tests_dir = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", _CHILD, tests_dir, str(tmp_path), how], capture_output=True, text=True,
                       timeout=600)
    if how.startswith("kill"):
        assert r.returncode == -signal.SIGKILL, r.stderr
    else:
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    want = blocks().view(torch.int16)
    for p in PATHS:
        with kvdb.open(tmp_path / p, **options(p)) as db:
            keys = db.block_keys(list(range(N * 16)))
            assert db.match_prefix(keys) == N, (how, p)
            out = torch.zeros_like(blocks())
            db.get_blocks(keys, out=out)  # coalesced: one call for every block
            assert out.view(torch.int16).equal(want), (how, p, "batched")
            for i in range(N):  # one block per call
                one = torch.zeros_like(blocks()[:1])
                db.get_blocks(keys[i : i + 1], out=one)
                assert one.view(torch.int16).equal(want[i : i + 1]), (how, p, i)
    r = subprocess.run([sys.executable, "-c", _READ_AT_EXIT, tests_dir, str(tmp_path / "pipelined")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "same", (r.stdout, r.stderr)
