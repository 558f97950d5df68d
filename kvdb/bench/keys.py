"""``kvdb bench keys``: block keys for a long prompt against plain ``hashlib.sha256``.

Baseline (docs/benchmarks.md): one ``hashlib.sha256`` digest per block over the very same
token bytes (uint32 LE, ``block_tokens`` per block), looped in Python over zero-copy
memoryview slices -- the cheapest way Python itself hashes those bytes. It does no chaining,
no namespace and no truncation, so it is a floor on the work, not a rival key scheme.

Measured: ``KeySpace.block_keys_bytes`` (SHA-256 chain in one native call, the allocation-free
form the Db uses), ``KeySpace.block_keys`` (the same plus a list of 16-byte keys), the xxh3-128
opt-in, and ``block_keys_bytes`` from a Python list of ints (what a tokenizer returns; includes
the conversion to uint32). All start from the same prompt; every figure is the best of
``repeats`` runs (a property of the code path, not of the noisiest moment on a shared machine).
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import torch

from kvdb.format.layout import BlockLayout
from kvdb.errors import InvalidInput
from kvdb.keys import KeySpace

_BENCH_SECRET = b"kvdb-bench-keys-secret-not-used-for-data"


def _best_s(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, (time.perf_counter_ns() - t0) / 1e9)
    return max(best, 1e-9)


def _hashlib_blocks(raw: memoryview, n_blocks: int, step: int) -> list[bytes]:
    sha256 = hashlib.sha256
    return [sha256(raw[i * step : (i + 1) * step]).digest() for i in range(n_blocks)]


def bench_keys(prompt_tokens: int = 131072, block_tokens: int = 16, repeats: int = 7, seed: int = 0) -> dict:
    """Keys per second for one ``prompt_tokens`` prompt at ``block_tokens``, with the baseline."""
    for name, v in (("prompt_tokens", prompt_tokens), ("block_tokens", block_tokens), ("repeats", repeats)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise InvalidInput(f"{name} must be a positive int, got {v!r}")
    if prompt_tokens < block_tokens:
        raise InvalidInput(f"prompt_tokens ({prompt_tokens}) must hold at least one block of {block_tokens}")
    layout = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=block_tokens, dtype=torch.bfloat16)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128_256, size=prompt_tokens, dtype=np.uint32)  # Llama-3 vocabulary
    token_list = tokens.tolist()
    n_blocks = prompt_tokens // block_tokens
    raw = memoryview(tokens.tobytes())
    step = block_tokens * 4

    sha = KeySpace(model_id="bench", layout=layout, key_secret=_BENCH_SECRET)
    xxh = KeySpace(model_id="bench", layout=layout, key_secret=_BENCH_SECRET, algo="xxh3_128")
    for ks in (sha, xxh):
        ks.namespace("bench")  # tenant namespaces are computed once per KeySpace, then cached

    hashlib_s = _best_s(lambda: _hashlib_blocks(raw, n_blocks, step), repeats)
    keys_s = _best_s(lambda: sha.block_keys_bytes(tokens, tenant="bench"), repeats)
    keys_list_s = _best_s(lambda: sha.block_keys(tokens, tenant="bench"), repeats)
    from_ints_s = _best_s(lambda: sha.block_keys_bytes(token_list, tenant="bench"), repeats)
    xxh_s = _best_s(lambda: xxh.block_keys_bytes(tokens, tenant="bench"), repeats)

    hashlib_bps = n_blocks / hashlib_s
    keys_bps = n_blocks / keys_s
    return {
        "prompt_tokens": prompt_tokens,
        "block_tokens": block_tokens,
        "blocks": n_blocks,
        "repeats": repeats,
        "hashlib_blocks_per_s": round(hashlib_bps),
        "keys_blocks_per_s": round(keys_bps),
        "ratio": round(keys_bps / hashlib_bps, 3),
        "xxh3_keys_blocks_per_s": round(n_blocks / xxh_s),
        "keys_list_blocks_per_s": round(n_blocks / keys_list_s),
        "keys_from_int_list_blocks_per_s": round(n_blocks / from_ints_s),
        "prompt_keys_ms": round(keys_s * 1e3, 3),
    }
