"""Followers apply every record type the leader logs (puts, deletes, SESSION / TTL / LEASE
metadata) idempotently, across restarts and catch-up; encrypted logs ship sealed to a follower
holding the same key, and to no other (sink.py)."""

from __future__ import annotations

import os
import struct
import tempfile
import time

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvdb
from kvdb.replication import NodeServer
from kvdb.replication.channel import Channel
from kvdb.replication.replicator import Replicator
from kvdb.replication.sink import LogSink
from kvdb.wal.source import SegmentLogSource

from .conftest import KEY_SECRET, LAYOUT, SECRET, make_blocks, make_keys, open_db, wait_for

PAGE = LAYOUT.page_bytes


def _state(db, keys, names) -> tuple[dict, dict]:
    """What ``db`` holds: {key: page bytes} and {(kind, name): value} (via the public APIs)."""
    blocks = {}
    out = torch.empty((1, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    for k in keys:
        if db.match_prefix([k], peek=True):
            db.get_blocks([k], out=out)
            blocks[k] = out.view(torch.uint8).numpy().tobytes()
    meta = {}
    for kind in ("session", "ttl", "lease"):
        for n in names:
            v = db.cold_store.find_metadata(kind, n)
            if v is not None:
                meta[(kind, n)] = v
    return blocks, meta


class _Follower:
    """An in-process follower node (a Db, its LogSink and a NodeServer) that can be restarted."""

    def __init__(self, path, port: int = 0, **kw) -> None:
        self.db = open_db(path, **kw)

        def reopen(p, host_bytes=64 * PAGE):  # what kvdb replicate serve passes: its own options
            return kvdb.open(p, host_bytes=host_bytes, **{"key_secret": KEY_SECRET, **kw})

        self.srv = NodeServer(self.db, f"127.0.0.1:{port}", SECRET, transport="tcp",
                              sink=LogSink.for_db(self.db, reopen=reopen)).start()
        self.address = self.srv.address

    def stop(self) -> None:
        self.srv.stop()
        self.srv.db.close()  # a re-seed replaces the node's Db


# ---------------------------------------------------------------- metadata over the network


def test_metadata_reaches_the_follower_across_its_restart(netns, tmp_path):
    # Scenario: the leader logs blocks and SESSION / TTL / LEASE entries (one TTL already
    # expired); the follower holds them all. It stops, the leader removes the session, changes
    # the lease and deletes a block; the follower restarts on its port and catches up. Then its
    # compaction expires the TTL'd block (TTL expiry works from the shipped entry), and the
    # follower's directory reopens as an ordinary Db with the same metadata.
    keys, blocks = make_keys(4, tag=60), make_blocks(4, seed=60)
    past = struct.pack("<Q", time.time_ns() - 10**9)
    f = _Follower(tmp_path / "f")
    db = open_db(tmp_path / "leader")
    rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
    try:
        db.put_blocks(keys, blocks, durability="group")
        cold = db.cold_store
        cold.put_metadata("session", b"s1", b"agent-a")
        cold.put_metadata("ttl", keys[0], past)
        cold.put_metadata("lease", b"l1", b"holder-1")
        rep.sync_replicas(30)
        names = [b"s1", b"l1", keys[0]]
        assert _state(f.db, keys, names) == _state(db, keys, names)
        assert f.srv.sink.status()["metadata"] == 3

        f.stop()
        cold.put_metadata("session", b"s1", b"")  # removed
        cold.put_metadata("lease", b"l1", b"holder-2")
        db.delete(keys[3:])
        f = _Follower(tmp_path / "f", int(f.address.rsplit(":", 1)[1]))
        lsn = rep.sync_replicas(30)
        want = _state(db, keys, names)
        assert want[1] == {("ttl", keys[0]): past, ("lease", b"l1"): b"holder-2"}
        assert _state(f.db, keys, names) == want and len(want[0]) == 3
        st = f.srv.sink.status()
        assert (st["applied_lsn"], st["metadata"], st["duplicates"]) == (lsn, 2, 0)

        assert f.db.cold_store.compact()["ttl_expired"] == 1  # the shipped TTL entry expires it
        assert f.db.cold_store.contains(keys[:1]) == [False]
    finally:
        rep.close()
        db.close()
        f.stop()
    with open_db(tmp_path / "f") as plain:
        assert plain.cold_store.find_metadata("lease", b"l1") == b"holder-2"
        assert plain.cold_store.find_metadata("session", b"s1") is None


# ---------------------------------------------------------------- idempotent apply, as a property


_OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("delete"), st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("meta"), st.sampled_from(["session", "ttl", "lease"]), st.integers(0, 2),
              st.sampled_from([b"", b"a", b"bb"])),
), min_size=1, max_size=10)


@settings(max_examples=12)
@given(ops=_OPS, cuts=st.lists(st.integers(1, 40), max_size=6), resend=st.lists(st.booleans(), max_size=6),
       restart=st.integers(0, 6))
