"""``kvdb bench shared``: the shared tier (kvdb/shared/, docs/shared.md) against the Mooncake
Store's own batched calls on the same bytes, in one run (issue 43, item 6).

The run starts its own pool (kvdb/shared/localpool.py: a ``mooncake_master`` and one storage
process on 127.0.0.1, inside a private network namespace; refused where none can be made) and
two Dbs with the shared tier (pure clients, no disk tier: ``flush`` then waits for publication
only, and the disk tier's own speed is ``kvdb bench scale``'s). Pages are 2 MiB. Figures:

* ``put_mbps``        ``put_blocks`` of ``pages`` new blocks + ``flush()`` (which returns once
                      they are published to the pool), on the first Db;
* ``store_put_mbps``  the baseline: one ``batch_put_from`` of the same bytes from a registered
                      buffer (the Store's best case: no copy, no check);
* ``get_mbps``        on the second Db, which never saw the blocks: ``match_prefix`` (the lookup
                      miss fetches them from the pool, checks and lands them in its host tier)
                      + ``get_blocks`` into a preallocated ``out``;
* ``store_get_mbps``  the baseline: one ``batch_get_into`` of the same objects into a
                      registered buffer.

MB/s count the pages' bytes (1 MB = 1e6 bytes). Every round stores new blocks; each round runs
both sides of each figure, the side that goes first alternating, after one untimed warm-up
round (connections, first-touched memory). Figures are medians over ``repeats`` rounds, each
with its runs and their spread (min, max); ``*_vs_store`` is the ratio of the medians (goal
>= 0.8) and ``*_vs_store_runs`` the per-round ratios.

With ``vllm=True`` the same run adds ``res["vllm"]``: time to first token of two real vLLM
engines (CPU build, the tiny random-weight Llama of kvdb/bench/tiny_llama.py, ``LLM.generate``
with ``max_tokens=1`` timed as in kvdb/bench/vllm.py) on a second private pool in the same
namespace, one after the other, each a fresh interpreter (``python -m kvdb.bench.vllm pool_a``,
``pool_b``) with its own data directory, ``kv_role="kv_both"``, ``shared=<pool>``,
``shared_bytes=0`` and one ``key_secret_file`` (docs/vllm.md "Sharing blocks through a pool").
Every round has its own prefix (``stored_tokens``, 7/8 of the prompt in whole 128-token blocks)
and a fresh suffix per request:

* ``recompute_s``        engine A, nothing cached anywhere: vLLM prefills the whole prompt;
* ``vllm_prefix_hit_s``  engine A, the same prefix again with vLLM's own cache still warm;
* ``pool_s``             engine B (started after A flushed its blocks to the pool and exited,
                         an empty directory): the prefix is loaded from the pool;
* ``b_prefix_hit_s``     engine B right after, the same prefix with vLLM's cache warm;
* ``b_recompute_s``      engine B, a prefix no engine saw.

The ``b_`` figures are the same baselines in B's own process (``b_recompute_vs_pool``,
``pool_vs_b_prefix_hit``): on a shared machine an engine's speed swings between processes, and
these tell the pool's cost from that swing.

Goals: ``recompute_vs_pool`` (recompute_s / pool_s) >= 3 and ``pool_vs_prefix_hit``
(pool_s / vllm_prefix_hit_s) <= 1.5; medians over ``repeats`` rounds with runs and spread.
"""

from __future__ import annotations

import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvdb import BlockLayout
from kvdb.format import shared_object as fmt

# 8 layers x 2 x 64 tokens x 8 heads x 128 dims x 2 bytes = 2 MiB pages
PAGE2M = BlockLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_tokens=64, dtype=torch.bfloat16)
GOAL = 0.8
_SECRET = b"kvdb-bench-shared-key-secret-32b"


def _mbps(nbytes: int, runs: list[float]) -> list[float]:
    return [round(nbytes / s / 1e6, 1) for s in runs]


def _figure(res: dict, name: str, nbytes: int, mine: list[float], base: list[float]) -> None:
    m, b = _mbps(nbytes, mine), _mbps(nbytes, base)
    res[f"{name}_mbps"] = round(statistics.median(m), 1)
    res[f"{name}_mbps_runs"] = m
    res[f"{name}_mbps_spread"] = [min(m), max(m)]
    res[f"store_{name}_mbps"] = round(statistics.median(b), 1)
    res[f"store_{name}_mbps_runs"] = b
    res[f"store_{name}_mbps_spread"] = [min(b), max(b)]
    res[f"{name}_vs_store"] = round(res[f"{name}_mbps"] / res[f"store_{name}_mbps"], 3)
    res[f"{name}_vs_store_runs"] = [round(x / y, 3) for x, y in zip(m, b)]
    res[f"{name}_goal"] = GOAL
    res[f"{name}_meets_goal"] = res[f"{name}_vs_store"] >= GOAL


