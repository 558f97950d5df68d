"""Inspection commands: ``kvdb ls`` (the blocks of a data directory) and ``kvdb get`` (one block).

Both open the disk tier read-only (kvdb/cli/cold.py ``open_store``: no byte written, no lock
taken), like ``sqlite3 -readonly`` or RocksDB's ``ldb`` on a secondary: they run on a read-only
copy and beside a Db that another process holds open.

How fresh the view is: the log as it stood when the command opened it (``as_of_lsn``, the
highest lsn replayed); opened again when the writer's compaction or GC deleted files under it
(kvdb/cold/view.py). A live writer's blocks that are only in its memory tiers (host, device)
are not in the directory and not listed; blocks it put with ``durability="none"`` appear once
its flusher has written them (within 50 ms by default). Every listed block is on the disk tier:
the memory tiers of a closed Db were written back at its close.
"""

from __future__ import annotations

import hashlib
import os
import time

import click

from kvdb.cli.cold import key_file_option, open_store
from kvdb.cold.view import stable
from kvdb.cli.output import emit, json_option, writable_file


def _view(path: str, store) -> dict:
    """What the command saw: the highest lsn in its view, whether a writer is live, when."""
    from kvdb.db.open import lock_is_held

    s = store.stats()
    return {"path": str(path), "as_of_lsn": s["next_lsn"] - 1, "writer_live": lock_is_held(path),
            "opened_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _freshness(view: dict) -> str:
    live = ("; a Db has it open: blocks only in its memory tiers are not shown"
            if view["writer_live"] else "; no Db has it open")
    return f"view: the log up to lsn {view['as_of_lsn']} as of {view['opened_at']}{live}"


def _row(key: bytes, e, page_bytes: int) -> dict:
    return {"key": key.hex(), "tier": "disk", "lsn": e.lsn, "segment": e.segment_no, "offset": e.offset,
            "record_bytes": e.record_bytes, "page_bytes": page_bytes, "position": e.position,
            "namespace_id": e.namespace_id}


@click.command("ls")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--limit", type=click.IntRange(min=0), default=None,
              help="list at most this many blocks (newest first); default: all")
@click.option("--namespace", "namespace_id", type=click.IntRange(min=0), default=None,
              help="only blocks of this namespace id (the namespace_id column)")
@key_file_option
@json_option
def ls_cmd(path: str, limit: int | None, namespace_id: int | None, encryption_key_file: str | None,
           as_json: bool) -> None:
    """List the blocks stored in the data directory at PATH: key, tier, lsn, segment and bytes,
    newest first. Read-only: writes nothing, works on a read-only copy and while a Db has PATH
    open (the view is the log as of this command; the first line says how fresh)."""
    view, rows, total = stable(path, lambda: _list(path, encryption_key_file, limit, namespace_id))
    if as_json:
        emit({**view, "blocks_total": total, "blocks": rows}, True)
        return
    click.echo(_freshness(view), err=True)
    click.echo(f"{'key':<32} {'tier':<5} {'lsn':>10} {'segment':>8} {'offset':>12} {'record_bytes':>12} namespace_id")
    for r in rows:
        click.echo(f"{r['key']:<32} {r['tier']:<5} {r['lsn']:>10} {r['segment']:>8} {r['offset']:>12} "
                   f"{r['record_bytes']:>12} {r['namespace_id']}")
    click.echo(f"{len(rows)} of {total} blocks shown", err=True)


def _list(path: str, encryption_key_file: str | None, limit: int | None, namespace_id: int | None):
    store = open_store(path, encryption_key_file, read_only=True)
    try:
        view = _view(path, store)
        keys = [c[0] for c in store.live.scan()]  # in log order: oldest written first
        keys.reverse()
        rows = []
        for start in range(0, len(keys), 4096):
            if limit is not None and len(rows) >= limit:
                break
            chunk = keys[start:start + 4096]
            for k, e in zip(chunk, store.lookup(chunk)):
                if e is None or (namespace_id is not None and e.namespace_id != namespace_id):
                    continue
                rows.append(_row(k, e, store.page_bytes))
        if limit is not None:
            rows = rows[:limit]
        return view, rows, len(keys)
    finally:
        store.close()


def _parse_key(ctx, param, value: str) -> bytes:
    from kvdb.types import KEY_BYTES

    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise click.BadParameter(f"{value!r} is not a block key ({2 * KEY_BYTES} hex digits, as `kvdb ls` prints)")
    return key


@click.command("get")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.argument("key", callback=_parse_key)
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False), default=None, callback=writable_file("the block"),
              help="write the block's page (page_bytes raw bytes, the layout's shape and dtype) to this file")
@click.option("--hex-bytes", type=click.IntRange(min=0), default=64, show_default=True,
              help="bytes of the page shown in hex on stdout")
@key_file_option
@json_option
def get_cmd(path: str, key: bytes, out_path: str | None, hex_bytes: int, encryption_key_file: str | None,
            as_json: bool) -> None:
    """Read one block (KEY: hex, as `kvdb ls` prints it) from the data directory at PATH, checked
    against its checksum: its lsn, size, SHA-256 and first bytes; with -o, its raw page bytes to a
    file. Read-only, like `kvdb ls` (same view). A missing or damaged block exits 1."""
    # a block moved and its segment collected by a live writer meanwhile: looked up again
    view, entry, page, store = stable(path, lambda: _read_one(path, key, encryption_key_file))
    data = page[0].tobytes()
    layout = store.layout
    info = {**view, **_row(key, entry, store.page_bytes), "shape": list(layout.block_shape),
            "dtype": layout.dtype_name, "sha256": hashlib.sha256(data).hexdigest(), "head_hex": data[:hex_bytes].hex()}
    if out_path is not None:
        from kvdb.errors import KvdbError

        tmp = f"{out_path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, out_path)
        except OSError as e:
            raise KvdbError(f"cannot write {out_path}: {e.strerror or e}") from None
        info["out"] = out_path
    if as_json:
        emit(info, True)
        return
    click.echo(_freshness(view), err=True)
    for k in ("key", "tier", "lsn", "segment", "offset", "record_bytes", "page_bytes", "shape", "dtype", "sha256"):
        click.echo(f"{k:<13} {info[k]}")
    if out_path is not None:
        click.echo(f"{'out':<13} {out_path}")
    head = data[:hex_bytes]
    for i in range(0, len(head), 16):
        click.echo(f"{i:08x}  {head[i:i + 16].hex(' ')}")


def _read_one(path: str, key: bytes, encryption_key_file: str | None):
    import numpy as np

    from kvdb.errors import CorruptionError, NotFound

    store = open_store(path, encryption_key_file, read_only=True)
    try:
        view = _view(path, store)
        (entry,) = store.lookup([key])
        if entry is None:
            raise NotFound(f"block {key.hex()} is not in {path} ({_freshness(view)}; run kvdb ls {path})")
        page = np.zeros((1, store.page_bytes), dtype=np.uint8)
        if not store.get_into([key], page)[0]:
            raise CorruptionError(f"block {key.hex()} failed its checksum in segment {entry.segment_no} at offset "
                                  f"{entry.offset}; run kvdb verify {path}")
        return view, entry, page, store
    finally:
        store.close()


def register(cli: click.Group) -> None:
    cli.add_command(ls_cmd)
    cli.add_command(get_cmd)
