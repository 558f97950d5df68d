"""Dirty pages: the pool's bit per frame for a page not yet in the cold tier, and the batches the
Db writes back (``dirty_batches``: views of the arena at close and flush, copies in the
background, kvdb/db/writeback.py). Part of ``BufferPool`` (kvdb/buffer_pool/pool.py), under
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

    @staticmethod
    def _dirty_frames(t: Tier):
        """The frames of tier ``t`` whose dirty bit is set, ascending (numpy: no step per frame;
        a free frame's bit is cleared wherever it is freed)."""
        return np.flatnonzero(np.frombuffer(t.dirty, dtype=np.uint8))

    def dirty_batches(self, max_bytes: int, staging: torch.Tensor | None = None, views: bool = True):
        """Every dirty resident page, fastest tier first, in batches of at most ``max_bytes``:
        yields (keys, pages uint8 [n, page_bytes] on the CPU, positions). With ``views``, a run of
        consecutive frames of a CPU arena is a view of the arena (no copy: at close and flush,
        kvdb/db/write.py); anything else is copied into ``staging`` (reused for each batch; the
        background writer, kvdb/db/writeback.py, takes one batch under the Db's lock and writes
        it outside). Nothing changes: ``mark_clean`` once a batch is written; the caller writes a
        batch before it asks for the next."""
        per = max(1, max_bytes // self.page_bytes)
        for t in self.tiers:
            if t is None:
                continue
            frames = self._dirty_frames(t)
            data = t.arena.data
            for i in range(0, len(frames), per):
                chunk = [f for f in frames[i : i + per].tolist() if t.keys[f] is not None]
                if not chunk:
                    continue
                keys = [t.keys[f] for f in chunk]
                positions = [t.positions[f] for f in chunk]
                if views and data.is_cpu and chunk[-1] - chunk[0] == len(chunk) - 1:
                    yield keys, data[chunk[0] : chunk[-1] + 1], positions
                    continue
                if staging is None or staging.shape[0] < len(chunk):
                    staging = torch.empty((min(per, len(frames)), self.page_bytes), dtype=torch.uint8)
                t.arena.read(chunk, staging)
                yield keys, staging[: len(chunk)], positions
