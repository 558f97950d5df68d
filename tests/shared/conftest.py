"""Fixtures for the shared-tier tests: a real Mooncake Store (``mooncake_master`` and storage
processes, kvdb/shared/localpool.py) in a private network namespace, stopped by pid.

The Store's listeners bind 0.0.0.0, so every pool runs inside a fresh network namespace with
only loopback up (kvdb/netns.py), entered by the test's thread: the master, the
storage processes, child engines and the in-process client share it. Without the Mooncake
wheel (or without namespaces) the tests skip saying why, except under KVDB_REQUIRE_VLLM=1 (CI),
where they fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdb import BlockLayout
from kvdb.shared.localpool import LocalPool as Pool, die_with_parent  # noqa: F401

HERE = Path(__file__).resolve().parent
# 4 layers x 2 x 16 tokens x 8 heads x 128 dims x 2 bytes = 256 KiB pages (an engine's size)
LAYOUT = BlockLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)

# the pool fixtures (shared_netns, pool_factory, pool) are tests/conftest.py's
from helpers import need_pool  # noqa: E402,F401


def make_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.block_shape), generator=g).to(LAYOUT.dtype)


def run_engine(*args: str, timeout_s: float = 60.0) -> dict:
    """Run tests/shared/engine.py in a child process (same namespace); its JSON answer."""
    r = subprocess.run([sys.executable, str(HERE / "engine.py"), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout_s, preexec_fn=die_with_parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
