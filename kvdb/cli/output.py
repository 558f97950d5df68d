"""Shared output options of every reporting command: ``--json`` to stdout, rich tables otherwise,
progress bars only on a terminal and never with ``--json``."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import click

json_option = click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON to stdout")


def _console():
    from rich.console import Console

    return Console()


def emit(data, as_json: bool, render=None) -> None:
    """Print ``data``: JSON when asked, else ``render(data, console)`` or a key/value table."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))
        return
    console = _console()
    if render is not None:
        render(data, console)
        return
    from rich.table import Table

    rows = data if isinstance(data, list) else [data]
    for row in rows:
        t = Table("field", "value")
        for k, v in row.items():
            t.add_row(str(k), json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v))
        console.print(t)


@contextmanager
def progress(total: int | None, description: str, enabled: bool = True):
    """A rich progress bar on a terminal; a no-op advance function otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n=1: None
        return
    from rich.progress import Progress

    from rich.console import Console

    with Progress(console=Console(stderr=True), transient=True) as p:
        task = p.add_task(description, total=total)
        yield lambda n=1: p.advance(task, n)


class ByteSize(click.ParamType):
    """A byte count as operators write it: ``65536``, ``4GiB``, ``512MiB`` (kvdb/sizes.py)."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        from kvdb.errors import InvalidInput
        from kvdb.sizes import parse_size

        try:
            return parse_size(value, param.opts[0] if param is not None else "size")
        except InvalidInput as e:
            self.fail(str(e), param, ctx)


BYTE_SIZE = ByteSize()


def writable_file(what: str):
    """A click callback for an output path: its directory must exist and be writable, checked
    while the options are parsed, so a long run never ends in an unwritable path (exit 1)."""

    def check(ctx, param, value):
        if value is None:
            return value
        import os

        from kvdb.errors import KvdbError

        parent = os.path.dirname(os.path.abspath(value)) or "."
        if not os.path.isdir(parent):
            reason = f"no directory {parent}"
        elif not os.access(parent, os.W_OK) or (os.path.exists(value) and not os.access(value, os.W_OK)):
            reason = "permission denied"
        else:
            return value
        raise KvdbError(f"cannot write {what} to {value!r}: {reason}")

    return check


class FiniteRange(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` and ``inf`` (which compare past its bounds)."""

    def convert(self, value, param, ctx):
        import math

        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv
