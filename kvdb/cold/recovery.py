"""The cold store's half of recovery: bringing its RocksDB index up to the log on every open.

The log's half (kvdb/wal/recovery.py) scans the segments from the index's checkpoint on and
finds where appending resumes; here, in order:

0. the store id (MANIFEST.json ``store_id``, given by the Db) is checked before the index is
   opened for writing, so a refused open writes nothing: every segment header (an intact one
   naming another id, or none, is another store's segment) and the index's ``Mstore`` (another
   id, or none in an index that holds anything, is another store's index) -- CorruptionError
   naming the file. A store without an id (legacy: made before ids existed) is not checked.
   ``stamp_identity`` then writes the id into a new (or rebuilt) index, and a copy of it
   beside RocksDB's files (PATH/index/KVDB-STORE-ID, 16 bytes, written by rename): an open
   that finds that file reads the id there instead of opening the index a second time
   (read-only) to peek at ``Mstore`` -- half the cost of an open. A copy of the wrong length
   is ignored (the peek decides); one naming another id is another store's index;
1. the key check (an AES-GCM seal of a known text, kvdb/cold/codec.py) decides whether the
   given ``encryption_key_file`` is the store's: a missing or wrong key is an InvalidInput;
2. the counters the last checkpoint saved come back (``stats`` after a reopen);
3. every intact record after the index's ``Mapplied`` (and the checkpoint) is replayed into
   the index in lsn order, in batches, each batch with the per-segment live totals it leads to
   and its ``Mapplied`` (C7, kvdb/cold/apply.py): the old location of each key it changes is
   looked up in the index, which holds the log's state at exactly ``Mapplied``, so C1 + C2 +
   C7 give exactly the durable log's state and its totals. The totals come back from the
   ``L`` keys: nothing is read per block (an index written before ``Mapplied`` existed, a
   legacy one, is replayed blindly and its totals summed from one scan of its entries, once);
4. an index without a key check (new, or rebuilt from the log alone: PATH/index/ removed, C6)
   learns from the log whether the store is encrypted: a sealed block whose record
   authenticates proves the key, and the key check is written again.

Then the store's live set starts from the totals (kvdb/cold/live.py).
"""

from __future__ import annotations

import os

import numpy as np

from kvdb.cold.apply import fold, index_ops, live_ops, location_delta
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
    copy = _read_id_copy(index_dir)
    if copy is not None:
        if copy != store_id:
            raise CorruptionError(f"{index_dir} belongs to another store (its {ID_COPY} says store {copy.hex()}, "
                                  f"MANIFEST.json says {store_id.hex()}); remove {index_dir} to rebuild it "
                                  "from this store's log (nothing was written)")
        return
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


#: the copy of the store id beside the index's files (step 0)
ID_COPY = "KVDB-STORE-ID"


def _read_id_copy(index_dir: str) -> bytes | None:
    try:
        with open(os.path.join(index_dir, ID_COPY), "rb") as f:
            got = f.read(17)
    except OSError:
        return None
    return got if len(got) == 16 else None


def stamp_identity(index, store_id: bytes | None) -> None:
    """Write the store id into an index that has none yet (new, or rebuilt from the log), and
    its copy beside the index's files when missing (not on a read-only open)."""
    if store_id is None:
        return
    if index.get(iv.STORE_KEY) is None:
        index.write([(iv.STORE_KEY, store_id)])
        index.flush()  # the index WAL is off: the id must survive a crash before anything else
    if not index.read_only and _read_id_copy(index.path) != store_id:
        tmp = os.path.join(index.path, ID_COPY + ".tmp")
        with open(tmp, "wb") as f:
            f.write(store_id)
        os.replace(tmp, os.path.join(index.path, ID_COPY))  # never a partial copy


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


def load_totals(index) -> dict[int, list[int]]:
    """The per-segment live totals the index holds (its ``L`` keys): O(segments)."""
    return {iv.decode_live_key(k): list(iv.decode_segment_live(v)) for k, v in index.items(iv.LIVE_PREFIX)}


def _scan_totals(index) -> dict[int, list[int]]:
    """The totals summed from every entry (a legacy index, once)."""
    totals: dict[int, list[int]] = {}
    touched: set[int] = set()
    for _key, e in index.entries():
        fold(totals, ((e.segment_no, e.record_bytes, 1),), touched)
    return totals


class _Replay:
    """Step 3's batches: each record's index writes plus what they change in the totals."""

    def __init__(self, index, after: int, totals: dict[int, list[int]]) -> None:
        self.index, self.after, self.totals = index, after, totals
        self.ops: list = []
        self.last = None
        self.applied = 0  # records after ``after`` with index writes

    def __call__(self, segment_no, rec) -> None:
        if rec.lsn <= self.after:
            return  # the index holds it already (C7)
        ops = index_ops(segment_no, rec.offset, rec.rtype, rec.lsn, rec.crc, rec.body)
        if not ops:
            return  # a CHECKPOINT record
        self.ops.extend(ops)
        self.last = rec.lsn
        self.applied += 1
        if len(self.ops) >= REPLAY_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.last is None:
            return
        blocks = [(ikey[1:], v) for ikey, v in self.ops if ikey[:1] == iv.BLOCK_PREFIX]
        keys = list(dict.fromkeys(k for k, _v in blocks))
        cur = dict(zip(keys, (None if v is None else iv.entry_location(v) for v in self.index.get_values(keys))))
        touched: set[int] = set()
        for key, value in blocks:
            new = None if value is None else iv.entry_location(value)
            fold(self.totals, location_delta(cur[key], new), touched)
            cur[key] = new
        self.ops.extend(live_ops(self.totals, touched))
        self.ops.append((iv.APPLIED_KEY, iv.encode_lsn(self.last)))
        self.index.write(self.ops)
        self.ops, self.last = [], None


def replay(index, fs, wal_dir: str, repair: bool = True) -> tuple[iv.Checkpoint | None, RecoveryResult, dict]:
    """Step 3: the index's checkpoint, what replaying the log after it found, and the
    per-segment live totals (segment -> [live record bytes, live blocks])."""
    ck = index.get(iv.CHECKPOINT_KEY)
    checkpoint = None if ck is None else iv.decode_checkpoint(ck)
    applied = index.get(iv.APPLIED_KEY)
    legacy = applied is None and (checkpoint is not None or next(index.items(iv.BLOCK_PREFIX), None) is not None)
    if legacy:  # written before Mapplied existed: a blind replay, then one scan (once)
        batch: list = []

        def apply(segment_no, rec) -> None:
            batch.extend(index_ops(segment_no, rec.offset, rec.rtype, rec.lsn, rec.crc, rec.body))
            if len(batch) >= REPLAY_BATCH:
                index.write(batch)
                batch.clear()
    else:
        apply = _Replay(index, 0 if applied is None else iv.decode_lsn(applied), load_totals(index))
    try:
        result = recover(fs, wal_dir, checkpoint, apply, repair=repair)  # read-only: a torn tail stays
    except OSError as e:
        raise StorageIOError(f"recovery of {wal_dir} failed: {e}") from e
    if not legacy:
        apply.flush()
        result.records_applied = apply.applied
        return checkpoint, result, apply.totals
    result.records_applied = result.records_replayed
    index.write(batch)
    totals = _scan_totals(index)
    index.write([*live_ops(totals, set(totals)), (iv.APPLIED_KEY, iv.encode_lsn(result.next_lsn - 1))])
    index.flush()
    return checkpoint, result, totals


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


__all__ = ["ID_COPY", "check_identity", "check_key_against_log", "load_totals", "open_sealer", "replay", "saved_counters",
           "stamp_identity"]
