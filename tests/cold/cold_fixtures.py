"""Shared helpers of the cold-tier tests: a tiny layout (128-byte pages), key and page makers.

Imported by name (pytest puts this folder on sys.path; tests/ has no packages)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from kvdb.format.layout import BlockLayout

#: 1 layer x 2 (k, v) x 4 tokens x 1 head x 8 dims x 2 bytes (bf16) = 128-byte pages
TINY = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def pages_for(keys: list[bytes], salt: int = 0, page_bytes: int = TINY.page_bytes) -> np.ndarray:
    """Deterministic page contents derived from each key and a salt (so versions differ)."""
    out = np.empty((len(keys), page_bytes), dtype=np.uint8)
    for i, k in enumerate(keys):
        seed = int.from_bytes(k[:8], "little") ^ (salt * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF)
        out[i] = np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8)
    return out


def write_manifest(path: Path, layout: BlockLayout = TINY) -> None:
    """The MANIFEST.json the Db writes (the CLI reads the layout from it)."""
    path.mkdir(parents=True, exist_ok=True)
    m = {"format": "kvdb-manifest", "version": 1, "layout": layout.to_dict(), "model_id": "test"}
    (path / "MANIFEST.json").write_text(json.dumps(m, sort_keys=True))


def recount(locations) -> dict[int, list[int]]:
    """Per-segment [live record bytes, live blocks] summed from (segment, record bytes) pairs."""
    out: dict[int, list[int]] = {}
    for seg, rb in locations:
        t = out.setdefault(seg, [0, 0])
        t[0] += rb
        t[1] += 1
    return out


def assert_totals(store) -> None:
    """The live set's per-segment totals are those of the live blocks (index and pending), and
    the index's own (C7, kvdb/cold/apply.py) those of its entries."""
    from kvdb.cold.recovery import load_totals

    with store.queue.lock, store.writer.lock:
        assert store.live.totals() == recount((seg, rb) for _k, seg, _off, rb in store.live.scan())
        in_index = recount((e.segment_no, e.record_bytes) for _k, e in store.index.entries())
        persisted = load_totals(store.index)
        assert store.queue.applied == in_index == persisted, (store.queue.applied, in_index, persisted)
