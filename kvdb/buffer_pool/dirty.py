"""Dirty pages: the pool's bit per frame for a page not yet in the cold tier, and the batches the
Db writes back (at close and flush: ``dirty_batches``, views of the arena; in the background:
``copy_dirty``, kvdb/db/writeback.py). Part of ``BufferPool`` (kvdb/buffer_pool/pool.py), under
the Db's lock like the rest of it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvdb.buffer_pool.tier import Tier


class DirtyPages:
    """Mixin of ``BufferPool``: reads its ``tiers``, ``table`` and ``page_bytes``."""

    def is_dirty(self, key: bytes) -> bool:
        """Whether a resident page is not yet in the cold tier (False when not resident)."""
        code = self.table.get(key)
        return code is not None and self.tiers[code & 1].dirty[code >> 1] == 1  # type: ignore[union-attr]

    def mark_clean(self, keys: Sequence[bytes]) -> None:
        """These keys' pages are in the cold tier now (keys no longer resident are skipped)."""
        get = self.table.get
        for k in keys:
            code = get(k)
            if code is not None:
                self.tiers[code & 1].dirty[code >> 1] = 0  # type: ignore[union-attr]

    def dirty_count(self) -> int:
        """How many resident pages are not yet in the cold tier."""
        return sum(len(self._dirty_frames(t)) for t in self.tiers if t is not None)

    def _dirty_frames(self, t: Tier) -> list[int]:
        """The frames of tier ``t`` holding dirty pages, ascending."""
        keys = t.keys
        return [f for f in np.flatnonzero(np.frombuffer(t.dirty, dtype=np.uint8)).tolist() if keys[f] is not None]

    def copy_dirty(self, staging: torch.Tensor) -> tuple[list[bytes], torch.Tensor, list[int]]:
        """Up to ``len(staging)`` dirty pages, fastest tier first, copied into ``staging``:
        (keys, staging[:n], positions). Nothing changes: ``mark_clean`` once they are written."""
        keys: list[bytes] = []
        positions: list[int] = []
        for t in self.tiers:
            room = staging.shape[0] - len(keys)
            if t is None or room <= 0:
                continue
            frames = self._dirty_frames(t)[:room]
            if frames:
                t.arena.read(frames, staging, range(len(keys), len(keys) + len(frames)))
                keys.extend(t.keys[f] for f in frames)
                positions.extend(t.positions[f] for f in frames)
        return keys, staging[: len(keys)], positions

    def dirty_batches(self, max_bytes: int, staging: torch.Tensor | None = None):
        """Every dirty resident page, in batches of at most ``max_bytes``: yields (keys, pages
        uint8 [n, page_bytes] on the CPU, positions). A run of consecutive frames of a CPU arena
        is a view of the arena (no copy); scattered or device pages are copied into ``staging``
        (reused for each batch: the caller writes a batch before it asks for the next). Nothing
        changes: ``mark_clean`` once a batch is written; the caller keeps the pool still meanwhile."""
        per = max(1, max_bytes // self.page_bytes)
        for t in self.tiers:
            if t is None:
                continue
            frames = self._dirty_frames(t)
            data = t.arena.data
            i = 0
            while i < len(frames):
                chunk = frames[i : i + per]
                i += len(chunk)
                keys = [t.keys[f] for f in chunk]
                positions = [t.positions[f] for f in chunk]
                if data.is_cpu and chunk[-1] - chunk[0] == len(chunk) - 1:
                    yield keys, data[chunk[0] : chunk[-1] + 1], positions
                    continue
                if staging is None or staging.shape[0] < len(chunk):
                    staging = torch.empty((min(per, len(frames)), self.page_bytes), dtype=torch.uint8)
                t.arena.read(chunk, staging)
                yield keys, staging[: len(chunk)], positions
