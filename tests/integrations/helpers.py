"""Helpers shared by the integration tests (not fixtures: plain functions)."""

from __future__ import annotations

from pathlib import Path

import torch


def log_segments(path: Path) -> list[Path]:
    segs = sorted(p for p in (Path(path) / "wal").rglob("*") if p.is_file())
    assert segs, f"no log segment under {Path(path) / 'wal'}"
    return segs


def corrupt_block(path: Path, block: torch.Tensor) -> None:
    """Flip one byte in the middle of ``block``'s payload in the log of the Db at ``path`` (raw
    codec: the payload is the block's bytes verbatim). Exactly one occurrence must exist."""
    needle = block.contiguous().view(torch.uint8).numpy().tobytes()
    hits = []
    for seg in log_segments(path):
        at = seg.read_bytes().find(needle)
        if at >= 0:
            hits.append((seg, at))
    assert len(hits) == 1, f"block payload found {len(hits)} times in the log"
    seg, at = hits[0]
    with open(seg, "r+b") as f:
        f.seek(at + len(needle) // 2)
        b = f.read(1)
        f.seek(at + len(needle) // 2)
        f.write(bytes([b[0] ^ 0x5A]))
