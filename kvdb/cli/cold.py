"""Cold-tier commands: ``kvdb verify``, ``kvdb compact``, ``kvdb wal dump`` and ``kvdb bench cold``.

They open the disk tier of a data directory directly (layout from PATH/MANIFEST.json). ``verify``
and ``wal dump`` only read (``read_only``: no byte written, no lock taken), so they run beside a
live Db (their view: the log as of the open, taken again when the Db's compaction or GC deleted
files under it: kvdb/cold/view.py) and on a read-only copy; ``compact`` needs the
directory to itself (a Db holding it makes it fail with a clear error).
Exit codes: 0 ok, 1 runtime error, 2 usage, 3 corruption found.
"""

from __future__ import annotations

import os
import sys

import click

from kvdb.cli.output import emit, json_option

key_file_option = click.option("--encryption-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
                               help="AES-256 key file the store was created with")


def read_layout(path: str, with_store_id: bool = False):
    """The BlockLayout in PATH/MANIFEST.json (and its store id, None for a legacy store, with
    ``with_store_id``); InvalidInput when PATH is not a data directory."""
    from kvdb.format.layout import BlockLayout
    from kvdb.errors import InvalidInput
    from kvdb.format.manifest import read_manifest, store_id_of

    m = read_manifest(path)
    if m is None:
        from pathlib import Path

        from kvdb.db.open import holds_log
        from kvdb.errors import CorruptionError

        if holds_log(Path(path)):  # damage, not a wrong path: exit 3
            raise CorruptionError(f"{os.path.join(path, 'MANIFEST.json')} is missing but {path} holds a log "
                                  "(wal/, index/): restore MANIFEST.json from a backup")
    if m is None or "layout" not in m:
        raise InvalidInput(f"{path} is not a kvdb data directory (no MANIFEST.json with a layout)")
    layout = BlockLayout.from_dict(m["layout"])
    return (layout, store_id_of(m, os.path.join(path, "MANIFEST.json"))) if with_store_id else layout


def open_store(path: str, key_file: str | None, read_only: bool = False):
    """The disk tier of PATH (no flusher); ``read_only``: no byte written, no lock taken. The
    index and segments must carry the manifest's store id (CorruptionError otherwise)."""
    from kvdb.cold.store import ColdStore

    layout, store_id = read_layout(path, with_store_id=True)
    return ColdStore.open(path, layout, encryption_key_file=key_file, flush_interval_s=None,
                          read_only=read_only, store_id=store_id)


class _Bar:
    """A progress callback (done, total) drawing a rich bar on a terminal, nothing otherwise."""

    def __init__(self, description: str, enabled: bool) -> None:
        self.description = description
        self.enabled = enabled and sys.stderr.isatty()
        self._p = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import Progress

            self._p = Progress(console=Console(stderr=True), transient=True)
            self._p.__enter__()
            self._task = self._p.add_task(self.description, total=None)
        return self

    def __call__(self, done: int, total: int) -> None:
        if self._p is not None:
            self._p.update(self._task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)


@click.command("verify")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@key_file_option
@json_option
def verify_cmd(path: str, encryption_key_file: str | None, as_json: bool) -> None:
    """Check every log record's checksum and every index entry against the log (exit 3 on damage)."""
    from kvdb.cold.view import stable
    from kvdb.db.open import lock_is_held
    from kvdb.errors import CorruptionError

    def attempt() -> dict:
        live = lock_is_held(path)  # a Db is appending: the last segment's end may be mid-append
        try:
            store = open_store(path, encryption_key_file, read_only=True)
        except CorruptionError as e:
            return {"ok": False, "segments": 0, "records": 0, "log_bytes": 0, "entries": 0,
                    "problems": [f"open: {e}"]}
        try:
            with _Bar("verify", not as_json) as bar:
                return store.verify(progress=bar, live_writer=live).to_dict()
        finally:
            store.close()

    # a problem is believed only from a view no compaction or GC of a live writer crossed
    report = stable(path, attempt, suspect=lambda r: not r["ok"])
    emit(report, as_json, _render_verify)
    if not report["ok"]:
        sys.exit(3)


def _render_verify(r: dict, console) -> None:
    state = "[green]clean[/]" if r["ok"] else f"[red]{len(r['problems'])} problem(s)[/]"
    console.print(f"{state}: {r['segments']} segments, {r['records']} records, {r['log_bytes']} log bytes, "
                  f"{r['entries']} index entries")
    for p in r["problems"]:
        console.print(f"  [red]x[/] {p}")


