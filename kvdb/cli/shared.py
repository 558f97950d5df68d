"""``kvdb bench shared``: the shared tier's batched puts and gets against the Mooncake Store's own
calls on the same bytes, in one run (kvdb/bench/shared.py; issue 43 item 6)."""

from __future__ import annotations

import click

from kvdb.cli.output import emit, json_option, progress


@click.command("shared")
@click.option("--dir", "dir_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="where the two Dbs' directories go (default: the system temp dir)")
@click.option("--pages", type=click.IntRange(min=1, max=1024), default=32, show_default=True,
              help="2 MiB pages per batch (one put_blocks, one get_blocks)")
@click.option("--repeats", type=click.IntRange(min=1), default=4, show_default=True,
              help="timed rounds, after one warm-up; figures are their medians")
@click.option("--vllm/--no-vllm", "with_vllm", default=None,
              help="also time two vLLM engines sharing the pool (default: on when vLLM imports)")
@click.option("--vllm-prompt-tokens", type=click.IntRange(min=512), default=8192, show_default=True,
              help="the engines' prompt length (tokens; the first 7/8, in whole 128-token blocks, is the prefix)")
@click.option("--vllm-repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="vLLM rounds (each a fresh prefix); figures are their medians")
@json_option
def bench_shared_cmd(dir_path, pages, repeats, with_vllm, vllm_prompt_tokens, vllm_repeats, as_json) -> None:
    """Batch put (put_blocks + flush, published) and batch get (match_prefix + get_blocks on a Db
    that never saw the blocks) of 2 MiB pages through a private Mooncake pool, vs the Store's
    batch_put_from / batch_get_into of the same bytes from registered memory. With --vllm (the
    default when vLLM imports), also the "vllm" figures: TTFT of a second vLLM engine loading a
    prefix from the pool vs the first engine's recompute (goal >= 3x faster) and its own prefix
    hit (goal <= 1.5x). Needs the Mooncake wheel and a private network namespace (root): the
    Store listens on 0.0.0.0."""
    from kvdb.bench.shared import bench_shared

    if with_vllm is None:
        with_vllm = _vllm_imports()
    elif with_vllm and not _vllm_imports():
        raise click.UsageError("--vllm needs vLLM: make install-vllm (the CPU build)")
    with progress(repeats + 1 + 2 * with_vllm, "bench shared", enabled=not as_json) as advance:
        res = bench_shared(pages=pages, repeats=repeats, dir_path=dir_path, progress=advance, vllm=with_vllm,
                           vllm_prompt_tokens=vllm_prompt_tokens, vllm_repeats=vllm_repeats)
    emit(res, as_json)


def _vllm_imports() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def register(cli: click.Group) -> None:
    cli.commands["bench"].add_command(bench_shared_cmd)
