"""kvdb verify / compact / wal dump / bench cold: exit codes, --json shapes, exact counts."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvdb.cli.main import cli
from kvdb.cold import ColdStore

from cold_fixtures import TINY, key, pages_for, write_manifest


def run(*args):
    return CliRunner().invoke(cli, list(args))


def make(path, n=10, deleted=4):
    write_manifest(path)
    keys = [key(i) for i in range(n)]
    with ColdStore.open(path, TINY, segment_bytes=1024, flush_interval_s=None) as s:
        s.put(keys, pages_for(keys), list(range(n)), "group")
        s.delete(keys[:deleted])
        s.put_metadata("session", b"s1", b"x")
    return keys


def test_wal_dump_lists_every_record(tmp_path):
    make(tmp_path)
    r = run("wal", "dump", str(tmp_path), "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    types = [row["type"] for row in rows]
    assert types.count("PUT_BLOCK") == 10 and types.count("DELETE") == 1 and types.count("SESSION") == 1
    assert types[-1] == "CHECKPOINT"
    assert [row["lsn"] for row in rows] == list(range(1, len(rows) + 1))
    first = rows[0]
    assert (first["segment"], first["offset"], first["key"], first["position"], first["raw_bytes"]) == \
        (1, 48, key(0).hex(), 0, TINY.page_bytes)  # after the 48-byte segment header
    delete = next(row for row in rows if row["type"] == "DELETE")
    assert delete["keys"] == [key(i).hex() for i in range(4)]
    text = run("wal", "dump", str(tmp_path))
    assert text.exit_code == 0 and len(text.stdout.splitlines()) == len(rows)
    one = run("wal", "dump", str(tmp_path), "--segment", "2", "--json")
    assert {row["segment"] for row in json.loads(one.stdout)} == {2}
    assert run("wal", "dump", str(tmp_path), "--segment", "99").exit_code == 1
    assert run("wal", "dump", str(tmp_path / "nope")).exit_code == 2  # usage: no such directory


def test_verify_clean_and_compact(tmp_path):
    keys = make(tmp_path)
    r = run("verify", str(tmp_path), "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["entries"] == 6 and rep["problems"] == []
    r = run("compact", str(tmp_path), "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["segments_deleted"] >= 1 and res["segments_after"] < res["segments_before"]
    assert json.loads(run("verify", str(tmp_path), "--json").stdout)["entries"] == 6
    with ColdStore.open(tmp_path, TINY, flush_interval_s=None) as s:
        assert s.contains(keys) == [False] * 4 + [True] * 6


def test_verify_without_a_manifest_is_a_runtime_error(tmp_path):
    r = run("verify", str(tmp_path))
    assert r.exit_code == 1 and "MANIFEST" in r.output


def test_bench_cold_json_reports_every_figure(tmp_path):
    r = run("bench", "cold", "--json", "--dir", str(tmp_path), "--total-mib", "8", "--batch-pages", "2",
            "--threads", "2", "--ops", "10", "--recovery-mib", "4", "--repeats", "2")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    for k in ("raw_write_gbps", "write_gbps", "raw_read_gbps", "read_gbps", "group_commit_ops_s", "sync_ops_s",
              "write_vs_raw", "read_vs_raw", "group_vs_sync", "recovery_s", "goals"):
        assert k in res, k
    assert res["bytes"] == 8 << 20 and res["repeats"] == 2 and len(res["read_vs_raw_runs"]) == 2
    assert res["recovery_ok"] is True
    assert list(tmp_path.iterdir()) == []  # scratch files removed


def test_bench_scale_json_reports_ingest_and_open_figures_next_to_their_baselines(tmp_path):
    # issue 12 item 5: each figure with its same-run baseline (no timing asserted)
    r = run("bench", "scale", "--json", "--dir", str(tmp_path), "--total-mib", "1", "--batch-pages", "8",
            "--get1-blocks", "2", "--repeats", "1", "--ingest-mib", "1", "--open-blocks", "100",
            "--open-large-blocks", "300", "--writeback-mib", "128")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    for size in ("4k", "64k"):
        ing = res[f"ingest_{size}"]
        for k in ("ingest_gbps", "raw_write_gbps", "ingest_vs_raw", "ingest_us_per_block", "raw_write_us_per_block",
                  "ingest_cpu_beyond_raw_us", "index_us_per_block", "index_lookup_us_per_block",
                  "goal_budget_us_per_block"):
            assert k in ing, k
        assert ing["blocks"] * ing["page_bytes"] >= 1 << 20
    assert {"open_10k_s", "rocksdb_open_10k_s", "open_1m_s", "rocksdb_open_1m_s", "open_py_bytes_per_block",
            "open_rss_bytes_per_block", "read_gbps", "raw_read_gbps", "ingest_goals", "read_small_host_gbps",
            "read_small_host_vs_raw", "close_gbps", "close_raw_write_gbps", "close_vs_raw"} <= set(res)
    assert {"read_small_host_vs_raw_min", "close_vs_raw_min", "met"} <= set(res["goals"])
    assert res["open_small_blocks"] == 100 and res["open_large_blocks"] == 300
    assert list(tmp_path.iterdir()) == []  # scratch files removed
