"""``kvdb bench ttft``: time to first token with and without kvdb on a real (random-weight) model.

One prompt of ``prompt_tokens`` (default 8192) tokens whose first ``stored_fraction`` (7/8) is
stored as KV blocks. Measured in the same process, best of ``repeats`` each (a path's cost, not
the noisiest moment of a shared 2-core machine):

    full_prefill_s     forward over the whole prompt, no cache (the baseline)
    suffix_prefill_s   forward over the unstored eighth on a cache already in memory: the
                       floor any cache can reach, so ideal_speedup = full / suffix
    restore_host_s     PrefixCache.lookup with the blocks in kvdb's host tier: key hashing,
                       index match, batched read, the permute into a transformers cache
    restore_disk_s     the same lookup from the disk tier (a freshly reopened Db, host tier
                       empty; the OS page cache is not dropped, so this is a warm disk)
    host_ttft_s        lookup + suffix prefill, timed together; host_speedup = full / host_ttft
    disk_ttft_s        the same from disk; disk_speedup = full / disk_ttft

Goal (issue 5): host_speedup >= 0.9 * ideal_speedup (``goal_met``); the same ratio from the
parts, suffix / (suffix + restore_host), is ``host_fraction_of_ideal_by_parts``. Every prefill keeps only the last
position's logits (all an engine needs for the first token), the same for every variant.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

import kvdb
from kvdb.demo.model import prefill, prompt_tokens, tiny_llama
from kvdb.errors import InvalidInput

MODEL_ID = "kvdb-demo-tiny-llama"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _disk_available() -> bool:
    try:
        import kvdb.cold.store  # noqa: F401
    except ImportError:
        return False
    return True


def bench_ttft(*args, **kwargs) -> dict:
    """See the module doc. Runs under no_grad (not inference_mode: the Db's arenas are created in
    here, and inference tensors refuse in-place updates from the Db's background thread)."""
    with torch.no_grad():
        return _bench_ttft(*args, **kwargs)


def _bench_ttft(
    prompt_tokens_n: int = 8192,
    stored_fraction: float = 7 / 8,
    block_tokens: int = 16,
    repeats: int = 5,
    data_dir: str | Path | None = None,
    progress=lambda n=1: None,
) -> dict:
    from kvdb.integrations.transformers import PrefixCache, blocks_from_cache, cache_from_blocks, layout_for

    if not 0 < stored_fraction < 1:
        raise InvalidInput(f"stored_fraction must be in (0, 1), got {stored_fraction}")
    if prompt_tokens_n < 2 * block_tokens:
        raise InvalidInput(f"prompt_tokens must be at least {2 * block_tokens}")
    model = tiny_llama(max_tokens=prompt_tokens_n)
    layout = layout_for(model.config, block_tokens=block_tokens)
    ids = prompt_tokens(prompt_tokens_n, seed=42)
    n_blocks = int(prompt_tokens_n * stored_fraction) // block_tokens
    n_stored = n_blocks * block_tokens
    suffix = ids[:, n_stored:]
    prefill(model, ids[:, :256])  # warm-up: first-call allocations, thread pools
    full_cache = prefill(model, ids).past_key_values
    blocks = blocks_from_cache(full_cache, 0, n_blocks, block_tokens, torch.empty((n_blocks, *layout.block_shape)))
    del full_cache

    res: dict = {
        "model": f"random-weight Llama, {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
        f"{model.config.num_key_value_heads} kv heads, fp32, CPU",
        "prompt_tokens": prompt_tokens_n,
        "stored_tokens": n_stored,
        "block_tokens": block_tokens,
        "page_bytes": layout.page_bytes,
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
    }

    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvdb-bench-ttft-")
        data_dir = tmp.name
    try:
        host_bytes = (n_blocks + 8) * layout.page_bytes
        disk = _disk_available()
        disk_dir = Path(data_dir) / "disk"
        if disk:  # the stored part, fsynced to the disk tier only
            with kvdb.open(disk_dir, layout=layout, model_id=MODEL_ID, host_bytes=2 * layout.page_bytes,
                           disk_bytes=None) as ddb:
                keys = ddb.block_keys(ids[0, :n_stored].tolist())
                ddb.put_blocks(keys, blocks, positions=list(range(n_blocks)), tier="disk", durability="sync")
            with _reopen(disk_dir, host_bytes) as ddb:
                _check_lookup(PrefixCache(ddb, model), ids, n_stored)
        with kvdb.open(Path(data_dir) / "host", layout=layout, model_id=MODEL_ID, host_bytes=host_bytes,
                       disk_bytes=0) as db:
            pc = PrefixCache(db, model)
            keys = db.block_keys(ids[0, :n_stored].tolist())
            db.put_blocks(keys, blocks, positions=list(range(n_blocks)))
            _check_lookup(pc, ids, n_stored)
            # every figure is measured once per round, round-robin, so that load from other
            # processes on a shared machine hits baseline and kvdb alike; best of the rounds
            runs: dict[str, list[float]] = {k: [] for k in (
                "full_prefill_s", "suffix_prefill_s", "restore_host_s", "host_ttft_s", "restore_disk_s", "disk_ttft_s")}
            for _ in range(repeats):
                runs["full_prefill_s"].append(_timed(lambda: prefill(model, ids)))
                # the floor: the suffix on a cache already in memory (built untimed each round,
                # since a forward pass extends the cache in place)
                ready = cache_from_blocks(model.config, blocks)
                runs["suffix_prefill_s"].append(_timed(lambda: prefill(model, suffix, ready)))
                del ready
                runs["restore_host_s"].append(_timed(lambda: pc.lookup(ids)))
                runs["host_ttft_s"].append(_timed(lambda: _restore_and_prefill(model, pc, ids)))
                if disk:  # a freshly opened Db each time: empty host tier, blocks only on disk
                    with _reopen(disk_dir, host_bytes) as ddb:
                        dpc = PrefixCache(ddb, model)
                        runs["restore_disk_s"].append(_timed(lambda: dpc.lookup(ids)))
                    with _reopen(disk_dir, host_bytes) as ddb:
                        dpc = PrefixCache(ddb, model)
                        runs["disk_ttft_s"].append(_timed(lambda: _restore_and_prefill(model, dpc, ids)))
                progress()
        res.update({k: (min(v) if v else None) for k, v in runs.items()})
        full_s = res["full_prefill_s"]
        res["ideal_speedup"] = full_s / res["suffix_prefill_s"]
        res["host_speedup"] = full_s / res["host_ttft_s"]
        res["disk_speedup"] = full_s / res["disk_ttft_s"] if disk else None
        if not disk:
            res["disk_note"] = "the disk tier (kvdb.cold) is not available in this build"
    finally:
        if tmp is not None:
            tmp.cleanup()
    res["host_fraction_of_ideal"] = res["host_speedup"] / res["ideal_speedup"]
    # the same ratio from the parts (suffix / (suffix + restore)): far less sensitive to load
    # spikes than a ratio of two end-to-end timings on a shared machine
    res["host_fraction_of_ideal_by_parts"] = res["suffix_prefill_s"] / (res["suffix_prefill_s"] + res["restore_host_s"])
    res["goal_met"] = res["host_fraction_of_ideal"] >= 0.9  # host_speedup >= 0.9 x ideal_speedup
    head = ("full_prefill_s", "suffix_prefill_s", "restore_host_s", "restore_disk_s",
            "ideal_speedup", "host_speedup", "disk_speedup")
    return {**{k: res[k] for k in head}, **{k: v for k, v in res.items() if k not in head}}


def _restore_and_prefill(model, pc, ids):
    cache, n = pc.lookup(ids)
    return prefill(model, ids[:, n:], cache)


def _check_lookup(pc, ids, want: int) -> None:
    n = pc.lookup(ids)[1]
    if n != want:
        raise RuntimeError(f"bench set-up: the lookup restored {n} tokens, expected {want}")


def _reopen(path: Path, host_bytes: int):
    return kvdb.open(path, host_bytes=host_bytes, disk_bytes=None)
