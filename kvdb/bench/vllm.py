"""``kvdb bench vllm``: time to first token in a real vLLM (CPU build) with kvdb as its KV connector.

One long prompt (8192 tokens by default) whose first 7/8 were seen before, four ways, all in the
same run on the same tiny random-weight Llama (kvdb/bench/tiny_llama.py):

    recompute_s        nothing cached: vLLM prefills the whole prompt
    vllm_prefix_hit_s  the stored part is in vLLM's own prefix cache (the ideal: no copy at all)
    kvdb_host_s        vLLM's cache reset; kvdb loads the stored part from its DRAM tier
    kvdb_disk_s        a new process (host tier empty, the log's pages dropped from the OS page
                       cache with posix_fadvise): kvdb loads it from the disk tier

Each figure is the median over ``repeats`` rounds; every round uses its own prefix (so nothing
is cached across rounds) and a fresh suffix per measurement. TTFT is the wall time of
``LLM.generate`` with ``max_tokens=1``. Goals: kvdb_host_s <= 1.25 x vllm_prefix_hit_s,
kvdb_disk_s <= 2 x vllm_prefix_hit_s, recompute_s / kvdb_host_s >= 3.

The two phases run in fresh interpreters (``python -m kvdb.bench.vllm PHASE ...``): a vLLM engine
keeps its process, and the disk figure needs a restart anyway. ``kvdb bench shared`` runs two
more phases here, ``pool_a`` and ``pool_b`` (``... PHASE ... OUT URL KEY_FILE``): two engines on
a shared Mooncake pool (kvdb/bench/shared.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvdb.fs import drop_page_cache

BLOCK_TOKENS = 128  # vLLM's CPU default


def _tokens(seed: int, n: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def _llm(model: str, path: str, max_len: int, **extra):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KvdbConnector", kv_connector_module_path="kvdb.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"path": path, "host_bytes": "2GiB", **extra})
    return LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=max_len, enable_prefix_caching=True,
               kv_transfer_config=ktc, distributed_executor_backend="uni", seed=0,
               gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 30)


def _ttft(llm, ids: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0)
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens


def phase(name: str, model: str, path: str, prompt_tokens: int, stored: int, repeats: int, *pool: str) -> dict:
    """One engine's rounds (``host``, ``disk``; ``pool_a``, ``pool_b`` with ``pool`` = URL KEY_FILE:
    kvdb/bench/shared.py's engines A and B on a shared Mooncake pool, pure clients)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    extra = {"shared": pool[0], "shared_bytes": 0, "key_secret_file": pool[1]} if pool else {}
    llm = _llm(model, path, prompt_tokens + 64, **extra)
    _ttft(llm, _tokens(99, 2 * BLOCK_TOKENS + 5))  # warm-up: first-forward costs are not TTFT
    llm.reset_prefix_cache()
    out: dict[str, list] = {}
    for r in range(repeats):
        prefix = _tokens(1000 + r, stored)

        def prompt(k: int) -> list[int]:
            return prefix + _tokens(5000 + 10 * r + k, prompt_tokens - stored)

        if name in ("host", "pool_a"):
            for key, k in (("recompute", 0), ("vllm_prefix_hit", 1)):
                s, cached = _ttft(llm, prompt(k))
                out.setdefault(key, []).append((s, cached))
            llm.reset_prefix_cache()
            if name == "pool_a":
                continue
            s, cached = _ttft(llm, prompt(2))
            out.setdefault("kvdb_host", []).append((s, cached))
            llm.reset_prefix_cache()
        elif name == "pool_b":  # a fresh process and an empty directory: the stored part comes from the pool
            # then, in the same process, its own prefix hit (vLLM's cache warm) and a recompute
            # (a prefix no engine saw): baselines that move with this process's speed
            for key, ids in (("pool", prompt(2)), ("b_prefix_hit", prompt(3)),
                             ("b_recompute", _tokens(3000 + r, prompt_tokens))):
                s, cached = _ttft(llm, ids)
                out.setdefault(key, []).append((s, cached))
            llm.reset_prefix_cache()
        else:
            s, cached = _ttft(llm, prompt(3))
            out.setdefault("kvdb_disk", []).append((s, cached))
            llm.reset_prefix_cache()
    if pool:
        from kvdb.integrations.vllm.service import local_service

        db = local_service(path).db
        db.flush()  # A: every block it saved is in the pool (or dropped, counted) before B starts
        out["shared"] = db.stats()["shared"]
    return out


def _drop_page_cache(path: Path) -> None:
    for f in (path / "wal").rglob("*"):
        if f.is_file():
            drop_page_cache(f)


def run_phase(name: str, model: Path, path: Path, prompt_tokens: int, stored: int, repeats: int, *pool: str,
               **popen) -> dict:
    out = path.parent / f"bench-{name}.json"
    p = subprocess.run([sys.executable, "-m", "kvdb.bench.vllm", name, str(model), str(path), str(prompt_tokens),
                        str(stored), str(repeats), str(out), *pool], capture_output=True, text=True, check=False,
                       **popen)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench vllm phase {name} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def bench_vllm(*, prompt_tokens: int = 8192, stored_fraction: float = 7 / 8, repeats: int = 3,
               data_dir: str | None = None, progress=None) -> dict:
    from kvdb.bench.tiny_llama import build_tiny_llama

    stored = int(prompt_tokens * stored_fraction) // BLOCK_TOKENS * BLOCK_TOKENS
    with tempfile.TemporaryDirectory(prefix="kvdb-bench-vllm-") as tmp:
        root = Path(data_dir) if data_dir else Path(tmp)
        model = build_tiny_llama(root / "model", max_position_embeddings=max(16384, prompt_tokens + 64))
        path = root / "db"
        t0 = time.perf_counter()
        rounds = run_phase("host", model, path, prompt_tokens, stored, repeats)
        if progress:
            progress(1)
        _drop_page_cache(path)
        rounds.update(run_phase("disk", model, path, prompt_tokens, stored, repeats))
        if progress:
            progress(1)
        wall = time.perf_counter() - t0
    med = {k: statistics.median(s for s, _ in v) for k, v in rounds.items()}
    hits = {k: sorted({c for _, c in v}) for k, v in rounds.items()}
    return {
        "prompt_tokens": prompt_tokens, "stored_tokens": stored, "repeats": repeats,
        "recompute_s": med["recompute"], "vllm_prefix_hit_s": med["vllm_prefix_hit"],
        "kvdb_host_s": med["kvdb_host"], "kvdb_disk_s": med["kvdb_disk"],
        "host_vs_prefix_hit": med["kvdb_host"] / med["vllm_prefix_hit"],
        "disk_vs_prefix_hit": med["kvdb_disk"] / med["vllm_prefix_hit"],
        "recompute_vs_host": med["recompute"] / med["kvdb_host"],
        "goals": {"host_vs_prefix_hit": "<= 1.25", "disk_vs_prefix_hit": "<= 2", "recompute_vs_host": ">= 3"},
        "cached_tokens": hits, "rounds_s": {k: [round(s, 4) for s, _ in v] for k, v in rounds.items()},
        "wall_s": wall,
    }


if __name__ == "__main__":
    _name, _model, _path, _n, _stored, _rep, _out = sys.argv[1:8]
    res = phase(_name, _model, _path, int(_n), int(_stored), int(_rep), *sys.argv[8:])
    from kvdb.integrations.vllm.service import local_service

    local_service(_path).worker.close()
    Path(_out).write_text(json.dumps(res))
