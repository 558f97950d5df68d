"""Every eviction policy kvdb ships, behind the buffer pool's Replacer interface.

The engine and the simulator build policies through ``make_policy`` and run the same objects.
``belady`` is replay-only: it needs the trace's future (``future=`` the calls' block ids).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvdb.buffer_pool.replacer import ArcReplacer, LruReplacer, Replacer
from kvdb.errors import InvalidInput
from kvdb.planner.policies.belady import BeladyReplacer
from kvdb.planner.policies.kvflow import KvflowReplacer
from kvdb.planner.policies.lfu import LfuReplacer
from kvdb.planner.policies.planned import PlannedReplacer
from kvdb.planner.policies.tokencake import TokencakeReplacer

POLICIES: dict[str, type[Replacer]] = {
    "lru": LruReplacer,
    "lfu": LfuReplacer,
    "arc": ArcReplacer,
    "kvflow": KvflowReplacer,
    "tokencake": TokencakeReplacer,
    "kvdb": PlannedReplacer,
    "belady": BeladyReplacer,
}
REPLAY_ONLY = frozenset({"belady"})


def make_policy(name: str, num_frames: int, *, future: Sequence[Sequence[Hashable]] | None = None,
                **options: Any) -> Replacer:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise InvalidInput(f"unknown policy {name!r}; one of {sorted(POLICIES)}") from None
    if name in REPLAY_ONLY:
        return cls(num_frames, future=future, **options)
    return cls(num_frames, **options)


__all__ = [
    "POLICIES",
    "REPLAY_ONLY",
    "BeladyReplacer",
    "KvflowReplacer",
    "LfuReplacer",
    "PlannedReplacer",
    "TokencakeReplacer",
    "make_policy",
]
