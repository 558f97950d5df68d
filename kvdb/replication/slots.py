"""A log-shipping leader's state on disk: its log id and its replication slots (shipping.py S4,
S5), in the state directory (``PATH/replication/``). The bytes: kvdb/format/slots.py."""

from __future__ import annotations

import os
from pathlib import Path

from kvdb.format.slots import (
    LOG_ID_BYTES,
    LOG_ID_NAME,
    SLOTS_NAME,
    decode_log_id,
    decode_slots,
    encode_log_id,
    encode_slots,
)
from kvdb.fs import write_file_atomic


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, data)


def log_id_of(state_dir) -> str | None:
    """This leader's log identity (``log_id``, created once): followers record it with their
    position so lsns of two different logs are never mixed up. None without a state directory."""
    if state_dir is None:
        return None
    p = Path(state_dir) / LOG_ID_NAME
    try:
        return decode_log_id(p.read_bytes())
    except FileNotFoundError:
        log_id = os.urandom(LOG_ID_BYTES).hex()
        _write(p, encode_log_id(log_id))
        return log_id


def read_slots(state_dir) -> dict[str, int]:
    """Each follower's confirmed lsn; {} when there is no slots file."""
    p = Path(state_dir) / SLOTS_NAME
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return {}
    return decode_slots(raw, str(p))


def write_slots(state_dir, slots: dict[str, int]) -> None:
    _write(Path(state_dir) / SLOTS_NAME, encode_slots(slots))


def retained_lsn(state_dir) -> int | None:
    """The lowest lsn a follower has confirmed (S4): keep every record above it; None: no slots."""
    slots = read_slots(state_dir)
    return min(slots.values()) if slots else None
