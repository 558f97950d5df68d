"""Reproduce the planner's figures (docs/planner.md "Measured standing"): hit ratios and gap
closure, then the timed replay.

    .venv/bin/python tools/planner_figures.py [--shared DIR] [--json]

DIR defaults to ../shared/traces relative to the repository. Agent traces come from
tools/workflows/agents.json (hints exact, sigma = 1 noise, and none; with and
without their workflow lines).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvdb.sim.generator import generate_trace, load_params
from kvdb.sim.replay import capacity_for, gap_closure, replay
from kvdb.sim.timed import timed_replay
from kvdb.sim.trace import read_trace

REPO = Path(__file__).resolve().parents[1]
FRACTIONS = (0.005, 0.01, 0.02, 0.05)
POLICIES = ("lru", "arc", "kvflow", "tokencake", "belady", "kvdb")


def agent_trace(workflows: bool = True, **kw):
    return generate_trace(load_params(str(REPO / "tools" / "workflows" / "agents.json"), **kw), workflows, "agents")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(REPO.parent / "shared" / "traces"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    traces = {}
    for name in ("conversation", "synthetic"):
        f = Path(a.shared) / f"{name}_trace.jsonl"
        if f.is_file():
            traces[name] = read_trace(str(f))
    traces["agents, hints"] = agent_trace()
    traces["agents, sigma=1 noise"] = agent_trace(hint_noise_sigma=1.0)
    traces["agents, no hints"] = agent_trace(hints=False)
    traces["agents, hints, no workflow"] = agent_trace(workflows=False)
    traces["agents, sigma=1 noise, no workflow"] = agent_trace(workflows=False, hint_noise_sigma=1.0)
    traces["agents, no hints, no workflow"] = agent_trace(workflows=False, hints=False)
    rows = []
    for name, t in traces.items():
        for fr in FRACTIONS:
            cap = capacity_for(t, fr)
            r = {p: replay(t, p, cap) for p in POLICIES}
            g = gap_closure(r["kvdb"].block_hit_ratio, r["lru"].block_hit_ratio, r["belady"].block_hit_ratio)
            rows.append({"trace": name, "fraction": fr, "capacity": cap,
                         **{p: round(r[p].block_hit_ratio, 4) for p in POLICIES},
                         "gap_closure": None if g is None else round(g, 3),
                         "kvdb_us_per_access": round(r["kvdb"].policy_us_per_access, 2),
                         "kvdb_replay_s": round(r["kvdb"].elapsed_s, 2)})
    timed = []
    t = traces["agents, hints"]
    for fr in FRACTIONS:
        d = capacity_for(t, fr)
        for p in ("lru", "kvflow", "tokencake", "kvdb"):
            x = timed_replay(t, p, d, 4 * d)
            timed.append({"device": d, "host": 4 * d, "policy": p, "ttft_mean_s": round(x.ttft_mean_s, 4),
                          "ttft_p99_s": round(x.ttft_p99_s, 4), "jct_mean_s": round(x.jct_mean_s, 3),
                          "jct_p99_s": round(x.jct_p99_s, 3)})
    if a.json:
        print(json.dumps({"hit_ratio": rows, "timed": timed}, indent=2))
        return
    print("| trace | capacity | " + " | ".join(POLICIES) + " | g | kvdb µs/access |")
    print("| --- | --- |" + " --- |" * (len(POLICIES) + 2))
    for r in rows:
        print(f"| {r['trace']} | {r['capacity']} | " + " | ".join(f"{r[p]:.4f}" for p in POLICIES)
              + f" | {r['gap_closure']} | {r['kvdb_us_per_access']} |")
    print()
    print("| device / host | policy | TTFT mean s | TTFT p99 s | JCT mean s | JCT p99 s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in timed:
        print(f"| {r['device']} / {r['host']} | {r['policy']} | {r['ttft_mean_s']} | {r['ttft_p99_s']} | "
              f"{r['jct_mean_s']} | {r['jct_p99_s']} |")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
