"""One key namespace per cluster (issue 14, hole 3; docs/replication.md "One key namespace per
cluster"): given the same key secret file, a follower made by ``kvdb replicate serve`` computes
its leader's keys for the same tokens and tenant, so lookups by tokens on it find the leader's
blocks; a follower of another secret is reported (``key_namespace: "differs"``), not silent."""

from __future__ import annotations

import os

import pytest
import torch

import kvdb

from .conftest import LAYOUT, SECRET, TRANSPORTS, make_blocks
from kvdb.replication import Peer

PAGE = LAYOUT.page_bytes
TOKENS = list(range(1000, 1064))  # 4 blocks of 16 tokens
TENANT = "acme"


def _leader(path, f_addr, secret_file, kind, **kw):
    return kvdb.open(path, layout=LAYOUT, model_id="test-model", host_bytes=16 * PAGE, replicas=[f_addr],
                     replication_secret_file=secret_file, replication_transport=kind, **kw)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_follower_given_the_cluster_key_secret_answers_token_lookups(netns, tmp_path, secret_file, nodes, kind):
    # Scenario: a key secret file shared by leader (kvdb.open(key_secret=)) and follower (kvdb
    # replicate serve --key-secret-file). The leader stores a 4-block prompt of tenant acme and
    # two engine-hashed blocks, ships them; both nodes report key_namespace "same". The follower's
    # own directory then computes the very same keys from the tokens and hashes and finds all 6
    # blocks bit-exact: a failover to it is a warm cache.
    ks = tmp_path / "cluster.keysecret"
    ks.write_bytes(os.urandom(32))
    f = nodes(tmp_path / "f", secret_file, transport=kind, key_secret_file=ks)
    blocks = make_blocks(6, seed=61)
    with _leader(tmp_path / "leader", f.address, secret_file, kind, key_secret=ks.read_bytes()) as db:
        keys = db.block_keys(TOKENS, tenant=TENANT)
        ekeys = db.engine_keys([b"vllm-hash-1", 2**63 - 1], tenant=TENANT)
        db.put_blocks(keys + ekeys, blocks, durability="group")
        db.sync_replicas(30)
        assert db.replication_status()["followers"][0]["key_namespace"] == "same"
    with Peer(f.address, secret=SECRET, transport="tcp") as p:
        assert p.status()["follower"]["key_namespace"] == "same"
    assert f.stop() == 0
    with kvdb.open(tmp_path / "f", host_bytes=16 * PAGE, key_secret=ks.read_bytes()) as fdb:
        assert fdb.block_keys(TOKENS, tenant=TENANT) == keys
        assert fdb.engine_keys([b"vllm-hash-1", 2**63 - 1], tenant=TENANT) == ekeys
        assert fdb.match_prefix(fdb.block_keys(TOKENS, tenant=TENANT)) == 4
        out = torch.empty_like(blocks)
        fdb.get_blocks(keys + ekeys, out=out)
        assert torch.equal(out, blocks)


def test_a_follower_of_another_key_secret_is_reported(netns, tmp_path, secret_file, nodes):
    # Scenario: the follower runs without --key-secret-file, so it keeps its own random KEY_SECRET
    # (before this change: a silent cold cache on failover). It still holds the leader's blocks
    # bit-exact under the leader's keys, but its own keys for the same tokens differ: both nodes'
    # status says key_namespace "differs", and its lookups by tokens find 0 of the 4 blocks.
    f = nodes(tmp_path / "f", secret_file, transport="tcp")
    blocks = make_blocks(4, seed=62)
    with _leader(tmp_path / "leader", f.address, secret_file, "tcp") as db:
        keys = db.block_keys(TOKENS, tenant=TENANT)
        db.put_blocks(keys, blocks, durability="group")
        db.sync_replicas(30)
        assert db.replication_status()["followers"][0]["key_namespace"] == "differs"
    with Peer(f.address, secret=SECRET, transport="tcp") as p:
        assert p.status()["follower"]["key_namespace"] == "differs"
    assert f.stop() == 0
    with kvdb.open(tmp_path / "f", host_bytes=16 * PAGE) as fdb:
        assert fdb.match_prefix(fdb.block_keys(TOKENS, tenant=TENANT)) == 0
        assert fdb.cold_store.contains(keys) == [True] * 4


