"""The README's "Monitoring" example runs as written and shows the documented series."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_monitoring_example_runs(tmp_path):
    text = README.read_text()
    section = text.split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for name in re.findall(r"`(kvdb_[a-z_]+)`", section):
        assert f"\n{name}" in r.stdout or r.stdout.startswith(name), name
