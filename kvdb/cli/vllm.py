"""``kvdb bench vllm``: TTFT in a real vLLM with kvdb as its KV connector (kvdb/bench/vllm.py).

Needs vLLM (``make install-vllm`` installs the CPU build); the import happens inside the command
so that ``kvdb --help`` stays fast and works without it.
"""

from __future__ import annotations

import click

from kvdb.cli.output import FiniteRange, emit, json_option, progress


@click.command("vllm")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=8192, show_default=True, help="prompt length (tokens)")
@click.option("--stored-fraction", default=7 / 8, show_default=True, type=FiniteRange(0, 1),
              help="share of the prompt seen before (rounded down to whole 128-token blocks)")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="rounds; each figure is the median")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="default: a temporary directory")
@json_option
def bench_vllm_cmd(prompt_tokens: int, stored_fraction: float, repeats: int, data_dir: str | None, as_json: bool) -> None:
    """TTFT of one long prompt: recompute vs vLLM's own prefix cache vs kvdb's host and disk tiers.

    Goals: kvdb_host_s <= 1.25 x vllm_prefix_hit_s, kvdb_disk_s <= 2 x vllm_prefix_hit_s,
    recompute_s / kvdb_host_s >= 3.
    """
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise click.UsageError("this command needs vLLM: make install-vllm (the CPU build)") from None
    if repeats < 1:
        raise click.BadParameter("must be >= 1", param_hint="--repeats")
    if not 0 < stored_fraction < 1:
        raise click.BadParameter("must be between 0 and 1", param_hint="--stored-fraction")
    if prompt_tokens < 512:
        raise click.BadParameter("must be >= 512", param_hint="--prompt-tokens")
    from kvdb.bench.vllm import bench_vllm

    with progress(2, "bench vllm", enabled=not as_json) as advance:
        res = bench_vllm(prompt_tokens=prompt_tokens, stored_fraction=stored_fraction, repeats=repeats,
                         data_dir=data_dir, progress=advance)
    emit(res, as_json)


@click.command("vllm-agents")
@click.option("--quick", is_flag=True, help="the smallest size: one short session of two kinds, a 2-layer model")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="rounds of every configuration, interleaved")
@click.option("--seed", type=int, default=None, help="the workload's seed")
@click.option("--sessions", type=click.IntRange(min=0), default=None,
              help="sessions of each kind (kvdb gen, agentic-mix, SWE-agent-like)")
@click.option("--pool-blocks", type=click.IntRange(min=4), default=None, help="vLLM's KV pool (P blocks)")
@click.option("--host-blocks", type=click.IntRange(min=1), default=None,
              help="kvdb's host tier (H, in blocks; apc_equal gives them to vLLM instead)")
@click.option("--time-scale", type=FiniteRange(0, None), default=None, help="tool waits and think times times this")
@click.option("--config", "configs", multiple=True, help="only these configurations (repeatable)")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="default: a temporary directory")
@json_option
def bench_vllm_agents_cmd(quick, repeats, seed, sessions, pool_blocks, host_blocks, time_scale, configs, data_dir,
                          as_json) -> None:
    """Agent sessions through vLLM's OpenAI server: APC alone, APC with kvdb's memory, kvdb (lru,
    hints, disk), and after a restart. Reports TTFT, total time and where prompt tokens came from.
    """
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise click.UsageError("this command needs vLLM: make install-vllm (the CPU build)") from None
    import dataclasses

    from kvdb.bench.vllm_agents import CONFIGS, FULL, QUICK, bench_vllm_agents

    for c in configs:
        if c not in CONFIGS:
            raise click.BadParameter(f"unknown configuration {c!r}; one of {', '.join(CONFIGS)}", param_hint="--config")
    sz = QUICK if quick else FULL
    over = {"repeats": repeats, "seed": seed, "pool_blocks": pool_blocks, "host_blocks": host_blocks,
            "time_scale": time_scale}
    if sessions is not None:
        over.update(gen_sessions=sessions, mix_sessions=sessions if not quick else 0, swe_sessions=sessions)
    sz = dataclasses.replace(sz, **{k: v for k, v in over.items() if v is not None})
    todo = tuple(configs) or CONFIGS
    steps = sz.repeats * (len(todo) + sum(c in ("apc_equal", "kvdb_hints", "kvdb_disk") for c in todo))
    with progress(steps, "bench vllm-agents", enabled=not as_json) as advance:
        res = bench_vllm_agents(sz, configs=todo, data_dir=data_dir, progress=advance)
    emit(res, as_json)


def register(cli: click.Group) -> None:
    cli.commands["bench"].add_command(bench_vllm_cmd)
    cli.commands["bench"].add_command(bench_vllm_agents_cmd)
