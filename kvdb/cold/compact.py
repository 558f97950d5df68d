"""Compaction: garbage collection of log segments that hold dead blocks (evicted, deleted,
overwritten, TTL-expired).

First, blocks whose TTL record has passed are deleted (``expire``).

For every sealed segment (never the active one) holding dead bytes, the records of its live
blocks are copied to the head of the log -- the body bytes unchanged (sealed payloads stay
sealed), the header re-encoded for a new lsn (format invariant R3) -- their index entries move,
the copies are fsynced and indexed, a checkpoint is flushed beyond them, and only then is the
old segment deleted (invariant C4, kvdb/cold/checkpoint.py). A crash at any point leaves each block indexed at
its old copy (the new one is then either replayed from the log and wins, or was never
acknowledged) or at its new copy: never a block without a readable record.

A record that fails its checks while being copied is left where it is (its segment is kept,
``kvdb verify`` reports it, reads of it are counted misses), so compaction never turns damage
into silence.

Work is done in chunks of ``CHUNK_BYTES`` under the writer lock, so foreground writers wait at
most one chunk.

Room first: compaction writes the copies before it frees the old segments, so it never starts
what it cannot finish, nor spends the disk's last free space (after which the store would fail
with no caller write in flight, and a reopen would find no room for RocksDB's files). Before it
writes anything, and again before each chunk, it compares the free bytes of the log's
filesystem (``fs.free_bytes``, statvfs) with the bytes it will write -- the live records it
copies plus ``INDEX_BYTES_PER_BLOCK`` per block -- plus ``SPACE_RESERVE_BYTES``. Segments that
do not fit are left for later (``space_deferred_segments`` in the counts; the store's
``compaction_space_deferrals`` counter; one warning on the ``kvdb.cold`` logger until a run fits
again); below the reserve nothing at all is written, not even the run's first checkpoint.

Tombstones outlive their segments (invariant C6 of kvdb/cold/checkpoint.py, ``carry_forward``)
    Deleting a segment must not change what a replay of the whole surviving log yields (the
    index rebuild: remove PATH/index/, reopen). Dropping a dead PUT never does: a newer record
    of its key exists. Dropping a DELETE does when a surviving *older* segment still holds a PUT
    of that key -- the block would come back -- and dropping metadata loses it. So before
    wholly dead segments are deleted (by a checkpoint or by compaction) their records are
    judged, under the writer lock:

    * a DELETE of a key that is absent now, and of which a surviving older segment holds a PUT,
      is appended again at the head of the log (a tombstone carried forward);
    * a SESSION / TTL / LEASE name whose value is set now is appended again with that value
      (unless a newer record of it waits in the index queue); a removed name is carried like a
      DELETE when a surviving older segment sets it;
    * a segment that cannot be walked to its end (damage) is not deleted: its records cannot be
      judged.

    A carried tombstone dies the same way when its own segment is collected and no older
    segment holding a PUT of its key survives any more (compaction deletes those).

    Cost: each dead segment is walked once from record header to record header (PUT payloads
    are not read); older surviving segments are walked only when there is something to judge,
    once per process (sealed segments never change: their key sets are cached, 16 bytes of key
    plus set overhead per PUT record), and a segment with no dead bytes at all is never walked
    (it holds only live PUTs). Carried records are 16 bytes per key plus a record header.
"""

from __future__ import annotations

import logging
import struct
import sys
import time

from kvdb.format import index_value as iv
from kvdb.format.record import (
    SEGMENT_HEADER_BYTES,
    RecordType,
    check_record,
    decode_put,
    encode_delete,
    encode_meta,
)
from kvdb.types import KEY_BYTES
from kvdb.wal.reader import SegmentSummary

CHUNK_BYTES = 64 << 20
#: keys per carried DELETE record
CARRY_KEYS = 4096
#: free bytes a compaction leaves on the log's filesystem beyond what it writes: its
#: checkpoints (a RocksDB flush, CHECKPOINT records), carried records, a reopen's files
SPACE_RESERVE_BYTES = 64 << 20
#: index bytes counted per moved block (its entry in a RocksDB table, with overhead)
INDEX_BYTES_PER_BLOCK = 128

