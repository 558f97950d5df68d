"""With encryption at rest, PATH/KEY_SECRET is sealed under the encryption key (kvdb/format/secret.py,
kvdb/db/open.py; docs/durability.md "What the directory reveals"): whoever holds the directory
without the key cannot compute the keys of a guessed prompt and find them in the index or the log
(issue 14, hole 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import LAYOUT, PAGE, blocks_for

import kvdb
from kvdb.cli.main import cli
from kvdb.errors import CorruptionError, InvalidInput
from kvdb.format import secret as fsec
from kvdb.keys import KeySpace

TOKENS = list(range(64))  # 16 blocks of 4 tokens: the "prompt" an attacker guesses
TENANT = "acme"


def _key_file(tmp_path, byte: int = 0x11):
    kf = tmp_path / f"key-{byte:02x}.bin"
    kf.write_bytes(bytes([byte]) * 32)
    return str(kf)


def _store_prompt(path, kf):
    with kvdb.open(path, layout=LAYOUT, model_id="m", host_bytes=4 * PAGE, encryption_key_file=kf,
                   durability="group") as db:
        keys = db.block_keys(TOKENS, tenant=TENANT)
        db.put_blocks(keys, blocks_for(len(keys)))
    return keys


def _logged_keys(path) -> set[str]:
    """The block keys ``kvdb wal dump`` shows (what anyone holding the directory can list)."""
    out = CliRunner().invoke(cli, ["wal", "dump", str(path), "--json"])
    assert out.exit_code == 0, out.output
    return {r["key"] for r in json.loads(out.stdout) if r["type"] == "PUT_BLOCK"}


def _attacker_keys(path) -> set[str]:
    """What an attacker with the directory alone computes for the guessed prompt: the keys under
    the KEY_SECRET file's bytes taken as the secret (what worked before sealing)."""
    raw = (path / "KEY_SECRET").read_bytes()
    ks = KeySpace(model_id="m", layout=LAYOUT, key_secret=raw)
    return {k.hex() for k in ks.block_keys(TOKENS, tenant=TENANT)}


def test_directory_alone_does_not_yield_the_keys_of_a_guessed_prompt(tmp_path):
    # Scenario: an encrypted store holds a 16-block prompt of tenant acme. The KEY_SECRET file is
    # sealed (magic, 68 bytes), so the guessed prompt's keys computed from the directory's bytes
    # match 0 of the 16 logged keys; with the encryption key the store reads every block back.
    path, kf = tmp_path / "db", _key_file(tmp_path)
    keys = _store_prompt(path, kf)
    raw = (path / "KEY_SECRET").read_bytes()
    assert raw.startswith(fsec.SEALED_MAGIC) and len(raw) == 68
    assert oct((path / "KEY_SECRET").stat().st_mode & 0o777) == "0o600"
    logged = _logged_keys(path)
    assert logged == {k.hex() for k in keys} and len(logged) == 16
    assert _attacker_keys(path) & logged == set()
    manifest = (path / "MANIFEST.json").read_text()
    assert raw[8:].hex() not in manifest and all(k.hex() not in manifest for k in keys)
    with kvdb.open(path, host_bytes=4 * PAGE, encryption_key_file=kf) as db:
        again = db.block_keys(TOKENS, tenant=TENANT)
        assert again == keys and db.match_prefix(again) == 16
        out = blocks_for(16) * 0
        db.get_blocks(again, out=out)
        assert out.equal(blocks_for(16))


def test_a_sealed_secret_needs_the_right_key(tmp_path):
    # Scenario: the sealed KEY_SECRET does not open without the key or under another one; the
    # open says which file and writes nothing.
    path, kf = tmp_path / "db", _key_file(tmp_path)
    _store_prompt(path, kf)
    before = (path / "KEY_SECRET").read_bytes()
    with pytest.raises(InvalidInput, match="open it with encryption_key_file="):
        kvdb.open(path, host_bytes=4 * PAGE)
    with pytest.raises(InvalidInput, match="encryption key does not match.*KEY_SECRET does not open"):
        kvdb.open(path, host_bytes=4 * PAGE, encryption_key_file=_key_file(tmp_path, 0x22))
    assert (path / "KEY_SECRET").read_bytes() == before


