"""Log segment and log record layouts (docs/durability.md). Encoded and decoded only here.

All integers are little-endian. A log is a directory of segment files ``00000001.log``,
``00000002.log``, ... (segment numbers increase by one; compaction may delete old ones).

Segment header (48 bytes, at offset 0 of every segment; version 2)
==================================================================

    off  size  field
      0     8  magic        b"KVDBLOG\x00"
      8     2  version      u16, 2 (SEGMENT_VERSION)
     10     2  flags        u16, reserved, 0
     12     4  segment_no   u32, equals the number in the file name
     16     8  first_lsn    u64, lsn of the first record the writer put in this segment
     24    16  store_id     the store's id (MANIFEST.json ``store_id``, kvdb/format/manifest.py);
                            16 zero bytes: a store without one (legacy, or a log opened on its own)
     40     4  reserved     u32, 0
     44     4  crc32c       u32 over bytes 0..44

Version 1 (32 bytes, segments written before store ids; read, never written): magic 8 |
version u16 = 1 | flags u16 | segment_no u32 | first_lsn u64 | reserved u32 | crc32c u32 over
bytes 0..28. Its records start at byte 32 and it carries no store id (decoded as zeros). Every
reader takes a segment's first record offset from its header (``SegmentHeader.header_bytes``).

Worked example: segment 1, first lsn 5, store id a0 a1 .. af (tests/golden/segment_header.bin):

    4b 56 44 42 4c 4f 47 00 | 02 00 | 00 00 | 01 00 00 00 | 05 00 00 00 00 00 00 00 |
    a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 aa ab ac ad ae af | 00 00 00 00 | crc32c of the 44 bytes before

Record (17-byte header + body), records follow each other with no padding
=========================================================================

    off  size  field
      0     4  length   u32, number of body bytes (the record is 17 + length bytes)
      4     4  crc32c   u32 over bytes 8 .. 17+length (type, lsn and body)
      8     1  type     u8, RecordType (stable values, never renumbered)
      9     8  lsn      u64, strictly increasing by exactly 1 from record to record
     17     *  body

Invariants
    R1  lsn(record i+1) == lsn(record i) + 1 within a log, across segments too.
    R2  a record is visible only when its whole length is present and its crc matches;
        a reader stops at the first record that fails (a torn tail) unless a later record
        with the next lsns follows it (then the bad record is mid-log damage: skipped and
        counted, never returned). See ``kvdb.wal.reader``.
    R3  the crc covers type and lsn as well as the body, so a record copied to another lsn
        must be re-encoded (compaction does: ``encode_header`` over the same body bytes).

Bodies
    PUT_BLOCK (1), fixed part 36 bytes then the payload:
        0  key 16 bytes | 16 namespace_id u32 | 20 position i64 (-1 = none) | 28 codec u8 |
        29 flags u8 (bit 0: payload is AES-256-GCM sealed) | 30 reserved u16 |
        32 raw_bytes u32 (page bytes after decoding) | 36 payload (length - 36 bytes)
    DELETE (2): count u32 | count keys of 16 bytes
    SESSION (3), TTL (4), LEASE (5) metadata: name_len u16 | name | value (the rest);
        an empty value removes the entry. TTL values are expires_at_unix_ns u64.
    CHECKPOINT (6): applied_lsn u64 (every record with lsn <= applied_lsn is in the index)

Worked example: PUT_BLOCK of a 4-byte raw page b"\\x01\\x02\\x03\\x04", key 00..0f,
namespace 7, position 3, lsn 5 (57 bytes; tests/golden/record_put.bin holds exactly these):

    28 00 00 00   length = 40 (36 fixed body bytes + 4 payload bytes)
    94 04 b1 4d   crc32c of the 49 bytes from offset 8 on (0x4db10494)
    01            type PUT_BLOCK
    05 00 00 00 00 00 00 00   lsn 5
    00 01 02 ... 0f           key
    07 00 00 00               namespace_id 7
    03 00 00 00 00 00 00 00   position 3
    00 00 00 00               codec raw, flags 0, reserved 0
    04 00 00 00               raw_bytes 4
    01 02 03 04               payload
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kvdb import native
from kvdb.errors import CorruptionError, InvalidInput
from kvdb.types import KEY_BYTES

SEGMENT_MAGIC = b"KVDBLOG\x00"
SEGMENT_VERSION = 2
SEGMENT_HEADER = struct.Struct("<8sHHIQ16sI")  # + crc u32
SEGMENT_HEADER_BYTES = 48  # what the writer writes (version 2); MAX_ as well
SEGMENT_HEADER_V1 = struct.Struct("<8sHHIQI")  # + crc u32
SEGMENT_HEADER_V1_BYTES = 32
NO_STORE_ID = bytes(16)

RECORD_HEADER = struct.Struct("<IIBQ")
RECORD_HEADER_BYTES = 17
#: no record is longer than this; a larger length field is damage, not a record
MAX_BODY_BYTES = 1 << 31

PUT_FIXED = struct.Struct("<16sIqBBHI")
PUT_FIXED_BYTES = 36
PUT_PAYLOAD_OFFSET = RECORD_HEADER_BYTES + PUT_FIXED_BYTES  # 53
NO_POSITION = -1

FLAG_SEALED = 0x01


class RecordType(enum.IntEnum):
    PUT_BLOCK = 1
    DELETE = 2
    SESSION = 3
    TTL = 4
    LEASE = 5
    CHECKPOINT = 6


META_TYPES = (RecordType.SESSION, RecordType.TTL, RecordType.LEASE)


class Codec(enum.IntEnum):
    """Payload codecs (stable values)."""

    RAW = 0
    ZSTD_PLANES = 1  # zstd level 1 over byte planes (kvdb.cold.codec)


CODEC_NAMES = {"raw": Codec.RAW, "zstd": Codec.ZSTD_PLANES}


# ---------------------------------------------------------------- segment header


@dataclass(frozen=True)
class SegmentHeader:
    segment_no: int
    first_lsn: int
    version: int = SEGMENT_VERSION
    store_id: bytes = NO_STORE_ID

    @property
    def header_bytes(self) -> int:
        """Where the segment's first record starts."""
        return SEGMENT_HEADER_V1_BYTES if self.version == 1 else SEGMENT_HEADER_BYTES


