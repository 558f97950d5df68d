"""Log and index byte layouts: golden files (re-encoded byte for byte), round trips, and the
log's two properties -- any truncation decodes to a prefix of the records (R2), and damage is
never decoded as a record."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdb.errors import CorruptionError
from kvdb.format import index_value as iv
from kvdb.format import record as fr
from kvdb.format import slots as fs
from kvdb.wal.reader import scan_buffer

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
KEY_A = bytes(range(16))
KEY_B = bytes(range(16, 32))
STORE_ID = bytes(range(0xA0, 0xB0))


def golden_examples() -> dict[str, bytes]:
    """Every on-disk layout, encoded from the worked examples of the format modules."""
    put = fr.encode_record(fr.RecordType.PUT_BLOCK, 5,
                           fr.encode_put_fixed(KEY_A, 7, 3, fr.Codec.RAW, 0, 4) + b"\x01\x02\x03\x04")
    delete = fr.encode_record(fr.RecordType.DELETE, 6, fr.encode_delete([KEY_A, KEY_B]))
    session = fr.encode_record(fr.RecordType.SESSION, 7, fr.encode_meta(b"agent-1", b'{"round":3}'))
    ttl = fr.encode_record(fr.RecordType.TTL, 8, fr.encode_meta(KEY_B, struct.pack("<Q", 1_700_000_000_000_000_000)))
    lease = fr.encode_record(fr.RecordType.LEASE, 9, fr.encode_meta(KEY_A, b"engine-0"))
    ckpt = fr.encode_record(fr.RecordType.CHECKPOINT, 10, fr.encode_checkpoint(9))
    header = fr.encode_segment_header(1, 5, STORE_ID)
    entry = iv.encode_entry(iv.BlockEntry(1, 32, 57, 0x11223344, 5, 3, 7, 0, 0, 4))
    return {
        "segment_header.bin": header,
        "record_put.bin": put,
        "record_delete.bin": delete,
        "record_session.bin": session,
        "record_ttl.bin": ttl,
        "record_lease.bin": lease,
        "record_checkpoint.bin": ckpt,
        "segment_example.log": header + put + delete + session + ttl + lease + ckpt,
        "index_entry.bin": entry,
        "index_checkpoint.bin": iv.encode_checkpoint(iv.Checkpoint(1, 32, 5)),
        "index_segment_live.bin": iv.live_key(1) + iv.encode_segment_live(3 * 4149, 3),
        "index_applied.bin": iv.APPLIED_KEY + iv.encode_lsn(5),
        "replication_slots.json": fs.encode_slots({"10.0.0.8:7070": 1790, "10.0.0.7:7070": 1843}),
        "replication_log_id": fs.encode_log_id("9f3a61c02be4d778"),
    }


@pytest.mark.parametrize("name", sorted(golden_examples()))
def test_golden_files_reencode_byte_for_byte(name):
    if os.environ.get("KVDB_REGEN_GOLDEN"):
        (GOLDEN / name).write_bytes(golden_examples()[name])
    assert (GOLDEN / name).read_bytes() == golden_examples()[name]


def test_replication_state_files_decode_and_refuse_damage():
    # the worked examples of kvdb/format/slots.py; a slots file that is not an object of
    # integer lsns is CorruptionError naming the file
    slots = fs.decode_slots((GOLDEN / "replication_slots.json").read_bytes())
    assert slots == {"10.0.0.7:7070": 1843, "10.0.0.8:7070": 1790}
    assert fs.decode_log_id((GOLDEN / "replication_log_id").read_bytes() + b"\n") == "9f3a61c02be4d778"
    for raw in (b"[1, 2]", b"{not json", b'{"a:1": "x"}', b'{"a:1": null}'):
        with pytest.raises(CorruptionError, match="slots file S is damaged"):
            fs.decode_slots(raw, "S")


def test_worked_example_of_a_put_record():
    # Scenario: the PUT_BLOCK of kvdb/format/record.py's docstring, field by field.
    buf = (GOLDEN / "record_put.bin").read_bytes()
    assert len(buf) == 57
    assert buf[:4] == b"\x28\x00\x00\x00"
    assert buf[8] == 1 and buf[9:17] == b"\x05" + bytes(7)
    status, rec = fr.check_record(buf, 0)
    assert status == "ok" and rec.lsn == 5 and rec.rtype == fr.RecordType.PUT_BLOCK
    p = fr.decode_put(rec.body)
    assert (p.key, p.namespace_id, p.position, p.codec, p.flags, p.raw_bytes, bytes(p.payload)) == \
        (KEY_A, 7, 3, 0, 0, 4, b"\x01\x02\x03\x04")
    e = iv.decode_entry((GOLDEN / "index_entry.bin").read_bytes())
    assert (e.segment_no, e.offset, e.record_bytes, e.crc, e.lsn, e.position, e.namespace_id, e.raw_bytes) == \
        (1, 32, 57, 0x11223344, 5, 3, 7, 4)


def test_worked_example_of_the_live_totals():
    # kvdb/format/index_value.py: segment 1 holds 3 live blocks of 4,149 record bytes; the
    # index's Mapplied says lsn 5. Damaged values are CorruptionError, never numbers.
    buf = (GOLDEN / "index_segment_live.bin").read_bytes()
    assert buf[:5] == b"L\x01\x00\x00\x00" and buf[5:].hex(" ") == "9f 30 00 00 00 00 00 00 03 00 00 00 00 00 00 00"
    assert iv.decode_live_key(buf[1:5]) == 1 and iv.decode_segment_live(buf[5:]) == (12447, 3)
    applied = (GOLDEN / "index_applied.bin").read_bytes()
    assert applied[:8] == b"Mapplied" and iv.decode_lsn(applied[8:]) == 5
    for bad in (buf[5:-1], buf[5:] + b"\x00", b""):
        with pytest.raises(CorruptionError):
            iv.decode_segment_live(bad)
    with pytest.raises(CorruptionError):
        iv.decode_live_key(b"\x01\x00\x00")
    with pytest.raises(CorruptionError):
        iv.decode_lsn(b"\x05")


def test_golden_segment_scans_to_its_records():
    buf = (GOLDEN / "segment_example.log").read_bytes()
    scan = scan_buffer(buf, 1)
    assert scan.ending == "clean" and scan.damage == []
    assert [r.lsn for r in scan.records] == [5, 6, 7, 8, 9, 10]
    assert [fr.describe(r)["type"] for r in scan.records] == ["PUT_BLOCK", "DELETE", "SESSION", "TTL", "LEASE", "CHECKPOINT"]
    assert fr.decode_delete(scan.records[1].body) == [KEY_A, KEY_B]
    assert fr.decode_meta(scan.records[2].body) == (b"agent-1", b'{"round":3}')
    assert fr.decode_checkpoint(scan.records[5].body) == 9


def test_segment_header_worked_example_and_version_1():
    # Scenario: the version 2 header of kvdb/format/record.py's docstring, field by field, and the
    # version 1 golden files (segments written before store ids) still decode and scan: their
    # records start at byte 32 and they carry no store id.
    h = (GOLDEN / "segment_header.bin").read_bytes()
    assert len(h) == 48 and h[8:10] == b"\x02\x00" and h[24:40] == STORE_ID
    assert fr.decode_segment_header(h) == fr.SegmentHeader(1, 5, 2, STORE_ID)
    assert fr.decode_segment_header(h).header_bytes == 48
    old = (GOLDEN / "segment_header_v1.bin").read_bytes()
    assert len(old) == 32
    assert fr.decode_segment_header(old) == fr.SegmentHeader(1, 5, 1, fr.NO_STORE_ID)
    assert fr.decode_segment_header(old).header_bytes == 32
    scan = scan_buffer((GOLDEN / "segment_example_v1.log").read_bytes(), 1)
    assert scan.ending == "clean" and scan.damage == []
    assert [r.lsn for r in scan.records] == [5, 6, 7, 8, 9, 10]
    assert scan.records[0].offset == 32


def test_segment_header_rejects_damage():
    h = bytearray(fr.encode_segment_header(3, 77, STORE_ID))
    assert fr.decode_segment_header(bytes(h)) == fr.SegmentHeader(3, 77, 2, STORE_ID)
    for i in (0, 9, 12, 20, 30, 41, 45):
        bad = bytearray(h)
        bad[i] ^= 0x10
        with pytest.raises(CorruptionError):
            fr.decode_segment_header(bytes(bad))


def test_crc_covers_type_and_lsn():
    # R3: the same body at another lsn or type has another crc
    body = fr.encode_checkpoint(1)
    a = fr.encode_record(fr.RecordType.CHECKPOINT, 1, body)
    b = fr.encode_record(fr.RecordType.CHECKPOINT, 2, body)
    assert a[4:8] != b[4:8]
    bad = bytearray(a)
    bad[8] = fr.RecordType.SESSION
    assert fr.check_record(bytes(bad), 0) == ("bad", None)


def test_bad_bodies_are_corruption():
    with pytest.raises(CorruptionError):
        fr.decode_delete(struct.pack("<I", 2) + KEY_A)
    with pytest.raises(CorruptionError):
        fr.decode_put(b"short")
    with pytest.raises(CorruptionError):
        iv.decode_entry(b"\x00" * 47)
    good = (GOLDEN / "index_entry.bin").read_bytes()
    with pytest.raises(CorruptionError):  # a batch with one short value (the joined length is right)
        iv.decode_entries([good, good[:-1], good + b"\x00"])
    with pytest.raises(CorruptionError):
        iv.decode_stats(b"not json")


def test_a_batch_of_entries_decodes_as_each_one_alone():
    # decode_entries (one unpack over the joined values) against decode_entry per value, with
    # absent keys (None) anywhere, every field at its extremes.
    es = [iv.BlockEntry(2**32 - 1, 2**64 - 1, 57, 2**32 - 1, 2**64 - 1, -(2**63), 7, 255, 255, 2**32 - 1),
          iv.BlockEntry(1, 32, 57, 0x11223344, 5, 3, 7, 0, 1, 4)]
    vals = [None, iv.encode_entry(es[0]), None, iv.encode_entry(es[1]), None]
    got = iv.decode_entries(vals)
    assert got == [None if v is None else iv.decode_entry(v) for v in vals] == [None, es[0], None, es[1], None]
    assert all(type(e) is iv.BlockEntry for e in got if e is not None)
    assert iv.decode_entries(vals[1:2] + vals[3:4]) == es and iv.decode_entries([None]) == [None]
    # one value (a one-block read's lookup) takes its own path: the same entry, the same error
    assert iv.decode_entries(vals[3:4]) == [es[1]] and type(iv.decode_entries(vals[1:2])[0]) is iv.BlockEntry
    with pytest.raises(CorruptionError):
        iv.decode_entries([vals[1][:-1]])


def test_a_batch_of_entries_carries_the_same_entries_as_arrays():
    # A batch read takes the entries' fields as arrays (kvdb/cold/read.py read_runs): the
    # Entries' table holds exactly the decoded entries, zeros and present False where absent,
    # and entry_table makes the same arrays from plain lists (a slice of an Entries is one).
    es = [iv.BlockEntry(2**32 - 1, 2**64 - 1, 57, 2**32 - 1, 2**64 - 1, -(2**63), 7, 255, 255, 2**32 - 1),
          iv.BlockEntry(1, 32, 57, 0x11223344, 5, 3, 7, 0, 1, 4)]
    for vals in ([None, iv.encode_entry(es[0]), None, iv.encode_entry(es[1]), None],
                 [iv.encode_entry(es[1]), iv.encode_entry(es[0])]):
        got = iv.decode_entries(vals)
        assert isinstance(got, iv.Entries) and type(got[:2]) is list
        for entries in (got, list(got), got[:]):
            table, present = iv.entry_table(entries)
            assert present.tolist() == [v is not None for v in vals]
            for row, e in zip(table, got):
                fields = (row[f].item() for f in iv.ENTRY_DTYPE.names if f != "reserved")
                assert tuple(fields) == (e if e is not None else (0,) * len(iv.BlockEntry._fields))
    assert iv.entry_table([None, None])[1].tolist() == [False, False]
    # read-only: a changed entry would leave the arrays naming the old record
    for change in (lambda g: g.__setitem__(0, es[0]), lambda g: g.append(None), lambda g: g.sort(),
                   lambda g: g.__delitem__(0), lambda g: g.extend([None]), lambda g: g.__iadd__([None])):
        with pytest.raises(TypeError):
            change(got)
    assert got == [es[1], es[0]] and type(got.copy()) is list


record_bodies = st.lists(
    st.tuples(st.sampled_from(list(fr.RecordType)), st.binary(max_size=300)), min_size=0, max_size=12)


def encode_log(items, first_lsn=1) -> tuple[bytes, list[tuple[int, int, bytes]]]:
    out = bytearray(fr.encode_segment_header(1, first_lsn))
    recs = []
    for i, (t, body) in enumerate(items):
        out += fr.encode_record(t, first_lsn + i, body)
        recs.append((int(t), first_lsn + i, body))
    return bytes(out), recs


@given(record_bodies, st.integers(min_value=1, max_value=2**40))
def test_encode_decode_round_trip(items, first_lsn):
    buf, recs = encode_log(items, first_lsn)
    scan = scan_buffer(buf, 1)
    assert scan.ending == "clean" and scan.damage == [] and scan.end == len(buf)
    assert [(r.rtype, r.lsn, bytes(r.body)) for r in scan.records] == recs


@given(record_bodies, st.data())
def test_any_truncation_decodes_to_a_prefix(items, data):
    buf, recs = encode_log(items)
    cut = data.draw(st.integers(min_value=fr.SEGMENT_HEADER_BYTES, max_value=len(buf)))
    scan = scan_buffer(buf[:cut], 1)
    got = [(r.rtype, r.lsn, bytes(r.body)) for r in scan.records]
    assert got == recs[: len(got)]
    assert scan.damage == []
    # everything that fits whole before the cut is decoded; the rest is a torn tail
    whole = 0
    off = fr.SEGMENT_HEADER_BYTES
    for _t, _l, body in recs:
        off += fr.RECORD_HEADER_BYTES + len(body)
        if off <= cut:
            whole += 1
    assert len(got) == whole
    assert scan.ending == ("clean" if scan.end == cut else "torn")


@given(record_bodies.filter(lambda xs: len(xs) >= 1), st.data())
def test_a_flipped_bit_is_never_decoded_as_a_record(items, data):
    buf, recs = encode_log(items)
    pos = data.draw(st.integers(min_value=fr.SEGMENT_HEADER_BYTES, max_value=len(buf) - 1))
    bit = data.draw(st.integers(min_value=0, max_value=7))
    bad = bytearray(buf)
    bad[pos] ^= 1 << bit
    scan = scan_buffer(bytes(bad), 1)
    got = [(r.rtype, r.lsn, bytes(r.body)) for r in scan.records]
    assert all(g in recs for g in got)
    assert len(got) < len(recs)
    assert scan.damage or scan.ending == "torn"