def test_a_plain_secret_of_an_encrypted_store_is_sealed_at_open(tmp_path):
    # Scenario: a store encrypted before sealing existed (its KEY_SECRET plain): it opens with its
    # key, its keys are unchanged, and the open seals the file in place. A wrong key fails before
    # the file is touched (the disk tier's key check comes first), so no secret is ever sealed
    # under a key the store does not use.
    kf = _key_file(tmp_path)
    plain = os.urandom(32)
    # stand in for an old store: put a plain secret back and re-key the manifest and blocks with it
    path2 = tmp_path / "old"
    path2.mkdir()
    (path2 / "KEY_SECRET").write_bytes(plain)
    with kvdb.open(path2, layout=LAYOUT, model_id="m", host_bytes=4 * PAGE, key_secret=plain,
                   encryption_key_file=kf, durability="group") as db:
        old_keys = db.block_keys(TOKENS, tenant=TENANT)
        db.put_blocks(old_keys, blocks_for(16))
    # key_secret= given, the same secret plain in the file: sealed as well once the key is accepted
    assert (path2 / "KEY_SECRET").read_bytes().startswith(fsec.SEALED_MAGIC)
    (path2 / "KEY_SECRET").write_bytes(plain)  # back to an old store's plain file
    with pytest.raises(InvalidInput, match="does not match"):
        kvdb.open(path2, host_bytes=4 * PAGE, encryption_key_file=_key_file(tmp_path, 0x22))
    assert (path2 / "KEY_SECRET").read_bytes() == plain
    with kvdb.open(path2, host_bytes=4 * PAGE, encryption_key_file=kf) as db:
        assert db.block_keys(TOKENS, tenant=TENANT) == old_keys and db.match_prefix(old_keys) == 16
    secret_now = (path2 / "KEY_SECRET").read_bytes()
    assert secret_now.startswith(fsec.SEALED_MAGIC) and plain not in secret_now
    with kvdb.open(path2, host_bytes=4 * PAGE, encryption_key_file=kf) as db:
        assert db.match_prefix(db.block_keys(TOKENS, tenant=TENANT)) == 16


def test_without_encryption_the_secret_stays_plain(tmp_path):
    # Scenario: a store without encryption keeps its 32-byte plain secret (nothing to seal it
    # under); docs/durability.md says so.
    path = tmp_path / "db"
    with kvdb.open(path, layout=LAYOUT, model_id="m", host_bytes=4 * PAGE, disk_bytes=None) as db:
        keys = db.block_keys(TOKENS, tenant=TENANT)
    raw = (path / "KEY_SECRET").read_bytes()
    assert len(raw) == 32 and not raw.startswith(fsec.SEALED_MAGIC)
    assert KeySpace(model_id="m", layout=LAYOUT, key_secret=raw).block_keys(TOKENS, tenant=TENANT) == keys


GOLDEN = Path(__file__).resolve().parent / "golden" / "key_secret_sealed.bin"


def test_golden_sealed_key_secret(monkeypatch):
    # the worked example of kvdb/format/secret.py: secret 20..3f sealed under key 00..1f with the
    # nonce fixed at 64..6f; it decodes and opens under that key only
    from kvdb.cold import codec as codec_mod

    monkeypatch.setattr(codec_mod.os, "urandom", lambda n: bytes(range(0x64, 0x64 + n)))
    sealer = codec_mod.Sealer(bytes(range(32)))
    data = fsec.encode_sealed(sealer.seal(bytes(range(0x20, 0x40)), fsec.SEALED_AAD))
    if os.environ.get("KVDB_REGEN_GOLDEN"):
        GOLDEN.write_bytes(data)
    assert GOLDEN.read_bytes() == data and len(data) == 68 and data[8:20] == bytes(range(0x64, 0x70))
    sealed, body = fsec.decode(data, "KEY_SECRET")
    assert sealed and sealer.open(body, fsec.SEALED_AAD) == bytes(range(0x20, 0x40))
    with pytest.raises(CorruptionError):
        codec_mod.Sealer(bytes(32)).open(body, fsec.SEALED_AAD)
    assert fsec.decode(bytes(range(32)), "KEY_SECRET") == (False, bytes(range(32)))
    with pytest.raises(CorruptionError, match="KEY_SECRET holds 3 bytes"):
        fsec.decode(b"abc", "KEY_SECRET")
