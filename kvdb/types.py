"""Id types shared by every layer. Units live in field names (docs/style.md "Names")."""

from __future__ import annotations

from typing import NewType

BlockKey = NewType("BlockKey", bytes)
"""16 bytes naming a block's whole token prefix within one namespace (kvdb/keys.py)."""

FrameId = NewType("FrameId", int)
"""Index of a page frame inside one arena."""

SlotId = NewType("SlotId", int)
"""Pool-wide page slot: device frames first, then host frames."""

Lsn = NewType("Lsn", int)
"""Log sequence number: strictly increasing per Db."""

NodeId = NewType("NodeId", str)
"""A workflow node or a replication peer, by name."""

KEY_BYTES = 16

DURABILITIES = ("none", "group", "sync")
"""Per-write durability: ack at once (written back later), after a shared fsync, after an own fsync."""
