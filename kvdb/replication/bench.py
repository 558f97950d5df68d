"""``kvdb bench replication``: push and log shipping of 2 MiB blocks over loopback, next to the
Transfer Engine's own batch write measured in the same run, to the same peer process.

Set-up: a ``kvdb replicate serve`` peer process (memory host tier + disk tier in a temporary
directory) and this process, both inside a private network namespace (netns.py) because the
engine listens on 0.0.0.0. Figures (GB/s = 1e9 bytes/s, median of ``repeats`` rounds):

    te_batch_write_gbps   one batch_transfer_sync_write of all blocks into the peer's landing
                          region: the engine alone, no CRC, no control message, no store
    push_gbps             Peer.push(durability="none"): TE write + CRC-32C both sides + HMAC'd
                          control messages + put_blocks into the peer's host tier
    push_sync_gbps        the same with durability="sync" (the peer fsyncs its log before acking)
    push_tcp_inline_gbps  Peer.push over the inline-TCP fallback (no engine), durability="none"
    ship_gbps             log shipping of a leader log holding the blocks, until the follower
                          confirmed them durable (reads segments, TE write, apply, fsync)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvdb.buffer_pool.layout import BlockLayout
from kvdb.errors import ReplicationError
from kvdb.replication.netns import netns_unavailable, private_netns
from kvdb.replication.transport import transport_kind

# Llama-3-8B-like: 32 layers x 2 x 16 tokens x 8 kv heads x 128 dims x bf16 = 2 MiB
BENCH_LAYOUT = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)
_SECRET = os.urandom(32).hex().encode()


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _spawn_peer(tmp: str, secret_file: str, num_blocks: int, repeats: int, transport: str) -> tuple[subprocess.Popen, str]:
    page = BENCH_LAYOUT.page_bytes
    cmd = [sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "replicate", "serve",
           "--db", os.path.join(tmp, "peer"), "--listen", "127.0.0.1:0", "--secret-file", secret_file,
           "--transport", transport, "--json", "--layout", json.dumps(BENCH_LAYOUT.to_dict()),
           "--model-id", "bench", "--host-bytes", str((num_blocks * (repeats + 2) + 8) * page)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line:
        raise ReplicationError(f"the benchmark peer exited with {proc.wait()} before listening")
    return proc, json.loads(line)["address"]


def bench_replication(num_blocks: int = 64, repeats: int = 3, transport: str = "auto") -> dict:
    kind = transport_kind(transport)
    why = netns_unavailable()
    if why is not None and kind == "mooncake":
        raise ReplicationError(f"the Transfer Engine listens on 0.0.0.0; this benchmark runs it only inside a "
                               f"private network namespace, which is unavailable here ({why}); "
                               "use --transport tcp")
    if why is not None:
        return _run(num_blocks, repeats, kind)
    with private_netns():
        return _run(num_blocks, repeats, kind)


def _run(num_blocks: int, repeats: int, kind: str) -> dict:
    import kvdb
    from kvdb.replication.peer import Peer
    from kvdb.replication.replicator import Replicator

    page = BENCH_LAYOUT.page_bytes
    nbytes = num_blocks * page
    blocks = torch.randint(-(2 ** 15), 2 ** 15, (num_blocks, *BENCH_LAYOUT.block_shape), dtype=torch.int16)
    blocks = blocks.view(BENCH_LAYOUT.dtype)
    rows = blocks.view(torch.uint8).reshape(num_blocks, page)
    out: dict = {"block_bytes": page, "blocks": num_blocks, "repeats": repeats, "transport": kind,
                 "unit": "GB/s (1e9 bytes/s), median of repeats"}
    with tempfile.TemporaryDirectory(prefix="kvdb-bench-repl-") as tmp:
        secret_file = os.path.join(tmp, "secret")
        with open(secret_file, "wb") as f:
            f.write(_SECRET)
        proc, addr = _spawn_peer(tmp, secret_file, num_blocks, repeats, kind)
        try:
            key_no = [0]

            def fresh_keys() -> list[bytes]:
                key_no[0] += 1
                return [key_no[0].to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(num_blocks)]

            with Peer(addr, secret=_SECRET, transport=kind, chunk_bytes=16 * page) as p:
                if p.uses_engine:
                    region = p._landing_region(nbytes)
                    p.transport.register(rows)
                    srcs = [(r.data_ptr(), page) for r in rows]
                    dsts = [int(region["addr"]) + i * page for i in range(num_blocks)]
                    p.transport.write(region["transport"], srcs, dsts)  # warm-up: connection set-up
                    t = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        p.transport.write(region["transport"], srcs, dsts)
                        t.append(time.perf_counter() - t0)
                    out["te_batch_write_gbps"] = _gbps(nbytes, t)
                for name, durability, tp in (("push_gbps", "none", kind), ("push_sync_gbps", "sync", kind),
                                             ("push_tcp_inline_gbps", "none", "tcp")):
                    if tp == "mooncake" and not p.uses_engine:
                        continue
                    with Peer(addr, secret=_SECRET, transport=tp, chunk_bytes=16 * page) as q:
                        q.push(fresh_keys()[:2], blocks[:2], durability=durability)  # warm-up
                        t = []
                        for _ in range(repeats):
                            keys = fresh_keys()
                            t0 = time.perf_counter()
                            q.push(keys, blocks, durability=durability)
                            t.append(time.perf_counter() - t0)
                    out[name] = _gbps(nbytes, t)

            # log shipping: each round appends the blocks to the leader's log with no shipper
            # running, then starts one and times until the follower confirmed them durable
            t = []
            path = os.path.join(tmp, "leader")
            with kvdb.open(path, layout=BENCH_LAYOUT, model_id="bench", host_bytes=(num_blocks + 2) * page) as db:
                for _ in range(repeats):
                    db.put_blocks(fresh_keys(), blocks, durability="group")
                    t0 = time.perf_counter()
                    rep = Replicator(db, replicas=[addr], secret=_SECRET, transport=kind)
                    try:
                        rep.sync_replicas(300)
                        t.append(time.perf_counter() - t0)
                    finally:
                        rep.close()
            out["ship_gbps"] = _gbps(nbytes, t)
        finally:
            proc.terminate()
            proc.wait(30)
    if "te_batch_write_gbps" in out:
        te = out["te_batch_write_gbps"]
        out["push_vs_te"] = round(out["push_gbps"] / te, 3)
        out["ship_vs_te"] = round(out["ship_gbps"] / te, 3)
        out["push_goal_met"] = out["push_vs_te"] >= 0.8
    return out
