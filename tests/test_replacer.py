"""LRU and ARC (kvdb/planner/policies/lru.py, arc.py) with tiny frame counts and exact victim
orders, the replacer invariants R1-R4 (kvdb/buffer_pool/replacer.py) for every classic policy
(``REPLACERS``: also lirs, lrfu, s3fifo, sieve, 2q, wtinylfu, whose own sequences are in
tests/planner/test_classic.py), and hypothesis state machines."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvdb.buffer_pool.replacer import AccessContext
from kvdb.errors import InvalidInput
from kvdb.planner.policies import (
    CAPACITY_SIZED,
    REPLACERS,
    ArcReplacer,
    LruReplacer,
    make_policy,
    make_replacer,
)


def drain(r) -> list[int]:
    """Every victim the replacer gives, in order, until it says None."""
    out = []
    while (f := r.evict()) is not None:
        out.append(f)
        assert len(out) <= r.num_frames
    return out


# ---------------------------------------------------------------- LRU


def test_lru_bustub_sample():
    # Scenario: BusTub's LRU sample adapted: six frames accessed one by one, frame 5 pinned;
    # a re-access moves frame 0 to the recent end; evictions come from the old end.
    r = LruReplacer(7)
    for f in range(6):
        r.record_access([f])
    r.set_evictable(5, False)
    assert r.num_evictable() == 5
    assert r.debug_order() == [0, 1, 2, 3, 4]
    r.record_access([0])
    assert [r.evict(), r.evict(), r.evict()] == [1, 2, 3]
    assert r.num_evictable() == 2
    r.record_access([2])
    r.record_access([3])
    r.set_evictable(4, False)  # 4 pinned: 0 is now the oldest evictable
    assert r.evict() == 0
    assert r.num_evictable() == 2
    r.set_evictable(5, True)  # unpinning makes 5 the most recent
    r.set_evictable(4, True)
    assert r.debug_order() == [2, 3, 5, 4]
    assert drain(r) == [2, 3, 5, 4]
    assert r.evict() is None and r.num_evictable() == 0


def test_lru_one_call_evicts_deepest_first_r3():
    # Scenario: one request touches a 3-block chain; R3: the deepest block goes first, and a
    # later request's chain is more recent than all of the first one.
    r = LruReplacer(8)
    r.record_access([0, 1, 2])
    r.record_access([5, 6])
    assert r.debug_order() == [2, 1, 0, 6, 5]
    # re-touching a chain prefix moves just those frames, shallowest most recent
    r.record_access([0, 1])
    assert drain(r) == [2, 6, 5, 1, 0]


def test_lru_pinned_frames_never_evicted_r1():
    # Scenario: 3 frames, 2 pinned; only the unpinned one is ever a victim; then none is.
    r = LruReplacer(3)
    r.record_access([0, 1, 2])
    r.set_evictable(0, False)
    r.set_evictable(2, False)
    assert r.num_evictable() == 1
    assert r.evict() == 1
    assert r.evict() is None  # no free frame is an outcome, not an exception
    # accessing a pinned frame keeps it pinned
    r.record_access([0])
    assert r.evict() is None and r.num_evictable() == 0
    r.set_evictable(2, True)
    r.set_evictable(0, True)
    assert drain(r) == [2, 0]


def test_lru_pin_before_first_access():
    # Scenario: the pool pins a frame while filling it, then records the access, then unpins.
    r = LruReplacer(2)
    r.set_evictable(1, False)
    r.record_access([1])
    r.record_access([0])
    assert r.num_evictable() == 1 and r.evict() == 0
    r.set_evictable(1, True)
    assert r.evict() == 1


def test_lru_evict_and_remove_forget_the_frame_r2():
    # Scenario: after evict(f) or remove(f), f is unknown (R2): unpinning or removing it again
    # does nothing, and it is never a victim until accessed again.
    r = LruReplacer(4)
    r.record_access([0, 1, 2, 3])
    assert r.evict() == 3
    r.set_evictable(3, True)  # unknown frame: no effect
    r.remove(2)
    r.remove(2)  # removing an unknown frame is a no-op
    r.set_evictable(2, True)
    assert r.num_evictable() == 2
    assert drain(r) == [1, 0]
    r.record_access([2])
    assert drain(r) == [2]
    # removing a pinned frame forgets the pin too
    r.set_evictable(1, False)
    r.remove(1)
    r.set_evictable(1, True)
    assert r.num_evictable() == 0 and r.evict() is None


def test_lru_duplicate_frames_in_one_call():
    # Scenario: a frame listed twice in one call ends where its shallowest mention puts it.
    r = LruReplacer(3)
    r.record_access([0, 1, 0])
    assert r.num_evictable() == 2
    assert r.debug_order() == [1, 0]


# ---------------------------------------------------------------- ARC


def test_arc_recency_then_frequency():
    # Scenario: 3 blocks seen once (T1), block a seen again (T2); T1 drains before T2.
    r = ArcReplacer(4)
    r.record_access([0], ids=["a"])
    r.record_access([1], ids=["b"])
    r.record_access([2], ids=["c"])
    r.record_access([0], ids=["a"])
    assert r.num_evictable() == 3
    assert drain(r) == [1, 2, 0]


def test_arc_b1_ghost_hit_protects_t1():
    # Scenario: 2 frames. a is evicted to ghost list B1; when a comes back into frame 0 the
    # ghost hit raises the T1 target p to 1, so T1's b is kept and a (in T2) is the victim.
    # The same steps with a fresh block z evict b instead.
    def run(new_id: str) -> int:
        r = ArcReplacer(2)
        r.record_access([0, 1], ids=["a", "b"])  # deepest first: T1 = [b, a]
        assert r.evict() == 1  # b is T1's LRU end
        r.record_access([1], ids=["b2"])
        assert r.evict() == 0  # a, now the T1 LRU end, goes to B1
        r.record_access([0], ids=[new_id])
        return r.evict()

    assert run("a") == 0
    assert run("z") == 1


def test_arc_b2_ghost_hit_shrinks_t1_target():
    # Scenario: 2 frames. a goes T1 -> B1 -> (hit, p=1) T2 -> B2; a B2 hit lowers p back to 0,
    # so the next victim comes from T1 (b) although T1 holds a single frame.
    r = ArcReplacer(2)
    r.record_access([0], ids=["a"])
    r.record_access([1], ids=["b"])
    assert r.evict() == 0  # a -> B1
    r.record_access([0], ids=["a"])  # B1 hit: p = 1, a in T2
    assert r.evict() == 0  # |T1| = 1 is not above p = 1: the victim comes from T2; a -> B2
    r.record_access([0], ids=["a"])  # B2 hit: p = 0, a in T2
    assert r.evict() == 1
    assert r.evict() == 0


def test_arc_one_call_evicts_deepest_first_r3():
    # Scenario: one request of 3 fresh blocks: R3, deepest first.
    r = ArcReplacer(4)
    r.record_access([0, 1, 2], ids=["a", "b", "c"])
    r.record_access([3], ids=["d"])
    assert drain(r) == [2, 1, 0, 3]


def test_arc_pinned_frames_never_evicted_r1():
    # Scenario: the T1 victim is pinned, so ARC takes the next T1 frame, then falls back to
    # T2, and gives None when only pinned frames remain.
    r = ArcReplacer(3)
    r.record_access([0, 1, 2], ids=["a", "b", "c"])  # T1 = [c, b, a]
    r.record_access([1], ids=["b"])  # T2 = [b]
    r.set_evictable(2, False)
    r.set_evictable(0, False)
    assert r.num_evictable() == 1
    assert r.evict() == 1
    assert r.evict() is None
    r.set_evictable(0, True)
    assert r.num_evictable() == 1
    assert r.evict() == 0
    r.set_evictable(2, True)
    assert drain(r) == [2]


def test_arc_without_ids_is_split_lru():
    # Scenario: no ids, so no ghosts: a frame evicted and reused starts in T1 again.
    r = ArcReplacer(3)
    r.record_access([0])
    r.record_access([1])
    r.record_access([0])  # 0 -> T2
    assert r.evict() == 1
    r.record_access([1])  # reused frame: T1 (no ghost to hit)
    r.record_access([2])
    assert drain(r) == [1, 2, 0]


def test_arc_remove_forgets_frame_r2():
    # Scenario: remove drops a frame from T1/T2 and its pin; a removed frame is never a victim.
    r = ArcReplacer(3)
    r.record_access([0, 1, 2], ids=["a", "b", "c"])
    r.set_evictable(1, False)
    r.remove(1)
    r.remove(2)
    r.remove(2)
    assert r.num_evictable() == 1
    assert drain(r) == [0]
    r.record_access([1], ids=["b"])
    assert r.num_evictable() == 1  # the pin went with remove()
    assert drain(r) == [1]


# ---------------------------------------------------------------- every classic policy

CLASSIC = sorted(REPLACERS)


@pytest.mark.parametrize("name", CLASSIC)
def test_bad_frames_raise_invalid_input(name):
    r = make_replacer(name, 4)
    r.record_access([3, 2])
    for bad in (4, -1, 100):
        with pytest.raises(InvalidInput, match="outside"):
            r.record_access([bad])
        with pytest.raises(InvalidInput, match="outside"):
            r.set_evictable(bad, False)
        with pytest.raises(InvalidInput, match="outside"):
            r.set_evictable(bad, True)
        with pytest.raises(InvalidInput, match="outside"):
            r.remove(bad)
    # nothing above disturbed the known frames (a negative index must not alias frame 3)
    assert r.num_evictable() == 2
    assert sorted(drain(r)) == [2, 3]
    if name in ("lru", "arc"):
        r.record_access([3, 2])
        assert drain(r) == [2, 3]


def test_arc_ids_must_match_frames():
    r = ArcReplacer(4)
    with pytest.raises(InvalidInput, match="2 frames but 1 ids"):
        r.record_access([0, 1], ids=["a"])


def test_make_replacer_and_sizes():
    assert CLASSIC == ["2q", "arc", "lirs", "lrfu", "lru", "s3fifo", "sieve", "wtinylfu"]
    assert isinstance(make_replacer("lru", 2), LruReplacer)
    assert isinstance(make_replacer("arc", 2), ArcReplacer)
    for name in CLASSIC:
        assert make_replacer(name, 2).name == name
    with pytest.raises(InvalidInput, match="unknown replacer 'mru'"):
        make_replacer("mru", 2)
    for cls in REPLACERS.values():
        with pytest.raises(InvalidInput, match="at least one frame"):
            cls(0)


@pytest.mark.parametrize("name", CLASSIC)
def test_context_and_events_are_accepted(name):
    # Scenario: classic policies take the planner's context and events and ignore them.
    r = make_replacer(name, 2)
    r.record_access([0, 1], ids=["a", "b"], ctx=AccessContext(now_s=1.0, session_id="s", positions=[0, 1]))
    r.on_event({"kind": "session_end", "session_id": "s"})
    assert sorted(drain(r)) == [0, 1]


@pytest.mark.parametrize("name", CLASSIC)
def test_one_call_of_new_blocks_evicts_deepest_first_r3(name):
    # Scenario: a cache of c = 8 (pool of 12, as in the replay) holds 8 blocks seen twice; one
    # request brings 3 new blocks. Nothing tells the new ones apart but depth, so among them
    # the deepest goes first (R3), whatever the policy evicts in between.
    opts = {"capacity_frames": 8} if name in CAPACITY_SIZED else {}
    r = make_policy(name, 12, **opts)
    for f in range(8):
        r.record_access([f], ids=[f"old{f}"])
        r.record_access([f], ids=[f"old{f}"])
    r.record_access([9, 10, 11], ids=["p", "q", "s"])
    assert [v for v in drain(r) if v > 8] == [11, 10, 9]


@pytest.mark.parametrize("name", CLASSIC)
def test_pinned_frames_never_evicted_r1_every_policy(name):
    # Scenario: 4 frames, 2 pinned (one before its first access): only the other two are ever
    # victims, then None; unpinned, the pinned ones go too (each once).
    r = make_replacer(name, 4)
    r.set_evictable(3, False)
    r.record_access([0, 1, 2, 3], ids=["a", "b", "c", "d"])
    r.set_evictable(1, False)
    assert r.num_evictable() == 2
    assert sorted([r.evict(), r.evict()]) == [0, 2]
    assert r.evict() is None and r.num_evictable() == 0
    r.record_access([1], ids=["b"])  # a hit keeps the pin
    assert r.evict() is None
    r.set_evictable(1, True)
    r.set_evictable(3, True)
    assert r.num_evictable() == 2
    assert sorted(drain(r)) == [1, 3]


@pytest.mark.parametrize("name", CLASSIC)
def test_remove_forgets_frame_and_pin_r2_every_policy(name):
    r = make_replacer(name, 4)
    r.record_access([0, 1, 2], ids=["a", "b", "c"])
    r.set_evictable(1, False)
    r.remove(1)
    r.remove(2)
    r.remove(2)
    r.set_evictable(2, True)  # unknown: no effect
    assert r.num_evictable() == 1
    assert drain(r) == [0]
    r.record_access([1], ids=["b"])
    assert r.num_evictable() == 1  # the pin went with remove()
    assert drain(r) == [1]


@pytest.mark.parametrize("name", CLASSIC)
def test_single_frame(name):
    # Scenario: a one-frame pool: access, pin, unpin, evict, reuse.
    r = make_replacer(name, 1)
    assert r.evict() is None
    r.record_access([0], ids=["a"])
    r.set_evictable(0, False)
    assert r.evict() is None and r.num_evictable() == 0
    r.set_evictable(0, True)
    assert r.evict() == 0
    assert r.evict() is None
    r.record_access([0], ids=["b"])
    assert r.evict() == 0


# ---------------------------------------------------------------- state machines

NUM_FRAMES = 6
frame_ids = st.integers(min_value=0, max_value=NUM_FRAMES - 1)
block_ids = st.sampled_from("abcdefghij")


class LruMachine(RuleBasedStateMachine):
    """LruReplacer against a plain list model; victims must match exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.r = LruReplacer(NUM_FRAMES)
        self.order: list[int] = []  # evictable frames, victim end first
        self.pinned: set[int] = set()

    @rule(frames=st.lists(frame_ids, min_size=1, max_size=4))
    def access(self, frames):
        self.r.record_access(frames)
        for f in reversed(frames):  # R3: deepest first, the shallowest ends most recent
            if f in self.pinned:
                continue
            if f in self.order:
                self.order.remove(f)
            self.order.append(f)

    @rule(frame=frame_ids)
    def pin(self, frame):
        self.r.set_evictable(frame, False)
        if frame in self.order:
            self.order.remove(frame)
        self.pinned.add(frame)

    @rule(frame=frame_ids)
    def unpin(self, frame):
        self.r.set_evictable(frame, True)
        if frame in self.pinned:
            self.pinned.remove(frame)
            self.order.append(frame)

    @rule()
    def evict(self):
        got = self.r.evict()
        want = self.order.pop(0) if self.order else None
        assert got == want
        assert got not in self.pinned  # R1

    @rule(frame=frame_ids)
    def remove(self, frame):
        self.r.remove(frame)
        if frame in self.order:
            self.order.remove(frame)
        self.pinned.discard(frame)

    @invariant()
    def matches_model(self):
        assert self.r.num_evictable() == len(self.order)  # R4
        assert self.r.debug_order() == self.order


