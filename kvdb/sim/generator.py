"""Seeded generator of agent-workflow traces (``kvdb gen``), in the kvdb agent trace v1.

One session runs ``rounds`` rounds of a fan-out / fan-in DAG::

    r0.plan ──> r0.w0.a ──> r0.w0.tool ──> r0.w0.b ──┐
            ├─> r0.w1.a ──> r0.w1.tool ──> r0.w1.b ──┼─> r0.agg ──> r1.plan ──> ...
            └─> ...                                   ┘

``plan`` / ``agg`` are the coordinator agent's LLM calls, ``wK.a`` / ``wK.b`` worker K's
calls around its tool wait. Every agent's prompt is: the shared system prompt
(``system_prompt_blocks``, the same for every session of a tenant), the schemas of its
tools (``tool_schema_blocks`` each, shared by every agent using that tool), the session's
task (``task_blocks``), then its own history, which grows by ``turn_blocks`` per call. The
last block of each call is partial (a unique hash: the next, longer prompt changes it),
as in the Mooncake traces. Tool waits are log-normal (heavy-tailed), capped at
``tool_wait_max_s``. LLM calls take ``llm_call_s``; timestamps assume that service time.

Hints (when ``hints`` is true) on each ``wK.a`` call: ``expected_tool_duration_s`` = the
true wait times exp(N(0, hint_noise_sigma)) and ``tool``. Sessions start as a Poisson
process (``session_interarrival_mean_s``); each starts with a ``workflow`` line and ends
with a ``session_end`` line. All randomness comes from one ``random.Random(seed)``.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any, Hashable, Iterator

from kvdb.errors import InvalidInput

DEFAULTS: dict[str, Any] = {
    "seed": 7,
    "sessions": 80,
    "session_interarrival_mean_s": 15.0,
    "rounds": [2, 5],
    "fan_out": [2, 4],
    "block_tokens": 512,
    "system_prompt_blocks": 8,
    "tools": ["search", "code_exec", "browser", "sql", "files"],
    "tool_schema_blocks": 3,
    "tools_per_agent": 2,
    "task_blocks": [2, 6],
    "turn_blocks": [1, 4],
    "llm_call_s": 2.0,
    "tool_wait_lognormal_mu": 2.0,
    "tool_wait_lognormal_sigma": 1.0,
    "tool_wait_max_s": 900.0,
    "hints": True,
    "hint_noise_sigma": 0.0,
    "tenants": 1,
}


def merge_params(defaults: dict[str, Any], path: str | None, overrides: dict[str, Any], what: str) -> dict[str, Any]:
    """``defaults``, then the JSON object in ``path`` (keys starting with ``_`` are comments),
    then the ``overrides`` that are not None; unknown names are refused."""
    p = dict(defaults)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{path}: malformed JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(loaded, dict):
            raise InvalidInput(f"{path}: {what} must be a JSON object")
        p.update({k: v for k, v in loaded.items() if not k.startswith("_")})
    p.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(p) - set(defaults))
    if unknown:
        raise InvalidInput(f"unknown {what} {unknown}; known: {sorted(defaults)}")
    return p


def load_params(path: str | None = None, **overrides: Any) -> dict[str, Any]:
    p = merge_params(DEFAULTS, path, overrides, "generator parameters")
    for k in ("rounds", "fan_out", "task_blocks", "turn_blocks"):
        v = p[k]
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) and 0 <= v[0] <= v[1]):
            raise InvalidInput(f"generator parameter {k!r} must be [min, max] integers, got {v!r}")
    for k in ("sessions", "block_tokens", "system_prompt_blocks", "tool_schema_blocks", "tools_per_agent", "tenants"):
        if not isinstance(p[k], int) or p[k] < 0:
            raise InvalidInput(f"generator parameter {k!r} must be an integer >= 0, got {p[k]!r}")
    for k in ("session_interarrival_mean_s", "llm_call_s", "tool_wait_lognormal_sigma", "tool_wait_max_s", "hint_noise_sigma"):
        if not isinstance(p[k], (int, float)) or not math.isfinite(p[k]) or p[k] < 0:
            raise InvalidInput(f"generator parameter {k!r} must be a finite number >= 0, got {p[k]!r}")
    if p["block_tokens"] < 1 or p["rounds"][0] < 1 or p["fan_out"][0] < 1 or p["turn_blocks"][0] < 1:
        raise InvalidInput("block_tokens, rounds, fan_out and turn_blocks must be at least 1")
    if not p["tools"] or p["tools_per_agent"] > len(p["tools"]):
        raise InvalidInput("tools must be non-empty and tools_per_agent at most len(tools)")
    return p


class _Chains:
    """Interns prefix chains: the id of block j names (id of block j-1, content of block j)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def ids(self, contents: list[Hashable]) -> list[int]:
        out, parent = [], -1
        for c in contents:
            k = (parent, c)
            i = self._ids.get(k)
            if i is None:
                i = self._ids[k] = len(self._ids)
            out.append(i)
            parent = i
        return out