log = logging.getLogger("kvdb.cold")


def room(store) -> int:
    """Bytes a compaction may write now: the free bytes of the log's filesystem less
    ``SPACE_RESERVE_BYTES`` (negative: not even the reserve is free). A filesystem that cannot
    say (statvfs fails) is taken as roomy."""
    try:
        free = store.fs.free_bytes(store.wal_dir)
    except OSError:
        return sys.maxsize
    return free - SPACE_RESERVE_BYTES


def _need(live_bytes: int, live_blocks: int) -> int:
    return live_bytes + live_blocks * INDEX_BYTES_PER_BLOCK


def _defer(store, out: dict, need: int, have: int) -> None:
    """Count a run that left segments for lack of room; warn once (until a run fits again)."""
    store.count(compaction_space_deferrals=1)
    ck = store.ckpt
    if not ck.space_warned:
        ck.space_warned = True
        log.warning("compaction of %s deferred %d segment(s): it needs %d bytes plus a reserve of %d free on the "
                    "filesystem, which has %d; it runs when there is room (free some space)", store.path,
                    out["space_deferred_segments"], need, SPACE_RESERVE_BYTES, max(0, have + SPACE_RESERVE_BYTES))


def expire(store, now_ns: int | None = None) -> int:
    """Delete live blocks whose TTL record (name = block key, value = expires_at_unix_ns u64)
    has passed, and drop those TTL entries. Returns how many blocks were deleted."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    expired = []
    for name, value in store.index.items(iv.record_meta_key(RecordType.TTL, b"")):
        if len(name) == KEY_BYTES and len(value) == 8 and struct.unpack("<Q", value)[0] <= now_ns:
            expired.append(name)
    if not expired:
        return 0
    n = store.delete(expired, durability="group")
    for name in expired:
        store.put_metadata("ttl", name, b"", durability="none")
    store.flush()
    return n


def compact(store, progress=None, *, min_dead_fraction: float = 0.0, now_ns: int | None = None,
            stop=None, auto: bool = False) -> dict:
    """Compact ``store``; ``progress(done_bytes, total_bytes)`` is called as live bytes move.
    Returns counts: segments_before/after, segments_deleted, records_copied, bytes_copied,
    bytes_reclaimed, damaged_records, space_deferred_segments (left for lack of room: module
    doc). ``stop`` (a threading.Event): once set, no further chunk is moved (what moved is
    checkpointed as usual). ``auto``: an automatic run, counted in ``auto_compactions`` unless
    there was no room to start. An I/O error fails the store (C5)."""
    store.check()
    with store.sticky_io("compaction"):
        with store.ckpt.lock:
            have = room(store)
            if have < 0:  # not even the reserve: write nothing, not a checkpoint
                victims = _victims(store, min_dead_fraction)
                n = len(store.segments.list())
                out = {"segments_before": n, "segments_after": n, "segments_deleted": 0, "records_copied": 0,
                       "bytes_copied": 0, "bytes_reclaimed": 0, "damaged_records": 0, "ttl_expired": 0,
                       "space_deferred_segments": len(victims)}
                _defer(store, out, sum(_need(b, k) for _s, b, k in victims), have)
                return out
        if auto:
            store.count(auto_compactions=1)  # before the run's checkpoints, which save the counters
        expired = expire(store, now_ns)
        out = _compact(store, progress, min_dead_fraction, stop)
        out["ttl_expired"] = expired
        return out


def _victims(store, min_dead_fraction: float) -> list[tuple[int, int, int]]:
    """Sealed segments with dead bytes (at least ``min_dead_fraction`` of their records), with
    their live bytes and blocks."""
    w, segments, live = store.writer, store.segments, store.live
    segs = segments.list()
    with w.lock:
        active = w.segment_no
        out = []
        for s in segs:
            if s >= active:
                continue
            try:
                size = segments.file_bytes(s)
            except FileNotFoundError:
                continue
            dead = size - SEGMENT_HEADER_BYTES - live.segment_bytes(s)
            if dead > 0 and dead >= min_dead_fraction * (size - SEGMENT_HEADER_BYTES):  # of its records
                out.append((s, live.segment_bytes(s), live.segment_blocks(s)))
        return out


def _compact(store, progress, min_dead_fraction: float, stop=None) -> dict:
    out = {"records_copied": 0, "bytes_copied": 0, "damaged_records": 0, "space_deferred_segments": 0}
    segments, live = store.segments, store.live
    with store.ckpt.lock:
        first = segments.list()
        out["segments_before"] = len(first)
        before_bytes = _log_bytes(segments, first)
        store.ckpt.checkpoint_locked()  # also deletes wholly dead segments
        victims, deferred, need, have = [], [], 0, room(store)
        for s, nbytes, nblocks in _victims(store, min_dead_fraction):  # oldest first, as many as fit
            if need + _need(nbytes, nblocks) <= have:
                victims.append(s)
                need += _need(nbytes, nblocks)
            else:
                deferred.append((s, nbytes, nblocks))
        total = sum(live.segment_bytes(s) for s in victims)
        done = 0
        if progress is not None:
            progress(0, total)
        for n, s in enumerate(victims):
            blocks = live.blocks_in(s)  # a sealed segment: walked without the writer's lock
            i = 0
            while i < len(blocks) and not (stop is not None and stop.is_set()):
                chunk, nbytes = [], 0
                while i < len(blocks) and (not chunk or nbytes < CHUNK_BYTES):
                    chunk.append(blocks[i][0])
                    nbytes += blocks[i][1]
                    i += 1
                have = room(store)  # something else on the filesystem may have taken room meanwhile
                if _need(nbytes, len(chunk)) > have:
                    deferred.extend((x, live.segment_bytes(x), live.segment_blocks(x)) for x in victims[n:])
                    break
                moved = _move_chunk(store, s, chunk, out)
                done += moved
                if progress is not None:
                    progress(done, total)
            else:
                continue
            break
        out["space_deferred_segments"] = len(deferred)
        if deferred:
            _defer(store, out, sum(_need(b, k) for _s, b, k in deferred), have)
        elif victims:
            store.ckpt.space_warned = False  # room again: the next shortage is worth a warning
        store.ckpt.checkpoint_locked()  # deletes every victim now wholly dead
        segs_after = segments.list()
        out["segments_after"] = len(segs_after)
        out["segments_deleted"] = len(set(first) - set(segs_after))
        out["bytes_reclaimed"] = max(0, before_bytes - _log_bytes(segments, segs_after))
    return out


def _log_bytes(segments, segs) -> int:
    total = 0
    for s in segs:
        try:
            total += segments.file_bytes(s)
        except FileNotFoundError:
            pass
    return total


def _move_chunk(store, segment_no: int, keys: list[bytes], out: dict) -> int:
    w, live = store.writer, store.live
    with w.lock:
        store.check()
        recs, metas, olds = [], [], []
        entries = store.lookup(keys)
        for key, e in zip(keys, entries):
            if e is None or e.segment_no != segment_no:
                continue
            raw = store.reader.read_record(segment_no, e.offset, e.record_bytes)
            status, rec = (("short", None) if raw is None else check_record(raw, 0))
            if status != "ok" or rec.crc != e.crc or rec.lsn != e.lsn or rec.rtype != RecordType.PUT_BLOCK \
                    or bytes(rec.body[:KEY_BYTES]) != key:
                out["damaged_records"] += 1
                continue
            body = bytes(rec.body)
            recs.append((RecordType.PUT_BLOCK, [body]))
            metas.append((key, decode_put(body)))
            olds.append((e.segment_no, e.offset, e.record_bytes))
        if not recs:
            return 0
        locs = w.append(recs)
        moved = 0
        entries, news = [], []
        for (key, p), loc in zip(metas, locs):
            entries.append((key, iv.BlockEntry(loc.segment_no, loc.offset, loc.record_bytes, loc.crc, loc.lsn,
                                               p.position, p.namespace_id, p.codec, p.flags, p.raw_bytes)))
            news.append((loc.segment_no, loc.offset, loc.record_bytes))
            moved += loc.record_bytes
        store.queue.put_entries(entries, live.change([k for k, _p in metas], olds, news))
        store.ckpt.log_bytes += moved
        last = w.next_lsn - 1
    store.commit.sync_to(last)
    store.queue.apply(last)
    out["records_copied"] += len(locs)
    out["bytes_copied"] += moved
    return moved


def _summary(store, segment_no: int, cache: bool) -> SegmentSummary:
    try:
        return store.segments.summary(segment_no, cache)
    except OSError:  # a read error: judged as damage (kept, may hold anything), not cached
        store.count(read_errors=1)
        return SegmentSummary(segment_no)


def carry_forward(store, dead: list[int], segments: list[int]) -> list[int]:
    """Before the wholly dead ``dead`` segments are deleted, append what a replay of the
    surviving log still needs from them (module doc, C6). Returns the segments that may go.
    Caller holds ``ckpt.lock``; an I/O error fails the store (the caller's ``sticky_io``)."""
    summaries = {s: _summary(store, s, cache=False) for s in dead}
    ok = [s for s in dead if summaries[s].complete]
    gone = set(ok)
    tombs: dict[bytes, int] = {}  # block key -> newest dropped segment deleting it
    metas: dict[tuple[int, bytes], int] = {}  # (type, name) -> newest dropped segment naming it
    for s in ok:
        for k in summaries[s].deletes:
            tombs[k] = s
        for rtype, name, _value in summaries[s].metas:
            metas[(rtype, name)] = s
    if not tombs and not metas:
        return ok
    newest = max(max(tombs.values(), default=0), max(metas.values(), default=0))
    w, live = store.writer, store.live
    with w.lock:
        tombs = {k: s for (k, s), alive in zip(tombs.items(), live.contains(list(tombs))) if not alive}
    # surviving sealed segments older than what is judged, that may hold a dead record: the
    # first one (in segment order) setting each name or putting each key decides
    older = []
    for s in segments:
        if s in gone or s >= newest:
            continue
        if store.segments.file_bytes(s) - SEGMENT_HEADER_BYTES - live.segment_bytes(s) > 0:
            older.append(s)
    first_put: dict[bytes, int] = {}
    first_set: dict[tuple[int, bytes], int] = {}
    anything_before = None  # the oldest survivor that may hold anything (could not be walked)
    for s in older:
        sm = _summary(store, s, cache=True)
        if not sm.complete:
            anything_before = s if anything_before is None else anything_before
            continue
        for k in sm.put_keys & tombs.keys():
            first_put.setdefault(k, s)
        for rtype, name, value in sm.metas:
            if value and (rtype, name) in metas:
                first_set.setdefault((rtype, name), s)

    def needed(first: int | None, s: int) -> bool:
        return (first is not None and first < s) or (anything_before is not None and anything_before < s)

    # under queue.lock the index and the queue hold every record's effect, none is in flight
    with store.queue.lock, w.lock:
        w.check()  # not store.check(): an open's first checkpoint comes here too
        queued = store.queue.queued_index_keys()
        keys = [k for (k, s), alive in zip(tombs.items(), live.contains(list(tombs)))
                if not alive and needed(first_put.get(k), s)]
        records, meta_ops = [], []
        for i in range(0, len(keys), CARRY_KEYS):
            records.append((RecordType.DELETE, [encode_delete(keys[i : i + CARRY_KEYS])]))
        for (rtype, name), s in metas.items():
            ikey = iv.record_meta_key(rtype, name)
            if ikey in queued:
                continue  # a newer record of it is in the log and survives
            value = store.index.get(ikey)
            if value is not None or needed(first_set.get((rtype, name)), s):
                records.append((rtype, [encode_meta(name, value or b"")]))
                meta_ops.append((ikey, value))
        if not records:
            return ok
        locs = w.append(records)
        ndel = len(records) - len(meta_ops)
        for j in range(ndel):
            store.appender.note_delete(locs[j].lsn, keys[j * CARRY_KEYS : (j + 1) * CARRY_KEYS])
        for loc, (ikey, value) in zip(locs[ndel:], meta_ops):
            store.queue.metadata(loc.lsn, ikey, value)
        store.ckpt.log_bytes += sum(loc.record_bytes for loc in locs)
        last = w.next_lsn - 1
    store.commit.sync_to(last)
    store.queue.apply(last)
    store.count(tombstones_carried=len(keys), metadata_carried=len(meta_ops))
    return ok
