"""Zero-copy landing: Db.reserve_frames / commit_frames / release_frames (pool invariant P6),
with exact frame accounting, and pushes that land in the peer's arena (node.py N4)."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvdb.buffer_pool.pool import HOST
from kvdb.errors import CapacityError, InvalidInput, ReplicationError
from kvdb.replication import NodeServer, Peer

from .conftest import LAYOUT, SECRET, make_blocks, make_keys, needs_te, open_db
from .test_push import _FlipOneByte

PAGE = LAYOUT.page_bytes
_open = partial(open_db, model_id="m", disk_bytes=0)


def _host(db):
    return db.pool.tiers[HOST]


def _check_pool(db) -> tuple[int, int, int]:
    """P1, P2, P4, P6 on the host tier; returns (resident, free, reserved)."""
    t = _host(db)
    keyed = [f for f, k in enumerate(t.keys) if k is not None]
    free, reserved = set(t.free), t.reserved
    assert len(free) == len(t.free)
    assert not (free & reserved) and not (free & set(keyed)) and not (reserved & set(keyed))
    assert len(keyed) + len(free) + len(reserved) == t.num_frames
    assert t.num_resident == len(keyed) == len(db.pool.table)
    assert t.replacer.num_evictable() == sum(1 for f in keyed if t.pins[f] == 0)
    for f in keyed:
        assert db.pool.locate(t.keys[f]) == (t, f)  # P1
    return len(keyed), len(free), len(reserved)


def _land(res, blocks: torch.Tensor) -> None:
    """What the engine does: write each block's bytes into its reserved frame."""
    rows = blocks.view(torch.uint8).reshape(len(res), PAGE)
    for dst, src in zip(res.rows, rows):
        dst.copy_(src)


