"""Handles a Db gives out: pinned pages (zero-copy views) and reserved frames (landing)."""

from __future__ import annotations

from typing import Callable

import torch

from kvdb.buffer_pool.pool import TIER_NAMES, Tier
from kvdb.errors import InvalidInput


class PinnedPages:
    """Zero-copy views of pinned pages; the pages stay resident until ``release`` / exit.

    ``pages[i]`` is a tensor of ``layout.block_shape`` and ``layout.dtype`` aliasing the arena
    frame (on the device tier's device, or host memory); ``tiers[i]`` names the tier. Writing
    through a view changes the stored block: treat views as read-only.
    """

    def __init__(self, unpin: Callable[[list], None], handles: list[tuple[Tier, int]],
                 pages: list[torch.Tensor]) -> None:
        self._unpin = unpin  # the Db's: takes its lock, unpins the handles
        self._handles = handles
        self.pages = pages
        self.tiers = [TIER_NAMES[t.index] for t, _ in handles]
        self._released = False

    def __len__(self) -> int:
        return len(self.pages)

    def __getitem__(self, i):
        return self.pages[i]

    def __iter__(self):
        return iter(self.pages)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._unpin(self._handles)

    def __enter__(self) -> "PinnedPages":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ReservedFrames:
    """Host arena frames lent out by ``Db.reserve_frames``: bytes are written into them in place
    (e.g. by the Transfer Engine), then ``Db.commit_frames`` makes them stored pages or
    ``Db.release_frames`` hands them back. Until then no reader sees them and nothing evicts them.

    ``frames[i]`` is a frame number, ``rows[i]`` a uint8 [page_bytes] view of it, ``addrs[i]``
    its address; ``arena`` is the whole host arena ([num_frames, page_bytes] uint8), for
    registering it with an engine once. ``res[a:b]`` is the reservation of those frames.
    """

    def __init__(self, arena: torch.Tensor, frames: list[int]) -> None:
        self.arena = arena
        self.frames = frames
        self.page_bytes = int(arena.shape[1])

    @property
    def rows(self) -> list[torch.Tensor]:
        return [self.arena[f] for f in self.frames]

    @property
    def addrs(self) -> list[int]:
        base = self.arena.data_ptr()
        return [base + f * self.page_bytes for f in self.frames]

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, s: slice) -> "ReservedFrames":
        if not isinstance(s, slice):
            raise InvalidInput("index a ReservedFrames with a slice")
        return ReservedFrames(self.arena, self.frames[s])
