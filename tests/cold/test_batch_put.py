"""The batch path of raw, unsealed puts (kvdb/cold/write.py ``PutRows``, kvdb/wal/writer.py
``append_rows``): the same log bytes, index, live set and reads as the record-by-record path,
through rotations in the middle of a batch, overwrites, eviction under ``disk_bytes`` and
reopen; pages inline behind their heads and pages written from the caller's rows."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import kvdb.cold.write as cold_write
import kvdb.wal.writer as wal_writer
from kvdb.cold import ColdStore
from kvdb.format.record import NO_POSITION, Codec, encode_put_fixed

from cold_fixtures import TINY, key, pages_for
import test_crash
import test_faults

STORE_ID = bytes(range(16))


def _record_by_record(store, keys, pages, positions):
    """The per-record path (what codecs and sealing still take) for raw pages."""
    items = [(k, encode_put_fixed(k, 0, NO_POSITION if p is None else p, Codec.RAW, 0, store.page_bytes), pages[i])
             for i, (k, p) in enumerate(zip(keys, positions))]
    store.appender.append_puts(items)


def _workload(store, batched: bool) -> list[bytes]:
    rng = np.random.default_rng(7)
    all_keys = []
    for b in range(8):
        ids = rng.choice(120, size=int(rng.integers(1, 40)), replace=False)  # overwrites across batches
        keys = [key(int(i)) for i in ids]
        pages = pages_for(keys, salt=b)
        positions = [None if i % 3 == 0 else int(i) for i in ids]
        if batched:
            store.put(keys, pages, positions, "none")
        else:
            _record_by_record(store, keys, pages, positions)
        if b == 4:
            store.flush()
        all_keys += keys
    return sorted(set(all_keys))


def _run(path, batched: bool, disk_bytes=None):
    store = ColdStore.open(path, TINY, flush_interval_s=None, segment_bytes=2048, store_id=STORE_ID,
                           disk_bytes=disk_bytes)
    keys = _workload(store, batched)
    pending = store.lookup(keys)  # before the queue is applied
    store.flush()
    applied = store.lookup(keys)
    out = np.zeros((len(keys), TINY.page_bytes), np.uint8)
    found = store.get_into(keys, out)
    state = (pending, applied, found, out.tobytes(), store.space(), store.stats()["pages"], store.durable_lsn)
    store.close()
    segs = {p.name: p.read_bytes() for p in sorted((path / "wal").iterdir())}
    store = ColdStore.open(path, TINY, flush_interval_s=None, segment_bytes=2048, disk_bytes=disk_bytes)
    reopened = store.lookup(keys)
    store.close()
    return segs, state, reopened


@pytest.mark.parametrize("write_bytes", [None, 600], ids=["one-write", "pipelined"])
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "iovec"])
@pytest.mark.parametrize("disk_bytes", [None, 5000], ids=["unbounded", "evicting"])
def test_batch_path_writes_what_the_record_path_writes(tmp_path, monkeypatch, inline, disk_bytes, write_bytes):
    # Scenario: the same puts (overwrites, positions and none, 2 KiB segments so that batches
    # rotate in their middle; under disk_bytes also evictions and a batch larger than the
    # bound) go through the batch path and record by record. Segment files are equal byte for
    # byte, and so are the index entries (queued and applied), reads, live bytes and reopen.
    # "pipelined": writes of ~3 records, sealed while the one before is written.
    if write_bytes is not None:
        monkeypatch.setattr(wal_writer, "ROWS_WRITE_BYTES", write_bytes)
    if not inline:
        monkeypatch.setattr(cold_write, "INLINE_PAGE_BYTES", 0)
    batch = _run(tmp_path / "batch", True, disk_bytes)
    ref = _run(tmp_path / "ref", False, disk_bytes)
    assert max(int(name[:8]) for name in batch[0]) > 5  # rotations happened
    assert batch[0] == ref[0]
    assert batch[1] == ref[1]
    assert batch[2] == ref[2]
    pending, applied, found = batch[1][0], batch[1][1], batch[1][2]
    assert pending == applied and sum(found) > 0
    if disk_bytes is not None:
        assert not all(found)  # evictions happened


def test_queue_counts_the_keys_of_a_batch_and_applies_it_whole(tmp_path):
    # Scenario: a batch is one queue item, counted as its keys (APPLY_BATCH compares against
    # updates, kvdb/cold/store.py); applied, it leaves nothing pending and RocksDB has it (C1).
    store = ColdStore.open(tmp_path / "s", TINY, flush_interval_s=None, store_id=STORE_ID)
    keys = [key(i) for i in range(50)]
    store.put(keys, pages_for(keys), None, "none")
    assert len(store.queue) == 50
    assert store.queue.queued_index_keys() == {b"B" + k for k in keys}
    store.flush()
    assert len(store.queue) == 0
    assert [e is not None for e in store.index.get_entries(keys)] == [True] * 50
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "iovec"])
def test_crash_and_io_errors_in_pipelined_writes(tmp_path, monkeypatch, inline):
    # Scenario: tests/cold/test_crash.py's crash at every I/O point and test_faults.py's EIO at
    # every other point, with every batch written one record per write by the writer's I/O
    # thread: the same guarantees (a prefix of an unacknowledged batch, typed sticky errors,
    # nothing acknowledged lost, verify clean).
    monkeypatch.setattr(wal_writer, "ROWS_WRITE_BYTES", 1)
    if not inline:
        monkeypatch.setattr(cold_write, "INLINE_PAGE_BYTES", 0)
    (tmp_path / "crash").mkdir()
    (tmp_path / "eio").mkdir()
    test_crash.test_crash_at_every_io_point(tmp_path / "crash")
    test_faults.test_io_error_at_every_point_is_typed_sticky_and_loses_nothing(tmp_path / "eio", errno.EIO)


def test_append_rows_refuses_strided_payloads_before_writing(tmp_path):
    # The writes read rows and payloads as flat memory (kvdb/fs.py writev_rows): a strided
    # payload array is refused before the first write (seal_rows checks it, chunk 1), no byte
    # written, no lsn taken, the writer still usable -- also when the batch takes several
    # writes, the later ones on the I/O thread.
    from kvdb.errors import InvalidInput
    from kvdb.format.record import put_rows

    keys = [key(i) for i in range(600)]  # more than one write (512 records each)
    s = ColdStore.open(tmp_path, TINY, flush_interval_s=None, store_id=STORE_ID)
    try:
        w = s.writer
        pages = np.zeros((600, 2 * TINY.page_bytes), dtype=np.uint8)[:, ::2]
        rows = put_rows(b"".join(keys), np.full(600, -1, dtype=np.int64), 0, Codec.RAW, 0, TINY.page_bytes, None,
                        TINY.page_bytes)
        logged = lambda: sum(p.stat().st_size for p in (tmp_path / "wal").iterdir())  # noqa: E731
        before, lsn = logged(), w.next_lsn
        with w.lock, pytest.raises(InvalidInput):
            w.append_rows(rows, pages)
        assert (logged(), w.next_lsn) == (before, lsn)
        s.put(keys, pages_for(keys), None, "sync")
        assert s.contains(keys) == [True] * 600
    finally:
        s.close()
