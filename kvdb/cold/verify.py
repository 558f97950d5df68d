"""``verify``: check every record's checksum and every index entry against the log.

The oracle of the corruption and crash tests (as diskcache's ``check()`` is for its tests).
Checks, in order:

1. the damage recovery found when the store was opened (kvdb/wal/recovery.py step 5);
2. every segment: intact header, every record intact from header to end of file, lsns
   consecutive inside a segment and across consecutive segments (R1), no torn tail in a
   sealed segment;
3. every index entry: its segment exists, the record at its offset has the entry's length,
   crc, type, lsn and key, and its payload decodes (and authenticates) to a whole page;
4. RocksDB itself: the full scan of steps 3 reads every block with checksums on;
5. the per-segment live totals the index holds (C7, kvdb/cold/apply.py): the sums of its
   entries, segment by segment (what the next open would start from).

Clean means no problem at all; ``kvdb verify`` exits 3 otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from kvdb.cold.recovery import load_totals
from kvdb.errors import KvdbError
from kvdb.wal.reader import scan_segment


@dataclass
class VerifyReport:
    segments: int = 0
    records: int = 0
    log_bytes: int = 0
    entries: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, **asdict(self)}


def verify(store, progress=None, live_writer: bool = False) -> VerifyReport:
    store.flush()
    rep = VerifyReport()
    rep.problems.extend(f"recovery: {d}" for d in store.recovery.damage)
    segments = store.segments
    with store.writer.lock:  # a quiet log for the scan
        segs = segments.list()
        sizes = {s: segments.file_bytes(s) for s in segs}
        total = sum(sizes.values())
        done = 0
        prev_seg, prev_last = None, None
        for s in segs:
            scan = scan_segment(segments.path(s), s, keep_records=False)
            rep.segments += 1
            rep.log_bytes += scan.file_bytes
            if scan.first_lsn is not None and scan.last_lsn is not None:
                rep.records += scan.last_lsn - scan.first_lsn + 1
            for d in scan.damage:
                rep.problems.append(f"segment {s} bytes {d.offset}..{d.end}: {d.what}")
            if scan.ending == "bad-header":
                rep.problems.append(f"segment {s} has a damaged header")
            elif scan.ending == "torn" and not (live_writer and s == segs[-1]):  # else: being appended
                rep.problems.append(f"segment {s} ends in a damaged record at byte {scan.end} of {scan.file_bytes}")
            first = scan.header.first_lsn if scan.header is not None else scan.first_lsn
            if prev_seg is not None and s == prev_seg + 1 and prev_last is not None and first is not None \
                    and first != prev_last + 1:
                rep.problems.append(f"segment {s} starts at lsn {first}, segment {prev_seg} ended at {prev_last}")
            prev_seg = s
            prev_last = scan.last_lsn if scan.last_lsn is not None else (first - 1 if first else prev_last)
            done += sizes[s]
            if progress is not None:
                progress(done, total)
    scratch = np.empty((1, store.page_bytes), dtype=np.uint8)
    sums: dict[int, list[int]] = {}
    try:
        for key, e in store.index.entries():
            rep.entries += 1
            t = sums.setdefault(e.segment_no, [0, 0])
            t[0] += e.record_bytes
            t[1] += 1
            if e.segment_no not in sizes:
                rep.problems.append(f"block {key.hex()}: its segment {e.segment_no} is missing")
                continue
            if e.offset + e.record_bytes > sizes[e.segment_no]:
                rep.problems.append(f"block {key.hex()}: record at segment {e.segment_no} offset {e.offset} "
                                    f"runs past the end of the file")
                continue
            ok = store.reader.read_entry(key, e, scratch[0])
            if ok is not True:
                rep.problems.append(f"block {key.hex()}: record at segment {e.segment_no} offset {e.offset} "
                                    "fails its checks")
        held = load_totals(store.index)
        for seg in sorted(set(held) | set(sums)):
            if held.get(seg, [0, 0]) != sums.get(seg, [0, 0]):
                (hb, hn), (eb, en) = held.get(seg, [0, 0]), sums.get(seg, [0, 0])
                rep.problems.append(f"index: the live totals of segment {seg} say {hn} blocks of {hb} bytes, its "
                                    f"entries {en} of {eb}; remove the index/ directory to rebuild it from the log")
    except KvdbError as exc:
        rep.problems.append(f"index: {exc}")
    return rep
