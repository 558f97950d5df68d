"""``kvdb ls`` and ``kvdb get`` (issue 15): list the blocks of a data directory and dump one,
read-only like ``kvdb stats`` / ``verify`` / ``wal dump`` (kvdb/cli/inspect.py): every file's hash
unchanged, on a read-only copy, and beside a Db another process holds open as a writer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat

import pytest
from helpers import LAYOUT, blocks_for, held_by_another_process, open_db, run_cli, tree_hashes



hashes = tree_hashes


def run(*args):
    r = run_cli(*args)
    assert "Traceback" not in r.output, r.output
    return r


def page_of(blocks, i: int) -> bytes:
    return blocks[i].contiguous().numpy().tobytes()


@pytest.fixture
def store(tmp_path):
    # Scenario: 6 blocks put into a Db with 2 host pages and an unbounded disk tier, then closed:
    # all 6 are on the disk tier (4 evicted on the way in, 2 written back at the close).
    path = tmp_path / "db"
    db = open_db(path, disk_bytes=None, host_pages=2)
    keys = db.block_keys(list(range(6 * LAYOUT.block_tokens)))
    db.put_blocks(keys, blocks_for(6))
    db.close()
    return path, [bytes(k).hex() for k in keys]


def test_ls_lists_every_block_newest_first(store):
    path, keys = store
    r = run("ls", path, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert sorted(b["key"] for b in out["blocks"]) == sorted(keys)
    assert {b["tier"] for b in out["blocks"]} == {"disk"}
    assert {b["page_bytes"] for b in out["blocks"]} == {LAYOUT.page_bytes}
    lsns = [b["lsn"] for b in out["blocks"]]
    assert lsns == sorted(lsns, reverse=True) and len(set(lsns)) == 6
    assert out["blocks_total"] == 6 and out["as_of_lsn"] >= lsns[0] and out["writer_live"] is False
    r = run("ls", path, "--json", "--limit", "2")
    assert json.loads(r.output)["blocks"] == out["blocks"][:2]  # the two newest
    r = run("ls", path)
    assert r.exit_code == 0
    assert all(k in r.output for k in keys) and "view: the log up to lsn" in r.output
    r = run("ls", path, "--json", "--namespace", str(out["blocks"][0]["namespace_id"] + 1))
    assert json.loads(r.output)["blocks"] == []


def test_get_dumps_one_block(store, tmp_path):
    path, keys = store
    blocks = blocks_for(6)
    out = tmp_path / "block.bin"
    r = run("get", path, keys[2], "-o", out, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert out.read_bytes() == page_of(blocks, 2)
    assert info["sha256"] == hashlib.sha256(page_of(blocks, 2)).hexdigest()
    assert info["shape"] == list(LAYOUT.block_shape) and info["dtype"] == "float32"
    r = run("get", path, keys[0], "--hex-bytes", "16")
    assert r.exit_code == 0, r.output
    assert page_of(blocks, 0)[:16].hex(" ") in r.output


def test_get_errors(store, tmp_path):
    path, keys = store
    r = run("get", path, "00" * 16)
    assert r.exit_code == 1 and "kvdb: error:" in r.output and "not in" in r.output
    r = run("get", path, "xyz")
    assert r.exit_code == 2 and "not a block key" in r.output
    r = run("get", path, keys[0], "-o", tmp_path / "missing-dir" / "b.bin")
    assert r.exit_code == 1 and "kvdb: error: cannot write the block" in r.output


def test_ls_get_wal_dump_leave_every_byte_on_a_read_only_copy(store, tmp_path):
    path, keys = store
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    before = hashes(copy)
    paths = [os.path.join(root, n) for root, dirs, files in os.walk(copy) for n in files + dirs] + [str(copy)]
    try:
        for p in paths:
            os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        for _ in range(2):
            assert run("ls", copy, "--json").exit_code == 0
            assert run("get", copy, keys[1], "-o", tmp_path / "b.bin").exit_code == 0
            r = run("wal", "dump", copy, "--json")
            assert r.exit_code == 0, r.output
            assert sorted(x["key"] for x in json.loads(r.output) if x["type"] == "PUT_BLOCK") == sorted(keys)
        assert hashes(copy) == before
    finally:
        for p in reversed(paths):
            os.chmod(p, os.stat(p).st_mode | stat.S_IWUSR)


def test_ls_get_wal_dump_leave_every_byte_of_a_writable_directory(store, tmp_path):
    path, keys = store
    before = hashes(path)
    for _ in range(2):
        assert run("ls", path).exit_code == 0
        assert run("get", path, keys[3]).exit_code == 0
        assert run("wal", "dump", path).exit_code == 0
    assert hashes(path) == before  # no LOCK file made, no checkpoint, no index write


def test_ls_get_wal_dump_while_another_process_holds_the_db(tmp_path):
    path = tmp_path / "db"
    with held_by_another_process(path) as keys:
        assert len(keys) == 6
        before = hashes(path)
        r = run("ls", path, "--json")
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        assert out["writer_live"] is True
        assert sorted(b["key"] for b in out["blocks"]) == sorted(keys)  # group puts: in the log
        r = run("get", path, keys[4], "-o", tmp_path / "b.bin")
        assert r.exit_code == 0, r.output
        assert (tmp_path / "b.bin").read_bytes() == page_of(blocks_for(6), 4)
        r = run("wal", "dump", path, "--json")
        assert r.exit_code == 0, r.output
        assert hashes(path) == before
