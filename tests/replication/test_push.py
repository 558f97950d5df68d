"""Push and remote lookup against an in-process NodeServer, over the Mooncake Transfer Engine
and over the inline-TCP fallback, inside a private network namespace (conftest.netns)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import kvdb
from kvdb.errors import AuthError, InvalidInput, ReplicationError
from kvdb.replication import NodeServer, Peer
from kvdb.replication.transport import MooncakeTransport

from .conftest import LAYOUT, SECRET, TRANSPORTS, make_blocks, make_keys, needs_te, wait_for


@pytest.fixture
def server(netns, tmp_path, request):
    kind = getattr(request, "param", "tcp")
    db = kvdb.open(tmp_path / "peer", layout=LAYOUT, model_id="m", host_bytes=64 * LAYOUT.page_bytes, disk_bytes=0)
    srv = NodeServer(db, "127.0.0.1:0", SECRET, node="decode-0", transport=kind).start()
    yield srv
    srv.stop()
    db.close()


def _stored(db, keys) -> torch.Tensor:
    out = torch.empty((len(keys), *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    db.get_blocks(keys, out=out)
    return out


@pytest.mark.parametrize("server", TRANSPORTS, indirect=True)
def test_push_stores_exact_bytes_then_lookup_returns_them(server):
    # Scenario: 10 blocks pushed in chunks of 3 (4 chunks, two in flight); the peer holds each
    # block bit-exact; a lookup of 6 known keys + 1 unknown reports 6 hits and their bytes.
    blocks = make_blocks(10, seed=1)
    keys = make_keys(10, tag=1)
    with Peer(server.address, secret=SECRET, transport=server.transport.kind,
              chunk_bytes=3 * LAYOUT.page_bytes) as p:
        assert p.uses_engine == (server.transport.kind == "mooncake")
        r = p.push(keys, blocks, durability="none")
        assert (r.num_blocks, r.num_bytes, r.transport) == (10, 10 * LAYOUT.page_bytes, server.transport.kind)
        assert torch.equal(_stored(server.db, keys), blocks)
        hits, got = p.lookup(keys[:6] + make_keys(1, tag=9))
        assert hits == 6
        assert torch.equal(got.view(LAYOUT.dtype).view(6, *LAYOUT.block_shape), blocks[:6])
        hits, got = p.lookup(make_keys(2, tag=9) + keys[:2])
        assert (hits, got) == (0, None)
        # pushing the same keys again stores nothing new and changes no byte
        p.push(keys[:4], make_blocks(4, seed=2), durability="none")
        assert torch.equal(_stored(server.db, keys), blocks)
        st = p.status()
    assert st["counters"]["blocks_received"] == 14
    assert st["counters"]["blocks_served"] == 6
    assert st["counters"]["blocks_served_by_engine"] == (6 if server.transport.kind == "mooncake" else 0)
    assert st["db"]["tiers"]["host"]["pages"] == 10


@pytest.mark.parametrize("server", TRANSPORTS, indirect=True)
def test_wrong_secret_is_refused_and_counted(server):
    with pytest.raises(AuthError, match="different shared secrets"):
        Peer(server.address, secret=b"not-the-cluster-secret!!", transport="tcp")
    with pytest.raises(AuthError, match="no replication secret"):
        Peer(server.address, secret=b"", transport="tcp")
    with Peer(server.address, secret=SECRET, transport="tcp") as p:
        # the client gives up as soon as it sees the server's proof fail; the server counts the
        # refusal when it reads the client's ERROR frame, which may come after this status call
        wait_for(lambda: p.status()["counters"]["auth_failures"] >= 1, "the node's count of refused handshakes")
        assert p.status()["counters"]["auth_failures"] == 1


@pytest.mark.parametrize("server", TRANSPORTS, indirect=True)
def test_corrupted_push_message_stores_nothing(server):
    # Scenario: the PUT_BLOCKS frame of the only chunk is damaged in transit: the peer drops the
    # connection, the push raises, no block is stored; the node keeps serving other peers (N3).
    keys = make_keys(4, tag=2)
    p = Peer(server.address, secret=SECRET, transport=server.transport.kind)
    p.channel.debug_corrupt_next_send()
    with pytest.raises(ReplicationError):
        p.push(keys, make_blocks(4, seed=3), durability="none")
    p.close()
    with Peer(server.address, secret=SECRET, transport="tcp") as q:
        assert q.lookup(keys, fetch=False)[0] == 0
        assert q.status()["counters"]["corrupt_frames"] == 1


def test_wrong_layout_is_refused(server):
    other = torch.zeros((2, 8, 1024), dtype=torch.uint8)
    with Peer(server.address, secret=SECRET, transport="tcp") as p:
        with pytest.raises(InvalidInput, match="another layout"):
            p.push(make_keys(2, tag=3), other)
        with pytest.raises(InvalidInput, match="2 keys but 3 pages"):
            p.push(make_keys(2, tag=3), make_blocks(3, seed=0))
        with pytest.raises(InvalidInput, match="key 0 must be 16 bytes"):
            p.push([b"short"], make_blocks(1, seed=0))
        # a client that skips its own check gets the node's refusal, and nothing is stored
        p.peer_layout = None
        with pytest.raises(ReplicationError, match="stores 16384-byte blocks"):
            p.push(make_keys(2, tag=3), other)
    assert server.db.match_prefix(make_keys(2, tag=3)) == 0


def test_memory_only_peer_refuses_sync_durability(server):
    with Peer(server.address, secret=SECRET, transport="tcp") as p:
        with pytest.raises(ReplicationError, match="needs the disk tier"):
            p.push(make_keys(1, tag=4), make_blocks(1, seed=4), durability="sync")


class _FlipOneByte(MooncakeTransport):
    """Fault injection: the engine delivers the first block with one byte changed."""

    def write_async(self, peer, srcs, dst_addrs):
        ptr, n = srcs[0]
        src = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), (n,))
        bad = torch.from_numpy(src.copy())
        bad[n // 2] ^= 0xFF
        self.register(bad)
        self.keep = bad
        return super().write_async(peer, [(bad.data_ptr(), n)] + srcs[1:], dst_addrs)


@needs_te
@pytest.mark.parametrize("server", ["mooncake"], indirect=True)
def test_block_damaged_by_the_engine_is_rejected(server):
    # Scenario: the data plane corrupts one byte of block 0 of a 3-block chunk (N2): the peer
    # checks each block's XXH3-128 digest before storing, refuses the chunk whole, and the push raises.
    keys = make_keys(3, tag=5)
    p = Peer(server.address, secret=SECRET, transport=_FlipOneByte("127.0.0.1"))
    with pytest.raises(ReplicationError, match="1 of 3 landed blocks fail their XXH3-128 digest"):
        p.push(keys, make_blocks(3, seed=5), durability="none")
    p.close()
    assert server.db.match_prefix(keys) == 0


@pytest.mark.parametrize("server", TRANSPORTS, indirect=True)
def test_replicator_pushes_pinned_pages_and_fetches_missing_ones(server, tmp_path):
    # Scenario: a prefill Db holds 6 blocks; Replicator.push sends 4 of them from its pinned
    # arena pages (registered with the engine once, no staging copy) to the decode node. A third
    # Db with the decode node as its peer misses locally, fetches the 4 from the peer (the 5th
    # key is nowhere), and then holds them bit-exact.
    from kvdb.replication.replicator import Replicator

    blocks, keys = make_blocks(6, seed=6), make_keys(6, tag=6)
    kind = server.transport.kind
    with kvdb.open(tmp_path / "prefill", layout=LAYOUT, model_id="m", host_bytes=16 * LAYOUT.page_bytes,
                   disk_bytes=0) as prefill:
        prefill.put_blocks(keys, blocks)
        rep = Replicator(prefill, secret=SECRET, transport=kind)
        try:
            r = rep.push(keys[:4], server.address, durability="none")
            assert (r.num_blocks, r.transport) == (4, kind)
        finally:
            rep.close()
    assert torch.equal(_stored(server.db, keys[:4]), blocks[:4])
    with kvdb.open(tmp_path / "other", layout=LAYOUT, model_id="m", host_bytes=16 * LAYOUT.page_bytes,
                   disk_bytes=0) as other:
        rep = Replicator(other, peers=[server.address], secret=SECRET, transport=kind)
        try:
            assert rep.fetch_missing(keys[:5]) == 4
            assert rep.fetch_missing(keys[:4]) == 4  # now local: no peer call needed
        finally:
            rep.close()
        out = torch.empty((4, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        other.get_blocks(keys[:4], out=out)
        assert torch.equal(out, blocks[:4])
    assert server.status()["counters"]["lookups"] == 1


def test_stop_joins_connection_threads(netns, tmp_path):
    # Scenario: a client still connected when the node stops. stop() returns only once that
    # connection's thread has ended: a daemon thread still unwinding at interpreter exit dies
    # inside torch's C++ destructors and aborts the process ("terminate called without an
    # active exception", seen in CI after a Transfer Engine replication).
    import threading

    db = kvdb.open(tmp_path / "peer", layout=LAYOUT, model_id="m", host_bytes=64 * LAYOUT.page_bytes, disk_bytes=0)
    srv = NodeServer(db, "127.0.0.1:0", SECRET, transport="tcp").start()
    p = Peer(srv.address, secret=SECRET, transport="tcp")
    try:
        p.push(make_keys(3, tag=1), make_blocks(3, seed=1), durability="none")
        assert any(t.name.startswith("kvdb-conn-") for t in threading.enumerate())
        srv.stop()
        assert [t.name for t in threading.enumerate() if t.name.startswith("kvdb-conn-")] == []
    finally:
        p.close()
        db.close()
