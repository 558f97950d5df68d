"""Bad input to every CLI command (issue 15), found by walking the click group recursively, so a
new command is swept the day it is added: an unknown option, bad numbers, a missing path, a binary
file where text is expected, a directory that is not a data directory, an unwritable output.

Each must give one line starting ``kvdb: error:``, no traceback, exit 2 for usage (click: a bad
option, value or path) and 1 for runtime (kvdb/cli/main.py). Every bad value here fails while the
options are parsed or before the command touches anything, so no benchmark or server ever runs.
"""

from __future__ import annotations

import click
import pytest

from kvdb.cli.main import cli
from kvdb.cli.output import ByteSize
from helpers import run_cli


def leaves(group: click.Group, path: tuple = ()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from leaves(cmd, path + (name,))
        else:
            yield path + (name,), cmd


COMMANDS = list(leaves(cli))
IDS = [" ".join(p) for p, _ in COMMANDS]
#: options whose negative values mean something (a seed)
SIGNED = {"seed", "seeds"}
#: file options and arguments read as text or as a key
TEXT_INPUTS = {"trace", "workflow", "params_path", "secret_file", "encryption_key_file"}
#: output files, checked before the command runs (kvdb/cli/output.py ``writable_file``)
OUTPUTS = {"out_path", "per_request_out", "plot", "chart_path"}
#: arguments naming a data directory
DATA_DIRS = {"path"}
BINARY = bytes(range(256)) * 8


def test_the_sweep_sees_every_command():
    assert {"ls", "get", "stats", "verify", "compact", "wal dump", "sim", "gen", "explain", "demo",
            "replicate serve", "replicate status", "bench cold"} <= set(IDS)


run = run_cli


def check(r, code: int, *needles: str):
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("kvdb: error:"), r.output
    assert len([ln for ln in lines if ln.startswith("kvdb: error:")]) == 1, r.output
    for n in needles:
        assert n in r.output, r.output


@pytest.fixture
def fillers(tmp_path):
    """``fill(cmd, p, value)``: the command line with ``value`` for ``p`` and valid values for
    the other required parameters (arguments in declaration order)."""
    d = tmp_path / "dir"
    d.mkdir()
    text = tmp_path / "text.txt"
    text.write_text("0123456789abcdef0123456789abcdef\n")

    def fill(cmd: click.Command, target: click.Parameter, value) -> list[str]:
        args: list[str] = []
        for p in cmd.params:
            if p is target:
                v = str(value)
            elif not p.required:
                continue
            elif p.name == "key":
                v = "00" * 16
            elif p.name == "policies":
                v = "lru"
            elif p.name == "listen":
                v = "127.0.0.1:0"
            elif isinstance(p.type, click.Path) and not p.type.file_okay:
                v = str(d)
            elif isinstance(p.type, click.Path):
                v = str(text)
            else:
                v = "x"
            args += [v] if isinstance(p, click.Argument) else [p.opts[0], v]
        if cmd.name == "sim" and target.name != "capacities":
            args += ["--capacity", "4"]  # one of --capacity / --capacity-fraction is needed
        return args

    return fill


def params_where(pred):
    return [pytest.param(path, cmd, p, id=f"{' '.join(path)}:{p.name}")
            for path, cmd in COMMANDS for p in cmd.params if pred(p)]


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=IDS)
def test_unknown_option_is_a_usage_error(path, cmd):
    check(run(*path, "--no-such-option"), 2, "--no-such-option")


def _numeric(p):
    return isinstance(p, click.Option) and isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType,
                                                                ByteSize))


@pytest.mark.parametrize("path,cmd,p", params_where(_numeric))
def test_bad_numbers_are_usage_errors(path, cmd, p, fillers):
    check(run(*path, *fillers(cmd, p, "abc")), 2, p.opts[0])
    if p.name not in SIGNED:
        check(run(*path, *fillers(cmd, p, "-5")), 2, p.opts[0])
    if isinstance(p.type, click.types.FloatParamType):  # nan compares past every bound
        check(run(*path, *fillers(cmd, p, "nan")), 2, p.opts[0])
        check(run(*path, *fillers(cmd, p, "inf")), 2, p.opts[0])


def test_size_options_take_size_strings(fillers):
    serve = cli.commands["replicate"].commands["serve"]
    for p in serve.params:
        if isinstance(p.type, ByteSize):
            assert p.type.convert("4GiB", p, None) == 4 << 30
            assert p.type.convert("512MiB", p, None) == 512 << 20
            check(run("replicate", "serve", *fillers(serve, p, "4 furlongs")), 2, p.opts[0], "GiB")


@pytest.mark.parametrize("path,cmd,p", params_where(lambda p: isinstance(p.type, click.Path) and (
    p.type.exists or p.name in TEXT_INPUTS or p.name in DATA_DIRS)))
def test_a_missing_input_path(path, cmd, p, fillers, tmp_path):
    r = run(*path, *fillers(cmd, p, tmp_path / "no-such-file"))
    check(r, 2 if p.type.exists else 1, "no-such-file")


@pytest.mark.parametrize("path,cmd,p", params_where(lambda p: p.name in TEXT_INPUTS))
def test_a_binary_file_where_text_is_expected(path, cmd, p, fillers, tmp_path):
    b = tmp_path / "binary.bin"
    b.write_bytes(BINARY)
    args = fillers(cmd, p, b)
    if path == ("replicate", "serve"):
        # a binary secret is a secret: the listen address is the bad input that stops it
        args += ["--listen", "203.0.113.7:0", "--transport", "tcp"]
    if path == ("replicate", "status"):
        args += ["--peer", "127.0.0.1:1"]
    r = run(*path, *args)
    check(r, 2 if path == ("replicate", "serve") else 1)


@pytest.mark.parametrize("path,cmd,p", params_where(lambda p: isinstance(p, click.Argument) and p.name in DATA_DIRS))
def test_a_directory_that_is_not_a_data_directory(path, cmd, p, fillers, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    check(run(*path, *fillers(cmd, p, empty)), 1, str(empty))
    assert list(empty.iterdir()) == []  # nothing made in it
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "MANIFEST.json").write_bytes(BINARY)
    (junk / "wal").mkdir()
    (junk / "wal" / "00000001.log").write_bytes(BINARY)
    r = run(*path, *fillers(cmd, p, junk))
    assert "Traceback" not in r.output, r.output
    if path == ("wal", "dump"):  # a dump lists damage (DAMAGE rows), as it does in any log
        assert r.exit_code == 0 and "DAMAGE" in r.output, r.output
        return
    # rich wraps long paths, at a space or inside a word (the tmp path's length decides): compare without whitespace
    assert r.exit_code == 3 and "MANIFEST.jsonisnotvalidJSON" in "".join(r.output.split()), r.output
    if path != ("verify",):  # verify reports it among its problems
        assert r.output.startswith("kvdb: corruption:"), r.output


@pytest.mark.parametrize("path,cmd,p", params_where(lambda p: p.name in OUTPUTS))
def test_an_unwritable_output_is_refused_before_the_run(path, cmd, p, fillers, tmp_path):
    out = tmp_path / "missing-dir" / "out.file"
    check(run(*path, *fillers(cmd, p, out)), 1, "cannot write", "missing-dir")
