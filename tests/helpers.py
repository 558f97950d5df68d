"""Set-up shared by the tests (tests/cold/ also has cold_fixtures.py): the small layout most Db
tests use, block factories, an injected clock, a Db sized in pages, tiers by name, one agent's
LLM call, the online policies, the hits of a replay, and the scripts of tools/ as modules.

Imported by name (``from helpers import LAYOUT, open_db``): tests/ holds the root conftest.py,
so pytest puts it on sys.path for every test, packages (replication/, integrations/) included.
"""

from __future__ import annotations

import contextlib

import torch

import kvdb
from kvdb import BlockLayout
from kvdb.planner.policies import POLICIES, REPLAY_ONLY
from kvdb.sim.replay import replay

#: 2 layers x (k, v) x 4 tokens x 2 heads x 4 dims x 4 bytes (fp32) = 512-byte pages
LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.float32)
PAGE = LAYOUT.page_bytes

#: 1 layer x (k, v) x 4 tokens x 1 head x 4 dims x 4 bytes = 128-byte pages: Dbs opened by the hundred
SMALL = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4, dtype=torch.float32)

#: the policies a live Db can run (the others need the whole trace: replay only)
ONLINE = sorted(set(POLICIES) - REPLAY_ONLY)

TIER_NAMES = {0: "device", 1: "host"}


class Clock:
    """An injected clock (``kvdb.open(clock=...)``, the mover): it reads ``t``, which the test
    moves by hand. Starts at 1000 s unless told, so that no event happens at time 0."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def blocks_for(n: int, seed: int = 0, layout: BlockLayout = LAYOUT) -> torch.Tensor:
    """``n`` blocks of random values (the same for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.block_shape), generator=g)


def open_db(path, clock=None, *, host_pages: int = 8, device_pages: int = 0, layout: BlockLayout = LAYOUT,
            model_id: str = "test-model", disk_bytes: int | None = 0, **kw) -> kvdb.Db:
    """``kvdb.open`` with tiers sized in pages of ``layout``; no disk tier unless ``disk_bytes``
    says so (None: unbounded); without CUDA the device tier is in CPU memory (``device="cpu"``).
    Other keywords go to ``kvdb.open``."""
    if clock is not None:
        kw["clock"] = clock
    if device_pages and not torch.cuda.is_available():  # without CUDA, ask for it in CPU memory
        kw.setdefault("device", "cpu")
    return kvdb.open(path, layout=layout, model_id=model_id, host_bytes=host_pages * layout.page_bytes,
                     device_bytes=device_pages * layout.page_bytes, disk_bytes=disk_bytes, **kw)


def tiers(db, keys) -> list[str | None]:
    """Where each key is resident: "device", "host" or None (on disk or nowhere)."""
    return [TIER_NAMES.get(db.pool.tier_of(k)) for k in keys]


def agent_call(db, sid, agent, keys, blocks, wait_s=None, **hints):
    """One LLM call: lookup, store what is new, finish (with the tool wait that follows)."""
    ctx, _ = db.call_started(sid, agent_id=agent, hints=hints or None)
    n = db.match_prefix(keys, ctx=ctx)
    if n < len(keys):
        db.put_blocks(keys[n:], blocks[n:], positions=list(range(n, len(keys))), ctx=ctx)
    return db.call_finished(sid, agent_id=agent,
                            hints=None if wait_s is None else {"expected_tool_duration_s": wait_s})


def replay_hits(trace, policy: str, capacity: int) -> list[int]:
    """The hits of each request when ``policy`` replays a parsed trace with room for ``capacity`` blocks."""
    out: list[dict] = []
    replay(trace, policy, capacity, per_request=out.append)
    return [r["hits"] for r in out]


def tree_hashes(path) -> dict[str, str]:
    """sha256 of every file under ``path``, by relative path (a read-only tool must leave it equal)."""
    import hashlib
    import os

    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def run_cli(*args):
    """``kvdb ARGS`` in process (click's runner); arguments may be paths or numbers."""
    from click.testing import CliRunner

    from kvdb.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


_HOLDER = """
import sys
sys.path.insert(0, sys.argv[2])
from helpers import LAYOUT, blocks_for, open_db
db = open_db(sys.argv[1], disk_bytes=None, host_pages=2)
keys = db.block_keys(list(range(6 * LAYOUT.block_tokens)))
db.put_blocks(keys, blocks_for(6), durability="group")
print(" ".join(bytes(k).hex() for k in keys), flush=True)
sys.stdin.readline()  # hold the Db open until told
db.close()
"""


@contextlib.contextmanager
def held_by_another_process(path):
    """A writer in another process holds the Db at ``path`` (6 blocks of ``blocks_for(6)``,
    durable in the log, 2 host pages) while the body runs; yields their keys in hex."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), str(Path(__file__).parent)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc.stdout.readline().split()
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0


def load_tool(name: str):
    """A script of tools/ (``name`` without .py) imported as a module, for tests that drive it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def need_pool() -> None:
    """Skip saying why no private Mooncake pool can run here (kvdb/shared/localpool.py); under
    KVDB_REQUIRE_VLLM=1 (CI), fail instead."""
    import os

    import pytest

    from kvdb.shared.localpool import pool_unavailable

    why = pool_unavailable()
    if why is not None:
        if os.environ.get("KVDB_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVDB_REQUIRE_VLLM=1 but {why}")
        pytest.skip(why)
