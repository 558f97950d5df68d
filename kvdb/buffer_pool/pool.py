"""The buffer pool: page table, page frames in a device and a host tier, pins, replacers.

Tiers are ordered fastest first: ``device`` (optional; CUDA when asked for and present, the
CPU otherwise) then ``host`` (DRAM, pinned under CUDA). Below the host tier the pool knows
only a *spill* callback: the Db writes spilled pages to the cold tier (kvdb/cold/) or drops
them. Everything here runs under the Db's lock; the pool itself holds no lock.

Page table: one dict ``key -> code`` with ``code = frame << 1 | tier`` for every page resident
in memory. Per-frame state lives in flat arrays (array/bytearray) of each tier
(kvdb/buffer_pool/tier.py), not in an object per page, so a million resident pages cost ~150
bytes each of metadata (``kvdb bench datapath`` measures it). Only this module reads the table,
decodes its codes and writes the per-frame arrays; the Db asks (``in``, ``tier_of``,
``tiers_of``, ``keys_in``, ``absent_rows``, ``is_dirty``, ``dirty_batches``, ``read_into``) and tells
(``insert``, ``mark_clean``, ``pin``, ``promote``, ``offload``, ``delete``, ...).

Invariants (tests cite them):
  P1  a key is resident in at most one tier; table[key] names a frame whose keys[] is key.
  P2  a frame is exactly one of: free (on the free list), resident-unpinned (known to the
      replacer, evictable), resident-pinned (known, not evictable).
  P3  a pinned frame is never evicted, demoted or overwritten; pins nest (a count).
  P4  resident pages of a tier never exceed its frame count (capacity accounting is exact).
  P5  a page leaves memory only through the spill callback (eviction from the last tier) or
      through delete; eviction from the device tier demotes to the host tier when it can.
  P6  a *reserved* host frame (``reserve_host_frames``: a zero-copy landing place for bytes
      written by someone else, e.g. the Transfer Engine) is neither free, nor in the page
      table, nor known to the replacer, and is not counted resident; it leaves that state only
      through ``commit_host_frames`` (resident-unpinned) or ``release_host_frames`` (free).

Eviction order within a tier is the replacer's (the interface: kvdb/buffer_pool/replacer.py; the
policies: kvdb/planner/policies/), fed with every request's frames in chain order.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvdb.buffer_pool.arena import Arena
from kvdb.buffer_pool.dirty import DirtyPages
from kvdb.buffer_pool.replacer import AccessContext, Replacer
from kvdb.buffer_pool.tier import DEVICE, HOST, TIER_NAMES, Tier, TierStats
from kvdb.errors import CapacityError, InvalidInput
from kvdb.format.layout import BlockLayout

__all__ = ["DEVICE", "HOST", "TIER_NAMES", "BufferPool", "SpillFn", "Tier", "TierStats"]


SpillFn = Callable[[list, "torch.Tensor | None", list, list], None]
"""spill(keys, pages uint8 [n, page_bytes] on the CPU or None when no page is dirty, positions,
dirty) for pages leaving memory."""



class BufferPool(DirtyPages):
    def __init__(
        self,
        layout: BlockLayout,
        *,
        host_frames: int,
        device_frames: int,
        device: torch.device | None,
        make_replacer: Callable[[int], Replacer],
        spill: SpillFn,
    ) -> None:
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.tiers: list[Tier | None] = [None, None]
        if device_frames > 0:
            dev = device or torch.device("cpu")
            self.tiers[DEVICE] = Tier(DEVICE, Arena("device", device_frames, self.page_bytes, dev), make_replacer(device_frames))
        self.tiers[HOST] = Tier(HOST, Arena("host", host_frames, self.page_bytes, torch.device("cpu")), make_replacer(host_frames))
        self.table: dict[bytes, int] = {}
        self._spill = spill

    # ------------------------------------------------------------ lookup
    # Only this module reads the page table and decodes its codes; the Db asks these.

    def __contains__(self, key: bytes) -> bool:
        return key in self.table

    def tier_of(self, key: bytes) -> int | None:
        code = self.table.get(key)
        return None if code is None else code & 1

    def tiers_of(self, keys: Sequence[bytes]) -> list[int | None]:
        """The tier of each key (DEVICE, HOST) or None when it is not resident."""
        get = self.table.get
        return [None if (c := get(k)) is None else c & 1 for k in keys]

    def keys_in(self, tier_index: int, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` resident in one tier, in their order."""
        get = self.table.get
        return [k for k in keys if (c := get(k)) is not None and c & 1 == tier_index]

    def locate(self, key: bytes) -> tuple[Tier, int] | None:
        code = self.table.get(key)
        if code is None:
            return None
        return self.tiers[code & 1], code >> 1  # type: ignore[return-value]

    def top_tier(self) -> Tier:
        return self.tiers[DEVICE] or self.tiers[HOST]  # type: ignore[return-value]

    @property
    def has_device(self) -> bool:
        return self.tiers[DEVICE] is not None

    def free_frames(self, tier_index: int) -> int:
        """Free frames of a tier (0 for an absent device tier)."""
        t = self.tiers[tier_index]
        return 0 if t is None else len(t.free)

    def num_frames(self, tier_index: int) -> int:
        t = self.tiers[tier_index]
        return 0 if t is None else t.num_frames

    def replacers(self) -> list[Replacer]:
        """Each present tier's replacer, fastest first (the planner informs them)."""
        return [t.replacer for t in self.tiers if t is not None]

    def devices(self) -> set[str]:
        """Device types of the arenas (``cpu``, ``cuda``)."""
        return {t.arena.device.type for t in self.tiers if t is not None}

    def host_arena(self) -> torch.Tensor:
        """The host arena, uint8 [num_frames, page_bytes] (frames are lent out of it, P6)."""
        return self.tiers[HOST].arena.data  # type: ignore[union-attr]

    # ------------------------------------------------------------ reads

    def absent_rows(self, keys: Sequence[bytes]) -> list[int]:
        """The indexes of the keys not resident."""
        table = self.table
        return [i for i, k in enumerate(keys) if k not in table]

    def read_into(self, keys: Sequence[bytes], dst: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """dst[rows[i]] := the page of keys[i] (rows default 0..n-1), every key resident (one
        copy per tier's runs); counts the reads per tier. dst uint8 [m, page_bytes], any device."""
        table = self.table
        codes = [table[k] for k in keys]
        rows = list(range(len(codes))) if rows is None else list(rows)
        dev, host = self.tiers
        if dev is None:  # one tier: every code is a host frame
            per_tier = [([], []), ([c >> 1 for c in codes], rows)]
        else:
            per_tier = [([], []), ([], [])]
            for c, r in zip(codes, rows):
                fr, rs = per_tier[c & 1]
                fr.append(c >> 1)
                rs.append(r)
        for t, (fr, rs) in zip(self.tiers, per_tier):
            if fr:
                t.arena.read(fr, dst, rs)  # type: ignore[union-attr]
                t.stats.reads += len(fr)  # type: ignore[union-attr]

    def page(self, handle: tuple[Tier, int]) -> torch.Tensor:
        """The uint8 [page_bytes] arena row of a pinned frame (``pin``'s handle): zero-copy."""
        tier, frame = handle
        return tier.arena.page(frame)

    def count_lookup(self, mem_hits: Sequence[int], below: int) -> None:
        """One lookup's hits and misses: ``mem_hits[t]`` keys found in tier t, ``below`` keys
        that went past memory (found on disk, or the miss that ended the prefix). A key counts
        a miss on every tier above the one that has it."""
        dev, host = self.tiers
        if dev is not None:
            dev.stats.hits += mem_hits[DEVICE]
            dev.stats.misses += mem_hits[HOST] + below
        host.stats.hits += mem_hits[HOST]  # type: ignore[union-attr]
        host.stats.misses += below  # type: ignore[union-attr]

    def tier_stats(self) -> list[tuple[str, dict]]:
        """(tier name, figures) per present tier, fastest first."""
        return [(t.name, t.figures()) for t in self.tiers if t is not None]

    # ------------------------------------------------------------ frames

    def _reserve(self, tier: Tier, k: int) -> list[int]:
        """Up to k free frames of ``tier`` (ascending), evicting victims when needed."""
        take = min(k, len(tier.free))
        frames = [tier.free.pop() for _ in range(take)]
        frames.extend(self._evict_some(tier, k - take))
        return frames

    def _evict_some(self, tier: Tier, k: int) -> list[int]:
        """Ask the replacer for up to k victims and move them out of ``tier``; returns their frames."""
        victims: list[int] = []
        while len(victims) < k:
            v = tier.replacer.evict()
            if v is None:
                break
            victims.append(v)
        if victims:
            self._evict(tier, victims)
        return victims

    def _release(self, tier: Tier, frames: Sequence[int]) -> None:
        for f in frames:
            key = tier.keys[f]
            if key is not None and self.table.get(key) == (f << 1 | tier.index):
                del self.table[key]
            tier.keys[f] = None
            tier.positions[f] = -1
            tier.dirty[f] = 0

    def _evict(self, tier: Tier, victims: list[int]) -> None:
        """Victims leave ``tier``: demoted to the host tier when possible, else spilled (P5)."""
        tier.stats.evictions += len(victims)
        moved = 0
        if tier.index == DEVICE:
            host: Tier = self.tiers[HOST]  # type: ignore[assignment]
            dest = self._reserve(host, len(victims))
            moved = len(dest)
            if moved:
                tier.arena.copy_to(victims[:moved], host.arena, dest)
                for f, d in zip(victims[:moved], dest):
                    key = tier.keys[f]
                    host.keys[d] = key
                    host.positions[d] = tier.positions[f]
                    host.dirty[d] = tier.dirty[f]
                    self.table[key] = d << 1 | HOST
                    tier.keys[f] = None
                    tier.positions[f] = -1
                    tier.dirty[f] = 0  # the bit moved with the page: a free frame is never dirty
                host.replacer.record_access(dest, [host.keys[d] for d in dest])
                tier.stats.demotions += moved
        if moved < len(victims):
            self._spill_frames(tier, victims[moved:])

    def _spill_frames(self, tier: Tier, frames: list[int]) -> None:
        keys = [tier.keys[f] for f in frames]
        dirty = [tier.dirty[f] for f in frames]
        pages = None  # clean pages are on disk already (or the Db is a pure cache): no copy
        if any(dirty):
            pages = torch.empty((len(frames), self.page_bytes), dtype=torch.uint8)
            tier.arena.read(frames, pages)
        self._spill(keys, pages, [tier.positions[f] for f in frames], dirty)
        self._release(tier, frames)

    # ------------------------------------------------------------ insert

    def insert(
        self,
        keys: list[bytes],
        pages: torch.Tensor,
        positions: Sequence[int],
        dirty: bool,
        ctx: AccessContext | None = None,
        start_tier: int | None = None,
        rows: Sequence[int] | None = None,
        defer: list | None = None,
    ) -> None:
        """Place new pages (keys not resident) fastest tier first; overflow goes down, then spills.

        pages: uint8 [m, page_bytes] on any device; key i's page is ``pages[rows[i]]`` (rows
        default 0..n-1), copied straight from there (a read promotes from the caller's ``out``).
        ``defer``: a list that collects (tier, frames, keys) instead of telling the replacers
        now; ``record_inserted(defer)`` tells them later, as one access per tier (a batch
        promoted a slice at a time is still one request to the replacer). Until then the
        frames are resident but no victim.
        """
        tier_idx = self.top_tier().index if start_tier is None else start_tier
        done = 0
        n = len(keys)
        while done < n and tier_idx <= HOST:
            tier = self.tiers[tier_idx]
            if tier is None:
                tier_idx += 1
                continue
            frames = self._reserve(tier, n - done)
            if frames:
                k = len(frames)
                if rows is None:
                    tier.arena.write(frames, pages[done : done + k])
                else:
                    tier.arena.write(frames, pages, rows[done : done + k])
                for j, f in enumerate(frames):
                    key = keys[done + j]
                    tier.keys[f] = key
                    tier.positions[f] = positions[done + j]
                    tier.dirty[f] = dirty
                    self.table[key] = f << 1 | tier.index
                if defer is None:
                    tier.replacer.record_access(frames, keys[done : done + k], ctx)
                else:
                    defer.append((tier, frames, keys[done : done + k]))
                tier.stats.inserts += k
                done += k
            tier_idx += 1
        if done < n:  # every frame is pinned: the rest bypasses memory (an outcome, not an error)
            rest = None  # clean pages (a read's promotion) are on disk already: no copy, as _spill_frames
            if dirty:
                rest = (pages[done:] if rows is None else pages[list(rows[done:])]).cpu()
            self._spill(keys[done:], rest, list(positions[done:]), [dirty] * (n - done))

    def record_inserted(self, deferred: list, ctx: AccessContext | None = None) -> None:
        """Tell each tier's replacer of the frames ``insert(..., defer=deferred)`` placed: one
        access per tier, in insertion order."""
        for tier in self.tiers:
            if tier is None:
                continue
            frames = [f for t, fr, _k in deferred if t is tier for f in fr]
            if frames:
                tier.replacer.record_access(frames, [k for t, _f, ks in deferred if t is tier for k in ks], ctx)

    def promote(self, keys: list[bytes], ctx: AccessContext | None = None) -> int:
        """Move host-resident keys into the device tier (prefetch). Returns pages moved."""
        dev = self.tiers[DEVICE]
        host: Tier = self.tiers[HOST]  # type: ignore[assignment]
        if dev is None:
            return 0
        codes = [self.table.get(k) for k in keys]
        src = [c >> 1 for c in codes if c is not None and c & 1 == HOST and host.pins[c >> 1] == 0]
        if not src:
            return 0
        for f in src:  # keep them from being chosen as victims while we make room
            host.replacer.set_evictable(f, False)
        dest = self._reserve(dev, len(src))
        for f in src:
            host.replacer.set_evictable(f, True)
        src = src[: len(dest)]
        if not src:
            return 0
        host.arena.copy_to(src, dev.arena, dest)
        for f, d in zip(src, dest):
            key = host.keys[f]
            dev.keys[d] = key
            dev.positions[d] = host.positions[f]
            dev.dirty[d] = host.dirty[f]
            self.table[key] = d << 1 | DEVICE
            host.replacer.remove(f)
            host.keys[f] = None
            host.positions[f] = -1
            host.dirty[f] = 0
            host.free.append(f)
        dev.replacer.record_access(dest, [dev.keys[d] for d in dest], ctx)
        dev.stats.promotions += len(dest)
        return len(dest)

    def offload(self, keys: Sequence[bytes], to_tier: int | None) -> int:
        """Move resident, unpinned keys down: device -> host (to_tier=HOST) or out of memory
        through the spill callback (to_tier=None). Returns pages moved."""
        by_tier: list[list[int]] = [[], []]
        for k in keys:
            code = self.table.get(k)
            if code is None:
                continue
            t = self.tiers[code & 1]
            if t.pins[code >> 1] == 0 and not (to_tier == HOST and t.index == HOST):
                by_tier[code & 1].append(code >> 1)
        moved = 0
        for t, frames in zip(self.tiers, by_tier):
            if t is None or not frames:
                continue
            for f in frames:
                t.replacer.remove(f)
            if t.index == DEVICE and to_tier == HOST:
                self._evict(t, frames)  # demotes what fits in the host tier, spills the rest
                t.stats.evictions -= len(frames)  # a planned move, not a capacity eviction
            else:
                self._spill_frames(t, frames)
            t.free.extend(frames)
            moved += len(frames)
        return moved

    def make_room(self, tier_index: int, free_frames: int) -> int:
        """Evict (demote / spill) until ``tier`` has ``free_frames`` free frames. Returns evicted."""
        tier = self.tiers[tier_index]
        if tier is None:
            return 0
        victims = self._evict_some(tier, free_frames - len(tier.free))
        tier.free.extend(sorted(victims, reverse=True))
        return len(victims)

    # ------------------------------------------------------------ reserved host frames (P6)

    def reserve_host_frames(self, k: int) -> list[int]:
        """Take ``k`` host frames out of circulation (free ones first, then victims evicted as
        ``insert`` would); all or nothing: CapacityError, with nothing evicted, when fewer than
        ``k`` frames are free or evictable."""
        host: Tier = self.tiers[HOST]  # type: ignore[assignment]
        avail = len(host.free) + host.replacer.num_evictable()
        if k > avail:
            raise CapacityError(f"cannot reserve {k} host frames: {len(host.free)} free and "
                                f"{host.replacer.num_evictable()} evictable of {host.num_frames} "
                                f"({len(host.reserved)} already reserved)")
        frames = self._reserve(host, k)
        if len(frames) != k:  # a replacer that under-reports; give back what we took
            host.free.extend(sorted(frames, reverse=True))
            raise CapacityError(f"cannot reserve {k} host frames: only {len(frames)} could be freed")
        host.reserved.update(frames)
        return frames

    def check_reserved(self, frames: Sequence[int]) -> Tier:
        host: Tier = self.tiers[HOST]  # type: ignore[assignment]
        if len(set(frames)) != len(frames) or not host.reserved.issuperset(frames):
            raise InvalidInput("frames must be distinct host frames reserved with reserve_frames "
                               "and not yet committed or released")
        return host

    def commit_host_frames(self, keys: list[bytes], frames: list[int], positions: Sequence[int], dirty: bool,
                           ctx: AccessContext | None = None) -> None:
        """Reserved frames become resident pages under ``keys`` (not resident anywhere)."""
        host = self.check_reserved(frames)
        if not frames:
            return
        for key, f, p in zip(keys, frames, positions):
            host.keys[f] = key
            host.positions[f] = p
            host.dirty[f] = dirty
            self.table[key] = f << 1 | HOST
        host.reserved.difference_update(frames)
        host.replacer.record_access(frames, keys, ctx)
        host.stats.inserts += len(frames)

    def release_host_frames(self, frames: Sequence[int]) -> None:
        """Reserved frames go back to the free list, their bytes unread."""
        host = self.check_reserved(frames)
        host.reserved.difference_update(frames)
        host.free.extend(sorted(frames, reverse=True))

    def still_reserved(self, frames: Sequence[int]) -> list[int]:
        """Those of ``frames`` still reserved (not yet committed or released)."""
        reserved = self.tiers[HOST].reserved  # type: ignore[union-attr]
        return [f for f in frames if f in reserved]

    # ------------------------------------------------------------ access, pins, delete

    def touch(self, keys: Sequence[bytes], ctx: AccessContext | None = None) -> None:
        """Report one request's resident keys (chain order) to each tier's replacer."""
        per_tier: list[tuple[list, list]] = [([], []), ([], [])]
        for k in keys:
            code = self.table.get(k)
            if code is not None:
                fr, ks = per_tier[code & 1]
                fr.append(code >> 1)
                ks.append(k)
        for t, (fr, ks) in zip(self.tiers, per_tier):
            if fr and t is not None:
                t.replacer.record_access(fr, ks, ctx)

    def pin(self, key: bytes) -> tuple[Tier, int]:
        loc = self.locate(key)
        if loc is None:
            raise InvalidInput("pin of a key that is not resident")
        tier, f = loc
        if tier.pins[f] == 0:
            tier.replacer.set_evictable(f, False)
        tier.pins[f] += 1
        return tier, f

    def unpin(self, tier: Tier, frame: int) -> None:
        if tier.pins[frame] <= 0:
            raise InvalidInput(f"unpin of unpinned frame {frame} in the {tier.name} tier")
        tier.pins[frame] -= 1
        if tier.pins[frame] == 0:
            tier.replacer.set_evictable(frame, True)

    def delete(self, key: bytes) -> bool:
        loc = self.locate(key)
        if loc is None:
            return False
        tier, f = loc
        if tier.pins[f]:
            raise InvalidInput(f"cannot delete key {key.hex()}: it is pinned")
        tier.replacer.remove(f)
        self._release(tier, [f])
        tier.free.append(f)
        return True

    def resident_items(self):
        """(key, tier, frame) for every resident page, fastest tier first (used by flush)."""
        for t in self.tiers:
            if t is None:
                continue
            for f, key in enumerate(t.keys):
                if key is not None:
                    yield key, t, f
