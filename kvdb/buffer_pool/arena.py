"""Arenas: one preallocated uint8 tensor of page frames per tier, and the batched copies in and out.

The device arena lives on CUDA when the Db asks for it and CUDA is present, otherwise on the
CPU (tests run every device-tier path on the CPU). The host arena is pinned when CUDA is present
so host<->device copies can run asynchronously. This module is the one place that touches arena
memory: everything above it names frames.

Copies are batched by *runs*: a batch of frames is split into maximal runs of consecutive
frames. One run is one torch ``copy_`` of contiguous bytes (memcpy speed, multi-threaded;
``index_copy_`` on a uint8 arena ran at 0.07-0.15x of it: docs/buffer_pool.md "Pages and
arenas"). The pool allocates fresh
frames in ascending order, so a batch of new pages is usually a single run. A scattered batch
between two CPU tensors is one call into the native page copier (kvdb.native.copy_tensor_pages): a
torch ``copy_`` per page costs ~10 us of dispatch, which dominates small pages (measured on
4 KiB pages: 13 us/page with a copy_ per page, 0.5 us/page native). A single CPU run of at
most NATIVE_COPY_BYTES goes native too: torch's copy_ of a 64 KiB page splits it over its
OpenMP threads, and on a loaded machine waiting for a descheduled helper thread cost 1-15 ms
per copy (one-block reads of 64 KiB pages under load 3-4 on 2 cores; ~10 us unloaded), and a
disk read's promotion of a 4 MiB slice competes with the read-ahead thread (docs/buffer_pool.md).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvdb import native
from kvdb.errors import CapacityError


#: a CPU-to-CPU copy of at most this many bytes in one run is one native memcpy, not a torch copy_
NATIVE_COPY_BYTES = 4 << 20
#: frame_runs splits at most this many pairs in Python (numpy's set-up costs more below it)
SMALL_RUNS = 16


def frame_runs(frames: Sequence[int], rows: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """Split (row, frame) pairs into runs consecutive on both sides: (row_start, frame_start, length).

    rows defaults to 0..n-1 (a dense batch).
    """
    n = len(frames)
    if n == 0:
        return []
    if n <= SMALL_RUNS:  # a few pages (one-block reads): a Python loop beats numpy's set-up
        rs = range(n) if rows is None else rows
        out: list[list[int]] = []
        for r_, f_ in zip(rs, frames):
            if out and r_ == out[-1][0] + out[-1][2] and f_ == out[-1][1] + out[-1][2]:
                out[-1][2] += 1
            else:
                out.append([int(r_), int(f_), 1])
        return [(a, b, c) for a, b, c in out]
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
        # never an inference tensor, even when the Db is opened under torch.inference_mode(): the
        # background mover writes arenas from a thread outside it
        with torch.inference_mode(False):
            self.data = torch.empty((num_frames, page_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
        self.pinned = pin
        if device.type == "cpu" and not pin:
            # fault every page in now: first-touch page faults during a put cost ~3x its copy
            with torch.inference_mode(False):
                self.data.zero_()

    @property
    def capacity_bytes(self) -> int:
        return self.num_frames * self.page_bytes

    def _copy(self, dst: torch.Tensor, dst_idx, src: torch.Tensor, src_idx) -> None:
        """dst[dst_idx[i]] := src[src_idx[i]] for whole pages; one of the index lists is a frame
        list, the other rows of a batch (None = 0..n-1)."""
        cpu = dst.is_cpu and src.is_cpu
        n = len(dst_idx if dst_idx is not None else src_idx)
        if cpu and n * self.page_bytes <= NATIVE_COPY_BYTES:
            native.copy_tensor_pages(dst, dst_idx, src, src_idx, self.page_bytes)
            return
        runs = frame_runs(src_idx if src_idx is not None else range(len(dst_idx)), dst_idx)
        if cpu and len(runs) > 1:
            native.copy_tensor_pages(dst, dst_idx, src, src_idx, self.page_bytes)
            return
        non_blocking = dst.device.type != src.device.type
        for d, s_, n in runs:
            dst[d : d + n].copy_(src[s_ : s_ + n], non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()

    def write(self, frames: Sequence[int], src: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """arena[frames[i]] := src[rows[i]] (rows default 0..n-1); src uint8 [m, page_bytes], any device."""
        self._copy(self.data, list(frames), src, None if rows is None else list(rows))

    def read(self, frames: Sequence[int], dst: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """dst[rows[i]] := arena[frames[i]] (rows default 0..n-1); dst uint8 [m, page_bytes], any device."""
        rows = list(range(len(frames))) if rows is None else list(rows)
        self._copy(dst, rows, self.data, list(frames))

    def copy_to(self, frames: Sequence[int], other: "Arena", other_frames: Sequence[int]) -> None:
        """Move pages between arenas (demotion / promotion): other[other_frames[i]] := self[frames[i]]."""
        self._copy(other.data, list(other_frames), self.data, list(frames))

    def page(self, frame: int) -> torch.Tensor:
        """A zero-copy uint8 view of one page."""
        return self.data[frame]
