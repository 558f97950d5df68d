"""SegmentLogSource over a real log written by kvdb.wal.writer.LogWriter (small segments) and made
durable by kvdb.wal.commit.GroupCommit, read while it grows: batches are consecutive, exact bytes, cut at max_bytes and upto_lsn."""

from __future__ import annotations

import os

import pytest

from kvdb.errors import CorruptionError
from kvdb.format.record import RecordType, check_record
from kvdb.fs import OsFs
from kvdb.wal.commit import GroupCommit
from kvdb.wal.source import SegmentLogSource
from kvdb.wal.writer import LogWriter


def _body(i: int) -> bytes:
    return bytes([i % 251]) * (100 + i)


@pytest.fixture
def log(tmp_path):
    wal = tmp_path / "wal"
    os.makedirs(wal)
    c = GroupCommit(LogWriter(OsFs(), str(wal), segment_no=1, offset=0, next_lsn=1, segment_bytes=600))
    yield c, SegmentLogSource(wal, durable=lambda: c.durable_lsn)
    c.close()


def _append(c, first: int, n: int) -> None:
    with c.writer.lock:
        c.writer.append([(RecordType.DELETE if i % 3 == 0 else RecordType.SESSION, [_body(i)])
                         for i in range(first, first + n)])
    c.sync_to(first + n - 1)


def test_reads_span_segments_in_order_with_exact_bytes(log):
    # Scenario: the source looks at the log while it holds only a segment header (its map of
    # that segment is then stale); 12 records of 101..112 body bytes are appended across
    # several 600-byte segments; batches of <= 400 bytes come back consecutive and intact.
    c, src = log
    assert (src.durable_lsn(), src.first_lsn()) == (0, 1)
    assert src.read_records(0, 400, 0) == []
    _append(c, 1, 12)
    assert len(os.listdir(src.wal_dir)) >= 3
    got, after = [], 0
    while after < 12:
        batch = src.read_records(after, 400, 12)
        assert batch and sum(b.nbytes for _, b in batch) <= max(400, batch[0][1].nbytes)
        got += batch
        after = batch[-1][0]
    assert [lsn for lsn, _ in got] == list(range(1, 13))
    for lsn, buf in got:
        status, rec = check_record(buf, 0)
        assert status == "ok" and (rec.lsn, bytes(rec.body), rec.record_bytes) == (lsn, _body(lsn), buf.nbytes)


def test_upto_lsn_and_a_reconnect_at_another_position(log):
    c, src = log
    _append(c, 1, 6)
    assert [lsn for lsn, _ in src.read_records(0, 1 << 20, 4)] == [1, 2, 3, 4]  # S3: nothing past upto
    assert [lsn for lsn, _ in src.read_records(2, 1 << 20, 6)] == [3, 4, 5, 6]  # cursor miss: walks headers
    assert src.read_records(6, 1 << 20, 6) == []
    _append(c, 7, 2)
    assert [lsn for lsn, _ in src.read_records(6, 1 << 20, 8)] == [7, 8]


def test_a_deleted_segment_means_reseed(log):
    c, src = log
    _append(c, 1, 12)
    os.unlink(os.path.join(src.wal_dir, "00000001.log"))
    assert src.first_lsn() > 1
    with pytest.raises(CorruptionError, match="no record 1.*re-seeded"):
        src.read_records(0, 1 << 20, 12)

