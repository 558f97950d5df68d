"""PrefixCache over the disk tier: restore after a reopen, and corrupted blocks never used.

The Db is closed and reopened between save and lookup, so the host tier starts empty and the
prefix can only come from the log segments on disk (kvdb/cold/).
"""

from __future__ import annotations

import pytest
import torch

import kvdb
from kvdb.integrations.transformers import PrefixCache, blocks_from_cache, layout_for

from .helpers import corrupt_block
from .test_prefix_cache import BT, check_restored, reference, tokens

pytest.importorskip("kvdb.cold.store", reason="the disk tier has not landed")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

DISK_BYTES = 64 << 20


def open_disk_db(path, model, **kw):
    kw.setdefault("host_bytes", 64 << 20)
    return kvdb.open(path, layout=layout_for(model.config, block_tokens=BT), model_id="tiny-llama",
                     disk_bytes=DISK_BYTES, **kw)


def save_to_disk(path, model, ids) -> torch.Tensor:
    """Prefill ``ids``, save every full block straight to the disk tier (fsynced), close.
    Returns the saved blocks (for locating them in the log)."""
    with open_disk_db(path, model) as db:
        pc = PrefixCache(db, model)
        cache = model(ids, use_cache=True).past_key_values
        n = ids.shape[1] // BT
        assert pc.save(ids, cache, tier="disk", durability="sync") == n
        assert db.stats()["tiers"]["host"]["pages"] == 0  # disk only
        lay = db.layout
        return blocks_from_cache(cache, 0, n, BT, torch.empty((n, *lay.block_shape))).clone()


@torch.no_grad()
def test_disk_restore_matches_recompute_and_greedy_decode(llama, tmp_path):
    # Scenario: a 200-token prompt (12 blocks) is saved to disk; the Db is reopened with an
    # empty host tier; a 260-token continuation restores 192 tokens from disk.
    first = tokens(200, 11)
    second = torch.cat([first, tokens(60, 12)], dim=1)
    save_to_disk(tmp_path / "db", llama, first)
    with open_disk_db(tmp_path / "db", llama) as db:
        assert db.stats()["tiers"]["host"]["pages"] == 0
        pc = PrefixCache(db, llama)
        cache, n = pc.lookup(second)
        assert n == 192
        assert db.stats()["tiers"]["disk"]["reads"] == 12  # every block came up from disk
        _, produced = check_restored(llama, second, cache, n, first)
        assert len(produced) == 32
        _, full_produced = reference(llama, second, 0)
        assert produced == full_produced


@pytest.mark.parametrize("bad", [0, 4, 9])
@torch.no_grad()
def test_corrupted_disk_block_is_never_used(llama, tmp_path, bad):
    # Scenario (I2): 10 blocks on disk, one byte of block `bad`'s payload flipped in the log
    # file. The lookup restores exactly the blocks before it -- fewer cached tokens, never the
    # damaged KV -- and what it restores is bit-exact (the exact oracle of test_prefix_cache).
    ids = tokens(170, 13)
    blocks = save_to_disk(tmp_path / "db", llama, ids)
    corrupt_block(tmp_path / "db", blocks[bad])
    with open_disk_db(tmp_path / "db", llama) as db:
        pc = PrefixCache(db, llama)
        cache, n = pc.lookup(ids)
        assert n == bad * BT
        assert cache.get_seq_length() == n
        check_restored(llama, ids, cache, n, ids, steps=8)
        assert db.stats()["tiers"]["host"]["pinned_pages"] == 0
        # the damaged block is reported, and a second lookup gives the same answer
        assert db.stats()["tiers"]["disk"]["corruptions"] >= 1
        assert pc.lookup(ids)[1] == n


@torch.no_grad()
def test_prefix_larger_than_memory_restores_through_staging(llama, tmp_path):
    # Scenario: 10 blocks on disk, a host tier of 4 pages and no device tier: the prefix cannot
    # be pinned at once (CapacityError inside the Db), so the lookup reads it with get_blocks
    # into its staging buffer; with block 7 damaged it still stops right before it.
    ids = tokens(170, 14)
    blocks = save_to_disk(tmp_path / "db", llama, ids)
    page = layout_for(llama.config, block_tokens=BT).page_bytes
    with open_disk_db(tmp_path / "db", llama, host_bytes=4 * page) as db:
        pc = PrefixCache(db, llama)
        cache, n = pc.lookup(ids)
        assert n == 160 and pc.stats.staged_lookups == 1
        check_restored(llama, ids, cache, n, ids, steps=1, recompute=False)
    corrupt_block(tmp_path / "db", blocks[7])
    with open_disk_db(tmp_path / "db", llama, host_bytes=4 * page) as db:
        pc = PrefixCache(db, llama)
        cache, n = pc.lookup(ids)
        assert n == 7 * BT and pc.stats.staged_lookups == 1
        check_restored(llama, ids, cache, n, ids, steps=1, recompute=False)
        assert db.stats()["tiers"]["host"]["pinned_pages"] == 0
