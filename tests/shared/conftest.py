"""What the shared-tier tests share: the engine layout, blocks, a child engine. The pool itself
(a real ``mooncake_master`` and storage processes in a private network namespace) and its
fixtures ``shared_netns``, ``pool_factory`` and ``pool`` are in tests/mooncake_pool.py and
tests/conftest.py, shared with the vLLM tests (tests/integrations/test_vllm_shared.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvdb import BlockLayout

HERE = Path(__file__).resolve().parent
# 4 layers x 2 x 16 tokens x 8 heads x 128 dims x 2 bytes = 256 KiB pages (an engine's size)
LAYOUT = BlockLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)


def make_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.block_shape), generator=g).to(LAYOUT.dtype)


def run_engine(*args: str, timeout_s: float = 60.0) -> dict:
    """Run tests/shared/engine.py in a child process (same namespace); its JSON answer."""
    from mooncake_pool import die_with_parent  # not at the top: engine.py imports this module by itself

    r = subprocess.run([sys.executable, str(HERE / "engine.py"), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout_s, preexec_fn=die_with_parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
