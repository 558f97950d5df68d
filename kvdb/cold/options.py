"""The disk tier's options, checked before anything is touched (kvdb/cold/store.py)."""

from __future__ import annotations

from kvdb.errors import InvalidInput
from kvdb.format.record import RecordType
from kvdb.types import DURABILITIES

METADATA_TYPES = {"session": RecordType.SESSION, "ttl": RecordType.TTL, "lease": RecordType.LEASE}


def check_space_amp(value) -> float | None:
    """``max_space_amp`` checked: a finite number > 1, or None (no automatic compaction)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 < value < float("inf"):
        raise InvalidInput(f"max_space_amp must be a finite number > 1 or None, got {value!r}")
    return float(value)


def check_durability(durability: str) -> str:
    if durability not in DURABILITIES:
        raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
    return durability


def metadata_type(kind: str) -> int:
    rtype = METADATA_TYPES.get(kind)
    if rtype is None:
        raise InvalidInput(f"metadata kind must be session, ttl or lease, got {kind!r}")
    return rtype
