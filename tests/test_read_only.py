"""Read-only inspection (issue 15): ``kvdb.open(path, read_only=True)``, ``kvdb stats`` and
``kvdb verify`` write no byte (every file's hash unchanged: no log record, no checkpoint, no
index write), take no lock (they work beside a live writer, in this process or another) and
work on a read-only copy."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
from helpers import LAYOUT, blocks_for, held_by_another_process, open_db, run_cli, tree_hashes

import kvdb
from kvdb.errors import InvalidInput, NotFound

SECRET = b"0123456789abcdef"


hashes = tree_hashes


run = run_cli


def make_db(path, n: int = 6):
    db = open_db(path, disk_bytes=None, host_pages=2)  # KEY_SECRET made in the directory
    keys = db.block_keys(list(range(n * LAYOUT.block_tokens)))
    db.put_blocks(keys, blocks_for(n))
    return db, keys


def test_stats_and_verify_twice_leave_every_byte(tmp_path):
    db, _ = make_db(tmp_path)
    db.close()
    before = hashes(tmp_path)
    for _ in range(2):
        r = run("stats", tmp_path, "--json")
        assert r.exit_code == 0, r.output
        assert '"read_only": true' in r.output
        r = run("verify", tmp_path, "--json")
        assert r.exit_code == 0, r.output
    assert hashes(tmp_path) == before  # old code: 2 log records per stats, a checkpoint per verify


def test_read_only_open_beside_a_live_writer_in_this_process(tmp_path):
    db, keys = make_db(tmp_path)
    db.flush()  # the blocks are in the log; the index may not hold them yet (the replay does)
    before = hashes(tmp_path)
    with kvdb.open(tmp_path, read_only=True, host_bytes=LAYOUT.page_bytes) as ro:  # no lock conflict
        assert ro.stats()["tiers"]["disk"]["pages"] == 6
        assert ro.match_prefix(keys) == 6
        out = blocks_for(6).zero_()
        ro.get_blocks(keys, out=out)
        assert out.equal(blocks_for(6))
        with pytest.raises(InvalidInput, match="read_only"):
            ro.put_blocks(keys, blocks_for(6))
        with pytest.raises(InvalidInput, match="read_only"):
            ro.delete(keys)
    assert hashes(tmp_path) == before
    db.close()


def test_read_only_open_of_a_missing_directory_makes_nothing(tmp_path):
    with pytest.raises(NotFound):
        kvdb.open(tmp_path / "nope", read_only=True)
    assert not (tmp_path / "nope").exists()


def test_stats_and_verify_while_another_process_holds_the_db(tmp_path):
    path = tmp_path / "db"
    with held_by_another_process(path) as keys:
        assert len(keys) == 6
        r = run("stats", path, "--json")  # old code: "already open", exit 1
        assert r.exit_code == 0, r.output
        assert '"pages": 6' in r.output
        r = run("verify", path, "--json")  # old code: a RocksDB lock error
        assert r.exit_code == 0, r.output
        assert '"ok": true' in r.output


def test_stats_and_verify_on_a_read_only_copy(tmp_path):
    db, _ = make_db(tmp_path / "db")
    db.close()
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "db", copy)
    before = hashes(copy)
    modes = []
    for root, dirs, files in os.walk(copy):
        for name in files + dirs:
            p = os.path.join(root, name)
            modes.append(p)
    try:
        for p in modes + [str(copy)]:
            os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        r = run("stats", copy, "--json")
        assert r.exit_code == 0 and "Traceback" not in r.output, r.output
        r = run("verify", copy, "--json")
        assert r.exit_code == 0, r.output
        r = run("wal", "dump", copy, "--json")
        assert r.exit_code == 0, r.output
        assert hashes(copy) == before
    finally:
        for p in [str(copy)] + modes:
            os.chmod(p, os.stat(p).st_mode | stat.S_IWUSR)