def _stored(db, keys) -> torch.Tensor:
    out = torch.empty((len(keys), *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    db.get_blocks(keys, out=out)
    return out


def test_reserve_commit_release_accounting(tmp_path):
    # Scenario: 8 frames. Reserve 3: invisible (not resident, not free, not evictable); commit
    # them under 3 keys: stored bit-exact in those very frames (no copy). Reserve 2 more and
    # release them as a failed digest check would: nothing visible, the frames free again and
    # reusable by the next reservation.
    with _open(tmp_path / "db", host_pages=8) as db:
        assert _check_pool(db) == (0, 8, 0)
        res = db.reserve_frames(3)
        assert (res.frames, res.addrs) == ([0, 1, 2], [res.arena.data_ptr() + f * PAGE for f in (0, 1, 2)])
        assert _check_pool(db) == (0, 5, 3)
        assert db.stats()["tiers"]["host"]["pages"] == 0
        blocks, keys = make_blocks(3, seed=1), make_keys(3, tag=1)
        _land(res, blocks)
        assert db.match_prefix(keys) == 0
        assert db.commit_frames(keys, res, durability="none") == 3
        assert _check_pool(db) == (3, 5, 0)
        assert [db.pool.locate(k)[1] for k in keys] == [0, 1, 2]
        assert torch.equal(_stored(db, keys), blocks)
        assert db.stats()["tiers"]["host"]["inserts"] == 3

        bad = db.reserve_frames(2)
        assert bad.frames == [3, 4]
        _land(bad, make_blocks(2, seed=2))
        db.release_frames(bad)
        assert _check_pool(db) == (3, 5, 0)
        assert db.match_prefix(make_keys(2, tag=2)) == 0
        again = db.reserve_frames(5)
        assert sorted(again.frames) == [3, 4, 5, 6, 7]
        assert _check_pool(db) == (3, 0, 5)
        db.release_frames(again)
        with pytest.raises(InvalidInput, match="reserved with reserve_frames"):
            db.release_frames(again)  # already released
        assert _check_pool(db) == (3, 5, 0)


def test_reserve_evicts_like_a_put_and_is_all_or_nothing(tmp_path):
    # Scenario: 4 frames full with 4 pages, 2 of them pinned. Reserving 2 evicts the 2 unpinned
    # pages; reserving 3 more is refused (only the 2 reserved + 2 pinned exist) with nothing
    # evicted; the pinned pages stay readable.
    with _open(tmp_path / "db", host_pages=4) as db:
        blocks, keys = make_blocks(4, seed=3), make_keys(4, tag=3)
        db.put_blocks(keys, blocks)
        with db.pin(keys[2:]):
            victims = sorted(db.pool.locate(k)[1] for k in keys[:2])
            res = db.reserve_frames(2)
            assert sorted(res.frames) == victims
            assert [k in db.pool for k in keys] == [False, False, True, True]
            assert _check_pool(db) == (2, 0, 2)
            with pytest.raises(CapacityError, match="cannot reserve 1 host frames: 0 free and 0 evictable"):
                db.reserve_frames(1)
            assert _check_pool(db) == (2, 0, 2)
            assert torch.equal(_stored(db, keys[2:]), blocks[2:])
            db.release_frames(res)
        assert _check_pool(db) == (2, 2, 0)
        with pytest.raises(CapacityError):
            db.reserve_frames(5)
        assert _check_pool(db) == (2, 2, 0)
        with pytest.raises(InvalidInput, match="count >= 0"):
            db.reserve_frames(-1)


def test_commit_skips_stored_keys_and_uses_the_reservation_up(tmp_path):
    # Scenario: a chunk of 4 frames whose keys are [stored, new, new-duplicate, new]: the stored
    # key keeps its old bytes, the duplicate's frame is released, 2 new pages are committed in
    # place. A commit with the wrong number of keys raises and still releases every frame.
    with _open(tmp_path / "db", host_pages=8) as db:
        old = make_blocks(1, seed=4)
        keys = make_keys(3, tag=4)
        db.put_blocks(keys[:1], old)
        res = db.reserve_frames(4)
        landed = make_blocks(4, seed=5)
        _land(res, landed)
        assert db.commit_frames([keys[0], keys[1], keys[1], keys[2]], res, durability="none") == 2
        assert _check_pool(db) == (3, 5, 0)
        assert torch.equal(_stored(db, keys), torch.cat([old, landed[1:2], landed[3:4]]))

        res = db.reserve_frames(2)
        with pytest.raises(InvalidInput, match="1 keys for 2 reserved frames"):
            db.commit_frames(make_keys(1, tag=5), res)
        assert _check_pool(db) == (3, 5, 0)
        res = db.reserve_frames(1)
        with pytest.raises(InvalidInput, match="needs the disk tier"):
            db.commit_frames(make_keys(1, tag=5), res, durability="sync")
        assert _check_pool(db) == (3, 5, 0)
        with pytest.raises(InvalidInput, match="reserved with reserve_frames"):
            db.commit_frames(make_keys(1, tag=5), [0])  # a resident frame, not a reservation
        assert _check_pool(db) == (3, 5, 0)
        assert db.match_prefix(make_keys(1, tag=5)) == 0


def test_durable_commit_reaches_the_disk_tier_before_returning(tmp_path):
    # Scenario: commit_frames(durability="sync") on a Db with a disk tier: the pages are clean
    # in memory (already on disk), and after close + reopen they read back bit-exact.
    blocks, keys = make_blocks(3, seed=6), make_keys(3, tag=6)
    with _open(tmp_path / "db", host_pages=8, disk_bytes=None) as db:
        res = db.reserve_frames(3)
        _land(res, blocks)
        assert db.commit_frames(keys, res, durability="sync") == 3
        assert [db.pool.is_dirty(k) for k in keys] == [False, False, False]
        assert _check_pool(db) == (3, 5, 0)
        # a key resident but only in memory (durability none: dirty) is made durable, not replaced
        extra, extra_key = make_blocks(1, seed=15), make_keys(1, tag=15)
        db.put_blocks(extra_key, extra, durability="none")
        assert db.pool.is_dirty(extra_key[0])
        res = db.reserve_frames(1)
        _land(res, extra)
        assert db.commit_frames(extra_key, res, durability="sync") == 0
        assert not db.pool.is_dirty(extra_key[0])
        assert _check_pool(db) == (4, 4, 0)
        keys, blocks = keys + extra_key, torch.cat([blocks, extra])
    with _open(tmp_path / "db", host_pages=8, disk_bytes=None) as db:
        assert torch.equal(_stored(db, keys), blocks)


@settings(deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["reserve", "commit", "release", "put", "delete"]),
                              st.integers(1, 4)), min_size=1, max_size=30))
