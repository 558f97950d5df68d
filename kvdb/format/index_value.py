"""Keys and values of the cold tier's RocksDB index (PATH/index/). Encoded and decoded only here.

The index is a cache of the log (docs/durability.md): the log is the source of truth, the
index holds where each live block's record is, plus a little store-wide metadata. RocksDB runs
in raw mode (bytes keys and values) with its own WAL off. All integers little-endian.

Index keys (the first byte says the kind)
    b"B" + block key (16 bytes)          -> BlockEntry (48 bytes, below)
    b"M" + name (ASCII)                  -> store metadata:
        b"Mcheckpoint"   Checkpoint (20 bytes, below)
        b"Mstats"        JSON object of counters (hits, misses, corruptions, evictions, ...)
        b"Mseal"         AES-GCM key check: nonce 12 | sealed b"kvdb-key-check" (+16 tag)
        b"Mstore"        the store id (16 bytes, MANIFEST.json ``store_id``): written when the
                         index is made (or rebuilt from the log); an index whose id is not the
                         manifest's belongs to another store (kvdb/cold/recovery.py)
        b"Mapplied"      u64: the lsn of the last record whose index writes this index holds;
                         written in the same RocksDB batch as those writes, so the index is
                         always the log's state at exactly this lsn (kvdb/cold/apply.py C7)
    b"L" + segment_no (u32)              -> SegmentLive (16 bytes, below): the segment's live
                                            blocks, kept in the batch of every index write
                                            that changes them (no key: nothing live there)
    b"m" + record type u8 + name         -> value of a SESSION / TTL / LEASE metadata record

BlockEntry (48 bytes)
    off  size  field
      0     4  segment_no     u32
      4     8  offset         u64, of the record header in the segment
     12     4  record_bytes   u32, header + body
     16     4  crc32c         u32, the record's crc (its header bytes 4..8)
     20     8  lsn            u64
     28     8  position       i64, -1 = none
     36     4  namespace_id   u32
     40     1  codec          u8 (kvdb.format.record.Codec)
     41     1  flags          u8 (bit 0: sealed)
     42     2  reserved       u16, 0
     44     4  raw_bytes      u32, decoded page bytes

SegmentLive (16 bytes)
      0     8  live_bytes     u64, record bytes of the live blocks whose newest record is there
      8     8  live_blocks    u64

Checkpoint (20 bytes)
      0     4  segment_no     u32  \\ replay of the log starts at this record boundary
      4     8  offset         u64  /
     12     8  applied_lsn    u64, every record with lsn <= applied_lsn is reflected here

Worked example: the PUT_BLOCK of kvdb/format/record.py's example stored at segment 1, offset
32 (just after a version 1 segment header), with crc 0x11223344 encodes to
(tests/golden/index_entry.bin):

    01 00 00 00 | 20 00 00 00 00 00 00 00 | 39 00 00 00 | 44 33 22 11 |
    05 00 00 00 00 00 00 00 | 03 00 00 00 00 00 00 00 | 07 00 00 00 | 00 | 00 | 00 00 |
    04 00 00 00

and a segment holding 3 live blocks of 4,149 record bytes each (tests/golden/segment_live.bin):

    9f 30 00 00 00 00 00 00 | 03 00 00 00 00 00 00 00
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import numpy as np

from kvdb.errors import CorruptionError

BLOCK_PREFIX = b"B"
META_PREFIX = b"M"
RECORD_META_PREFIX = b"m"

CHECKPOINT_KEY = b"Mcheckpoint"
STATS_KEY = b"Mstats"
SEAL_KEY = b"Mseal"
STORE_KEY = b"Mstore"
APPLIED_KEY = b"Mapplied"
LIVE_PREFIX = b"L"

_ENTRY = struct.Struct("<IQIIQqIBBHI")
_ENTRY_FIELDS = struct.Struct("<IQIIQqIBB2xI")  # the same bytes, the reserved field skipped
ENTRY_BYTES = 48
_CHECKPOINT = struct.Struct("<IQQ")
_LOCATION = struct.Struct("<IQI")  # the first 16 bytes of an entry: segment_no, offset, record_bytes
_SEGMENT_LIVE = struct.Struct("<QQ")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_new_tuple = tuple.__new__


class BlockEntry(NamedTuple):
    """A decoded entry (a tuple: decoded on every read, 0.5 us against 2.4 for a frozen dataclass)."""

    segment_no: int
    offset: int
    record_bytes: int
    crc: int
    lsn: int
    position: int
    namespace_id: int
    codec: int
    flags: int
    raw_bytes: int


def block_key(key: bytes) -> bytes:
    return BLOCK_PREFIX + key


def encode_entry(e: BlockEntry) -> bytes:
    return _ENTRY.pack(e.segment_no, e.offset, e.record_bytes, e.crc, e.lsn, e.position,
                       e.namespace_id, e.codec, e.flags, 0, e.raw_bytes)


#: BlockEntry's 48 bytes as a numpy record (``encode_entries``: a batch at once)
ENTRY_DTYPE = np.dtype([("segment_no", "<u4"), ("offset", "<u8"), ("record_bytes", "<u4"), ("crc", "<u4"),
                        ("lsn", "<u8"), ("position", "<i8"), ("namespace_id", "<u4"), ("codec", "u1"),
                        ("flags", "u1"), ("reserved", "<u2"), ("raw_bytes", "<u4")])


def encode_entries(segment_nos, offsets, record_bytes: int, crcs, lsns, positions, namespace_id: int, codec: int,
                   flags: int, raw_bytes: int) -> list[bytes]:
    """``encode_entry`` of a batch of records of one size, codec and namespace (numpy arrays or
    scalars per field); one bytes object per record."""
    e = np.empty(len(crcs), dtype=ENTRY_DTYPE)
    e["segment_no"] = segment_nos
    e["offset"] = offsets
    e["record_bytes"] = record_bytes
    e["crc"] = crcs
    e["lsn"] = lsns
    e["position"] = positions
    e["namespace_id"] = namespace_id
    e["codec"] = codec
    e["flags"] = flags
    e["reserved"] = 0
    e["raw_bytes"] = raw_bytes
    raw = e.tobytes()
    return [raw[i : i + ENTRY_BYTES] for i in range(0, len(raw), ENTRY_BYTES)]


def decode_entry(buf: bytes) -> BlockEntry:
    if len(buf) != ENTRY_BYTES:
        raise CorruptionError(f"index entry is {len(buf)} bytes, expected {ENTRY_BYTES}")
    seg, off, rb, crc, lsn, pos, ns, codec, flags, _, raw = _ENTRY.unpack(buf)
    return _new_tuple(BlockEntry, (seg, off, rb, crc, lsn, pos, ns, codec, flags, raw))


class Entries(list):
    """``decode_entries``' answer for a batch: a list of BlockEntry (None: not live) that also
    holds the same entries as arrays, so that a batch read takes their fields at once
    (``entry_table``; kvdb/cold/read.py ``read_runs``): ``table`` ENTRY_DTYPE [n] (zeros where
    None) and ``present`` bool [n]. Read-only, so that the arrays can never disagree with the
    list (a change raises TypeError; a slice or a copy is a plain list)."""

    __slots__ = ("table", "present")

    def _read_only(self, *args, **kwargs):
        raise TypeError("a lookup's Entries is read-only: copy it to a list to change it")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only


def decode_entries(vals: list) -> list:
    """``decode_entry`` of each encoded entry in ``vals`` (None stays None), a batch at once: one
    unpack over the joined bytes when every value is an entry's size (then an ``Entries``)."""
    if len(vals) == 1:  # a one-block read: no batch to set up
        return [None if vals[0] is None else decode_entry(vals[0])]
    good = [v for v in vals if v is not None]
    if not good:
        return list(vals)
    if set(map(len, good)) != {ENTRY_BYTES}:
        return [None if v is None else decode_entry(v) for v in vals]  # raises CorruptionError
    joined = b"".join(good)
    it = map(_new_tuple, repeat(BlockEntry), _ENTRY_FIELDS.iter_unpack(joined))
    out = Entries(it if len(good) == len(vals) else (None if v is None else next(it) for v in vals))
    if len(good) == len(vals):
        out.table, out.present = np.frombuffer(joined, dtype=ENTRY_DTYPE), np.ones(len(vals), dtype=bool)
    else:
        out.present = np.fromiter((v is not None for v in vals), dtype=bool, count=len(vals))
        out.table = np.zeros(len(vals), dtype=ENTRY_DTYPE)
        out.table[out.present] = np.frombuffer(joined, dtype=ENTRY_DTYPE)
    return out


