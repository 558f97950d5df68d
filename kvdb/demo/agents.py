"""``kvdb demo``: a multi-agent workflow on a real (random-weight) model, kvdb managing its KV.

The workflow, per round r (``rounds`` of them; ``workers`` = W)::

    plan{r} (planner) -> search{r} (tool) -> work{r}.1..W (workers, in parallel)
        -> exec{r}.w (tool, heavy-tailed wait) -> fix{r}.w (worker reads the tool result)
        -> review{r} (reviewer reads every fix) -> plan{r+1} ...

Prompts are what agent frameworks send: a shared system prompt and tool schemas, the agent's
role, its growing history (earlier prompts, its outputs, tool results) and the new input.
Token ids are seeded random (the model has random weights; only prefix sharing matters).

Each LLM call runs twice on the same model: without kvdb (prefill the whole prompt) and with
kvdb (``PrefixCache.lookup`` + prefill of the rest), both timed to the first token; the first
tokens must agree. The kvdb path then decodes ``output_tokens`` greedily and saves the blocks.

Tiers: a device arena (on the CPU here: the demo runs anywhere), a host arena and the disk
tier, capacities far below the workflow's KV so that blocks move down (device -> host ->
disk) and come back. Eviction is the planner's ``kvdb`` policy, fed by the Db's session API:
each agent is a session, each call a ``call_started`` / ``call_finished`` with hints (the
expected tool wait after it), each tool start a ``hint``. The Db acts on that plan by itself
(kvdb/db/plans/): a waiting agent's blocks go down when the device tier is full and
come back before its predicted return; the demo never moves a block. Time is a virtual clock
given to the Db (tool waits are not slept; LLM calls advance it by their measured duration):
when a tool returns the demo moves the clock and lets the Db run the moves then due
(``Db.run_plans``), as a real clock would have.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import kvdb
from kvdb.demo.model import VOCAB, prefill, tiny_llama
from kvdb.demo.tools import HeadRenderer, tools_for
from kvdb.errors import InvalidInput

MARKER = ".kvdb-demo"
MODEL_ID = "kvdb-demo-tiny-llama"


@dataclass
class DemoConfig:
    data_dir: str | os.PathLike = "kvdb-demo"
    rounds: int = 3
    workers: int = 3
    chart_path: str | os.PathLike | None = None
    seed: int = 0
    block_tokens: int = 16
    system_tokens: int = 768  # shared system prompt
    schema_tokens: int = 256  # shared tool schemas
    role_tokens: int = 64  # per agent
    tool_result_tokens: int = 48
    output_tokens: int = 16  # decoded per call
    device_pages: int = 64  # 64 KiB pages: a 4 MiB device tier
    host_pages: int = 64  # a 4 MiB host tier (the workflow's KV is ~2.5x both together)
    disk_bytes: int = 256 << 20
    offload_after_s: float = 5.0
    tool_change_round: int = 2  # worker1 loads one more tool from this round on (0: never; kvdb/demo/tools.py)
    threads: int | None = 1  # torch intra-op threads; None: torch's choice (see run_demo)


# ---------------------------------------------------------------------------- the workflow


def _segment(name: str, n: int, seed: int) -> list[int]:
    """Seeded token ids for a named prompt segment (stable across processes: no hash())."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def tool_durations(cfg: DemoConfig) -> dict[str, float]:
    """Expected tool waits (seconds): searches ~1.5 s, code runs heavy-tailed (lognormal)."""
    g = torch.Generator().manual_seed(cfg.seed + 17)
    out = {}
    for r in range(1, cfg.rounds + 1):
        out[f"search{r}"] = 1.5
        z = torch.randn(cfg.workers, generator=g).tolist()
        for w in range(1, cfg.workers + 1):
            out[f"exec{r}.{w}"] = round(min(120.0, math.exp(1.2 + 1.1 * z[w - 1])), 2)
    return out