def test_reservations_keep_pool_invariants(tmp_path_factory, ops):
    # Property: any interleaving of reservations, commits, releases, puts and deletes keeps
    # P1/P2/P4/P6 and every stored key reads back the bytes it was stored with.
    path = tmp_path_factory.mktemp("db")
    held: list = []
    model: dict[bytes, torch.Tensor] = {}
    n = 0
    with _open(path, host_pages=6) as db:
        for op, k in ops:
            if op == "reserve":
                try:
                    held.append(db.reserve_frames(k))
                except CapacityError:
                    assert len(_host(db).free) + _host(db).replacer.num_evictable() < k
            elif op in ("commit", "release") and held:
                res = held.pop(0)
                if op == "release":
                    db.release_frames(res)
                else:
                    blocks = make_blocks(len(res), seed=n)
                    keys = [bytes([7]) + (n * 8 + i).to_bytes(4, "little") + bytes(11) for i in range(len(res))]
                    n += 1
                    _land(res, blocks)
                    db.commit_frames(keys, res, durability="none")
                    model.update(zip(keys, blocks))
            elif op == "put":
                keys = [bytes([8]) + (n * 8 + i).to_bytes(4, "little") + bytes(11) for i in range(k)]
                blocks = make_blocks(k, seed=1000 + n)
                n += 1
                db.put_blocks(keys, blocks)
                model.update(zip(keys, blocks))
            elif op == "delete" and model:
                key = next(iter(model))
                db.delete([key])
                del model[key]
            _, _, reserved = _check_pool(db)
            assert reserved == sum(len(r) for r in held)
            for key in [k for k in model if k in db.pool]:
                assert torch.equal(_stored(db, [key])[0], model[key])
        for res in held:
            db.release_frames(res)
        assert _check_pool(db)[2] == 0


# ---------------------------------------------------------------------- pushes over the engine


@pytest.fixture
def node(netns, tmp_path, request):
    frames = getattr(request, "param", 64)
    db = _open(tmp_path / "peer", host_pages=frames)
    srv = NodeServer(db, "127.0.0.1:0", SECRET, node="decode-0", transport="mooncake").start()
    yield srv
    srv.stop()
    db.close()


@needs_te
def test_push_lands_in_arena_frames(node):
    # Scenario: 10 blocks in chunks of 3 land straight in the peer's arena frames (no landing
    # region): bit-exact, counted in blocks_landed_in_arena, no frame left reserved; a second
    # push of the same keys stores nothing and releases its frames.
    blocks, keys = make_blocks(10, seed=8), make_keys(10, tag=8)
    with Peer(node.address, secret=SECRET, transport="mooncake", chunk_bytes=3 * PAGE) as p:
        assert p.channel.peer_meta["frames"] is True
        p.push(keys, blocks, durability="none")
        assert p._region is None  # never asked for a landing region
        assert torch.equal(_stored(node.db, keys), blocks)
        assert _check_pool(node.db) == (10, 54, 0)
        p.push(keys, make_blocks(10, seed=9), durability="none")
        assert torch.equal(_stored(node.db, keys), blocks)
        assert _check_pool(node.db) == (10, 54, 0)
        st = p.status()["counters"]
    assert (st["blocks_received"], st["blocks_landed_in_arena"]) == (20, 20)