def entry_table(entries: list) -> tuple[np.ndarray, np.ndarray]:
    """(ENTRY_DTYPE [n] array, bool [n] present) of a list of BlockEntry or None: an
    ``Entries``' own arrays, else made from the entries."""
    if isinstance(entries, Entries):
        return entries.table, entries.present
    present = np.fromiter((e is not None for e in entries), dtype=bool, count=len(entries))
    table = np.zeros(len(entries), dtype=ENTRY_DTYPE)
    if present.any():
        table[present] = np.frombuffer(b"".join(encode_entry(e) for e in entries if e is not None), dtype=ENTRY_DTYPE)
    return table, present


def entry_location(buf: bytes) -> tuple[int, int, int]:
    """(segment_no, offset, record_bytes) of an encoded entry, without decoding the rest."""
    if len(buf) != ENTRY_BYTES:
        raise CorruptionError(f"index entry is {len(buf)} bytes, expected {ENTRY_BYTES}")
    return _LOCATION.unpack_from(buf)


def live_key(segment_no: int) -> bytes:
    return LIVE_PREFIX + _U32.pack(segment_no)


def decode_live_key(suffix: bytes) -> int:
    """The segment number of an ``L`` key (its 4 bytes after the prefix)."""
    if len(suffix) != _U32.size:
        raise CorruptionError(f"index segment-live key has {len(suffix)} bytes after its prefix, expected 4")
    return _U32.unpack(suffix)[0]


