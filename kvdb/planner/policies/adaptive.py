"""``kvdb``: the planner's policy under a guard that learns, online, which ordering pays.

The planner (kvdb.planner.policies.planned) is one way to order a tier; a workload it was not
built for (plans that do not come true, a trace where decayed frequency beats GreedyDual) can
make it worse than LRU. This module keeps it honest with *miniature simulations*: a few small
caches, each fed a fixed random-looking sample of the blocks (spatial sampling: a block is in
the sample when a stable 32-bit hash of its id falls under ``rate * 2**32``, so every access of
a sampled block is seen and none of the others), each run by one candidate ordering at
``rate`` times the real cache's capacity. Their hit counts estimate how each ordering would do
on the whole workload; the real tier follows the best one.

Candidates (``CANDIDATES``):
  ``gd``   the planner with GreedyDual values for unplanned blocks (the default: it starts here);
  ``crf``  the planner with decayed recency-frequency (LRFU's ordering) for unplanned blocks;
  ``nowf`` the planner (GreedyDual) that does not plan from declared workflows, only from hints
           and the gaps it learned: a workflow saying "this agent calls again" does not mean
           its blocks are re-read (a chain broken by shared context inserted before the agent's
           history), and where trusting the declarations costs hits this candidate wins;
  ``lru``  plain LRU -- the guard: when the samples say LRU does better, the tier evicts in
           LRU order, so a workload on which the planner's ideas are wrong costs about nothing
           compared with LRU.

The real tier keeps one planner and one LRU list over the same frames (both see every access,
pin and removal); ``evict`` asks the one the current mode names and tells the other. Switching
between ``gd`` and ``crf`` re-keys the planner's heap (``PlannedReplacer.set_unplanned``);
to or from ``nowf`` turns its planning from workflows off or on (``set_workflows``).

Decisions: a paired test, every ``EPOCH`` sampled block accesses and not before ``WARMUP``
epochs. All minis see the same calls, so call by call each candidate's hits are compared with
those of the mini of the ordering in force: the sum of the differences ``d`` and of ``d**2``
(times DECAY after each decision: a memory of about ten epochs). The tier moves to the
candidate with the largest sum when that sum exceeds ``SWITCH_MARGIN`` of the sampled accesses
and ``SWITCH_Z`` standard deviations of the paired difference (``sqrt(sum d**2)``), so that
sampling noise alone does not move it but a steady loss of a point of hit ratio does; the sums
restart after a switch. A mini cache counts hits as the replay does (kvdb/sim/replay.py S1), on
the sample: the leading run of a call's sampled blocks that it holds. A planner mini is told the
call's length and whether the call's last block is in the sample (``PlannedReplacer.sampled_call``):
the planner sends a call's last block first as a partial block, and the sample's last block is
usually a full one the next turn reads. The hit counts are kept for EXPLAIN.

Capacity: the policy is never told the tier's capacity (kvdb/sim/replay.py S4). The minis
evict when the tier does (in a replay after the host's call_finished, in the engine when the
pool needs a frame), each down to ``rate`` x the frames still resident, so at ``rate`` 1 a
candidate's mini is that candidate exactly. ``describe`` reports the capacity learned this
way (resident frames after the last eviction of a burst).

At ``rate`` 1 (a tier of at most MIN_MINI_BLOCKS frames) the mini of the ordering in force
would repeat the tier itself (G1): the tier's own hits stand for it, call by call, and no mini
of it is kept. A switch away from an ordering makes its mini then, as a copy of the tier
(every frame it holds, none pinned: a mini is never pinned), and drops the mini of the
ordering the tier takes up.

Causal and deterministic: the minis see only what the real policy sees, in the same order; the
sample is a function of block ids only. Costs per access: the planner, an LRU update, and
``rate`` x (the candidates but the one in force at ``rate`` 1) -- ``rate`` is 1/8 by default;
``nowf`` is simulated only once a session has declared a workflow (until then it would decide
exactly as ``gd``).
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Hashable, Sequence
from typing import Any

from kvdb.buffer_pool.replacer import AccessContext, Replacer
from kvdb.compiled import copy_fields
from kvdb.planner.events import SessionBegan
from kvdb.planner.policies.agentplans import PINNED
from kvdb.planner.policies.lru import LruReplacer
from kvdb.planner.policies.planned import PlannedReplacer

CANDIDATES = ("gd", "crf", "nowf", "lru")
_SETTINGS = {"gd": ("gd", True), "crf": ("crf", True), "nowf": ("gd", False)}  # unplanned ordering, workflows
SAMPLE_RATE = 1.0 / 8
MIN_MINI_BLOCKS = 64  # a small tier samples more, so that each mini cache holds at least this many
EPOCH = 256  # sampled block accesses between decisions
DECAY = 0.9  # the paired sums' weight after a decision: a memory of ~10 epochs
WARMUP = 4  # decisions start after this many epochs
SWITCH_MARGIN = 0.002  # a candidate must lead the ordering in force by this share of the sampled accesses
SWITCH_Z = 2.0  # ... and by this many standard deviations of the paired difference
_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def sample_hash(bid: Hashable) -> int:
    """A stable 32-bit hash of a block id (Python's ``hash`` of str/bytes changes per process)."""
    if type(bid) is int:
        return ((bid * _MIX) & _M64) >> 32
    if isinstance(bid, (bytes, bytearray)):
        return zlib.crc32(bid)
    return zlib.crc32(repr(bid).encode())


class _Mini:
    """One candidate's miniature cache: its own frames, table of sampled ids and hit count."""

    def __init__(self, repl: Replacer) -> None:
        self.repl = repl
        n = repl.num_frames
        self.table: dict[Hashable, int] = {}
        self.owner: list[Hashable] = [None] * n
        self.free = list(range(n - 1, -1, -1))
        self.hits = 0
        self.accesses = 0
        self.planned = isinstance(repl, PlannedReplacer)

    def _release(self, f: int) -> None:
        """Frame ``f`` holds no block any more (its replacer already let it go)."""
        del self.table[self.owner[f]]
        self.owner[f] = None
        self.free.append(f)

    def _evict_one(self) -> bool:
        f = self.repl.evict()
        if f is None:
            return False
        self._release(f)
        return True

    def drop(self, bid: Hashable) -> None:
        """Forget block ``bid`` if this mini holds it (the tier removed it)."""
        f = self.table.get(bid)
        if f is not None:
            self.repl.remove(f)
            self._release(f)

    def trim(self, cap: int) -> None:
        while len(self.table) > cap and self._evict_one():
            pass

    def access(self, ids: list, ctx: AccessContext | None, call: tuple[int, bool]) -> int:
        table = self.table
        while True:  # room for the blocks it does not hold (a loop, not a generator: compiled, see setup.py)
            missing = 0
            for b in ids:
                if b not in table:
                    missing += 1
            if missing <= len(self.free):
                break
            if not self._evict_one():
                return 0
        frames = []
        hit = 0
        run = True  # hits count as the replay counts them: the leading run of the call's (sampled) blocks
        for b in ids:
            f = table.get(b)
            if f is None:
                f = self.free.pop()
                table[b] = f
                self.owner[f] = b
                run = False
            elif run:
                hit += 1
            frames.append(f)
        if self.planned:
            self.repl.sampled_call(*call)
        self.repl.record_access(frames, ids, ctx)
        self.hits += hit
        self.accesses += len(ids)
        return hit


class AdaptiveCore:
    """AdaptiveReplacer's state and methods (compiled when the extension is built: adaptive.pxd
    types the fields its per-access methods read)."""

    def __init__(self, num_frames: int, llm_call_s: float | None = None, sample_rate: float = SAMPLE_RATE,
                 candidates: Sequence[str] = CANDIDATES, capacity_frames: int | None = None) -> None:
        Replacer.__init__(self, num_frames)
        opts = {} if llm_call_s is None else {"llm_call_s": llm_call_s}
        self.planner = PlannedReplacer(num_frames, **opts)
        self._lru = LruReplacer(num_frames)
        self.mode = "gd"
        # sized by the cache (the replay passes its resident capacity: a pool sized by the
        # trace's longest call would be a peek at the future, kvdb/sim/replay.py S4)
        c = max(1, capacity_frames if capacity_frames is not None else num_frames)
        self.rate = min(1.0, max(0.0, sample_rate, MIN_MINI_BLOCKS / c))
        self._threshold = int(self.rate * (1 << 32))
        self._shadow = self.rate >= 1.0 and self.mode in candidates  # G1: the tier is the mini of its own ordering
        # at rate 1 a mini has the tier's frames: it takes every call the tier takes, as the
        # tier's own hits (G1) do, so that no call counts for the ordering in force alone
        mini_n = num_frames if self._shadow else int(c * self.rate) * 2 + 16
        self._minis: dict[str, _Mini] = {}
        self._mode_counts = [0, 0]  # at rate 1: the tier's hits and accesses, for the ordering in force
        # until a session declares a workflow, ``nowf`` decides exactly as ``gd``: it is made
        # then, as a copy of ``gd``'s mini cache (a trace without workflows never pays for it)
        self._nowf_later = "nowf" in candidates and "gd" in candidates
        for c in candidates:
            if c == "nowf" and self._nowf_later or self._shadow and c == self.mode:
                continue
            if c == "lru":
                r: Replacer = LruReplacer(mini_n)
            else:
                unplanned, workflows = _SETTINGS[c]
                r = PlannedReplacer(mini_n, unplanned=unplanned, workflows=workflows, **opts)
            self._minis[c] = _Mini(r)
        self._known = bytearray(num_frames)  # 0 unknown, 1 known and not sampled, 2 known and sampled
        self._ids: list[Hashable] = [None] * num_frames  # the block each known frame holds (G1's copies)
        self._resident = 0
        self._cap: int | None = None  # learned capacity of the tier (resident frames after evictions)
        self._evicted_since_access = False
        self._since = 0
        self._seen = 0.0  # sampled accesses, decayed as the paired sums are
        self._pd: dict[str, float] = {}  # per candidate: sum over calls of (its hits - the mode's), decayed
        self._pv: dict[str, float] = {}  # ... and of the squared differences (the paired test's variance)
        self.epochs = 0
        self.switches = 0

    def __deepcopy__(self, memo: dict) -> AdaptiveCore:
        return copy_fields(self, memo)  # compiled, the fields are not in ``__dict__``

    # -- the interface ------------------------------------------------------------------
    def record_access(self, frames, ids=None, ctx: AccessContext | None = None) -> None:
        if self._evicted_since_access:
            self._cap = self._resident
            self._evicted_since_access = False
        self.planner.record_access(frames, ids, ctx)
        self._lru.record_access(frames, ids, ctx)
        known = self._known
        sampled = None
        tier_hits = 0
        run = True  # the tier's hits: the leading run of frames it held before this access
        for j, f in enumerate(frames):
            k = known[f]
            if k == 0:
                run = False
                self._resident += 1
                # sampled? (at rate 1 every block is: no hash taken)
                k = known[f] = 2 if ids is not None and (self.rate >= 1.0 or sample_hash(ids[j]) < self._threshold) else 1
                if self._shadow and ids is not None:
                    self._ids[f] = ids[j]
            elif run:
                tier_hits += 1
            if k == 2:
                if sampled is None:
                    sampled = []
                sampled.append(ids[j])
        if sampled is not None and (self._minis or self._shadow):
            call = (len(frames), known[frames[-1]] == 2)  # the whole call's length; its last block sampled?
            hits = {c: m.access(sampled, ctx, call) for c, m in self._minis.items()}
            if self._shadow:  # G1: every block is sampled, and the tier plays its own ordering
                base = tier_hits
                self._mode_counts[0] += tier_hits
                self._mode_counts[1] += len(sampled)
            else:
                base = hits.get(self.mode, 0)
            pd, pv = self._pd, self._pv
            for c, h in hits.items():  # paired: each candidate against the ordering in force, call by call
                d = h - base
                if d:
                    pd[c] = pd.get(c, 0.0) + d
                    pv[c] = pv.get(c, 0.0) + d * d
            self._seen += len(sampled)
            self._since += len(sampled)
            if self._since >= EPOCH:
                self._decide()

    def _decide(self) -> None:
        self._since = 0
        self.epochs += 1
        minis, pd, pv = self._minis, self._pd, self._pv
        best = max((c for c in minis if c != self.mode), key=lambda c: pd.get(c, 0.0), default=None)
        if best is not None and self.epochs >= WARMUP:  # before that, too few samples to tell anything apart
            d = pd.get(best, 0.0)
            if d > SWITCH_MARGIN * self._seen and d > SWITCH_Z * math.sqrt(pv.get(best, 0.0)):
                self._switch(best)
        self._seen *= DECAY
        for c in pd:
            pd[c] *= DECAY
            pv[c] *= DECAY

    def _switch(self, mode: str) -> None:
        if self._shadow:  # G1: the ordering left gets a mini (the tier as it is), the one taken up none
            self._minis[self.mode] = self._copy_tier()
            new = self._minis.pop(mode)
            self._mode_counts = [new.hits, new.accesses]
        self.mode = mode
        self.switches += 1
        self._pd.clear()  # the differences were against the old ordering
        self._pv.clear()
        if mode != "lru":
            unplanned, workflows = _SETTINGS[mode]
            self.planner.set_unplanned(unplanned)
            self.planner.set_workflows(workflows)

    def _copy_tier(self) -> _Mini:
        """A mini of the ordering in force, made from the tier (G1, at rate 1): a copy of its
        replacer holding the same frames, none pinned, and the hits counted for it so far."""
        repl = copy.deepcopy(self._lru if self.mode == "lru" else self.planner)
        m = _Mini(repl)
        ids, pinned = self._ids, self.planner._state
        m.free = []
        for f in range(repl.num_frames - 1, -1, -1):
            bid = ids[f] if self._known[f] else None
            if bid is None:  # free, or held without an id (or pinned before its first access): no mini names it
                repl.remove(f)
                m.free.append(f)
            else:
                if pinned[f] == PINNED:  # the tier's pin (planner and LRU see the same ones)
                    repl.set_evictable(f, True)
                m.table[bid] = f
                m.owner[f] = bid
        m.hits, m.accesses = self._mode_counts
        return m

    def on_event(self, event: Any) -> None:
        if self._nowf_later and isinstance(event, SessionBegan) and event.workflow is not None:
            self._nowf_later = False
            twin = copy.deepcopy(self._minis["gd"]) if "gd" in self._minis else self._copy_tier()
            twin.repl.set_workflows(False)
            self._minis["nowf"] = twin
        self.planner.on_event(event)
        for m in self._minis.values():
            m.repl.on_event(event)

    def evict(self) -> int | None:
        if self.mode == "lru":
            f = self._lru.evict()
            if f is not None:
                self.planner.remove(f)
        else:
            f = self.planner.evict()
            if f is not None:
                self._lru.remove(f)
        if f is not None:
            self._forget(f)
            self._evicted_since_access = True
            # the minis evict when the tier does (after the host's call_finished in a replay,
            # when it needs a frame in the engine), down to their share of what stays resident
            cap = max(1, int(self._resident * self.rate))
            for m in self._minis.values():
                if len(m.table) > cap:  # most evictions of a burst leave the minis within their share
                    m.trim(cap)
        return f

    def _forget(self, f: int) -> None:
        if self._known[f]:
            self._known[f] = 0
            self._ids[f] = None
            self._resident -= 1

    def set_evictable(self, frame: int, evictable: bool) -> None:
        self.planner.set_evictable(frame, evictable)
        self._lru.set_evictable(frame, evictable)

    def remove(self, frame: int) -> None:
        self.planner.remove(frame)
        self._lru.remove(frame)
        if self._shadow and self._known[frame] == 2:  # G1: the tier's hits see the removal, so must its rivals
            bid = self._ids[frame]
            for m in self._minis.values():
                m.drop(bid)
        self._forget(frame)

    def num_evictable(self) -> int:
        return self.planner.num_evictable()

    # -- what it learned ------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The guard's state for EXPLAIN: the ordering in force, each candidate's sampled hit ratio
        and the tier planner's learned P(an orphaned block is read again) (kvdb/planner/policies/planned.py, O1)
        and P(an agent's first call reads the prefix its kind read in sessions like its own) (N1)."""
        return {
            "mode": self.mode,
            "switches": self.switches,
            "sample_rate": self.rate,
            "learned_capacity_blocks": self._cap,
            "orphans": self.planner.orphan_reuse(),
            "newcomers": self.planner.newcomer_reuse(),
            "candidates": {c: {"sampled_accesses": a, "sampled_hit_ratio": h / a if a else None}
                           for c, (h, a) in self._counts().items()},
        }

    def _counts(self) -> dict[str, tuple[int, int]]:
        """(hits, accesses) per candidate: its mini's, or the tier's for the ordering it plays (G1)."""
        out = {c: (m.hits, m.accesses) for c, m in self._minis.items()}
        if self._shadow:
            out[self.mode] = tuple(self._mode_counts)
        return {c: out[c] for c in CANDIDATES if c in out}

    def predicted_return(self, session_id: str) -> float | None:
        return self.planner.predicted_return(session_id)

    def __getattr__(self, name: str) -> Any:  # debug_* and other read-only views of the planner
        if name.startswith("debug_"):
            return getattr(self.planner, name)
        raise AttributeError(name)


class AdaptiveReplacer(AdaptiveCore, Replacer):
    name = "kvdb"
