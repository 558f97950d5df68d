"""``kvdb bench shared --json``, tiny (2 pages, 1 round): it starts its own private pool, runs
both sides of each figure and reports every key (no timing asserts: kvdb/bench/shared.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import need_pool

from kvdb.shared.localpool import die_with_parent

KEYS = ["pages", "page_bytes", "repeats", "corruptions", "dropped_puts"] + [
    f"{pre}{name}{suf}" for name in ("put", "get")
    for pre, suf in [("", "_mbps"), ("", "_mbps_runs"), ("", "_mbps_spread"), ("store_", "_mbps"),
                     ("store_", "_mbps_runs"), ("store_", "_mbps_spread"), ("", "_vs_store"),
                     ("", "_vs_store_runs"), ("", "_goal"), ("", "_meets_goal")]]


def test_bench_shared_json_tiny(tmp_path):
    need_pool()
    # a process of its own: the bench makes its own network namespace, and the Store client
    # keeps connections in the namespace it first used (conftest.py)
    r = subprocess.run([sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "bench", "shared", "--json",
                        "--pages", "2", "--repeats", "1", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, preexec_fn=die_with_parent,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert [k for k in KEYS if k not in res] == []
    assert res["pages"] == 2 and res["repeats"] == 1 and res["page_bytes"] == 2 << 20
    assert len(res["put_mbps_runs"]) == 1 and len(res["store_get_mbps_runs"]) == 1
    assert res["corruptions"] == 0 and res["dropped_puts"] == 0
    assert os.listdir(tmp_path) == []  # the Dbs' directories are removed