def workflow_nodes(cfg: DemoConfig) -> list[dict]:
    """The declared DAG (kvdb.planner.workflow format)."""
    waits = tool_durations(cfg)
    nodes: list[dict] = []
    for r in range(1, cfg.rounds + 1):
        nodes.append({"id": f"plan{r}", "agent_id": "planner", "deps": [f"review{r - 1}"] if r > 1 else []})
        nodes.append({"id": f"search{r}", "agent_id": "planner", "kind": "tool", "deps": [f"plan{r}"],
                      "expected_duration_s": waits[f"search{r}"]})
        for w in range(1, cfg.workers + 1):
            nodes.append({"id": f"work{r}.{w}", "agent_id": f"worker{w}", "deps": [f"search{r}"]})
            nodes.append({"id": f"exec{r}.{w}", "agent_id": f"worker{w}", "kind": "tool", "deps": [f"work{r}.{w}"],
                          "expected_duration_s": waits[f"exec{r}.{w}"]})
            nodes.append({"id": f"fix{r}.{w}", "agent_id": f"worker{w}", "deps": [f"exec{r}.{w}"]})
        nodes.append({"id": f"review{r}", "agent_id": "reviewer",
                      "deps": [f"fix{r}.{w}" for w in range(1, cfg.workers + 1)]})
    return nodes


LlmFn = Callable[[str, str, list, float, dict], tuple]  # (node, agent, prompt, now_s, hints) -> (out, dur_s)
ToolFn = Callable[[str, str, float, float], None]  # (node, agent, duration_s, now_s)


def drive(cfg: DemoConfig, llm: LlmFn, tool: ToolFn, before_call: Callable | None = None,
          on_prompt: Callable | None = None) -> dict[str, float]:
    """Run the workflow in dependency order on a virtual clock; returns each node's end time.

    ``llm`` gets each call's full prompt and returns its output tokens and duration. Workers of
    one round start together; their follow-up calls run in the order their tools finish.
    ``before_call(node, agent, previous_prompt, now_s)`` runs when a tool wait ends, before the
    agent's next call (the moment the tool returns). A prompt is the head (system prompt and the
    tools the agent loaded for this call, rendered canonically: kvdb/demo/tools.py) then the
    agent's turns; ``on_prompt(node, agent, tools, head, turns)`` runs after each call.
    """
    seed = cfg.seed
    heads = HeadRenderer(cfg)
    agents = ["planner", "reviewer"] + [f"worker{w}" for w in range(1, cfg.workers + 1)]
    history = {a: [_segment(f"role:{a}", cfg.role_tokens, seed)] for a in agents}  # turns after the head
    waits = tool_durations(cfg)
    end: dict[str, float] = {}

    def call(node: str, agent: str, new_input: list[int], now: float, hints: dict) -> list[int]:
        tools = tools_for(cfg, node, agent, int(re.search(r"\d+", node).group()))
        head = heads.head(tools)
        turns = history[agent] + [new_input]
        out, dur = llm(node, agent, head.token_ids + [t for turn in turns for t in turn], now, hints)
        if on_prompt is not None:
            on_prompt(node, agent, tools, head, turns)
        history[agent] = turns + [list(out)]
        end[node] = now + dur
        return list(out)

    review_out: list[int] = []
    for r in range(1, cfg.rounds + 1):
        t = end.get(f"review{r - 1}", 0.0)
        plan = call(f"plan{r}", "planner", review_out, t, {"expected_tool_duration_s": waits[f"search{r}"]})
        tool(f"search{r}", "planner", waits[f"search{r}"], end[f"plan{r}"])
        end[f"search{r}"] = end[f"plan{r}"] + waits[f"search{r}"]
        found = _segment(f"search{r}", cfg.tool_result_tokens, seed)
        for w in range(1, cfg.workers + 1):
            a, node = f"worker{w}", f"work{r}.{w}"
            call(node, a, plan + found, end[f"search{r}"], {"expected_tool_duration_s": waits[f"exec{r}.{w}"]})
            tool(f"exec{r}.{w}", a, waits[f"exec{r}.{w}"], end[node])
            end[f"exec{r}.{w}"] = end[node] + waits[f"exec{r}.{w}"]
        fixes: dict[int, list[int]] = {}
        for w in sorted(range(1, cfg.workers + 1), key=lambda w: (end[f"exec{r}.{w}"], w)):
            a = f"worker{w}"
            now = end[f"exec{r}.{w}"]
            if before_call is not None:
                before_call(f"fix{r}.{w}", a, history[a], now)
            fixes[w] = call(f"fix{r}.{w}", a, _segment(f"exec{r}.{w}", cfg.tool_result_tokens, seed), now, {})
        t = max(end[f"fix{r}.{w}"] for w in fixes)
        review_out = call(f"review{r}", "reviewer", [tok for w in sorted(fixes) for tok in fixes[w]], t, {})
    return end


