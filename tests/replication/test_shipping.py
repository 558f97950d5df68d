"""Log shipping from an in-process leader Db to ``kvdb replicate serve`` followers, inside one
private network namespace: catch-up after a follower is killed, a leader restart, a wrong
secret, a damaged record."""

from __future__ import annotations

import time

import pytest
import torch

import kvdb
from kvdb.errors import ReplicationError
from kvdb.replication import Peer
from kvdb.replication.replicator import Replicator
from kvdb.replication.slots import retained_lsn

from .conftest import KEY_SECRET, LAYOUT, SECRET, TRANSPORTS, make_blocks, make_keys


def _leader(path):
    return kvdb.open(path, layout=LAYOUT, model_id="test-model", host_bytes=64 * LAYOUT.page_bytes,
                     key_secret=KEY_SECRET)


def _holds(addr: str, keys, blocks) -> bool:
    with Peer(addr, secret=SECRET, transport="tcp") as p:
        hits, rows = p.lookup(keys)
    return hits == len(keys) and torch.equal(rows.view(LAYOUT.dtype).view(hits, *LAYOUT.block_shape), blocks)


def _count(addr: str, keys) -> int:
    with Peer(addr, secret=SECRET, transport="tcp") as p:
        return p.lookup(keys, fetch=False)[0]


