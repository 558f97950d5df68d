"""Store identity (issue 14, hole 5): a random store id made at creation is in MANIFEST.json, the
index (``Mstore``) and every segment header (kvdb/format/manifest.py, index_value.py, record.py)
and checked at open (kvdb/cold/recovery.py step 0): a foreign index or segment is CorruptionError
and ``kvdb verify`` exits 3; a log without its MANIFEST.json, or an existing store without its
KEY_SECRET, is an error naming the file; and a failed open writes nothing."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from click.testing import CliRunner
from helpers import LAYOUT, PAGE, blocks_for, tree_hashes

import kvdb
from kvdb import native
from kvdb.cli.main import cli
from kvdb.cold.recovery import ID_COPY
from kvdb.errors import CorruptionError, InvalidInput
from kvdb.format import index_value as iv
from kvdb.format import record as fr
from kvdb.keys import KeySpace


def _make(path, n: int = 12, seed: int = 0, **kw):
    """A store of ``n`` blocks (tokens 0..4n) in 512-byte segments (several per store)."""
    with kvdb.open(path, layout=LAYOUT, model_id="m", host_bytes=2 * PAGE, durability="group", **kw) as db:
        db.cold_store.writer.segment_bytes = 2048
        keys = db.block_keys(list(range(seed, seed + 4 * n)))
        db.put_blocks(keys, blocks_for(n, seed))
    return keys


def _store_id(path) -> bytes:
    return bytes.fromhex(json.loads((path / "MANIFEST.json").read_text())["store_id"])


def _segments(path) -> list:
    return sorted((path / "wal").glob("*.log"))


_hashes = tree_hashes


def _verify_exit(path) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["verify", str(path), "--json"])
    return r.exit_code, r.output


def test_a_new_store_writes_its_id_into_manifest_index_and_every_segment(tmp_path):
    # Scenario: a new store of 12 blocks over 2 KiB segments: its id (16 random bytes, not
    # zeros) is in MANIFEST.json, in the index's Mstore, and in the header of each of its segments,
    # which are version 2 (48 bytes); compaction's rewritten segments carry it too.
    path = tmp_path / "a"
    keys = _make(path)
    sid = _store_id(path)
    assert len(sid) == 16 and sid != bytes(16) and sid != _store_id(_make_other(tmp_path))
    segs = _segments(path)
    assert len(segs) >= 3
    for p in segs:
        h = fr.decode_segment_header(p.read_bytes()[:48])
        assert (h.version, h.store_id, h.header_bytes) == (2, sid, 48)
    with kvdb.open(path, host_bytes=2 * PAGE) as db:
        assert db.cold_store.index.get(iv.STORE_KEY) == sid
        db.delete(keys[:10])
        db.cold_store.compact()
        assert db.cold_store.stats()["pages"] == 2
    for p in _segments(path):
        assert fr.decode_segment_header(p.read_bytes()[:48]).store_id == sid
    with kvdb.open(path, host_bytes=2 * PAGE) as db:
        assert db.match_prefix(keys[10:]) == 2


def _make_other(tmp_path):
    path = tmp_path / "other"
    if not path.exists():
        _make(path, seed=1000)
    return path


@pytest.mark.parametrize("copy", ["kept", "removed"])
def test_a_foreign_index_is_corruption_and_the_open_writes_nothing(tmp_path, copy):
    # Scenario: store a's index/ replaced by store b's (same layout and model). Before store ids
    # this opened and a's blocks silently went missing; now the open raises CorruptionError naming
    # index/, writes no byte anywhere in a, and kvdb verify exits 3. Removing index/ rebuilds it
    # from a's own log (C6) and every block is found again. The id is read from the copy beside
    # the index's files (KVDB-STORE-ID), or, without it, from the index itself.
    a, b = tmp_path / "a", _make_other(tmp_path)
    keys = _make(a)
    shutil.rmtree(a / "index")
    shutil.copytree(b / "index", a / "index")
    assert (a / "index" / ID_COPY).read_bytes() == _store_id(b)
    if copy == "removed":
        (a / "index" / ID_COPY).unlink()
    before = _hashes(a)
    with pytest.raises(CorruptionError, match=r"index belongs to another store"):
        kvdb.open(a, host_bytes=2 * PAGE)
    assert _hashes(a) == before
    code, out = _verify_exit(a)
    assert code == 3 and "another store" in out
    assert _hashes(a) == before
    shutil.rmtree(a / "index")
    with kvdb.open(a, host_bytes=2 * PAGE) as db:
        assert db.match_prefix(keys) == 12
        assert db.cold_store.index.get(iv.STORE_KEY) == _store_id(a)


def test_a_damaged_id_copy_is_ignored_and_written_again(tmp_path):
    # a copy cut short (or gone) is not the store's word: the index's Mstore decides, and the
    # open writes the copy again
    a = tmp_path / "a"
    keys = _make(a)
    (a / "index" / ID_COPY).write_bytes(_store_id(a)[:7])
    with kvdb.open(a, host_bytes=2 * PAGE) as db:
        assert db.match_prefix(keys) == 12
    assert (a / "index" / ID_COPY).read_bytes() == _store_id(a)


def test_a_foreign_segment_is_corruption_naming_it(tmp_path):
    # Scenario: a segment of store b dropped into a's wal/ as its next segment: the open raises
    # CorruptionError naming that file, writes nothing, and kvdb verify exits 3.
    a, b = tmp_path / "a", _make_other(tmp_path)
    _make(a)
    last = _segments(a)[-1]
    foreign = a / "wal" / fr.segment_name(fr.parse_segment_name(last.name) + 1)
    shutil.copy(_segments(b)[0], foreign)
    before = _hashes(a)
    with pytest.raises(CorruptionError, match=rf"{foreign.name} belongs to another store"):
        kvdb.open(a, host_bytes=2 * PAGE)
    assert _hashes(a) == before
    code, out = _verify_exit(a)
    assert code == 3 and foreign.name in out


def test_a_log_without_its_manifest_is_refused_and_nothing_is_written(tmp_path):
    # Scenario: MANIFEST.json deleted beside a log. Before, the open wrote a new manifest from the
    # caller's arguments over it; now: CorruptionError naming MANIFEST.json, no byte written
    # (no manifest, no secret), read-only opens say the same.
    a = tmp_path / "a"
    _make(a)
    (a / "MANIFEST.json").unlink()
    before = _hashes(a)
    for kw in ({"layout": LAYOUT, "model_id": "m"}, {"read_only": True}):
        with pytest.raises(CorruptionError, match=r"MANIFEST.json is missing .* holds a log"):
            kvdb.open(a, host_bytes=2 * PAGE, **kw)
        assert _hashes(a) == before
    code, out = _verify_exit(a)
    assert code == 3 and "MANIFEST.json is missing" in out
    assert _hashes(a) == before


def test_a_missing_key_secret_names_the_file_and_writes_nothing(tmp_path):
    # Scenario: KEY_SECRET deleted from an existing store. Before, the open wrote a new secret and
    # then blamed "a different key secret"; now: InvalidInput naming KEY_SECRET, no new file.
    a = tmp_path / "a"
    keys = _make(a)
    secret = (a / "KEY_SECRET").read_bytes()
    (a / "KEY_SECRET").unlink()
    before = _hashes(a)
    with pytest.raises(InvalidInput, match=r"KEY_SECRET is missing"):
        kvdb.open(a, host_bytes=2 * PAGE)
    assert _hashes(a) == before and not (a / "KEY_SECRET").exists()
    with kvdb.open(a, host_bytes=2 * PAGE, key_secret=secret) as db:  # the caller still has it
        assert db.match_prefix(keys) == 12


def _to_version_1(seg) -> None:
    """Rewrite a segment as one written before store ids: a 32-byte version 1 header, same records."""
    data = seg.read_bytes()
    h = fr.decode_segment_header(data[:48])
    head = fr.SEGMENT_HEADER_V1.pack(fr.SEGMENT_MAGIC, 1, 0, h.segment_no, h.first_lsn, 0)
    seg.write_bytes(head + struct.pack("<I", native.crc32c(head)) + data[48:])


def test_a_legacy_store_without_an_id_still_opens_and_grows(tmp_path):
    # Scenario: a store as kvdb wrote it before store ids: no store_id in MANIFEST.json, version 1
    # segments (32-byte headers), an index without Mstore (rebuilt here from the log). It opens,
    # every block is found, new writes land in new segments, and it reopens again: legacy stores
    # are accepted unchecked (docs/durability.md).
    a = tmp_path / "a"
    keys = _make(a)
    m = json.loads((a / "MANIFEST.json").read_text())
    del m["store_id"]
    (a / "MANIFEST.json").write_text(json.dumps(m))
    for seg in _segments(a):
        _to_version_1(seg)
    shutil.rmtree(a / "index")
    with kvdb.open(a, host_bytes=2 * PAGE, durability="group") as db:
        assert db.match_prefix(keys) == 12
        more = db.block_keys(list(range(100, 116)))
        db.put_blocks(more, blocks_for(4, 9))
        assert db.cold_store.index.get(iv.STORE_KEY) is None
    with kvdb.open(a, host_bytes=2 * PAGE) as db:
        assert db.match_prefix(keys) == 12 and db.match_prefix(more) == 4
    code, _ = _verify_exit(a)
    assert code == 0
    ks = KeySpace(model_id="m", layout=LAYOUT, key_secret=(a / "KEY_SECRET").read_bytes())
    assert ks.block_keys(list(range(48))) == keys
