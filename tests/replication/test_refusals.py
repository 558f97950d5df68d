"""Peers that must be refused, and say so (issue 14, holes 4 and 7): a follower of another
namespace refuses a leader's records and the leader reports why; a Db whose peers= hold another
secret counts it, logs it once per peer, and raises AuthError on explicit calls.

In-process nodes on 127.0.0.1 over the inline TCP transport (nothing else listens)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import kvdb
from kvdb import BlockLayout
from kvdb.errors import AuthError, NamespaceError, ReplicationError
from kvdb.replication import NodeServer
from kvdb.replication.sink import LogSink

from .conftest import KEY_SECRET, LAYOUT, SECRET, make_blocks, make_keys, wait_for

PAGE = LAYOUT.page_bytes
# other layouts of the same page size (16 KiB): only the namespace tells them apart
SAME_PAGE_OTHER_SHAPE = BlockLayout(num_layers=8, num_kv_heads=2, head_dim=16, block_tokens=16, dtype=torch.bfloat16)
SAME_PAGE_OTHER_DTYPE = BlockLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_tokens=16, dtype=torch.float16)
OTHER_PAGE = BlockLayout(num_layers=8, num_kv_heads=2, head_dim=32, block_tokens=16, dtype=torch.bfloat16)
assert SAME_PAGE_OTHER_SHAPE.page_bytes == SAME_PAGE_OTHER_DTYPE.page_bytes == PAGE != OTHER_PAGE.page_bytes


def _leader(path, secret_file, replicas=(), peers=(), **kw):
    kw.setdefault("key_secret", KEY_SECRET)  # the cluster's key namespace
    return kvdb.open(path, layout=LAYOUT, model_id="test-model", host_bytes=16 * PAGE, replicas=list(replicas),
                     peers=list(peers), replication_secret_file=secret_file, replication_transport="tcp", **kw)


class _Follower:
    """An in-process follower node: a Db with a disk tier, a LogSink, a NodeServer."""

    def __init__(self, path, *, layout=LAYOUT, model_id="test-model", secret=SECRET, **kw) -> None:
        kw.setdefault("key_secret", KEY_SECRET)  # the cluster's key namespace
        self.db = kvdb.open(path, layout=layout, model_id=model_id, host_bytes=16 * layout.page_bytes, **kw)
        self.srv = NodeServer(self.db, "127.0.0.1:0", secret, transport="tcp", sink=LogSink.for_db(self.db)).start()
        self.address = self.srv.address

    def close(self) -> None:
        self.srv.stop()
        self.db.close()


NAMESPACES = [
    pytest.param({"model_id": "another-model"}, "model_id 'test-model' vs 'another-model'", id="model"),
    pytest.param({"model_revision": "rev-2"}, "model_revision None vs 'rev-2'", id="revision"),
    pytest.param({"layout": SAME_PAGE_OTHER_SHAPE}, "layout (head_dim 32 vs 16, num_layers 4 vs 8)", id="layout"),
    pytest.param({"layout": SAME_PAGE_OTHER_DTYPE}, "layout (dtype 'bfloat16' vs 'float16')", id="dtype"),
    pytest.param({"key_algo": "xxh3_128"}, "key_algo 'sha256' vs 'xxh3_128'", id="key-namespace"),
    pytest.param({"key_secret": b"another-cluster-key-secret-0123"}, "another key secret (key_secret_id ",
                 id="key-secret"),
    pytest.param({"layout": OTHER_PAGE}, "layout (num_layers 4 vs 8)", id="page-size"),
]


@pytest.mark.parametrize("follower_kw, why", NAMESPACES)
def test_a_follower_of_another_namespace_refuses_and_the_leader_says_why(tmp_path, secret_file, follower_kw, why):
    # Scenario: a leader Db of test-model (bf16, 4 layers, sha256 keys) with replicas=[f]
    # writes 3 blocks; f holds another model / revision / layout / dtype / key namespace /
    # key secret / page size. f refuses the stream before any record (nothing applied, counted); the
    # leader's sync_replicas raises at once with f's own reason naming the field that differs
    # (not a timeout), and replication_status() shows the follower refused with that reason.
    keys, blocks = make_keys(3, tag=90), make_blocks(3, seed=90)
    f = _Follower(tmp_path / "f", **follower_kw)
    try:
        with _leader(tmp_path / "leader", secret_file, replicas=[f.address]) as db:
            db.put_blocks(keys, blocks, durability="group")
            refused = r"cannot confirm lsn \d+: .*\(refused: .*" + re.escape(why)
            with pytest.raises(NamespaceError, match=refused) as e:
                db.sync_replicas(60)
            assert not isinstance(e.value, AuthError)
            st = db.replication_status()["followers"][0]
            assert st["state"] == "refused" and st["confirmed_lsn"] == 0 and st["refusals"] >= 1
            assert why in st["error"] and "another namespace" in st["error"] and "nothing was applied" in st["error"]
            assert db.stats()["replication"]["refused_streams"] >= 1
            assert db.stats()["replication"]["namespace_refusals"] >= 1 and st["namespace_refusals"] >= 1
        sink = f.srv.sink.status()
        assert sink["applied_lsn"] == 0 and sink["records"] == 0 and sink["refused_streams"] >= 1
        assert f.db.match_prefix(keys, peek=True) == 0
    finally:
        f.close()


def test_a_follower_of_the_same_namespace_still_follows(tmp_path, secret_file):
    # The control of the test above: the same model and key secret (the cluster's) and a
    # default revision takes the stream.
    keys, blocks = make_keys(3, tag=91), make_blocks(3, seed=91)
    f = _Follower(tmp_path / "f")
    try:
        with _leader(tmp_path / "leader", secret_file, replicas=[f.address]) as db:
            db.put_blocks(keys, blocks, durability="group")
            assert db.sync_replicas(60) > 0
            assert db.replication_status()["followers"][0]["state"] == "streaming"
        out = torch.empty_like(blocks)
        f.db.get_blocks(keys, out=out)
        assert torch.equal(out, blocks)
    finally:
        f.close()


def test_no_block_is_pushed_to_or_fetched_from_a_peer_of_another_namespace(tmp_path, secret_file):
    # Scenario: node B serves a Db of another model holding 4 blocks under keys A looks up. A
    # (peers=[B]) misses locally: it fetches nothing from B (its blocks are another model's)
    # and counts the refusal; A's push to B raises naming the model, and B stores nothing.
    other = kvdb.open(tmp_path / "b", layout=LAYOUT, model_id="another-model", host_bytes=16 * PAGE, disk_bytes=0)
    srv = NodeServer(other, "127.0.0.1:0", SECRET, transport="tcp").start()
    keys, blocks = make_keys(4, tag=92), make_blocks(4, seed=92)
    mine, my_blocks = make_keys(2, tag=93), make_blocks(2, seed=93)
    try:
        other.put_blocks(keys, blocks)
        with _leader(tmp_path / "a", secret_file, peers=[srv.address], disk_bytes=0) as db:
            assert db.match_prefix(keys) == 0
            assert db.stats()["remote_hits"] == 0
            db.put_blocks(mine, my_blocks)
            with pytest.raises(ReplicationError, match="another namespace.*model_id 'another-model' vs 'test-model'"):
                db.push(mine, srv.address)
            assert db.stats()["replication"]["namespace_refusals"] == 2
            assert "model_id" in db.replication_status()["peer_errors"][srv.address]["last_error"]
        assert other.match_prefix(mine, peek=True) == 0
    finally:
        srv.stop()
        other.close()


def _mentions(records, start: str, addr: str) -> list[str]:
    """Log lines of this side (``start``) about ``addr`` (the in-process node logs its own)."""
    return [m for m in (r.getMessage() for r in records) if m.startswith(start) and addr in m]


def test_a_wrong_secret_on_peers_is_counted_logged_once_and_raised_on_explicit_calls(tmp_path, caplog):
    # Scenario: node B holds 4 blocks; Db A names B in peers= but holds another cluster secret.
    # Two lookups miss (a lookup is best effort), yet each failed handshake is counted in
    # A's stats()["replication"] and replication_status() (per peer, with the reason), and
    # logged once, not once per lookup. An explicit push raises AuthError and is counted too;
    # B counted every refused handshake.
    wrong = tmp_path / "wrong.secret"
    wrong.write_bytes(b"another-cluster-secret-0123456789\n")
    b_db = kvdb.open(tmp_path / "b", layout=LAYOUT, model_id="test-model", host_bytes=16 * PAGE, disk_bytes=0)
    srv = NodeServer(b_db, "127.0.0.1:0", SECRET, transport="tcp").start()
    keys, blocks = make_keys(4, tag=94), make_blocks(4, seed=94)
    try:
        b_db.put_blocks(keys, blocks)
        with _leader(tmp_path / "a", wrong, peers=[srv.address], disk_bytes=0) as db:
            with caplog.at_level(logging.WARNING, logger="kvdb.replication"):
                assert db.match_prefix(keys) == 0
                assert db.match_prefix(keys) == 0
            assert db.stats()["replication"]["auth_failures"] == 2
            per = db.replication_status()["peer_errors"][srv.address]
            assert per["auth_failures"] == 2 and "different shared secrets" in per["last_error"]
            logged = _mentions(caplog.records, "replication peer", srv.address)
            assert len(logged) == 1 and "different shared secrets" in logged[0], logged
            db.put_blocks(make_keys(1, tag=95), make_blocks(1, seed=95))
            with pytest.raises(AuthError, match="different shared secrets"):
                db.push(make_keys(1, tag=95), srv.address)
            assert db.stats()["replication"]["auth_failures"] == 3
        wait_for(lambda: srv.status()["counters"]["auth_failures"] == 3, "the node's count of refused handshakes")
        assert srv.status()["counters"]["connections"] == 0
    finally:
        srv.stop()
        b_db.close()


def test_a_wrong_secret_on_replicas_makes_sync_replicas_raise_auth_error(tmp_path, caplog):
    # Scenario: a leader whose replication secret differs from its follower's writes a block:
    # sync_replicas raises AuthError naming the follower and the reason at once (not a
    # ReplicationError after its timeout); the follower shows auth_failed, every retry is
    # counted, and the log has one line for it however many retries there were.
    wrong = tmp_path / "wrong.secret"
    wrong.write_bytes(b"another-cluster-secret-0123456789\n")
    f = _Follower(tmp_path / "f")
    try:
        with caplog.at_level(logging.WARNING, logger="kvdb.replication"):
            with _leader(tmp_path / "leader", wrong, replicas=[f.address]) as db:
                db.put_blocks(make_keys(1, tag=96), make_blocks(1, seed=96), durability="group")
                with pytest.raises(AuthError, match=f"{re.escape(f.address)} at 0 \\(auth_failed: .*different shared"):
                    db.sync_replicas(60)
                wait_for(lambda: db.replication_status()["followers"][0]["auth_failures"] >= 2, "a retry refused")
                assert db.replication_status()["followers"][0]["state"] == "auth_failed"
                assert db.stats()["replication"]["auth_failures"] >= 2
        assert len(_mentions(caplog.records, "log stream to follower", f.address)) == 1
        assert f.srv.status()["counters"]["auth_failures"] >= 2
        assert f.srv.sink.status()["applied_lsn"] == 0
    finally:
        f.close()
