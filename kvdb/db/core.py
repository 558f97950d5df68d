"""Db: the embedded database. The class, its states, its lock, close and stats.

    db = kvdb.open(path, layout=layout, model_id="llama-3-8b", host_bytes=4 << 30)
    keys = db.block_keys(token_ids, tenant="acme")
    db.put_blocks(keys, blocks)
    n = db.match_prefix(keys)
    db.get_blocks(keys[:n], out=out)
    with db.pin(keys[:n]) as pages: ...
    db.close()

One class, its methods grouped by operation in the modules of this package (in the manner of
RocksDB's db_impl_open / _write / ... files): ``open`` (the data directory, the lock, the key
secret, the manifest, recovery steps: the directory's layout is documented there), ``write``
(put, the one write path, write-back, flush, delete), ``read`` (lookups, get, pin), ``moves``
(prefetch, offload, the device tier's free-frame watermark), ``landing`` (zero-copy landing
into reserved frames), ``attached`` (what layers above attach: replication), ``plans/`` (the
planner's engine API and the moves it plans). This module: the class, states, close, stats.

Concurrency
    One lock (``_lock``) guards the pool (page table, frames, replacers, stats) and the plans
    (agents' chains, waits, prefixes: kvdb/db/plans/). Durable writes to the cold tier run
    *outside* it, so writers on many threads share group commits.

States
        open ──(I/O error in flush / checkpoint / cold tier)──> failed ──close()──> closed
          └───────────────────────────close()─────────────────────────────────────────┘
    In ``failed`` every call raises DbFailedError; nothing acknowledged is lost (the cold tier
    never acknowledges a write it has not made durable). ``closed`` rejects every call.

Lookups and stats
    ``match_prefix`` is the lookup: each key it examines counts a miss on every tier it is not
    in, up to and including the tier where it is found (a hit there); a key found nowhere counts
    a miss on every tier and ends the prefix. ``get_blocks`` and ``pin`` count reads, not hits.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable

import torch

from kvdb.buffer_pool.pool import BufferPool
from kvdb.buffer_pool.replacer import AccessContext, Replacer
from kvdb.db.attached import AttachedMixin
from kvdb.db.landing import LandingMixin
from kvdb.db.mover import Mover
from kvdb.db.moves import MovesMixin
from kvdb.db.open import (
    check_options,
    check_sizes,
    drop_lock,
    early_sealer,
    finish_swap_locked,
    open_cold,
    open_keyspace,
    pick_device,
    replacer_factory,
    seal_plain_file,
    take_lock,
)
from kvdb.db.plans import PlansMixin
from kvdb.db.read import ReadMixin
from kvdb.db.write import WriteMixin
from kvdb.db.writeback import BackgroundWriter
from kvdb.errors import CapacityError, DbFailedError, InvalidInput, KvdbError, StorageIOError
from kvdb.format.layout import BlockLayout
from kvdb.format.record import CODEC_NAMES
from kvdb.keys import ALGORITHMS, DEFAULT_TENANT, check_ranks
from kvdb.planner import Planner
from kvdb.prompts.book import PromptBook
from kvdb.types import DURABILITIES, BlockKey

__all__ = ["DURABILITIES", "Db"]

# Dbs open in this process, held weakly (the exit hook must not keep a dropped Db alive): a Db
# still open when the interpreter exits normally is closed then, so blocks stored with
# durability="none" are written back (a ResourceWarning names it), as a file object flushes.
_OPEN_DBS: "weakref.WeakSet[Db]" = weakref.WeakSet()


@atexit.register
def _close_open_dbs() -> None:
    for db in list(_OPEN_DBS):
        db._close_unclosed("at interpreter exit")


def check_early(tp_rank, tp_size, pp_rank, pp_size, device_free_fraction, session_idle_s, max_space_amp,
                key_algo="sha256", codec="raw", clock=None, writeback_s=None) -> None:
    """Options checked before the directory is touched (no mkdir, no lock, no secret written):
    parallel ranks (kvdb/keys.py ``check_ranks``), the key algorithm, the codec, the clock and
    the fractional options -- real numbers only, and an int past float's range (10**400) is
    InvalidInput, not an OverflowError."""
    check_ranks(tp_rank, tp_size, "tp")
    check_ranks(pp_rank, pp_size, "pp")
    if key_algo not in ALGORITHMS:
        raise InvalidInput(f"unknown key algorithm {key_algo!r}; one of {ALGORITHMS}")
    if not isinstance(codec, str) or codec not in CODEC_NAMES:
        raise InvalidInput(f"codec must be one of {sorted(CODEC_NAMES)}, got {codec!r}")
    if clock is not None and not callable(clock):
        raise InvalidInput(f"clock must be a callable returning monotone seconds (or None), got {type(clock).__name__}")
    for name, v in (("device_free_fraction", device_free_fraction), ("session_idle_s", session_idle_s),
                    ("max_space_amp", max_space_amp), ("writeback_s", writeback_s)):
        if v is None and name != "device_free_fraction":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidInput(f"{name} must be a number, got {type(v).__name__}")
        try:
            float(v)
        except OverflowError:
            raise InvalidInput(f"{name}={v!r:.40} is past the range of a float") from None
    if writeback_s is not None and not (0.0 < writeback_s < float("inf")):
        raise InvalidInput(f"writeback_s must be a positive finite number of seconds or None (write back only on "
                           f"eviction, flush and close), got {writeback_s!r}")
    if not 0.0 <= device_free_fraction < 1.0:
        raise InvalidInput(f"device_free_fraction must be in [0, 1), got {device_free_fraction!r}")


class Db(WriteMixin, ReadMixin, MovesMixin, LandingMixin, PlansMixin, AttachedMixin):
    """An open kvdb data directory. Build one with :func:`kvdb.open`."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        layout: BlockLayout | None = None,
        model_id: str | None = None,
        host_bytes: int | str = 1 << 30,
        device_bytes: int | str = 0,
        device: str | torch.device | None = None,
        replacer: str | Callable[[int], Replacer] = "lru",
        key_secret: bytes | None = None,
        key_algo: str = "sha256",
        model_revision: str | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        pp_rank: int | None = None,
        pp_size: int | None = None,
        durability: str = "none",
        disk_bytes: int | str | None = None,
        codec: str = "raw",
        encryption_key_file: str | os.PathLike | None = None,
        device_free_fraction: float = 0.0,
        clock: Callable[[], float] | None = None,
        session_idle_s: float | None = 3600.0,
        max_space_amp: float | None = 2.0,  # kvdb.cold.store.DEFAULT_MAX_SPACE_AMP
        read_only: bool = False,
        writeback_s: float | None = 1.0,
    ) -> None:
        self.path = Path(path)
        # read_only: inspection (kvdb stats, verify) that writes no byte, takes no lock and so
        # works beside a live writer and on a read-only copy; its view is the log as of the open
        self.read_only = bool(read_only)
        # the time base of sessions, hints and planned moves (monotone seconds); injectable so
        # tests and simulated timelines can drive plans without sleeping
        self._clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self._state = "opening"
        self._failure: BaseException | None = None
        self._lock = threading.RLock()
        # a background write-back batch and delete() exclude each other (kvdb/db/writeback.py B3)
        self._writeback_mu = threading.Lock()
        self._writer: BackgroundWriter | None = None
        self._lock_fd: int | None = None
        self._init_attached()
        self._prompts = PromptBook()  # rendered prompts: break accounting, near matches (kvdb/prompts/book.py)
        host_bytes, device_bytes, disk_bytes = check_sizes(host_bytes, device_bytes, disk_bytes)  # "4GiB" or ints
        check_early(tp_rank, tp_size, pp_rank, pp_size, device_free_fraction, session_idle_s, max_space_amp,
                    key_algo, codec, clock, writeback_s)
        # the disk tier compacts on its own past this space amplification (kvdb/cold/store.py)
        self._max_space_amp = check_options(durability, host_bytes, device_bytes, session_idle_s, max_space_amp)
        # a session idle this long is ended by the mover (kvdb/db/plans/expiry.py S1-S3)
        self._session_idle_s: float | None = None if session_idle_s is None else float(session_idle_s)
        if not self.read_only:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = take_lock(self.path)
        try:
            if not self.read_only:
                finish_swap_locked(self.path)  # a re-seed a crash interrupted: roll it forward or drop it (RS1)
            self._open(
                layout, model_id, host_bytes, device_bytes, device, replacer, key_secret, key_algo,
                dict(model_revision=model_revision, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size),
                durability, disk_bytes, codec, encryption_key_file, device_free_fraction,
            )
        except BaseException:
            self._drop_lock()
            raise
        self._state = "open"
        _OPEN_DBS.add(self)
        if writeback_s is not None and self._cold is not None and not self.read_only:
            self._writer = BackgroundWriter(self, float(writeback_s), self.layout.page_bytes)

    # ------------------------------------------------------------------ open / close

    def _open(self, layout, model_id, host_bytes, device_bytes, device, replacer, key_secret, key_algo,
              ns_extra, durability, disk_bytes, codec, encryption_key_file, device_free_fraction) -> None:
        """Steps 3-4 of the open (kvdb/db/open.py), under the directory's lock."""
        sealer = early_sealer(encryption_key_file, disk_bytes)  # a sealed KEY_SECRET opens under it
        opened = open_keyspace(self.path, layout, model_id, key_secret, key_algo, ns_extra, self.read_only, sealer)
        self.keyspace, self.layout, self.model_id = opened.keyspace, opened.layout, opened.model_id
        self.default_durability = durability

        page = self.layout.page_bytes
        host_frames = host_bytes // page
        device_frames = device_bytes // page
        if host_frames < 1:
            raise CapacityError(f"host_bytes={host_bytes} holds no page of {page} bytes; give at least {page}")
        if device_bytes and device_frames < 1:
            raise CapacityError(f"device_bytes={device_bytes} holds no page of {page} bytes; give 0 or at least {page}")
        dev = pick_device(device, device_bytes) if device_frames else None
        factory = replacer_factory(replacer)
        self.pool = BufferPool(self.layout, host_frames=host_frames, device_frames=device_frames, device=dev,
                               make_replacer=factory, spill=self._spill)
        # the planner sees sessions, workflows and hints and informs every tier's replacer
        self.planner = Planner(replacers=self.pool.replacers(), clock=self._clock)
        self._lookup_misses = 0
        self._disk_reads = 0  # pages read from disk (the memory tiers count theirs: pool.read_into)
        self._disk_hits = 0
        # the background mover: one thread, so moves apply in submission order; it also runs
        # the plan's timed moves (kvdb/db/plans/)
        self._mover = Mover(self._clock)
        self._init_plans()
        self._init_moves(device_frames, device_free_fraction)
        self._cold = None
        self._cold = open_cold(self.path, self.layout, disk_bytes, codec, encryption_key_file, self._max_space_amp,
                               self.read_only, opened.store_id)
        if opened.secret.seal_later and self._cold is not None:  # the disk tier accepted the key
            seal_plain_file(self.path, opened.secret.value, sealer)
        if self._cold is not None:  # the disk tier's counters survive a reopen (saved by the store)
            saved = self._cold.stats()
            self._disk_hits, self._lookup_misses = saved["lookup_hits"], saved["lookup_misses"]
            self._disk_reads = saved["hits"]  # pages the Db read from disk (it is the store's only reader)

    def _drop_lock(self) -> None:
        if self._lock_fd is not None:
            drop_lock(self._lock_fd)
            self._lock_fd = None

    @property
    def cold_store(self):
        """The disk tier (kvdb.cold.store.ColdStore), None when it is off (disk_bytes=0)."""
        return self._cold

    def close(self) -> None:
        """Write back dirty pages (when the disk tier is on), close the cold tier, drop the lock."""
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.stop()
        mover = getattr(self, "_mover", None)
        if mover is not None:
            mover.shutdown(wait=True)
        self._close_attached()
        with self._lock:
            if self._state == "closed":
                return
            try:
                if self._state == "open" and self._cold is not None and not self.read_only:
                    self._write_back_all()
            finally:
                try:
                    if self._cold is not None:
                        self._cold.close()
                finally:
                    self._state = "closed"
                    _OPEN_DBS.discard(self)
                    self._drop_lock()

    def __enter__(self) -> "Db":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # a forgotten Db is closed when collected (its writes go back, its locks -- the file lock
        # and the index's -- are dropped); on one of kvdb's own daemon threads (which may be
        # inside the disk tier) the close runs on a fresh thread instead
        if getattr(self, "_state", "closed") not in ("open", "failed"):
            return
        if threading.current_thread().daemon:
            threading.Thread(target=self._close_unclosed, args=("after it was dropped",),
                             name="kvdb-close", daemon=True).start()
        else:
            self._close_unclosed("after it was dropped")

    def _close_unclosed(self, when: str) -> None:
        """``close()`` for a Db its owner never closed, with a ResourceWarning naming it."""
        if self._state not in ("open", "failed"):
            return
        warnings.warn(f"kvdb: {self.path} was never closed; closing it {when} (call close() or use "
                      "'with kvdb.open(...)')", ResourceWarning, stacklevel=2)
        failure = self._failure if self._state == "failed" else None
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - nobody to raise to: say so, and drop the lock
            failure = e
            try:
                self._drop_lock()
            except OSError:
                pass
        if failure is not None and self._cold is not None and not self.read_only:
            # a loss is never silent: one line, whatever the warning filters say
            try:
                lost = self.pool.dirty_count()
            except Exception:  # noqa: BLE001 - the count is best effort, the line is not
                lost = "some"
            if lost:
                print(f"kvdb: error: closing {self.path} {when} failed; {lost} blocks stored with "
                      f"durability='none' were not written to disk: {failure}", file=sys.stderr, flush=True)

    def _check(self) -> None:
        if self._state == "open":
            return
        if self._state == "failed":
            raise DbFailedError(f"{self.path} is in the failed state after an I/O error ({self._failure}); "
                                "close it and open it again") from self._failure
        raise KvdbError(f"{self.path} is closed")

    def _check_writable(self) -> None:
        self._check()
        if self.read_only:
            raise InvalidInput(f"{self.path} is open read_only; open it without read_only=True to write")

    @staticmethod
    def _check_ctx(ctx) -> None:
        """``ctx``: None or the AccessContext of ``call_started`` (checked before anything changes)."""
        if ctx is not None and not isinstance(ctx, AccessContext):
            raise InvalidInput(f"ctx must be the context call_started returned (an AccessContext) or None, "
                               f"got {type(ctx).__name__}")

    def _fail(self, err: BaseException) -> None:
        self._state = "failed"
        self._failure = err

    def _cold_call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except StorageIOError as e:
            with self._lock:
                self._fail(e)
            raise

    # ------------------------------------------------------------------ keys

    def block_keys(self, token_ids, tenant: str = DEFAULT_TENANT, public_prefix_tokens: int = 0) -> list[BlockKey]:
        """One key per full block of ``token_ids`` in the tenant's namespace (kvdb/keys.py)."""
        return self.keyspace.block_keys(token_ids, tenant, public_prefix_tokens)

    def engine_keys(self, hashes, tenant: str = DEFAULT_TENANT) -> list[BlockKey]:
        """Keys for an engine's own block hashes (vLLM, SGLang), salted per tenant."""
        return self.keyspace.engine_keys(hashes, tenant)

    # ------------------------------------------------------------------ prompts (kvdb/prompts/book.py)

    def note_prompt(self, rendered, *, session_id: str | None = None, tenant: str = DEFAULT_TENANT, block_keys=None):
        """Note a prompt rendered by ``kvdb.prompts.render`` (after its blocks are stored under
        ``block_keys``, default its block keys): its segments become findable by ``near_match``;
        with ``session_id`` it counts in that session's cache breaks. Returns the call's
        ``CallBreaks`` (None without ``session_id``)."""
        self._check()
        return self._prompts.note(self, rendered, session_id, tenant, block_keys)

    def near_match(self, rendered, *, tenant: str = DEFAULT_TENANT, block_keys=None):
        """For a rendered prompt: its exact prefix (over ``block_keys``, default its block keys;
        an engine that keys blocks by its own hashes passes ``engine_keys``) and, per segment past
        it, where that segment is stored after another context (shift, blocks, context): a
        ``NearMatch`` report for an engine that splices KV. Never a hit: lookups count nothing,
        nothing is returned as KV."""
        self._check()
        return self._prompts.near_match(self, rendered, tenant, block_keys)

    # ------------------------------------------------------------------ the tensors it takes

    def _as_pages(self, blocks, n: int, what: str, allow_larger: bool = False) -> torch.Tensor:
        """A [n, page_bytes] uint8 view of a block tensor, after checking everything about it."""
        if not isinstance(blocks, torch.Tensor):
            raise InvalidInput(f"{what} must be a torch.Tensor, got {type(blocks).__name__}")
        lay = self.layout
        if blocks.dtype != lay.dtype:
            raise InvalidInput(f"{what} has dtype {blocks.dtype}; this Db stores {lay.dtype}")
        shape = tuple(blocks.shape)
        if len(shape) != 6 or shape[1:] != lay.block_shape or (shape[0] < n if allow_larger else shape[0] != n):
            want = f"[{'>=' if allow_larger else ''}{n}, {', '.join(map(str, lay.block_shape))}]"
            raise InvalidInput(f"{what} has shape {list(shape)}; expected {want} "
                               "(blocks, layers, k/v, block_tokens, kv_heads, head_dim)")
        if not blocks.is_contiguous():
            raise InvalidInput(f"{what} is not contiguous; pass .contiguous()")
        if not blocks.is_cpu and blocks.device.type not in (arena_devs := {"cpu"} | self.pool.devices()):
            raise InvalidInput(f"{what} is on {blocks.device}; this Db's arenas are on {sorted(arena_devs)}")
        return blocks.view(torch.uint8).view(shape[0], lay.page_bytes)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Per tier: pages, capacity, bytes, hits, misses, evictions (and more)."""
        self._check()
        with self._lock:
            out: dict = {"model_id": self.model_id, "read_only": self.read_only, "layout": self.layout.to_dict(),
                         "page_bytes": self.layout.page_bytes, "tiers": dict(self.pool.tier_stats())}
            if self._cold is not None:
                disk = dict(self._cold.stats())
                # lookups, as for the other tiers; the store's own read counters keep their names
                disk["store_hits"], disk["store_misses"] = disk.pop("hits", 0), disk.pop("misses", 0)
                del disk["lookup_hits"], disk["lookup_misses"]  # the Db's own, reported just below
                disk["hits"] = self._disk_hits
                disk["misses"] = self._lookup_misses
                disk["reads"] = self._disk_reads
                out["tiers"]["disk"] = disk
            out["lookup_misses"] = self._lookup_misses
            out["remote_hits"] = self._remote_hits
            out.update(self._attached_stats())
            out["sessions"] = self.planner.num_sessions
            out["hints"] = dict(self.planner.outcome_counts)
            out["plans"] = self._plans_stats()
            out["prompts"] = self._prompts.stats()
            return out
