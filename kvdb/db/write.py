"""Writes on the Db: ``put_blocks``, the one write path, write-back of dirty pages, flush, delete.

Part of the class ``kvdb.db.core.Db`` (a mixin; its state and lock are the Db's).

A page is *dirty* while memory holds it and the cold tier does not (the pool keeps the bit,
kvdb/buffer_pool/pool.py). Durability "none" acknowledges once the page is in memory (dirty);
it reaches the disk tier when it is evicted (the pool's spill callback, ``_spill``), flushed or
the Db closes. "group" and "sync" write the page to the disk tier before acknowledging (clean).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from kvdb.buffer_pool.replacer import AccessContext
from kvdb.buffer_pool.tier import MAX_POSITION
from kvdb.errors import InvalidInput, StorageIOError
from kvdb.keys import normalize_keys
from kvdb.types import DURABILITIES

#: the most bytes one write-back batch puts (a view of the arena, or a copy of scattered pages)
WRITE_BACK_BYTES = 256 << 20


class WriteMixin:
    def put_blocks(self, keys, blocks: torch.Tensor, *, positions: Sequence[int] | None = None,
                   durability: str | None = None, tier: str | None = None,
                   ctx: AccessContext | None = None) -> int:
        """Store blocks under keys; keys already stored are skipped. Returns how many were new.

        durability: "none" (ack at once; written back to disk on eviction / close), "group"
        (ack after the batch's shared fsync), "sync" (own fsync); default: the Db's.
        tier: None (fastest tier with room) or "disk" (write to the disk tier only).
        """
        self._check_writable()
        keys = normalize_keys(keys)
        n = len(keys)
        pages = self._as_pages(blocks, n, "blocks")
        pos = self._check_positions(positions, n)
        if tier not in (None, "disk"):
            raise InvalidInput(f"tier must be None or 'disk', got {tier!r}")
        durability = self._check_durability(durability, to_disk=tier == "disk")
        self._check_ctx(ctx)
        if ctx is not None:
            self._note_call_keys(ctx, keys)

        placed: list[int] = []  # rows stored new in memory: offered to the shared tier after

        def place(rows: list[int], dirty: bool) -> None:
            if not rows:
                return
            rkeys, rpos = [keys[i] for i in rows], [pos[i] for i in rows]
            self.pool.insert(rkeys, self._select(pages, rows), rpos, dirty=dirty, ctx=ctx or AccessContext(positions=rpos))
            self._maybe_make_room()
            placed.extend(rows)

        new = self._store(keys, pos, lambda rows: self._select(pages, rows), durability,
                          None if tier == "disk" else place)
        self._offer_shared(keys, pages, placed)  # kvdb/db/attached.py: never waits for the pool
        return new

    def _check_positions(self, positions, n: int) -> list[int]:
        if positions is None:
            return [-1] * n
        if isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
            raise InvalidInput(f"positions must be a sequence of {n} ints, got {type(positions).__name__}")
        pos = list(positions)
        if len(pos) != n:
            raise InvalidInput(f"positions has {len(pos)} entries for {n} keys; give one block depth per key")
        for p in pos:
            if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or not 0 <= p <= MAX_POSITION:
                raise InvalidInput(f"positions must be ints in [0, {MAX_POSITION}] (block depth of each key; the "
                                   f"pool keeps them as int32), got {p!r}")
        return [int(p) for p in pos]

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
        pool = self.pool
        with self._lock:
            self._check()
            fresh: list[int] = pool.absent_rows(keys)  # not in memory
            persist: list[int] = []  # in memory, not yet on disk, and the caller asks for disk
            if len(fresh) != len(keys) or len(set(keys)) != len(keys):  # else: all new, no repeats
                seen: set[bytes] = set()
                absent = set(fresh)
                fresh = []
                for i, k in enumerate(keys):
                    if k in seen:
                        continue
                    seen.add(k)
                    if i in absent:
                        fresh.append(i)
                    elif durability != "none" and pool.is_dirty(k):
                        persist.append(i)
        if place is None:  # disk only (the disk tier exists: _check_durability): it skips what it holds, one lookup
            rows = fresh + persist
            if not rows:
                return 0
            written = self._cold_call(self._cold.put, [keys[i] for i in rows],
                                      np.ascontiguousarray(pages_of(rows).cpu().numpy()), [pos[i] for i in rows],
                                      durability, if_absent=True)
            return sum(written[: len(fresh)])
        on_disk = [False] * len(fresh)
        if self._cold is not None and fresh:
            on_disk = self._cold_call(self._cold.contains, [keys[i] for i in fresh])
        new = [i for i, d in zip(fresh, on_disk) if not d]
        written = False
        if durability != "none" and (new or persist):
            rows = new + persist
            self._cold_call(self._cold.put, [keys[i] for i in rows], np.ascontiguousarray(pages_of(rows).cpu().numpy()),
                            [pos[i] for i in rows], durability)
            written = True
        with self._lock:
            self._check()
            pool.mark_clean([keys[i] for i in persist])  # now on disk: clean wherever the page lives
            rows = [new[j] for j in pool.absent_rows([keys[i] for i in new])]  # another writer may have won
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
        """Caller holds our lock: every dirty page to the log (the caller's flush or the close's
        checkpoint makes it durable). In batches of at most WRITE_BACK_BYTES written straight
        from the arena (kvdb/buffer_pool/dirty.py ``dirty_batches``): no copy of the whole dirty
        set into fresh memory, whose first touch cost more than the disk write (a 4 GiB close
        ran at ~0.1x the disk's speed)."""
        for keys, pages, positions in self.pool.dirty_batches(WRITE_BACK_BYTES):
            self._cold_call(self._cold.put, keys, pages.numpy(), positions, "none")
            self.pool.mark_clean(keys)

    def flush(self, wait: bool = True) -> None:
        """Make every block stored so far durable (write back dirty pages, fsync) and, with a
        shared tier, published to the pool (or dropped: docs/shared.md S2). ``wait=False`` hands
        the write-back to the background writer (kvdb/db/writeback.py) and returns at once: an
        engine calls it after a step's saves so that a stop soon after finds them on disk."""
        self._check()
        if not wait:
            if self._writer is not None:
                self._writer.kick()
                return
        if self._shared is not None:
            self._shared.wait_published()
        if self._cold is None:
            return
        with self._lock:
            self._write_back_all()
        self._cold_call(self._cold.flush)

    def delete(self, keys) -> int:
        """Delete keys from every tier; returns how many were stored. Unknown keys are ignored."""
        self._check_writable()
        keys = normalize_keys(keys)
        with self._writeback_mu:  # no background batch writes these back behind us (kvdb/db/writeback.py B3)
            with self._lock:
                self._unprotect(keys)
                found = [self.pool.delete(k) for k in keys]
            if self._cold is not None:
                on_disk = self._cold_call(self._cold.contains, keys)
                gone = [k for k, d in zip(keys, on_disk) if d]
                if gone:
                    self._cold_call(self._cold.delete, gone)
                found = [a or b for a, b in zip(found, on_disk)]
        if self._shared is not None:
            self._shared.remove(keys)
        return sum(found)
