"""``kvdb bench vllm-agents``: agent sessions through vLLM's OpenAI server, kvdb against what a
vLLM user would run instead (issue 44; docs/vllm.md "Performance on agent workloads").

Workload (kvdb/bench/agent_sessions.py): sessions of ``kvdb gen`` (the default trace, and the
``agentic-mix`` preset) and SWE-agent-like coding sessions, as token prompts, replayed closed
loop: a call starts once the calls it follows in its session have ended, plus the trace's tool
wait or think time times ``time_scale``. Calls of different sessions run concurrently.

Every configuration is a fresh server (``python -m vllm.entrypoints.openai.api_server``, vLLM's
default multi-process mode) on the same tiny random-weight Llama (kvdb/bench/tiny_llama.py),
with vLLM's prefix cache on and its KV pool capped by ``--num-gpu-blocks-override``:

    apc          vLLM alone, pool P blocks
    apc_equal    vLLM alone, pool P + H (kvdb's host budget given to vLLM instead: equal memory)
    kvdb_lru     pool P + kvdb host H, replacer "lru", no session hints, no pool ops
    kvdb_hints   pool P + kvdb host H, replacer "kvdb", hints in kv_transfer_params, pool ops
    kvdb_disk    pool P + kvdb host H/4 + disk, replacer "kvdb", hints, pool ops
    *_restart    after apc_equal, kvdb_hints and kvdb_disk: the server stopped (SIGTERM, vLLM's
                 default shutdown) and started again on the same data path; the last
                 ``restart_sessions`` sessions replayed

Configurations are interleaved over ``repeats`` rounds, each on a fresh data path. Per
configuration: TTFT (vLLM's per-request metrics, ``--enable-per-request-metrics``: from
scheduling to the first token; ``queued_ttft`` adds the queue time) mean, p50, p90, p99; the
replay's total time; prompt tokens; tokens from vLLM's prefix cache and from kvdb (the
response's ``cached_tokens`` less ``kv_transfer_params["kvdb"]["hit_tokens"]``); kvdb's
connector, pool-op and plan counters (read from the worker's socket); and whether the greedy
outputs of every call are the same in every configuration.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdb.bench.agent_sessions import Session, gen_sessions, swe_sessions

BT = 128  # vLLM's CPU block size


@dataclass
class Sizes:
    """The bench's size; ``QUICK`` and ``FULL`` are the two named ones."""

    layers: int = 8
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    pool_blocks: int = 72  # P
    host_blocks: int = 96  # H, in blocks of this model (kvdb's host tier, or vLLM's extra pool)
    gen_sessions: int = 8
    mix_sessions: int = 6
    swe_sessions: int = 6
    max_context: int = 8192
    max_tokens: int = 16
    time_scale: float = 0.25  # tool waits of seconds: past the Db's 1 s threshold for moving blocks (E1)
    restart_sessions: int = 4
    repeats: int = 1
    seed: int = 7

    def block_bytes(self) -> int:
        return self.layers * 2 * BT * self.kv_heads * (self.hidden // self.heads) * 4


FULL = Sizes()
QUICK = Sizes(layers=2, hidden=256, heads=4, kv_heads=2, pool_blocks=20, host_blocks=24, gen_sessions=1,
              mix_sessions=0, swe_sessions=1, max_context=2048, max_tokens=4, time_scale=0.02,
              restart_sessions=1)

CONFIGS = ("apc", "apc_equal", "kvdb_lru", "kvdb_hints", "kvdb_disk")
RESTARTS = ("apc_equal", "kvdb_hints", "kvdb_disk")


def workload(sz: Sizes) -> list[Session]:
    from kvdb.sim.generator import load_params

    kw = dict(vocab=1024, max_tokens=sz.max_tokens, max_context=sz.max_context)
    small = dict(block_tokens=BT, rounds=[1, 2], fan_out=[1, 3], system_prompt_blocks=2, tool_schema_blocks=1,
                 task_blocks=[1, 2], turn_blocks=[1, 2], tool_wait_lognormal_mu=2.0, llm_call_s=2.0)
    out: list[Session] = []
    if sz.gen_sessions:
        p = load_params(seed=sz.seed, sessions=sz.gen_sessions, session_interarrival_mean_s=10.0, **small)
        out += [_tag(s, "gen") for s in gen_sessions(p, token_seed=sz.seed, **kw)]
    if sz.mix_sessions:
        p = load_params(shape="agentic-mix", seed=sz.seed + 1, sessions=sz.mix_sessions,
                        session_interarrival_mean_s=10.0, app_tool_schema_blocks=2, react_calls=[1, 3], **small)
        out += [_tag(s, "mix") for s in gen_sessions(p, token_seed=sz.seed + 1, **kw)]
    if sz.swe_sessions:
        out += swe_sessions(seed=sz.seed, sessions=sz.swe_sessions, block_tokens=BT,
                            swe_shared_tokens=min(1536, sz.max_context // 4), **kw)
    out.sort(key=lambda s: s.start_s)
    return out


def _tag(s: Session, kind: str) -> Session:
    s.session_id = f"{kind}-{s.session_id}"
    for c in s.calls:
        c.session_id = s.session_id
    return s


def _prefix_hashes(sessions: list[Session]) -> dict[tuple, str]:
    """vLLM's own hash (hex) of each call's last shared-prefix block: the ``prefix_hash`` hint
    (the connector maps it to the kvdb key, kvdb/integrations/vllm/service.py)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    out = {}
    for s in sessions:
        for i, c in enumerate(s.calls):
            if c.prefix_blocks:
                req = Request("h", c.tokens[: c.prefix_blocks * BT], SamplingParams(max_tokens=1), None,
                              block_hasher=get_request_block_hasher(BT, fn))
                out[(s.session_id, i)] = bytes(req.block_hashes[c.prefix_blocks - 1]).hex()
    return out


# ---------------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    """vLLM's CPU build on a small machine: no thread binding (the cores are shared), and no
    cores reserved for the scheduler and the connector when there are only two."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if (os.cpu_count() or 1) <= 2:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    root = str(Path(__file__).resolve().parents[2])  # the connector is imported by module path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class Server:
    def __init__(self, model: Path, blocks: int, sz: Sizes, log: Path, kvdb: dict | None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager", "--seed", "0",
               "--max-model-len", str(sz.max_context + sz.max_tokens + BT), "--enable-prefix-caching",
               "--num-gpu-blocks-override", str(blocks), "--kv-cache-memory-bytes", str(blocks * sz.block_bytes()),
               "--max-num-seqs", "16", "--enable-per-request-metrics", "--enable-prompt-tokens-details",
               "--host", "127.0.0.1", "--port", str(self.port)]
        if kvdb is not None:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvdbConnector", "kv_connector_module_path": "kvdb.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": kvdb})]
        self.log = log
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=server_env(),
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited ({self.proc.returncode}):\n{_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM's server not ready after {timeout_s:.0f} s:\n{_tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (vLLM's default shutdown), then SIGKILL."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of the group left (engine, worker)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._out.close()


def _tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _post(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------------------- a replay
def replay(url: str, sessions: list[Session], *, hints: bool, prefix: dict[tuple, str], time_scale: float) -> dict:
    """Every session's calls, closed loop; returns per-call results keyed by (session, index)."""
    results: dict[tuple, dict] = {}
    lock = threading.Lock()
    t0 = time.monotonic()

    def run_call(s: Session, i: int, done: list[threading.Event]) -> None:
        c = s.calls[i]
        for j in c.deps:
            done[j].wait()
        if c.gap_s:
            time.sleep(c.gap_s * time_scale)
        body: dict[str, Any] = {"model": "tiny", "prompt": c.tokens, "max_tokens": c.max_tokens, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}
        if hints:
            params: dict[str, Any] = {"session_id": s.session_id, "agent_id": c.agent_id}
            for k, v in c.hints.items():  # the waits as the replay makes them (scaled)
                params[k] = round(v * time_scale, 3) if k == "expected_tool_duration_s" else v
            if (s.session_id, i) in prefix:
                params["prefix_hash"] = prefix[(s.session_id, i)]
            if c.last:
                params["end_session"] = True
            body["kv_transfer_params"] = params
        t = time.monotonic()
        try:
            r = _post(url, body)
            ch = r["choices"][0]
            m = r.get("metrics") or {}
            usage = r.get("usage") or {}
            cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
            kvdb_hit = (((r.get("kv_transfer_params") or {}).get("kvdb")) or {}).get("hit_tokens", 0)
            out = {"ttft_s": (m.get("time_to_first_token_ms") or 0.0) / 1000,
                   "queue_s": (m.get("queue_time_ms") or 0.0) / 1000, "wall_s": time.monotonic() - t,
                   "prompt_tokens": usage.get("prompt_tokens", len(c.tokens)), "cached_tokens": cached,
                   "kvdb_tokens": kvdb_hit, "tokens": ch.get("token_ids") or ch.get("text")}
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        with lock:
            results[(s.session_id, i)] = out
        done[i].set()

    def run_session(s: Session) -> None:
        time.sleep(max(0.0, s.start_s * time_scale - (time.monotonic() - t0)))
        done = [threading.Event() for _ in s.calls]
        threads = [threading.Thread(target=run_call, args=(s, i, done), daemon=True) for i in range(len(s.calls))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    threads = [threading.Thread(target=run_session, args=(s,), daemon=True) for s in sessions]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"calls": results, "total_s": time.monotonic() - t0}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def summarize(run: dict) -> dict:
    ok = [r for r in run["calls"].values() if "error" not in r]
    ttft = [r["ttft_s"] for r in ok]
    queued = [r["ttft_s"] + r["queue_s"] for r in ok]
    cached = sum(r["cached_tokens"] for r in ok)
    kv = sum(r["kvdb_tokens"] for r in ok)
    return {"requests": len(run["calls"]), "errors": len(run["calls"]) - len(ok),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"), "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p90_s": _pct(ttft, 0.9), "ttft_p99_s": _pct(ttft, 0.99),
            "queued_ttft_mean_s": statistics.fmean(queued) if queued else float("nan"),
            "total_s": run["total_s"], "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "vllm_cache_tokens": cached - kv, "kvdb_tokens": kv}


def _kvdb_stats(path: Path) -> dict:
    from kvdb.integrations.vllm.service import ServiceClient

    c = ServiceClient(str(path), timeout_s=10.0)
    try:
        got = c.call({"op": "stats"}) or {}
    finally:
        c.close()
    plans = (got.get("db") or {}).get("plans") or {}
    keep = ("waits", "planned_offloads", "planned_prefetches", "planned_prefetch_blocks", "late_prefetches",
            "early_calls", "prefixes_resolved")
    return {"connector": got.get("connector"), "pool": got.get("pool"), "plans": {k: plans.get(k) for k in keep}}


def _kvdb_settings(name: str, sz: Sizes, path: Path) -> dict | None:
    bb = sz.block_bytes()
    if name.startswith("apc"):
        return None
    s = {"path": str(path), "host_bytes": sz.host_blocks * bb, "disk_bytes": 0, "replacer": "kvdb",
         "lookup_timeout_s": 10.0}
    if name == "kvdb_lru":
        s.update(replacer="lru", pool_demote=False)
    elif name == "kvdb_disk":
        s.update(host_bytes=max(1, sz.host_blocks // 4) * bb, disk_bytes=None)
    return s


def bench_vllm_agents(sz: Sizes = FULL, *, configs: tuple[str, ...] = CONFIGS, restarts: tuple[str, ...] = RESTARTS,
                      data_dir: str | None = None, progress=None) -> dict:
    from kvdb.bench.tiny_llama import build_tiny_llama

    sessions = workload(sz)
    prefix = _prefix_hashes(sessions)
    last = sessions[-sz.restart_sessions:] if sz.restart_sessions else []
    runs: dict[str, list[dict]] = {}
    outputs: dict[str, dict] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvdb-bench-agents-") as tmp:
        root = Path(data_dir) if data_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        model = build_tiny_llama(root / "model", num_hidden_layers=sz.layers, hidden_size=sz.hidden,
                                 intermediate_size=2 * sz.hidden, num_attention_heads=sz.heads,
                                 num_key_value_heads=sz.kv_heads,
                                 max_position_embeddings=max(16384, sz.max_context + 2 * BT))
        for r in range(sz.repeats):
            order = list(configs[r % len(configs):]) + list(configs[: r % len(configs)])  # interleaved
            for name in order:
                path = root / f"{name}-{r}" / "kv"
                path.parent.mkdir(parents=True, exist_ok=True)
                phases = [(name, sessions)] + ([(name + "_restart", last)] if name in restarts and last else [])
                for phase, todo in phases:
                    blocks = sz.pool_blocks + (sz.host_blocks if name == "apc_equal" else 0)
                    kv = _kvdb_settings(name, sz, path)
                    srv = Server(model, blocks, sz, path.parent / f"{phase}.log", kv)
                    try:
                        srv.wait_ready()
                        got = replay(srv.url, todo, hints=name in ("kvdb_hints", "kvdb_disk"), prefix=prefix,
                                     time_scale=sz.time_scale)
                        res = summarize(got)
                        if kv is not None:
                            res.update(_kvdb_stats(path))
                    finally:
                        srv.stop()
                    runs.setdefault(phase, []).append(res)
                    if r == 0 and not phase.endswith("_restart"):
                        outputs[phase] = {k: v.get("tokens") for k, v in got["calls"].items()}
                    if progress:
                        progress(1)
    return _report(sz, sessions, runs, outputs, time.perf_counter() - t_all)


def _report(sz: Sizes, sessions: list[Session], runs: dict, outputs: dict, wall: float) -> dict:
    numeric = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "queued_ttft_mean_s", "total_s")
    configs = {}
    for name, rs in runs.items():
        agg = dict(rs[-1])
        for k in numeric:
            agg[k] = statistics.median(x[k] for x in rs)
        agg["repeats"] = [{k: round(x[k], 4) for k in numeric} for x in rs]
        configs[name] = agg
    ref_name = next(iter(outputs), None)
    ref = outputs.get(ref_name, {})
    mismatches = {n: sum(1 for k, v in o.items() if v != ref.get(k)) for n, o in outputs.items()}
    blocks = {tuple(c.tokens[i:i + BT]) for s in sessions for c in s.calls for i in range(0, len(c.tokens) - BT + 1, BT)}

    def ratio(a: str, b: str, k: str) -> float | None:
        if a in configs and b in configs and configs[b][k]:
            return configs[a][k] / configs[b][k]
        return None

    return {
        "sizes": {**sz.__dict__, "block_bytes": sz.block_bytes(),
                  "host_bytes": sz.host_blocks * sz.block_bytes()},
        "workload": {"sessions": len(sessions), "calls": sum(len(s.calls) for s in sessions),
                     "prompt_tokens": sum(len(c.tokens) for s in sessions for c in s.calls),
                     "distinct_full_blocks": len(blocks),
                     "kinds": sorted({s.session_id.split("-")[0] if "-" in s.session_id else "swe" for s in sessions})},
        "configs": configs,
        "outputs_identical": all(v == 0 for v in mismatches.values()),
        "output_mismatches": mismatches,
        "ratios": {"hints_vs_apc_equal_ttft": ratio("kvdb_hints", "apc_equal", "ttft_mean_s"),
                   "hints_vs_apc_equal_total": ratio("kvdb_hints", "apc_equal", "total_s"),
                   "hints_vs_lru_ttft": ratio("kvdb_hints", "kvdb_lru", "ttft_mean_s"),
                   "disk_vs_apc_equal_ttft": ratio("kvdb_disk", "apc_equal", "ttft_mean_s")},
        "goals": {"hints_vs_apc_equal_ttft": "<= 0.67", "hints_vs_apc_equal_total": "<= 0.85",
                  "hints_vs_lru_ttft": "<= 0.9"},
        "wall_s": wall,
    }
