"""Recovery: replay the log after the last checkpoint and find where appending resumes.

Steps (every open runs them; a clean close leaves nothing to replay but the checkpoint record):

1. list the segments; replay starts at the checkpoint's (segment, offset), or at the first
   segment when the index holds no checkpoint;
2. scan each segment from there on, passing every intact record to ``apply`` in lsn order
   (the index applies puts and deletes; re-applying one already in the index is harmless
   because every record is a blind write of its keys' final state);
3. the last segment may end in a torn record (an append the crash interrupted, never
   acknowledged: W3 in kvdb/wal/writer.py): it is truncated away (``repair=True``);
4. a last segment whose header never reached the disk (crash while creating it) is removed;
5. anything else that fails -- a record in the middle that fails its crc, a sealed segment
   that ends torn, a missing segment after the checkpoint, lsns that skip -- is *damage*:
   listed in the result (the store counts it and ``kvdb verify`` exits 3), never applied;
6. with no checkpoint (a new store, or an index rebuilt from the log: PATH/index/ removed),
   replay starts at the first segment and a hole between two segments is one that segment GC
   deleted, not damage (only the index knew which segments GC took): replay resumes at the
   next segment's first lsn. Store invariant C6 (kvdb/cold/checkpoint.py) makes the surviving
   segments replay to exactly the live state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdb.format.index_value import Checkpoint
from kvdb.format.record import SEGMENT_HEADER_BYTES
from kvdb.fs import OsFs
from kvdb.wal.reader import scan_segment
from kvdb.wal.segments import list_segments, segment_path


@dataclass
class RecoveryResult:
    segment_no: int  # segment appends resume in
    offset: int  # its append offset; 0 = create this segment
    next_lsn: int
    records_replayed: int = 0
    records_applied: int = 0  # of those, records that changed the index (set by the caller's apply)
    bytes_replayed: int = 0
    torn_bytes: int = 0  # truncated from the tail
    segments: list[int] = field(default_factory=list)
    damage: list[str] = field(default_factory=list)


def recover(fs: OsFs, wal_dir: str, checkpoint: Checkpoint | None, apply, *, repair: bool = True) -> RecoveryResult:
    segs = list_segments(fs, wal_dir)
    ck_next = checkpoint.applied_lsn + 1 if checkpoint else 1
    if not segs:
        if checkpoint is not None and checkpoint.applied_lsn > 0:
            return RecoveryResult(checkpoint.segment_no + 1, 0, ck_next, damage=[
                f"the index has a checkpoint in segment {checkpoint.segment_no} but the log has no segments"])
        return RecoveryResult(1, 0, ck_next)
    res = RecoveryResult(segs[-1], 0, ck_next, segments=list(segs))
    if checkpoint is not None:
        start_seg, start_off, expect = checkpoint.segment_no, checkpoint.offset, ck_next
        if start_seg not in segs:
            res.damage.append(f"segment {start_seg} holding the checkpoint is missing")
            start_off = None
    else:
        start_seg, start_off, expect = segs[0], None, None
    todo = [s for s in segs if s >= start_seg]
    if not todo:
        res.segment_no, res.offset = start_seg + 1, 0
        return res
    prev = start_seg if start_seg in segs else None
    max_lsn = ck_next - 1

    s = 0

    def on_record(rec) -> None:
        res.records_replayed += 1
        res.bytes_replayed += rec.record_bytes
        apply(s, rec)

    for s in todo:
        if prev is not None and s != prev and s != prev + 1:
            if checkpoint is not None:
                res.damage.append(f"segments {prev + 1}..{s - 1} are missing")
            else:  # a replay from the first segment: holes are segments GC deleted (step 6)
                expect = None
        prev = s
        path = segment_path(wal_dir, s)
        is_last = s == segs[-1]
        scan_start = start_off
        scan = scan_segment(path, s, start_off, expect, keep_records=False, on_record=on_record)
        start_off = None
        if scan_start is not None and scan.file_bytes < scan_start:
            # fsynced bytes (before the checkpoint) are gone: damage, and appends must not
            # land where index entries still point
            res.damage.append(f"segment {s} is {scan.file_bytes} bytes, shorter than its checkpoint "
                              f"at byte {scan_start}")
            if is_last:
                res.segment_no, res.offset = s + 1, 0
            continue
        for d in scan.damage:
            res.damage.append(f"segment {s} bytes {d.offset}..{d.end}: {d.what}")
        if scan.last_lsn is not None:
            max_lsn = max(max_lsn, scan.last_lsn)
            expect = scan.last_lsn + 1
        elif scan.header is not None:
            max_lsn = max(max_lsn, scan.header.first_lsn - 1)
        if scan.ending == "bad-header":
            if is_last and scan.file_bytes <= SEGMENT_HEADER_BYTES:  # (a version 1 header: 32 bytes)
                # step 4: the crash came while this segment was being created
                if repair:
                    fs.unlink(path)
                    fs.sync_dir(wal_dir)
                    res.segments.remove(s)
                res.segment_no, res.offset = s, 0
                res.torn_bytes += scan.file_bytes
            else:
                res.damage.append(f"segment {s} has a damaged header")
                if is_last:
                    res.segment_no, res.offset = s + 1, 0
            continue
        if scan.ending == "torn":
            if is_last:
                res.torn_bytes += scan.file_bytes - scan.end
                if repair:
                    fs.truncate(path, scan.end)
            else:
                res.damage.append(f"sealed segment {s} ends in a damaged record at byte {scan.end}")
        if is_last:
            res.segment_no, res.offset = s, scan.end
    res.next_lsn = max(max_lsn + 1, ck_next)
    return res