@click.command("compact")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@key_file_option
@json_option
def compact_cmd(path: str, encryption_key_file: str | None, as_json: bool) -> None:
    """Garbage-collect log segments that hold dead blocks."""
    store = open_store(path, encryption_key_file)
    try:
        with _Bar("compact", not as_json) as bar:
            res = store.compact(progress=bar)
    finally:
        store.close()
    emit(res, as_json)


@click.group("wal")
def wal() -> None:
    """The write-ahead log of a data directory."""


@wal.command("dump")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--segment", "segment_no", type=click.IntRange(min=0), default=None, help="only this segment")
@json_option
def wal_dump_cmd(path: str, segment_no: int | None, as_json: bool) -> None:
    """Print the log's records (read-only; damaged spans are listed, never decoded)."""
    from kvdb.cold.view import stable
    from kvdb.errors import NotFound

    wal_dir = os.path.join(path, "wal")
    if not os.path.isdir(wal_dir):
        raise NotFound(f"{path} has no log (no wal/ directory)")
    # a segment collected by a live writer meanwhile: listed and read again (kvdb/cold/view.py)
    rows = stable(path, lambda: _dump_rows(wal_dir, segment_no))
    if as_json:
        emit(rows, True)
        return
    for r in rows:
        extra = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("segment", "offset", "type"))
        click.echo(f"{r['segment']:>6} {r['offset']:>12} {r['type']:<10} {extra}")


def _dump_rows(wal_dir: str, segment_no: int | None) -> list[dict]:
    from kvdb.errors import NotFound
    from kvdb.format.record import describe, segment_name
    from kvdb.fs import OsFs
    from kvdb.wal.reader import scan_segment
    from kvdb.wal.segments import list_segments

    segs = list_segments(OsFs(), wal_dir)
    if segment_no is not None:
        if segment_no not in segs:
            raise NotFound(f"segment {segment_no} is not in {wal_dir} (segments: {segs})")
        segs = [segment_no]
    rows = []
    for s in segs:
        scan = scan_segment(os.path.join(wal_dir, segment_name(s)), s)
        for rec in scan.records:
            rows.append({"segment": s, **describe(rec)})
        for d in scan.damage:
            rows.append({"segment": s, "offset": d.offset, "type": "DAMAGE", "end": d.end, "what": d.what})
        if scan.ending != "clean":
            rows.append({"segment": s, "offset": scan.end, "type": "END", "what": scan.ending})
    rows.sort(key=lambda r: (r["segment"], r["offset"]))
    return rows


@click.command("cold")
@click.option("--dir", "dir_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="where to write the scratch files (default: the system temp dir)")
@click.option("--total-mib", type=click.IntRange(min=1), default=512, show_default=True, help="bytes of 2 MiB pages written and read")
@click.option("--batch-pages", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=8, show_default=True, help="writer threads for the group-commit figure")
@click.option("--ops", type=click.IntRange(min=1), default=400, show_default=True, help="small puts per thread (and for the sync figure)")
@click.option("--recovery-mib", type=click.IntRange(min=0), default=1024, show_default=True, help="log replayed for the recovery figure; 0 skips")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="bandwidth runs; figures are their medians")
@json_option
def bench_cold_cmd(dir_path, total_mib, batch_pages, threads, ops, recovery_mib, repeats, as_json) -> None:
    """Disk tier write / read vs raw write+fsync / read of the same bytes; group vs sync commits."""
    from kvdb.bench.cold import run

    with _Bar("bench cold", not as_json) as bar:
        steps = [0]

        def tick() -> None:
            steps[0] += 1
            bar(steps[0], 3)

        res = run(dir_path, total_mib << 20, batch_pages, threads, ops, ops, recovery_mib << 20, tick, repeats)
    emit(res, as_json)


def register(cli: click.Group) -> None:
    cli.add_command(verify_cmd)
    cli.add_command(compact_cmd)
    cli.add_command(wal)
    bench = cli.commands.get("bench")
    if bench is None:  # kvdb.cli.store registers the group; it must come first in COMMAND_MODULES
        raise RuntimeError("kvdb.cli.cold needs the `bench` group of kvdb.cli.store registered first")
    bench.add_command(bench_cold_cmd)