def test_a_key_secret_file_is_checked(tmp_path):
    # a short file, a sealed KEY_SECRET and a missing file are InvalidInput naming the file
    from kvdb.db.open import read_key_secret_file
    from kvdb.errors import InvalidInput
    from kvdb.format.secret import SEALED_MAGIC

    short, sealed = tmp_path / "short", tmp_path / "sealed"
    short.write_bytes(b"x" * 15)
    sealed.write_bytes(SEALED_MAGIC + bytes(60))
    with pytest.raises(InvalidInput, match="short holds 15 bytes"):
        read_key_secret_file(short)
    with pytest.raises(InvalidInput, match="sealed KEY_SECRET"):
        read_key_secret_file(sealed)
    with pytest.raises(InvalidInput, match="cannot read key secret file"):
        read_key_secret_file(tmp_path / "absent")
    (tmp_path / "ok").write_bytes(b"k" * 16)
    assert read_key_secret_file(tmp_path / "ok") == b"k" * 16


def test_a_reseeded_follower_answers_token_lookups_with_the_cluster_key_secret(netns, tmp_path, secret_file, nodes):
    # Scenario: the leader (cluster key secret) writes prompt p1 (4 blocks) one record per
    # segment, deletes it and compacts, so its log no longer starts at lsn 1; then writes prompt
    # p2 and ships to a new `serve` follower given the same key secret file, which is re-seeded
    # (a copy of the live blocks, written by its own staging Db from its own MANIFEST.json). The
    # follower's directory keeps its own store id and computes the leader's keys: p2's 4 blocks
    # are found by tokens, p1's are gone, as on the leader.
    import json

    ks = tmp_path / "cluster.keysecret"
    ks.write_bytes(os.urandom(32))
    p1, p2 = list(range(64)), list(range(5000, 5064))
    with kvdb.open(tmp_path / "leader", layout=LAYOUT, model_id="test-model", host_bytes=16 * PAGE,
                   key_secret=ks.read_bytes()) as db:
        db.cold_store.writer.segment_bytes = 2 * PAGE  # test: one record per segment, so compaction frees some
        k1 = db.block_keys(p1, tenant=TENANT)
        db.put_blocks(k1, make_blocks(4, seed=63), durability="group")
        db.delete(k1)
        db.cold_store.compact()
        k2 = db.block_keys(p2, tenant=TENANT)
        b2 = make_blocks(4, seed=64)
        db.put_blocks(k2, b2, durability="group")
    f = nodes(tmp_path / "f", secret_file, transport="tcp", key_secret_file=ks)
    with _leader(tmp_path / "leader", f.address, secret_file, "tcp", key_secret=ks.read_bytes()) as db:
        db.sync_replicas(60)
        st = db.replication_status()["followers"][0]
        assert st["reseeds"] == 1 and st["key_namespace"] == "same"
    assert f.stop() == 0
    f_id = json.loads((tmp_path / "f" / "MANIFEST.json").read_text())["store_id"]
    assert f_id != json.loads((tmp_path / "leader" / "MANIFEST.json").read_text())["store_id"]
    with kvdb.open(tmp_path / "f", host_bytes=16 * PAGE, key_secret=ks.read_bytes()) as fdb:
        assert fdb.match_prefix(fdb.block_keys(p2, tenant=TENANT)) == 4
        assert fdb.match_prefix(fdb.block_keys(p1, tenant=TENANT)) == 0
        out = torch.empty_like(b2)
        fdb.get_blocks(k2, out=out)
        assert torch.equal(out, b2)
