"""``kvdb demo`` relies on the Db's plan (kvdb/db/plans/): it never moves a block itself."""

from __future__ import annotations

import pytest

import kvdb
from kvdb.demo.agents import DemoConfig, run_demo

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")


def test_demo_moves_come_from_the_engines_plan(tmp_path, monkeypatch):
    # Scenario: 1 round, 2 workers, 12 device + 12 host pages; Db.prefetch and Db.offload (the
    # caller-driven moves) are forbidden: every block that comes back up does so by the plan.
    def forbidden(*a, **k):
        raise AssertionError("the demo moved blocks itself")

    monkeypatch.setattr(kvdb.Db, "prefetch", forbidden)
    monkeypatch.setattr(kvdb.Db, "offload", forbidden)
    cfg = DemoConfig(data_dir=tmp_path / "demo", rounds=1, workers=2, system_tokens=256, schema_tokens=64,
                     role_tokens=64, tool_result_tokens=48, output_tokens=4, device_pages=12, host_pages=12)
    res = run_demo(cfg)
    p = res["plans"]
    assert res["first_tokens_identical"] == 6
    assert p["waits"] == 3  # the planner's search, each worker's code run
    assert p["planned_prefetches"] == 3 and p["late_prefetches"] == 0 and p["early_calls"] == 0
    assert p["planned_offload_blocks"] > 0 and p["planned_prefetch_blocks"] > 0
    assert p["prefixes_resolved"] == 4 and res["hint_outcomes"]["clipped"] == 4  # named before it was stored
    assert res["prefetched_blocks"] == p["planned_prefetch_blocks"]
