"""One block as an object of the shared pool (Mooncake Store): its name and its bytes.

Name: ``kvdb1/<ns>/<key hex>``. ``ns`` is 24 hex digits naming the store namespace the block
belongs to (``namespace_name``: model id and revision, layout, key algorithm, ranks, the key
secret's id and whether pages are sealed), so engines of another model, layout or key namespace
never name, and so never see, each other's objects (docs/shared.md S4).

Bytes: a 64-byte header, then the payload (all integers little-endian)

    off  size  field
      0     4  magic     b"KVSO"
      4     2  version   1
      6     2  flags     bit 0: the payload is sealed (nonce 12 | AES-256-GCM | tag 16 of the
                         page, kvdb/cold/codec.py ``Sealer``, associated data ``sealed_aad``)
      8    16  key       the block key the object holds
     24     8  length    payload bytes (the page's bytes, or page + 28 when sealed)
     32    16  digest    XXH3-128 of bytes 0..31 and the payload
     48    16  zero
     64     -  payload

A reader checks magic, version, flags, key, length and digest before it uses a byte (S5): a
forged, torn, short or foreign object is a counted corruption and a miss. The digest detects
damage and mix-ups, not a forger with write access to the pool (anyone may compute XXH3);
pages sealed under ``encryption_key_file`` are also authenticated by AES-GCM, whose associated
data binds them to the namespace and the key.

Worked example (tests/shared/test_object_format.py): key 00 01 .. 0f, a 4-byte page de ad be ef,
unsealed: ``4b 56 53 4f | 01 00 | 00 00 | 00 01 .. 0f | 04 00 00 00 00 00 00 00 | digest 16 |
00 * 16 | de ad be ef``.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import xxhash

MAGIC = b"KVSO"
VERSION = 1
HEADER_BYTES = 64
FLAG_SEALED = 1
SEAL_OVERHEAD = 12 + 16  # nonce + tag (kvdb/cold/codec.py)
_HEAD = struct.Struct("<4sHH16sQ")  # bytes 0..31
NAME_PREFIX = "kvdb1"


def namespace_name(fields: dict) -> str:
    """The 24 hex digits naming a store namespace in the pool, from plain JSON ``fields``."""
    raw = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvdb shared namespace\0" + raw).hexdigest()[:24]


def object_names(ns: str, keys) -> list[str]:
    prefix = f"{NAME_PREFIX}/{ns}/"
    return [prefix + k.hex() for k in keys]


def payload_bytes(page_bytes: int, sealed: bool) -> int:
    return page_bytes + (SEAL_OVERHEAD if sealed else 0)


def object_bytes(page_bytes: int, sealed: bool) -> int:
    return HEADER_BYTES + payload_bytes(page_bytes, sealed)


def sealed_aad(ns: str, key: bytes) -> bytes:
    return b"kvdb shared page\0" + ns.encode() + b"\0" + key


def write_header(row: np.ndarray, key: bytes, length: int, sealed: bool) -> None:
    """Fill bytes 0..63 of ``row`` (a uint8 object row whose payload is at 64..64+length)."""
    head = _HEAD.pack(MAGIC, VERSION, FLAG_SEALED if sealed else 0, key, length)
    row[:32] = np.frombuffer(head, dtype=np.uint8)
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(row[HEADER_BYTES : HEADER_BYTES + length])
    row[32:48] = np.frombuffer(h.digest(), dtype=np.uint8)
    row[48:64] = 0


def check(head: np.ndarray, payload: np.ndarray, key: bytes, length: int, sealed: bool, got: int) -> str | None:
    """None when ``head`` (64 bytes) and ``payload`` (``length`` bytes) are the object of ``key``
    as this namespace writes it and ``got`` (the bytes the store returned) is its size; else
    what is wrong (for the corruption counter's log)."""
    if got != HEADER_BYTES + length:
        return f"size {got}, expected {HEADER_BYTES + length}"
    magic, version, flags, okey, olen = _HEAD.unpack(head[:32].tobytes())
    if magic != MAGIC or version != VERSION:
        return "not a kvdb object"
    if flags != (FLAG_SEALED if sealed else 0) or olen != length:
        return "foreign flags or length"
    if okey != key:
        return "another key's object"
    h = xxhash.xxh3_128()
    h.update(head[:32])
    h.update(payload[:length])
    if h.digest() != head[32:48].tobytes():
        return "digest mismatch (torn or damaged)"
    return None
