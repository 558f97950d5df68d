"""Moves on the Db: ``prefetch`` (up the tiers), ``offload`` (down), the device tier's watermark.

Part of the class ``kvdb.db.core.Db`` (a mixin; its state and lock are the Db's). Every move
runs on the Db's one background mover (kvdb/db/mover.py), so moves apply in submission order,
and under the Db's lock (they change the page table); the moves the plans make
(kvdb/db/plans/) go through ``_bring_up`` and the pool's ``offload`` too.
"""

from __future__ import annotations

import time

from kvdb.buffer_pool.pool import DEVICE, HOST
from kvdb.errors import InvalidInput
from kvdb.keys import normalize_keys


class MovesMixin:
    def _init_moves(self, device_frames: int, device_free_fraction: float) -> None:
        self._room_pending = False
        self._device_free_target = int(device_frames * device_free_fraction)

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
            pool = self.pool
            absent = [k for k in keys if k not in pool]
            loaded, _ = self._load_from_disk(absent)
            return pool.promote([k for k in keys if k in pool]) + len(loaded)

    def _bring_up(self, keys) -> tuple[int, float]:
        """Keys toward the device tier (disk -> host -> device); (pages moved, seconds).
        Caller holds the lock (a planned move: kvdb/db/plans/)."""
        t0 = time.perf_counter()
        pool = self.pool
        absent = [k for k in keys if k not in pool]
        loaded = self._load_from_disk(absent)[0] if absent and self._cold is not None else []
        moved = pool.promote(pool.keys_in(HOST, keys))
        return moved + len(loaded), time.perf_counter() - t0

    def offload(self, keys, *, to: str = "host", wait: bool = True):
        """Move keys down a tier ahead of need, in one batch on the background mover: to="host"
        demotes device pages; to="disk" writes dirty pages back and frees their memory (needs
        the disk tier). Pinned pages stay. Returns pages moved, or a Future with wait=False."""
        self._check_writable()
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

    def _device_at_watermark(self) -> bool:
        """The device tier exists and has no more free frames than its watermark
        (``device_free_fraction``; full when 0)."""
        return self.pool.has_device and self.pool.free_frames(DEVICE) <= self._device_free_target

    def _maybe_make_room(self) -> None:
        """After a put: keep the device tier's free frames at its watermark, in the background,
        so the next put into the device tier does not wait for a demotion. Called under _lock."""
        self._plan_pressure()
        pool = self.pool
        if not pool.has_device or self._room_pending or pool.free_frames(DEVICE) >= self._device_free_target:
            return
        self._room_pending = True
        self._mover.submit(self._make_room_now)

    def _make_room_now(self) -> None:
        with self._lock:
            self._room_pending = False
            if self._state == "open":
                self.pool.make_room(DEVICE, self._device_free_target)