def explain_spec(cfg: DemoConfig) -> dict:
    """The EXPLAIN input: the DAG plus every call's prompt size, from a dry run of ``drive``."""
    prompt_blocks: dict[str, int] = {}

    def llm(node, agent, prompt, now, hints):
        prompt_blocks[node] = len(prompt) // cfg.block_tokens
        return [0] * cfg.output_tokens, 2.0

    drive(cfg, llm, lambda *a: None)
    nodes = [dict(n, prompt_blocks=prompt_blocks[n["id"]]) if n["id"] in prompt_blocks else n
             for n in workflow_nodes(cfg)]
    return {"session_id": "demo", "nodes": nodes, "block_tokens": cfg.block_tokens,
            "shared_prefix_blocks": (cfg.system_tokens + cfg.schema_tokens) // cfg.block_tokens,
            "offload_after_s": cfg.offload_after_s}


# ---------------------------------------------------------------------------- the run


def fresh_data_dir(path: str | os.PathLike) -> Path:
    """An empty directory at ``path``: a previous demo's directory is emptied, anything else
    that is not empty is refused (the demo never deletes data it did not write)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise InvalidInput(f"{p} exists and is not a directory; pass another --data-dir")
        if (p / MARKER).exists():
            shutil.rmtree(p)
        elif any(p.iterdir()):
            raise InvalidInput(f"{p} is not empty and not a previous demo's directory; pass another --data-dir")
    p.mkdir(parents=True, exist_ok=True)
    (p / MARKER).write_text("written by `kvdb demo`; deleted and rewritten by the next run\n")
    return p


@dataclass
class CallRecord:
    node: str
    agent: str
    round: int
    prompt_tokens: int
    cached_tokens: int
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    ttft_without_s: float
    ttft_with_s: float
    first_token_same: bool
    saved_blocks: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Counters:
    calls: list = field(default_factory=list)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _tier_hits(db) -> tuple[int, int]:
    tiers = db.stats()["tiers"]
    return tiers.get("device", {}).get("hits", 0), tiers["host"]["hits"]


def run_demo(cfg: DemoConfig, log: Callable[[str], None] | None = None, live: bool = False) -> dict:
    """Run the demo; returns every figure (the CLI renders it or prints it as JSON)."""
    t_start = time.perf_counter()
    say = log or (lambda msg: None)
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        # one thread by default: on this small model a second one gains ~1.2x on an idle 2-core
        # machine, while on a busy one the two spin against each other and timings swing 5-10x
        torch.set_num_threads(cfg.threads)
    try:
        # no_grad, not inference_mode: the Db's arenas are created in here, and inference tensors
        # refuse in-place updates from the Db's background mover thread (outside the mode)
        with torch.no_grad():
            return _run(cfg, say, live, t_start)
    finally:
        torch.set_num_threads(threads_before)


def _run(cfg: DemoConfig, say, live: bool, t_start: float) -> dict:
    from kvdb.integrations.transformers import PrefixCache, layout_for

    data_dir = fresh_data_dir(cfg.data_dir)
    spec = explain_spec(cfg)
    n_calls = sum(1 for n in spec["nodes"] if n.get("kind", "llm") == "llm")
    model = tiny_llama(max_tokens=4096, seed=cfg.seed)
    layout = layout_for(model.config, block_tokens=cfg.block_tokens)
    _warm_up(model, layout)

    clock = [0.0]  # the virtual time (s): the Db's clock

    def advance(now: float) -> None:
        clock[0] = max(clock[0], now)  # workers of a round start together: time never goes back

    db = kvdb.open(data_dir / "db", layout=layout, model_id=MODEL_ID,
                   device_bytes=cfg.device_pages * layout.page_bytes, device="cpu",
                   host_bytes=cfg.host_pages * layout.page_bytes, disk_bytes=cfg.disk_bytes,
                   replacer="kvdb", clock=lambda: clock[0])
    plan = db.explain(spec)
    pc = PrefixCache(db, model, tenant="demo")
    ctr = _Counters()
    say(f"kvdb demo: {cfg.rounds} rounds x (planner -> {cfg.workers} workers -> reviewer), {n_calls} LLM calls; "
        f"tiers: device {cfg.device_pages} pages, host {cfg.host_pages} pages, disk; data in {data_dir}")
    # every agent's prompt starts with the system prompt and tool schemas: name that prefix by
    # the key of its last block, so the Db keeps it (and never offloads it with one agent's history)
    heads = HeadRenderer(cfg)
    shared_tokens = heads.head(tools_for(cfg, "plan1", "planner", 1)).token_ids
    prefix_keys = db.block_keys(shared_tokens, tenant="demo")
    prefix = {"prefix_hash": prefix_keys[-1].hex()} if prefix_keys else {}
    for agent in ["planner", "reviewer"] + [f"worker{w}" for w in range(1, cfg.workers + 1)]:
        db.begin_session(agent, tenant="demo", hints=prefix, now_s=0.0)

    bar = _LiveBar(n_calls) if live else None

    def llm(node, agent, prompt, now, hints):
        ids = torch.tensor([prompt], dtype=torch.long)
        # each prefill is timed twice (best of 2, baseline and kvdb alike): a single timing on
        # a shared machine is at the mercy of whatever else runs at that moment
        # without kvdb: the whole prompt
        base: list = []
        without_s = min(_timed(lambda: base.append(int(prefill(model, ids).logits[0, -1].argmax())))
                        for _ in range(2))
        first_base = base[0]
        # with kvdb: restore the longest stored prefix, prefill the rest
        advance(now)
        db.run_plans()
        ctx, _ = db.call_started(agent, agent_id=agent, hints=hints, now_s=now)
        dev0, host0 = _tier_hits(db)
        t0 = time.perf_counter()
        cache, n = pc.lookup(ids, ctx=ctx)
        lookup_s = time.perf_counter() - t0
        spare = copy.deepcopy(cache)  # a forward pass extends its cache in place
        suffix_a = _timed(lambda: prefill(model, ids[:, n:], spare))
        t0 = time.perf_counter()
        out = prefill(model, ids[:, n:], cache)
        with_s = lookup_s + min(suffix_a, time.perf_counter() - t0)
        del spare
        dev1, host1 = _tier_hits(db)
        nxt = out.logits[:, -1:].argmax(-1)
        first = int(nxt)
        produced = [first]
        cache = out.past_key_values
        for _ in range(cfg.output_tokens - 1):
            step = prefill(model, nxt, cache)
            cache = step.past_key_values
            nxt = step.logits[:, -1:].argmax(-1)
            produced.append(int(nxt))
        saved = pc.save(torch.tensor([prompt + produced]), cache, ctx=ctx)
        dur = time.perf_counter() - t0
        advance(now + dur)
        db.call_finished(agent, agent_id=agent, now_s=now + dur)
        dev, host = dev1 - dev0, host1 - host0
        bt = cfg.block_tokens
        rec = CallRecord(node=node, agent=agent, round=int(re.search(r"\d+", node).group()),
                         prompt_tokens=len(prompt), cached_tokens=n, device_tokens=dev * bt, host_tokens=host * bt,
                         disk_tokens=max(0, n - (dev + host) * bt), ttft_without_s=without_s, ttft_with_s=with_s,
                         first_token_same=first == first_base, saved_blocks=saved)
        ctr.calls.append(rec)
        line = (f"[{len(ctr.calls):2d}/{n_calls}] {node:<10} {agent:<9} prompt {len(prompt):5d} tok, "
                f"cached {n:5d} (dev {rec.device_tokens}, host {rec.host_tokens}, disk {rec.disk_tokens}); "
                f"TTFT {without_s * 1e3:6.1f} ms -> {with_s * 1e3:6.1f} ms")
        if bar is not None:
            bar.advance(line)
        else:
            say(line)
        return produced, dur

    def tool(node, agent, duration, now):
        advance(now)
        db.hint(agent, expected_tool_duration_s=duration, now_s=now)

    def before_call(node, agent, previous_prompt, now):
        # the tool returns: time has passed, and with it the Db's planned moves came due
        advance(now)
        db.run_plans()

    def on_prompt(node, agent, tools, head, turns):
        # the prompt as sent (canonical head) counts in the Db's break accounting; the same
        # prompt with the tools rendered raw, in the order they arrived, on the side
        db.note_prompt(heads.prompt(head, turns), session_id=agent, tenant="demo")
        heads.observe_raw(db, agent, tools, turns)

    try:
        drive(cfg, llm, tool, before_call, on_prompt)
        stats = db.stats()
    finally:
        if bar is not None:
            bar.close()
        db.close()
    res = _summarize(cfg, ctr, stats, plan, data_dir)
    keep = ("calls", "breaks", "tokens", "shared_tokens", "tokens_lost")
    res["cache_breaks"] = {"tool_orders": len(heads.orders), "tool_change_round": cfg.tool_change_round,
                           "canonical": {k: stats["prompts"][k] for k in keep},
                           "raw": {k: heads.raw.stats()[k] for k in keep}}
    from kvdb.demo.chart import write_chart

    chart = Path(cfg.chart_path) if cfg.chart_path is not None else data_dir / "ttft.png"
    write_chart(res["calls"], chart)
    res["chart"] = str(chart)
    res["wall_s"] = round(time.perf_counter() - t_start, 2)
    return res


def _warm_up(model, layout) -> None:
    """First calls of a forward path pay one-time costs (thread pools, allocator, lazy init);
    run both paths the demo times once, so that call 1's figures are not about them."""
    from kvdb.integrations.transformers import cache_from_blocks

    ids = torch.zeros((1, 1024), dtype=torch.long)
    prefill(model, ids)
    blocks = torch.zeros((56, *layout.block_shape), dtype=layout.dtype)
    prefill(model, ids[:, 56 * layout.block_tokens:], cache_from_blocks(model.config, blocks))


