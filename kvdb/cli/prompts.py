"""``kvdb bench cache-break``: prefix-cache hit rates under tool-order churn, JSON key-order noise
and tool-list changes, rendered raw, canonically and in first-seen order (kvdb/bench/cache_break.py).

Needs the ``tokenizers`` package (installed with the ``transformers`` extra): the bench trains a
byte-level BPE locally; nothing is downloaded.
"""

from __future__ import annotations

import click

from kvdb.cli.output import emit, json_option, progress


def _render_table(res: dict, console) -> None:
    from rich.table import Table

    t = Table("level", "clean", "raw", "canonical", "first_seen", "canonical / clean", "breaks raw", "breaks canonical",
              title=f"hit rate, seeds {', '.join(map(str, res['seeds']))}")
    for lv in res["levels"]:
        t.add_row(lv, *(f"{res[f'hit_rate_{m}'][lv]:.4f}" for m in ("clean", "raw", "canonical", "first_seen")),
                  f"{res['canonical_vs_clean_min'][lv]:.4f}", f"{res['breaks_per_call']['raw'][lv]:.3f}",
                  f"{res['breaks_per_call']['canonical'][lv]:.3f}")
    console.print(t)
    console.print(f"render {res['render_ms_per_call']:.3f} ms + block keys {res['block_keys_ms_per_call']:.3f} ms "
                  f"per call; tokenizer {res['tokenizer_ms_per_call']:.3f} ms for the same text: "
                  f"{res['render_keys_vs_tokenizer']:.3f} x (goal <= 0.5)")


@click.command("cache-break")
@click.option("--seed", "seeds", type=int, multiple=True, help="workload seed (repeatable; default 41 42 43)")
@click.option("--level", "levels", multiple=True, help="noise level: low, mid, high, max (repeatable; default all)")
@click.option("--sessions", type=click.IntRange(min=1), help="sessions per workload (default 10)")
@click.option("--calls", type=click.IntRange(min=1), help="calls per session (default 20)")
@click.option("--block-tokens", type=click.IntRange(min=1), default=16, show_default=True, help="tokens per KV block")
@json_option
def bench_cache_break_cmd(seeds, levels, sessions, calls, block_tokens, as_json) -> None:
    """Hit rate of a noisy MCP-like workload: clean / raw / canonical / first-seen rendering,
    breaks per call, and render + keys time next to the tokenizer's for the same text.

    Goals: canonical >= 0.95 x clean at every level; render + keys <= 0.5 x tokenizer.
    """
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise click.UsageError("this command needs the tokenizers package: pip install 'kvdb[transformers]'") from None
    from kvdb.bench.cache_break import DEFAULT_SEEDS, LEVELS, MODES, bench_cache_break

    levels = tuple(levels) or tuple(LEVELS)
    for lv in levels:
        if lv not in LEVELS:
            raise click.BadParameter(f"{lv!r}; one of {', '.join(LEVELS)}", param_hint="--level")
    seeds = tuple(seeds) or DEFAULT_SEEDS
    with progress(len(seeds) * len(levels) * len(MODES), "bench cache-break", enabled=not as_json) as advance:
        res = bench_cache_break(seeds=seeds, levels=levels, sessions=sessions, calls=calls, block_tokens=block_tokens,
                                progress=advance)
    emit(res, as_json, None if as_json else _render_table)


def register(cli: click.Group) -> None:
    cli.commands["bench"].add_command(bench_cache_break_cmd)
