"""``kvdb`` entry point. Each command group lives in its own module and registers here.

Exit codes: 0 ok, 1 runtime error, 2 usage, 3 corruption found. Every error is one line on
stderr (``kvdb: error: ...``), never a traceback: kvdb's own errors, and the file errors
(a missing or unwritable path, a file that is not text) a command did not turn into one.
"""

from __future__ import annotations

import importlib
import sys

import click

from kvdb import __version__
from kvdb.errors import CorruptionError, KvdbError

# modules under kvdb/cli/ whose ``register(cli)`` adds their commands
COMMAND_MODULES = [
    "kvdb.cli.store",
    "kvdb.cli.cold",
    "kvdb.cli.inspect",
    "kvdb.cli.demo",
    "kvdb.cli.replicate",
    "kvdb.cli.sim",
    "kvdb.cli.vllm",
    "kvdb.cli.prompts",
    "kvdb.cli.scale",
    "kvdb.cli.shared",
]


class KvdbGroup(click.Group):
    """Maps kvdb errors to the documented exit codes with a one-line message on stderr."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Click's own errors (a bad option, value or path: exit 2) in kvdb's one-line form,
        ``kvdb: error: ...``, instead of click's usage block."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # a group run without a command
            click.echo(e.ctx.get_help(), err=True)
            click.echo(f"kvdb: error: no command given (see: {e.ctx.command_path} --help)", err=True)
            sys.exit(2)
        except click.UsageError as e:
            hint = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
            click.echo(f"kvdb: error: {e.format_message()}{hint}", err=True)
            sys.exit(2)
        except click.ClickException as e:  # a file click could not open, ...
            click.echo(f"kvdb: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except (click.Abort, KeyboardInterrupt, EOFError):
            click.echo("kvdb: interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CorruptionError as e:
            click.echo(f"kvdb: corruption: {e}", err=True)
            sys.exit(3)
        except KvdbError as e:
            click.echo(f"kvdb: error: {e}", err=True)
            sys.exit(1)
        except OSError as e:  # a path the user named: missing, unwritable, a directory, ...
            where = f": {e.filename}" if e.filename else ""
            click.echo(f"kvdb: error: {e.strerror or e}{where}", err=True)
            sys.exit(1)
        except UnicodeDecodeError as e:
            click.echo(f"kvdb: error: an input is not UTF-8 text (byte {e.start}: {e.reason})", err=True)
            sys.exit(1)


@click.group(cls=KvdbGroup)
@click.version_option(__version__, prog_name="kvdb")
def cli() -> None:
    """kvdb: an embedded storage engine for LLM KV-cache blocks."""


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(cli)
