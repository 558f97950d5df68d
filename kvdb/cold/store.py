"""ColdStore: the disk tier -- log segments (PATH/wal/) indexed by RocksDB (PATH/index/).

The Db holds one ColdStore. It writes blocks evicted from the host tier (write-back, usually
``durability="none"``) and blocks put with ``group``/``sync`` (write-through), and reads here on a
miss in memory. Every method is thread-safe.

How a put becomes durable and indexed
    1. payloads are encoded (codec, seal) outside any lock;
    2. under ``writer.lock``: the records are appended (lsn order), their index updates are
       queued (``_queue``, lsn order) and published to readers in ``_pending`` and ``_live``;
    3. ``none`` returns now; ``sync`` fsyncs alone; ``group`` puts do steps 2-3 through the
       commit queue (``_put_group``): the writer at its front appends every queued batch with
       one writev, fsyncs once for all and wakes the others (LevelDB's writer queue);
    4. whoever finishes an fsync applies the queue's durable prefix to RocksDB in one batch
       (``_apply``) and drops those keys from ``_pending``. A background flusher fsyncs
       ``none`` writes within ``flush_interval_s`` and checkpoints every ``checkpoint_bytes``.

Invariants
    C1  RocksDB only ever holds index entries of fsynced records, applied in lsn order: any
        state a crash leaves it in is the log's state at some durable lsn (its memtable is not
        logged, so a crash rolls it back to an earlier such state, never forward).
    C2  a checkpoint (segment, offset, applied_lsn) is written to RocksDB and flushed only after
        every record before it is applied; recovery replays from there, so C1 plus replay
        rebuilds exactly the durable log's state.
    C3  a read returns a page only if its record's crc, type, lsn and key match the index
        entry and its payload decodes (and authenticates) to exactly page_bytes; otherwise the
        read is a miss, the row is zeroed and ``corruptions`` counts it.
    C4  a segment file is deleted only after a flushed checkpoint lies beyond it and no live
        entry points into it; readers holding its fd keep reading (POSIX unlink semantics).
    C5  after any StorageIOError the store is failed: every call raises DbFailedError until it
        is closed and opened again; nothing acknowledged before the error is lost (C1, C2).
    C6  replaying every surviving segment from the first (the index rebuild: remove index/,
        reopen) yields exactly the live blocks and metadata: before a segment is deleted, its
        DELETEs that an older surviving PUT still needs and its live metadata are appended
        again (kvdb/cold/compact.py ``carry_forward``).

Locks (in the order they may nest)
    ``_ckpt_lock``  one checkpoint or compaction at a time.
    ``_apply_lock`` serialises applying the queue to RocksDB.
    ``_gq_mu``      the group commit queue (nothing blocks while holding it).
    ``writer.lock`` appends, ``_queue`` order, ``_pending``, ``_live``, ``_seg_live``.
    ``_fd_lock``    the read fd cache ``_fds``.
    ``_stats_lock`` the read-side counters (hits, misses, corruptions, ...); puts, deletes and
                    evictions change under ``writer.lock`` instead (their own keys, so the two
                    never race on one entry).

Eviction under ``disk_bytes``: live record bytes never exceed it; the oldest written blocks go
first (a DELETE record is appended in the same batch), counted in ``evictions``. A batch bigger
than the bound keeps only its last blocks. Dead bytes stay in their segments until a checkpoint
finds a segment wholly dead (deleted at once) or ``compact`` copies the live rest out.
"""

from __future__ import annotations

import collections
import contextlib
import concurrent.futures
import os
import threading
import time
from pathlib import Path

import numpy as np

from kvdb import native
from kvdb.cold.codec import Sealer, aad, decode_page, encode_page, read_key_file
from kvdb.cold.index import Index
from kvdb.errors import (
    CapacityError,
    CorruptionError,
    DbFailedError,
    InvalidInput,
    StorageIOError,
)
from kvdb.format import index_value as iv
from kvdb.format.record import (
    CODEC_NAMES,
    FLAG_SEALED,
    META_TYPES,
    NO_POSITION,
    PUT_FIXED,
    PUT_PAYLOAD_OFFSET,
    RECORD_HEADER,
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    Codec,
    RecordType,
    buffer_bytes,
    check_record,
    decode_delete,
    decode_meta,
    decode_put,
    decode_segment_header,
    encode_checkpoint,
    encode_delete,
    encode_meta,
    encode_put_fixed,
    segment_name,
)
from kvdb.types import KEY_BYTES
from kvdb.fs import IOV_MAX, OsFs
from kvdb.wal.recovery import list_segments, recover
from kvdb.wal.writer import LogWriter

_allocate_lock = threading.Lock

DURABILITIES = ("none", "group", "sync")
DEFAULT_SEGMENT_BYTES = 256 << 20
#: automatic compaction once the log holds more than this many times the live bytes
DEFAULT_MAX_SPACE_AMP = 2.0
#: how often the flusher looks at the log's space (a directory listing)
AUTO_COMPACT_CHECK_S = 1.0
#: an automatic compaction copies only sealed segments at least this dead
AUTO_MIN_DEAD_FRACTION = 0.5
DEFAULT_CHECKPOINT_BYTES = 512 << 20
#: group puts leave their index updates queued (readers see them in ``_pending``) until this
#: many are waiting or the flusher, a flush or a checkpoint applies them: a RocksDB write per
#: group fsync cost its leader ~30 us, in series with everyone's next commit
APPLY_BATCH = 512
READ_SLICE_BYTES = 4 << 20  # raw runs are read and checked in slices of this many bytes
#: saved in the index at every checkpoint (so after a clean reopen, or a crash, ``stats`` shows
#: the counts of the last checkpoint); ``lookup_hits`` / ``lookup_misses`` are the Db's lookups
#: answered by this tier and answered by no tier (``count_lookups``)
PERSISTED_COUNTERS = ("hits", "misses", "corruptions", "evictions", "puts", "deletes", "segments_deleted",
                      "lookup_hits", "lookup_misses", "auto_compactions")


