"""Hypothesis state machine: ColdStore against a dict model, through puts, deletes, metadata,
evictions under disk_bytes, TTL expiry, checkpoints, compaction, clean reopens, crashes (the
index rolled back to its last flush) and index rebuilds from the log alone (invariant C6, kvdb/cold/checkpoint.py:
no deleted, evicted, expired or overwritten block and no removed metadata ever comes back).

Scenario: 8 keys, 128-byte pages in 512-byte segments (two puts per segment, so segments are
sealed, die and are collected all the time), room for 5 blocks on disk.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvdb.cold import ColdStore
from kvdb.cold.compact import compact

from cold_fixtures import TINY, assert_totals, key, pages_for

KEYS = [key(i) for i in range(1, 9)]
CAPACITY = 5  # blocks
RECORD_BYTES = 53 + TINY.page_bytes
NAMES = [b"s1", b"s2"]
NOW_NS = 2  # compaction's clock: TTLs of 0..2 have passed, 3 has not

pytestmark = pytest.mark.slow  # ~30-60 s: the state machine


class ColdStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.path = Path(tempfile.mkdtemp(prefix="kvdb-cold-state-"))
        self.blocks: dict[bytes, int] = {}  # key -> salt of its page
        self.metas: dict[tuple[str, bytes], bytes] = {}
        self.store = self._open()

    def _open(self) -> ColdStore:
        return ColdStore.open(self.path, TINY, segment_bytes=512, disk_bytes=CAPACITY * RECORD_BYTES,
                              flush_interval_s=None)

    def teardown(self) -> None:
        try:
            if self.store is not None:
                assert self.store.verify().ok
                self.store.close()
        finally:
            shutil.rmtree(self.path, ignore_errors=True)

    # -- writes

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
          salt=st.integers(0, 3), durability=st.sampled_from(["group", "sync"]))
    def put(self, keys, salt, durability):
        self.store.put(keys, pages_for(keys, salt), durability=durability)
        for k in keys:
            self.blocks[k] = salt
        over = len(self.blocks) - CAPACITY
        if over > 0:
            # which blocks go is the store's eviction order (write order, which compaction's
            # copies and reopens change); the model checks how many and that the batch stays
            kept = dict(zip(KEYS, self.store.contains(KEYS)))
            gone = [k for k in self.blocks if not kept[k]]
            assert len(gone) == over and not set(gone) & set(keys)
            for k in gone:
                del self.blocks[k]

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def delete(self, keys):
        want = sum(k in self.blocks for k in keys)
        assert self.store.delete(keys, durability="sync") == want
        for k in keys:
            self.blocks.pop(k, None)

    @rule(kind=st.sampled_from(["session", "lease"]), name=st.sampled_from(NAMES),
          value=st.sampled_from([b"", b"a", b"bb"]))
    def metadata(self, kind, name, value):
        self.store.put_metadata(kind, name, value, "sync")
        if value:
            self.metas[(kind, name)] = value
        else:
            self.metas.pop((kind, name), None)

    @rule(k=st.sampled_from(KEYS), expires=st.integers(0, 3))
    def ttl(self, k, expires):
        value = struct.pack("<Q", expires)
        self.store.put_metadata("ttl", k, value, "sync")
        self.metas[("ttl", k)] = value

    # -- maintenance

    @rule()
    def checkpoint(self):
        self.store.checkpoint()

    @rule(min_dead_fraction=st.sampled_from([0.0, 0.6]))
    def compact(self, min_dead_fraction):
        compact(self.store, min_dead_fraction=min_dead_fraction, now_ns=NOW_NS)
        for (kind, name), value in list(self.metas.items()):
            if kind == "ttl" and struct.unpack("<Q", value)[0] <= NOW_NS:
                del self.metas[(kind, name)]
                self.blocks.pop(name, None)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @rule()
    def crash(self):
        # every write above was acknowledged durable; the index loses what it did not flush
        self.store.debug_crash_close()
        self.store = self._open()

    @rule()
    def rebuild_index(self):
        self.store.close()
        shutil.rmtree(self.path / "index")
        self.store = self._open()
        assert self.store.recovery.damage == []

    # -- the model

    @invariant()
    def same_as_model(self):
        out = np.zeros((len(KEYS), TINY.page_bytes), np.uint8)
        found = self.store.get_into(KEYS, out)
        assert found == [k in self.blocks for k in KEYS]
        for i, k in enumerate(KEYS):
            if found[i]:
                assert (out[i] == pages_for([k], self.blocks[k])[0]).all()
        assert self.store.contains(KEYS) == found
        st_ = self.store.stats()
        assert st_["pages"] == len(self.blocks) and st_["bytes"] == len(self.blocks) * RECORD_BYTES
        for kind in ("session", "lease"):
            for name in NAMES:
                assert self.store.find_metadata(kind, name) == self.metas.get((kind, name))
        for k in KEYS:
            assert self.store.find_metadata("ttl", k) == self.metas.get(("ttl", k))

    @invariant()
    def live_totals_agree(self):
        assert_totals(self.store)


TestColdStoreState = ColdStoreMachine.TestCase
# each example opens RocksDB and fsyncs a log: at most 200 examples (~1 s each under load)
TestColdStoreState.settings = settings(settings(), stateful_step_count=25,
                                       max_examples=min(200, settings.default.max_examples))
