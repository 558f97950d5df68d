"""vLLM engines sharing blocks through a Mooncake Store pool: kvdb's ``shared`` tier inside vLLM.

A real ``mooncake_master`` and a storage process (kvdb/shared/localpool.py, in the session's
private network namespace, which the engines' processes inherit) and three real vLLM CPU
engines, one after the other, each with its own data directory, all with one key secret file
(docs/vllm.md "Sharing blocks through a pool"). Engines are pure clients: the storage process
lends the pool its memory, so a block outlives the engine that published it. The tiny Llama's
2048-token prompts are 16 blocks of 128 tokens, of which 15 (1920 tokens) can be loaded.

    producer  kv_producer, one process: P, then P again; it never loads (0 cached both times)
              and its saves are in the pool when its step ends
    both      kv_both, vLLM's default multi-process mode, never saw P: P gets 1920 tokens from
              the pool, same greedy output; P2 is new (saved and published)
    consumer  kv_consumer, one process: P2 (from the kv_both engine) and P (from the producer,
              which had exited) get 1920 tokens each from the pool, same output; P3 is new and
              nothing is saved

Three engine starts, ~1 minute each on two cores.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kvdb.bench.tiny_llama import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
if os.environ.get("KVDB_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

DRIVER = Path(__file__).with_name("vllm_driver.py")
BT, FULL, LOADABLE = 128, 16, 15


@pytest.fixture(scope="module")
def shared_pool(shared_netns):
    from kvdb.shared.localpool import LocalPool as Pool

    p = Pool([128 << 20])
    yield p
    p.stop()


@pytest.fixture(scope="module")
def engines(shared_pool, tmp_path_factory) -> dict:
    from kvdb.shared.localpool import die_with_parent

    root = tmp_path_factory.mktemp("vllm-shared")
    model = build_tiny_llama(root / "tiny-llama")
    key_file = root / "cluster.keysecret"
    key_file.write_bytes(secrets.token_bytes(32))

    def drive(name: str, role: str, mode: str, prompts: str) -> dict:
        path, out = root / name, root / f"{name}.json"
        p = subprocess.run([sys.executable, str(DRIVER), "pool", str(model), str(path), str(out), shared_pool.url,
                            role, mode, str(key_file), prompts],
                           capture_output=True, text=True, timeout=600, check=False, preexec_fn=die_with_parent)
        assert p.returncode == 0 and out.exists(), f"{name} failed ({p.returncode}):\n{p.stderr[-6000:]}"
        return json.loads(out.read_text())

    got = {"producer": drive("producer", "kv_producer", "uni", "P,P")}  # P twice: the second must not load
    got["both"] = drive("both", "kv_both", "mp", "P,P2")
    got["consumer"] = drive("consumer", "kv_consumer", "uni", "P2,P,P3")
    return got


def _connector(run: dict) -> dict:
    return run["stats"]["connector"]


def _shared(run: dict) -> dict:
    return run["stats"]["db"]["shared"]


def test_a_producer_saves_publishes_and_never_loads(engines):
    prod = engines["producer"]
    # the driver runs P twice; the JSON keeps the last, which vLLM's reset prefix cache and kvdb both missed
    assert prod["P"]["cached"] == 0 and prod["P"]["kvdb"]["hit_tokens"] == 0
    c, s = _connector(prod), _shared(prod)
    assert c["saved_blocks"] == FULL and c["loaded_blocks"] == 0 and c["lookup_blocks"] == 0
    assert s["puts"] == FULL and s["dropped_puts"] == 0 and s["hits"] == 0


def test_a_second_engine_in_multiprocess_mode_gets_1920_tokens_from_the_pool(engines):
    prod, both = engines["producer"], engines["both"]
    p = both["P"]
    assert p["cached"] == LOADABLE * BT == 1920 and p["kvdb"]["hit_tokens"] == 1920
    assert p["tokens"] == prod["P"]["tokens"] and len(p["tokens"]) == 16
    s = _shared(both)
    assert s["hits"] == LOADABLE and s["corruptions"] == 0
    assert both["P2"]["cached"] == 0
    assert _connector(both)["saved_blocks"] == 2 * FULL - LOADABLE  # P's last block, then all of P2
    assert s["puts"] == FULL + 1  # blocks landed from the pool are never published again (docs/shared.md S3)


def test_a_consumer_loads_from_the_pool_and_saves_nothing(engines):
    both, prod, cons = engines["both"], engines["producer"], engines["consumer"]
    assert cons["P2"]["cached"] == 1920 and cons["P2"]["kvdb"]["hit_tokens"] == 1920
    assert cons["P2"]["tokens"] == both["P2"]["tokens"]
    # handed over by the prefill engine, which exited before this engine started
    assert cons["P"]["cached"] == 1920 and cons["P"]["tokens"] == prod["P"]["tokens"]
    assert cons["P3"]["cached"] == 0
    c, s = _connector(cons), _shared(cons)
    assert c["saved_blocks"] == 0 and s["puts"] == 0
    assert c["loaded_blocks"] == 2 * LOADABLE and s["hits"] == 2 * LOADABLE
