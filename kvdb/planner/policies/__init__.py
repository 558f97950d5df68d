"""Every eviction policy kvdb ships, behind the buffer pool's Replacer interface.

The engine and the simulator build policies through ``make_policy`` and run the same objects.
``belady`` is replay-only: it needs the trace's future (``future=`` the calls' block ids).

Modules: ``lru`` and ``arc``, and the classic baselines ``lirs``, ``lrfu``, ``s3fifo``, ``sieve``,
``twoq`` (``2q``) and ``wtinylfu`` (with ``sketch``, its frequency sketch) over ``resident`` (their
base: frames, ids, pins) -- the classic policies, also built by ``make_replacer`` --
``ordered`` (bases over ordered dicts), ``heap`` (a base over a heap of keys), ``lfu``,
``kvflow``, ``tokencake``, ``planned`` (``planner``: its frames and plans, with ``nextuse``
estimating each agent's next call, ``gaps`` its learned residuals and ``reuse`` the value of
unplanned blocks), ``adaptive`` (``kvdb``: the planner under a guard of miniature simulations
that picks its ordering for unplanned blocks, or LRU, online), ``belady``. The interface and its invariants R1-R4: kvdb/buffer_pool/replacer.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvdb.buffer_pool.replacer import Replacer
from kvdb.errors import InvalidInput
from kvdb.planner.policies.adaptive import AdaptiveReplacer
from kvdb.planner.policies.arc import ArcReplacer
from kvdb.planner.policies.belady import BeladyReplacer
from kvdb.planner.policies.kvflow import KvflowReplacer
from kvdb.planner.policies.lfu import LfuReplacer
from kvdb.planner.policies.lirs import LirsReplacer
from kvdb.planner.policies.lrfu import LrfuReplacer
from kvdb.planner.policies.lru import LruReplacer
from kvdb.planner.policies.planned import PlannedReplacer
from kvdb.planner.policies.s3fifo import S3FifoReplacer
from kvdb.planner.policies.sieve import SieveReplacer
from kvdb.planner.policies.tokencake import TokencakeReplacer
from kvdb.planner.policies.twoq import TwoQReplacer
from kvdb.planner.policies.wtinylfu import WTinyLfuReplacer

CLASSIC: dict[str, type[Replacer]] = {
    "lru": LruReplacer,
    "arc": ArcReplacer,
    "lirs": LirsReplacer,
    "lrfu": LrfuReplacer,
    "s3fifo": S3FifoReplacer,
    "sieve": SieveReplacer,
    "2q": TwoQReplacer,
    "wtinylfu": WTinyLfuReplacer,
}

POLICIES: dict[str, type[Replacer]] = {
    **CLASSIC,
    "lfu": LfuReplacer,
    "kvflow": KvflowReplacer,
    "tokencake": TokencakeReplacer,
    "kvdb": AdaptiveReplacer,  # the planner under its guard
    "planner": PlannedReplacer,  # the planner alone (GreedyDual; unplanned="crf" for LRFU's ordering)
    "belady": BeladyReplacer,
}
REPLAY_ONLY = frozenset({"belady"})
REPLACERS: dict[str, type[Replacer]] = dict(CLASSIC)  # the classic ones
# policies sized by the cache size c (queue shares, ghost bounds): the replay passes its resident
# capacity as ``capacity_frames``, never its pool, which has room for one call more (S4)
CAPACITY_SIZED = frozenset({"arc", "lirs", "lrfu", "s3fifo", "2q", "wtinylfu", "kvdb"})


def make_policy(name: str, num_frames: int, *, future: Sequence[Sequence[Hashable]] | None = None,
                **options: Any) -> Replacer:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise InvalidInput(f"unknown policy {name!r}; one of {sorted(POLICIES)}") from None
    if name in REPLAY_ONLY:
        return cls(num_frames, future=future, **options)
    return cls(num_frames, **options)


def make_replacer(name: str, num_frames: int) -> Replacer:
    """A classic policy (``REPLACERS``) with its defaults."""
    try:
        cls = REPLACERS[name]
    except KeyError:
        raise InvalidInput(f"unknown replacer {name!r}; one of {sorted(REPLACERS)}") from None
    return cls(num_frames)


__all__ = [
    "CAPACITY_SIZED",
    "POLICIES",
    "REPLACERS",
    "REPLAY_ONLY",
    "AdaptiveReplacer",
    "ArcReplacer",
    "BeladyReplacer",
    "KvflowReplacer",
    "LfuReplacer",
    "LirsReplacer",
    "LrfuReplacer",
    "LruReplacer",
    "PlannedReplacer",
    "S3FifoReplacer",
    "SieveReplacer",
    "TokencakeReplacer",
    "TwoQReplacer",
    "WTinyLfuReplacer",
    "make_policy",
    "make_replacer",
]
