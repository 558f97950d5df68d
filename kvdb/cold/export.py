"""Reading the cold tier for another node (log shipping, kvdb/replication/shipping.py).

A sibling of compact.py and verify.py: it reads the store's index and log the way they do,
so that the replication layer above needs only these calls:

    key_check(store)          the store's encryption key check (None: not encrypted)
    key_matches(store, check) whether the store holds the key another store's check names
    open_payload(store, put)  a shipped PUT_BLOCK's payload, authenticated and unsealed
    Snapshot.take(store)      a consistent copy of the live state, read as log records

Snapshot consistency (a follower's re-seed, kvdb/replication/reseed.py). ``take`` notes the
durable lsn L, then flushes (every record <= L is now in the index: C1, kvdb/cold/apply.py) and
lists the live block keys and the metadata entries. The records it then reads may be newer
than L (writes go on meanwhile) but never older, and every record of the store is a blind
write of one key (a PUT stores it, a DELETE or an empty metadata value removes it). So the
copy, followed by the log from L + 1 applied in order, ends in exactly the log's state: a key
written after L is rewritten by the log, a key untouched since L was copied as of L.
"""

from __future__ import annotations

from kvdb.cold.codec import aad
from kvdb.errors import InvalidInput
from kvdb.format import index_value as iv
from kvdb.format.record import (
    FLAG_SEALED,
    META_TYPES,
    RecordType,
    check_record,
    decode_put,
    encode_meta,
    encode_record,
)


def key_check(store) -> bytes | None:
    """The store's key check (an AES-GCM seal of a known text), None when it is not encrypted."""
    store.check()
    return store.index.get(iv.SEAL_KEY)


def key_matches(store, check: bytes) -> bool:
    """True when ``store`` is encrypted with the key that made ``check``."""
    return store is not None and store.sealer is not None and store.sealer.matches(bytes(check))


def open_payload(store, put):
    """The codec payload of a decoded PUT_BLOCK body: as is, or authenticated and unsealed with
    the store's key (CorruptionError when it does not authenticate, InvalidInput without a key)."""
    if not put.flags & FLAG_SEALED:
        return put.payload
    if store is None or store.sealer is None:
        raise InvalidInput("a sealed (encrypted) block needs a disk tier opened with the same encryption key")
    return store.sealer.open(put.payload, aad(put.key, put.namespace_id, put.position, put.codec))


class Snapshot:
    """The live state of a store as of ``lsn`` (see the module doc); read it in batches."""

    def __init__(self, store, lsn: int, keys: list[bytes], metadata: list[bytes]) -> None:
        self.store = store
        self.lsn = lsn
        self.keys = keys  # live block keys when the copy was taken
        self.metadata = metadata  # encoded metadata records (lsn = self.lsn)
        self.records_missing = 0  # keys deleted meanwhile, or whose record failed its checks

    @classmethod
    def take(cls, store) -> Snapshot:
        store.check()
        lsn = store.durable_lsn
        store.flush()
        keys = [k for k, _e in store.index.entries()]
        meta = []
        for rtype in META_TYPES:
            for name, value in store.index.items(iv.record_meta_key(rtype, b"")):
                meta.append(encode_record(rtype, lsn, encode_meta(name, value)))
        return cls(store, lsn, keys, meta)

    def read(self, keys: list[bytes]) -> list[bytes]:
        """The current PUT_BLOCK records of ``keys``, verbatim (crc, key and lsn checked); a key
        deleted meanwhile, or whose record fails its checks, is left out and counted."""
        store = self.store
        out = []
        for key, e in zip(keys, store.lookup(keys)):
            for _attempt in range(2):  # compaction may move a record between lookup and read
                raw = None if e is None else store.reader.read_record(e.segment_no, e.offset, e.record_bytes)
                if raw is not None or e is None:
                    break
                (e,) = store.lookup([key])
            if raw is None:
                self.records_missing += 1
                continue
            status, rec = check_record(raw, 0)
            if status != "ok" or rec.rtype != RecordType.PUT_BLOCK or rec.lsn != e.lsn \
                    or decode_put(rec.body).key != key:
                self.records_missing += 1
                continue
            out.append(raw)
        return out