class ArcMachine(RuleBasedStateMachine):
    """ArcReplacer's victim choice is adaptive; the model checks what must always hold:
    R1 (victims known and unpinned), R2 (victims forgotten), R4 (evictable count), and that
    None comes exactly when nothing is evictable."""

    def __init__(self) -> None:
        super().__init__()
        self.r = ArcReplacer(NUM_FRAMES)
        self.known: set[int] = set()
        self.pinned: set[int] = set()

    @rule(pairs=st.lists(st.tuples(frame_ids, block_ids), min_size=1, max_size=4))
    def access(self, pairs):
        frames = [f for f, _ in pairs]
        self.r.record_access(frames, ids=[b for _, b in pairs])
        self.known.update(frames)

    @rule(frames=st.lists(frame_ids, min_size=1, max_size=3))
    def access_without_ids(self, frames):
        self.r.record_access(frames)
        self.known.update(frames)

    @rule(frame=frame_ids)
    def pin(self, frame):
        self.r.set_evictable(frame, False)
        self.pinned.add(frame)

    @rule(frame=frame_ids)
    def unpin(self, frame):
        self.r.set_evictable(frame, True)
        self.pinned.discard(frame)

    @rule()
    def evict(self):
        got = self.r.evict()
        evictable = self.known - self.pinned
        if not evictable:
            assert got is None
            return
        assert got in evictable  # R1
        self.known.remove(got)  # R2: unknown until accessed again

    @precondition(lambda self: self.known - self.pinned)
    @rule()
    def evict_all(self):
        victims = drain(self.r)
        assert sorted(victims) == sorted(self.known - self.pinned)  # R1, R2: each once
        self.known &= self.pinned

    @rule(frame=frame_ids)
    def remove(self, frame):
        self.r.remove(frame)
        self.known.discard(frame)
        self.pinned.discard(frame)

    @invariant()
    def evictable_count(self):
        assert self.r.num_evictable() == len(self.known - self.pinned)  # R4


class ClassicMachine(ArcMachine):
    """The same checks (R1, R2, R4, None exactly when nothing is evictable) for every classic
    policy, with a pool of 8 frames around a cache of c = 6 where the policy is sized by c."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        opts = {"capacity_frames": NUM_FRAMES - 2} if self.policy in CAPACITY_SIZED else {}
        self.r = make_policy(self.policy, NUM_FRAMES, **opts)

    @rule(frame=frame_ids)
    def unpin(self, frame):
        self.r.set_evictable(frame, True)
        if self.policy == "lrfu" and frame in self.pinned:
            # lrfu is a heap policy (kvdb/planner/policies/heap.py): like lru and lfu it takes a
            # frame pinned before its first access as known once unpinned
            self.known.add(frame)
        self.pinned.discard(frame)


for _name in ("lirs", "lrfu", "s3fifo", "sieve", "2q", "wtinylfu"):
    _cls = type(f"Machine_{_name}", (ClassicMachine,), {"policy": _name})
    globals()[f"Test{_name.upper()}Machine"] = _cls.TestCase

TestLruMachine = LruMachine.TestCase
TestArcMachine = ArcMachine.TestCase
