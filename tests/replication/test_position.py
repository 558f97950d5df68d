"""The follower's position file (kvdb/format/position.py): the worked example, alternating
slots, a torn slot falling back to the other, the older text layout."""

from __future__ import annotations

import struct

import pytest

from kvdb import native
from kvdb.errors import CorruptionError
from kvdb.format.position import SLOT_BYTES, Position, decode, encode_file, encode_slot


def test_worked_example():
    slot = encode_slot(Position(3, 42, "cafe"))
    body = struct.pack("<QQH", 3, 42, 4) + b"cafe"
    assert slot == (b"KVPS" + struct.pack("<I", native.crc32c(body)) + body).ljust(SLOT_BYTES, b"\0")
    whole = encode_file(Position(3, 42, "cafe"))
    assert whole[:SLOT_BYTES] == bytes(SLOT_BYTES) and whole[SLOT_BYTES:] == slot  # seq 3: slot 1


def test_newest_intact_slot_wins_and_a_torn_one_falls_back():
    # Scenario: seq 1 (slot 1, lsn 10) then seq 2 (slot 0, lsn 20) were written; the next write
    # (seq 3, slot 1) is torn after 20 bytes: the file still reads lsn 20. With slot 0 damaged
    # too, nothing is left to resume from: CorruptionError.
    f = bytearray(encode_file(Position(1, 10, "a")))
    f[:SLOT_BYTES] = encode_slot(Position(2, 20, "a"))
    assert decode(bytes(f)) == Position(2, 20, "a")
    f[SLOT_BYTES:] = encode_slot(Position(3, 30, "a"))[:20] + bytes(SLOT_BYTES - 20)
    assert decode(bytes(f)) == Position(2, 20, "a")
    f[SLOT_BYTES:] = encode_slot(Position(3, 30, "a"))  # completed
    assert decode(bytes(f)) == Position(3, 30, "a")
    f[5] ^= 0xFF  # slot 0's crc: slot 1 alone
    assert decode(bytes(f)) == Position(3, 30, "a")
    f[SLOT_BYTES + 5] ^= 0xFF
    with pytest.raises(CorruptionError, match="no intact slot"):
        decode(bytes(f))


def test_older_text_layout():
    assert decode(b"17 beef") == Position(0, 17, "beef")
    assert decode(b"5 -") == Position(0, 5, None)
    with pytest.raises(CorruptionError, match="damaged"):
        decode(b"5x")
