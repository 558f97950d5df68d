#!/usr/bin/env python3
"""SIGKILL soak of the cold tier: a child process writes blocks under ``sync`` and ``group`` and
prints each acknowledged key; the parent kills it with SIGKILL at a random moment, reopens the
store, checks that every acknowledged block reads back bit-exact and that ``verify`` is clean,
and repeats on the same directory (so every round also recovers from the previous kill).

    python tools/soak_sigkill.py --kills 1000 [--path DIR] [--seed 0] [--json]

tests/cold/test_sigkill.py runs the same driver for 20+ kills. The child imports only the cold
tier (no torch), so a round costs little more than the kill delay.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

PAGE_BYTES = 8192
#: the cold tier needs only page_bytes and itemsize from a layout
LAYOUT = SimpleNamespace(page_bytes=PAGE_BYTES, itemsize=2)
SEGMENT_BYTES = 256 << 10  # small segments: rotations happen under the kills too
ROUNDS_PER_STORE = 50  # a fresh directory every so often keeps each round's check short


def page_of(key: bytes):
    import numpy as np

    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, (1, PAGE_BYTES), dtype=np.uint8)


def key_of(round_no: int, i: int) -> bytes:
    return round_no.to_bytes(4, "little") + i.to_bytes(4, "little") + b"soak-key"


#: a hot set rewritten across rounds: its old versions are dead bytes, so the store's automatic
#: compaction (max_space_amp) runs while children write and are killed
HOT_KEYS = 48


def hot_key(h: int) -> bytes:
    return b"hot:" + h.to_bytes(4, "little") + b"soak-key"


def _import_cold_tier_only() -> None:
    """Make ``import kvdb.cold...`` skip kvdb/__init__.py (which imports torch, ~1.5 s a round):
    register the package by path only. The cold tier itself never needs torch."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("kvdb")
    if spec is None or "kvdb" in sys.modules:
        return
    pkg = types.ModuleType("kvdb")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["kvdb"] = pkg


def child(path: str, round_no: int) -> None:
    """Write forever: batches of 1-4 blocks under ``sync`` or ``group`` (some under ``none``,
    acknowledged by the next durable put), three in four rewriting the hot set; print each
    acknowledged key. The store compacts on its own (``max_space_amp``, default) as the hot
    set's old versions pile up."""
    import numpy as np

    from kvdb.cold.store import ColdStore

    # odd rounds fsync group commits in the native committer thread (ColdStore native_commit)
    store = ColdStore.open(path, LAYOUT, segment_bytes=SEGMENT_BYTES, flush_interval_s=0.01,
                           native_commit=round_no % 2 == 1)
    rng = random.Random(round_no)
    pending: list[bytes] = []  # keys written under "none", acknowledged by the next sync
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    # the flusher calls its Checkpointer's maybe_compact (kvdb/cold/checkpoint.py), not the
    # store's: the reporter goes there (on the store it saw no run: 0 reported since the split)
    ckpt = store.ckpt
    compact = ckpt.maybe_compact

    def reported_compact():  # runs in the flusher thread (after READY: the parent reads that first)
        r = compact()
        if r is not None:
            out.write(f"COMPACTED {r['segments_deleted']}\n")
            out.flush()
        return r

    ckpt.maybe_compact = reported_compact
    i = 0
    while True:
        n = rng.randint(1, 4)
        if rng.random() < 0.75:  # rewrite part of the hot set (same bytes: a page is its key's)
            h = rng.randrange(HOT_KEYS - n + 1)
            keys = [hot_key(h + j) for j in range(n)]
        else:
            keys = [key_of(round_no, i + j) for j in range(n)]
            i += n
        pages = np.vstack([page_of(k) for k in keys])
        r = rng.random()
        durability = "sync" if r < 0.4 else "group" if r < 0.8 else "none"
        store.put(keys, pages, None, durability)
        if durability != "none":  # the ack covers every earlier record of the log as well
            acks = pending + keys
            out.write("".join(f"ACK {k.hex()}\n" for k in acks))
            pending.clear()
            out.flush()
        else:
            pending.extend(keys)
        if keys[0].startswith(b"hot:"):
            continue
        if i % 97 == 0:
            out.write(f"DELETING {key_of(round_no, i - 50).hex()}\n")  # a kill now leaves it either way
            out.flush()
            store.delete([key_of(round_no, i - 50)], durability="sync")
            out.write(f"DEL {key_of(round_no, i - 50).hex()}\n")
            out.flush()


