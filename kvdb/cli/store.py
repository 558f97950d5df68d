"""Store commands: ``kvdb stats`` and the ``kvdb bench`` group with ``datapath`` and ``keys``.

Other modules attach more benchmarks to the ``bench`` group (cold, ttft, replication).
"""

from __future__ import annotations



import click

from kvdb.cli.output import emit, json_option


@click.command("stats")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@json_option
def stats_cmd(path: str, as_json: bool) -> None:
    """Show per-tier pages, bytes, hits, misses and evictions of the Db at PATH. Read-only: writes
    nothing, works while an engine has the Db open (its view: the log as of now, taken again when
    the engine's compaction deleted files under it) and on a read-only copy. It opens no shared
    tier: the pool's figures are the engine's own (``db.stats()["shared"]``, its Prometheus
    collector)."""
    from kvdb.cold.view import stable
    from kvdb.db import Db

    def attempt() -> dict:
        with Db(path, host_bytes=_one_page(path), read_only=True) as db:
            return db.stats()

    emit(stable(path, attempt), as_json, _render_stats)  # a live writer's GC meanwhile: look again


def _one_page(path: str) -> int:
    from kvdb.format.layout import BlockLayout
    from kvdb.errors import InvalidInput
    from kvdb.format.manifest import read_manifest

    m = read_manifest(path)
    if m is None:
        raise InvalidInput(f"{path} is not a kvdb data directory (no MANIFEST.json)")
    return BlockLayout.from_dict(m["layout"]).page_bytes


def _render_stats(s: dict, console) -> None:
    from rich.table import Table

    console.print(f"model [bold]{s['model_id']}[/]  layout {s['layout']}  page {s['page_bytes']} B")
    cols = ["pages", "capacity_pages", "bytes", "hits", "misses", "evictions"]
    t = Table("tier", *cols)
    for name, tier in s["tiers"].items():
        t.add_row(name, *[str(tier.get(c, "")) for c in cols])
    console.print(t)
    shared = s.get("shared")  # a Db open with shared= (kvdb stats PATH opens read-only: no pool)
    if shared:
        console.print("shared " + "  ".join(f"{k} {shared[k]}" for k in SHARED_SHOWN if k in shared))


#: the shared tier's figures a stats table shows (docs/shared.md "Counters")
SHARED_SHOWN = ("hits", "misses", "puts", "put_bytes", "get_bytes", "dropped_puts", "dropped_full", "corruptions",
                "deadline_misses", "breaker")


@click.group("bench")
def bench() -> None:
    """Benchmarks; each prints its figure next to a baseline measured in the same run."""


@bench.command("datapath")
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True, help="blocks per put / get")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--meta-blocks", type=click.IntRange(min=0), default=1_000_000, show_default=True, help="tiny blocks resident for the metadata figure")
@json_option
def bench_datapath(batch: int, repeats: int, meta_blocks: int, as_json: bool) -> None:
    """Host-tier put / get of 2 MiB blocks vs torch copy_ of the same bytes; metadata bytes per block."""
    from kvdb.bench.datapath import bench_bandwidth, bench_metadata

    res = bench_bandwidth(batch=batch, repeats=repeats)
    if meta_blocks:
        res.update(bench_metadata(meta_blocks))
    emit(res, as_json)


@bench.command("keys")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=131072, show_default=True)
@click.option("--block-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@json_option
def bench_keys_cmd(prompt_tokens: int, block_tokens: int, as_json: bool) -> None:
    """Block keys for a long prompt vs hashlib SHA-256 over the same token bytes."""
    from kvdb.bench.keys import bench_keys

    emit(bench_keys(prompt_tokens=prompt_tokens, block_tokens=block_tokens), as_json)


def register(cli: click.Group) -> None:
    cli.add_command(stats_cmd)
    cli.add_command(bench)