def encode_segment_live(live_bytes: int, live_blocks: int) -> bytes:
    return _SEGMENT_LIVE.pack(live_bytes, live_blocks)


def decode_segment_live(buf: bytes) -> tuple[int, int]:
    if len(buf) != _SEGMENT_LIVE.size:
        raise CorruptionError(f"index segment-live value is {len(buf)} bytes, expected {_SEGMENT_LIVE.size}")
    return _SEGMENT_LIVE.unpack(buf)


def encode_lsn(lsn: int) -> bytes:
    return _U64.pack(lsn)


def decode_lsn(buf: bytes) -> int:
    if len(buf) != _U64.size:
        raise CorruptionError(f"index lsn value is {len(buf)} bytes, expected {_U64.size}")
    return _U64.unpack(buf)[0]


@dataclass(frozen=True)
class Checkpoint:
    segment_no: int
    offset: int
    applied_lsn: int


def encode_checkpoint(c: Checkpoint) -> bytes:
    return _CHECKPOINT.pack(c.segment_no, c.offset, c.applied_lsn)


def decode_checkpoint(buf: bytes) -> Checkpoint:
    if len(buf) != _CHECKPOINT.size:
        raise CorruptionError(f"index checkpoint is {len(buf)} bytes, expected {_CHECKPOINT.size}")
    return Checkpoint(*_CHECKPOINT.unpack(buf))


def record_meta_key(rtype: int, name: bytes) -> bytes:
    return RECORD_META_PREFIX + bytes([rtype]) + name


def encode_stats(counters: dict) -> bytes:
    return json.dumps(counters, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode_stats(buf: bytes) -> dict:
    try:
        d = json.loads(buf.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptionError(f"index stats record is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise CorruptionError("index stats record is not a JSON object")
    return d
