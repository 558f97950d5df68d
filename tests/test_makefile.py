"""The Makefile (issue 15): quiet by default (pip's output goes to the install log, one line per
step), everything with ``V=1``, never ``sudo``. Checked with ``make -n`` against a venv path that
does not exist, so every install step is listed and nothing runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(tmp_path, *args: str) -> list[str]:
    r = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", *args, "install-vllm"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_quiet_by_default(tmp_path):
    lines = dry_run(tmp_path)
    pip = [ln for ln in lines if "pip install" in ln or "install_vllm.py" in ln]
    assert len(pip) >= 6
    for ln in pip:  # old Makefile: pip's own output (and its warnings) on the terminal
        assert "install.log 2>&1" in ln, ln
    steps = [ln for ln in lines if ln.startswith('echo "kvdb: ')]
    assert len(steps) >= 4


def test_v1_shows_pip(tmp_path):
    lines = dry_run(tmp_path, "V=1")
    pip = [ln for ln in lines if "pip install" in ln and "mooncake" not in ln]
    assert pip and not any("install.log" in ln for ln in pip)


def test_no_sudo_and_one_line_for_a_missing_library():
    text = (ROOT / "Makefile").read_text()
    assert "sudo" not in text.replace("never through sudo", "")
    msgs = [ln for ln in text.splitlines() if "libibverbs1 and librdmacm1 missing" in ln]
    assert len(msgs) == 1 and msgs[0].strip().startswith("echo ")