@needs_te
@pytest.mark.parametrize("node", [8], indirect=True)
def test_push_too_large_for_frames_uses_the_landing_region(node):
    # Scenario: the peer's host tier has 8 frames; a push of 6 blocks may reserve at most half
    # of them, so the peer answers frames: null and the push lands in a region, then put_blocks.
    blocks, keys = make_blocks(6, seed=10), make_keys(6, tag=10)
    with Peer(node.address, secret=SECRET, transport="mooncake", chunk_bytes=2 * PAGE) as p:
        p.push(keys, blocks, durability="none")
        assert p._region is not None
        st = p.status()["counters"]
    assert (st["blocks_received"], st["blocks_landed_in_arena"]) == (6, 0)
    assert torch.equal(_stored(node.db, keys), blocks)
    assert _check_pool(node.db) == (6, 2, 0)


@needs_te
def test_damaged_block_in_arena_frames_is_released_unseen(node):
    # Scenario: the engine flips a byte of block 0 of a 3-block chunk landing in arena frames:
    # the digest check refuses the chunk, its frames go back free (nothing visible), and the
    # next push reuses them.
    keys = make_keys(3, tag=11)
    p = Peer(node.address, secret=SECRET, transport=_FlipOneByte("127.0.0.1"))
    with pytest.raises(ReplicationError, match="1 of 3 landed blocks fail their XXH3-128 digest"):
        p.push(keys, make_blocks(3, seed=11), durability="none")
    p.close()
    assert node.db.match_prefix(keys) == 0
    assert _check_pool(node.db) == (0, 64, 0)
    blocks = make_blocks(3, seed=12)
    with Peer(node.address, secret=SECRET, transport="mooncake") as q:
        q.push(keys, blocks, durability="none")
    assert torch.equal(_stored(node.db, keys), blocks)
    assert sorted(node.db.pool.locate(k)[1] for k in keys) == [0, 1, 2]


@needs_te
def test_sync_push_into_frames_is_on_disk_when_acknowledged(netns, tmp_path):
    # Scenario: a peer with a disk tier; a push with durability="sync" lands in arena frames and
    # is acknowledged only after commit_frames wrote it to the disk tier: the pages are clean in
    # memory, and after the peer's Db closes, PATH reopens with every block bit-exact.
    blocks, keys = make_blocks(5, seed=14), make_keys(5, tag=14)
    db = _open(tmp_path / "peer", host_pages=16, disk_bytes=None)
    srv = NodeServer(db, "127.0.0.1:0", SECRET, transport="mooncake").start()
    try:
        with Peer(srv.address, secret=SECRET, transport="mooncake", chunk_bytes=2 * PAGE) as p:
            p.push(keys, blocks, durability="sync")
            assert p.status()["counters"]["blocks_landed_in_arena"] == 5
        assert [db.pool.is_dirty(k) for k in keys] == [False] * 5
        assert _check_pool(db) == (5, 11, 0)
    finally:
        srv.stop()
        db.close()
    with _open(tmp_path / "peer", host_pages=16, disk_bytes=None) as again:
        assert torch.equal(_stored(again, keys), blocks)


@needs_te
def test_frames_of_a_dropped_connection_are_released_after_the_grace_period(netns, tmp_path):
    # Scenario: a sender reserves frames for a 2-chunk push, then its connection drops before it
    # announced anything (N4): the frames stay reserved for the grace period (an engine write
    # could still be on its way), then go back free; nothing becomes visible.
    from kvdb.replication.protocol import MsgType

    db = _open(tmp_path / "peer", host_pages=16)
    srv = NodeServer(db, "127.0.0.1:0", SECRET, transport="mooncake", late_write_grace_s=0.2).start()
    try:
        p = Peer(srv.address, secret=SECRET, transport="mooncake")
        p.channel.send(MsgType.RESERVE_FRAMES, {"chunks": [3, 2]})
        reply = p.channel.expect(MsgType.FRAMES)
        assert reply.meta["frames"] == [[0, 1, 2], [3, 4]]
        assert _check_pool(db) == (0, 11, 5)
        p.close()
        for _ in range(200):  # the release happens on the node's timer thread
            if not _host(db).reserved:
                break
            threading.Event().wait(0.05)
        assert _check_pool(db) == (0, 16, 0)
        assert len(db.pool.table) == 0
    finally:
        srv.stop()
        db.close()
