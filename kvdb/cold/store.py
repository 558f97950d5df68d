"""ColdStore: the disk tier -- log segments (PATH/wal/) indexed by RocksDB (PATH/index/).

The Db holds one ColdStore. It writes blocks evicted from the host tier (write-back, usually
``durability="none"``) and blocks put with ``group``/``sync`` (write-through), and reads here on a
miss in memory. Every method is thread-safe.

This module is the facade: it checks arguments, picks the durability path, counts, and holds
the parts, each with its own module and invariants (the attributes below are public: the
functions of compact.py, verify.py and export.py work through them):

    writer    kvdb/wal/writer.py       LogWriter: appends and rotations (W1, W3, W4)
    commit    kvdb/wal/commit.py       GroupCommit: commit queue, fsync leader, native committer (W2)
    segments  kvdb/wal/segments.py     SegmentSet: listing, sealed sizes, summaries, deletion
    appender  kvdb/cold/write.py       LogAppender: encoding, eviction, appends and their bookkeeping
    live      kvdb/cold/live.py        LiveSet: live totals per segment, eviction order, space
    queue     kvdb/cold/apply.py       IndexQueue: queued index updates, pending, apply (C1)
    index     kvdb/cold/index.py       Index: RocksDB
    reader    kvdb/cold/read.py        BlockReader: fd cache, checked reads (C3)
    ckpt      kvdb/cold/checkpoint.py  Checkpointer: checkpoints, segment GC, flusher (C2, C4, C6)
    kvdb/cold/recovery.py              the open: key check, saved counters, replay into the index

How a put becomes durable and indexed
    1. payloads are encoded (codec, seal) outside any lock (``appender.encode``);
    2. under ``writer.lock``: the records are appended (lsn order), their index updates are
       queued (lsn order) and published to readers (``queue`` pending, ``live``);
    3. ``none`` returns now; ``sync`` fsyncs alone; ``group`` puts do steps 2-3 through the
       commit queue: the writer at its front appends every queued batch with one writev,
       fsyncs once for all and wakes the others;
    4. whoever finishes an fsync applies the queue's durable prefix to RocksDB in one batch
       and drops those keys from pending. A background flusher fsyncs ``none`` writes within
       ``flush_interval_s`` and checkpoints every ``checkpoint_bytes``.

Read-only (``open(read_only=True)``): no byte written -- the index read-only with the replay in
    memory (kvdb/cold/index.py), a torn tail kept, files through ``ReadOnlyFs``, no checkpoint,
    no flusher; the view is the log as of the open; writes raise InvalidInput.

Invariant
    C5  after any StorageIOError the store is failed: every call raises DbFailedError until it
        is closed and opened again; nothing acknowledged before the error is lost (C1, C2).
        The failed state is the log's (``writer.error``): every part fails it there.

Locks (in the order they may nest)
    ``ckpt.lock``   one checkpoint or compaction at a time.
    ``queue.lock``  serialises applying the queue to RocksDB.
    commit queue    kvdb/wal/commit.py (nothing blocks while holding it).
    ``writer.lock`` appends, queue order, pending, ``live``.
    reader fd lock  the read fd cache.
    ``_stats_lock`` the read-side counters (hits, misses, corruptions, ...); puts, deletes and
                    evictions change under ``writer.lock`` instead (their own keys, so the two
                    never race on one entry).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np

from kvdb.cold import recovery, view
from kvdb.cold.apply import IndexQueue
from kvdb.cold.checkpoint import Checkpointer
from kvdb.cold.compact import compact
from kvdb.cold.index import Index
from kvdb.cold.live import LiveSet
from kvdb.cold.options import check_durability, metadata_type, check_space_amp
from kvdb.cold.read import BlockReader
from kvdb.cold.verify import VerifyReport, verify
from kvdb.cold.write import LogAppender
from kvdb.errors import CapacityError, DbFailedError, InvalidInput, StorageIOError
from kvdb.format import index_value as iv
from kvdb.format.record import CODEC_NAMES, PUT_PAYLOAD_OFFSET, Codec, RecordType
from kvdb.fs import OsFs, ReadOnlyFs
from kvdb.types import DURABILITIES, KEY_BYTES
from kvdb.wal.commit import GroupCommit
from kvdb.wal.segments import SegmentSet
from kvdb.wal.writer import LogWriter

DEFAULT_SEGMENT_BYTES = 256 << 20
#: automatic compaction once the log holds more than this many times the live bytes
DEFAULT_MAX_SPACE_AMP = 2.0
DEFAULT_CHECKPOINT_BYTES = 512 << 20
#: group puts leave their index updates queued (readers see them pending) until this many are
#: waiting or the flusher, a flush or a checkpoint applies them: a RocksDB write per group
#: fsync cost its leader ~30 us, in series with everyone's next commit
APPLY_BATCH = 512
#: saved in the index at every checkpoint (so after a clean reopen, or a crash, ``stats`` shows
#: the counts of the last checkpoint); ``lookup_hits`` / ``lookup_misses`` are the Db's lookups
#: answered by this tier and answered by no tier (``count_lookups``)
PERSISTED_COUNTERS = ("hits", "misses", "corruptions", "evictions", "puts", "deletes", "segments_deleted",
                      "lookup_hits", "lookup_misses", "auto_compactions")

class ColdStore:
    """Open with ``ColdStore.open``; see the module doc."""

    def __init__(self) -> None:  # use open()
        self.closed = True
        self._crashed = False
        self.read_only = False

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(cls, path, layout, *, disk_bytes: int | None = None, encryption_key_file: str | None = None,
             codec: str = "raw", default_durability: str = "group", fs: OsFs | None = None,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES, checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
             flush_interval_s: float | None = 0.05, native_commit: bool = False,
             max_space_amp: float | None = DEFAULT_MAX_SPACE_AMP, read_only: bool = False,
             store_id: bytes | None = None) -> "ColdStore":
        """Open (creating when missing) the cold tier under ``path``; runs recovery.

        ``max_space_amp``: the background flusher compacts on its own (``maybe_compact``) once
        the log files hold more than this many times the live record bytes and sealed segments
        hold a segment's worth of dead bytes it can reclaim; ``None`` leaves compaction to
        ``compact`` / ``kvdb compact``. (Without a flusher, ``flush_interval_s=None``, nothing runs on its own.)

        ``flush_interval_s=None`` turns the background flusher off (deterministic I/O for the
        crash tests; ``none`` writes then become durable at the next group/sync/checkpoint).
        ``native_commit=True`` fsyncs group commits in the native committer thread (ahead when
        fsync is very fast, behind at 0.2 ms: kvdb/wal/commit.py, docs/durability.md).
        ``store_id`` (MANIFEST.json's): checked against index and segments (recovery.py step 0).

        ``read_only``: the view of a live writer's store is taken again while the writer's
        compaction or GC changed files under it (kvdb/cold/view.py): a missing file or replay
        damage is believed only from an unchanged store, else ``StoreChangedError``."""
        kw = {k: v for k, v in locals().items() if k not in ("cls", "path", "layout")}
        if not read_only:
            return cls._open(path, layout, **kw)
        return view.stable(path, lambda: cls._open(path, layout, **kw),
                           suspect=lambda st: bool(st.recovery.damage), discard=lambda st: st.close())

    @classmethod
    def _open(cls, path, layout, *, disk_bytes, encryption_key_file, codec, default_durability, fs, segment_bytes,
              checkpoint_bytes, flush_interval_s, native_commit, max_space_amp, read_only, store_id) -> "ColdStore":
        self = cls()
        self.read_only = read_only
        if read_only:
            fs, flush_interval_s = ReadOnlyFs(), None
        if codec not in CODEC_NAMES:
            raise InvalidInput(f"codec must be one of {sorted(CODEC_NAMES)}, got {codec!r}")
        check_durability(default_durability)
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.itemsize = layout.itemsize
        self._retention = None  # () -> lowest lsn a log reader (a replication slot) still needs
        max_record_bytes = PUT_PAYLOAD_OFFSET + self.page_bytes + 64 + (self.page_bytes >> 6)
        if disk_bytes is not None and disk_bytes < max_record_bytes:
            raise CapacityError(f"disk_bytes={disk_bytes} cannot hold one {self.page_bytes}-byte page; "
                                f"give at least {max_record_bytes}")
        if segment_bytes < 512:
            raise InvalidInput(f"segment_bytes must be at least 512, got {segment_bytes}")
        max_space_amp = check_space_amp(max_space_amp)
        self.path, self.store_id = Path(path), store_id  # store_id: None for a legacy store
        self.wal_dir = str(self.path / "wal")
        self.index_dir = str(self.path / "index")
        self.disk_bytes = disk_bytes
        self.codec = CODEC_NAMES[codec]
        self.default_durability = default_durability
        self.fs = fs if fs is not None else OsFs()
        self.segments = SegmentSet(self.fs, self.wal_dir)
        self.live = LiveSet()  # empty until recovered (_open_rest)
        self.debug_on_index_flush = None  # tests: called after each checkpoint's index flush
        self._stats_lock = threading.Lock()
        self._counters = dict.fromkeys(PERSISTED_COUNTERS, 0)
        self._counters.update(checkpoints=0, read_errors=0, tombstones_carried=0, metadata_carried=0,
                              compaction_space_deferrals=0)
        try:
            self.fs.makedirs(self.wal_dir)
            self.fs.makedirs(self.index_dir)
        except OSError as e:
            raise StorageIOError(f"cannot create {self.path}: {e}") from e
        recovery.check_identity(self.index_dir, self.segments, store_id)  # before the index is written
        self.index = Index(self.index_dir, read_only=read_only)
        try:
            recovery.stamp_identity(self.index, store_id)
            self._open_rest(encryption_key_file, segment_bytes, checkpoint_bytes, max_space_amp, native_commit)
        except BaseException:
            self.index.close()
            raise
        self.closed = False
        if flush_interval_s is not None:
            self.ckpt.start_flusher(flush_interval_s, f"kvdb-cold-flusher:{self.path.name}")
        return self

    def _open_rest(self, encryption_key_file: str | None, segment_bytes: int, checkpoint_bytes: int,
                   max_space_amp: float | None, native_commit: bool) -> None:
        """Recovery (kvdb/cold/recovery.py), then the parts and the live set."""
        self.sealer, seal_check = recovery.open_sealer(self.index, self.path, encryption_key_file)
        self.reader = BlockReader(self.segments, page_bytes=self.page_bytes, itemsize=self.itemsize,
                                  sealer=self.sealer, live=self.live, count=self.count)
        saved = recovery.saved_counters(self.index)
        for k in PERSISTED_COUNTERS:
            self._counters[k] = int(saved.get(k, 0))
        checkpoint, r, totals = recovery.replay(self.index, self.fs, self.wal_dir, repair=not self.read_only)
        self.recovery = r
        if seal_check is None:
            recovery.check_key_against_log(self.index, self.path, self.sealer, self.reader.read_entry,
                                           self.page_bytes, bool(r.records_replayed and checkpoint is not None))
        self.writer = LogWriter(self.fs, self.wal_dir, segment_no=r.segment_no, offset=r.offset,
                                next_lsn=r.next_lsn, segment_bytes=segment_bytes, store_id=self.store_id)
        self.queue = IndexQueue(self.index, self.writer)
        self.live.attach(self.queue, self.segments, self.writer, totals)  # O(segments), not blocks (C7)
        self.appender = LogAppender(self, self._counters)
        self.commit = GroupCommit(self.writer, append_batches=self.appender.append_batches, check=self.check,
                                  on_durable=self.queue.apply, native_commit=native_commit)
        self.ckpt = Checkpointer(self, checkpoint_lsn=checkpoint.applied_lsn if checkpoint else 0,
                                 checkpoint_bytes=checkpoint_bytes, max_space_amp=max_space_amp)
        if (r.records_applied or r.torn_bytes) and not self.read_only:  # not for CHECKPOINT records alone
            self.ckpt.checkpoint_locked()

    def close(self) -> None:
        """Checkpoint (unless failed) and release everything. Idempotent."""
        if self.closed:
            return
        self.ckpt.stop_flusher()
        try:
            if not self.failed and not self.read_only:
                self.checkpoint()
        finally:
            self._release()

    def debug_crash_close(self) -> None:
        """Tests: let go of everything without a checkpoint, as a killed process would."""
        if self.closed:
            return
        self.ckpt.stop_flusher()
        self._crashed = True  # failed from now on, as a dead process's store is
        self._release()

    def _release(self) -> None:
        self.closed = True
        self.reader.close()
        try:
            self.commit.close()
        except BaseException:
            pass
        self.index.close()

    def __enter__(self) -> "ColdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def check(self) -> None:
        """Raise unless the store is open and healthy (C5)."""
        if self.closed:
            raise InvalidInput(f"the cold store at {self.path} is closed")
        err = self.writer.error
        if err is not None:
            raise DbFailedError(f"the cold store at {self.path} failed earlier ({err}); "
                                "close it and open it again") from None

    def check_writable(self) -> None:  # check(), and InvalidInput when opened read_only
        self.check()
        if self.read_only:
            raise InvalidInput(f"the cold store at {self.path} is open read-only")

    @contextlib.contextmanager
    def sticky_io(self, what: str):
        """An I/O error inside puts the store in the sticky failed state (C5): a StorageIOError
        passes as is, a bare OSError becomes one naming ``what``."""
        try:
            yield
        except StorageIOError as e:
            self.writer.fail(e)
            raise
        except OSError as e:
            err = StorageIOError(f"{what} of {self.path} failed: {e}")
            self.writer.fail(err)
            raise err from e

    failed = property(lambda self: self._crashed or self.writer.error is not None)

    @property
    def durable_lsn(self) -> int:
        """The highest lsn whose record is fsynced (log readers may ship up to here)."""
        return self.commit.durable_lsn

    def set_retention(self, floor) -> None:
        """``floor() -> lsn | None``: a segment holding a record above that lsn is never deleted
        (replication slots: a follower that confirmed up to it still needs the rest)."""
        self._retention = floor

    def retention_floor(self) -> int | None:
        return self._retention() if self._retention is not None else None

    def count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._counters[k] += v

    def persisted_counters(self) -> dict:
        """The counters a checkpoint saves (PERSISTED_COUNTERS)."""
        with self._stats_lock:
            return {k: self._counters[k] for k in PERSISTED_COUNTERS}

    def count_lookups(self, hits: int, misses: int) -> None:
        """The Db's prefix lookups: ``hits`` blocks found on this tier only, ``misses`` lookups
        no tier answered. Kept here so that they are persisted with the store's counters."""
        self.count(lookup_hits=hits, lookup_misses=misses)

    def add_durable_listener(self, fn) -> None:
        """Call ``fn(lsn)`` each time the log is durable up to ``lsn`` (after each group commit,
        sync put and background flush; the index may still be catching up), in the thread that
        made it so. ``fn`` must be quick and must not call back into the store."""
        self.queue.add_listener(fn)

    def remove_durable_listener(self, fn) -> None:
        self.queue.remove_listener(fn)

    # ------------------------------------------------------------------ writes

    @staticmethod
    def _validate_keys(keys) -> list[bytes]:
        keys = list(keys)
        if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:
            return keys  # all 16-byte bytes already: no Python step per key
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise InvalidInput(f"block keys must be {KEY_BYTES} bytes, got {k!r:.60}")
        return [bytes(k) for k in keys]

    def put(self, keys, pages: np.ndarray, positions=None, durability: str | None = None,
            namespace_id: int = 0, if_absent: bool = False) -> list[bool] | None:
        """Store pages (uint8 [n, page_bytes], C-contiguous, CPU) under keys; returns when they
        are as durable as ``durability`` asks ("none" | "group" | "sync"). ``if_absent``: keys
        already stored are left as they are; returns which keys were written."""
        self.check_writable()
        durability = check_durability(durability or self.default_durability)
        keys = self._validate_keys(keys)
        if not isinstance(pages, np.ndarray) or pages.dtype != np.uint8 or pages.ndim != 2 \
                or pages.shape[1] != self.page_bytes or not pages.flags.c_contiguous:
            raise InvalidInput(f"pages must be a C-contiguous uint8 numpy array [n, {self.page_bytes}], "
                               f"got {getattr(pages, 'dtype', type(pages))} {getattr(pages, 'shape', '')}")
        if len(keys) != pages.shape[0]:
            raise InvalidInput(f"{len(keys)} keys for {pages.shape[0]} pages")
        if positions is not None and len(positions) != len(keys):
            raise InvalidInput(f"{len(positions)} positions for {len(keys)} keys")
        if len(set(keys)) != len(keys):
            raise InvalidInput("a put batch names the same key twice")
        items, written = self.appender.encode_new(keys, pages, positions, namespace_id, if_absent)
        if items is None:  # nothing to write
            return written
        if durability == "group":
            durable = self.commit.commit(items)
            if durable is not None:  # this thread led the round: the index, see APPLY_BATCH
                if len(self.queue) >= APPLY_BATCH:
                    self.queue.apply(durable)
                else:
                    self.queue.notify(durable)  # durable in the log, its index update still queued
            return written
        self._make_durable(self.appender.append_puts(items), durability)
        return written

    def delete(self, keys, durability: str | None = None) -> int:
        """Delete blocks (absent keys are ignored); returns how many were live."""
        self.check_writable()
        durability = check_durability(durability or self.default_durability)
        lsn, n = self.appender.append_delete(self._validate_keys(keys))
        if n:
            self._make_durable(lsn, durability)
        return n

    def put_metadata(self, kind: str, name: bytes, value: bytes, durability: str | None = None) -> None:
        """Log a SESSION / TTL / LEASE record (``kind`` "session" | "ttl" | "lease"); an empty
        value removes the entry. The planner gives them meaning; here they are stored durably."""
        self.check_writable()
        lsn = self.appender.append_metadata(metadata_type(kind), bytes(name), bytes(value))
        self._make_durable(lsn, durability or self.default_durability)

    def find_metadata(self, kind: str, name: bytes) -> bytes | None:
        """The durable value of a metadata entry, None when absent (or not yet fsynced)."""
        self.check()
        return self.index.get(iv.record_meta_key(metadata_type(kind), bytes(name)))

    def _make_durable(self, lsn: int, durability: str) -> None:
        if durability == "none":
            return
        try:
            self.commit.sync_to(lsn, own=(durability == "sync"))
        except BaseException as e:
            self.writer.fail(e)
            raise

    def flush(self) -> None:
        """Make every write so far durable (and indexed)."""
        self.check()
        if self.read_only:
            return
        with self.writer.lock:
            last = self.writer.next_lsn - 1
        self._make_durable(last, "group")
        self.queue.apply(last)

    def checkpoint(self) -> None:
        """Everything so far durable, indexed and flushed; replay will start after it (C2).
        Also deletes segments that hold no live block any more (C4)."""
        self.check_writable()
        self.ckpt.checkpoint()

    # ------------------------------------------------------------------ reads

    def contains(self, keys) -> list[bool]:
        self.check()
        return self.live.contains([k if type(k) is bytes else bytes(k) for k in keys])

    def lookup(self, keys: list[bytes]) -> list[iv.BlockEntry | None]:
        """Index entries of ``keys`` (queued ones first), None for a key not live."""
        self.check()
        return self.queue.lookup(keys)

    def get_into(self, keys, out: np.ndarray, rows=None, entries=None, on_ready=None) -> list[bool]:
        """Read pages into ``out`` rows (uint8 [m, page_bytes]): key i into ``out[rows[i]]``
        (rows default 0..n-1, then m >= n), read there directly (no staging copy). False = miss:
        absent, or damaged (C3: counted in ``corruptions``, the row zeroed, never wrong bytes);
        ``entries``: the keys' ``lookup`` if the caller just made it (a moved block: looked up again);
        ``on_ready(indices)``: told each hit once, in this thread, as soon as it is checked."""
        self.check()
        keys = self._validate_keys(keys)
        rows = range(len(keys)) if rows is None else rows
        ints = type(rows) is range or all(type(r) is int for r in rows)  # every row, not just the ends
        top, low = (max(rows, default=-1) + 1, min(rows, default=0)) if ints else (-1, -1)
        if len(rows) != len(keys) or low < 0 or not isinstance(out, np.ndarray) or out.dtype != np.uint8 \
                or out.ndim != 2 or out.shape[1] != self.page_bytes or out.shape[0] < top or not out.flags.c_contiguous:
            raise InvalidInput(f"rows must name one row (an int) of out per key, out a C-contiguous uint8 numpy "
                               f"array [>= {top}, {self.page_bytes}]; got {len(rows)} rows for {len(keys)} keys")
        return self.read_rows(keys, out, rows, entries, on_ready)

    def read_rows(self, keys: list[bytes], out: np.ndarray, rows, entries=None, on_ready=None) -> list[bool]:
        """``get_into`` without its argument checks, for the Db only (a one-block read's path):
        the same read, checks (C3) and counts. Nothing here checks ``keys`` (16-byte bytes),
        ``out`` (a C-contiguous uint8 [m, page_bytes] array) or ``rows`` (one int in 0..m-1 per
        key): a caller that cannot vouch for them calls ``get_into``."""
        self.check()
        found, hits, misses, bad = self.reader.read_found(keys, entries or self.lookup(keys), out, rows, on_ready,
                                                          self.lookup)
        self.count(hits=hits, misses=misses, corruptions=bad)
        return found

    # ------------------------------------------------------------------ reporting, compaction

    def stats(self) -> dict:
        sp = self.space()
        w = self.writer
        with w.lock:
            out = {
                "pages": len(self.live),
                "bytes": self.live.bytes,
                "disk_bytes": self.disk_bytes,
                "log_bytes": sp["log_bytes"],
                "segments": sp["segments"],
                "next_lsn": w.next_lsn,
                "durable_lsn": self.commit.durable_lsn,
                "checkpoint_lsn": self.ckpt.lsn,
                "codec": Codec(self.codec).name.lower(),
                "encrypted": self.sealer is not None,
            }
        with self._stats_lock:
            out.update(self._counters)
        out["fsyncs"] = self.commit.num_fsyncs
        r = self.recovery
        out["recovery"] = {"records_replayed": r.records_replayed, "bytes_replayed": r.bytes_replayed,
                           "torn_bytes": r.torn_bytes, "damage": len(r.damage)}
        return out

    def space(self) -> dict:
        """Log bytes (all segments), live record bytes, dead bytes in sealed segments (what a
        compaction could reclaim) and ``reclaimable_bytes``: the dead bytes of sealed segments
        dead enough for an automatic compaction to copy (kvdb/cold/live.py ``space``)."""
        self.check()
        return self.live.space(self.segments, self.writer, self.ckpt.dead_fraction())

    def maybe_compact(self) -> dict | None:
        """Compact when the log holds more than ``max_space_amp`` x the live record bytes and
        sealed segments dead enough to copy (at least half, or 1 - 1/amp under a bound below 2)
        hold a segment's worth of dead bytes (only those are copied, so with the default bound
        a run copies at most as many bytes as it frees, unless a log reader holds the segments
        or damage keeps one). Returns the compaction's counts, or None when nothing
        was due. After a run that left the log above the bound (held segments, damage), the next
        waits until the log is a segment larger than the smallest it has been since. A close
        stops a run between chunks (``ckpt.stopping``)."""
        return self.ckpt.maybe_compact()

    max_space_amp = property(lambda self: self.ckpt.max_space_amp)

    def compact(self, progress=None, now_ns: int | None = None) -> dict:
        """Delete TTL-expired blocks, then garbage-collect segments (kvdb/cold/compact.py); segments
        whose copies would not leave ``SPACE_RESERVE_BYTES`` free on the disk are left for later."""
        self.check_writable()
        return compact(self, progress, now_ns=now_ns)

    def verify(self, progress=None, live_writer: bool = False) -> VerifyReport:
        """Check every record and index entry (kvdb/cold/verify.py); ``live_writer``: another
        process is appending (a read-only check): a torn end of the last segment is its append."""
        return verify(self, progress, live_writer)


__all__ = ["ColdStore"]
