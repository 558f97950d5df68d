"""A Db its owner never closes (issue 15): blocks stored with durability="none" are written back
when the interpreter exits normally (a ResourceWarning names the directory), and a dropped Db,
once collected, lets go of its locks (the directory's and the index's) so it can be reopened."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings
import weakref
from pathlib import Path

from helpers import LAYOUT, blocks_for, open_db

SECRET = b"0123456789abcdef"

_PUT_AND_EXIT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from helpers import LAYOUT, blocks_for, open_db
    db = open_db(sys.argv[1], disk_bytes=None, key_secret=b"0123456789abcdef")
    keys = db.block_keys(list(range(4 * LAYOUT.block_tokens)))
    db.put_blocks(keys, blocks_for(4))  # durability="none": in memory only until a write-back
    # no close(): the interpreter exits normally with the Db open
""")


def test_plain_exit_writes_back_durability_none_blocks(tmp_path):
    path = tmp_path / "db"
    tests_dir = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONWARNINGS="always::ResourceWarning")
    r = subprocess.run([sys.executable, "-c", _PUT_AND_EXIT, str(path), tests_dir], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "ResourceWarning" in r.stderr and str(path) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    with open_db(path, disk_bytes=None, key_secret=SECRET) as db:
        keys = db.block_keys(list(range(4 * LAYOUT.block_tokens)))
        assert db.match_prefix(keys) == 4
        out = blocks_for(4).clone().zero_()
        db.get_blocks(keys, out=out)
        assert out.equal(blocks_for(4))


def test_dropped_db_releases_its_locks_when_collected(tmp_path):
    path = tmp_path / "db"
    db = open_db(path, disk_bytes=None, key_secret=SECRET)
    keys = db.block_keys(list(range(3 * LAYOUT.block_tokens)))
    db.put_blocks(keys, blocks_for(3))
    ref = weakref.ref(db)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del db
        gc.collect()
    assert ref() is None, "the exit hook must hold open Dbs weakly"
    assert any(issubclass(w.category, ResourceWarning) and str(path) in str(w.message) for w in caught)
    with open_db(path, disk_bytes=None, key_secret=SECRET) as db:  # old code: DbLockedError (the index's lock)
        assert db.match_prefix(keys) == 3


def test_closed_db_leaves_no_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        db = open_db(tmp_path / "db", disk_bytes=None)
        db.close()
        del db
        gc.collect()
