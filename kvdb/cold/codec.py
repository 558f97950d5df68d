"""Payload codecs of cold blocks, and encryption at rest.

Codecs (kvdb.format.record.Codec, stable values)
    RAW          the page bytes as they are (written with writev straight from the caller's
                 array, read with preadv straight into the caller's row: no copies).
    ZSTD_PLANES  the page split into byte planes first -- byte j of every element goes to plane j
                 (for bf16: plane 0 = low bytes, mostly noise; plane 1 = sign+exponent+top
                 mantissa, very compressible) -- then zstd level 1 over the concatenated planes.
                 Why planes: neighbouring values' high bytes are alike and compress well,
                 the low bytes are nearly noise, and interleaved the two dilute each other.
                 How much a page shrinks depends on the model's KV; this repo measures no
                 ratio (its test models have random weights). A page that does not shrink is
                 stored RAW instead (the codec byte says which).

Sealing (``Sealer``), when the store has an encryption key
    payload = nonce 12 | AES-256-GCM(key, nonce, encoded bytes, aad) | tag 16
    aad     = block key 16 | namespace_id u32 | position i64 | codec u8  (little-endian)
    The nonce is 12 random bytes per record (os.urandom); with 2^32 records per key the
    collision chance stays below 2^-32. The aad binds a payload to its key and position, so a
    record copied under another key fails to open. Compaction copies sealed bodies unchanged.

Key file: 32 raw bytes, or 64 hex digits (whitespace ignored). A wrong key is detected at open
from a key check stored in the index (kvdb/format/index_value.py, ``Mseal``).
"""

from __future__ import annotations

import os
import struct

import numpy as np
import zstandard

from kvdb.errors import CorruptionError, InvalidInput
from kvdb.format.record import Codec

NONCE_BYTES = 12
TAG_BYTES = 16
ZSTD_LEVEL = 1
KEY_CHECK = b"kvdb-key-check"

_zc = None
_zd = None


def _compressor():
    global _zc, _zd
    if _zc is None:
        _zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        _zd = zstandard.ZstdDecompressor()
    return _zc, _zd


def encode_page(page: np.ndarray, codec: int, itemsize: int) -> tuple[int, object]:
    """(codec actually used, payload buffer) for one uint8 page row."""
    if codec == Codec.RAW:
        return Codec.RAW, page
    if codec == Codec.ZSTD_PLANES:
        zc, _ = _compressor()
        planes = page.reshape(-1, itemsize).T.copy() if itemsize > 1 else page
        comp = zc.compress(planes)  # threads: zstandard releases the GIL while compressing
        if len(comp) >= page.nbytes:
            return Codec.RAW, page
        return Codec.ZSTD_PLANES, comp
    raise InvalidInput(f"unknown codec {codec}")


def decode_page(payload, codec: int, itemsize: int, out: np.ndarray) -> None:
    """Decode into ``out`` (one uint8 page row); CorruptionError when the payload is wrong."""
    n = out.nbytes
    if codec == Codec.RAW:
        if len(payload) != n:
            raise CorruptionError(f"raw payload of {len(payload)} bytes for a {n}-byte page")
        out[:] = np.frombuffer(payload, dtype=np.uint8)
        return
    if codec == Codec.ZSTD_PLANES:
        _, zd = _compressor()
        try:
            raw = zd.decompress(payload, max_output_size=n)
        except zstandard.ZstdError as e:
            raise CorruptionError(f"zstd payload does not decode: {e}") from None
        if len(raw) != n:
            raise CorruptionError(f"zstd payload decodes to {len(raw)} bytes, expected {n}")
        planes = np.frombuffer(raw, dtype=np.uint8)
        if itemsize > 1:
            out.reshape(-1, itemsize)[:] = planes.reshape(itemsize, -1).T
        else:
            out[:] = planes
        return
    raise CorruptionError(f"unknown codec {codec} in a stored record")


def read_key_file(path: str) -> bytes:
    try:
        raw = open(path, "rb").read()
    except OSError as e:
        raise InvalidInput(f"cannot read encryption key file {path}: {e}") from None
    if len(raw) == 32:
        return raw
    text = b"".join(raw.split())
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != 32:
        raise InvalidInput(f"encryption key file {path} must hold 32 raw bytes or 64 hex digits (AES-256)")
    return key


def aad(key: bytes, namespace_id: int, position: int, codec: int) -> bytes:
    return key + struct.pack("<IqB", namespace_id, position, codec)


class Sealer:
    """AES-256-GCM over payloads (cryptography's AESGCM: OpenSSL, releases the GIL)."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)

    def seal(self, data, ad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, bytes(data) if not isinstance(data, bytes) else data, ad)

    def open(self, sealed, ad: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        sealed = bytes(sealed)
        if len(sealed) < NONCE_BYTES + TAG_BYTES:
            raise CorruptionError("sealed payload shorter than nonce + tag")
        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], ad)
        except InvalidTag:
            raise CorruptionError("sealed payload fails authentication (damaged, moved, or another key)") from None

    def key_check(self) -> bytes:
        return self.seal(KEY_CHECK, b"")

    def matches(self, check: bytes) -> bool:
        try:
            return self.open(check, b"") == KEY_CHECK
        except CorruptionError:
            return False
