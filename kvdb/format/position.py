"""A log-shipping follower's position file (``PATH/replication/applied_lsn``). Encoded and decoded
only here; written and read by kvdb/replication/sink.py.

The follower rewrites its position after every applied batch, before it acknowledges it
(shipping.py S1), so the write is on the replication lag's critical path: it is one 512-byte
``pwrite`` into one of two slots, alternately, and one ``fdatasync`` -- not a new file renamed
over the old one (that costs an fsync of the file and one of the directory). A write torn by a
crash damages only the slot being written; the other still holds the previous position, which
is safe to resume from (re-applying records is idempotent, S2).

File: 1024 bytes, slot k at offset 512 * k (all integers little-endian)::

    off  size  field
      0     4  magic     b"KVPS"
      4     4  crc32c    over bytes 8 .. 26 + id_len
      8     8  seq       u64, write counter: of the two intact slots the higher seq wins
     16     8  lsn       u64, the leader lsn applied up to (inclusive)
     24     2  id_len    u16
     26     n  log_id    ASCII, the leader log the lsns count (empty: none adopted yet)
     ...       zero padding to 512 bytes

Worked example: seq 3, lsn 42, log id "cafe" goes to slot 1 (offset 512):
``4b565053 <crc> 0300000000000000 2a00000000000000 0400 63616665`` then zeros.

Files written before this layout hold one text line ``<lsn> <log id or ->``; they are read as
seq 0 and rewritten whole in this layout at the first write. The file I/O is in sink.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvdb import native
from kvdb.errors import CorruptionError

MAGIC = b"KVPS"
SLOT_BYTES = 512
FILE_BYTES = 2 * SLOT_BYTES
_HEAD = struct.Struct("<4sIQQH")  # magic, crc, seq, lsn, id_len
MAX_ID_BYTES = SLOT_BYTES - _HEAD.size


@dataclass(frozen=True)
class Position:
    seq: int
    lsn: int
    log_id: str | None


def encode_slot(pos: Position) -> bytes:
    ident = (pos.log_id or "").encode("ascii")
    if len(ident) > MAX_ID_BYTES:
        raise ValueError(f"log id of {len(ident)} bytes exceeds {MAX_ID_BYTES}")
    body = struct.pack("<QQH", pos.seq, pos.lsn, len(ident)) + ident
    return (MAGIC + struct.pack("<I", native.crc32c(body)) + body).ljust(SLOT_BYTES, b"\0")


def decode_slot(raw: bytes) -> Position | None:
    """The slot's position, None when it is not intact (never written, or torn)."""
    if len(raw) < _HEAD.size:
        return None
    magic, crc, seq, lsn, n = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC or _HEAD.size + n > len(raw) or native.crc32c(raw[8 : _HEAD.size + n]) != crc:
        return None
    return Position(seq, lsn, raw[_HEAD.size : _HEAD.size + n].decode("ascii") or None)


def encode_file(pos: Position) -> bytes:
    """A whole new file holding ``pos`` in its slot (the other slot empty)."""
    slots = [bytes(SLOT_BYTES), bytes(SLOT_BYTES)]
    slots[pos.seq % 2] = encode_slot(pos)
    return b"".join(slots)


def decode(raw: bytes, where: str = "position file") -> Position:
    """The newest intact slot of a whole file (or a pre-slot text file); CorruptionError when
    neither slot is intact."""
    if raw[:1].isdigit():  # the older text layout
        parts = raw.decode("ascii", "replace").split()
        try:
            return Position(0, int(parts[0]), parts[1] if len(parts) > 1 and parts[1] != "-" else None)
        except (ValueError, IndexError):
            raise CorruptionError(f"{where} is damaged; delete it to re-apply the log") from None
    slots = [p for p in (decode_slot(raw[k * SLOT_BYTES : (k + 1) * SLOT_BYTES]) for k in (0, 1)) if p]
    if not slots:
        raise CorruptionError(f"{where} has no intact slot; delete it to re-apply the log (or re-seed)")
    return max(slots, key=lambda p: p.seq)
