"""The cold store's half of recovery: bringing its RocksDB index up to the log on every open.

The log's half (kvdb/wal/recovery.py) scans the segments from the index's checkpoint on and
finds where appending resumes; here, in order:

0. the store id (MANIFEST.json ``store_id``, given by the Db) is checked before the index is
   opened for writing, so a refused open writes nothing: every segment header (an intact one
   naming another id, or none, is another store's segment) and the index's ``Mstore`` (another
   id, or none in an index that holds anything, is another store's index) -- CorruptionError
   naming the file. A store without an id (legacy: made before ids existed) is not checked.
   ``stamp_identity`` then writes the id into a new (or rebuilt) index;
1. the key check (an AES-GCM seal of a known text, kvdb/cold/codec.py) decides whether the
   given ``encryption_key_file`` is the store's: a missing or wrong key is an InvalidInput;
2. the counters the last checkpoint saved come back (``stats`` after a reopen);
3. every intact record after the checkpoint is replayed into the index in lsn order, in
   batches (re-applying one the index already holds is harmless: every record is a blind write
   of its keys' final state), so C1 + C2 (kvdb/cold/apply.py, kvdb/cold/checkpoint.py) give
   exactly the durable log's state;
4. an index without a key check (new, or rebuilt from the log alone: PATH/index/ removed, C6)
   learns from the log whether the store is encrypted: a sealed block whose record
   authenticates proves the key, and the key check is written again.

Then the store rebuilds its live set from one scan of the index (kvdb/cold/store.py).
"""

from __future__ import annotations

import os

import numpy as np

from kvdb.cold.apply import index_ops
from kvdb.cold.codec import Sealer, read_key_file
from kvdb.cold.index import Index
from kvdb.errors import CorruptionError, InvalidInput, StorageIOError
from kvdb.format import index_value as iv
from kvdb.format.record import FLAG_SEALED
from kvdb.wal.recovery import RecoveryResult, recover

#: index writes per batch while replaying
REPLAY_BATCH = 4096


def check_identity(index_dir: str, segments, store_id: bytes | None) -> None:
    """Step 0 (see the module doc), before the index is opened for writing."""
    if store_id is None:
        return
    for n in segments.list():
        try:
            have = segments.header(n).store_id
        except (CorruptionError, OSError):
            continue  # a damaged header is recovery's and verify's to report, not an identity
        if have != store_id:
            raise CorruptionError(f"{segments.path(n)} belongs to another store (its header says store "
                                  f"{have.hex() if any(have) else 'none'}, MANIFEST.json says {store_id.hex()}); "
                                  "remove the foreign segment or restore this store's own (nothing was written)")
    if not os.path.exists(os.path.join(index_dir, "CURRENT")):
        return  # no index yet: made (or rebuilt from the log) by the open
    peek = Index(index_dir, read_only=True)
    try:
        have = peek.get(iv.STORE_KEY)
        used = have is not None or next(iter(peek.items(b"")), None) is not None
    finally:
        peek.close()
    if used and have != store_id:
        raise CorruptionError(f"{index_dir} belongs to another store (its store id is "
                              f"{have.hex() if have else 'none'}, MANIFEST.json says {store_id.hex()}); remove "
                              f"{index_dir} to rebuild it from this store's log (nothing was written)")


def stamp_identity(index, store_id: bytes | None) -> None:
    """Write the store id into an index that has none yet (new, or rebuilt from the log)."""
    if store_id is not None and index.get(iv.STORE_KEY) is None:
        index.write([(iv.STORE_KEY, store_id)])
        index.flush()  # the index WAL is off: the id must survive a crash before anything else


def open_sealer(index, path, encryption_key_file: str | None) -> tuple[Sealer | None, bytes | None]:
    """Step 1: the store's Sealer (None: not encrypted) and the index's key check (None: none)."""
    seal_check = index.get(iv.SEAL_KEY)
    sealer = Sealer(read_key_file(encryption_key_file)) if encryption_key_file else None
    if seal_check is not None and sealer is None:
        raise InvalidInput(f"{path} is encrypted: open it with encryption_key_file=")
    if seal_check is not None and not sealer.matches(seal_check):
        raise InvalidInput(f"the encryption key does not match the one {path} was created with")
    return sealer, seal_check


def saved_counters(index) -> dict:
    """Step 2: the counters the last checkpoint saved (empty when none)."""
    raw = index.get(iv.STATS_KEY)
    return {} if raw is None else iv.decode_stats(raw)


def replay(index, fs, wal_dir: str, repair: bool = True) -> tuple[iv.Checkpoint | None, RecoveryResult]:
    """Step 3: the index's checkpoint and what replaying the log after it found."""
    ck = index.get(iv.CHECKPOINT_KEY)
    checkpoint = None if ck is None else iv.decode_checkpoint(ck)
    batch: list = []

    def apply(segment_no, rec) -> None:
        batch.extend(index_ops(segment_no, rec.offset, rec.rtype, rec.lsn, rec.crc, rec.body))
        if len(batch) >= REPLAY_BATCH:
            index.write(batch)
            batch.clear()

    try:
        result = recover(fs, wal_dir, checkpoint, apply, repair=repair)  # read-only: a torn tail stays
    except OSError as e:
        raise StorageIOError(f"recovery of {wal_dir} failed: {e}") from e
    index.write(batch)
    return checkpoint, result


def check_key_against_log(index, path, sealer, read_entry, page_bytes: int, replayed: bool) -> None:
    """Step 4, for an index without a key check. ``read_entry(key, entry, row)`` is the
    store's checked read (kvdb/cold/read.py); ``replayed``: records were replayed after a
    checkpoint (a store with history, which had no key)."""
    first = next(index.entries(), None)
    if first is not None and first[1].flags & FLAG_SEALED:
        if sealer is None:
            raise InvalidInput(f"{path} is encrypted: open it with encryption_key_file=")
        if read_entry(first[0], first[1], np.empty(page_bytes, np.uint8)) is not True:
            raise InvalidInput(f"the encryption key does not match the log of {path} "
                               "(or its first block's record is damaged: run `kvdb verify`)")
    elif sealer is not None and (first is not None or replayed):
        raise InvalidInput(f"{path} was created without encryption; it cannot be opened with a key")
    if sealer is not None:
        index.write([(iv.SEAL_KEY, sealer.key_check())])
        index.flush()  # the index WAL is off: make the key check survive a crash now


__all__ = ["check_identity", "check_key_against_log", "open_sealer", "replay", "saved_counters", "stamp_identity"]
