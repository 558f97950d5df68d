"""Db: the embedded database. Open / recover / close; executes every call against pool, log and index.

    db = kvdb.open(path, layout=layout, model_id="llama-3-8b", host_bytes=4 << 30)
    keys = db.block_keys(token_ids, tenant="acme")
    db.put_blocks(keys, blocks)
    n = db.match_prefix(keys)
    db.get_blocks(keys[:n], out=out)
    with db.pin(keys[:n]) as pages: ...
    db.close()

Data directory
    PATH/LOCK           flock held while a Db has PATH open (any process, any thread)
    PATH/MANIFEST.json  layout, model id, key parameters (kvdb/format/manifest.py)
    PATH/KEY_SECRET     32 random bytes, mode 0600: salts tenant namespaces (kvdb/keys.py)
    PATH/wal/, PATH/index/  the cold tier (kvdb/cold/), when the disk tier is enabled

Concurrency
    One lock (``_lock``) guards the pool (page table, frames, replacers, stats) and the plans
    (agents' chains, waits, prefixes: kvdb/db/sessions.py). Durable writes
    to the cold tier run *outside* it, so writers on many threads share group commits.

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

import fcntl
import hashlib
import hmac
import math
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from kvdb.buffer_pool.arena import cuda_available
from kvdb.buffer_pool.layout import BlockLayout
from kvdb.buffer_pool.pool import DEVICE, HOST, BufferPool, Tier
from kvdb.buffer_pool.replacer import AccessContext, Replacer
from kvdb.db.handles import PinnedPages
from kvdb.db.landing import LandingMixin
from kvdb.db.mover import Mover
from kvdb.db.replication import ReplicationMixin
from kvdb.db.sessions import SessionsMixin
from kvdb.errors import (
    CapacityError,
    DbFailedError,
    DbLockedError,
    InvalidInput,
    KvdbError,
    NotFound,
    StorageIOError,
)
from kvdb.format.manifest import read_manifest, write_manifest
from kvdb.keys import DEFAULT_TENANT, KeySpace, normalize_keys
from kvdb.planner import Planner, make_policy
from kvdb.planner.policies import REPLAY_ONLY
from kvdb.types import DURABILITIES, BlockKey
from kvdb.fs import write_file_atomic

KEY_SECRET_NAME = "KEY_SECRET"
LOCK_NAME = "LOCK"


def _key_secret_id(secret: bytes) -> str:
    return hmac.new(secret, b"kvdb key secret id", hashlib.sha256).hexdigest()[:32]


def _describe_keys(keys: Sequence[bytes], limit: int = 4) -> str:
    shown = ", ".join(k.hex() for k in keys[:limit])
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return shown + more


class Db(SessionsMixin, LandingMixin, ReplicationMixin):
    """An open kvdb data directory. Build one with :func:`kvdb.open`."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        layout: BlockLayout | None = None,
        model_id: str | None = None,
        host_bytes: int = 1 << 30,
        device_bytes: int = 0,
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
        disk_bytes: int | None = None,
        codec: str = "raw",
        encryption_key_file: str | os.PathLike | None = None,
        device_free_fraction: float = 0.0,
        peers: Sequence[str] = (),
        replicas: Sequence[str] = (),
        replication_secret_file: str | os.PathLike | None = None,
        replication_transport: str | None = None,
        clock: Callable[[], float] | None = None,
        session_idle_s: float | None = 3600.0,
        max_space_amp: float | None = 2.0,  # kvdb.cold.store.DEFAULT_MAX_SPACE_AMP
    ) -> None:
        self.path = Path(path)
        # the time base of sessions, hints and planned moves (monotone seconds); injectable so
        # tests and simulated timelines can drive plans without sleeping
        self._clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self._state = "opening"
        self._failure: BaseException | None = None
        self._lock = threading.RLock()
        if durability not in DURABILITIES:
            raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
        for name, v in (("host_bytes", host_bytes), ("device_bytes", device_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidInput(f"{name} must be an int >= 0, got {v!r}")
        if session_idle_s is not None and (isinstance(session_idle_s, bool) or not isinstance(session_idle_s, (int, float))
                                           or not math.isfinite(session_idle_s) or session_idle_s <= 0):
            raise InvalidInput(f"session_idle_s must be a positive finite number of seconds or None (sessions never "
                               f"expire), got {session_idle_s!r}")
        # a session idle this long is ended by the mover (kvdb/db/sessions.py S1-S3)
        self._session_idle_s: float | None = None if session_idle_s is None else float(session_idle_s)
        # the disk tier compacts on its own past this space amplification (kvdb/cold/store.py)
        self._max_space_amp = _check_space_amp(max_space_amp)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            from kvdb.replication.reseed import finish_swap_locked

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
        self._replicator = None
        self._remote_hits = 0
        if peers or replicas or replication_secret_file is not None:
            try:
                self._replicator = self._open_replication(peers, replicas, replication_secret_file, replication_transport)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ open / close

    def _take_lock(self) -> int:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DbLockedError(
                f"{self.path} is already open (another process or another Db in this one); "
                "close it first or use a different path"
            ) from None
        return fd

    def _drop_lock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _load_secret(self, key_secret: bytes | None) -> bytes:
        p = self.path / KEY_SECRET_NAME
        if key_secret is not None:
            if not isinstance(key_secret, (bytes, bytearray)) or len(key_secret) < 16:
                raise InvalidInput("key_secret must be at least 16 bytes")
            return bytes(key_secret)
        try:
            return p.read_bytes()
        except FileNotFoundError:
            secret = secrets.token_bytes(32)
            write_file_atomic(p, secret, mode=0o600)  # we hold the directory lock: no race
            return secret

    def _open(self, layout, model_id, host_bytes, device_bytes, device, replacer, key_secret, key_algo,
              ns_extra, durability, disk_bytes, codec, encryption_key_file, device_free_fraction) -> None:
        if not 0.0 <= device_free_fraction < 1.0:
            raise InvalidInput(f"device_free_fraction must be in [0, 1), got {device_free_fraction!r}")
        manifest = read_manifest(self.path)
        secret = self._load_secret(key_secret)
        if manifest is None:
            if layout is None or model_id is None:
                raise InvalidInput(f"{self.path} is a new data directory: pass layout= and model_id=")
            if not isinstance(layout, BlockLayout):
                raise InvalidInput(f"layout must be a kvdb.BlockLayout, got {type(layout).__name__}")
            fields = dict(model_id=model_id, layout=layout.to_dict(), key_algo=key_algo,
                          key_secret_id=_key_secret_id(secret), **ns_extra)
            KeySpace(model_id=model_id, layout=layout, key_secret=secret, algo=key_algo, **ns_extra)  # validates
            write_manifest(self.path, fields)
        else:
            stored = BlockLayout.from_dict(manifest["layout"])
            if layout is not None and layout != stored:
                raise InvalidInput(f"{self.path} holds layout {stored}, not {layout}; open it with its own layout")
            if model_id is not None and model_id != manifest["model_id"]:
                raise InvalidInput(f"{self.path} holds model {manifest['model_id']!r}, not {model_id!r}")
            if manifest.get("key_secret_id") != _key_secret_id(secret):
                raise InvalidInput(f"{self.path} was written with a different key secret; pass the same key_secret")
            for k, v in ns_extra.items():
                if v is not None and v != manifest.get(k):
                    raise InvalidInput(f"{self.path} holds {k}={manifest.get(k)!r}, not {v!r}")
            layout, model_id, key_algo = stored, manifest["model_id"], manifest.get("key_algo", "sha256")
            ns_extra = {k: manifest.get(k) for k in ns_extra}
        self.layout: BlockLayout = layout
        self.model_id: str = model_id
        self.keyspace = KeySpace(model_id=model_id, layout=layout, key_secret=secret, algo=key_algo, **ns_extra)
        self.default_durability = durability

        page = layout.page_bytes
        host_frames = host_bytes // page
        device_frames = device_bytes // page
        if host_frames < 1:
            raise CapacityError(f"host_bytes={host_bytes} holds no page of {page} bytes; give at least {page}")
        if device_bytes and device_frames < 1:
            raise CapacityError(f"device_bytes={device_bytes} holds no page of {page} bytes; give 0 or at least {page}")
        dev = self._pick_device(device) if device_frames else None
        if callable(replacer):
            factory = replacer
        else:
            name = replacer
            if name in REPLAY_ONLY:
                raise InvalidInput(f"policy {name!r} needs the future and runs only in replay (kvdb sim)")
            # the engine reports call_finished when a call really ends, so the planned policy
            # adds no assumed call duration of its own (the simulator, which sees only
            # arrivals, uses the default)
            opts = {"llm_call_s": 0.0} if name == "kvdb" else {}
            make_policy(name, 1, **opts)  # validates the name now
            factory = lambda n: make_policy(name, n, **opts)  # noqa: E731
        self.pool = BufferPool(layout, host_frames=host_frames, device_frames=device_frames, device=dev,
                               make_replacer=factory, spill=self._spill)
        # the planner sees sessions, workflows and hints and informs every tier's replacer
        self.planner = Planner(replacers=[t.replacer for t in self.pool.tiers if t is not None], clock=self._clock)
        self._lookup_misses = 0
        self._reads = [0, 0, 0]  # device, host, disk
        self._disk_hits = 0
        # the background mover: one thread, so moves apply in submission order; it also runs
        # the plan's timed moves (kvdb/db/sessions.py)
        self._mover = Mover(self._clock)
        self._init_plans()
        self._room_pending = False
        self._device_free_target = int(device_frames * device_free_fraction)
        self._cold = None
        if disk_bytes != 0:
            self._cold = self._open_cold(disk_bytes, codec, encryption_key_file, self._max_space_amp)
        elif encryption_key_file is not None:
            raise InvalidInput("encryption_key_file needs the disk tier (disk_bytes != 0)")
        if self._cold is not None:  # the disk tier's counters survive a reopen (saved by the store)
            saved = self._cold.stats()
            self._disk_hits, self._lookup_misses = saved["lookup_hits"], saved["lookup_misses"]
            self._reads[2] = saved["hits"]  # pages the Db read from disk (it is the store's only reader)

    def _open_cold(self, disk_bytes, codec, encryption_key_file, max_space_amp):
        try:
            from kvdb.cold.store import ColdStore  # the disk tier (kvdb/cold/)
        except ImportError:
            if disk_bytes is None and encryption_key_file is None:
                return None  # this build has no disk tier yet: memory only
            raise InvalidInput("this kvdb build has no disk tier; open with disk_bytes=0") from None
        return ColdStore.open(self.path, self.layout, disk_bytes=disk_bytes, encryption_key_file=encryption_key_file,
                              codec=codec, default_durability="group", max_space_amp=max_space_amp)

    @staticmethod
    def _pick_device(device) -> torch.device:
        if device is None:
            return torch.device("cuda") if cuda_available() else torch.device("cpu")
        dev = torch.device(device)
        if dev.type == "cuda" and not cuda_available():
            raise InvalidInput("device='cuda' asked for but CUDA is not available; use device='cpu' or None")
        if dev.type not in ("cuda", "cpu"):
            raise InvalidInput(f"unsupported device {dev}; use 'cuda' or 'cpu'")
        return dev

    def close(self) -> None:
        """Write back dirty pages (when the disk tier is on), close the cold tier, drop the lock."""
        mover = getattr(self, "_mover", None)
        if mover is not None:
            mover.shutdown(wait=True)
        replicator, self._replicator = getattr(self, "_replicator", None), None
        if replicator is not None:
            replicator.close()
        with self._lock:
            if self._state == "closed":
                return
            try:
                if self._state == "open" and self._cold is not None:
                    self._write_back_all()
            finally:
                try:
                    if self._cold is not None:
                        self._cold.close()
                finally:
                    self._state = "closed"
                    self._drop_lock()

    def __enter__(self) -> "Db":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten Db must not keep the directory locked
        if getattr(self, "_state", "closed") != "closed" and getattr(self, "_lock_fd", None) is not None:
            try:
                self._drop_lock()
            except OSError:
                pass

    def _check(self) -> None:
        if self._state == "open":
            return
        if self._state == "failed":
            raise DbFailedError(f"{self.path} is in the failed state after an I/O error ({self._failure}); "
                                "close it and open it again") from self._failure
        raise KvdbError(f"{self.path} is closed")

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

    # ------------------------------------------------------------------ validation

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
        dev = blocks.device.type
        arena_devs = {"cpu"} | {t.arena.device.type for t in self.pool.tiers if t is not None}
        if dev not in arena_devs:
            raise InvalidInput(f"{what} is on {blocks.device}; this Db's arenas are on {sorted(arena_devs)}")
        return blocks.view(torch.uint8).reshape(shape[0], lay.page_bytes)

    def _check_positions(self, positions, n: int) -> list[int]:
        if positions is None:
            return [-1] * n
        pos = list(positions)
        if len(pos) != n or any(not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 0 for p in pos):
            raise InvalidInput(f"positions must be {n} ints >= 0 (block depth of each key)")
        return [int(p) for p in pos]

    # ------------------------------------------------------------------ writes

    def put_blocks(self, keys, blocks: torch.Tensor, *, positions: Sequence[int] | None = None,
                   durability: str | None = None, tier: str | None = None,
                   ctx: AccessContext | None = None) -> int:
        """Store blocks under keys; keys already stored are skipped. Returns how many were new.

        durability: "none" (ack at once; written back to disk on eviction / close), "group"
        (ack after the batch's shared fsync), "sync" (own fsync); default: the Db's.
        tier: None (fastest tier with room) or "disk" (write to the disk tier only).
        """
        self._check()
        keys = normalize_keys(keys)
        n = len(keys)
        pages = self._as_pages(blocks, n, "blocks")
        pos = self._check_positions(positions, n)
        if tier not in (None, "disk"):
            raise InvalidInput(f"tier must be None or 'disk', got {tier!r}")
        durability = self._check_durability(durability, to_disk=tier == "disk")
        if ctx is not None:
            self._note_call_keys(ctx, keys)

        def place(rows: list[int], dirty: bool) -> None:
            if not rows:
                return
            rkeys, rpos = [keys[i] for i in rows], [pos[i] for i in rows]
            self.pool.insert(rkeys, self._select(pages, rows), rpos, dirty=dirty, ctx=ctx or AccessContext(positions=rpos))
            self._maybe_make_room()

        return self._store(keys, pos, lambda rows: self._select(pages, rows), durability,
                           None if tier == "disk" else place)

    def _check_durability(self, durability: str | None, to_disk: bool = False) -> str:
        durability = durability or self.default_durability
        if durability not in DURABILITIES:
            raise InvalidInput(f"durability must be one of {DURABILITIES}, got {durability!r}")
        if (durability != "none" or to_disk) and self._cold is None:
            raise InvalidInput(f"durability={durability!r}{' / tier=disk' if to_disk else ''} needs the disk tier "
                               "(open with disk_bytes != 0)")
        return durability

    def _store(self, keys: list[bytes], pos: list[int], pages_of, durability: str, place) -> int:
        """The one write path (put_blocks, commit_frames). Keys already stored -- in memory or
        on disk -- are skipped: the stored bytes stay the only copy, so memory and disk never
        disagree about a key. With durability "group"/"sync" the new pages, and resident pages
        not yet on disk, go to the disk tier first (outside the lock: writers share fsyncs);
        then ``place(rows, dirty)`` puts the new ones in memory under the lock (None: disk
        only). ``pages_of(rows)`` gives the pages of those rows. Returns how many were new."""
        with self._lock:
            self._check()
            seen: set[bytes] = set()
            fresh: list[int] = []  # not in memory
            persist: list[int] = []  # in memory, not yet on disk, and the caller asks for disk
            for i, k in enumerate(keys):
                if k in seen:
                    continue
                seen.add(k)
                code = self.pool.table.get(k)
                if code is None:
                    fresh.append(i)
                elif durability != "none" and self.pool.tiers[code & 1].dirty[code >> 1]:
                    persist.append(i)
        on_disk = [False] * len(fresh)
        if self._cold is not None and fresh:
            on_disk = self._cold_call(self._cold.contains, [keys[i] for i in fresh])
        new = [i for i, d in zip(fresh, on_disk) if not d]
        written = False
        if (durability != "none" or place is None) and (new or persist):
            rows = new + persist
            self._cold_call(self._cold.put, [keys[i] for i in rows], np.ascontiguousarray(pages_of(rows).cpu().numpy()),
                            [pos[i] for i in rows], durability)
            written = True
        if place is None:
            return len(new)
        with self._lock:
            self._check()
            for i in persist:  # now on disk: clean wherever the page lives
                code = self.pool.table.get(keys[i])
                if code is not None:
                    self.pool.tiers[code & 1].dirty[code >> 1] = 0
            rows = [i for i in new if keys[i] not in self.pool.table]  # another writer may have won
            place(rows, self._cold is not None and not written)
        return len(new)

    @staticmethod
    def _select(pages: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """pages[rows] without a copy when the rows are one consecutive run."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return pages[rows[0] : rows[0] + len(rows)]
        return pages[torch.as_tensor(rows, device=pages.device)]

    def _spill(self, keys: list, pages: torch.Tensor, positions: list, dirty: list) -> None:
        """Pages leaving memory (called by the pool under our lock): write back the dirty ones."""
        if self._cold is None:  # a pure cache: the page is simply dropped
            return
        idx = [i for i, d in enumerate(dirty) if d]
        if not idx:
            return
        arr = pages.numpy()
        if len(idx) != len(keys):
            arr = arr[idx]
        try:
            self._cold.put([keys[i] for i in idx], np.ascontiguousarray(arr), [positions[i] for i in idx], "none")
        except StorageIOError as e:
            self._fail(e)
            raise

    def _write_back_all(self) -> None:
        items = [(k, t, f) for k, t, f in self.pool.resident_items() if t.dirty[f]]
        if not items:
            return
        keys = [k for k, _, _ in items]
        pages = torch.empty((len(items), self.layout.page_bytes), dtype=torch.uint8)
        for t in self.pool.tiers:
            if t is None:
                continue
            rows = [i for i, (_, tt, _) in enumerate(items) if tt is t]
            if rows:
                t.arena.read([items[i][2] for i in rows], pages, rows)
        positions = [t.positions[f] for _, t, f in items]
        self._cold_call(self._cold.put, keys, pages.numpy(), positions, "sync")
        for _, t, f in items:
            t.dirty[f] = 0

    def flush(self) -> None:
        """Make every block stored so far durable (write back dirty pages, fsync)."""
        self._check()
        if self._cold is None:
            return
        with self._lock:
            self._write_back_all()
        self._cold_call(self._cold.flush)

    def delete(self, keys) -> int:
        """Delete keys from every tier; returns how many were stored. Unknown keys are ignored."""
        self._check()
        keys = normalize_keys(keys)
        with self._lock:
            self._unprotect(keys)
            found = [self.pool.delete(k) for k in keys]
        if self._cold is not None:
            on_disk = self._cold_call(self._cold.contains, keys)
            gone = [k for k, d in zip(keys, on_disk) if d]
            if gone:
                self._cold_call(self._cold.delete, gone)
            found = [a or b for a, b in zip(found, on_disk)]
        return sum(found)

    # ------------------------------------------------------------------ reads

    def match_prefix(self, keys, *, ctx: AccessContext | None = None, peek: bool = False) -> int:
        """How many leading keys are stored in any tier (the lookup; counts hits and misses).

        ``peek=True`` only checks: no stats, and the replacer is not told (use it to ask "is
        this stored?" without making it look recently used)."""
        self._check()
        keys = normalize_keys(keys)
        with self._lock:
            table = self.pool.table
            codes = [table.get(k) for k in keys]
            on_disk = [False] * len(keys)
            if self._cold is not None:
                idx = [i for i, c in enumerate(codes) if c is None]
                if idx:
                    for i, d in zip(idx, self._cold_call(self._cold.contains, [keys[i] for i in idx])):
                        on_disk[i] = d
            total, disk_hits, mem_hits = 0, 0, [0, 0]
            for c, d in zip(codes, on_disk):
                if c is not None:
                    mem_hits[c & 1] += 1
                elif d:
                    disk_hits += 1
                else:
                    break
                total += 1
            if not peek:
                self._count_lookup(mem_hits, disk_hits, total < len(keys))
                self.pool.touch(keys[:total], ctx)
                if ctx is not None:
                    self._note_call_keys(ctx, keys)
        if total < len(keys) and not peek and self._replicator is not None and self._replicator.peer_addrs:
            # a local miss may be served by a peer: fetched blocks are stored here, then counted
            now = self._replicator.fetch_missing(keys, local=total)
            self._remote_hits += now - total
            total = now
        return total

    def _count_lookup(self, mem_hits: list[int], disk_hits: int, missed: bool) -> None:
        dev, host = self.pool.tiers
        if dev is not None:
            dev.stats.hits += mem_hits[DEVICE]
            dev.stats.misses += mem_hits[HOST] + disk_hits + (1 if missed else 0)
        host.stats.hits += mem_hits[HOST]
        host.stats.misses += disk_hits + (1 if missed else 0)
        self._disk_hits += disk_hits
        if missed:
            self._lookup_misses += 1
        if self._cold is not None:
            self._cold.count_lookups(disk_hits, 1 if missed else 0)

    def contains(self, key) -> bool:
        """Whether one key is stored in any tier (a peek: no stats, no recency)."""
        return self.match_prefix([key], peek=True) == 1

    def _read_disk(self, keys: list[bytes]) -> tuple[np.ndarray, list[bool]]:
        """Read keys from the disk tier into a staging buffer; found[i] False = absent or corrupt."""
        buf = np.empty((len(keys), self.layout.page_bytes), dtype=np.uint8)
        if self._cold is None or not keys:
            return buf, [False] * len(keys)
        found = self._cold_call(self._cold.get_into, keys, buf)
        self._reads[2] += sum(found)
        return buf, found

    def _promote_from_disk(self, keys: list[bytes], buf: np.ndarray) -> None:
        """Place pages read from disk in the host tier (clean: they are on disk already)."""
        rows = list({k: i for i, k in reversed(list(enumerate(keys)))}.values())  # first row of each key
        if len(rows) != len(keys):
            keys, buf = [keys[i] for i in rows], buf[rows]
        if keys:
            self.pool.insert(keys, torch.from_numpy(buf), [-1] * len(keys), dirty=False, start_tier=HOST)

    def _load_from_disk(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Read keys from the disk tier into memory (promotion). Returns (loaded, missing)."""
        buf, found = self._read_disk(keys)
        ok = [i for i, f in enumerate(found) if f]
        loaded = [keys[i] for i in ok]
        self._promote_from_disk(loaded, buf[ok] if len(ok) != len(keys) else buf)
        return loaded, [keys[i] for i, f in enumerate(found) if not f]

    def get_blocks(self, keys, out: torch.Tensor, *, ctx: AccessContext | None = None) -> None:
        """Copy the blocks of ``keys`` into ``out[:len(keys)]`` bit-exact; NotFound names absent keys.

        ``out``: a preallocated tensor [>= len(keys), *layout.block_shape] of the layout dtype
        on the CPU or the device tier's device. Nothing is written when a key is missing.
        Blocks read from disk go straight into ``out`` and are then promoted to the host tier.
        """
        self._read_into(keys, out, ctx, prefix=False)

    def get_prefix(self, keys, out: torch.Tensor, *, ctx: AccessContext | None = None) -> int:
        """Copy the longest leading run of readable blocks of ``keys`` into ``out``; return its
        length. A block that is absent or fails its checksum ends the run (never wrong bytes)."""
        return self._read_into(keys, out, ctx, prefix=True)

    def _read_into(self, keys, out: torch.Tensor, ctx: AccessContext | None, prefix: bool) -> int:
        self._check()
        keys = normalize_keys(keys)
        n = len(keys)
        dst = self._as_pages(out, n, "out", allow_larger=True)
        with self._lock:
            self._check()
            table = self.pool.table
            codes = [table.get(k) for k in keys]
            if prefix and self._cold is None:  # the run ends at the first key not in memory
                n = next((i for i, c in enumerate(codes) if c is None), n)
                keys, codes = keys[:n], codes[:n]
            absent_rows = [i for i, c in enumerate(codes) if c is None]
            buf = None
            if absent_rows:
                buf, found = self._read_disk([keys[i] for i in absent_rows])
                if not all(found):
                    if not prefix:
                        missing = [keys[i] for i, f in zip(absent_rows, found) if not f]
                        raise NotFound(f"{len(missing)} of {n} keys are not stored (or failed their checksum): "
                                       f"{_describe_keys(missing)}")
                    n = absent_rows[found.index(False)]
                    keep = [j for j, i in enumerate(absent_rows) if i < n]
                    absent_rows, buf = absent_rows[: len(keep)], buf[: len(keep)]
                    keys, codes = keys[:n], codes[:n]
            per_tier: list[tuple[list, list]] = [([], []), ([], [])]
            for i, c in enumerate(codes):
                if c is not None:
                    fr, rows = per_tier[c & 1]
                    fr.append(c >> 1)
                    rows.append(i)
            for t, (fr, rows) in zip(self.pool.tiers, per_tier):
                if fr:
                    t.arena.read(fr, dst, rows)
                    self._reads[t.index] += len(fr)
            if absent_rows:
                rows_t = torch.as_tensor(absent_rows, dtype=torch.long, device=dst.device)
                dst.index_copy_(0, rows_t, torch.from_numpy(buf).to(dst.device))
                self.pool.touch([k for k, c in zip(keys, codes) if c is not None], ctx)
                self._promote_from_disk([keys[i] for i in absent_rows], buf)
            else:
                self.pool.touch(keys, ctx)
        return n

    def pin(self, keys, *, ctx: AccessContext | None = None, prefix: bool = False) -> PinnedPages:
        """Pin keys' pages in memory and return zero-copy views (a context manager).

        Keys on disk are loaded into the host tier first; CapacityError when they cannot all be
        resident at once (every other frame pinned, or more keys than frames). A key that is
        not stored (or fails its checksum) raises NotFound, or with ``prefix=True`` ends the
        pinned run there: ``len(pages)`` is then the longest readable prefix.
        """
        self._check()
        keys = normalize_keys(keys)
        with self._lock:
            self._check()
            handles: dict[int, tuple[Tier, int]] = {}
            try:
                for i, k in enumerate(keys):  # resident pages first, so loading cannot evict them
                    if k in self.pool.table:
                        handles[i] = self.pool.pin(k)
                absent_rows = [i for i in range(len(keys)) if i not in handles]
                if absent_rows:
                    loaded, missing = self._load_from_disk([keys[i] for i in absent_rows])
                    if missing and not prefix:
                        raise NotFound(f"cannot pin {len(missing)} keys that are not stored: {_describe_keys(missing)}")
                    if missing:
                        gone = set(missing)
                        stop = next(i for i in absent_rows if keys[i] in gone)
                        for i in [i for i in handles if i >= stop]:
                            self.pool.unpin(*handles.pop(i))
                        keys = keys[:stop]
                        absent_rows = [i for i in absent_rows if i < stop]
                    for i in absent_rows:
                        if keys[i] not in self.pool.table:
                            raise CapacityError(f"cannot pin {len(keys)} pages at once: not enough unpinned frames")
                        handles[i] = self.pool.pin(keys[i])
            except BaseException:
                for t, f in handles.values():
                    self.pool.unpin(t, f)
                raise
            ordered = [handles[i] for i in range(len(keys))]
            lay = self.layout
            pages = [t.arena.page(f).view(lay.dtype).view(lay.block_shape) for t, f in ordered]
            self.pool.touch(keys, ctx)
        return PinnedPages(self, ordered, pages)

    def _unpin(self, handles) -> None:
        with self._lock:
            for t, f in handles:
                self.pool.unpin(t, f)

    def prefetch(self, keys, *, wait: bool = True):
        """Bring keys into the fastest tier ahead of use (disk -> host -> device), in one batch
        on the background mover. Returns pages moved up, or a Future of it with wait=False."""
        self._check()
        keys = normalize_keys(keys)
        fut = self._mover.submit(self._prefetch_now, keys)
        return fut.result() if wait else fut

    def _prefetch_now(self, keys: list[bytes]) -> int:
        with self._lock:
            self._check()
            absent = [k for k in keys if k not in self.pool.table]
            loaded, _ = self._load_from_disk(absent)
            return self.pool.promote([k for k in keys if k in self.pool.table]) + len(loaded)

    def offload(self, keys, *, to: str = "host", wait: bool = True):
        """Move keys down a tier ahead of need, in one batch on the background mover: to="host"
        demotes device pages; to="disk" writes dirty pages back and frees their memory (needs
        the disk tier). Pinned pages stay. Returns pages moved, or a Future with wait=False."""
        self._check()
        if to not in ("host", "disk"):
            raise InvalidInput(f"offload to must be 'host' or 'disk', got {to!r}")
        if to == "disk" and self._cold is None:
            raise InvalidInput("offload to='disk' needs the disk tier (open with disk_bytes != 0)")
        keys = normalize_keys(keys)
        fut = self._mover.submit(self._offload_now, keys, HOST if to == "host" else None)
        return fut.result() if wait else fut

    def _offload_now(self, keys: list[bytes], to_tier: int | None) -> int:
        with self._lock:
            self._check()
            return self.pool.offload(keys, to_tier)

    def _maybe_make_room(self) -> None:
        """After a put: keep the device tier's free frames at its watermark, in the background,
        so the next put into the device tier does not wait for a demotion. Called under _lock."""
        self._plan_pressure()
        dev = self.pool.tiers[DEVICE]
        if dev is None or self._room_pending or len(dev.free) >= self._device_free_target:
            return
        self._room_pending = True
        self._mover.submit(self._make_room_now)

    def _make_room_now(self) -> None:
        with self._lock:
            self._room_pending = False
            if self._state == "open":
                self.pool.make_room(DEVICE, self._device_free_target)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Per tier: pages, capacity, bytes, hits, misses, evictions (and more)."""
        self._check()
        with self._lock:
            out: dict = {"model_id": self.model_id, "layout": self.layout.to_dict(),
                         "page_bytes": self.layout.page_bytes, "tiers": {}}
            for t in self.pool.tiers:
                if t is None:
                    continue
                s = t.stats
                out["tiers"][t.name] = {
                    "pages": t.num_resident,
                    "capacity_pages": t.num_frames,
                    "bytes": t.num_resident * self.layout.page_bytes,
                    "capacity_bytes": t.arena.capacity_bytes,
                    "pinned_pages": sum(1 for p in t.pins if p),
                    "hits": s.hits,
                    "misses": s.misses,
                    "reads": self._reads[t.index],
                    "inserts": s.inserts,
                    "evictions": s.evictions,
                    "demotions": s.demotions,
                    "promotions": s.promotions,
                    "device": str(t.arena.device),
                }
            if self._cold is not None:
                disk = dict(self._cold.stats())
                # lookups, as for the other tiers; the store's own read counters keep their names
                disk["store_hits"], disk["store_misses"] = disk.pop("hits", 0), disk.pop("misses", 0)
                del disk["lookup_hits"], disk["lookup_misses"]  # the Db's own, reported just below
                disk["hits"] = self._disk_hits
                disk["misses"] = self._lookup_misses
                disk["reads"] = self._reads[2]
                out["tiers"]["disk"] = disk
            out["lookup_misses"] = self._lookup_misses
            out["remote_hits"] = self._remote_hits
            out["sessions"] = self.planner.num_sessions
            out["hints"] = dict(self.planner.outcome_counts)
            out["plans"] = self._plans_stats()
            return out


def _check_space_amp(value) -> float | None:
    from kvdb.cold.store import check_space_amp  # the disk tier's own check (kvdb/cold/store.py)

    return check_space_amp(value)


def open(path: str | os.PathLike, **kwargs) -> Db:  # noqa: A001 - mirrors sqlite3.connect / rocksdb open
    """Open (creating when new) the kvdb data directory at ``path``. See :class:`Db` for options."""
    return Db(path, **kwargs)
