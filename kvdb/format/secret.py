"""PATH/KEY_SECRET: the key secret of a data directory, plain or sealed. Encoded and decoded only here.

The key secret salts every tenant's key namespace (kvdb/keys.py): whoever holds it can compute
the keys of a guessed prompt and look for them in the index or ``kvdb wal dump``. So a store
with encryption at rest keeps it sealed under the encryption key (docs/durability.md,
"What the directory reveals"); a store without encryption keeps it plain (mode 0600).

Plain (stores without encryption, and every store made before sealing existed)
    the secret's bytes, nothing else (32 random bytes when kvdb made it)

Sealed (stores with ``encryption_key_file=``): 68 bytes for a 32-byte secret

    off  size  field
      0     8  magic    b"KVDBSKS\\x01" (the last byte is the version, currently 1)
      8    12  nonce    random, per write
     20    32  the secret, AES-256-GCM under the store's encryption key (kvdb/cold/codec.py
               ``Sealer``), associated data SEALED_AAD
     52    16  tag

Worked example (tests/golden/key_secret_sealed.bin): secret 20 21 .. 3f sealed with key 00..1f
and nonce 64..6f is ``4b 56 44 42 53 4b 53 01 | 64 65 .. 6f | ciphertext | tag``.

A plain secret starting with the magic is not possible in practice (8 fixed bytes out of 32
random ones), and a plain one supplied through ``key_secret=`` never lands in this file.
"""

from __future__ import annotations

from kvdb.errors import CorruptionError

KEY_SECRET_NAME = "KEY_SECRET"
SEALED_MAGIC = b"KVDBSKS\x01"
SEALED_AAD = b"kvdb key secret v1"
#: nonce 12 + tag 16 around the secret; a sealed file shorter than this + 16 secret bytes is damage
SEAL_OVERHEAD = 12 + 16


def encode_sealed(sealed: bytes) -> bytes:
    """The file's bytes for a secret already sealed (nonce | ciphertext | tag)."""
    return SEALED_MAGIC + sealed


def decode(raw: bytes, where: str) -> tuple[bool, bytes]:
    """(sealed?, body): a sealed file's nonce | ciphertext | tag, or a plain file's secret.
    CorruptionError (naming ``where``) for a file that holds neither."""
    if raw.startswith(SEALED_MAGIC):
        body = raw[len(SEALED_MAGIC):]
        if len(body) < SEAL_OVERHEAD + 16:
            raise CorruptionError(f"{where} is a sealed key secret of {len(raw)} bytes, too short; restore it")
        return True, body
    if raw[:7] == SEALED_MAGIC[:7]:
        raise CorruptionError(f"{where} is a sealed key secret of version {raw[7]}; this kvdb reads version 1")
    if len(raw) < 16:
        raise CorruptionError(f"{where} holds {len(raw)} bytes; a key secret has at least 16; restore it")
    return False, raw
