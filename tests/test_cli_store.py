"""``kvdb --version``, ``kvdb stats`` and ``kvdb bench datapath|keys`` through click's runner."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from helpers import LAYOUT

import kvdb
from kvdb.cli.main import cli


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and kvdb.__version__ in r.output


def test_stats_survive_reopen(tmp_path):
    # Scenario: 6 blocks into a 2-page host tier with the disk tier on: 4 spill to disk at once,
    # the rest at close; `kvdb stats --json` after reopen shows all 6 on disk.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=2 * LAYOUT.page_bytes) as db:
        keys = db.block_keys(list(range(24)))
        db.put_blocks(keys, torch.randn((6, *LAYOUT.block_shape)))
        before = db.stats()["tiers"]
        assert before["host"]["pages"] == 2 and before["disk"]["pages"] == 4
    r = run("stats", str(tmp_path), "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["model_id"] == "m" and s["layout"] == LAYOUT.to_dict()
    assert s["tiers"]["disk"]["pages"] == 6
    assert s["tiers"]["host"]["pages"] == 0
    r = run("stats", str(tmp_path))
    assert r.exit_code == 0 and "disk" in r.output


def test_stats_errors_have_exit_codes(tmp_path):
    r = run("stats", str(tmp_path))  # an empty directory is not a data directory
    assert r.exit_code == 1 and "MANIFEST" in r.output
    assert run("stats").exit_code == 2  # usage
    with kvdb.open(tmp_path / "d", layout=LAYOUT, model_id="m", host_bytes=LAYOUT.page_bytes):
        r = run("stats", str(tmp_path / "d"))  # read-only: works beside the open Db (tests/test_read_only.py)
        assert r.exit_code == 0 and "m" in r.output, r.output


def test_bench_datapath_json_fields():
    r = run("bench", "datapath", "--json", "--batch", "2", "--repeats", "2", "--meta-blocks", "2000")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["block_bytes"] == 2 << 20 and res["blocks"] == 2 and res["meta_blocks"] == 2000
    for k in ("memcpy_gbps", "put_gbps", "get_gbps", "metadata_bytes_per_block"):
        assert res[k] > 0


def test_bench_keys_json_fields():
    r = run("bench", "keys", "--json", "--prompt-tokens", "4096")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["blocks"] == 256 and res["keys_blocks_per_s"] > 0 and res["hashlib_blocks_per_s"] > 0
