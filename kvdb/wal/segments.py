"""Log segments: the one owner of the files in PATH/wal/ (what LevelDB's filename.h and the file
half of its VersionSet do).

A segment is a file named ``segment_name(n)`` (kvdb/format/record.py: eight decimal digits and
``.log``), holding a header (48 bytes; 32 in version 1 segments) and then records back to
back. Numbers only grow. The
highest segment is the *active* one, the only one the writer appends to (kvdb/wal/writer.py);
every lower one is *sealed*: fsynced in full before the next was created (W3), and never
written again, so its size and its summary never change and are cached here.

Who does what with segments:

* the writer creates and rotates them (kvdb/wal/writer.py);
* recovery scans them (kvdb/wal/recovery.py, kvdb/wal/reader.py ``scan_segment``);
* the cold store reads blocks from them by index location (kvdb/cold/read.py) and decides which
  may go (kvdb/cold/checkpoint.py, C4; kvdb/cold/compact.py, C6), then deletes them here;
* log shipping reads them record by record (kvdb/wal/source.py).
"""

from __future__ import annotations

import os

from kvdb.format.record import (
    SEGMENT_HEADER_BYTES,
    SegmentHeader,
    decode_segment_header,
    parse_segment_name,
    segment_name,
)
from kvdb.fs import OsFs
from kvdb.wal.reader import SegmentSummary, summarize_segment


def segment_path(wal_dir: str, segment_no: int) -> str:
    return os.path.join(wal_dir, segment_name(segment_no))


def list_segments(fs: OsFs, wal_dir: str) -> list[int]:
    """The segment numbers present in ``wal_dir``, ascending (other files are ignored)."""
    out = []
    for name in fs.listdir(wal_dir):
        n = parse_segment_name(name)
        if n is not None:
            out.append(n)
    return sorted(out)


class SegmentSet:
    """The segments of one log directory, read through ``fs``. Sealed sizes and summaries are
    cached (a sealed segment never changes); ``delete`` forgets them. Thread-safe: the caches are
    plain dicts filled idempotently, and a deleted segment is only ever looked up again by a
    caller that lists the directory first."""

    def __init__(self, fs: OsFs, wal_dir: str) -> None:
        self.fs = fs
        self.wal_dir = wal_dir
        self._sizes: dict[int, int] = {}  # sealed segment -> file bytes
        self._summaries: dict[int, SegmentSummary] = {}  # sealed segment -> its summary (segment GC)

    def path(self, segment_no: int) -> str:
        return segment_path(self.wal_dir, segment_no)

    def list(self) -> list[int]:
        return list_segments(self.fs, self.wal_dir)

    def file_bytes(self, segment_no: int) -> int:
        """The file's size now (FileNotFoundError when it is gone)."""
        return self.fs.file_bytes(self.path(segment_no))

    def sealed_sizes(self, segments: list[int], active: int) -> dict[int, int]:
        """Sizes of the sealed segments among ``segments`` (those below ``active``), from the
        cache where known; a segment gone meanwhile is left out, and the cache forgets segments
        no longer listed."""
        sizes = self._sizes
        present = set(segments)
        for gone in [x for x in list(sizes) if x not in present]:
            sizes.pop(gone, None)
        out = {}
        for x in segments:
            if x >= active:
                continue
            size = sizes.get(x)
            if size is None:
                try:
                    size = sizes[x] = self.file_bytes(x)
                except FileNotFoundError:
                    continue
            out[x] = size
        return out

    def header(self, segment_no: int) -> SegmentHeader:
        """Its header (either version; CorruptionError when damaged, OSError when unreadable)."""
        fd = self.fs.open_read(self.path(segment_no))
        try:
            return decode_segment_header(self.fs.pread(fd, SEGMENT_HEADER_BYTES, 0))
        finally:
            self.fs.close(fd)

    def first_lsn(self, segment_no: int) -> int:
        """The lsn its header says its first record has."""
        return self.header(segment_no).first_lsn

    def last_lsn(self, segment_no: int, segments: list[int]) -> int | None:
        """The lsn of the last record of a sealed segment: the next segment's first lsn - 1
        (None when no later segment is listed in ``segments``)."""
        later = [s for s in segments if s > segment_no]
        if not later:
            return None
        return self.first_lsn(min(later)) - 1

    def summary(self, segment_no: int, cache: bool) -> SegmentSummary:
        """Which keys a sealed segment puts, deletes and names (kvdb/wal/reader.py
        ``summarize_segment``); ``cache``: keep it for the next call. OSError on a read error."""
        sm = self._summaries.get(segment_no)
        if sm is None:
            sm = summarize_segment(self.path(segment_no), segment_no)
            if cache:
                self._summaries[segment_no] = sm
        return sm

    def delete(self, dead: list[int]) -> None:
        """Unlink sealed segments and fsync the directory. The caller has made sure nothing
        needs them any more (C4 in kvdb/cold/checkpoint.py)."""
        for s in dead:
            self._sizes.pop(s, None)
            self._summaries.pop(s, None)
        for s in dead:
            self.fs.unlink(self.path(s))
        if dead:
            self.fs.sync_dir(self.wal_dir)


__all__ = ["SegmentSet", "list_segments", "segment_path"]