def check(path: str, acked: dict[bytes, bool | None]) -> tuple[int, list[str]]:
    """Reopen; every acknowledged key present (or deleted) and bit-exact; verify clean.
    ``acked[k]``: True written, False deleted, None a delete in flight (either is right)."""
    import numpy as np

    from kvdb.cold.store import ColdStore

    store = ColdStore.open(path, LAYOUT, segment_bytes=SEGMENT_BYTES, flush_interval_s=None)
    problems = []
    try:
        keys = list(acked)
        for s in range(0, len(keys), 256):
            chunk = keys[s : s + 256]
            out = np.zeros((len(chunk), PAGE_BYTES), dtype=np.uint8)
            found = store.get_into(chunk, out)
            for j, k in enumerate(chunk):
                if acked[k] and not found[j]:
                    problems.append(f"acknowledged key {k.hex()} is missing")
                elif acked[k] is False and found[j]:
                    problems.append(f"deleted key {k.hex()} is back")
                elif found[j] and not (out[j] == page_of(k)[0]).all():
                    problems.append(f"key {k.hex()} reads back wrong bytes")
        rep = store.verify()
        problems.extend(f"verify: {p}" for p in rep.problems)
        torn = store.recovery.torn_bytes
    finally:
        store.close()
    return torn, problems


def run_soak(path: str, kills: int, seed: int = 0, min_s: float = 0.05, max_s: float = 0.4, log=None) -> dict:
    rng = random.Random(seed)
    acked: dict[bytes, bool] = {}  # key -> live (False once its delete is acknowledged)
    base = path
    here = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = {"kills": 0, "acked": 0, "rounds_with_torn_tail": 0, "auto_compactions": 0, "problems": []}
    for round_no in range(kills):
        if round_no % ROUNDS_PER_STORE == 0:
            path = os.path.join(base, f"store{round_no // ROUNDS_PER_STORE}")
            acked = {}
            if round_no:
                import shutil

                shutil.rmtree(os.path.join(base, f"store{round_no // ROUNDS_PER_STORE - 1}"), ignore_errors=True)
        proc = subprocess.Popen([sys.executable, here, "child", path, str(round_no + seed * 1_000_000)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        t0 = time.monotonic()
        while not any(l.startswith("READY") for l in lines[:1]) and proc.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.005)
        time.sleep(rng.uniform(min_s, max_s))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join(10)
        err = proc.stderr.read()
        if not lines or not lines[0].startswith("READY"):
            res["problems"].append(f"round {round_no}: child did not start: {err[-2000:]}")
            break
        res["kills"] += 1
        for line in lines[1:]:
            if not line.endswith("\n"):
                continue  # cut mid-line by the kill: not an acknowledgement the parent saw
            kind, arg = line.split()
            if kind == "COMPACTED":  # the child's flusher compacted (arg: segments it deleted)
                res["auto_compactions"] += 1
                continue
            k = bytes.fromhex(arg)
            if kind == "DELETING":
                acked[k] = None
            else:
                acked[k] = kind == "ACK"
        torn, problems = check(path, acked)
        res["rounds_with_torn_tail"] += torn > 0
        res["problems"].extend(f"round {round_no}: {p}" for p in problems)
        if log is not None:
            log(f"round {round_no}: {len(lines) - 1} acks, torn tail {torn} bytes, {len(problems)} problems")
        if problems:
            break
        res["acked"] += sum(1 for line in lines[1:] if line.startswith("ACK") and line.endswith("\n"))
    return res


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "child":
        _import_cold_tier_only()
        child(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--path", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    path = a.path or tempfile.mkdtemp(prefix="kvdb-soak-")
    t0 = time.time()
    res = run_soak(path, a.kills, a.seed, log=None if a.json else (lambda m: print(m, file=sys.stderr)))
    res["seconds"] = round(time.time() - t0, 1)
    res["path"] = path
    print(json.dumps(res, indent=2))
    sys.exit(0 if not res["problems"] else 3)


if __name__ == "__main__":
    main()
