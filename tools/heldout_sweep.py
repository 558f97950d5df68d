"""Held-out check of the ``kvdb`` policy against LRU (issue 13, goal 2: never below LRU - 0.005).

    .venv/bin/python tools/heldout_sweep.py [--seeds 1001-1006] [--fractions 0.005,0.01,0.02,0.05]
                                            [--variants default,mix,...] [--sessions N]
                                            [--policy kvdb] [--json]

Generates one trace per workload variant and seed with ``kvdb gen``'s generator
(tools/workflows/agents.json plus the variant's options, the same as the CLI flags named in
VARIANTS), replays ``lru``, ``kvdb`` and ``belady`` at each capacity fraction, and prints per
variant and fraction the smallest margin of ``kvdb`` over LRU and the mean and smallest gap
closure g = (kvdb - lru) / (belady - lru). Exits 1 when a cell is below LRU - 0.005, 2 on bad arguments.

Use seeds no one has tuned on (docs/planner.md lists the ones used in development): the point is
workloads the policy has not seen.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvdb.errors import KvdbError
from kvdb.sim.generator import generate_trace, load_params
from kvdb.sim.replay import capacity_for, gap_closure, replay

REPO = Path(__file__).resolve().parents[1]
BOUND = 0.005  # the tolerance below LRU

#: variant -> (generator overrides, preset shape, keep workflow lines); the CLI flag each stands for in the comment
VARIANTS: dict[str, tuple[dict, str | None, bool]] = {
    "default": ({}, None, True),
    "mix": ({}, "agentic-mix", True),  # --shape agentic-mix
    "apps": ({"apps": 4, "app_tool_schema_blocks": 16}, None, True),  # --apps 4 --app-tool-blocks 16
    "react-pareto": ({"react": True, "react_wait_tail": "pareto"}, None, True),  # --react --wait-tail pareto
    "breaks-ns": ({"chain_break_prob": 0.3, "namespaced_agent_ids": True}, None, True),  # --chain-breaks 0.3 --namespaced-agents
    "wrong": ({"hint_shuffle": True, "wrong_workflow_prob": 0.5}, "agentic-mix", True),  # ... --hint-shuffle --wrong-workflow 0.5
    "nohints": ({"hints": False}, None, True),  # --no-hints
    "nowf": ({}, None, False),  # (none), workflow lines dropped: hints alone (goal 4: g >= 0.8 at 1 / 2 %)
    "mix-nowf": ({}, "agentic-mix", False),  # --shape agentic-mix, workflow lines dropped
}


def seed_list(text: str) -> list[int]:
    """"1001-1003,1010" -> [1001, 1002, 1003, 1010]; ValueError for a range that names no seed."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"seed range {part!r} is empty")
        out.extend(range(a, b + 1))
    return out


def variant_trace(name: str, seed: int, sessions: int | None = None):
    overrides, shape, workflows = VARIANTS[name]
    p = load_params(str(REPO / "tools" / "workflows" / "agents.json"), shape=shape, seed=seed, sessions=sessions,
                    **overrides)
    return generate_trace(p, workflows, f"{name}-{seed}")


def sweep(variants: list[str], seeds: list[int], fractions: list[float], sessions: int | None = None,
          policy: str = "kvdb", on_cell=None) -> list[dict]:
    """One cell per variant, seed and fraction: lru, ``policy`` (under the key "kvdb") and belady."""
    cells = []
    for v in variants:
        for seed in seeds:
            tr = variant_trace(v, seed, sessions)
            for fr in fractions:
                cap = capacity_for(tr, fr)
                h = {p: replay(tr, policy if p == "kvdb" else p, cap).block_hit_ratio for p in ("lru", "kvdb", "belady")}
                g = gap_closure(h["kvdb"], h["lru"], h["belady"])
                cell = {"variant": v, "seed": seed, "fraction": fr, "capacity": cap, **h, "g": g}
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    return cells


def below(cells: list[dict]) -> list[dict]:
    return [c for c in cells if c["kvdb"] < c["lru"] - BOUND]


def rounded(cell: dict) -> dict:
    return {k: round(v, 3 if k == "g" else 4) if isinstance(v, float) else v for k, v in cell.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1001-1006")
    ap.add_argument("--fractions", default="0.005,0.01,0.02,0.05")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sessions", type=int, default=None, help="override the sessions per trace")
    ap.add_argument("--policy", default="kvdb", help="the policy checked against LRU (default kvdb)")
    ap.add_argument("--json", action="store_true", help="one JSON line per cell instead of the summary")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    try:
        fractions = [float(f) for f in a.fractions.split(",")]
        seeds = seed_list(a.seeds)
    except ValueError as e:
        ap.error(str(e))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not seeds:
        ap.error(f"unknown variants {unknown} (known: {', '.join(VARIANTS)})" if unknown else "no seeds")
    try:
        cells = sweep(variants, seeds, fractions, a.sessions, a.policy,
                      (lambda c: print(json.dumps(rounded(c)), flush=True)) if a.json else None)
    except KvdbError as e:  # a fraction under one block, an unknown policy: said, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = below(cells)
    if not a.json:
        print(f"{'variant':14s} {'fraction':>8s} {'cells':>5s} {'min kvdb-lru':>12s} {'mean g':>7s} {'min g':>6s}")
        for v in dict.fromkeys(c["variant"] for c in cells):
            for fr in fractions:
                cs = [c for c in cells if c["variant"] == v and c["fraction"] == fr]
                gs = [c["g"] for c in cs if c["g"] is not None]
                mean_g = f"{sum(gs) / len(gs):7.3f}" if gs else f"{'-':>7s}"
                min_g = f"{min(gs):6.3f}" if gs else f"{'-':>6s}"
                print(f"{v:14s} {fr:8g} {len(cs):5d} {min(c['kvdb'] - c['lru'] for c in cs):+12.4f} {mean_g} {min_g}")
        print(f"{len(cells)} cells, {len(bad)} below LRU - {BOUND}")
    for c in bad:
        print(f"BELOW: {rounded(c)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
