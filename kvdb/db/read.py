"""Reads on the Db: the lookup (``match_prefix``), ``get_blocks`` / ``get_prefix``, ``pin``.

Part of the class ``kvdb.db.core.Db`` (a mixin; its state and lock are the Db's). How lookups
count hits and misses is documented at the top of kvdb/db/core.py. A page read from disk lands
in the caller's tensor first and is then promoted into the host tier (clean: it is on disk).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvdb.buffer_pool.pool import HOST
from kvdb.buffer_pool.replacer import AccessContext
from kvdb.db.handles import PinnedPages
from kvdb.errors import CapacityError, NotFound
from kvdb.keys import normalize_keys


def describe_keys(keys: Sequence[bytes], limit: int = 4) -> str:
    shown = ", ".join(k.hex() for k in keys[:limit])
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return shown + more


class ReadMixin:
    def match_prefix(self, keys, *, ctx: AccessContext | None = None, peek: bool = False) -> int:
        """How many leading keys are stored in any tier (the lookup; counts hits and misses).

        ``peek=True`` only checks: no stats, and the replacer is not told (use it to ask "is
        this stored?" without making it look recently used)."""
        self._check()
        keys = normalize_keys(keys)
        with self._lock:
            tiers = self.pool.tiers_of(keys)
            on_disk = [False] * len(keys)
            if self._cold is not None:
                idx = [i for i, t in enumerate(tiers) if t is None]
                if idx:
                    for i, d in zip(idx, self._cold_call(self._cold.contains, [keys[i] for i in idx])):
                        on_disk[i] = d
            total, disk_hits, mem_hits = 0, 0, [0, 0]
            for t, d in zip(tiers, on_disk):
                if t is not None:
                    mem_hits[t] += 1
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
        if total < len(keys) and not peek:
            total = self._on_lookup_miss(keys, total)  # a layer above may serve it (kvdb/db/attached.py)
        return total

    def _count_lookup(self, mem_hits: list[int], disk_hits: int, missed: bool) -> None:
        self.pool.count_lookup(mem_hits, disk_hits + (1 if missed else 0))
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
        self._disk_reads += sum(found)
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
            absent_rows = self.pool.absent_rows(keys)
            if prefix and self._cold is None and absent_rows:  # the run ends at the first key not in memory
                n = absent_rows[0]
                keys, absent_rows = keys[:n], []
            buf = None
            if absent_rows:
                buf, found = self._read_disk([keys[i] for i in absent_rows])
                if not all(found):
                    if not prefix:
                        missing = [keys[i] for i, f in zip(absent_rows, found) if not f]
                        raise NotFound(f"{len(missing)} of {n} keys are not stored (or failed their checksum): "
                                       f"{describe_keys(missing)}")
                    n = absent_rows[found.index(False)]
                    keep = [j for j, i in enumerate(absent_rows) if i < n]
                    absent_rows, buf = absent_rows[: len(keep)], buf[: len(keep)]
                    keys = keys[:n]
            if absent_rows:
                absent = set(absent_rows)
                rows = [i for i in range(n) if i not in absent]
                resident = [keys[i] for i in rows]
                self.pool.read_into(resident, dst, rows)
                rows_t = torch.as_tensor(absent_rows, dtype=torch.long, device=dst.device)
                dst.index_copy_(0, rows_t, torch.from_numpy(buf).to(dst.device))
                self.pool.touch(resident, ctx)
                self._promote_from_disk([keys[i] for i in absent_rows], buf)
            else:
                self.pool.read_into(keys, dst)
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
        pool = self.pool
        with self._lock:
            self._check()
            handles: dict[int, tuple] = {}
            try:
                absent_rows = pool.absent_rows(keys)
                absent = set(absent_rows)
                for i, k in enumerate(keys):  # resident pages first, so loading cannot evict them
                    if i not in absent:
                        handles[i] = pool.pin(k)
                if absent_rows:
                    loaded, missing = self._load_from_disk([keys[i] for i in absent_rows])
                    if missing and not prefix:
                        raise NotFound(f"cannot pin {len(missing)} keys that are not stored: {describe_keys(missing)}")
                    if missing:
                        gone = set(missing)
                        stop = next(i for i in absent_rows if keys[i] in gone)
                        for i in [i for i in handles if i >= stop]:
                            pool.unpin(*handles.pop(i))
                        keys = keys[:stop]
                        absent_rows = [i for i in absent_rows if i < stop]
                    for i in absent_rows:
                        if keys[i] not in pool:
                            raise CapacityError(f"cannot pin {len(keys)} pages at once: not enough unpinned frames")
                        handles[i] = pool.pin(keys[i])
            except BaseException:
                for t, f in handles.values():
                    pool.unpin(t, f)
                raise
            ordered = [handles[i] for i in range(len(keys))]
            lay = self.layout
            pages = [pool.page(h).view(lay.dtype).view(lay.block_shape) for h in ordered]
            pool.touch(keys, ctx)
        return PinnedPages(self._unpin, ordered, pages)

    def _unpin(self, handles) -> None:
        with self._lock:
            for t, f in handles:
                self.pool.unpin(t, f)
