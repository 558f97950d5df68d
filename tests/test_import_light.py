"""``import kvdb``, ``kvdb --version`` and ``kvdb --help`` do not import torch (issue 15: the
version took seconds); the package's names are there on first use (kvdb/__init__.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import sys
    import kvdb
    from kvdb.cli.main import cli
    try:
        cli([sys.argv[1]])
    except SystemExit as e:
        assert e.code == 0, e.code
    assert "torch" not in sys.modules, "torch was imported"
""")


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_do_not_import_torch(flag):
    r = subprocess.run([sys.executable, "-c", _SCRIPT, flag], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "kvdb" in r.stdout


def test_lazy_names():
    import kvdb

    assert kvdb.BlockLayout.__name__ == "BlockLayout" and kvdb.Db.__name__ == "Db"
    from kvdb import BlockKey, PinnedPages  # noqa: F401

    assert set(kvdb.__all__) <= set(dir(kvdb))
    with pytest.raises(AttributeError):
        kvdb.no_such_name  # noqa: B018
