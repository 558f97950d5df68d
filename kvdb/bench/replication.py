"""``kvdb bench replication``: push and log shipping of 2 MiB blocks over loopback, next to the
Transfer Engine's own batch write measured in the same run, to the same peer process.

Set-up: two ``kvdb replicate serve`` peer processes (one memory-only, one with a disk tier, in a
temporary directory) and this process, all inside a private network namespace
(kvdb/netns.py)
because the engine listens on 0.0.0.0. Like any cluster, every node is given the same key secret
file (docs/replication.md, "One key namespace per cluster"): the disk peer refuses the log of a
leader of another key secret. Figures (GB/s = 1e9 bytes/s, median of ``repeats``
rounds after two warm-up rounds; the engine and push rounds are interleaved so that load from
other processes hits both alike):

    te_batch_write_gbps   batch_transfer_sync_write of all blocks into a landing region of the
                          memory-only peer: the engine alone, no hashing, no control message, no store
    push_gbps             Peer.push(durability="none") to the same peer: TE writes + XXH3-128 on
                          both sides + HMAC'd control messages + put_blocks into its host tier
    push_tcp_inline_gbps  Peer.push over the inline-TCP fallback (no engine), durability="none"
    push_sync_gbps        Peer.push(durability="sync") to the disk peer (it fsyncs before acking)
    ship_gbps             log shipping: a leader Db's log holding the blocks, from starting the
                          stream until the disk peer confirmed them durable
    ship_lag_ms           commit-to-confirm lag of log shipping: single-block ``group`` puts
                          5-40 ms apart (seeded), from put_blocks returning until the disk peer
                          confirmed that record; median and p90 over ``repeats`` x 10 commits
    ship_lag_fixed_poll_ms  the same with the streams' earlier fixed 50 ms poll (the baseline;
                          rounds of the two interleaved)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kvdb
from kvdb.errors import ReplicationError
from kvdb.format.layout import BlockLayout
from kvdb.netns import die_with_parent, netns_unavailable, private_netns
from kvdb.replication.peer import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW, Peer
from kvdb.replication.replicator import Replicator
from kvdb.replication.transport import transport_kind

# Llama-3-8B-like: 32 layers x 2 x 16 tokens x 8 kv heads x 128 dims x bf16 = 2 MiB
BENCH_LAYOUT = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)
_SECRET = os.urandom(32).hex().encode()
_KEY_SECRET = os.urandom(32)  # the cluster's key secret: the leader's kvdb.open(key_secret=), the peers' file


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _spawn_peer(tmp: str, name: str, secret_file: str, host_pages: int, disk: bool,
                transport: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "replicate", "serve",
           "--db", os.path.join(tmp, name), "--listen", "127.0.0.1:0", "--secret-file", secret_file,
           "--key-secret-file", os.path.join(tmp, "keysecret"),
           "--transport", transport, "--json", "--layout", json.dumps(BENCH_LAYOUT.to_dict()),
           "--model-id", "bench", "--host-bytes", str(host_pages * BENCH_LAYOUT.page_bytes)]
    if not disk:
        cmd += ["--disk-bytes", "0"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=die_with_parent)


def _address(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        raise ReplicationError(f"a benchmark peer exited with {proc.wait()} before listening")
    return json.loads(line)["address"]


def bench_replication(num_blocks: int = 64, repeats: int = 3, transport: str = "auto",
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, window: int = DEFAULT_WINDOW) -> dict:
    kind = transport_kind(transport)
    why = netns_unavailable()
    if why is not None and kind == "mooncake":
        raise ReplicationError(f"the Transfer Engine listens on 0.0.0.0; this benchmark runs it only inside a "
                               f"private network namespace, which is unavailable here ({why}); "
                               "use --transport tcp")
    if why is not None:
        return _run(num_blocks, repeats, kind, chunk_bytes, window)
    with private_netns():
        return _run(num_blocks, repeats, kind, chunk_bytes, window)


def _ship_lags(db, follower: str, kind: str, block, fresh_keys, repeats: int) -> dict:
    """Commit-to-confirm lags (ms) of single-block group puts: streams woken by the store's
    durability listener vs a fixed 50 ms poll."""
    rng = random.Random(7)
    lags: dict[str, list[float]] = {"ship_lag_ms": [], "ship_lag_fixed_poll_ms": []}
    for _ in range(repeats):
        for name, got in lags.items():
            rep = Replicator(db, replicas=[follower], secret=_SECRET, transport=kind)
            try:
                if name == "ship_lag_fixed_poll_ms":
                    rep.shipper.poll_only(0.05)
                rep.sync_replicas(300)
                for _ in range(10):
                    time.sleep(rng.uniform(0.005, 0.04))
                    db.put_blocks(fresh_keys()[:1], block, durability="group")
                    t0 = time.perf_counter()
                    rep.shipper.sync(60)  # waits for the follower's ack; does not wake the stream
                    got.append((time.perf_counter() - t0) * 1e3)
            finally:
                rep.close()
    return lags


def _run(num_blocks: int, repeats: int, kind: str, chunk_bytes: int, window: int) -> dict:
    page = BENCH_LAYOUT.page_bytes
    nbytes = num_blocks * page
    blocks = torch.randint(-(2 ** 15), 2 ** 15, (num_blocks, *BENCH_LAYOUT.block_shape), dtype=torch.int16)
    blocks = blocks.view(BENCH_LAYOUT.dtype)
    rows = blocks.view(torch.uint8).reshape(num_blocks, page)
    out: dict = {"block_bytes": page, "blocks": num_blocks, "repeats": repeats, "transport": kind,
                 "chunk_bytes": chunk_bytes, "window": window,
                 "unit": "GB/s (1e9 bytes/s), median of repeats"}
    with tempfile.TemporaryDirectory(prefix="kvdb-bench-repl-") as tmp:
        secret_file = os.path.join(tmp, "secret")
        with open(secret_file, "wb") as f:
            f.write(_SECRET)
        with open(os.path.join(tmp, "keysecret"), "wb") as f:
            f.write(_KEY_SECRET)
        # two peers: a memory-only one for the engine and the plain pushes, one with a disk
        # tier for durable pushes and shipping; host tiers of 2n pages so that, after the
        # warm-up, every round reuses arena frames that are already faulted in
        procs = [_spawn_peer(tmp, "mem", secret_file, 2 * num_blocks, False, kind),
                 _spawn_peer(tmp, "disk", secret_file, 2 * num_blocks, True, kind)]
        try:
            mem_addr, disk_addr = (_address(p) for p in procs)
            key_no = [0]

            def fresh_keys() -> list[bytes]:
                key_no[0] += 1
                return [key_no[0].to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(num_blocks)]

            def timed_push(q: Peer, durability: str) -> float:
                keys = fresh_keys()
                t0 = time.perf_counter()
                q.push(keys, blocks, durability=durability)
                return time.perf_counter() - t0

            chunk = chunk_bytes
            with Peer(mem_addr, secret=_SECRET, transport=kind, chunk_bytes=chunk, window=window) as p, \
                    Peer(mem_addr, secret=_SECRET, transport=kind, chunk_bytes=chunk, window=window) as q:
                for _ in range(2):  # warm-up: connections, landing regions, arena frames
                    q.push(fresh_keys(), blocks, durability="none")
                te, push = [], []
                if p.uses_engine:
                    region = p.landing_region(nbytes)
                    p.transport.register(rows)
                    srcs = [(r.data_ptr(), page) for r in rows]
                    dsts = [int(region["addr"]) + i * page for i in range(num_blocks)]
                    p.transport.write(region["transport"], srcs, dsts)
                for _ in range(repeats):  # interleaved, so load changes hit both figures alike
                    if p.uses_engine:
                        t0 = time.perf_counter()
                        p.transport.write(region["transport"], srcs, dsts)
                        te.append(time.perf_counter() - t0)
                    push.append(timed_push(q, "none"))
                if te:
                    out["te_batch_write_gbps"] = _gbps(nbytes, te)
                    out["push_vs_te_per_round"] = [round(a / b, 3) for a, b in zip(te, push)]
                out["push_gbps"] = _gbps(nbytes, push)
            with Peer(mem_addr, secret=_SECRET, transport="tcp", chunk_bytes=chunk, window=window) as q:
                q.push(fresh_keys(), blocks, durability="none")
                out["push_tcp_inline_gbps"] = _gbps(nbytes, [timed_push(q, "none") for _ in range(repeats)])
            with Peer(disk_addr, secret=_SECRET, transport=kind, chunk_bytes=chunk, window=window) as q:
                for _ in range(2):
                    q.push(fresh_keys(), blocks, durability="sync")
                out["push_sync_gbps"] = _gbps(nbytes, [timed_push(q, "sync") for _ in range(repeats)])

            # log shipping: each round appends the blocks to the leader's log with no shipper
            # running, then starts one and times until the follower confirmed them durable
            t = []
            path = os.path.join(tmp, "leader")
            with kvdb.open(path, layout=BENCH_LAYOUT, model_id="bench", host_bytes=(num_blocks + 2) * page,
                           key_secret=_KEY_SECRET) as db:
                for _ in range(repeats):
                    db.put_blocks(fresh_keys(), blocks, durability="group")
                    t0 = time.perf_counter()
                    rep = Replicator(db, replicas=[disk_addr], secret=_SECRET, transport=kind)
                    try:
                        rep.sync_replicas(300)
                        t.append(time.perf_counter() - t0)
                    finally:
                        rep.close()
                out["ship_gbps"] = _gbps(nbytes, t)
                lags = _ship_lags(db, disk_addr, kind, blocks[:1], fresh_keys, repeats)
            for name, ms in lags.items():
                out[name] = {"p50": round(statistics.median(ms), 2),
                             "p90": round(statistics.quantiles(ms, n=10)[-1], 2), "commits": len(ms)}
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(60)
    if "te_batch_write_gbps" in out:
        te = out["te_batch_write_gbps"]
        out["push_vs_te"] = round(out["push_gbps"] / te, 3)
        out["ship_vs_te"] = round(out["ship_gbps"] / te, 3)
        out["push_goal_met"] = out["push_vs_te"] >= 0.8  # goal: push >= 0.8 x the engine's own write
    return out