def segment_name(segment_no: int) -> str:
    return f"{segment_no:08d}.log"


def parse_segment_name(name: str) -> int | None:
    if len(name) == 12 and name.endswith(".log") and name[:8].isdigit():
        return int(name[:8])
    return None


def encode_segment_header(segment_no: int, first_lsn: int, store_id: bytes | None = None) -> bytes:
    sid = NO_STORE_ID if store_id is None else store_id
    if len(sid) != len(NO_STORE_ID):
        raise InvalidInput(f"a store id is {len(NO_STORE_ID)} bytes, got {len(sid)}")
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, segment_no, first_lsn, sid, 0)
    return head + struct.pack("<I", native.crc32c(head))


def guess_header_bytes(buf) -> int:
    """Where records start in a segment whose header may be damaged: after a version 1 header
    when its version field still says 1, else after a version 2 one."""
    return SEGMENT_HEADER_V1_BYTES if bytes(buf[8:10]) == b"\x01\x00" else SEGMENT_HEADER_BYTES


def decode_segment_header(buf: bytes) -> SegmentHeader:
    """Raises CorruptionError when ``buf`` does not start with an intact segment header (of
    either version; ``buf`` may run on past it)."""
    if len(buf) < SEGMENT_HEADER_V1_BYTES:
        raise CorruptionError(f"segment header is {len(buf)} bytes, expected {SEGMENT_HEADER_BYTES}")
    (version,) = struct.unpack_from("<H", buf, 8)
    if version == 1:
        size, layout = SEGMENT_HEADER_V1_BYTES, SEGMENT_HEADER_V1
    else:
        size, layout = SEGMENT_HEADER_BYTES, SEGMENT_HEADER
        if len(buf) < size:
            raise CorruptionError(f"segment header is {len(buf)} bytes, expected {size}")
    head = bytes(buf[: size - 4])
    (crc,) = struct.unpack_from("<I", buf, size - 4)
    if native.crc32c(head) != crc:
        raise CorruptionError("segment header checksum mismatch")
    fields = layout.unpack(head)
    magic, segment_no, first_lsn = fields[0], fields[3], fields[4]
    if magic != SEGMENT_MAGIC:
        raise CorruptionError(f"bad segment magic {magic!r}")
    if version not in (1, SEGMENT_VERSION):
        raise CorruptionError(f"segment format version {version} is not supported (expected {SEGMENT_VERSION} or 1)")
    return SegmentHeader(segment_no, first_lsn, version, fields[5] if version == 2 else NO_STORE_ID)


# ---------------------------------------------------------------- record header


def buffer_bytes(p) -> int:
    """Byte length of a bytes-like or numpy buffer (cheaper than memoryview(p).nbytes)."""
    n = getattr(p, "nbytes", None)
    return len(p) if n is None else n


