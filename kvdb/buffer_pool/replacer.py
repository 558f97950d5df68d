"""The replacer interface: how a tier of the buffer pool asks a policy for eviction victims.

A replacer picks eviction victims among the *evictable* frames of one tier (frames are ints in
``[0, num_frames)``). The pool (and the simulator, kvdb/sim/, which drives the very same
objects) reports every request's frames through ``record_access``; pinned frames are made
non-evictable with ``set_evictable(frame, False)`` and are never returned by ``evict``.

Invariants (tests cite them):
  R1  evict() never returns a non-evictable frame, nor a frame it was not told about.
  R2  after evict() or remove(f), f is unknown to the replacer until it is accessed again.
  R3  among the frames of one record_access call, deeper frames (later in the list) are
      evicted before shallower ones when nothing else tells them apart.
  R4  num_evictable() equals the number of known, evictable frames.

Frames enter with ``record_access`` (evictable by default). Block ids (``ids``) are opaque,
hashable identities of the blocks in those frames (BlockKey in the engine, hash id in the
simulator); policies with ghost lists (ARC) use them, others ignore them. ``ctx`` carries what
the planner knows about the request (kvdb/planner/); policies that do not plan ignore it.

The policies themselves -- the classic LRU (the default) and ARC, and the planner's LFU, kvflow,
tokencake, kvdb (planned) and belady (replay only) -- live in one package, kvdb/planner/policies/,
built by name with ``make_policy``. The pool knows only this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from kvdb.errors import InvalidInput


@dataclass
class AccessContext:
    """What a request tells the replacer beyond its frames. All fields optional."""

    now_s: float = 0.0
    session_id: str | None = None
    tenant: str | None = None
    positions: Sequence[int] | None = None  # block depth of each frame in the chain
    hints: dict[str, Any] = field(default_factory=dict)


class Replacer(ABC):
    name = "abstract"

    def __init__(self, num_frames: int) -> None:
        if num_frames <= 0:
            raise InvalidInput(f"a replacer needs at least one frame, got {num_frames}")
        self.num_frames = num_frames

    @abstractmethod
    def record_access(
        self, frames: Sequence[int], ids: Sequence[Hashable] | None = None, ctx: AccessContext | None = None
    ) -> None:
        """One request touched these frames, in chain order (index 0 = shallowest)."""

    @abstractmethod
    def set_evictable(self, frame: int, evictable: bool) -> None: ...

    @abstractmethod
    def evict(self) -> int | None:
        """Remove and return a victim frame; None when no frame is evictable (an outcome)."""

    @abstractmethod
    def remove(self, frame: int) -> None:
        """Forget a frame the pool freed itself (delete); no-op for unknown frames.

        Every method raises InvalidInput for a frame outside ``[0, num_frames)``."""

    @abstractmethod
    def num_evictable(self) -> int: ...

    def on_event(self, event: Any) -> None:
        """Workflow / session events from the planner; classic policies ignore them."""

    def _check_frames(self, frames: Sequence[int]) -> None:
        """Every frame of a call in range before any is touched (``-1`` would index the last)."""
        n = self.num_frames
        for f in frames:
            if not 0 <= f < n:
                self._check(f)

    def _check(self, frame: int) -> None:
        if not 0 <= frame < self.num_frames:
            raise InvalidInput(f"frame {frame} outside [0, {self.num_frames})")
