"""Locates the shared Mooncake traces relative to the repository (never by machine path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdb.sim.trace import read_trace

REPO = Path(__file__).resolve().parents[2]


def _shared_trace(name: str) -> Path:
    for base in (REPO.parent / "shared" / "traces", REPO / "shared" / "traces"):
        p = base / name
        if p.is_file():
            return p
    pytest.skip(f"{name} not found in ../shared/traces or ./shared/traces beside the clone")


@pytest.fixture(scope="session")
def conversation():
    return read_trace(str(_shared_trace("conversation_trace.jsonl")))
