"""Read-only views beside a live writer: detect "changed under me" and look again.

A read-only open (``kvdb stats``, ``verify``, ``ls``, ``get``, ``wal dump``, ``kvdb.open(...,
read_only=True)``) takes no lock and writes nothing, so it cannot pin the writer's files the
way a RocksDB reader pins its table files: meanwhile the writer's compaction and segment GC
delete log segments (C4), RocksDB compacts and deletes table files, and a checkpoint adds
table files that the index's MANIFEST, read a moment later, names. A view built across such a
change can miss a file: RocksDB reports a "No such file" that reads as a damaged index, a
replay finds a segment after its checkpoint missing, a scan or a read finds a segment gone.

None of that is damage, and exit 3 (``CorruptionError``) must mean damage. So ``stable`` runs
an inspection as an attempt between two listings of the store's files (``files_of``: the
log's segment names, the index's file names and its MANIFEST sizes). An attempt that failed
(``CorruptionError``, ``StorageIOError``, a vanished file) or whose result looks damaged
(``suspect``) is believed only when the listings are equal -- nothing was created or deleted
while it ran, so what it saw is the store as it is; otherwise it is discarded and run again
on a fresh view, at most ``VIEW_TRIES`` times, then ``StoreChangedError`` ("changed too fast
to inspect; try again": exit 1, never 3). A writer that only appends to its active segment
changes no listing: damage found beside it is reported at once.

A read-only open pins what it opened: every table file RocksDB opened (all of them, the
default ``max_open_files=-1``) and every segment fd held; a file deleted after that keeps its
bytes for this view (POSIX unlink).
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

from kvdb.errors import CorruptionError, StorageIOError, StoreChangedError
from kvdb.format.record import parse_segment_name

T = TypeVar("T")

#: attempts before StoreChangedError
VIEW_TRIES = 8
#: the pause before attempt i (seconds, doubled each time up to VIEW_PAUSE_MAX_S)
VIEW_PAUSE_S = 0.01
VIEW_PAUSE_MAX_S = 0.25


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def files_of(path) -> tuple:
    """What a writer changes when it creates or deletes files: the segments of ``wal/``, the
    files of ``index/`` (not RocksDB's info logs or lock) with each MANIFEST's size (a RocksDB
    flush appends to it). Equal before and after an attempt: no file came or went meanwhile."""
    path = os.fspath(path)
    wal = frozenset(n for n in _names(os.path.join(path, "wal")) if parse_segment_name(n) is not None)
    index_dir = os.path.join(path, "index")
    index = set()
    for n in _names(index_dir):
        if n.startswith("LOG") or n == "LOCK":
            continue
        if n.startswith("MANIFEST-"):
            try:
                n = (n, os.stat(os.path.join(index_dir, n)).st_size)
            except FileNotFoundError:
                continue
        index.add(n)
    return wal, frozenset(index)


def _changed_by_writer(e: BaseException) -> bool:
    """An error a file vanishing under a view can cause (damage causes the same ones: only the
    listings tell them apart)."""
    return isinstance(e, (CorruptionError, StorageIOError, FileNotFoundError))


def stable(path, attempt: Callable[[], T], *, suspect: Callable[[T], bool] | None = None,
           discard: Callable[[T], None] | None = None, tries: int = VIEW_TRIES) -> T:
    """``attempt()``'s result (or its error) from a view no file change crossed; see the module
    doc. ``suspect(result)``: the result reports damage (believed only from an unchanged store);
    ``discard(result)``: release a result that is thrown away (close a store)."""
    for i in range(tries):
        if i:
            time.sleep(min(VIEW_PAUSE_S * 2 ** (i - 1), VIEW_PAUSE_MAX_S))
        before = files_of(path)
        try:
            out = attempt()
        except Exception as e:
            if not _changed_by_writer(e) or files_of(path) == before:
                raise
            continue
        if suspect is None or not suspect(out) or files_of(path) == before:
            return out
        if discard is not None:
            discard(out)
    raise StoreChangedError(f"{path} changed too fast to inspect: its writer created or deleted files during each "
                            f"of {tries} attempts (compaction, segment GC); try again")


__all__ = ["VIEW_TRIES", "files_of", "stable"]
