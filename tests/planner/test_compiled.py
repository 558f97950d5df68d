"""The planner's compiled modules (setup.py, kvdb/compiled.py): built from the current source,
and deciding exactly as that source does when it runs as Python."""

from __future__ import annotations

import copy
import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import kvdb
from kvdb.compiled import compiled_modules
from kvdb.errors import InvalidInput
from kvdb.planner.policies import POLICIES, REPLAY_ONLY, make_policy
from kvdb.planner.policies.planned import PlannedReplacer

PACKAGE = Path(kvdb.__file__).resolve().parent
PXDS = sorted(PACKAGE.rglob("*.pxd"))
PURE = bool(os.environ.get("KVDB_PURE_PYTHON"))


def _name(pxd: Path) -> str:
    return ".".join(pxd.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_the_planner_modules_have_a_pxd():
    names = {_name(p) for p in PXDS}
    assert {"kvdb.planner.policies.planned", "kvdb.planner.policies.agentplans", "kvdb.planner.policies.adaptive",
            "kvdb.planner.policies.lru", "kvdb.planner.policies.reuse"} <= names


@pytest.mark.skipif(PURE, reason="KVDB_PURE_PYTHON runs the Python source")
@pytest.mark.parametrize("pxd", PXDS, ids=_name)
def test_every_module_with_a_pxd_runs_compiled_from_its_current_source(pxd):
    name = _name(pxd)
    assert name in compiled_modules(), f"{name} is not compiled: run `make native`"
    built = Path(importlib.import_module(name).__file__)
    assert built.suffix == ".so", built
    newest = max(pxd.stat().st_mtime, pxd.with_suffix(".py").stat().st_mtime)
    assert built.stat().st_mtime >= newest, f"{built.name} is older than its source: run `make native`"


# replays the same generated agent workloads through each policy; prints per-call hits and the guard's state
_REPLAY = r"""
import json, sys
from kvdb.sim.generator import generate, load_params
from kvdb.sim.replay import capacity_for, replay
from kvdb.sim.trace import parse_trace
out = {}
for shape, workflows in ((None, True), ("agentic-mix", True), ("agentic-mix", False)):
    p = load_params(None, shape=shape, sessions=12, seed=5)
    lines = [x for x in generate(p) if workflows or x.get("type") != "workflow"]
    t = parse_trace("\n".join(json.dumps(x) for x in lines), source="t")
    for policy in ("kvdb", "planner", "lru"):
        for fr in (0.02, 0.2):
            hits = []
            r = replay(t, policy, capacity_for(t, fr), per_request=lambda d: hits.append(d["hits"]))
            out[f"{shape}/{workflows}/{policy}/{fr}"] = [r.hits, hits]
import kvdb.planner.policies.planned as m
out["source"] = m.__file__.endswith(".py")
print(json.dumps(out))
"""


def _replayed(pure: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVDB_PURE_PYTHON"}
    if pure:
        env["KVDB_PURE_PYTHON"] = "1"
    done = subprocess.run([sys.executable, "-c", _REPLAY], env=env, capture_output=True, text=True, timeout=240,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(PURE, reason="compares the compiled modules with KVDB_PURE_PYTHON")
def test_compiled_and_python_source_make_the_same_decisions():
    compiled, source = _replayed(False), _replayed(True)
    assert (compiled.pop("source"), source.pop("source")) == (False, True)
    assert compiled.keys() == source.keys()
    for cell in compiled:
        assert compiled[cell] == source[cell], cell
    assert any(h for cell in compiled for h in compiled[cell][1])  # the replays hit: the comparison is not of zeros


def test_a_copied_planner_decides_as_the_original():
    """A guard copies its ``gd`` mini when ``nowf`` appears (kvdb/planner/policies/adaptive.py): the
    copy, compiled or not, must carry every field (arrays behind typed views included)."""
    rng = random.Random(3)
    r = PlannedReplacer(64)
    free = list(range(64))
    table: dict[int, int] = {}

    def access(repl, tab, fr, ids):
        frames = []
        for b in ids:
            if b not in tab:
                while not fr:
                    f = repl.evict()
                    del tab[next(k for k, v in tab.items() if v == f)]
                    fr.append(f)
                tab[b] = fr.pop()
            frames.append(tab[b])
        repl.record_access(frames, ids)

    calls = [[rng.randrange(200) for _ in range(rng.randint(1, 12))] for _ in range(400)]
    for ids in calls[:200]:
        access(r, table, free, list(dict.fromkeys(ids)))
    twin, twin_table, twin_free = copy.deepcopy((r, table, free))
    saved = r._h[5]  # one array behind the twin's _key and _h (the gd ordering), not r's
    twin._h[5] = saved + 1.0
    assert (twin._key[5], r._h[5], r._key[5]) == (saved + 1.0, saved, saved)
    twin._h[5] = saved
    for ids in calls[200:]:
        ids = list(dict.fromkeys(ids))
        access(r, table, free, ids)
        access(twin, twin_table, twin_free, ids)
    assert table == twin_table
    victims = [r.evict() for _ in range(20)]
    assert victims == [twin.evict() for _ in range(20)] and None not in victims


@pytest.mark.parametrize("name", sorted(set(POLICIES) - REPLAY_ONLY))
@pytest.mark.parametrize("bad", [-1, 8, 2**70])
@pytest.mark.parametrize("first", [False, True], ids=["bad-last", "bad-first"])
def test_a_frame_out_of_range_is_refused_before_anything_changes(name, bad, first):
    """R-contract (kvdb/buffer_pool/replacer.py): InvalidInput, compiled or not (a typed frame would
    overflow on 2**70; -1 would index the last frame), and the call's other frames stay unknown,
    whichever end of the call the bad frame is at (several policies walk it deepest first)."""
    r = make_policy(name, 8)
    r.record_access([0, 1], [10, 11])
    with pytest.raises(InvalidInput):
        r.record_access([bad, 2] if first else [2, bad], [12, 13])
    assert r.num_evictable() == 2


@pytest.mark.parametrize("name", ["lru", "planner", "kvdb"])
def test_a_copied_replacer_evicts_as_the_original(name):
    r = make_policy(name, 16, **({"capacity_frames": 16} if name == "kvdb" else {}))
    r.record_access(list(range(10)), list(range(100, 110)))
    r.record_access([3, 1, 7], [103, 101, 107])
    twin = copy.deepcopy(r)
    r.record_access([9, 2], [109, 102])
    twin.record_access([9, 2], [109, 102])
    assert [r.evict() for _ in range(10)] == [twin.evict() for _ in range(10)]