def generate(params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yield the trace's lines (dicts), sorted by timestamp."""
    rng = random.Random(params["seed"])
    noise_rng = random.Random(params["seed"] + 1)  # hints' noise: the same trace whatever its sigma
    chains = _Chains()
    bt = params["block_tokens"]
    events: list[tuple[float, int, dict[str, Any]]] = []
    seq = 0
    t_start = 0.0
    llm = float(params["llm_call_s"])
    uid = 0

    def emit(t: float, line: dict[str, Any]) -> None:
        nonlocal seq
        line = {"timestamp": int(round(t * 1000)), **line}
        events.append((line["timestamp"], seq, line))
        seq += 1

    for s in range(params["sessions"]):
        t_start += rng.expovariate(1.0 / params["session_interarrival_mean_s"]) if params["session_interarrival_mean_s"] > 0 else 0.0
        sid = f"s{s}"
        tenant = f"t{s % params['tenants']}" if params["tenants"] > 1 else None
        sys_blocks = [("sys", tenant, k) for k in range(params["system_prompt_blocks"])]
        task = [(sid, "task", k) for k in range(rng.randint(*params["task_blocks"]))]
        rounds = rng.randint(*params["rounds"])
        nodes: list[dict[str, Any]] = []
        calls: list[tuple[float, dict[str, Any]]] = []
        histories: dict[str, list] = {}

        def prompt(agent: str, tools: list[str]) -> list:
            if agent not in histories:
                schema = [("tool", tenant, name, k) for name in tools for k in range(params["tool_schema_blocks"])]
                histories[agent] = sys_blocks + schema + task
            return histories[agent]

        def call(agent: str, tools: list[str], node: str, t: float, hints: dict[str, Any] | None) -> None:
            nonlocal uid
            h = prompt(agent, tools)
            h.extend((sid, agent, len(h) + k) for k in range(rng.randint(*params["turn_blocks"])))
            uid += 1
            contents = h + [("partial", uid)]
            ids = chains.ids(contents)
            partial_tokens = rng.randint(1, bt - 1) if bt > 1 else 0
            line: dict[str, Any] = {"session_id": sid, "agent_id": agent, "node_id": node,
                                    "input_length": (len(contents) - 1) * bt + partial_tokens,
                                    "output_length": rng.randint(50, 800), "hash_ids": ids}
            if tenant is not None:
                line["tenant"] = tenant
            if hints:
                line["hints"] = hints
            calls.append((t, line))

        t = t_start
        prev_agg: str | None = None
        for r in range(rounds):
            plan = f"r{r}.plan"
            nodes.append({"id": plan, "agent_id": "coordinator", "deps": [prev_agg] if prev_agg else []})
            call("coordinator", params["tools"][:1], plan, t, None)
            t_plan_done = t + llm
            k = rng.randint(*params["fan_out"])
            ends = []
            for w in range(k):
                agent = f"worker{w}"
                tools = rng.sample(params["tools"], params["tools_per_agent"]) if agent not in histories else []
                a, tool, b = f"r{r}.w{w}.a", f"r{r}.w{w}.tool", f"r{r}.w{w}.b"
                wait = min(params["tool_wait_max_s"],
                           rng.lognormvariate(params["tool_wait_lognormal_mu"], params["tool_wait_lognormal_sigma"]))
                noise = math.exp(noise_rng.gauss(0.0, params["hint_noise_sigma"]))
                tool_name = tools[0] if tools else params["tools"][w % len(params["tools"])]
                hints = {"expected_tool_duration_s": round(wait * noise, 3), "tool": tool_name} if params["hints"] else None
                nodes.append({"id": a, "agent_id": agent, "deps": [plan]})
                nodes.append({"id": tool, "kind": "tool", "deps": [a], "agent_id": agent,
                              **({"expected_duration_s": round(wait * noise, 3)} if params["hints"] else {})})
                nodes.append({"id": b, "agent_id": agent, "deps": [tool]})
                call(agent, tools, a, t_plan_done, hints)
                t_b = t_plan_done + llm + wait
                call(agent, tools, b, t_b, None)
                ends.append(t_b + llm)
            agg = f"r{r}.agg"
            nodes.append({"id": agg, "agent_id": "coordinator", "deps": [f"r{r}.w{w}.b" for w in range(k)]})
            t = max(ends)
            call("coordinator", [], agg, t, None)
            t += llm
            prev_agg = agg
        wf_line: dict[str, Any] = {"type": "workflow", "session_id": sid, "nodes": nodes}
        if tenant is not None:
            wf_line["tenant"] = tenant
        emit(t_start, wf_line)
        for tc, line in calls:
            emit(tc, line)
        emit(t, {"type": "session_end", "session_id": sid})
    events.sort(key=lambda e: (e[0], e[1]))
    for _, _, line in events:
        yield line


def write_trace(params: dict[str, Any], path: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for line in generate(params):
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
            n += 1
    return n
