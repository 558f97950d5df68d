"""SIGKILL test (issue 3 acceptance): a child process writes under ``sync`` and ``group`` (every
other round with the native committer) and prints each acknowledged key; it is killed at random
moments, 20 times, on the same directory. After each kill every acknowledged key reads back
bit-exact, acknowledged deletes stay deleted, and verify is clean. tools/soak_sigkill.py runs
the same driver for 1000+ kills."""

from __future__ import annotations

import pytest
from helpers import load_tool


@pytest.mark.slow
def test_twenty_sigkills_lose_no_acknowledged_block(tmp_path):
    soak = load_tool("soak_sigkill")
    res = soak.run_soak(str(tmp_path), kills=20, seed=7, min_s=0.02, max_s=0.12)
    assert res["problems"] == []
    assert res["kills"] == 20
    assert res["acked"] >= 20  # the child really wrote between kills
