"""Every way a process ends keeps what kvdb promised, at the sizes engines write (issue 45).

Each case runs in a fresh subprocess that opens four Dbs -- one small block, and batches of 8, 64
and 256 MiB in pages of 256 KiB, 1 MiB and 2 MiB (the last two take the log writer's pipelined
path, kvdb/wal/writer.py ``append_rows``) -- puts with the default durability ("none") and ends:
``close()``, a plain exit with the Dbs open, the Dbs dropped and collected, SIGINT. The test
reopens every directory and checks every block, bit-exact. SIGTERM and SIGKILL run no exit hook:
there the background writer (kvdb/db/writeback.py) has written the pages back before the signal,
and what was put with ``group`` is there whatever the writer did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # seconds of 256 MiB writes per stop; `make test` runs them
import torch

import kvdb

#: (name, layers, blocks): pages of layers x 64 KiB (bf16, 16 tokens, 8 heads of 128)
SIZES = [("small", 1, 1), ("8MiB", 4, 32), ("64MiB", 16, 64), ("256MiB", 32, 128)]


def layout(layers: int) -> kvdb.BlockLayout:
    return kvdb.BlockLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)


def blocks(layers: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(layers * 1000 + n)
    return torch.randint(-(1 << 15), 1 << 15, (n, *layout(layers).block_shape), dtype=torch.int16,
                         generator=g).view(torch.bfloat16)


_CHILD = textwrap.dedent("""
    import gc, os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from test_stops import SIZES, blocks, layout
    import kvdb
    root, how, durability = sys.argv[2], sys.argv[3], sys.argv[4]
    dbs = []
    for name, layers, n in SIZES:
        db = kvdb.open(os.path.join(root, name), layout=layout(layers), model_id="m", host_bytes="512MiB",
                       durability=durability, writeback_s=float(sys.argv[5]) if len(sys.argv) > 5 else 1.0)
        db.put_blocks(db.block_keys(list(range(n * 16))), blocks(layers, n))
        dbs.append(db)
    if how == "close":
        for db in dbs:
            db.close()
    elif how == "gc":
        del db, dbs
        gc.collect()
        print("collected", flush=True)
    elif how in ("sigint", "sigterm", "sigkill"):
        if how != "sigint":
            time.sleep(float(sys.argv[6]))  # the background writer's rounds, then the signal
        print("ready", flush=True)
        os.kill(os.getpid(), getattr(signal, how.upper()))
        time.sleep(60)
    # "exit": the interpreter ends with every Db open
""")


def run_child(root, how: str, durability: str = "none", *extra: str) -> subprocess.CompletedProcess:
    tests_dir = os.path.dirname(__file__)
    return subprocess.run([sys.executable, "-c", _CHILD, tests_dir, str(root), how, durability, *extra],
                          capture_output=True, text=True, timeout=600)


def check_all(root) -> None:
    for name, layers, n in SIZES:
        with kvdb.open(os.path.join(root, name), layout=layout(layers), model_id="m", host_bytes="512MiB") as db:
            keys = db.block_keys(list(range(n * 16)))
            assert db.match_prefix(keys) == n, f"{name}: {db.match_prefix(keys)} of {n} blocks after the stop"
            out = torch.zeros_like(blocks(layers, n))
            db.get_blocks(keys, out=out)
            assert out.view(torch.int16).equal(blocks(layers, n).view(torch.int16)), name


@pytest.mark.parametrize("how", ["close", "exit", "gc", "sigint"])
def test_every_clean_stop_keeps_every_block_at_engine_sizes(tmp_path, how):
    r = run_child(tmp_path, how, "none", "3600")  # no background round: the stop itself writes back
    if how == "sigint":
        assert r.returncode != 0 and "KeyboardInterrupt" in r.stderr, r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
    assert "kvdb: error" not in r.stderr, r.stderr
    check_all(tmp_path)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_stop_without_exit_hooks_keeps_what_the_background_writer_wrote(tmp_path, how):
    r = run_child(tmp_path, how, "none", "0.2", "3")
    assert r.returncode == -getattr(signal, how.upper()), r.stderr
    check_all(tmp_path)


def test_a_kill_keeps_group_writes_with_no_background_writer(tmp_path):
    r = run_child(tmp_path, "sigkill", "group", "3600", "0")
    assert r.returncode == -signal.SIGKILL, r.stderr
    check_all(tmp_path)


_FAIL_AT_EXIT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from test_stops import blocks, layout
    import kvdb
    from kvdb.errors import StorageIOError
    db = kvdb.open(sys.argv[2], layout=layout(4), model_id="m", writeback_s=None)
    db.put_blocks(db.block_keys(list(range(32 * 16))), blocks(4, 32))

    def refuse(*a, **k):  # the fault: the disk refuses the exit-time write-back
        raise StorageIOError("injected: no space left on device")

    db._cold.put = refuse
    # no close(): the exit hook's write-back fails
""")


def test_a_failed_exit_write_back_says_so_on_stderr(tmp_path):
    tests_dir = os.path.dirname(__file__)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's default filters
    r = subprocess.run([sys.executable, "-c", _FAIL_AT_EXIT, tests_dir, str(tmp_path / "db")], capture_output=True,
                       text=True, timeout=300, env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvdb: error:")]
    assert len(lines) == 1, r.stderr
    assert str(tmp_path / "db") in lines[0] and "32 blocks" in lines[0] and "no space left" in lines[0], lines
    assert "Traceback" not in r.stderr, r.stderr
