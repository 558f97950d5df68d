"""``kvdb bench scale``: the disk tier's reads, ingest and open against plain file I/O of the
same bytes and a plain RocksDB open (kvdb/bench/scale.py, kvdb/bench/ingest.py; issue 12 item 5)."""

from __future__ import annotations

import click

from kvdb.cli.output import emit, json_option, progress


@click.command("scale")
@click.option("--dir", "dir_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="where to write the scratch files (default: the system temp dir)")
@click.option("--total-mib", type=click.IntRange(min=1), default=256, show_default=True, help="bytes of 64 KiB pages read in batches")
@click.option("--batch-pages", type=click.IntRange(min=1), default=256, show_default=True, help="pages per get_blocks call (batch reads)")
@click.option("--get1-blocks", type=click.IntRange(min=1), default=256, show_default=True, help="one-block reads timed per repeat")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="runs per phase; figures are their medians")
@click.option("--ingest-mib", type=click.IntRange(min=0), default=128, show_default=True,
              help="bytes of 4 KiB and of 64 KiB pages ingested per run (0: no ingest figures)")
@click.option("--open-blocks", type=click.IntRange(min=0), default=10_000, show_default=True,
              help="512-byte blocks in the small store whose open is timed (0: no open figures)")
@click.option("--open-large-blocks", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="512-byte blocks in the large store whose open is timed (open_1m_s)")
@click.option("--writeback-mib", type=click.IntRange(min=0), default=512, show_default=True,
              help="dirty bytes in DRAM whose write-back at close() is timed (0: no write-back figures)")
@json_option
def bench_scale_cmd(dir_path, total_mib, batch_pages, get1_blocks, repeats, ingest_mib, open_blocks,
                    open_large_blocks, writeback_mib, as_json) -> None:
    """Disk-tier reads (batched, with a roomy and a small host tier, and one block per call,
    cold) vs preadv / one file per block; ingest of 4 KiB and 64 KiB pages and the write-back at
    close() vs sequential writes; open of 10k and 1M blocks vs a RocksDB open."""
    from kvdb.bench.scale import bench_scale

    steps = 2 * repeats * (2 if ingest_mib else 1) + (repeats if writeback_mib else 0)
    with progress(steps, "bench scale", enabled=not as_json) as advance:
        res = bench_scale(total_mib=total_mib, batch_pages=batch_pages, get1_blocks=get1_blocks, repeats=repeats,
                          ingest_mib=ingest_mib, open_blocks=open_blocks, open_large_blocks=open_large_blocks,
                          writeback_mib=writeback_mib, dir_path=dir_path,
                          progress=lambda done, total: advance())
    emit(res, as_json)


def register(cli: click.Group) -> None:
    cli.commands["bench"].add_command(bench_scale_cmd)
