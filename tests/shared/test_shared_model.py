"""S1 as a model: the pool may drop any object at any time (removed behind kvdb's back, evicted
from a reader's small host tier, deleted), and every answer a reader gives is still right:
a key never put is never found, and every row it returns is the bytes that were put."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import LAYOUT, make_blocks
from engine import open_db, tokens
from kvdb.format import shared_object as fmt

N = 8
_examples = itertools.count()


@pytest.fixture
def engines(pool_factory, tmp_path):
    pool = pool_factory(storage_bytes=[32 << 20], lease_ms=100)
    raw = pool.raw_client()
    with open_db(tmp_path / "w", pool.url, disk_bytes=0) as w, \
            open_db(tmp_path / "r", pool.url, disk_bytes=0, host_bytes=4 * LAYOUT.page_bytes) as r:
        yield w, r, raw
    raw.close()


OPS = st.lists(st.tuples(st.sampled_from(["put", "drop", "evict", "read", "prefix"]), st.integers(0, N - 1)),
               max_size=20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_every_answer_is_right_whatever_the_pool_drops(engines, ops):
    w, r, raw = engines
    ex = next(_examples)
    keys = w.block_keys(tokens(N, 1000 + ex))  # a chain: key i's prefix is keys[:i + 1]
    blocks = make_blocks(N, 1000 + ex)
    ns = w.stats()["shared"]["namespace"]
    names = fmt.object_names(ns, keys)
    put: set[int] = set()
    out = torch.empty_like(blocks)
    for op, i in ops:
        if op == "put":
            w.put_blocks([keys[i]], blocks[i : i + 1])
            w.flush()
            put.add(i)
        elif op == "drop":
            raw.remove(names[i])  # never forced: a leased object may stay
        elif op == "evict":
            r.delete([keys[i]])  # gone from the reader, and removed (unforced) from the pool
        elif op == "read":
            found = r.match_prefix([keys[i]]) == 1
            assert not found or i in put
            if found:
                got = r.get_prefix([keys[i]], out=out)
                assert got == 0 or torch.equal(out[0].view(torch.uint8), blocks[i].view(torch.uint8))
        else:
            n = r.get_prefix(keys, out=out)
            assert all(j in put for j in range(n))
            assert torch.equal(out[:n].view(torch.uint8), blocks[:n].view(torch.uint8))
    assert r.stats()["shared"]["corruptions"] == 0
