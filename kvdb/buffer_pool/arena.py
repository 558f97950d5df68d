"""Arenas: one preallocated uint8 tensor of page frames per tier, and the batched copies in and out.

The device arena lives on CUDA when the Db asks for it and CUDA is present, otherwise on the
CPU (tests run every device-tier path on the CPU). The host arena is pinned when CUDA is present
so host<->device copies can run asynchronously. This module is the one place that touches arena
memory: everything above it names frames.

Copies are batched by *runs*: a batch of frames is split into maximal runs of consecutive
frames, and each run is one ``copy_`` of contiguous bytes (memcpy speed; ``index_copy_`` on a
uint8 arena runs ~5x slower, see DESIGN.md). The pool allocates fresh frames in ascending order,
so a batch of new pages is usually a single run.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvdb.errors import CapacityError


def frame_runs(frames: Sequence[int], rows: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """Split (row, frame) pairs into runs consecutive on both sides: (row_start, frame_start, length).

    rows defaults to 0..n-1 (a dense batch).
    """
    n = len(frames)
    if n == 0:
        return []
    f = np.asarray(frames, dtype=np.int64)
    r = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(f) != 1) | (np.diff(r) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(r[s]), int(f[s]), int(e - s)) for s, e in zip(starts, ends)]


def cuda_available() -> bool:
    return torch.cuda.is_available()


class Arena:
    """``num_frames`` pages of ``page_bytes`` each, on one torch device."""

    def __init__(self, name: str, num_frames: int, page_bytes: int, device: torch.device) -> None:
        if num_frames <= 0:
            raise CapacityError(f"{name} arena holds no page of {page_bytes} bytes")
        self.name = name
        self.num_frames = num_frames
        self.page_bytes = page_bytes
        self.device = device
        pin = device.type == "cpu" and cuda_available()
        self.data = torch.empty((num_frames, page_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
        self.pinned = pin
        if device.type == "cpu" and not pin:
            # fault every page in now: first-touch page faults during a put cost ~3x its copy
            self.data.zero_()

    @property
    def capacity_bytes(self) -> int:
        return self.num_frames * self.page_bytes

    def write(self, frames: Sequence[int], src: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """arena[frames[i]] := src[rows[i]] (rows default 0..n-1); src uint8 [m, page_bytes], any device."""
        non_blocking = src.device.type != self.device.type
        for b, f, n in frame_runs(frames, rows):
            self.data[f : f + n].copy_(src[b : b + n], non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()

    def read(self, frames: Sequence[int], dst: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """dst[rows[i]] := arena[frames[i]] (rows default 0..n-1); dst uint8 [m, page_bytes], any device."""
        non_blocking = dst.device.type != self.device.type
        for b, f, n in frame_runs(frames, rows):
            dst[b : b + n].copy_(self.data[f : f + n], non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()

    def copy_to(self, frames: Sequence[int], other: "Arena", other_frames: Sequence[int]) -> None:
        """Move pages between arenas (demotion / promotion): other[other_frames[i]] := self[frames[i]].

        One copy per joint run (consecutive on both sides); no staging buffer.
        """
        non_blocking = self.device.type != other.device.type
        for of, f, n in frame_runs(frames, other_frames):
            other.data[of : of + n].copy_(self.data[f : f + n], non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()

    def page(self, frame: int) -> torch.Tensor:
        """A zero-copy uint8 view of one page."""
        return self.data[frame]