def _wait_for_error(rep: Replicator, text: str, timeout_s: float = 30.0) -> dict:
    """The first follower's status once its last error mentions ``text`` (polls; no timing asserted)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = rep.status()["followers"][0]
        if text in (st["error"] or ""):
            return st
        time.sleep(0.02)
    raise AssertionError(f"no follower error mentioning {text!r}: {rep.status()}")


def _follower_status(addr: str) -> dict:
    with Peer(addr, secret=SECRET, transport="tcp") as p:
        return p.status()["follower"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_two_followers_catch_up_after_one_is_killed(netns, tmp_path, secret_file, nodes, kind):
    # Scenario: a leader ships to two followers. Batch 1 (6 puts, then a delete of 2) is
    # confirmed by both. Follower f1 is SIGKILLed; batch 2 is written; sync_replicas times out
    # naming f1 while f2 has it. f1 restarts on its port, catches up from its persisted applied
    # lsn, and both hold exactly batch 1 (minus the deleted) + batch 2.
    f1 = nodes(tmp_path / "f1", secret_file, transport=kind, wait=False)
    f2 = nodes(tmp_path / "f2", secret_file, transport=kind, wait=False)
    f1.wait_ready(), f2.wait_ready()
    db = _leader(tmp_path / "leader")
    rep = Replicator(db, replicas=[f1.address, f2.address], secret=SECRET, transport=kind)
    try:
        b1, k1 = make_blocks(6, seed=20), make_keys(6, tag=20)
        db.put_blocks(k1, b1, durability="group")
        db.delete(k1[4:])
        lsn1 = rep.sync_replicas(30)
        for f in (f1, f2):
            assert _holds(f.address, k1[:4], b1[:4]) and _count(f.address, k1[4:]) == 0
        assert _follower_status(f1.address)["applied_lsn"] == lsn1

        f1.kill()
        b2, k2 = make_blocks(5, seed=21), make_keys(5, tag=21)
        db.put_blocks(k2, b2, durability="group")
        with pytest.raises(ReplicationError, match=f"{f1.address} at {lsn1}"):
            rep.sync_replicas(1.0)
        assert _holds(f2.address, k2, b2)
        f1.start()
        lsn2 = rep.sync_replicas(30)
        assert lsn2 > lsn1
        for f in (f1, f2):
            assert _holds(f.address, k1[:4] + k2, torch.cat([b1[:4], b2]))
            assert _count(f.address, k1[4:]) == 0
        st = _follower_status(f1.address)
        assert st["applied_lsn"] == lsn2 and st["duplicates"] == 0
        assert [s["lag_records"] for s in rep.status()["followers"]] == [0, 0]
    finally:
        rep.close()
        db.close()
    # replication slots: the leader kept each follower's confirmed lsn (S4)
    assert retained_lsn(tmp_path / "leader" / "replication") == lsn2


def test_leader_restart_resumes_from_the_follower_position(netns, tmp_path, secret_file, nodes):
    f = nodes(tmp_path / "f", secret_file, transport="tcp")
    b1, k1 = make_blocks(3, seed=30), make_keys(3, tag=30)
    b2, k2 = make_blocks(3, seed=31), make_keys(3, tag=31)
    with _leader(tmp_path / "leader") as db:
        rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
        db.put_blocks(k1, b1, durability="sync")
        lsn1 = rep.sync_replicas(30)
        rep.close()
    with _leader(tmp_path / "leader") as db:
        rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
        db.put_blocks(k2, b2, durability="sync")
        lsn2 = rep.sync_replicas(30)
        rep.close()
    assert lsn2 > lsn1
    assert _holds(f.address, k1 + k2, torch.cat([b1, b2]))
    st = _follower_status(f.address)
    assert st["applied_lsn"] == lsn2 and st["duplicates"] == 0 and st["batches"] >= 2
    # a different leader (a fresh data directory, longer log) must not feed this follower:
    # its lsns count another history, so it is marked for re-seeding and nothing is applied
    with _leader(tmp_path / "other") as db:
        db.put_blocks(make_keys(9, tag=32), make_blocks(9, seed=32), durability="sync")
        rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
        st = _wait_for_error(rep, "another leader log")
        rep.close()
    assert st["state"] == "needs_reseed"
    assert _follower_status(f.address)["applied_lsn"] == lsn2 and _count(f.address, make_keys(9, tag=32)) == 0


def test_wrong_secret_and_damaged_record_are_reported(netns, tmp_path, secret_file, nodes):
    f = nodes(tmp_path / "f", secret_file, transport="tcp")
    k, b = make_keys(2, tag=40), make_blocks(2, seed=40)
    with _leader(tmp_path / "leader") as db:
        db.put_blocks(k, b, durability="sync")
        rep = Replicator(db, replicas=[f.address], secret=b"not-the-cluster-secret!!", transport="tcp")
        assert _wait_for_error(rep, "different shared secrets")["state"] == "auth_failed"
        with pytest.raises(ReplicationError, match="auth_failed.*different shared secrets"):
            rep.sync_replicas(0.1)
        rep.close()

        # fault injection: the log source hands out a record with one flipped body byte
        rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
        src = rep.shipper.source
        real = src.read_records

        def damaged(after, max_bytes, upto):
            recs = real(after, max_bytes, upto)
            bad = bytearray(recs[0][1])
            bad[-1] ^= 0x01
            return [(recs[0][0], memoryview(bytes(bad)))] + recs[1:]

        src.read_records = damaged
        assert _wait_for_error(rep, "fails its crc32c")["confirmed_lsn"] == 0
        with pytest.raises(ReplicationError, match="fails its crc32c"):
            rep.sync_replicas(0.1)
        rep.close()
    assert _count(f.address, k) == 0
    assert _follower_status(f.address)["applied_lsn"] == 0


def test_dropped_connections_are_resumed_without_loss(netns, tmp_path):
    # Scenario: an in-process follower node drops every connection (a network blip) between
    # two batches of writes; the leader reconnects, resumes from the follower's position and
    # the follower ends with both batches bit-exact and no record applied twice.
    from kvdb.replication import NodeServer
    from kvdb.replication.sink import LogSink

    fdb = kvdb.open(tmp_path / "f", layout=LAYOUT, model_id="test-model", host_bytes=64 * LAYOUT.page_bytes,
                    key_secret=KEY_SECRET)
    srv = NodeServer(fdb, "127.0.0.1:0", SECRET, transport="tcp", sink=LogSink.for_db(fdb)).start()
    b1, k1 = make_blocks(4, seed=50), make_keys(4, tag=50)
    b2, k2 = make_blocks(4, seed=51), make_keys(4, tag=51)
    try:
        with _leader(tmp_path / "leader") as db:
            rep = Replicator(db, replicas=[srv.address], secret=SECRET, transport="tcp")
            try:
                db.put_blocks(k1, b1, durability="group")
                rep.sync_replicas(30)
                assert srv.debug_drop_connections() == 1
                db.put_blocks(k2, b2, durability="group")
                lsn = rep.sync_replicas(30)
                assert rep.status()["followers"][0]["connects"] == 2
            finally:
                rep.close()
        out = torch.empty((8, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        fdb.get_blocks(k1 + k2, out=out)
        assert torch.equal(out, torch.cat([b1, b2]))
        st = srv.sink.status()
        assert (st["applied_lsn"], st["duplicates"], st["puts"]) == (lsn, 0, 8)
    finally:
        srv.stop()
        fdb.close()


def test_streams_are_woken_by_the_store_not_by_polling(netns, tmp_path, secret_file, nodes, monkeypatch):
    # Scenario: the streams' safety-net poll is an hour, so only the store's durability
    # listener can tell them about new records: a group put, a sync put and a write-back put
    # made durable by flush() each reach the follower (shipper.sync does not wake streams).
    # Once the shipper has stopped it is no longer a listener of the store.
    from kvdb.replication import shipping

    monkeypatch.setattr(shipping, "POLL_S", 3600.0)
    f = nodes(tmp_path / "f", secret_file, transport="tcp")
    with _leader(tmp_path / "leader") as db:
        rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
        try:
            rep.shipper.sync(30)  # the stream is connected and idle
            for tag, durability in ((40, "group"), (41, "sync"), (42, "none")):
                keys, blocks = make_keys(2, tag=tag), make_blocks(2, seed=tag)
                db.put_blocks(keys, blocks, durability=durability, tier="disk")
                if durability == "none":
                    db.flush()
                lsn = rep.shipper.sync(30)
                assert lsn == db.cold_store.durable_lsn
                assert _holds(f.address, keys, blocks)
            assert rep.shipper._on_durable in db.cold_store.queue.listeners
        finally:
            rep.close()
        assert db.cold_store.queue.listeners == ()
