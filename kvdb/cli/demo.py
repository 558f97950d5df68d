"""``kvdb demo`` (the worked example: agents on a real model, kvdb managing tiers) and
``kvdb bench ttft`` (time to first token with and without kvdb).

Both need the ``transformers`` extra (``pip install 'kvdb[transformers]'``); the heavy imports
happen inside the commands so that ``kvdb --help`` stays fast.
"""

from __future__ import annotations

import sys

import click

from kvdb.cli.output import FiniteRange, emit, json_option, progress, writable_file


def _need_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise click.UsageError("this command needs transformers: pip install 'kvdb[transformers]'") from None


@click.command("ttft")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=8192, show_default=True, help="prompt length")
@click.option("--stored-fraction", default=7 / 8, show_default=True, type=FiniteRange(0, 1), help="share of the prompt stored")
@click.option("--block-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="rounds; each figure is the best round")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="default: a temporary directory")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch intra-op threads (default: torch's choice)")
@json_option
def bench_ttft_cmd(prompt_tokens: int, stored_fraction: float, block_tokens: int, repeats: int,
                   data_dir: str | None, threads: int | None, as_json: bool) -> None:
    """TTFT of a long prompt: full prefill vs restoring the stored part from host / disk + suffix prefill.

    ideal_speedup = full / suffix prefill (a cache already in memory); host_speedup and
    disk_speedup = full / (kvdb lookup + suffix prefill). Goal: host_speedup >= 0.9 x ideal.
    """
    _need_transformers()
    from kvdb.demo.ttft import bench_ttft

    if repeats < 1:
        raise click.BadParameter("must be >= 1", param_hint="--repeats")
    if threads is not None:
        if threads < 1:
            raise click.BadParameter("must be >= 1", param_hint="--threads")
        import torch

        torch.set_num_threads(threads)
    with progress(repeats, "bench ttft", enabled=not as_json) as advance:
        res = bench_ttft(prompt_tokens_n=prompt_tokens, stored_fraction=stored_fraction, block_tokens=block_tokens,
                         repeats=repeats, data_dir=data_dir, progress=advance)
    emit(res, as_json)


@click.command("demo")
@click.option("--data-dir", type=click.Path(file_okay=False), default="kvdb-demo", show_default=True,
              help="a fresh data directory (emptied first if it holds a previous demo)")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="planner -> workers -> reviewer rounds")
@click.option("--workers", type=click.IntRange(min=1), default=3, show_default=True, help="parallel worker agents per round")
@click.option("--chart", "chart_path", type=click.Path(dir_okay=False), default=None, callback=writable_file("the chart"),
              help="PNG chart path (default: DATA_DIR/ttft.png)")
@click.option("--output-tokens", type=click.IntRange(min=1), default=16, show_default=True, help="tokens each call decodes")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True,
              help="torch intra-op threads (0: torch's choice); one keeps timings stable on busy machines")
@click.option("--seed", default=0, show_default=True)
@json_option
def demo_cmd(data_dir: str, rounds: int, workers: int, chart_path: str | None, output_tokens: int, threads: int,
             seed: int, as_json: bool) -> None:
    """Run a multi-agent workflow on a small random-weight model with kvdb managing its KV tiers.

    Planner -> parallel workers -> reviewer, several rounds with tool waits, under tight
    device / host capacity with a disk tier below. Prints per-call TTFT with and without
    kvdb, hit tokens per tier, the workflow's EXPLAIN, and writes a PNG chart.
    """
    _need_transformers()
    from kvdb.demo.agents import DemoConfig, render, run_demo

    cfg = DemoConfig(data_dir=data_dir, rounds=rounds, workers=workers, chart_path=chart_path,
                     output_tokens=output_tokens, seed=seed, threads=threads or None)
    live = not as_json and sys.stderr.isatty()
    res = run_demo(cfg, log=(lambda msg: click.echo(msg, err=True)) if not as_json else None, live=live)
    emit(res, as_json, render)


def register(cli: click.Group) -> None:
    cli.add_command(demo_cmd)
    cli.commands["bench"].add_command(bench_ttft_cmd)
