"""Hypothesis state machine: the Db against a dict model, with tiny capacities (STYLE.md "Tests").

DbMachine -- memory-only Db (disk tier off): evicted blocks are gone, so the model tracks what
*may* be stored; the checks are that nothing is ever wrong rather than that nothing is ever lost:
  - a key the Db reports present returns exactly the bytes last put under it;
  - a key never put is never reported present; match_prefix never runs past a key never put;
  - pinned pages are never evicted (pool invariant P3); their views keep their bytes;
  - resident pages never exceed any tier's capacity (P4); page table and frames agree (P1, P2).

DiskDbMachine -- the same with the disk tier on (unbounded): nothing is ever lost, so the model
is exact: match_prefix equals the model's prefix, every stored key reads back exactly, also
after close and reopen (write-back of durability="none" pages at close).
"""

from __future__ import annotations

import tempfile

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

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
        self.counter = 0

    def _block(self) -> torch.Tensor:
        self.counter += 1
        return torch.full((1, *LAYOUT.block_shape), float(self.counter))

    def _present(self, i: int) -> bool:
        if self.DISK:
            return self.keys[i] in self.model
        return self.keys[i] in self.db.pool.table

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
            if not (k in self.model if self.DISK else k in self.db.pool.table):
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
        assert self.keys[i] not in self.db.pool.table
        assert self.db.match_prefix([self.keys[i]]) == 0

    @rule()
    @precondition(lambda self: self.db is not None and self.DISK and not self.pins)
    def reopen(self):
        self.db.close()
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
            for f in keyed:
                assert pool.table[t.keys[f]] == (f << 1 | t.index)  # P1
            assert t.replacer.num_evictable() == sum(1 for f in keyed if t.pins[f] == 0)
            resident += len(keyed)
        assert resident == len(pool.table)

    def teardown(self):
        if self.db is not None:
            for _, p, _ in self.pins:
                p.release()
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
