"""Two and three nodes as ``kvdb replicate serve`` processes on loopback inside one private
network namespace: durable pushes survive a SIGKILL, a node killed mid-push loses nothing it
acknowledged, the CLI reports status and refuses a wrong secret."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

import kvdb
from kvdb.errors import AuthError, ReplicationError
from kvdb.replication import Peer

from .conftest import KEY_SECRET, LAYOUT, SECRET, TRANSPORTS, make_blocks, make_keys

pytestmark = pytest.mark.slow  # every test runs node processes: 5-15 s each


def _fetch(addr: str, keys) -> tuple[int, torch.Tensor | None]:
    with Peer(addr, secret=SECRET, transport="tcp") as p:
        hits, rows = p.lookup(keys)
    return hits, None if rows is None else rows.view(LAYOUT.dtype).view(hits, *LAYOUT.block_shape)


class _KillAfterAcks(Peer):
    """Fault injection: SIGKILL the peer's process right after its ``after``-th acknowledgement."""

    def __init__(self, *a, node_proc, after: int, **kw):
        super().__init__(*a, **kw)
        self._node_proc, self._after, self.acked = node_proc, after, 0

    def _wait_ack(self, chunk: int) -> None:
        super()._wait_ack(chunk)
        self.acked += 1
        if self.acked == self._after:
            self._node_proc.kill()


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_node_killed_mid_push_keeps_every_acknowledged_block(netns, tmp_path, secret_file, nodes, kind):
    # Scenario: 12 blocks pushed with durability=sync in chunks of 2 (6 chunks); the node is
    # SIGKILLed right after the 2nd ack. The push raises; after a restart on the same port the
    # 4 acknowledged blocks are there bit-exact (P1, N1); re-pushing all 12 completes them.
    node = nodes(tmp_path / "decode", secret_file, transport=kind)
    blocks, keys = make_blocks(12, seed=10), make_keys(12, tag=10)
    p = _KillAfterAcks(node.address, secret=SECRET, transport=kind, chunk_bytes=2 * LAYOUT.page_bytes,
                       node_proc=node, after=2)
    with pytest.raises(ReplicationError):
        p.push(keys, blocks, durability="sync")
    p.close()
    assert p.acked == 2
    node.start()
    hits, got = _fetch(node.address, keys)
    assert hits >= 4 and torch.equal(got[:4], blocks[:4]) and torch.equal(got, blocks[:hits])
    with Peer(node.address, secret=SECRET, transport=kind) as q:
        assert q.push(keys, blocks, durability="sync").num_blocks == 12
    hits, got = _fetch(node.address, keys)
    assert hits == 12 and torch.equal(got, blocks)
    # after the daemon stops, PATH opens as an ordinary Db holding the blocks
    assert node.stop() == 0
    with kvdb.open(tmp_path / "decode", host_bytes=16 * LAYOUT.page_bytes, key_secret=KEY_SECRET) as db:
        out = torch.empty((12, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        db.get_blocks(keys, out=out)
        assert torch.equal(out, blocks)


def test_three_nodes_push_and_status_cli(netns, tmp_path, secret_file, nodes):
    # Scenario: this process pushes one request's blocks to two decode nodes; each holds exactly
    # what it was sent; `kvdb replicate status --json` reports the counters; a wrong secret
    # exits 1 with a clear message.
    a = nodes(tmp_path / "a", secret_file, wait=False)
    b = nodes(tmp_path / "b", secret_file, wait=False)
    a.wait_ready(), b.wait_ready()
    blocks, keys = make_blocks(6, seed=11), make_keys(6, tag=11)
    with Peer(a.address, secret=SECRET) as pa, Peer(b.address, secret=SECRET) as pb:
        pa.push(keys[:4], blocks[:4])
        pb.push(keys[2:], blocks[2:])
    assert _fetch(a.address, keys)[0] == 4 and torch.equal(_fetch(a.address, keys[:4])[1], blocks[:4])
    assert _fetch(b.address, keys)[0] == 0
    hits, got = _fetch(b.address, keys[2:])
    assert hits == 4 and torch.equal(got, blocks[2:])

    kvdb_cli = [sys.executable, "-c", "from kvdb.cli.main import cli; cli()"]
    r = subprocess.run([*kvdb_cli, "replicate", "status", "--peer", a.address, "--secret-file",
                        str(secret_file), "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["counters"]["blocks_received"] == 4 and st["db"]["tiers"]["host"]["pages"] == 4
    bad = tmp_path / "wrong.secret"
    bad.write_bytes(b"w" * 32)
    r = subprocess.run([*kvdb_cli, "replicate", "status", "--peer", a.address, "--secret-file", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "different shared secrets" in r.stderr
    with pytest.raises(AuthError):
        Peer(b.address, secret=b"w" * 32)


def _caught_up(leader_addr: str, min_lsn: int) -> dict:
    """Poll the leader's status until its one follower confirmed >= min_lsn with no lag."""
    deadline = time.monotonic() + 30
    with Peer(leader_addr, secret=SECRET, transport="tcp") as p:
        while True:
            (f,) = p.status()["followers"]
            if (f["confirmed_lsn"] >= min_lsn and f["lag_records"] == 0) or time.monotonic() > deadline:
                return f
            time.sleep(0.05)


def test_daemon_leader_ships_pushes_and_survives_a_kill(netns, tmp_path, secret_file, nodes):
    # Scenario: prefill -> push -> decode node A, which ships its log to B (`serve --replica`).
    # A's status lists B with its confirmed lsn and lag; once the lag is 0, B holds the blocks.
    # A is SIGKILLed and restarted: it recovers its log, B resumes from its own position, and a
    # second push reaches B too, with no record applied twice.
    b = nodes(tmp_path / "b", secret_file)
    a = nodes(tmp_path / "a", secret_file, replicas=[b.address])
    b1, k1 = make_blocks(5, seed=12), make_keys(5, tag=12)
    b2, k2 = make_blocks(3, seed=13), make_keys(3, tag=13)
    with Peer(a.address, secret=SECRET) as pa:
        pa.push(k1, b1, durability="sync")
    f = _caught_up(a.address, 5)
    assert (f["addr"], f["state"], f["lag_records"]) == (b.address, "streaming", 0)
    hits, got = _fetch(b.address, k1)
    assert hits == 5 and torch.equal(got, b1)
    lsn1 = f["confirmed_lsn"]

    a.kill()
    a.start()
    with Peer(a.address, secret=SECRET) as pa:
        pa.push(k2, b2, durability="sync")
    f = _caught_up(a.address, lsn1 + 3)
    assert f["lag_records"] == 0 and f["confirmed_lsn"] >= lsn1 + 3
    hits, got = _fetch(b.address, k1 + k2)
    assert hits == 8 and torch.equal(got, torch.cat([b1, b2]))
    with Peer(b.address, secret=SECRET) as pb:
        st = pb.status()["follower"]
    assert st["applied_lsn"] == f["confirmed_lsn"] and st["duplicates"] == 0


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_bench_replication_reports_every_figure(kind):
    # A smoke run of `kvdb bench replication` (2 blocks, 1 round): every figure is present and
    # positive; no timing is asserted. The benchmark makes its own network namespace.
    from kvdb.bench.replication import bench_replication

    out = bench_replication(num_blocks=2, repeats=1, transport=kind)
    figures = ["push_gbps", "push_tcp_inline_gbps", "push_sync_gbps", "ship_gbps"]
    if kind == "mooncake":
        figures += ["te_batch_write_gbps", "push_vs_te", "ship_vs_te"]
        assert len(out["push_vs_te_per_round"]) == 1 and isinstance(out["push_goal_met"], bool)
    assert (out["transport"], out["blocks"], out["block_bytes"]) == (kind, 2, 2 << 20)
    assert all(out[f] > 0 for f in figures)
