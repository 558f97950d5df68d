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
with a ``session_end`` line. All randomness comes from one ``random.Random(seed)``, and the
shapes' own (below).

Workload shapes (kvdb/sim/shapes.py documents each; all off by default, and then the trace is
byte for byte what it was before they existed): chain breaks (shared context inserted before an
agent's own history), applications sharing system prompts and a tool-schema block across
sessions, ReAct nodes with heavy-tailed tool waits fanning in to a reviewer, call agent ids
namespaced apart from the workflow's, tool lists that change mid-session, and wrong hints.
An agent's prompt is then: head (system prompt, tool schemas), task, shared context, history.
"""

from __future__ import annotations

import gc
import json
import math
import random
from typing import Any, Hashable, Iterator

from kvdb.errors import InvalidInput
from kvdb.sim.shapes import SHAPE_DEFAULTS, Shapes, check_shape_params, preset

BASE_DEFAULTS: dict[str, Any] = {
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
DEFAULTS: dict[str, Any] = {**BASE_DEFAULTS, **SHAPE_DEFAULTS}  # the shapes: kvdb/sim/shapes.py


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


def load_params(path: str | None = None, shape: str | None = None, **overrides: Any) -> dict[str, Any]:
    """The defaults, then ``path``'s JSON, then the preset ``shape`` (kvdb/sim/shapes.py), then
    the ``overrides`` that are not None; checked."""
    if shape is not None:
        overrides = {**preset(shape), **{k: v for k, v in overrides.items() if v is not None}}
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
    check_shape_params(p)
    if p["react"] and p["tools_per_agent"] < 1:
        raise InvalidInput("react needs tools_per_agent >= 1 (each ReAct step calls one of the agent's tools)")
    return p


class _Chains:
    """Interns prefix chains: the id of block j names (id of block j-1, content of block j)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def extend(self, parent: int, contents: list[Hashable]) -> list[int]:
        """The ids of ``contents`` following the block ``parent`` (-1: at the start)."""
        out, ids = [], self._ids
        for c in contents:
            k = (parent, c)
            i = ids.get(k)
            if i is None:
                i = ids[k] = len(ids)
            out.append(i)
            parent = i
        return out

    def ids(self, contents: list[Hashable]) -> list[int]:
        return self.extend(-1, contents)


class _Agent:
    """One agent's prompt in one session: head (system prompt, tool schemas), the session's
    task, shared context (chain breaks) and its own history, with the ids of all of it."""

    __slots__ = ("tools", "version", "base", "ctx", "hist", "contents", "ids", "calls")

    def __init__(self, tools: list[str]) -> None:
        self.tools = tools
        self.version = 0  # the session's tool-list version its head was built with
        self.base = 0  # blocks of head + task at the front of contents
        self.ctx: list = []
        self.hist: list = []
        self.contents: list = []
        self.ids: list[int] = []
        self.calls = 0


def generate(params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yield the trace's lines (dicts), sorted by timestamp."""
    # The cyclic GC finds nothing to free in these acyclic lines but rescans them all as they
    # pile up: off while building, 100k calls take about a third less time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        events = _events(params)
    finally:
        if enabled:
            gc.enable()
    for ts, _, line in events:
        yield {"timestamp": ts, **line}


def _events(params: dict[str, Any]) -> list[tuple[int, int, dict[str, Any]]]:
    """(timestamp ms, tie-break, line without its timestamp) for every line, in trace order."""
    rng = random.Random(params["seed"])
    noise_rng = random.Random(params["seed"] + 1)  # hints' noise: the same trace whatever its sigma
    sh = Shapes(params)
    chains = _Chains()
    bt = params["block_tokens"]
    events: list[tuple[int, int, dict[str, Any]]] = []
    llm = float(params["llm_call_s"])
    t_start = 0.0
    uid = 0
    for s in range(params["sessions"]):
        t_start += rng.expovariate(1.0 / params["session_interarrival_mean_s"]) if params["session_interarrival_mean_s"] > 0 else 0.0
        sid = f"s{s}"
        tenant = f"t{s % params['tenants']}" if params["tenants"] > 1 else None
        app = sh.app_for_session()
        sys_blocks = [("sys", tenant, k) for k in range(params["system_prompt_blocks"])]
        task = [(sid, "task", k) for k in range(rng.randint(*params["task_blocks"]))]
        rounds = rng.randint(*params["rounds"])
        change = sh.tool_change_round(rounds)
        version = 0
        nodes: list[dict[str, Any]] = []
        calls: list[tuple[float, dict[str, Any]]] = []
        agents: dict[str, _Agent] = {}

        def head(agent: str, st: _Agent) -> list:
            if app is not None:
                return sh.system_prompt(app, agent, tenant) + sh.app_tools(app, st.version, tenant)
            v = () if st.version == 0 else (st.version,)
            return sys_blocks + [("tool", tenant, name, k, *v) for name in st.tools for k in range(params["tool_schema_blocks"])]

        def call(agent: str, node: str, t: float, hints: dict[str, Any] | None) -> None:
            nonlocal uid
            st = agents[agent]
            new_head = not st.calls or st.version != version
            st.version = version
            broken = bool(st.calls) and sh.breaks()
            if broken:
                st.ctx = [(sid, agent, "ctx", st.calls, k) for k in range(sh.context_blocks())]
            if new_head:
                base = head(agent, st) + task
                st.base = len(base)
                st.contents = base + st.ctx + st.hist
                st.ids = chains.ids(st.contents)
            elif broken:  # head and task keep their ids; context and history get new ones
                b = st.base
                rest = st.ctx + st.hist
                st.contents = st.contents[:b] + rest
                st.ids = st.ids[:b] + chains.extend(st.ids[b - 1] if b else -1, rest)
            n0 = len(st.contents)
            new = [(sid, agent, n0 + k) for k in range(rng.randint(*params["turn_blocks"]))]
            st.hist.extend(new)
            st.contents.extend(new)
            st.ids.extend(chains.extend(st.ids[-1] if st.ids else -1, new))
            st.calls += 1
            uid += 1
            ids = st.ids + chains.extend(st.ids[-1], [("partial", uid)])
            partial_tokens = rng.randint(1, bt - 1) if bt > 1 else 0
            line: dict[str, Any] = {"session_id": sid, "agent_id": sh.call_agent_id(sid, agent), "node_id": node,
                                    "input_length": (len(ids) - 1) * bt + partial_tokens,
                                    "output_length": rng.randint(50, 800), "hash_ids": ids}
            if tenant is not None:
                line["tenant"] = tenant
            if hints:
                line["hints"] = hints
            calls.append((t, line))

        def hint(wait: float, tool_name: str, tool_node: dict[str, Any] | None) -> dict[str, Any] | None:
            noise = math.exp(noise_rng.gauss(0.0, params["hint_noise_sigma"]))
            if not params["hints"]:
                return None
            h = {"expected_tool_duration_s": round(wait * noise, 3), "tool": tool_name}
            targets = [(h, "expected_tool_duration_s")]
            if tool_node is not None:
                tool_node["expected_duration_s"] = h["expected_tool_duration_s"]
                targets.append((tool_node, "expected_duration_s"))
            sh.declare(wait * noise, targets)
            return h

        def react(agent: str, node: str, t: float) -> float:
            """A ReAct node: calls with tool waits between them; returns when its last call ends."""
            st = agents[agent]
            n = rng.randint(*params["react_calls"])
            for i in range(n):
                if i == n - 1:
                    call(agent, node, t, None)
                    break
                name = rng.choice(st.tools)
                wait = sh.react_wait_s(rng, params["tools"].index(name))
                call(agent, node, t, hint(wait, name, None))
                t += llm + wait
            return t + llm

        t = t_start
        prev_agg: str | None = None
        wrong = sh.wrong_workflow()
        for r in range(rounds):
            if change is not None and r == change[0]:
                version = change[1]
            plan = f"r{r}.plan"
            nodes.append({"id": plan, "agent_id": "coordinator", "deps": [prev_agg] if prev_agg else []})
            agents.setdefault("coordinator", _Agent(params["tools"][:1]))
            call("coordinator", plan, t, None)
            t_plan_done = t + llm
            k = rng.randint(*params["fan_out"])
            ends, fan_in = [], []
            for w in range(k):
                agent = f"worker{w}"
                tools = rng.sample(params["tools"], params["tools_per_agent"]) if agent not in agents else []
                if agent not in agents:
                    agents[agent] = _Agent(tools)
                if params["react"]:
                    node = f"r{r}.w{w}"
                    nodes.append({"id": node, "agent_id": agent, "deps": [plan]})
                    ends.append(react(agent, node, t_plan_done))
                    fan_in.append(node)
                    continue
                a, tool, b = f"r{r}.w{w}.a", f"r{r}.w{w}.tool", f"r{r}.w{w}.b"
                wait = min(params["tool_wait_max_s"],
                           rng.lognormvariate(params["tool_wait_lognormal_mu"], params["tool_wait_lognormal_sigma"]))
                tool_name = tools[0] if tools else params["tools"][w % len(params["tools"])]
                tool_node: dict[str, Any] = {"id": tool, "kind": "tool", "deps": [a], "agent_id": agent}
                hints = hint(wait, tool_name, tool_node)
                nodes.append({"id": a, "agent_id": agent, "deps": [plan]})
                nodes.append(tool_node)
                nodes.append({"id": b, "agent_id": agent, "deps": [tool]})
                call(agent, a, t_plan_done, hints)
                t_b = t_plan_done + llm + wait
                call(agent, b, t_b, None)
                ends.append(t_b + llm)
                fan_in.append(b)
            if wrong:  # a phantom worker: declared, never calls
                nodes.append({"id": f"r{r}.w{k}.phantom", "agent_id": f"worker{k}", "deps": [plan]})
            t = max(ends)
            if params["react"]:
                agg = f"r{r}.review"
                nodes.append({"id": agg, "agent_id": "reviewer", "deps": fan_in})
                if "reviewer" not in agents:
                    agents["reviewer"] = _Agent(rng.sample(params["tools"], params["tools_per_agent"]))
                t = react("reviewer", agg, t)
            else:
                agg = f"r{r}.agg"
                nodes.append({"id": agg, "agent_id": "coordinator", "deps": fan_in})
                call("coordinator", agg, t, None)
                t += llm
            prev_agg = agg
        if wrong:  # a phantom round: planned and aggregated, never run
            nodes.append({"id": f"r{rounds}.plan", "agent_id": "coordinator", "deps": [prev_agg]})
            nodes.append({"id": f"r{rounds}.agg", "agent_id": "coordinator", "deps": [f"r{rounds}.plan"]})
        wf_line: dict[str, Any] = {"type": "workflow", "session_id": sid, "nodes": nodes}
        if tenant is not None:
            wf_line["tenant"] = tenant
        events.append((int(round(t_start * 1000)), len(events), wf_line))
        for tc, line in calls:
            events.append((int(round(tc * 1000)), len(events), line))
        events.append((int(round(t * 1000)), len(events), {"type": "session_end", "session_id": sid}))
    sh.mispredict()
    events.sort(key=lambda e: (e[0], e[1]))
    return events


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps(line, separators=...), one encoder


def trace_lines(params: dict[str, Any], workflows: bool = True) -> Iterator[str]:
    """The trace's JSON lines (no newlines); ``workflows=False`` leaves the workflow lines out
    (the same calls and hints with no declared DAG)."""
    for line in generate(params):
        if workflows or line.get("type") != "workflow":
            yield _ENCODE(line)


def generate_trace(params: dict[str, Any], workflows: bool = True, source: str = "generated"):
    """The trace parsed in memory (kvdb/sim/trace.py ``Trace``), without a file."""
    from kvdb.sim.trace import parse_trace

    return parse_trace("\n".join(trace_lines(params, workflows)), source=source)


def write_trace(params: dict[str, Any], path: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for line in trace_lines(params):
            f.write(line + "\n")
            n += 1
    return n