def check_space_amp(value) -> float | None:
    """``max_space_amp`` checked: a finite number > 1, or None (no automatic compaction)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 < value < float("inf"):
        raise InvalidInput(f"max_space_amp must be a finite number > 1 or None, got {value!r}")
    return float(value)


class ColdStore:
    """Open with ``ColdStore.open``; see the module doc."""

    def __init__(self) -> None:  # use open()
        self._closed = True

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(cls, path, layout, *, disk_bytes: int | None = None, encryption_key_file: str | None = None,
             codec: str = "raw", default_durability: str = "group", fs: OsFs | None = None,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES, checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
             flush_interval_s: float | None = 0.05, native_commit: bool = False,
             max_space_amp: float | None = DEFAULT_MAX_SPACE_AMP) -> "ColdStore":
        """Open (creating when missing) the cold tier under ``path``; runs recovery.

        ``max_space_amp``: the background flusher compacts on its own (``maybe_compact``) once
        the log files hold more than this many times the live record bytes and sealed segments
        hold a segment's worth of dead bytes it can reclaim; ``None`` leaves compaction to
        ``compact`` / ``kvdb compact``. (Without a flusher, ``flush_interval_s=None``, nothing runs on its own.)

        ``flush_interval_s=None`` turns the background flusher off (deterministic I/O for the
        crash tests; ``none`` writes then become durable at the next group/sync/checkpoint).
        ``native_commit=True`` fsyncs group commits in the native committer thread (ahead when
        fsync is very fast, behind at 0.2 ms: kvdb/wal/writer.py, docs/durability.md)."""
        self = cls()
        if codec not in CODEC_NAMES:
            raise InvalidInput(f"codec must be one of {sorted(CODEC_NAMES)}, got {codec!r}")
        if default_durability not in DURABILITIES:
            raise InvalidInput(f"durability must be one of {DURABILITIES}, got {default_durability!r}")
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.itemsize = layout.itemsize
        self._retention = None  # () -> lowest lsn a log reader (a replication slot) still needs
        self._max_record_bytes = PUT_PAYLOAD_OFFSET + self.page_bytes + 64 + (self.page_bytes >> 6)
        if disk_bytes is not None and disk_bytes < self._max_record_bytes:
            raise CapacityError(f"disk_bytes={disk_bytes} cannot hold one {self.page_bytes}-byte page; "
                                f"give at least {self._max_record_bytes}")
        if segment_bytes < 512:
            raise InvalidInput(f"segment_bytes must be at least 512, got {segment_bytes}")
        self.max_space_amp = check_space_amp(max_space_amp)
        self._sealed_sizes: dict[int, int] = {}  # sealed segment -> file bytes (they never change)
        self._auto_floor = 0  # maybe_compact waits until the log grows past this again
        self._auto_checked = 0.0
        self.path = Path(path)
        self.wal_dir = str(self.path / "wal")
        self.index_dir = str(self.path / "index")
        self.disk_bytes = disk_bytes
        self.codec = CODEC_NAMES[codec]
        self.default_durability = default_durability
        self.checkpoint_bytes = checkpoint_bytes
        self._fs = fs if fs is not None else OsFs()
        self._native_commit = native_commit
        self._failed: BaseException | None = None
        self.debug_on_index_flush = None  # tests: called after each checkpoint's index flush
        self._ckpt_lock = threading.Lock()
        self._apply_lock = threading.Lock()
        self._durable_listeners: tuple = ()  # called with the new durable lsn (log shipping wakes its streams)
        self._fd_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._fds: dict[int, list] = {}  # segment -> [fd, pins, retired]
        self._pool = None  # read-ahead thread of raw runs, made on first use
        self._queue: collections.deque = collections.deque()  # (lsn, index key, value|None, block key|None)
        self._pending: dict[bytes, tuple[int, iv.BlockEntry | None]] = {}
        self._live: dict[bytes, tuple[int, int, int]] = {}  # key -> (lsn, record_bytes, segment)
        self._seg_live: collections.Counter = collections.Counter()  # segment -> live record bytes
        self._live_bytes = 0
        self._counters = dict.fromkeys(PERSISTED_COUNTERS, 0)
        self._counters.update(checkpoints=0, read_errors=0, tombstones_carried=0, metadata_carried=0)
        self._summaries: dict = {}  # sealed segment -> its SegmentSummary (segment GC, C6)
        self._gq_mu = threading.Lock()  # the group commit queue: _gq, _gq_busy
        self._gq: list[list] = []  # [items, wake-up lock, leads, error] of waiting group puts
        self._gq_busy = False  # a writer is leading the queue (or the lead is being handed on)
        self._gq_expect = 1  # size of the last committed batch
        self._gq_want = 0  # a gathering leader waits until this many puts are queued
        self.max_gather_s = 0.0005
        try:
            self._fs.makedirs(self.wal_dir)
            self._fs.makedirs(self.index_dir)
        except OSError as e:
            raise StorageIOError(f"cannot create {self.path}: {e}") from e
        self._index = Index(self.index_dir)
        try:
            self._open_rest(encryption_key_file, segment_bytes)
        except BaseException:
            self._index.close()
            raise
        self._closed = False
        self._stop = threading.Event()
        self._flusher = None
        if flush_interval_s is not None:
            self._flusher = threading.Thread(target=self._flush_loop, args=(flush_interval_s,),
                                             name=f"kvdb-cold-flusher:{self.path.name}", daemon=True)
            self._flusher.start()
        return self

    def _open_rest(self, encryption_key_file: str | None, segment_bytes: int) -> None:
        seal_check = self._index.get(iv.SEAL_KEY)
        self._sealer = Sealer(read_key_file(encryption_key_file)) if encryption_key_file else None
        if seal_check is not None and self._sealer is None:
            raise InvalidInput(f"{self.path} is encrypted: open it with encryption_key_file=")
        if seal_check is not None and not self._sealer.matches(seal_check):
            raise InvalidInput(f"the encryption key does not match the one {self.path} was created with")
        raw_stats = self._index.get(iv.STATS_KEY)
        if raw_stats is not None:
            saved = iv.decode_stats(raw_stats)
            for k in PERSISTED_COUNTERS:
                self._counters[k] = int(saved.get(k, 0))
        ck = self._index.get(iv.CHECKPOINT_KEY)
        checkpoint = None if ck is None else iv.decode_checkpoint(ck)
        batch: list = []

        def apply(segment_no, rec) -> None:
            batch.extend(self._index_ops(segment_no, rec.offset, rec.rtype, rec.lsn, rec.crc, rec.body))
            if len(batch) >= 4096:
                self._index.write(batch)
                batch.clear()

        try:
            self.recovery = recover(self._fs, self.wal_dir, checkpoint, apply)
        except OSError as e:
            raise StorageIOError(f"recovery of {self.wal_dir} failed: {e}") from e
        self._index.write(batch)
        if seal_check is None:
            first = next(self._index.entries(), None)
            if first is not None and first[1].flags & FLAG_SEALED:
                # an index rebuilt from the log of an encrypted store: the log tells, and one
                # record that authenticates proves the key
                if self._sealer is None:
                    raise InvalidInput(f"{self.path} is encrypted: open it with encryption_key_file=")
                if self._read_entry(first[0], first[1], np.empty(self.page_bytes, np.uint8)) is not True:
                    raise InvalidInput(f"the encryption key does not match the log of {self.path} "
                                       "(or its first block's record is damaged: run `kvdb verify`)")
            elif self._sealer is not None and (first is not None or self.recovery.records_replayed
                                               and checkpoint is not None):
                raise InvalidInput(f"{self.path} was created without encryption; it cannot be opened with a key")
            if self._sealer is not None:
                self._index.write([(iv.SEAL_KEY, self._sealer.key_check())])
                self._index.flush()  # the index WAL is off: make the key check survive a crash now
        self._writer = LogWriter(self._fs, self.wal_dir, segment_no=self.recovery.segment_no,
                                 offset=self.recovery.offset, next_lsn=self.recovery.next_lsn,
                                 segment_bytes=segment_bytes, on_durable=self._apply,
                                 native_commit=self._native_commit)
        self._ckpt_lsn = checkpoint.applied_lsn if checkpoint else 0
        self._ckpt_log_bytes = 0  # log bytes appended since the last checkpoint
        entries = sorted(self._index.entries(), key=lambda kv: kv[1].lsn)
        for key, e in entries:
            self._live[key] = (e.lsn, e.record_bytes, e.segment_no)
            self._seg_live[e.segment_no] += e.record_bytes
            self._live_bytes += e.record_bytes
        if self.recovery.records_replayed or self.recovery.torn_bytes:
            self._checkpoint_locked_free()

    @staticmethod
    def _index_ops(segment_no: int, offset: int, rtype: int, lsn: int, crc: int, body) -> list:
        """The index writes one log record stands for (replay and the live path share this)."""
        if rtype == RecordType.PUT_BLOCK:
            p = decode_put(body)
            e = iv.BlockEntry(segment_no, offset, RECORD_HEADER_BYTES + len(body), crc, lsn, p.position,
                              p.namespace_id, p.codec, p.flags, p.raw_bytes)
            return [(iv.block_key(p.key), iv.encode_entry(e))]
        if rtype == RecordType.DELETE:
            return [(iv.block_key(k), None) for k in decode_delete(body)]
        if rtype in META_TYPES:
            name, value = decode_meta(body)
            return [(iv.record_meta_key(rtype, name), value if value else None)]
        return []

    def close(self) -> None:
        """Checkpoint (unless failed) and release everything. Idempotent."""
        if self._closed:
            return
        self._stop_flusher()
        try:
            if self._failed is None:
                self.checkpoint()
        finally:
            self._release()

    def debug_crash_close(self) -> None:
        """Tests: let go of everything without a checkpoint, as a killed process would."""
        if self._closed:
            return
        self._stop_flusher()
        self._failed = self._failed or DbFailedError("crashed")
        self._release()

    def _stop_flusher(self) -> None:
        self._stop.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()

    def _release(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            self._writer.close()
        except BaseException:
            pass
        with self._fd_lock:
            for fd, _pins, _retired in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
        self._index.close()

    def __enter__(self) -> "ColdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def _check(self) -> None:
        if self._closed:
            raise InvalidInput(f"the cold store at {self.path} is closed")
        if self._failed is None and self._writer._failed is not None:
            self._failed = self._writer._failed  # the log failed under compaction or the flusher
        if self._failed is not None:
            raise DbFailedError(f"the cold store at {self.path} failed earlier ({self._failed}); "
                                "close it and open it again") from None

    @contextlib.contextmanager
    def sticky_io(self, what: str):
        """An I/O error inside puts the store in the sticky failed state (STYLE.md "Errors"):
        a StorageIOError passes as is, a bare OSError becomes one naming ``what``."""
        try:
            yield
        except StorageIOError as e:
            self._fail(e)
            raise
        except OSError as e:
            err = StorageIOError(f"{what} of {self.path} failed: {e}")
            self._fail(err)
            raise err from e

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc
        self._writer.fail(exc)

    @property
    def failed(self) -> bool:
        return self._failed is not None or self._writer._failed is not None

    @property
    def durable_lsn(self) -> int:
        """The highest lsn whose record is fsynced (log readers may ship up to here)."""
        return self._writer.durable_lsn

    def set_retention(self, floor) -> None:
        """``floor() -> lsn | None``: a segment holding a record above that lsn is never deleted
        (replication slots: a follower that confirmed up to it still needs the rest)."""
        self._retention = floor

    def _last_lsn_of(self, segment_no: int, segments: list[int]) -> int | None:
        """The lsn of the last record in a sealed segment: the next segment's first lsn - 1."""
        later = [s for s in segments if s > segment_no]
        if not later:
            return None
        path = os.path.join(self.wal_dir, segment_name(min(later)))
        fd = self._fs.open_read(path)
        try:
            return decode_segment_header(self._fs.pread(fd, SEGMENT_HEADER_BYTES, 0)).first_lsn - 1
        finally:
            self._fs.close(fd)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._counters[k] += v

    def count_lookups(self, hits: int, misses: int) -> None:
        """The Db's prefix lookups: ``hits`` blocks found on this tier only, ``misses`` lookups
        no tier answered. Kept here so that they are persisted with the store's counters."""
        if hits or misses:
            self._count(lookup_hits=hits, lookup_misses=misses)

    # ------------------------------------------------------------------ writes

    def _validate_keys(self, keys) -> list[bytes]:
        out = []
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise InvalidInput(f"block keys must be {KEY_BYTES} bytes, got {k!r:.60}")
            out.append(bytes(k))
        return out

    def put(self, keys, pages: np.ndarray, positions=None, durability: str | None = None,
            namespace_id: int = 0) -> None:
        """Store pages (uint8 [n, page_bytes], C-contiguous, CPU) under keys; returns when they
        are as durable as ``durability`` asks ("none" | "group" | "sync")."""
        self._check()
        durability = durability or self.default_durability
        if durability not in DURABILITIES:
            raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
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
        if not keys:
            return
        items = self._encode(keys, pages, positions, namespace_id)
        if durability == "group":
            self._put_group(items)
            return
        last = self._append_puts(items)
        self._make_durable(last, durability)

    def _put_group(self, items: list) -> None:
        """A ``group`` put joins the commit queue (LevelDB's writer queue): the writer at its
        front appends every queued batch, fsyncs once for all of them and wakes their
        writers; the others neither take ``writer.lock`` nor write, they only sleep once.

        The leader first gathers: it waits (at most ``max_gather_s``) until as many puts are
        queued as its previous batch had -- their writers are on their way back -- so that one
        fsync covers them all. It waits on its own wake-up lock, and the put that completes
        the count takes the lead over at once (it is running already; waking the gatherer
        would put one more thread switch in series with everyone's commit)."""
        req = [items, _allocate_lock(), False, None]  # batch, wake-up lock, lead, error
        req[1].acquire()
        with self._gq_mu:
            self._gq.append(req)
            if not self._gq_busy:
                self._gq_busy = True
                lead, gathered = True, False
            elif self._gq_want and len(self._gq) >= self._gq_want:
                self._gq_want = 0  # the gatherer is a follower in this batch now
                lead, gathered = True, True
            else:
                lead = False
        if not lead:
            self._follow(req)
        else:
            self._lead_group(req, gathered)

    def _follow(self, req: list) -> None:
        req[1].acquire()  # released when the batch is durable or failed, or the lead is ours
        if req[2]:
            req[2] = False
            self._lead_group(req, False)
        elif req[3] is not None:
            self._check()
            raise req[3]

    def _lead_group(self, mine: list, gathered: bool) -> None:
        """Gather, commit the queue in one batch, then pass the lead to the queue's front (a
        leader that went on committing would starve its own caller)."""
        if not gathered:
            with self._gq_mu:
                if len(self._gq) < self._gq_expect:
                    self._gq_want = self._gq_expect
                    gathered = None  # wait below
            if gathered is None:
                if mine[1].acquire(timeout=self.max_gather_s):
                    self._follow_done(mine)  # taken over, and already committed
                    return
                with self._gq_mu:
                    taken = self._gq_want == 0
                    self._gq_want = 0
                if taken:
                    self._follow(mine)
                    return
        with self._gq_mu:
            batch, self._gq = self._gq, []
        err: BaseException | None = None
        durable = None
        try:
            last = self._append_batches([req[0] for req in batch])
            durable = self._writer.sync_to(last, notify=False)  # the index: see APPLY_BATCH
        except BaseException as e:
            self._fail(e)
            err = e
        with self._gq_mu:
            self._gq_expect = len(batch)
            heir = None
            if err is not None:
                batch.extend(self._gq)  # they fail the same way
                self._gq = []
            if self._gq:
                heir = self._gq[0]
                heir[2] = True  # _gq_busy stays True: the lead passes straight on
            else:
                self._gq_busy = False
        for req in batch:
            if req is not mine:
                req[3] = err
                req[1].release()
        if heir is not None:
            heir[1].release()
        if err is not None:
            raise err
        if len(self._queue) >= APPLY_BATCH:
            self._apply(durable)
        else:
            self._notify_durable(durable)  # durable in the log, its index update still queued

    def _follow_done(self, req: list) -> None:
        if req[3] is not None:
            self._check()
            raise req[3]

    def _encode(self, keys, pages, positions, namespace_id: int) -> list:
        items = []
        for i, key in enumerate(keys):
            pos = NO_POSITION if positions is None or positions[i] is None else int(positions[i])
            used, payload = encode_page(pages[i], self.codec, self.itemsize)
            flags = 0
            if self._sealer is not None:
                payload = self._sealer.seal(payload, aad(key, namespace_id, pos, used))
                flags |= FLAG_SEALED
            fixed = encode_put_fixed(key, namespace_id, pos, used, flags, self.page_bytes)
            items.append((key, fixed, payload))
        return items

    def _append_puts(self, items: list) -> int:
        w = self._writer
        with w.lock:
            self._check()
            evict: list[bytes] = []
            if self.disk_bytes is not None:
                items, evict = self._plan_evictions(items)
            records = []
            if evict:
                records.append((RecordType.DELETE, [encode_delete(evict)]))
            records.extend((RecordType.PUT_BLOCK, [fixed, payload]) for _k, fixed, payload in items)
            locs = w.append(records)  # an I/O error fails the writer; _check adopts it
            if evict:
                self._note_delete(locs[0].lsn, evict)
                locs = locs[1:]
            self._note_puts(items, locs)
            if evict:
                self._counters["evictions"] += len(evict)
            return w.next_lsn - 1

    def _append_batches(self, batches: list[list]) -> int:
        """Append several put batches (the group commit queue) in order; one writev for all
        of them unless eviction is on (then each batch is planned on its own, as alone)."""
        w = self._writer
        with w.lock:
            if self.disk_bytes is not None or len(batches) == 1:
                for items in batches:
                    last = self._append_puts(items)
                return last
            self._check()
            items = [it for b in batches for it in b]
            locs = w.append([(RecordType.PUT_BLOCK, [fixed, payload]) for _k, fixed, payload in items])  # an I/O error fails the writer; _check adopts it
            self._note_puts(items, locs)
            return w.next_lsn - 1

    def _note_puts(self, items: list, locs: list) -> None:
        """Caller holds writer.lock: queue the index updates of appended puts, publish them."""
        queue, pending, block_prefix = self._queue, self._pending, iv.BLOCK_PREFIX
        nbytes = 0
        for (key, fixed, _payload), loc in zip(items, locs):
            _, ns, pos, codec, flags, _, raw = PUT_FIXED.unpack(fixed)
            seg, lsn, rbytes = loc.segment_no, loc.lsn, loc.record_bytes
            e = iv.BlockEntry(seg, loc.offset, rbytes, loc.crc, lsn, pos, ns, codec, flags, raw)
            queue.append((lsn, block_prefix + key, iv.encode_entry(e), key))
            pending[key] = (lsn, e)
            self._set_live(key, lsn, rbytes, seg)
            nbytes += rbytes
        self._ckpt_log_bytes += nbytes
        # writer-side counters change only under writer.lock (no second lock on the hot path)
        self._counters["puts"] += len(items)

    def _plan_evictions(self, items: list) -> tuple[list, list[bytes]]:
        """Caller holds writer.lock. Keeps live bytes <= disk_bytes: evicts oldest live blocks,
        and drops the batch's own first blocks when the batch alone is too big."""
        sizes = [RECORD_HEADER_BYTES + len(f) + buffer_bytes(p) for _k, f, p in items]
        keep_from, total = len(items), 0
        while keep_from > 0 and total + sizes[keep_from - 1] <= self.disk_bytes:
            keep_from -= 1
            total += sizes[keep_from]
        dropped = keep_from
        items = items[keep_from:]
        batch_keys = {k for k, _f, _p in items}
        need = self._live_bytes + total - sum(self._live[k][1] for k in batch_keys if k in self._live)
        evict = []
        if need > self.disk_bytes:
            for key, (_lsn, rbytes, _seg) in self._live.items():
                if key in batch_keys:
                    continue
                evict.append(key)
                need -= rbytes
                if need <= self.disk_bytes:
                    break
        if dropped:
            self._counters["evictions"] += dropped
        return items, evict

    def _set_live(self, key: bytes, lsn: int, record_bytes: int, segment_no: int, keep_order: bool = False) -> None:
        """``keep_order``: a block moved by compaction keeps its place in ``_live`` (the
        eviction order under ``disk_bytes`` is write order, not copy order)."""
        old = self._live.get(key) if keep_order and record_bytes else self._live.pop(key, None)
        if old is not None:
            self._seg_live[old[2]] -= old[1]
            self._live_bytes -= old[1]
        if record_bytes:
            self._live[key] = (lsn, record_bytes, segment_no)
            self._seg_live[segment_no] += record_bytes
            self._live_bytes += record_bytes

    def _note_delete(self, lsn: int, keys: list[bytes]) -> None:
        for key in keys:
            self._queue.append((lsn, iv.block_key(key), None, key))
            self._pending[key] = (lsn, None)
            self._set_live(key, lsn, 0, 0)

    def delete(self, keys, durability: str | None = None) -> int:
        """Delete blocks (absent keys are ignored); returns how many were live."""
        self._check()
        durability = durability or self.default_durability
        if durability not in DURABILITIES:
            raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
        keys = self._validate_keys(keys)
        w = self._writer
        with w.lock:
            self._check()
            live = [k for k in dict.fromkeys(keys) if k in self._live]
            if not live:
                return 0
            (loc,) = w.append([(RecordType.DELETE, [encode_delete(live)])])  # an I/O error fails the writer; _check adopts it
            self._note_delete(loc.lsn, live)
            self._ckpt_log_bytes += loc.record_bytes
            self._counters["deletes"] += len(live)
        self._make_durable(loc.lsn, durability)
        return len(live)

    def put_metadata(self, kind: str, name: bytes, value: bytes, durability: str | None = None) -> None:
        """Log a SESSION / TTL / LEASE record (``kind`` "session" | "ttl" | "lease"); an empty
        value removes the entry. The planner gives them meaning; here they are stored durably."""
        self._check()
        rtype = {"session": RecordType.SESSION, "ttl": RecordType.TTL, "lease": RecordType.LEASE}.get(kind)
        if rtype is None:
            raise InvalidInput(f"metadata kind must be session, ttl or lease, got {kind!r}")
        w = self._writer
        with w.lock:
            self._check()
            (loc,) = w.append([(rtype, [encode_meta(bytes(name), bytes(value))])])  # an I/O error fails the writer; _check adopts it
            self._queue.append((loc.lsn, iv.record_meta_key(rtype, bytes(name)), bytes(value) or None, None))
            self._ckpt_log_bytes += loc.record_bytes
        self._make_durable(loc.lsn, durability or self.default_durability)

    def find_metadata(self, kind: str, name: bytes) -> bytes | None:
        """The durable value of a metadata entry, None when absent (or not yet fsynced)."""
        self._check()
        rtype = {"session": RecordType.SESSION, "ttl": RecordType.TTL, "lease": RecordType.LEASE}.get(kind)
        if rtype is None:
            raise InvalidInput(f"metadata kind must be session, ttl or lease, got {kind!r}")
        return self._index.get(iv.record_meta_key(rtype, bytes(name)))

    def _make_durable(self, lsn: int, durability: str) -> None:
        if durability == "none":
            return
        try:
            self._writer.sync_to(lsn, own=(durability == "sync"))
        except BaseException as e:
            self._fail(e)
            raise

    def _apply(self, lsn: int) -> None:
        """Write the durable prefix of the queue (lsn <= ``lsn``) to RocksDB (C1)."""
        with self._apply_lock:
            ops, done = [], []
            q = self._queue
            while q and q[0][0] <= lsn:
                op_lsn, ikey, value, key = q.popleft()
                ops.append((ikey, value))
                if key is not None:
                    done.append((key, op_lsn))
            try:
                self._index.write(ops)
            except Exception as e:
                self._fail(e)
                raise
            with self._writer.lock:
                for key, op_lsn in done:
                    p = self._pending.get(key)
                    if p is not None and p[0] == op_lsn:
                        del self._pending[key]
        self._notify_durable(lsn)

    def _notify_durable(self, lsn: int) -> None:
        for fn in self._durable_listeners:  # outside the locks: a listener only wakes threads
            fn(lsn)

    def add_durable_listener(self, fn) -> None:
        """Call ``fn(lsn)`` each time the log is durable up to ``lsn`` (after each group commit,
        sync put and background flush; the index may still be catching up), in the thread that
        made it so. ``fn`` must be quick and must not call back into the store."""
        with self._apply_lock:
            self._durable_listeners = (*self._durable_listeners, fn)

    def remove_durable_listener(self, fn) -> None:
        with self._apply_lock:
            self._durable_listeners = tuple(f for f in self._durable_listeners if f != fn)  # bound methods: ==

    def flush(self) -> None:
        """Make every write so far durable (and indexed)."""
        self._check()
        with self._writer.lock:
            last = self._writer.next_lsn - 1
        self._make_durable(last, "group")
        self._apply(last)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> None:
        """Everything so far durable, indexed and flushed; replay will start after it (C2).
        Also deletes segments that hold no live block any more (C4)."""
        self._check()
        with self._ckpt_lock:
            self._checkpoint_locked_free()

    def _checkpoint_locked_free(self) -> None:
        w = self._writer
        with self.sticky_io("checkpoint"):
            with w.lock:
                active = w.segment_no
            # chosen before the checkpoint's lsn is read: every record that made them dead (and
            # every record carried out of them, C6) is then fsynced and under the checkpoint
            dead = self._collectable_segments(active)
            with w.lock:
                seg, off, last = w.segment_no, w.offset, w.next_lsn - 1
            w.sync_to(last)
            self._apply(last)
            with self._stats_lock:
                saved = {k: self._counters[k] for k in PERSISTED_COUNTERS}
            self._index.write([(iv.CHECKPOINT_KEY, iv.encode_checkpoint(iv.Checkpoint(seg, off, last))),
                               (iv.STATS_KEY, iv.encode_stats(saved))])
            self._index.flush()
            if self.debug_on_index_flush is not None:
                self.debug_on_index_flush(self)
            with w.lock:
                w.append([(RecordType.CHECKPOINT, [encode_checkpoint(last)])])
                self._ckpt_log_bytes = 0
            self._ckpt_lsn = last
            self._count(checkpoints=1)
            self._delete_segments(dead)

    def _collectable_segments(self, before: int) -> list[int]:
        """Sealed segments below ``before`` with no live block, not held for a log reader, whose
        records a replay no longer needs once ``carry_forward`` has appended what it does (C6)."""
        from kvdb.cold.compact import carry_forward

        floor = self._retention() if self._retention is not None else None
        with self._writer.lock:
            segments = list_segments(self._fs, self.wal_dir)
            dead = [s for s in segments if s < before and self._seg_live.get(s, 0) <= 0]
            if floor is not None:  # kept for a log reader that has not confirmed them yet
                dead = [s for s in dead if (self._last_lsn_of(s, segments) or floor + 1) <= floor]
        return carry_forward(self, dead, segments) if dead else []

    def _delete_segments(self, dead: list[int]) -> None:
        """C4: called with a flushed checkpoint beyond ``dead``."""
        with self._writer.lock:
            for s in dead:  # sealed and wholly dead: nothing can make them live again
                self._seg_live.pop(s, None)
                self._summaries.pop(s, None)
        for s in dead:
            self._retire_fd(s)
            self._fs.unlink(os.path.join(self.wal_dir, segment_name(s)))
        if dead:
            self._fs.sync_dir(self.wal_dir)
            self._count(segments_deleted=len(dead))

    def _flush_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if self._failed is not None or self._closed:
                return
            try:
                w = self._writer
                if w.next_lsn - 1 > w.durable_lsn or self._queue:
                    self.flush()
                if self._ckpt_log_bytes >= self.checkpoint_bytes:
                    self.checkpoint()
                if self.max_space_amp is not None:
                    now = time.monotonic()
                    if now - self._auto_checked >= AUTO_COMPACT_CHECK_S:
                        self._auto_checked = now
                        self.maybe_compact()
            except BaseException as e:  # the store is failed now; callers see DbFailedError
                if self._failed is None:
                    self._fail(e)
                return

    # ------------------------------------------------------------------ reads

    def contains(self, keys) -> list[bool]:
        self._check()
        live = self._live
        return [bytes(k) in live for k in keys]

    def _lookup(self, keys: list[bytes]) -> list[iv.BlockEntry | None]:
        out: list = [None] * len(keys)
        missing = []
        for i, k in enumerate(keys):
            p = self._pending.get(k)
            if p is not None:
                out[i] = p[1]
            elif k in self._live:
                missing.append(i)
        if missing:
            got = self._index.get_entries([keys[i] for i in missing])
            for i, e in zip(missing, got):
                out[i] = e
        return out

    def _pin_fd(self, segment_no: int) -> int | None:
        with self._fd_lock:
            ent = self._fds.get(segment_no)
            if ent is None:
                try:
                    fd = self._fs.open_read(os.path.join(self.wal_dir, segment_name(segment_no)))
                except FileNotFoundError:
                    return None
                ent = self._fds[segment_no] = [fd, 0, False]
            ent[1] += 1
            return ent[0]

    def _unpin_fd(self, segment_no: int, fd: int) -> None:
        with self._fd_lock:
            ent = self._fds.get(segment_no)
            if ent is not None and ent[0] == fd:
                ent[1] -= 1
                if ent[2] and ent[1] == 0:
                    del self._fds[segment_no]
                    os.close(fd)

    def _retire_fd(self, segment_no: int) -> None:
        with self._fd_lock:
            ent = self._fds.get(segment_no)
            if ent is None:
                return
            if ent[1] == 0:
                del self._fds[segment_no]
                os.close(ent[0])
            else:
                ent[2] = True

    def get_into(self, keys, out: np.ndarray) -> list[bool]:
        """Read pages into ``out`` rows (uint8 [>= n, page_bytes]). False = miss: absent, or
        damaged (C3: counted in ``corruptions``, the row zeroed, never wrong bytes)."""
        self._check()
        keys = self._validate_keys(keys)
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 2 \
                or out.shape[1] != self.page_bytes or out.shape[0] < len(keys) or not out.flags.c_contiguous:
            raise InvalidInput(f"out must be a C-contiguous uint8 numpy array [>= {len(keys)}, {self.page_bytes}]")
        found = [False] * len(keys)
        entries = self._lookup(keys)
        results: list = [None] * len(keys)  # True hit, False damaged, "absent", None: not read yet
        self._read_raw_runs(keys, entries, out, results)
        for i, (key, e) in enumerate(zip(keys, entries)):
            if e is None:
                results[i] = "absent"
            if results[i] is not None:
                continue
            ok = self._read_entry(key, e, out[i])
            if ok is None:  # moved by compaction between lookup and read: look again once
                (e2,) = self._lookup([key])
                ok = "absent" if e2 is None else bool(self._read_entry(key, e2, out[i]))
            results[i] = ok
        hits = misses = bad = 0
        for i, ok in enumerate(results):
            if ok is True:
                found[i] = True
                hits += 1
            else:
                misses += 1
                if ok is False:
                    out[i] = 0
                    bad += 1
        self._count(hits=hits, misses=misses, corruptions=bad)
        return found

    def _read_raw_runs(self, keys, entries, out: np.ndarray, results: list) -> None:
        """Raw, unsealed pages whose records lie back to back in a segment are read with one
        preadv per run, straight into their rows (the same I/O a plain sequential read does)."""
        want = PUT_PAYLOAD_OFFSET + self.page_bytes
        cand = sorted((e.segment_no, e.offset, i) for i, e in enumerate(entries)
                      if e is not None and e.codec == Codec.RAW and not (e.flags & FLAG_SEALED)
                      and e.record_bytes == want)
        j = 0
        while j < len(cand):
            seg, off, _ = cand[j]
            run = [cand[j][2]]
            j += 1
            while j < len(cand) and len(run) < IOV_MAX // 2 and cand[j][0] == seg \
                    and cand[j][1] == off + len(run) * want:
                run.append(cand[j][2])
                j += 1
            if len(run) == 1:
                continue  # the per-entry path handles it (and its retry)
            fd = self._pin_fd(seg)
            if fd is None:
                continue
            try:
                # read and check the run in slices: the checksums of one slice overlap the
                # device reading the next (posix_fadvise WILLNEED over the run measured slower)
                per = max(1, READ_SLICE_BYTES // want)
                slices = []
                for a in range(0, len(run), per):
                    part = run[a : a + per]
                    heads = [bytearray(PUT_PAYLOAD_OFFSET) for _ in part]
                    bufs = []
                    for h, i in zip(heads, part):
                        bufs.append(h)
                        bufs.append(out[i])
                    slices.append((part, heads, bufs, off + a * want))
                # a reader thread runs ahead through the slices (preadv releases the GIL) while
                # this thread checks the ones already read (crc32c releases it too)
                pool = self._read_pool() if len(slices) > 1 else None
                futs = [pool.submit(self._safe_preadv, fd, b, o) if pool else None for _p, _h, b, o in slices]
                for (part, heads, bufs, o), fut in zip(slices, futs):
                    n = fut.result() if fut is not None else self._safe_preadv(fd, bufs, o)
                    for k, (h, i) in enumerate(zip(heads, part)):
                        if n < (k + 1) * want:
                            results[i] = False
                        else:
                            results[i] = self._check_raw(keys[i], entries[i], h, out[i])
            finally:
                self._unpin_fd(seg, fd)

    def _read_entry(self, key: bytes, e: iv.BlockEntry, row: np.ndarray):
        """True: row holds the page. False: damaged. None: the segment is gone (retry)."""
        fd = self._pin_fd(e.segment_no)
        if fd is None:
            # GC deleted the segment (C4 drops it from _seg_live first): the block moved since
            # the caller looked it up, so look again; a segment the store still counts is damage
            return None if e.segment_no not in self._seg_live else False
        try:
            if e.codec == Codec.RAW and not (e.flags & FLAG_SEALED) \
                    and e.record_bytes == PUT_PAYLOAD_OFFSET + self.page_bytes:
                return self._read_raw(fd, key, e, row)
            return self._read_decoded(fd, key, e, row)
        except OSError:
            # a read error is a miss (counted), not a reason to fail the store
            self._count(read_errors=1)
            return False
        finally:
            self._unpin_fd(e.segment_no, fd)

    def _read_raw(self, fd: int, key: bytes, e: iv.BlockEntry, row: np.ndarray) -> bool:
        head = bytearray(PUT_PAYLOAD_OFFSET)
        n = self._fs.preadv(fd, [head, row], e.offset)  # straight into the caller's row
        if n != e.record_bytes:
            return False
        return self._check_raw(key, e, head, row)

    def _safe_preadv(self, fd: int, bufs: list, offset: int) -> int:
        try:
            return self._fs.preadv(fd, bufs, offset)
        except OSError:
            return 0

    def _read_pool(self):
        with self._fd_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvdb-cold-read")
            return self._pool

    @staticmethod
    def _check_raw(key: bytes, e: iv.BlockEntry, head: bytearray, row: np.ndarray) -> bool:
        length, crc, rtype, lsn = RECORD_HEADER.unpack_from(head, 0)
        if (length + RECORD_HEADER_BYTES != e.record_bytes or crc != e.crc or rtype != RecordType.PUT_BLOCK
                or lsn != e.lsn or head[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + KEY_BYTES] != key):
            return False
        return native.crc32c(row, native.crc32c(memoryview(head)[8:])) == crc

    def _read_decoded(self, fd: int, key: bytes, e: iv.BlockEntry, row: np.ndarray) -> bool:
        buf = self._fs.pread(fd, e.record_bytes, e.offset)
        status, rec = check_record(buf, 0)
        if status != "ok" or rec.crc != e.crc or rec.lsn != e.lsn or rec.rtype != RecordType.PUT_BLOCK \
                or rec.record_bytes != e.record_bytes:
            return False
        try:
            p = decode_put(rec.body)
            if p.key != key or p.raw_bytes != self.page_bytes:
                return False
            payload = p.payload
            if p.flags & FLAG_SEALED:
                if self._sealer is None:
                    return False
                payload = self._sealer.open(payload, aad(key, p.namespace_id, p.position, p.codec))
            decode_page(payload, p.codec, self.itemsize, row)
        except CorruptionError:
            return False
        return True

    def read_record(self, segment_no: int, offset: int, nbytes: int) -> bytes | None:
        """Raw bytes of one record (compaction, verify); None when the segment is gone."""
        fd = self._pin_fd(segment_no)
        if fd is None:
            return None
        try:
            return self._fs.pread(fd, nbytes, offset)
        finally:
            self._unpin_fd(segment_no, fd)

    # ------------------------------------------------------------------ reporting

    def stats(self) -> dict:
        sp = self.space()
        with self._writer.lock:
            out = {
                "pages": len(self._live),
                "bytes": self._live_bytes,
                "disk_bytes": self.disk_bytes,
                "log_bytes": sp["log_bytes"],
                "segments": sp["segments"],
                "next_lsn": self._writer.next_lsn,
                "durable_lsn": self._writer.durable_lsn,
                "checkpoint_lsn": self._ckpt_lsn,
                "codec": Codec(self.codec).name.lower(),
                "encrypted": self._sealer is not None,
            }
        with self._stats_lock:
            out.update(self._counters)
        out["fsyncs"] = self._writer.num_fsyncs
        r = self.recovery
        out["recovery"] = {"records_replayed": r.records_replayed, "bytes_replayed": r.bytes_replayed,
                           "torn_bytes": r.torn_bytes, "damage": len(r.damage)}
        return out

    def space(self) -> dict:
        """Log bytes (all segments), live record bytes, dead bytes in sealed segments (what a
        compaction could reclaim) and ``reclaimable_bytes``: the dead bytes of sealed segments
        dead enough for an automatic compaction to copy (``_auto_dead_fraction``).
        Sealed segments' sizes are cached: they never change."""
        self._check()
        w = self._writer
        with w.lock:
            segs = list_segments(self._fs, self.wal_dir)
            active, active_bytes = w.segment_no, w.offset
            live = self._live_bytes
            seg_live = dict(self._seg_live)
        sizes = self._sealed_sizes
        present = set(segs)
        for gone in [x for x in list(sizes) if x not in present]:
            sizes.pop(gone, None)
        log_bytes = dead = reclaimable = 0
        frac = self._auto_dead_fraction()
        for x in segs:
            if x >= active:
                log_bytes += active_bytes if x == active else 0
                continue
            size = sizes.get(x)
            if size is None:
                try:
                    size = sizes[x] = self._fs.file_bytes(os.path.join(self.wal_dir, segment_name(x)))
                except FileNotFoundError:
                    continue
            log_bytes += size
            d = max(0, size - SEGMENT_HEADER_BYTES - seg_live.get(x, 0))
            dead += d
            if d and d >= frac * size:
                reclaimable += d
        return {"log_bytes": log_bytes, "live_bytes": live, "dead_bytes": dead, "reclaimable_bytes": reclaimable,
                "segments": len(segs)}

    def _auto_dead_fraction(self) -> float:
        """How dead a sealed segment must be for an automatic compaction to copy it: half, or
        less under a bound below 2 (a log above ``amp`` x live is more than 1 - 1/amp dead, so
        some segment is at least that dead)."""
        amp = self.max_space_amp
        return AUTO_MIN_DEAD_FRACTION if amp is None else min(AUTO_MIN_DEAD_FRACTION, 1.0 - 1.0 / amp)

    def maybe_compact(self) -> dict | None:
        """Compact when the log holds more than ``max_space_amp`` x the live record bytes and
        sealed segments dead enough to copy (at least half, or 1 - 1/amp under a bound below 2)
        hold a segment's worth of dead bytes (only those are copied, so with the default bound
        a run copies at most as many bytes as it frees, unless a log reader holds the segments
        or damage keeps one). Returns the compaction's counts, or None when nothing
        was due. After a run that left the log above the bound (held segments, damage), the next
        waits until the log is a segment larger than the smallest it has been since. A close
        stops a run between chunks (``_stop``)."""
        amp = self.max_space_amp
        if amp is None:
            return None
        sp = self.space()
        seg = self._writer.segment_bytes
        self._auto_floor = min(self._auto_floor, sp["log_bytes"] + seg)  # the log shrank: look again sooner
        if sp["log_bytes"] <= amp * sp["live_bytes"] or sp["reclaimable_bytes"] < seg \
                or sp["log_bytes"] < self._auto_floor:
            return None
        from kvdb.cold.compact import compact

        self._count(auto_compactions=1)  # before the run's checkpoints, which save the counters
        out = compact(self, min_dead_fraction=self._auto_dead_fraction(), stop=self._stop)
        after = self.space()
        # a run that left the log above the bound waits for growth; one that did not, for nothing
        self._auto_floor = after["log_bytes"] + seg if after["log_bytes"] > amp * after["live_bytes"] else 0
        return out

    def compact(self, progress=None, now_ns: int | None = None) -> dict:
        """Delete TTL-expired blocks, then garbage-collect segments (kvdb/cold/compact.py)."""
        from kvdb.cold.compact import compact

        return compact(self, progress, now_ns=now_ns)

    def verify(self, progress=None):
        from kvdb.cold.verify import verify

        return verify(self, progress)


__all__ = ["ColdStore", "DURABILITIES"]