def _summarize(cfg, ctr: _Counters, stats: dict, plan: dict, data_dir: Path) -> dict:
    calls = [c.as_dict() for c in ctr.calls]
    tot_without = sum(c["ttft_without_s"] for c in calls)
    tot_with = sum(c["ttft_with_s"] for c in calls)
    prompt = sum(c["prompt_tokens"] for c in calls)
    tiers = {}
    for name, t in stats["tiers"].items():
        keep = ("pages", "capacity_pages", "evictions", "demotions", "promotions", "puts", "bytes", "log_bytes")
        tiers[name] = {k: t[k] for k in keep if k in t}
    return {
        "data_dir": str(data_dir),
        "model": "random-weight Llama, 4 layers, hidden 256, 4 heads, 2 kv heads, fp32, CPU",
        "rounds": cfg.rounds,
        "workers": cfg.workers,
        "llm_calls": len(calls),
        "prompt_tokens": prompt,
        "hit_tokens": {
            "device": sum(c["device_tokens"] for c in calls),
            "host": sum(c["host_tokens"] for c in calls),
            "disk": sum(c["disk_tokens"] for c in calls),
            "recomputed": prompt - sum(c["cached_tokens"] for c in calls),
        },
        "ttft_without_kvdb_s": tot_without,
        "ttft_with_kvdb_s": tot_with,
        "ttft_speedup": tot_without / tot_with if tot_with else None,
        "first_tokens_identical": sum(c["first_token_same"] for c in calls),
        "prefetched_blocks": stats["plans"]["planned_prefetch_blocks"],
        "prefetch_s": stats["plans"]["planned_prefetch_s"],
        "plans": stats["plans"],
        "hint_outcomes": dict(stats["hints"]),
        "tiers": tiers,
        "explain": plan,
        "calls": calls,
    }


