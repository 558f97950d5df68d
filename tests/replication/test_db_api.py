"""Replication through the Db's own API: kvdb.open(peers=, replicas=, replication_secret_file=),
db.push, remote lookup on a local miss, db.sync_replicas (inside a private namespace)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import kvdb
from kvdb.errors import InvalidInput
from kvdb.replication import Peer

from .conftest import KEY_SECRET, LAYOUT, SECRET, TRANSPORTS, make_blocks, make_keys, open_db
from .test_push import server  # noqa: F401 - the in-process node fixture

_open = partial(open_db, host_pages=16, model_id="m", disk_bytes=0)


@pytest.mark.parametrize("server", TRANSPORTS, indirect=True)
def test_push_then_a_peer_serves_a_local_miss(server, tmp_path, secret_file):
    # Scenario: prefill pushes 4 of its 6 blocks to the decode node with db.push; a third Db that
    # names the decode node in peers= misses locally, match_prefix fetches the 4 from the peer
    # (the 5th key is nowhere) and counts them as remote hits; the bytes are exact.
    kind = server.transport.kind
    blocks, keys = make_blocks(6, seed=40), make_keys(6, tag=40)
    with _open(tmp_path / "prefill", replication_secret_file=secret_file, replication_transport=kind) as prefill:
        prefill.put_blocks(keys, blocks)
        r = prefill.push(keys[:4], server.address, durability="none")
        assert r.num_blocks == 4
    with _open(tmp_path / "other", peers=[server.address], replication_secret_file=secret_file,
               replication_transport=kind) as other:
        assert other.match_prefix(keys[:5]) == 4
        assert other.stats()["remote_hits"] == 4
        assert other.match_prefix(keys[:5], peek=True) == 4  # now local
        out = torch.empty((4, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        other.get_blocks(keys[:4], out=out)
        assert torch.equal(out, blocks[:4])
        assert other.replication_status()["peers"] == [server.address]


def test_replication_options_are_checked(tmp_path, secret_file):
    with _open(tmp_path / "a") as db:
        with pytest.raises(InvalidInput, match="no replication"):
            db.push(make_keys(1, tag=1), "127.0.0.1:1")
        with pytest.raises(InvalidInput, match="no replication"):
            db.sync_replicas(1)
    with pytest.raises(InvalidInput, match="replication_secret_file"):
        _open(tmp_path / "b", peers=["127.0.0.1:9"])
    with pytest.raises(InvalidInput, match="host:port"):
        _open(tmp_path / "c", peers=["nowhere"], replication_secret_file=secret_file)
    with _open(tmp_path / "c"):  # the failed open released the directory
        pass


def test_sync_replicas_through_the_db(netns, tmp_path, secret_file, nodes):
    # Scenario: a leader Db opened with replicas=[follower] writes 3 blocks with group
    # durability; db.sync_replicas returns once the follower holds them bit-exact.
    f = nodes(tmp_path / "f", secret_file, transport="tcp")
    blocks, keys = make_blocks(3, seed=41), make_keys(3, tag=41)
    with kvdb.open(tmp_path / "leader", layout=LAYOUT, model_id="test-model", host_bytes=16 * LAYOUT.page_bytes,
                   replicas=[f.address], replication_secret_file=secret_file, replication_transport="tcp",
                   key_secret=KEY_SECRET) as db:
        db.put_blocks(keys, blocks, durability="group")
        assert db.sync_replicas(30) > 0
        st = db.replication_status()["followers"][0]
        assert st["confirmed_lsn"] >= 1
    with Peer(f.address, secret=SECRET, transport="tcp") as p:
        hits, rows = p.lookup(keys)
    assert hits == 3 and torch.equal(rows.view(LAYOUT.dtype).view(3, *LAYOUT.block_shape), blocks)