VLLM_GOALS = {"recompute_vs_pool": ">= 3", "pool_vs_prefix_hit": "<= 1.5"}


def bench_shared(*, pages: int = 32, repeats: int = 4, dir_path: str | None = None, progress=None,
                 vllm: bool = False, vllm_prompt_tokens: int = 8192, vllm_repeats: int = 3) -> dict:
    """Every figure (see the module's docstring); ``progress()`` after each round and each vLLM engine."""
    from kvdb.shared.localpool import LocalPool, isolated

    with isolated():
        obj = fmt.object_bytes(PAGE2M.page_bytes, False)
        rounds = repeats + 1
        # every round's objects twice (the Db's and the baseline's), with room to spare
        with LocalPool([int(2 * pages * rounds * obj * 1.25) + (64 << 20)]) as pool:
            res = _run(pool, pages, repeats, dir_path, progress)
        if vllm:  # the engines' processes inherit this thread's namespace
            res["vllm"] = bench_vllm_pool(prompt_tokens=vllm_prompt_tokens, repeats=vllm_repeats,
                                          dir_path=dir_path, progress=progress)
        return res


def _seconds(res: dict, name: str, runs: list[float]) -> None:
    res[f"{name}_s"] = round(statistics.median(runs), 4)
    res[f"{name}_s_runs"] = [round(x, 4) for x in runs]
    res[f"{name}_s_spread"] = [round(min(runs), 4), round(max(runs), 4)]


