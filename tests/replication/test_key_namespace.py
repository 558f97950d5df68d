"""One key namespace per cluster (issue 14, holes 3 and 4; docs/replication.md "One key namespace
per cluster"): given the same key secret file, a follower made by ``kvdb replicate serve`` computes
its leader's keys for the same tokens and tenant, so lookups by tokens on it find the leader's
blocks; a follower of another secret refuses the leader's records (``NamespaceError`` from
``sync_replicas``, the reason in the leader's status and ``kvdb replicate status``), unless it
is a raw byte mirror (``--allow-foreign-keys``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kvdb

from .conftest import LAYOUT, SECRET, TRANSPORTS, make_blocks, make_keys, wait_for
from kvdb.errors import NamespaceError
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


def test_a_follower_of_another_key_secret_refuses_and_the_leader_says_why(netns, tmp_path, secret_file, nodes):
    # Scenario: the follower runs without --key-secret-file, so it keeps its own random KEY_SECRET
    # (before, it took the records anyway and a failover to it was a silent cold cache). The
    # leader (its own secret too) writes 4 blocks: the follower refuses the stream before any
    # record (ERROR{NAMESPACE}), so sync_replicas raises NamespaceError at once with the reason;
    # the leader shows the follower refused, key_namespace "differs", and counts the refusals.
    # Only fingerprints travel: neither node's key secret appears in any message. The follower
    # applied nothing of the leader's.
    f = nodes(tmp_path / "f", secret_file, transport="tcp", key_secret_file=None)
    blocks = make_blocks(4, seed=62)
    with _leader(tmp_path / "leader", f.address, secret_file, "tcp") as db:
        keys = db.block_keys(TOKENS, tenant=TENANT)
        db.put_blocks(keys, blocks, durability="group")
        with pytest.raises(NamespaceError, match="another namespace than this follower: another key secret") as err:
            db.sync_replicas(30)
        st = db.replication_status()
        (fs,) = st["followers"]
        assert (fs["state"], fs["key_namespace"], fs["confirmed_lsn"]) == ("refused", "differs", 0)
        assert "another key secret" in fs["error"] and "--key-secret-file" in fs["error"]
        assert fs["namespace_refusals"] >= 1 and fs["refusals"] >= fs["namespace_refusals"]
        assert st["counters"]["namespace_refusals"] >= 1 and st["counters"]["refused_streams"] >= 1
        assert db.stats()["replication"]["namespace_refusals"] >= 1
        ours = json.loads((tmp_path / "leader" / "MANIFEST.json").read_text())["key_secret_id"]
        theirs = json.loads((tmp_path / "f" / "MANIFEST.json").read_text())["key_secret_id"]
        assert f"key_secret_id {ours[:8]}... vs {theirs[:8]}..." in str(err.value)
        secrets = [(tmp_path / "leader" / "KEY_SECRET").read_bytes(), (tmp_path / "f" / "KEY_SECRET").read_bytes()]
    with Peer(f.address, secret=SECRET, transport="tcp") as p:
        fol = p.status()["follower"]
    assert (fol["key_namespace"], fol["applied_lsn"], fol["records"]) == ("differs", 0, 0)
    assert fol["refused_streams"] >= 1 and "another key secret" in fol["last_refusal"]
    for text in (str(err.value), fs["error"], fol["last_refusal"]):
        for secret in secrets:
            assert secret.hex() not in text and secret.hex()[:16] not in text
    assert f.stop() == 0
    with kvdb.open(tmp_path / "f", host_bytes=16 * PAGE) as fdb:
        assert fdb.cold_store.contains(keys) == [False] * 4


def test_kvdb_replicate_status_says_why_a_follower_refused(netns, tmp_path, secret_file, nodes):
    # Scenario: a `serve` leader given the cluster key secret file ships to a `serve` follower
    # given none (its own secret). A push to the leader is durable there, but the follower
    # refuses it; `kvdb replicate status` on the leader shows the follower refused, why (its
    # table and --json), and the follower's own status shows its refusal; it holds nothing.
    f = nodes(tmp_path / "f", secret_file, key_secret_file=None)
    leader = nodes(tmp_path / "leader", secret_file, replicas=[f.address])
    keys, blocks = make_keys(2, tag=65), make_blocks(2, seed=65)
    with Peer(leader.address, secret=SECRET) as p:
        p.push(keys, blocks, durability="sync")
        wait_for(lambda: p.status()["followers"][0]["state"] == "refused", "the follower to refuse")
    cli = [sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "replicate", "status", "--peer",
           leader.address, "--secret-file", str(secret_file)]
    r = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (fs,) = json.loads(r.stdout)["followers"]
    assert (fs["state"], fs["key_namespace"], fs["confirmed_lsn"]) == ("refused", "differs", 0)
    assert "another namespace than this follower: another key secret" in fs["error"]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    assert f"follower {f.address} (refused): " in r.stdout and "another key secret" in r.stdout
    with Peer(f.address, secret=SECRET) as p:
        assert p.lookup(keys)[0] == 0
        assert p.status()["follower"]["records"] == 0


def test_a_raw_byte_mirror_may_take_another_key_secret(netns, tmp_path, secret_file, nodes):
    # Scenario: the one use of a follower of another key secret, a raw byte mirror looked up by
    # its leader's keys, is an opt-in (serve --allow-foreign-keys): it takes the stream, holds
    # the leader's blocks bit-exact, and both nodes say key_namespace "differs"; its own lookups
    # by tokens compute other keys and find none of them.
    f = nodes(tmp_path / "f", secret_file, transport="tcp", key_secret_file=None, allow_foreign_keys=True)
    blocks = make_blocks(4, seed=66)
    with _leader(tmp_path / "leader", f.address, secret_file, "tcp") as db:
        keys = db.block_keys(TOKENS, tenant=TENANT)
        db.put_blocks(keys, blocks, durability="group")
        db.sync_replicas(30)
        assert db.replication_status()["followers"][0]["key_namespace"] == "differs"
    with Peer(f.address, secret=SECRET, transport="tcp") as p:
        fol = p.status()["follower"]
        assert (fol["key_namespace"], fol["allow_foreign_keys"], fol["refused_streams"]) == ("differs", True, 0)
        hits, rows = p.lookup(keys)
    assert hits == 4 and torch.equal(rows.view(LAYOUT.dtype).view(4, *LAYOUT.block_shape), blocks)
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