def test_any_split_resend_and_restart_converges(ops, cuts, resend, restart):
    # Property (S1, S2): the leader's log, shipped in any batch split, with batches re-sent
    # (duplicates) and the follower's sink recreated from its position file mid-way, leaves the
    # follower holding exactly the leader's blocks and metadata.
    keys = make_keys(6, tag=61)
    pages = make_blocks(6, seed=61)
    names = [bytes([n]) * 3 for n in range(3)]
    with tempfile.TemporaryDirectory() as tmp, open_db(os.path.join(tmp, "leader")) as db, \
            open_db(os.path.join(tmp, "f")) as fdb:
        for op in ops:
            if op[0] == "put":
                db.put_blocks([keys[i] for i in op[1]], pages[list(op[1])], durability="group")
            elif op[0] == "delete":
                db.delete([keys[i] for i in op[1]])
            else:
                db.cold_store.put_metadata(op[1], names[op[2]], op[3])
        db.flush()
        src = SegmentLogSource(db.cold_store.wal_dir, durable=lambda: db.cold_store.durable_lsn)
        recs = src.read_records(0, 1 << 30, src.durable_lsn())
        sink = LogSink(fdb, fdb.path / "replication", durable=True)
        at, batches = 0, []
        for n in [*cuts, len(recs)]:
            if at < len(recs):
                batches.append(recs[at : at + n])
                at += n
        for i, b in enumerate(batches):
            if i == restart:
                sink = LogSink(fdb, fdb.path / "replication", durable=True)
            assert sink.apply(b"".join(bytes(r) for _, r in b), b[0][0], b[-1][0]) == b[-1][0]
            if i < len(resend) and resend[i]:  # the leader re-sends what was acknowledged
                sink.apply(b"".join(bytes(r) for _, r in b), b[0][0], b[-1][0])
        assert _state(fdb, keys, names) == _state(db, keys, names)


# ---------------------------------------------------------------- encryption at rest


def _plaintext_found(blobs, pages: np.ndarray) -> list[str]:
    """Names of the blobs holding any 64-byte stretch of a page."""
    needles = [p[o : o + 64].tobytes() for p in pages for o in (0, PAGE // 2, PAGE - 64)]
    return [name for name, blob in blobs if any(n in blob for n in needles)]


def _files(root) -> list[tuple[str, bytes]]:
    out = []
    for d, _dirs, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out.append((os.path.join(d, f), fh.read()))
    return out


def test_encrypted_log_ships_sealed_and_only_to_a_follower_with_the_key(netns, tmp_path, monkeypatch):
    # Scenario: an encrypted leader ships to three followers: one with the same key, one with
    # no encryption, one with another key. The first holds the blocks bit-exact, then once more
    # after a re-seed (the copy's records travel sealed too); the other two are refused with a
    # clear error naming the key, and apply nothing. No file of any node and no byte sent on any
    # channel holds a stretch of a block's plaintext.
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    other = tmp_path / "other.key"
    other.write_text("ab" * 32)
    sent: list[tuple[str, bytes]] = []
    real = Channel._sendall

    def tap(self, bufs):  # every byte any channel of this process sends
        sent.append((f"to {self.peer}", b"".join(bytes(memoryview(b).cast("B")) for b in bufs)))
        return real(self, bufs)

    monkeypatch.setattr(Channel, "_sendall", tap)
    keys, blocks = make_keys(6, tag=62), make_blocks(6, seed=62)
    good = _Follower(tmp_path / "good", encryption_key_file=key)
    plain = _Follower(tmp_path / "plain")
    wrong = _Follower(tmp_path / "wrong", encryption_key_file=other)
    db = open_db(tmp_path / "leader", encryption_key_file=key)
    rep = Replicator(db, replicas=[good.address, plain.address, wrong.address], secret=SECRET, transport="tcp")
    try:
        db.put_blocks(keys, blocks, durability="group")
        db.cold_store.put_metadata("session", b"s", b"v")
        target = db.cold_store.durable_lsn
        wait_for(lambda: rep.status()["followers"][0]["confirmed_lsn"] >= target, "the follower with the key")
        for i in (1, 2):
            st = wait_for(lambda i=i: "encrypted at rest" in (rep.status()["followers"][i]["error"] or "")
                       and rep.status()["followers"][i], f"follower {i} refused")
            assert st["confirmed_lsn"] == 0
        for f in (plain, wrong):
            assert f.srv.sink.status()["applied_lsn"] == 0 and f.db.match_prefix(keys, peek=True) == 0
        out = torch.empty_like(blocks)
        good.db.get_blocks(keys, out=out)
        assert torch.equal(out, blocks)
        assert good.db.cold_store.find_metadata("session", b"s") == b"v"
        rep.reseed(good.address)
        wait_for(lambda: rep.status()["followers"][0]["reseeds"] == 1, "the re-seed of the follower with the key")
        out.zero_()
        good.srv.db.get_blocks(keys, out=out)
        assert torch.equal(out, blocks) and good.srv.sink.status()["reseeds"] == 1
        assert good.srv.db.cold_store.find_metadata("session", b"s") == b"v"
        assert good.srv.db.cold_store.stats()["encrypted"]
    finally:
        rep.close()
        db.close()
        for f in (good, plain, wrong):
            f.stop()
    pages = blocks.view(torch.uint8).reshape(6, PAGE).numpy()
    assert sum(len(b) for _, b in sent) > 6 * PAGE  # the records did cross the channels
    assert _plaintext_found(sent, pages) == []
    assert _plaintext_found(_files(tmp_path / "leader") + _files(tmp_path / "good"), pages) == []
