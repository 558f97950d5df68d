"""Compaction: garbage collection of log segments that hold dead blocks (evicted, deleted,
overwritten, TTL-expired).

First, blocks whose TTL record has passed are deleted (``expire``).

For every sealed segment (never the active one) holding dead bytes, the records of its live
blocks are copied to the head of the log -- the body bytes unchanged (sealed payloads stay
sealed), the header re-encoded for a new lsn (format invariant R3) -- their index entries move,
the copies are fsynced and indexed, a checkpoint is flushed beyond them, and only then is the
old segment deleted (store invariant C4). A crash at any point leaves each block indexed at
its old copy (the new one is then either replayed from the log and wins, or was never
acknowledged) or at its new copy: never a block without a readable record.

A record that fails its checks while being copied is left where it is (its segment is kept,
``kvdb verify`` reports it, reads of it are counted misses), so compaction never turns damage
into silence.

Work is done in chunks of ``CHUNK_BYTES`` under the writer lock, so foreground writers wait at
most one chunk.
"""

from __future__ import annotations

import os
import struct
import time

from kvdb.format import index_value as iv
from kvdb.format.record import SEGMENT_HEADER_BYTES, RecordType, check_record, decode_put, segment_name
from kvdb.types import KEY_BYTES
from kvdb.wal.recovery import list_segments

CHUNK_BYTES = 64 << 20


def expire(store, now_ns: int | None = None) -> int:
    """Delete live blocks whose TTL record (name = block key, value = expires_at_unix_ns u64)
    has passed, and drop those TTL entries. Returns how many blocks were deleted."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    expired = []
    for name, value in store._index.items(iv.record_meta_key(RecordType.TTL, b"")):
        if len(name) == KEY_BYTES and len(value) == 8 and struct.unpack("<Q", value)[0] <= now_ns:
            expired.append(name)
    if not expired:
        return 0
    n = store.delete(expired, durability="group")
    for name in expired:
        store.put_metadata("ttl", name, b"", durability="none")
    store.flush()
    return n


def compact(store, progress=None, *, min_dead_fraction: float = 0.0, now_ns: int | None = None) -> dict:
    """Compact ``store``; ``progress(done_bytes, total_bytes)`` is called as live bytes move.
    Returns counts: segments_before/after, segments_deleted, records_copied, bytes_copied,
    bytes_reclaimed, damaged_records. An I/O error fails the store (C5)."""
    store._check()
    with store.sticky_io("compaction"):
        expired = expire(store, now_ns)
        out = _compact(store, progress, min_dead_fraction)
        out["ttl_expired"] = expired
        return out


def _compact(store, progress, min_dead_fraction: float) -> dict:
    out = dict(records_copied=0, bytes_copied=0, damaged_records=0)
    w = store._writer
    with store._ckpt_lock:
        first = list_segments(store._fs, store.wal_dir)
        out["segments_before"] = len(first)
        before_bytes = _log_bytes(store, first)
        store._checkpoint_locked_free()  # also deletes wholly dead segments
        segs = list_segments(store._fs, store.wal_dir)
        with w.lock:
            active = w.segment_no
            victims = []
            for s in segs:
                if s >= active:
                    continue
                size = store._fs.file_bytes(os.path.join(store.wal_dir, segment_name(s)))
                live = store._seg_live.get(s, 0)
                dead = size - SEGMENT_HEADER_BYTES - live
                if dead > 0 and dead >= min_dead_fraction * size:
                    victims.append(s)
            total = sum(store._seg_live.get(s, 0) for s in victims)
        done = 0
        if progress is not None:
            progress(0, total)
        for s in victims:
            with w.lock:
                keys = [k for k, (_lsn, _rb, seg) in store._live.items() if seg == s]
            i = 0
            while i < len(keys):
                chunk, nbytes = [], 0
                while i < len(keys) and (not chunk or nbytes < CHUNK_BYTES):
                    chunk.append(keys[i])
                    nbytes += store._live[keys[i]][1] if keys[i] in store._live else 0
                    i += 1
                moved = _move_chunk(store, s, chunk, out)
                done += moved
                if progress is not None:
                    progress(done, total)
        store._checkpoint_locked_free()  # deletes every victim now wholly dead
        segs_after = list_segments(store._fs, store.wal_dir)
        out["segments_after"] = len(segs_after)
        out["segments_deleted"] = len(set(first) - set(segs_after))
        out["bytes_reclaimed"] = max(0, before_bytes - _log_bytes(store, segs_after))
    return out


def _log_bytes(store, segs) -> int:
    total = 0
    for s in segs:
        try:
            total += store._fs.file_bytes(os.path.join(store.wal_dir, segment_name(s)))
        except FileNotFoundError:
            pass
    return total


def _move_chunk(store, segment_no: int, keys: list[bytes], out: dict) -> int:
    w = store._writer
    with w.lock:
        store._check()
        recs, metas = [], []
        entries = store._lookup(keys)
        for key, e in zip(keys, entries):
            cur = store._live.get(key)
            if e is None or cur is None or cur[2] != segment_no or e.segment_no != segment_no:
                continue
            raw = store.read_record(segment_no, e.offset, e.record_bytes)
            status, rec = (("short", None) if raw is None else check_record(raw, 0))
            if status != "ok" or rec.crc != e.crc or rec.lsn != e.lsn or rec.rtype != RecordType.PUT_BLOCK \
                    or bytes(rec.body[:KEY_BYTES]) != key:
                out["damaged_records"] += 1
                continue
            body = bytes(rec.body)
            recs.append((RecordType.PUT_BLOCK, [body]))
            metas.append((key, decode_put(body)))
        if not recs:
            return 0
        locs = w.append(recs)
        moved = 0
        for (key, p), loc in zip(metas, locs):
            e = iv.BlockEntry(loc.segment_no, loc.offset, loc.record_bytes, loc.crc, loc.lsn, p.position,
                              p.namespace_id, p.codec, p.flags, p.raw_bytes)
            store._queue.append((loc.lsn, iv.block_key(key), iv.encode_entry(e), key))
            store._pending[key] = (loc.lsn, e)
            store._set_live(key, loc.lsn, loc.record_bytes, loc.segment_no)
            moved += loc.record_bytes
        store._ckpt_log_bytes += moved
        last = w.next_lsn - 1
    w.sync_to(last)
    store._apply(last)
    out["records_copied"] += len(locs)
    out["bytes_copied"] += moved
    return moved
