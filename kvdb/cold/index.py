"""The RocksDB index of the cold tier (PATH/index/), through rocksdict in raw mode.

Layout of keys and values: kvdb/format/index_value.py. The index is rebuilt from the log on
recovery, so RocksDB's own WAL is off (``disable_wal``): a crash may lose the newest index
writes, never the log records they came from.

Every open uses the very same ``Options(raw_mode=True)``, built in one place (``_options``):
rocksdict records the options of an open in ``rocksdict-config.json`` beside the DB and reads
them back, and only this one set is tested here. No column families (their handles keep the DB
lock after close). Values are small (48-byte entries): no blob files.

Read-only (``Index(path, read_only=True)``, for inspection while another process writes, or
of a read-only copy): RocksDB's read-only open over a private directory of symlinks to the
index's files (rocksdict rewrites its ``rocksdict-config.json`` at every open, and the info LOG
is written where the DB is opened: neither may touch PATH/index/). Writes (the log replay of an
open) go to an in-memory overlay that reads consult first; nothing reaches the files.

Errors map to kvdb's: a held lock -> DbLockedError, "Corruption" -> CorruptionError, any other
failure -> StorageIOError. A damaged index is never rebuilt silently; a missing (or empty)
index/ is: the open replays the whole log into a new one (C6, kvdb/cold/checkpoint.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Iterator

import rocksdict

from kvdb.errors import CorruptionError, DbLockedError, StorageIOError
from kvdb.format.index_value import (
    BLOCK_PREFIX,
    CHECKPOINT_KEY,
    BlockEntry,
    Checkpoint,
    decode_checkpoint,
    decode_entries,
    decode_entry,
)


def _options() -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    # Bloom filters over whole keys, in the SST files (10 bits a key, ~1.2 bytes a block on
    # disk) and in the memtable (a tenth of the write buffer): a put looks up the old location
    # of every key it writes, and for a fresh key (most of an ingest) the filters answer "not
    # here" without searching a table: 0.5-0.7 us a key instead of 1.5-1.8 (200k keys, the
    # memtable or one SST file, rocksdict multi-get).
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    opts.set_memtable_prefix_bloom_ratio(0.1)
    opts.set_memtable_whole_key_filtering(True)
    return opts


def map_error(e: Exception, what: str) -> Exception:
    msg = str(e)
    low = msg.lower()
    if "lock" in low and ("resource temporarily unavailable" in low or "lock hold" in low or "no locks available" in low):
        return DbLockedError(f"{what}: the index is open in another process or store ({msg})")
    if "corruption" in low or "checksum" in low or "bad magic" in low or "truncated" in low or "no such file" in low or "does not exist" in low:
        return CorruptionError(f"{what}: the RocksDB index is damaged ({msg}); run `kvdb verify`, then remove "
                               "the store's index/ directory to rebuild it from the log "
                               "(docs/durability.md, 'Losing the index')")
    return StorageIOError(f"{what}: {msg}")


#: files of PATH/index/ a read-only open does not link: RocksDB's lock and info logs, rocksdict's config
_NOT_LINKED = ("LOCK", "rocksdict-config.json")


def _linked_view(path: str) -> str:
    """A private directory of symlinks to the index's files (for a read-only open)."""
    view = tempfile.mkdtemp(prefix="kvdb-index-ro-")
    try:
        for name in os.listdir(path):
            if name in _NOT_LINKED or name.startswith("LOG"):
                continue
            os.symlink(os.path.abspath(os.path.join(path, name)), os.path.join(view, name))
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


class Index:
    def __init__(self, path: str, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self._lock = threading.Lock()  # guards _db against use after close
        self._view: str | None = None
        self._overlay: dict[bytes, bytes | None] | None = None
        try:
            if read_only:
                self._overlay = {}
                self._view = _linked_view(path)
                self._db = rocksdict.Rdict(self._view, rocksdict.Options(raw_mode=True),
                                           access_type=rocksdict.AccessType.read_only())
                self._closed = False
                return
            self._db = rocksdict.Rdict(path, _options())
        except Exception as e:  # rocksdict raises plain Exception subclasses
            self._drop_view()
            raise map_error(e, f"opening the index at {path}") from None
        wo = rocksdict.WriteOptions()
        wo.disable_wal = True
        self._db.set_write_options(wo)
        self._closed = False

    def _drop_view(self) -> None:
        if self._view is not None:
            shutil.rmtree(self._view, ignore_errors=True)
            self._view = None

    def get_values(self, keys: list[bytes]) -> list[bytes | None]:
        """The encoded entries of block ``keys`` (None: not in the index), in one multi-get."""
        ks = list(map(BLOCK_PREFIX.__add__, keys))
        try:
            vals = [self._db.get(ks[0])] if len(ks) == 1 else self._db.get(ks)  # one key: no multi-get
        except Exception as e:
            raise map_error(e, "reading the index") from None
        if self._overlay:
            vals = [self._overlay[k] if k in self._overlay else v for k, v in zip(ks, vals)]
        return vals

    def get_entries(self, keys: list[bytes]) -> list[BlockEntry | None]:
        return decode_entries(self.get_values(keys))

    def get(self, key: bytes) -> bytes | None:
        if self._overlay and key in self._overlay:
            return self._overlay[key]
        try:
            return self._db.get(key)
        except Exception as e:
            raise map_error(e, "reading the index") from None

    def write(self, ops: list[tuple[bytes, bytes | None]]) -> None:
        """Apply (key, value) puts and (key, None) deletes atomically, in order."""
        if not ops:
            return
        if self._overlay is not None:  # read-only: in memory only
            self._overlay.update(ops)
            return
        wb = rocksdict.WriteBatch(raw_mode=True)
        for k, v in ops:
            if v is None:
                wb.delete(k)
            else:
                wb.put(k, v)
        try:
            self._db.write(wb)
        except Exception as e:
            raise map_error(e, "writing the index") from None

    def checkpoint(self) -> Checkpoint | None:
        raw = self.get(CHECKPOINT_KEY)
        return None if raw is None else decode_checkpoint(raw)

    def items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """(key without the prefix, value) for every key starting with ``prefix``."""
        if self._overlay:  # read-only after a replay: the overlay's puts and deletes merged in
            merged = dict(self._items(prefix))
            for k, v in self._overlay.items():
                if k.startswith(prefix):
                    if v is None:
                        merged.pop(k[len(prefix):], None)
                    else:
                        merged[k[len(prefix):]] = v
            yield from sorted(merged.items())
            return
        yield from self._items(prefix)

    def _items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        it = self._db.iter()
        try:
            it.seek(prefix)
            while it.valid():
                k = it.key()
                if not k.startswith(prefix):
                    break
                yield k[len(prefix):], it.value()
                it.next()
            it.status()
        except Exception as e:
            raise map_error(e, "scanning the index") from None
        finally:
            del it

    def entries(self) -> Iterator[tuple[bytes, BlockEntry]]:
        for k, v in self.items(BLOCK_PREFIX):
            yield k, decode_entry(v)

    def copy_to(self, path: str) -> None:
        """A consistent copy of the index, openable on its own, at ``path`` (RocksDB's checkpoint:
        tests take one to model what a crash leaves of an index whose WAL is off)."""
        try:
            rocksdict.Checkpoint(self._db).create_checkpoint(path)
        except Exception as e:
            raise map_error(e, "copying the index") from None

    def flush(self) -> None:
        if self.read_only:
            return
        try:
            self._db.flush(True)
        except Exception as e:
            raise map_error(e, "flushing the index") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._db.close()
            except Exception as e:
                raise map_error(e, "closing the index") from None
            finally:
                self._drop_view()