class _LiveBar:
    """A rich progress bar on stderr with the latest call's line under it."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(TextColumn("kvdb demo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           console=Console(stderr=True))
        self._task = self._p.add_task("calls", total=total)
        self._p.start()

    def advance(self, line: str) -> None:
        self._p.console.print(line, highlight=False)
        self._p.advance(self._task)

    def close(self) -> None:
        self._p.stop()


def render(res: dict, console) -> None:
    """Terminal rendering of a demo run."""
    from rich import box
    from rich.table import Table

    from kvdb.planner.explain import render as render_explain

    if not console.is_terminal:  # piped: no terminal width to respect, keep rows on one line
        console.width = max(console.width, 132)
    console.print("[bold]EXPLAIN[/] (the planner's plan for the workflow)")
    console.print(render_explain(res["explain"]), highlight=False, soft_wrap=True)
    t = Table(title="per call: tokens by tier; TTFT in ms, full prefill vs kvdb; same first token",
              box=box.SIMPLE_HEAD, padding=(0, 1))
    for name in ("call", "prompt", "cached", "dev/host/disk", "full", "kvdb", "speedup", "same"):
        t.add_column(name, no_wrap=True, justify="left" if name == "call" else "right")
    for c in res["calls"]:
        t.add_row(c["node"], str(c["prompt_tokens"]), str(c["cached_tokens"]),
                  f"{c['device_tokens']}/{c['host_tokens']}/{c['disk_tokens']}", f"{c['ttft_without_s'] * 1e3:.1f}",
                  f"{c['ttft_with_s'] * 1e3:.1f}", f"{c['ttft_without_s'] / c['ttft_with_s']:.2f}x",
                  "yes" if c["first_token_same"] else "NO")
    console.print(t)
    h = res["hit_tokens"]
    console.print(f"hit tokens per tier: device {h['device']}, host {h['host']}, disk {h['disk']}; "
                  f"recomputed {h['recomputed']} of {res['prompt_tokens']} prompt tokens")
    console.print(f"TTFT total: {res['ttft_without_kvdb_s']:.2f} s without kvdb, {res['ttft_with_kvdb_s']:.2f} s with "
                  f"kvdb ({res['ttft_speedup']:.2f}x); first tokens identical in "
                  f"{res['first_tokens_identical']}/{res['llm_calls']} calls")
    p = res["plans"]
    console.print(f"the engine prefetched {res['prefetched_blocks']} blocks during tool waits "
                  f"({res['prefetch_s'] * 1e3:.1f} ms; offloaded {p['planned_offload_blocks']}); "
                  f"{p['planned_prefetch_hits']} of {p['planned_prefetch_hits'] + p['planned_prefetch_misses']} "
                  f"blocks on the device when the calls came, {p['late_prefetches']} late; "
                  f"hints: {res['hint_outcomes']}")
    tiers = Table("tier", "pages", "capacity", "evictions", "demotions", "promotions", title="tiers at the end",
                  box=box.SIMPLE_HEAD)
    for name, tt in res["tiers"].items():
        tiers.add_row(name, str(tt.get("pages", "")), str(tt.get("capacity_pages", "")), str(tt.get("evictions", "")),
                      str(tt.get("demotions", "")), str(tt.get("promotions", "")))
    console.print(tiers)
    cb = res["cache_breaks"]
    canon, raw = cb["canonical"], cb["raw"]
    change = f", worker1 gained a tool in round {cb['tool_change_round']}" if cb["tool_change_round"] else ""
    console.print(f"cache breaks (tools loaded per call, {cb['tool_orders']} orders seen{change}): canonical render "
                  f"{canon['breaks']} breaks, {canon['tokens_lost']} tokens lost; a raw render would have broken "
                  f"{raw['breaks']} of {raw['calls']} calls, losing {raw['tokens_lost']} tokens")
    console.print(f"chart: {res.get('chart')}   data: {res['data_dir']}   wall {res['wall_s']} s")
