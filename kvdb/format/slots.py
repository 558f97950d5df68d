"""A log-shipping leader's state files, in ``PATH/replication/``. Encoded and decoded only here;
read and written by kvdb/replication/slots.py (through kvdb/fs.py ``write_file_atomic``: each
file is replaced whole, never edited in place).

``log_id`` (LOG_ID_NAME): the identity of this leader's log, created once
    ASCII, 16 lowercase hex digits (8 random bytes), no newline; readers strip surrounding
    whitespace. Followers store it with their position (kvdb/format/position.py) so that lsns
    of two different logs are never compared (shipping.py S5). Example: ``9f3a61c02be4d778``.

``slots.json`` (SLOTS_NAME): the replication slots, each follower's confirmed lsn (shipping.py S4)
    UTF-8 JSON, one object: follower address (``host:port``) -> the highest lsn that follower
    confirmed durable, an integer >= 0; keys sorted. Example::

        {"10.0.0.7:7070": 1843, "10.0.0.8:7070": 1790}

    The lowest value is the leader's retention floor: compaction keeps every record above it.
    An absent file means no slots (no floor). A file that is not such an object (or holds a
    value that is not an integer) is damaged: CorruptionError (deleting it drops the floor;
    followers left behind are then re-seeded).
"""

from __future__ import annotations

import json

from kvdb.errors import CorruptionError

LOG_ID_NAME = "log_id"
SLOTS_NAME = "slots.json"
LOG_ID_BYTES = 8  # random bytes in a log id (16 hex digits)


def encode_log_id(log_id: str) -> bytes:
    return log_id.encode("ascii")


def decode_log_id(raw: bytes) -> str:
    return raw.decode("utf-8").strip()


def encode_slots(slots: dict[str, int]) -> bytes:
    return json.dumps({str(k): int(v) for k, v in slots.items()}, sort_keys=True).encode()


def decode_slots(raw: bytes, where: str = SLOTS_NAME) -> dict[str, int]:
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            raise ValueError(f"a JSON {type(obj).__name__}, not an object")
        slots = {str(k): int(v) for k, v in obj.items()}
    except (ValueError, TypeError) as e:
        raise CorruptionError(f"replication slots file {where} is damaged ({e}); delete it to re-seed followers") from None
    return slots
