"""The disk tier: RocksDB index over the log, codecs, compaction, verify."""

from kvdb.cold.store import ColdStore

__all__ = ["ColdStore"]
