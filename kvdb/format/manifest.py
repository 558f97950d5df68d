"""MANIFEST.json: what a data directory holds, written once at creation and checked at every open.

A UTF-8 JSON object (one line, sorted keys), written to MANIFEST.json.tmp, fsynced, renamed over
MANIFEST.json, directory fsynced, so it is always either the old or the new whole file:

    {"format": "kvdb-manifest", "version": 1,
     "model_id": "llama-3-8b", "model_revision": null,
     "layout": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_tokens": 16,
                "dtype": "bfloat16"},
     "key_algo": "sha256", "key_secret_id": "3f2a...",          # HMAC of a constant, hex
     "store_id": "9c1e...",                                      # 16 random bytes, hex
     "tp_rank": null, "tp_size": null, "pp_rank": null, "pp_size": null}

``key_secret_id`` identifies the key secret without revealing it, so a Db opened with a
different secret is refused instead of silently missing every block.

``store_id`` names this store: made at creation (16 random bytes) and written into the index
(kvdb/format/index_value.py ``Mstore``) and every log segment header (kvdb/format/record.py),
so an ``index/`` or a segment of another store is refused at open (CorruptionError). Manifests
written before it existed have none: such a store is *legacy* and its files are not checked.

Unknown fields are kept by readers (forward compatible); a different ``version`` is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdb.errors import CorruptionError, InvalidInput
from kvdb.fs import write_file_atomic

MANIFEST_NAME = "MANIFEST.json"
FORMAT = "kvdb-manifest"
VERSION = 1
STORE_ID_BYTES = 16


def read_manifest(dir_path: Path) -> dict | None:
    """The manifest of a data directory, None when there is none yet."""
    p = Path(dir_path) / MANIFEST_NAME
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptionError(f"{p} is not valid JSON ({e}); restore it or remove the directory") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptionError(f"{p} is not a kvdb manifest")
    if m.get("version") != VERSION:
        raise InvalidInput(f"{p} has manifest version {m.get('version')}; this kvdb reads version {VERSION}")
    return m


def store_id_of(manifest: dict, where: str = MANIFEST_NAME) -> bytes | None:
    """The manifest's store id (16 bytes), None for a legacy store made before store ids."""
    text = manifest.get("store_id")
    if text is None:
        return None
    try:
        sid = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        sid = b""
    if len(sid) != STORE_ID_BYTES or sid == bytes(STORE_ID_BYTES):
        raise CorruptionError(f"{where}: store_id {text!r} is not 32 hex digits; restore the file")
    return sid


def write_manifest(dir_path: Path, fields: dict) -> None:
    m = {"format": FORMAT, "version": VERSION, **fields}
    data = json.dumps(m, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n"
    write_file_atomic(Path(dir_path) / MANIFEST_NAME, data)
