"""Reads on the Db: the lookup (``match_prefix``), ``get_blocks`` / ``get_prefix``, ``pin``.

Part of the class ``kvdb.db.core.Db`` (a mixin; its state and lock are the Db's). How lookups
count hits and misses is documented at the top of kvdb/db/core.py.

One copy on reads: a page read from disk lands in the caller's ``out`` directly (a CPU ``out``:
``preadv`` into its rows; a device ``out``: into one reused host staging buffer, then one
host-to-device copy) and is then promoted into the host tier (clean: it is on disk) by a copy
from those same bytes, never a second read. Every disk read is checked (C3, kvdb/cold/read.py):
a block that fails is a miss, its row zeroed. Keys stored nowhere are found before any read, so
they write nothing; after a failed check the rows read in that call (past a prefix's end, or
all of them for NotFound) are unspecified.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvdb.buffer_pool.arena import cuda_available, frame_runs
from kvdb.buffer_pool.pool import HOST
from kvdb.buffer_pool.replacer import AccessContext
from kvdb.db.handles import PinnedPages
from kvdb.errors import CapacityError, NotFound
from kvdb.keys import normalize_keys


def describe_keys(keys: Sequence[bytes], limit: int = 4) -> str:
    shown = ", ".join(k.hex() for k in keys[:limit])
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return shown + more


#: a device ``out``'s staging buffer is kept between reads up to this size (bigger: per call)
STAGE_KEEP_BYTES = 256 << 20


class ReadMixin:
    _read_stage: torch.Tensor | None = None  # the reused host staging buffer (device reads)

    def match_prefix(self, keys, *, ctx: AccessContext | None = None, peek: bool = False) -> int:
        """How many leading keys are stored in any tier (the lookup; counts hits and misses).

        ``peek=True`` only checks: no stats, and the replacer is not told (use it to ask "is
        this stored?" without making it look recently used)."""
        self._check()
        keys = normalize_keys(keys)
        self._check_ctx(ctx)
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
        if self._cold is not None and (disk_hits or missed):  # no stats lock for nothing to count
            self._cold.count_lookups(disk_hits, 1 if missed else 0)

    def contains(self, key) -> bool:
        """Whether one key is stored in any tier (a peek: no stats, no recency)."""
        return self.match_prefix([key], peek=True) == 1

    def _read_disk(self, keys: list[bytes], entries: list) -> tuple[np.ndarray, list[bool]]:
        """Read keys (at ``entries``, their disk tier lookup) into a staging buffer; found[i]
        False = absent or corrupt."""
        buf = np.empty((len(keys), self.layout.page_bytes), dtype=np.uint8)
        if self._cold is None or not keys:
            return buf, [False] * len(keys)
        found = self._cold_call(self._cold.get_into, keys, buf, None, entries)
        self._disk_reads += sum(found)
        return buf, found

    def _promote_from_disk(self, keys: list[bytes], src: torch.Tensor, rows: list[int] | None = None,
                           defer: list | None = None) -> None:
        """Place pages read from disk in the host tier (clean: they are on disk already), copied
        from ``src[rows[i]]`` (rows default 0..n-1): the rows the read landed in; ``keys``
        distinct. ``defer``:
        the pool's ``insert`` list of replacer notices (``record_inserted``)."""
        if keys:  # each key once (the callers see to it: insert takes keys not resident)
            self.pool.insert(keys, src, [-1] * len(keys), dirty=False, start_tier=HOST, rows=rows, defer=defer)

    def _stage(self, k: int) -> torch.Tensor:
        """A host buffer of ``k`` pages for reads into a device ``out`` (pinned when CUDA is
        present), reused between calls (under the Db lock) up to STAGE_KEEP_BYTES."""
        st = self._read_stage
        if st is None or st.shape[0] < k:
            with torch.inference_mode(False):
                st = torch.empty((k, self.layout.page_bytes), dtype=torch.uint8, pin_memory=cuda_available())
            if st.numel() <= STAGE_KEEP_BYTES:
                self._read_stage = st
        return st[:k]

    @staticmethod
    def _reads_in_place(dst: torch.Tensor) -> bool:
        """Whether disk reads can land in ``dst`` itself (CPU memory), not a staging buffer."""
        return dst.device.type == "cpu"

    def _read_disk_into(self, keys: list[bytes], dst: torch.Tensor, rows: list[int], entries: list) -> list[bool]:
        """Read keys (at ``entries``, their disk tier lookup) into ``dst[rows[i]]`` with one copy,
        and promote them into the host tier from the bytes read, a checked slice at a time while
        the next slices are still being read (the promotion's copy overlaps the device's reads)."""
        if self._reads_in_place(dst):
            src, src_rows = dst, rows
        else:
            src, src_rows = self._stage(len(keys)), list(range(len(keys)))
        promoted: set[bytes] = set()
        notices: list = []  # the replacer hears of the promoted pages once, as one request

        def promote(idx: list[int]) -> None:  # a key twice in one call: promoted once
            idx = [i for i in idx if keys[i] not in promoted and not promoted.add(keys[i])]
            if idx:
                self._promote_from_disk([keys[i] for i in idx], src, [src_rows[i] for i in idx], notices)

        try:
            found = self._cold_call(self._cold.read_rows, keys, src.detach().numpy(), src_rows, entries, promote)
        finally:
            self.pool.record_inserted(notices)
        self._disk_reads += sum(found)
        if src is not dst:
            ok = [j for j, f in enumerate(found) if f]
            for d0, s0, m in frame_runs(ok, [rows[j] for j in ok]):  # one copy per run of rows
                dst[d0 : d0 + m].copy_(src[s0 : s0 + m], non_blocking=src.is_pinned())
            if src.is_pinned():
                torch.cuda.current_stream(dst.device).synchronize()
        return found

    def _load_from_disk(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Read keys from the disk tier into memory (promotion; caller holds the lock). Returns
        (loaded, missing). The pages are read straight into host frames lent for them (pool
        P6: one copy, none through a staging buffer); when the host tier cannot lend one frame
        a key (every other frame pinned), through a staging buffer and ``insert``, which places
        what fits."""
        keys = list(dict.fromkeys(keys))
        if self._cold is None or not keys:
            return [], keys
        entries = self._cold_call(self._cold.lookup, keys)  # one lookup: for the check and the read
        absent = [k for k, e in zip(keys, entries) if e is None]  # no frame (no eviction) for these
        keys = [k for k, e in zip(keys, entries) if e is not None]
        entries = [e for e in entries if e is not None]
        pool = self.pool
        try:
            frames = pool.reserve_host_frames(len(keys)) if keys else None
        except CapacityError:
            frames = None
        if frames is None:
            buf, found = self._read_disk(keys, entries)
            ok = [i for i, f in enumerate(found) if f]
            loaded = [keys[i] for i in ok]
            self._promote_from_disk(loaded, torch.from_numpy(buf), ok)
            return loaded, absent + [keys[i] for i, f in enumerate(found) if not f]
        try:
            found = self._cold_call(self._cold.get_into, keys, pool.host_arena().numpy(), frames, entries)
        except BaseException:
            pool.release_host_frames(frames)
            raise
        self._disk_reads += sum(found)
        loaded = [k for k, f in zip(keys, found) if f]
        pool.commit_host_frames(loaded, [fr for fr, f in zip(frames, found) if f], [-1] * len(loaded), dirty=False)
        pool.release_host_frames([fr for fr, f in zip(frames, found) if not f])
        return loaded, absent + [k for k, f in zip(keys, found) if not f]

    def get_blocks(self, keys, out: torch.Tensor, *, ctx: AccessContext | None = None) -> None:
        """Copy the blocks of ``keys`` into ``out[:len(keys)]`` bit-exact; NotFound names absent keys.

        ``out``: a preallocated tensor [>= len(keys), *layout.block_shape] of the layout dtype
        on the CPU or the device tier's device. Blocks read from disk land straight in ``out``
        (one copy) and are promoted to the host tier from there. Nothing is written when a key
        is not stored; when a stored block fails its checksum (NotFound too), the rows of
        ``out`` read from disk in that call are unspecified (the damaged one's is zeroed).
        """
        self._read_into(keys, out, ctx, prefix=False)

    def get_prefix(self, keys, out: torch.Tensor, *, ctx: AccessContext | None = None) -> int:
        """Copy the longest leading run of readable blocks of ``keys`` into ``out``; return its
        length. A block that is absent or fails its checksum ends the run (never wrong bytes);
        rows of ``out`` past the run are unspecified."""
        return self._read_into(keys, out, ctx, prefix=True)

    def _read_into(self, keys, out: torch.Tensor, ctx: AccessContext | None, prefix: bool) -> int:
        self._check()
        keys = normalize_keys(keys)
        n = len(keys)
        dst = self._as_pages(out, n, "out", allow_larger=True)
        self._check_ctx(ctx)
        self._fill_from_shared(keys)  # kvdb/db/attached.py: keys on no local tier, from the pool
        with self._lock:
            self._check()
            absent_rows = self.pool.absent_rows(keys)
            if absent_rows:
                # keys on no tier end a prefix or fail the call before any byte is written; the
                # disk tier's lookup is made once, for this check and the read
                absent_keys = keys if len(absent_rows) == n else [keys[i] for i in absent_rows]
                entries = self._cold_call(self._cold.lookup, absent_keys) \
                    if self._cold is not None else [None] * len(absent_rows)
                on_disk = [e is not None for e in entries]
                if not all(on_disk):
                    if not prefix:
                        missing = [keys[i] for i, d in zip(absent_rows, on_disk) if not d]
                        raise NotFound(f"{len(missing)} of {n} keys are not stored: {describe_keys(missing)}")
                    stop = on_disk.index(False)
                    n = absent_rows[stop]
                    keys, absent_rows, entries = keys[:n], absent_rows[:stop], entries[:stop]
                    absent_keys = absent_keys[:stop]
            if absent_rows:
                # resident pages first: promoting the pages read from disk may evict them
                if len(absent_rows) == n:
                    rows = []
                else:
                    absent = set(absent_rows)
                    rows = [i for i in range(n) if i not in absent]
                    self.pool.read_into([keys[i] for i in rows], dst, rows)
                # then straight into out's rows (C3 checked), promoted as they are checked; a
                # block that fails its check ends a prefix there or raises NotFound, the rows
                # already read then unspecified (the pages promoted are correct: they passed)
                found = self._read_disk_into(absent_keys, dst, absent_rows, entries)
                if not all(found):
                    if not prefix:
                        missing = [keys[i] for i, f in zip(absent_rows, found) if not f]
                        raise NotFound(f"{len(missing)} of {n} keys are not stored (or failed their checksum): "
                                       f"{describe_keys(missing)}")
                    n = absent_rows[found.index(False)]
                if rows:
                    self.pool.touch([keys[i] for i in rows if i < n], ctx)  # what the caller gets
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
        self._check_ctx(ctx)
        self._fill_from_shared(keys)
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