def encode_header(rtype: int, lsn: int, body_parts: list, length: int | None = None) -> bytes:
    """The 17 header bytes for a body given as buffers (bytes, memoryview, numpy rows).

    The crc is computed over the buffers in place: no copy of a page is made here."""
    if length is None:
        length = sum(buffer_bytes(p) for p in body_parts)
    if length >= MAX_BODY_BYTES:
        raise InvalidInput(f"record body of {length} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    tl = struct.pack("<BQ", rtype, lsn)
    crc = native.crc32c(tl)
    for p in body_parts:
        crc = native.crc32c(p, crc)
    return struct.pack("<II", length, crc) + tl


#: the 53 leading bytes of a PUT_BLOCK record (header + fixed body part) as a numpy record, for
#: batches built all at once (``put_rows``); the same bytes as encode_header + encode_put_fixed
PUT_HEAD_DTYPE = np.dtype([("length", "<u4"), ("crc", "<u4"), ("type", "u1"), ("lsn", "<u8"), ("key", "V16"),
                           ("namespace_id", "<u4"), ("position", "<i8"), ("codec", "u1"), ("flags", "u1"),
                           ("reserved", "<u2"), ("raw_bytes", "<u4")], align=False)


def put_rows(keys_blob: bytes, positions: np.ndarray, namespace_id: int, codec: int, flags: int,
             raw_bytes: int, payloads: np.ndarray | None = None, payload_bytes: int | None = None) -> np.ndarray:
    """PUT_BLOCK records of one batch as rows of a uint8 array, lsn and crc still 0 (``seal_rows``
    fills them once the lsns are known). ``keys_blob``: the n 16-byte keys back to back;
    ``positions``: int64 [n] (-1: none). With ``payloads`` (uint8 [n, m]) each row is the whole
    record (53 + m bytes, the payload copied in); without, each row is its 53 leading bytes and
    ``payload_bytes`` says how long the payload written after it is."""
    n = len(positions)
    if len(keys_blob) != n * KEY_BYTES:
        raise InvalidInput(f"{len(keys_blob)} key bytes for {n} blocks of {KEY_BYTES}-byte keys")
    m = payloads.shape[1] if payloads is not None else int(payload_bytes or 0)
    if PUT_FIXED_BYTES + m >= MAX_BODY_BYTES:
        raise InvalidInput(f"record body of {PUT_FIXED_BYTES + m} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    head = np.empty(n, dtype=PUT_HEAD_DTYPE)
    head["length"] = PUT_FIXED_BYTES + m
    head["crc"] = 0
    head["type"] = RecordType.PUT_BLOCK
    head["lsn"] = 0
    head["key"] = np.frombuffer(keys_blob, dtype="V16")
    head["namespace_id"] = namespace_id
    head["position"] = positions
    head["codec"] = codec
    head["flags"] = flags
    head["reserved"] = 0
    head["raw_bytes"] = raw_bytes
    if payloads is None:
        return head.view(np.uint8).reshape(n, PUT_PAYLOAD_OFFSET)
    rows = np.empty((n, PUT_PAYLOAD_OFFSET + m), dtype=np.uint8)
    rows[:, :PUT_PAYLOAD_OFFSET] = head.view(np.uint8).reshape(n, PUT_PAYLOAD_OFFSET)
    rows[:, PUT_PAYLOAD_OFFSET:] = payloads
    return rows


def seal_rows(rows: np.ndarray, first_lsn: int, payloads: np.ndarray | None = None) -> np.ndarray:
    """Give the records of ``put_rows`` the lsns first_lsn, first_lsn + 1, ... and their crcs
    (over type, lsn and body, payload rows included when they follow separately); returns the
    crcs (uint32 [n])."""
    n = rows.shape[0]
    lsn = np.arange(first_lsn, first_lsn + n, dtype="<u8")
    rows[:, 9:17] = lsn.view(np.uint8).reshape(n, 8)
    crcs = native.crc32c_rows(rows, 8, rows.shape[1] - 8, then=payloads)
    rows[:, 4:8] = crcs.view(np.uint8).reshape(n, 4)
    return crcs


@dataclass(frozen=True)
class Record:
    rtype: int
    lsn: int
    body: bytes | memoryview
    offset: int  # byte offset of the record header in its segment
    crc: int

    @property
    def record_bytes(self) -> int:
        return RECORD_HEADER_BYTES + len(self.body)


def encode_record(rtype: int, lsn: int, body: bytes) -> bytes:
    return encode_header(rtype, lsn, [body]) + body


def check_record(buf, offset: int) -> tuple[str, Record | None]:
    """Decode the record at ``buf[offset:]``.

    Returns ("ok", record), ("short", None) when the bytes end before the record does, or
    ("bad", None) when the length is impossible or the crc does not match."""
    end = len(buf)
    if offset + RECORD_HEADER_BYTES > end:
        return "short", None
    length, crc, rtype, lsn = RECORD_HEADER.unpack_from(buf, offset)
    if length >= MAX_BODY_BYTES:
        return "bad", None
    if offset + RECORD_HEADER_BYTES + length > end:
        return "short", None
    mv = memoryview(buf)[offset + 8 : offset + RECORD_HEADER_BYTES + length]
    if native.crc32c(mv) != crc:
        return "bad", None
    body = memoryview(buf)[offset + RECORD_HEADER_BYTES : offset + RECORD_HEADER_BYTES + length]
    return "ok", Record(rtype, lsn, body, offset, crc)


def decode_records(buf, offset: int = 0) -> Iterator[Record]:
    """Every intact record from ``offset`` on, stopping at the first that fails (R2, strict form)."""
    while True:
        status, rec = check_record(buf, offset)
        if status != "ok":
            return
        yield rec
        offset += rec.record_bytes


# ---------------------------------------------------------------- bodies


@dataclass(frozen=True)
class PutBlock:
    key: bytes
    namespace_id: int
    position: int
    codec: int
    flags: int
    raw_bytes: int
    payload: bytes | memoryview


def encode_put_fixed(key: bytes, namespace_id: int, position: int | None, codec: int, flags: int, raw_bytes: int) -> bytes:
    if len(key) != KEY_BYTES:
        raise InvalidInput(f"block keys are {KEY_BYTES} bytes, got {len(key)}")
    pos = NO_POSITION if position is None else position
    return PUT_FIXED.pack(key, namespace_id, pos, codec, flags, 0, raw_bytes)


def decode_put(body) -> PutBlock:
    if len(body) < PUT_FIXED_BYTES:
        raise CorruptionError(f"PUT_BLOCK body of {len(body)} bytes is shorter than {PUT_FIXED_BYTES}")
    key, ns, pos, codec, flags, _, raw_bytes = PUT_FIXED.unpack_from(body, 0)
    return PutBlock(key, ns, pos, codec, flags, raw_bytes, memoryview(body)[PUT_FIXED_BYTES:])


def encode_delete(keys: list[bytes]) -> bytes:
    for k in keys:
        if len(k) != KEY_BYTES:
            raise InvalidInput(f"block keys are {KEY_BYTES} bytes, got {len(k)}")
    return struct.pack("<I", len(keys)) + b"".join(keys)


def decode_delete(body) -> list[bytes]:
    if len(body) < 4:
        raise CorruptionError("DELETE body shorter than its count")
    (n,) = struct.unpack_from("<I", body, 0)
    if len(body) != 4 + n * KEY_BYTES:
        raise CorruptionError(f"DELETE body of {len(body)} bytes does not hold {n} keys")
    raw = bytes(body[4:])
    return [raw[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(n)]


def encode_meta(name: bytes, value: bytes) -> bytes:
    if len(name) > 0xFFFF:
        raise InvalidInput(f"metadata name of {len(name)} bytes exceeds 65535")
    return struct.pack("<H", len(name)) + name + value


def decode_meta(body) -> tuple[bytes, bytes]:
    if len(body) < 2:
        raise CorruptionError("metadata body shorter than its name length")
    (n,) = struct.unpack_from("<H", body, 0)
    if len(body) < 2 + n:
        raise CorruptionError("metadata name runs past the body")
    return bytes(body[2 : 2 + n]), bytes(body[2 + n :])


def encode_checkpoint(applied_lsn: int) -> bytes:
    return struct.pack("<Q", applied_lsn)


def decode_checkpoint(body) -> int:
    if len(body) != 8:
        raise CorruptionError(f"CHECKPOINT body is {len(body)} bytes, expected 8")
    return struct.unpack("<Q", body)[0]


def describe(rec: Record) -> dict:
    """A JSON-ready view of one record (``kvdb wal dump``)."""
    out: dict = {"offset": rec.offset, "lsn": rec.lsn, "record_bytes": rec.record_bytes}
    try:
        rtype = RecordType(rec.rtype)
        out["type"] = rtype.name
    except ValueError:
        out["type"] = f"UNKNOWN({rec.rtype})"
        return out
    if rtype == RecordType.PUT_BLOCK:
        p = decode_put(rec.body)
        out.update(key=p.key.hex(), namespace_id=p.namespace_id, position=p.position,
                   codec=Codec(p.codec).name.lower() if p.codec in Codec._value2member_map_ else p.codec,
                   sealed=bool(p.flags & FLAG_SEALED), raw_bytes=p.raw_bytes, payload_bytes=len(p.payload))
    elif rtype == RecordType.DELETE:
        out["keys"] = [k.hex() for k in decode_delete(rec.body)]
    elif rtype in META_TYPES:
        name, value = decode_meta(rec.body)
        out.update(name=name.hex(), value_bytes=len(value))
    elif rtype == RecordType.CHECKPOINT:
        out["applied_lsn"] = decode_checkpoint(rec.body)
    return out
