"""Corruption tests, one per kind of damage (docs/style.md "Tests"; LevelDB's log_test in spirit):
``kvdb verify`` is the oracle (exit 3, the problem named), and reads never return wrong bytes --
a damaged block is a miss and a counted corruption.

Scenario for every test: 30 blocks of 128 bytes in segments of 1 KiB (about 6 segments),
5 of them deleted, a clean close; then one kind of damage is done to the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvdb.cli.main import cli
from kvdb.cold import ColdStore
from kvdb.errors import CorruptionError
from kvdb.format.record import segment_name

from cold_fixtures import TINY, key, pages_for, write_manifest

KEYS = [key(i) for i in range(30)]
LIVE = KEYS[5:]


def build(path: Path) -> None:
    write_manifest(path)
    with ColdStore.open(path, TINY, segment_bytes=1024, flush_interval_s=None) as s:
        s.put(KEYS[:15], pages_for(KEYS[:15]), list(range(15)), "group")
        s.put(KEYS[15:], pages_for(KEYS[15:]), None, "sync")
        s.delete(KEYS[:5])


def verify_cli(path: Path) -> tuple[int, dict]:
    r = CliRunner().invoke(cli, ["verify", str(path), "--json"])
    return r.exit_code, json.loads(r.stdout)


def puts(path: Path) -> list[dict]:
    r = CliRunner().invoke(cli, ["wal", "dump", str(path), "--json"])
    assert r.exit_code == 0, r.output
    return [row for row in json.loads(r.stdout) if row["type"] == "PUT_BLOCK"]


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def seg_path(root: Path, n: int) -> Path:
    return root / "wal" / segment_name(n)


def reads_are_exact_or_missing(path: Path) -> tuple[list[bool], int]:
    """Open and read every live key: a hit must be bit-exact. Returns (found, corruptions)."""
    with ColdStore.open(path, TINY, segment_bytes=1024, flush_interval_s=None) as s:
        out = np.zeros((len(LIVE), TINY.page_bytes), np.uint8)
        found = s.get_into(LIVE, out)
        want = pages_for(LIVE)
        for i, ok in enumerate(found):
            if ok:
                assert (out[i] == want[i]).all()
            else:
                assert (out[i] == 0).all()
        return found, s.stats()["corruptions"]


@pytest.fixture
def db(tmp_path):
    build(tmp_path)
    code, rep = verify_cli(tmp_path)
    assert code == 0 and rep["ok"] and rep["entries"] == 25 and rep["problems"] == []
    return tmp_path


def victim(db: Path, nth: int = 7) -> dict:
    """A live block's PUT record in a sealed segment (not the last one)."""
    rows = [r for r in puts(db) if bytes.fromhex(r["key"]) in LIVE and r["segment"] < 3]
    return rows[nth % len(rows)]


@pytest.mark.parametrize("where", ["payload", "header", "length"])
def test_bit_flip_in_a_record(db, where):
    v = victim(db)
    at = {"payload": v["offset"] + 53 + 40, "header": v["offset"] + 9, "length": v["offset"] + 1}[where]
    flip(seg_path(db, v["segment"]), at, 0x04)
    code, rep = verify_cli(db)
    assert code == 3 and not rep["ok"]
    assert any(v["key"] in p for p in rep["problems"])
    found, corruptions = reads_are_exact_or_missing(db)
    assert found.count(False) == 1 and not found[LIVE.index(bytes.fromhex(v["key"]))]
    assert corruptions == 1


def test_bit_flip_in_a_segment_header(db):
    flip(seg_path(db, 2), 20, 0x80)
    code, rep = verify_cli(db)
    assert code == 3
    assert any("segment 2 has a damaged header" in p for p in rep["problems"])
    found, _ = reads_are_exact_or_missing(db)
    assert all(found)  # the records themselves are intact and checked one by one


def test_truncated_segment(db):
    v = victim(db, 0)
    p = seg_path(db, v["segment"])
    os.truncate(p, v["offset"] + 30)
    code, rep = verify_cli(db)
    assert code == 3
    assert any(f"sealed segment {v['segment']} ends in a damaged record" in x or "runs past the end" in x
               for x in rep["problems"])
    found, corruptions = reads_are_exact_or_missing(db)
    assert not found[LIVE.index(bytes.fromhex(v["key"]))]
    assert corruptions == found.count(False) >= 1


def test_truncated_last_segment_is_not_mistaken_for_a_torn_tail(tmp_path):
    # Scenario: one segment only; its 25 live records were acknowledged and indexed, so cutting
    # the file inside the 20th is damage, not the torn tail of an interrupted append.
    write_manifest(tmp_path)
    with ColdStore.open(tmp_path, TINY, flush_interval_s=None) as s:
        s.put(LIVE, pages_for(LIVE), None, "sync")
    rows = puts(tmp_path)
    assert {r["segment"] for r in rows} == {1}
    os.truncate(seg_path(tmp_path, 1), rows[19]["offset"] + 10)
    code, rep = verify_cli(tmp_path)
    assert code == 3
    assert any("shorter than its checkpoint" in p for p in rep["problems"])
    assert sum("runs past the end" in p for p in rep["problems"]) == 6
    found, corruptions = reads_are_exact_or_missing(tmp_path)
    assert found == [True] * 19 + [False] * 6 and corruptions == 6
    # new writes go to a fresh segment, never under the entries that point past the cut
    with ColdStore.open(tmp_path, TINY, flush_interval_s=None) as s:
        s.put([key(500)], pages_for([key(500)]), None, "sync")
        out = np.zeros((1, TINY.page_bytes), np.uint8)
        assert s.get_into([key(500)], out) == [True] and (out == pages_for([key(500)])).all()
    assert {r["segment"] for r in puts(tmp_path) if r["key"] == key(500).hex()} == {2}


def test_missing_segment(db):
    os.unlink(seg_path(db, 2))
    code, rep = verify_cli(db)
    assert code == 3
    assert any("segment 2 is missing" in p for p in rep["problems"])
    found, corruptions = reads_are_exact_or_missing(db)
    assert 1 <= found.count(False) == corruptions


def test_damaged_rocksdb_table_file(db):
    ssts = sorted((db / "index").glob("*.sst"))
    assert ssts
    for sst in ssts:
        flip(sst, 40, 0xFF)
    code, rep = verify_cli(db)
    assert code == 3
    assert rep["problems"]
    try:
        found, _ = reads_are_exact_or_missing(db)
    except CorruptionError:
        pass  # refusing to open is also a right answer; wrong bytes never are


def test_missing_rocksdb_manifest(db):
    for m in (db / "index").glob("MANIFEST-*"):
        m.unlink()
    code, rep = verify_cli(db)
    assert code == 3
    assert rep["problems"][0].startswith("open:")
    with pytest.raises(CorruptionError):
        ColdStore.open(db, TINY, flush_interval_s=None)
