"""``kvdb sim``, ``kvdb gen``, ``kvdb explain``: replay traces, generate agent workflows, show plans."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext

import click

from kvdb.errors import InvalidInput
from kvdb.cli.output import FiniteRange, writable_file
from kvdb.sim.shapes import PRESETS


def _progress(total: int, enabled: bool):
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import Progress

    class _Bar:
        def __init__(self) -> None:
            self.p = Progress(transient=True, console=Console(stderr=True))  # data stays on stdout

        def __enter__(self):
            self.p.__enter__()
            self.task = self.p.add_task("replay", total=total)
            return lambda n: self.p.advance(self.task, n)

        def __exit__(self, *exc):
            return self.p.__exit__(*exc)

    return _Bar()


@click.command("sim")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--policy", "policies", multiple=True, required=True,
              help="lru, lfu, arc, kvflow, tokencake, kvdb, belady (repeatable)")
@click.option("--capacity", "capacities", type=click.IntRange(min=1), multiple=True,
              help="device capacity in blocks (repeatable)")
@click.option("--capacity-fraction", "fractions", type=FiniteRange(0, 1, min_open=True), multiple=True,
              help="capacity as a share of the trace's distinct blocks (repeatable)")
@click.option("--timed", is_flag=True, help="timed replay (TTFT, job completion time) instead of hit ratios")
@click.option("--host-factor", type=FiniteRange(min=0), default=4.0, show_default=True,
              help="--timed: host tier capacity as a multiple of the device capacity")
@click.option("--disk-factor", type=FiniteRange(min=0), default=0.0, show_default=True,
              help="--timed: disk tier capacity as a multiple of the device capacity (0: no disk tier)")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list, one object per (policy, capacity)")
@click.option("--per-request-out", type=click.Path(dir_okay=False), callback=writable_file("the per-request lines"),
              help="write one JSON line per (policy, capacity, call), calls in trace order: its hit blocks")
@click.option("--plot", type=click.Path(dir_okay=False), callback=writable_file("the plot"), help="draw hit ratio against capacity per policy (PNG)")
def sim_cmd(trace, policies, capacities, fractions, timed, host_factor, disk_factor, as_json, per_request_out, plot):
    """Replay TRACE (Mooncake or kvdb JSONL) under each policy and capacity."""
    from kvdb.planner.policies import POLICIES
    from kvdb.sim.replay import capacity_for, replay
    from kvdb.sim.trace import read_trace

    for p in policies:
        if p not in POLICIES:
            raise click.UsageError(f"unknown policy {p!r}; one of {', '.join(sorted(POLICIES))}")
    if not capacities and not fractions:
        raise click.UsageError("give --capacity N or --capacity-fraction F")
    if timed and (plot or per_request_out):
        raise click.UsageError("--plot and --per-request-out are for hit ratios; --timed reports TTFT and JCT")
    try:
        t = read_trace(trace)
    except UnicodeDecodeError as e:
        raise InvalidInput(f"trace {trace!r} is not a text file (byte {e.start} is not UTF-8); "
                           "expected Mooncake or kvdb JSONL") from None
    if not t.calls:
        raise InvalidInput(f"trace {trace!r} holds no calls (an empty trace); nothing to replay")
    caps = list(capacities) + [capacity_for(t, f) for f in fractions]
    rows = []
    show = sys.stderr.isatty() and not as_json
    if timed:
        from kvdb.sim.timed import timed_replay

        for c in caps:
            for p in policies:
                rows.append(timed_replay(t, p, c, int(c * host_factor), disk_blocks=int(c * disk_factor)).as_dict())
    else:
        out = open(per_request_out, "w", encoding="utf-8") if per_request_out else None
        try:
            for c in caps:
                for p in policies:
                    with _progress(len(t.calls), show) as adv:
                        sink = None
                        if out:
                            def sink(d, p=p, c=c):
                                out.write(json.dumps({"policy": p, "capacity_blocks": c, **d}, separators=(",", ":")) + "\n")
                        rows.append(replay(t, p, c, per_request=sink, progress=adv).as_dict())
        finally:
            if out:
                out.close()
    if plot:
        _plot(rows, plot)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if timed:
        click.echo(f"{'policy':<10} {'device':>7} {'host':>7} {'disk':>7} {'ttft_mean_s':>12} {'ttft_p99_s':>11} {'jct_mean_s':>11} {'jct_p99_s':>10}")
        for r in rows:
            click.echo(f"{r['policy']:<10} {r['device_blocks']:>7} {r['host_blocks']:>7} {r['disk_blocks']:>7} {r['ttft_mean_s']:>12.4f} "
                       f"{r['ttft_p99_s']:>11.4f} {r['jct_mean_s']:>11.3f} {r['jct_p99_s']:>10.3f}")
        return
    click.echo(f"{'policy':<10} {'capacity':>9} {'requests':>9} {'accesses':>9} {'hits':>8} {'block_hit':>9} {'token_hit':>9} {'us/access':>9}")
    for r in rows:
        click.echo(f"{r['policy']:<10} {r['capacity_blocks']:>9} {r['requests']:>9} {r['accesses']:>9} {r['hits']:>8} "
                   f"{r['block_hit_ratio']:>9.4f} {r['token_hit_ratio']:>9.4f} {r['policy_us_per_access']:>9.2f}")


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity_blocks"], r["block_hit_ratio"]) for r in rows if r["policy"] == p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit ratio")
    ax.set_xscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@click.command("gen")
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), help="JSON parameters (tools/workflows/agents.json)")
@click.option("--seed", type=int, help="override the seed")
@click.option("--sessions", type=click.IntRange(min=1), help="override the number of sessions")
@click.option("--no-hints", is_flag=True, help="emit no hints")
@click.option("--hint-noise", type=FiniteRange(min=0), help="sigma of the hints' log-normal noise")
@click.option("--prompts", is_flag=True,
              help="write a prompt trace instead (MCP-like tools and messages: kvdb/sim/prompt_gen.py)")
@click.option("--tool-order-churn", type=FiniteRange(0, 1), help="--prompts: probability per call that the tool lists arrive reordered")
@click.option("--json-key-noise", type=FiniteRange(0, 1), help="--prompts: probability per call of a random key order in every JSON object")
@click.option("--tool-list-change", type=FiniteRange(0, 1),
              help="probability that a tool is added or removed: with --prompts per call; otherwise per session, "
                   "once, at the start of a round after the first (default 0)")
@click.option("--shape", type=click.Choice(sorted(PRESETS)),
              help="a preset of workload shapes (kvdb/sim/shapes.py); the options below override it")
@click.option("--chain-breaks", type=FiniteRange(0, 1),
              help="probability per call that shared context is inserted before the agent's own history (default 0)")
@click.option("--apps", type=click.IntRange(min=0),
              help="applications, each with system prompts and a tool-schema block shared by its sessions (default 0: off)")
@click.option("--app-tool-blocks", type=click.IntRange(min=0),
              help="--apps: blocks of each app's tool-schema block (default 16)")
@click.option("--react/--no-react", default=None,
              help="worker and reviewer nodes as ReAct loops of 1-4 calls, tool waits of median 0.3 / 2 / 15 s "
                   "between (default off)")
@click.option("--wait-tail", type=click.Choice(["lognormal", "pareto"]),
              help="--react: the tail of the tool waits (default lognormal)")
@click.option("--namespaced-agents/--plain-agents", default=None,
              help="calls name their agent ns/<session>/<agent>, workflow nodes <agent> (default plain)")
@click.option("--hint-scale", type=FiniteRange(0, min_open=True),
              help="wrong hints: every declared tool duration times this factor (default 1)")
@click.option("--hint-shuffle", is_flag=True, default=None,
              help="wrong hints: the declared tool durations permuted across the trace")
@click.option("--wrong-workflow", type=FiniteRange(0, 1),
              help="wrong hints: probability per session that its workflow declares phantom workers and a phantom "
                   "round (default 0)")
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False), required=True,
              callback=writable_file("the trace"), help="trace file to write")
@click.option("--json", "as_json", is_flag=True, help="print a JSON summary")
def gen_cmd(params_path, seed, sessions, no_hints, hint_noise, prompts, tool_order_churn, json_key_noise,
            tool_list_change, shape, chain_breaks, apps, app_tool_blocks, react, wait_tail, namespaced_agents,
            hint_scale, hint_shuffle, wrong_workflow, out_path, as_json):
    """Generate a seeded agent-workflow trace (fan-out / fan-in DAGs, tool waits, hints, and the
    workload shapes of kvdb/sim/shapes.py), or with --prompts a prompt trace with tool-order
    churn, JSON key-order noise and tool-list changes."""
    noise = dict(tool_order_churn=tool_order_churn, json_key_noise=json_key_noise)
    shapes = dict(chain_break_prob=chain_breaks, apps=apps, app_tool_schema_blocks=app_tool_blocks, react=react,
                  react_wait_tail=wait_tail, namespaced_agent_ids=namespaced_agents, hint_scale=hint_scale,
                  hint_shuffle=hint_shuffle, wrong_workflow_prob=wrong_workflow)
    if prompts:
        if no_hints or hint_noise is not None:
            raise click.UsageError("--no-hints and --hint-noise are for workflow traces, not --prompts")
        if shape is not None or any(v is not None for v in shapes.values()):
            raise click.UsageError("--shape and the workload shape options are for workflow traces, not --prompts")
        from kvdb.sim.prompt_gen import load_params, write_trace

        p = load_params(params_path, seed=seed, sessions=sessions, tool_list_change=tool_list_change, **noise)
    else:
        given = [k.replace("_", "-") for k, v in noise.items() if v is not None]
        if given:
            raise click.UsageError(f"--{', --'.join(given)} {'needs' if len(given) == 1 else 'need'} --prompts "
                                   "(noise shapes prompt traces)")
        from kvdb.sim.generator import load_params, write_trace

        p = load_params(params_path, shape=shape, seed=seed, sessions=sessions, hints=False if no_hints else None,
                        hint_noise_sigma=hint_noise, tool_list_change_prob=tool_list_change, **shapes)
    try:
        n = write_trace(p, out_path)
    except OSError as e:
        raise InvalidInput(f"cannot write the trace to {out_path!r}: {e.strerror or e}") from None
    if as_json:
        click.echo(json.dumps({"out": out_path, "lines": n, "params": p}, indent=2))
    else:
        click.echo(f"wrote {n} lines to {out_path}")


@click.command("explain")
@click.argument("workflow", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the plan tree as JSON")
def explain_cmd(workflow, as_json):
    """Show the plan for WORKFLOW.json: per node, reuse and tier, prefetch deadlines, prefill saved."""
    from kvdb.errors import NotFound
    from kvdb.planner.explain import explain, render

    try:
        with open(workflow, encoding="utf-8") as f:
            spec = json.load(f)
    except FileNotFoundError:
        raise NotFound(f"workflow file {workflow!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{workflow}: malformed JSON ({e.msg} at line {e.lineno})") from None
    plan = explain(spec)
    click.echo(json.dumps(plan, indent=2) if as_json else render(plan))


def register(cli: click.Group) -> None:
    cli.add_command(sim_cmd)
    cli.add_command(gen_cmd)
    cli.add_command(explain_cmd)