def bench_vllm_pool(*, prompt_tokens: int, repeats: int, dir_path: str | None = None, progress=None) -> dict:
    """Engine A then engine B on a fresh private pool (call inside ``isolated()``): the ``vllm``
    figures of the module's docstring."""
    from kvdb.bench.tiny_llama import DEFAULT, build_tiny_llama
    from kvdb.bench.vllm import BLOCK_TOKENS, run_phase
    from kvdb.shared.localpool import LocalPool, die_with_parent

    stored = prompt_tokens * 7 // 8 // BLOCK_TOKENS * BLOCK_TOKENS
    # float32 K and V of every layer: what one 128-token block is in the pool
    block = (DEFAULT["num_hidden_layers"] * 2 * BLOCK_TOKENS * DEFAULT["num_key_value_heads"]
             * DEFAULT["hidden_size"] // DEFAULT["num_attention_heads"] * 4)
    # what the engines publish each round: A the first prompt and a suffix, B two suffixes and
    # its recompute's prompt; plus their warm-up prompts (nothing may be evicted before B reads it)
    saved = repeats * (5 * prompt_tokens - 3 * stored) // BLOCK_TOKENS + 16
    root = Path(tempfile.mkdtemp(prefix="kvdb-bench-shared-vllm-", dir=dir_path))
    t0 = time.perf_counter()
    try:
        model = build_tiny_llama(root / "model", max_position_embeddings=max(16384, prompt_tokens + 64))
        key_file = root / "cluster.keysecret"
        key_file.write_bytes(secrets.token_bytes(32))
        with LocalPool([int(saved * fmt.object_bytes(block, False) * 1.5) + (64 << 20)]) as pool:
            got = {}
            for name in ("pool_a", "pool_b"):
                got[name] = run_phase(name, model, root / name, prompt_tokens, stored, repeats, pool.url,
                                       str(key_file), preexec_fn=die_with_parent)
                if progress is not None:
                    progress()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    a, b = got["pool_a"], got["pool_b"]
    rounds = {"recompute": a["recompute"], "vllm_prefix_hit": a["vllm_prefix_hit"], "pool": b["pool"],
              "b_recompute": b["b_recompute"], "b_prefix_hit": b["b_prefix_hit"]}
    cached = {k: [c for _, c in v] for k, v in rounds.items()}
    if any(c < stored for c in cached["pool"]):
        raise RuntimeError(f"engine B got {cached['pool']} of {stored} stored tokens from the pool; "
                           f"A's shared tier: {a['shared']}; B's: {b['shared']}")
    secs = {k: [s for s, _ in v] for k, v in rounds.items()}
    res: dict = {"prompt_tokens": prompt_tokens, "stored_tokens": stored, "repeats": repeats}
    for k, runs in secs.items():
        _seconds(res, k, runs)
    res["recompute_vs_pool"] = round(res["recompute_s"] / res["pool_s"], 3)
    res["recompute_vs_pool_runs"] = [round(x / y, 3) for x, y in zip(secs["recompute"], secs["pool"])]
    res["pool_vs_prefix_hit"] = round(res["pool_s"] / res["vllm_prefix_hit_s"], 3)
    res["pool_vs_prefix_hit_runs"] = [round(x / y, 3) for x, y in zip(secs["pool"], secs["vllm_prefix_hit"])]
    # the same ratios against engine B's own baselines (same process, same rounds)
    res["b_recompute_vs_pool"] = round(res["b_recompute_s"] / res["pool_s"], 3)
    res["pool_vs_b_prefix_hit"] = round(res["pool_s"] / res["b_prefix_hit_s"], 3)
    res["goals"] = dict(VLLM_GOALS)
    res["meets_goals"] = {"recompute_vs_pool": res["recompute_vs_pool"] >= 3,
                          "pool_vs_prefix_hit": res["pool_vs_prefix_hit"] <= 1.5}
    res["cached_tokens"] = cached
    res["published_blocks"] = a["shared"]["puts"]
    res["dropped_puts"] = a["shared"]["dropped_puts"]
    res["pool_hits"] = b["shared"]["hits"]
    res["corruptions"] = b["shared"]["corruptions"]
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def _run(pool, n: int, repeats: int, dir_path, progress) -> dict:
    import kvdb

    lay = PAGE2M
    page = lay.page_bytes
    root = tempfile.mkdtemp(prefix="kvdb-bench-shared-", dir=dir_path)
    staging = f"{max(64, 4 * n * fmt.object_bytes(page, False) >> 20)}MiB"  # two batches each way at least (docs/shared.md)
    url = f"{pool.url}?staging={staging}&deadline_ms=5000"

    def open_db(name: str):
        return kvdb.open(f"{root}/{name}", layout=lay, model_id="bench-shared", key_secret=_SECRET, shared=url,
                         host_bytes=2 * n * page, disk_bytes=0)

    raw = pool.raw_client()
    src = np.empty((n, page), dtype=np.uint8)  # the baseline's registered buffers, touched first
    dst = np.empty((n, page), dtype=np.uint8)
    src.fill(1)
    dst.fill(1)
    assert raw.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert raw.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    out = torch.empty((n, *lay.block_shape), dtype=lay.dtype)
    out.view(torch.uint8).fill_(1)
    put_s, get_s, store_put_s, store_get_s = [], [], [], []
    g = torch.Generator().manual_seed(0)
    try:
        with open_db("put") as a, open_db("get") as b:
            for r in range(repeats + 1):  # round 0: the untimed warm-up
                blocks = torch.randint(-(1 << 15), 1 << 15, (n, *lay.block_shape), dtype=torch.int16,
                                       generator=g).view(lay.dtype)
                tokens = torch.randint(0, 50000, (n * lay.block_tokens,), generator=g).tolist()
                keys = a.block_keys(tokens)
                names = [f"bench/raw/{r}/{i}" for i in range(n)]
                ptrs_src = [src.ctypes.data + i * page for i in range(n)]
                ptrs_dst = [dst.ctypes.data + i * page for i in range(n)]
                sizes = [page] * n
                src[:] = blocks.view(torch.uint8).reshape(n, page).numpy()
                times = {}
                order = ("kvdb", "store") if r % 2 == 0 else ("store", "kvdb")
                for side in order:  # puts
                    t0 = time.perf_counter()
                    if side == "kvdb":
                        a.put_blocks(keys, blocks)
                        a.flush()
                    else:
                        codes = raw.batch_put_from(names, ptrs_src, sizes)
                    times["put_" + side] = time.perf_counter() - t0
                    if side == "store" and any(c != 0 for c in codes):
                        raise RuntimeError(f"batch_put_from: {codes}")
                st = a.stats()["shared"]
                if st["dropped_puts"]:
                    raise RuntimeError(f"the Db dropped {st['dropped_puts']} puts: {st}")
                for side in order:  # gets
                    t0 = time.perf_counter()
                    if side == "kvdb":
                        found = b.match_prefix(keys)
                        b.get_blocks(keys[:found], out)
                    else:
                        codes = raw.batch_get_into(names, ptrs_dst, sizes)
                    times["get_" + side] = time.perf_counter() - t0
                    if side == "store" and any(c != page for c in codes):
                        raise RuntimeError(f"batch_get_into: {codes}")
                if found != n:
                    raise RuntimeError(f"the second Db found {found} of {n} blocks in the pool: {b.stats()['shared']}")
                if not torch.equal(out.view(torch.uint8), blocks.view(torch.uint8)) or not np.array_equal(dst, src):
                    raise RuntimeError("a read returned other bytes than were put")
                if r:
                    put_s.append(times["put_kvdb"])
                    store_put_s.append(times["put_store"])
                    get_s.append(times["get_kvdb"])
                    store_get_s.append(times["get_store"])
                if progress is not None:
                    progress()
            shared_put, shared_get = a.stats()["shared"], b.stats()["shared"]
    finally:
        raw.unregister_buffer(src.ctypes.data)
        raw.unregister_buffer(dst.ctypes.data)
        raw.close()
        shutil.rmtree(root, ignore_errors=True)
    res: dict = {"pages": n, "page_bytes": page, "repeats": repeats}
    _figure(res, "put", n * page, put_s, store_put_s)
    _figure(res, "get", n * page, get_s, store_get_s)
    res["corruptions"] = shared_get["corruptions"]
    res["dropped_puts"] = shared_put["dropped_puts"]
    return res
