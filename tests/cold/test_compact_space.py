"""Compaction looks for room before it writes (issue 45; kvdb/cold/compact.py "Room first").

``SmallDisk`` is the fault layer (kvdb/fs.py ``FaultFs``) of a disk that holds only the store:
its free bytes are its capacity less every file under the store's directory (the log and
RocksDB's files), and a log write past the capacity raises ENOSPC. On such a nearly full disk,
deleting blocks used to let automatic compaction copy the live blocks into the last free
bytes: the store failed with no caller write in flight and could not reopen until space was
added. Now compaction leaves segments it has no room for (counted, logged once) and tries
again later; the store stays healthy and reopens."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest
from cold_fixtures import TINY, key, pages_for

from kvdb.cold import checkpoint as checkpoint_mod
from kvdb.cold import compact as compact_mod
from kvdb.cold.store import ColdStore
from kvdb.errors import StorageIOError
from kvdb.fs import FaultFs

SEG = 8 << 10
RESERVE = 128 << 10  # the reserve at this test's scale (64 MiB at a real store's): a reopen here
#: writes ~45 KiB of RocksDB files (info LOG, OPTIONS, MANIFEST)
ROOM_TO_REOPEN = 64 << 10


class SmallDisk(FaultFs):
    def __init__(self, root, capacity: int) -> None:
        super().__init__()
        self.root, self.capacity = str(root), capacity

    def used(self) -> int:
        total = 0
        for d, _dirs, files in os.walk(self.root):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(d, f))
                except FileNotFoundError:
                    pass
        return total

    def free_bytes(self, path: str) -> int:
        return max(0, self.capacity - self.used())

    def writev(self, fd: int, path: str, bufs: list, nbytes: int | None = None) -> None:
        total = sum(memoryview(b).nbytes for b in bufs)
        fit = self.capacity - self.used()
        if total > fit:  # what fits reaches the file (a short write), then the disk is full
            os.write(fd, b"".join(bytes(memoryview(b).cast("B")) for b in bufs)[:max(0, fit)])
            raise OSError(errno.ENOSPC, "No space left on device (SmallDisk)", path)
        super().writev(fd, path, bufs, nbytes)


@pytest.fixture(autouse=True)
def small_reserve(monkeypatch):
    monkeypatch.setattr(compact_mod, "SPACE_RESERVE_BYTES", RESERVE)


def _open(path, fs, **kw):
    return ColdStore.open(path, TINY, fs=fs, segment_bytes=SEG, flush_interval_s=None, **kw)


def _nearly_full(tmp_path, headroom: int):
    """A store of 300 blocks, two in three deleted (every sealed segment ~2/3 dead: automatic
    compaction is due), on a disk with ``headroom`` bytes free; the live keys."""
    disk = SmallDisk(tmp_path / "c", capacity=1 << 30)
    s = _open(tmp_path / "c", disk, max_space_amp=2.0)
    keys = [key(i) for i in range(300)]
    s.put(keys, pages_for(keys), durability="group")
    dead = [k for i, k in enumerate(keys) if i % 3]
    s.delete(dead, durability="group")
    s.checkpoint()
    disk.capacity = disk.used() + headroom
    live = keys[::3]
    sp = s.space()
    assert sp["log_bytes"] > 2.0 * sp["live_bytes"] and sp["reclaimable_bytes"] >= SEG  # compaction is due
    return s, disk, live


def _read_back(s, keys) -> bool:
    out = np.zeros((len(keys), TINY.page_bytes), dtype=np.uint8)
    return all(s.get_into(keys, out)) and np.array_equal(out, pages_for([key(i) for i in range(300)])[::3])


def _reads_back_and_reopens(s, disk, live) -> None:
    """``s`` is healthy, every live block reads back, and so after a reopen on the same disk."""
    assert not s.failed and _read_back(s, live) and s.verify().problems == []
    s.close()
    s = _open(s.path, disk)
    assert _read_back(s, live)
    s.close()


def test_without_the_room_check_a_full_disk_fails_the_store_and_its_reopen(tmp_path, monkeypatch):
    # the failure the check prevents: the copies take the last free bytes (on a real disk
    # RocksDB then has no room for the files a reopen writes)
    s, disk, live = _nearly_full(tmp_path, headroom=4 << 10)
    monkeypatch.setattr(compact_mod, "SPACE_RESERVE_BYTES", -(1 << 40))  # as if no check
    with pytest.raises(StorageIOError, match="No space left"):
        s.maybe_compact()
    assert s.failed and disk.free_bytes("") == 0  # no caller write in flight, and the disk is full
    s.close()


def test_a_nearly_full_disk_defers_automatic_compaction_and_the_store_reopens(tmp_path, monkeypatch, caplog):
    s, disk, live = _nearly_full(tmp_path, headroom=ROOM_TO_REOPEN)
    used = disk.used()
    with caplog.at_level(logging.WARNING, logger="kvdb.cold"):
        out = s.maybe_compact()
        assert out is not None and out["space_deferred_segments"] >= 1 and out["records_copied"] == 0
        assert disk.used() == used  # below the reserve: not a byte written, not even a checkpoint
        assert s.maybe_compact() is None  # backed off: the next try waits SPACE_RETRY_S
        s.ckpt._space_retry_at = 0.0  # ... which has passed
        assert s.maybe_compact()["space_deferred_segments"] >= 1  # tried again, still no room
    warnings = [r for r in caplog.records if "deferred" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path / "c") in warnings[0].getMessage()  # logged once
    st = s.stats()
    assert st["compaction_space_deferrals"] == 2 and st["auto_compactions"] == 0
    assert not s.failed and _read_back(s, live)
    s.close()
    s = _open(tmp_path / "c", disk, max_space_amp=2.0)  # reopens on the same full disk
    assert _read_back(s, live) and s.verify().problems == []
    disk.capacity += 1 << 20  # space added: the next try compacts
    monkeypatch.setattr(checkpoint_mod, "SPACE_RETRY_S", 0.0)
    before = s.space()["log_bytes"]
    out = s.maybe_compact()
    assert out["space_deferred_segments"] == 0 and out["segments_deleted"] >= 1
    assert s.space()["log_bytes"] < before and s.stats()["auto_compactions"] == 1
    assert _read_back(s, live) and s.verify().problems == []
    s.close()


def test_compaction_copies_what_fits_and_leaves_the_rest(tmp_path):
    s, disk, live = _nearly_full(tmp_path, headroom=RESERVE + (16 << 10))  # room for a segment or two
    out = s.compact()
    assert out["segments_deleted"] >= 1 and out["space_deferred_segments"] >= 1
    assert disk.free_bytes("") > 0
    _reads_back_and_reopens(s, disk, live)


def test_room_is_looked_at_again_before_each_chunk(tmp_path, monkeypatch):
    # something else fills the disk while a compaction runs: it stops before the chunk that
    # would not fit, and what it moved stays moved
    monkeypatch.setattr(compact_mod, "CHUNK_BYTES", 1024)
    s, disk, live = _nearly_full(tmp_path, headroom=1 << 20)
    moves = []
    real = compact_mod._move_chunk

    def move_then_fill(store, segment_no, keys, out):
        moved = real(store, segment_no, keys, out)
        moves.append(moved)
        if len(moves) == 2:
            disk.capacity = disk.used() + RESERVE + 512  # another process took the disk
        return moved

    monkeypatch.setattr(compact_mod, "_move_chunk", move_then_fill)
    out = s.compact()
    assert len(moves) == 2 and out["records_copied"] > 0 and out["space_deferred_segments"] >= 1
    _reads_back_and_reopens(s, disk, live)


def test_the_flusher_defers_on_a_full_disk_and_the_store_stays_healthy(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_mod, "AUTO_COMPACT_CHECK_S", 0.0)
    s, disk, live = _nearly_full(tmp_path, headroom=ROOM_TO_REOPEN)
    s.ckpt.start_flusher(0.002, "test-flusher")  # the flusher's own automatic compaction
    for _ in range(2000):  # bounded: until the flusher has looked and deferred
        if s.stats()["compaction_space_deferrals"]:
            break
        s.flush()
    assert s.stats()["compaction_space_deferrals"] >= 1
    s.flush()
    _reads_back_and_reopens(s, disk, live)
