"""Hypothesis state machine: the Db against a dict model, with tiny capacities (docs/style.md "Tests").

DbMachine -- memory-only Db (disk tier off): evicted blocks are gone, so the model tracks what
*may* be stored; the checks are that nothing is ever wrong rather than that nothing is ever lost:
  - a key the Db reports present returns exactly the bytes last put under it;
  - a key never put is never reported present; match_prefix never runs past a key never put;
  - pinned pages are never evicted (pool invariant P3); their views keep their bytes;
  - resident pages never exceed any tier's capacity (P4); page table and frames agree (P1, P2).

DiskDbMachine -- the same with the disk tier on (unbounded): nothing is ever lost, so the model
is exact: match_prefix equals the model's prefix, every stored key reads back exactly, also
after close and reopen (write-back of durability="none" pages at close), also when the reopen
rebuilds the cold tier's index from the log alone.

Both also land blocks in place (kvdb/db/landing.py, pool invariant P6): reserve_frames lends
host frames (all or nothing: a CapacityError evicts nothing), bytes are written into them;
until commit_frames they are invisible to every read, commit_frames makes them the pages of
their keys (keys already stored are skipped) and release_frames frees them; reserved frames are
never keyed, never free, and a reservation never evicts a pinned page.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import kvdb

LAYOUT = kvdb.BlockLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_tokens=2, dtype=torch.float32)
NUM_KEYS = 12


class DbMachine(RuleBasedStateMachine):
    DISK = False

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.db = None

    @rule(host_pages=st.integers(1, 4), device_pages=st.integers(0, 3), replacer=st.sampled_from(["lru", "arc"]))
    @precondition(lambda self: self.db is None)
    def open(self, host_pages, device_pages, replacer):
        self.db = kvdb.open(self.tmp.name, layout=LAYOUT, model_id="m", host_bytes=host_pages * LAYOUT.page_bytes,
                            device_bytes=device_pages * LAYOUT.page_bytes, device="cpu", replacer=replacer,
                            disk_bytes=None if self.DISK else 0)
        self.open_args = (host_pages, device_pages, replacer)
        self.keys = self.db.block_keys(list(range(NUM_KEYS * LAYOUT.block_tokens)))
        self.model: dict[bytes, torch.Tensor] = {}  # key -> bytes last put (may have been evicted since)
        self.pins: list[tuple[list[int], kvdb.PinnedPages, torch.Tensor]] = []
        self.landing: list[tuple[object, torch.Tensor]] = []  # (ReservedFrames, blocks written into them)
        self.counter = 0

    def _block(self) -> torch.Tensor:
        self.counter += 1
        return torch.full((1, *LAYOUT.block_shape), float(self.counter))

    def _present(self, i: int) -> bool:
        if self.DISK:
            return self.keys[i] in self.model
        return self.keys[i] in self.db.pool

    @rule(idx=st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=5, unique=True))
    @precondition(lambda self: self.db is not None)
    def put(self, idx):
        keys = [self.keys[i] for i in idx]
        blocks = torch.cat([self._block() for _ in idx])
        was_present = {i: self._present(i) for i in idx}
        self.db.put_blocks(keys, blocks)
        for j, i in enumerate(idx):
            if not was_present[i]:  # present keys are skipped: their old bytes stay
                self.model[self.keys[i]] = blocks[j].clone()

    @rule(idx=st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=6))
    @precondition(lambda self: self.db is not None)
    def get(self, idx):
        keys = [self.keys[i] for i in idx]
        present = all(self._present(i) for i in idx)
        out = torch.zeros((len(idx), *LAYOUT.block_shape))
        if present:
            self.db.get_blocks(keys, out=out)
            for j, k in enumerate(keys):
                assert torch.equal(out[j], self.model[k])
        else:
            try:
                self.db.get_blocks(keys, out=out)
                raise AssertionError("get of an absent key succeeded")
            except kvdb.errors.NotFound:
                assert torch.count_nonzero(out) == 0

    @rule(start=st.integers(0, NUM_KEYS - 1), length=st.integers(1, NUM_KEYS))
    @precondition(lambda self: self.db is not None)
    def match(self, start, length):
        keys = self.keys[start : start + length]
        n = self.db.match_prefix(keys)
        expect = 0
        for k in keys:
            if not (k in self.model if self.DISK else k in self.db.pool):
                break
            expect += 1
        assert n == expect
        assert all(k in self.model for k in keys[:n])  # never past a key never put

    @rule(idx=st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=3, unique=True))
    @precondition(lambda self: self.db is not None and len(self.pins) < 3)
    def pin(self, idx):
        if not all(self._present(i) for i in idx):
            return
        before = [list(t.pins) for t in self.db.pool.tiers if t is not None]
        try:
            p = self.db.pin([self.keys[i] for i in idx])
        except kvdb.errors.CapacityError:
            # disk pages load into the host tier; when they cannot all be resident at once the
            # pin fails whole: no pin may leak
            assert self.DISK
            assert [list(t.pins) for t in self.db.pool.tiers if t is not None] == before
            return
        self.pins.append((idx, p, torch.stack([t.clone() for t in p.pages])))

    @rule(data=st.data())
    @precondition(lambda self: self.db is not None and self.pins)
    def unpin(self, data):
        j = data.draw(st.integers(0, len(self.pins) - 1))
        _, p, _ = self.pins.pop(j)
        p.release()

    @rule(i=st.integers(0, NUM_KEYS - 1))
    @precondition(lambda self: self.db is not None)
    def delete(self, i):
        pinned = any(i in idx for idx, _, _ in self.pins)
        if pinned:
            return
        self.db.delete([self.keys[i]])
        self.model.pop(self.keys[i], None)
        assert self.keys[i] not in self.db.pool
        assert self.db.match_prefix([self.keys[i]]) == 0

    @rule(n=st.integers(0, 3))
    @precondition(lambda self: self.db is not None and len(self.landing) < 2)
    def reserve(self, n):
        host = self.db.pool.tiers[1]
        table_before = dict(self.db.pool.table)
        try:
            res = self.db.reserve_frames(n)
        except kvdb.errors.CapacityError:
            # all or nothing: fewer than n frames were free or evictable, and nothing moved
            assert len(host.free) + host.replacer.num_evictable() < n
            assert dict(self.db.pool.table) == table_before
            return
        assert len(res) == n and set(res.frames) <= host.reserved
        blocks = torch.cat([self._block() for _ in range(n)]) if n else torch.zeros((0, *LAYOUT.block_shape))
        for j, row in enumerate(res.rows):  # the bytes land in place, as a transfer engine writes them
            row.copy_(blocks[j].contiguous().view(torch.uint8).reshape(-1))
        self.landing.append((res, blocks))

    @rule(data=st.data())
    @precondition(lambda self: self.db is not None and self.landing)
    def commit_landed(self, data):
        res, blocks = self.landing.pop(data.draw(st.integers(0, len(self.landing) - 1)))
        idx = data.draw(st.lists(st.integers(0, NUM_KEYS - 1), min_size=len(res), max_size=len(res), unique=True))
        new = [i for i in idx if not self._present(i)]
        # a reserved frame is no page yet: its bytes are invisible until committed
        for i in new:
            assert self.db.match_prefix([self.keys[i]]) == 0
        n = self.db.commit_frames([self.keys[i] for i in idx], res, positions=list(idx))
        assert n == len(new)
        for j, i in enumerate(idx):
            if i in new:  # present keys are skipped: their old bytes stay
                self.model[self.keys[i]] = blocks[j].clone()
        assert not set(res.frames) & self.db.pool.tiers[1].reserved  # the reservation is used up

    @rule(data=st.data())
    @precondition(lambda self: self.db is not None and self.landing)
    def release_landed(self, data):
        res, _ = self.landing.pop(data.draw(st.integers(0, len(self.landing) - 1)))
        host = self.db.pool.tiers[1]
        self.db.release_frames(res)
        assert set(res.frames) <= set(host.free)
        if len(res):
            with pytest.raises(kvdb.errors.InvalidInput):  # released frames cannot be committed
                self.db.commit_frames(self.keys[: len(res)], res)

    @rule(rebuild=st.booleans())
    @precondition(lambda self: self.db is not None and self.DISK and not self.pins and not self.landing)
    def reopen(self, rebuild):
        self.db.close()
        if rebuild:  # the cold tier's index rebuilt from its log alone (invariant C6, kvdb/cold/checkpoint.py)
            shutil.rmtree(os.path.join(self.tmp.name, "index"))
        host_pages, device_pages, replacer = self.open_args
        self.db = kvdb.open(self.tmp.name, host_bytes=host_pages * LAYOUT.page_bytes,
                            device_bytes=device_pages * LAYOUT.page_bytes, device="cpu", replacer=replacer)
        assert self.db.block_keys(list(range(NUM_KEYS * LAYOUT.block_tokens))) == self.keys
        assert all(self.db.match_prefix([k]) == 1 for k in self.model)

    @invariant()
    def pinned_pages_stay(self):
        if self.db is None:
            return
        for idx, p, snapshot in self.pins:
            for j, i in enumerate(idx):
                assert self._present(i), "a pinned page was evicted"
                assert torch.equal(p.pages[j], snapshot[j])
                assert torch.equal(p.pages[j], self.model[self.keys[i]])

    @invariant()
    def capacity_and_table_agree(self):
        if self.db is None:
            return
        pool = self.db.pool
        resident = 0
        for t in pool.tiers:
            if t is None:
                continue
            keyed = [f for f, k in enumerate(t.keys) if k is not None]
            assert len(keyed) == t.num_resident <= t.num_frames  # P4
            assert set(keyed).isdisjoint(t.free) and len(set(t.free)) == len(t.free)  # P2
            # P6: reserved frames are neither keyed nor free, and every frame is one of the three
            assert t.reserved.isdisjoint(keyed) and t.reserved.isdisjoint(t.free)
            assert len(keyed) + len(t.free) + len(t.reserved) == t.num_frames
            lent = {f for res, _ in self.landing for f in res.frames} if t.index == 1 else set()
            assert t.reserved == lent
            for f in keyed:
                assert pool.locate(t.keys[f]) == (t, f)  # P1
            assert t.replacer.num_evictable() == sum(1 for f in keyed if t.pins[f] == 0)
            resident += len(keyed)
        assert resident == len(pool.table)

    def teardown(self):
        if self.db is not None:
            for _, p, _ in self.pins:
                p.release()
            for res, _ in self.landing:
                self.db.release_frames(res)
            self.db.close()
        self.tmp.cleanup()


class DiskDbMachine(DbMachine):
    DISK = True


TestDbMachine = DbMachine.TestCase
TestDiskDbMachine = DiskDbMachine.TestCase
# every example opens RocksDB and a log: fewer, longer runs in the ci profile
TestDiskDbMachine.settings = settings(
    max_examples=max(15, settings.default.max_examples // 3), stateful_step_count=40
)
