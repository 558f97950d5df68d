"""One copy on reads (issue 12 item 3): a disk read lands in the caller's ``out`` directly, and
promotion into the host tier copies from ``out`` (never a staging buffer, never a second read).

The copy sites are observed, not timed: every ``preadv`` the reader issues is recorded (which
memory each page lands in), and so is every arena write (where a promoted page is copied from).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import LAYOUT, PAGE, blocks_for

import kvdb
from kvdb.buffer_pool.arena import Arena
from kvdb.buffer_pool.pool import HOST
from kvdb.errors import CapacityError, NotFound


def _addr(buf) -> tuple[int, int]:
    a = np.asarray(buf) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return a.__array_interface__["data"][0], a.nbytes


class Spy:
    """Records the page-sized buffers the disk reader fills and the sources of arena writes."""

    def __init__(self, db, monkeypatch) -> None:
        self.preadv_calls = 0
        self.pages_read: list[tuple[int, int]] = []  # (address, bytes) of each page-sized iovec
        self.arena_srcs: list[int] = []  # data_ptr of each arena write's source
        self.arena_pages = 0  # pages written into arenas
        fs = db._cold.reader.fs
        real_preadv = fs.preadv

        def preadv(fd, bufs, offset):
            self.preadv_calls += 1
            self.pages_read += [_addr(b) for b in bufs if _addr(b)[1] == PAGE]
            return real_preadv(fd, bufs, offset)

        monkeypatch.setattr(fs, "preadv", preadv)
        real_write = Arena.write

        def write(arena, frames, src, rows=None):
            self.arena_srcs.append(src.data_ptr())
            self.arena_pages += len(frames)
            return real_write(arena, frames, src, rows)

        monkeypatch.setattr(Arena, "write", write)

        def no_index_copy(*a, **k):
            raise AssertionError("index_copy_ on the read path: a second copy of the pages")

        monkeypatch.setattr(torch.Tensor, "index_copy_", no_index_copy)


def _inside(addr: int, nbytes: int, t: torch.Tensor) -> bool:
    return t.data_ptr() <= addr and addr + nbytes <= t.data_ptr() + t.nbytes


def _on_disk(db, n: int, seed: int, durability: str = "group"):
    """n blocks put straight to disk (adjacent records): their keys and blocks."""
    keys = db.block_keys(list(range(n * LAYOUT.block_tokens)))
    b = blocks_for(n, seed=seed)
    db.put_blocks(keys, b, tier="disk", durability=durability)
    return keys, b


def _flip(db, key: bytes, back: int) -> None:
    """Flip one bit of the byte ``back`` bytes before the end of key's record on disk."""
    (e,) = db._cold.lookup([key])
    fd = os.open(db._cold.reader.segments.path(e.segment_no), os.O_RDWR)
    try:
        at = e.offset + e.record_bytes - back
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
    finally:
        os.close(fd)


def _heard(db, monkeypatch) -> list[list[bytes]]:
    """The ids of each record_access call the host replacer gets from now on."""
    repl = db.pool.tiers[HOST].replacer
    calls: list[list[bytes]] = []
    real = repl.record_access

    def spy(frames, ids=None, ctx=None):
        calls.append(list(ids))
        return real(frames, ids, ctx)

    monkeypatch.setattr(repl, "record_access", spy)
    return calls


def test_disk_reads_land_in_out_and_promote_from_it(tmp_path, monkeypatch):
    # Scenario: 8 blocks put straight to disk (adjacent records), 2 of them then read into
    # memory; a get of all 8 reads the 6 others from disk: every page lands inside out (rows
    # 2-7, one preadv per adjacent run), promotion copies from out, and no index_copy_ runs.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=16 * PAGE) as db:
        keys = db.block_keys(list(range(8 * LAYOUT.block_tokens)))
        b = blocks_for(8)
        db.put_blocks(keys, b, tier="disk", durability="group")
        warm = torch.zeros((2, *LAYOUT.block_shape))
        db.get_blocks(keys[:2], warm)  # rows 0-1 now resident
        assert [k in db.pool for k in keys] == [True] * 2 + [False] * 6
        spy = Spy(db, monkeypatch)
        out = torch.zeros((8, *LAYOUT.block_shape))
        db.get_blocks(keys, out)
        assert torch.equal(out, b)
        assert len(spy.pages_read) == 6 and all(_inside(a, n, out[2:]) for a, n in spy.pages_read)
        assert spy.preadv_calls == 1  # records 2-7 lie back to back: one coalesced preadv
        assert spy.arena_srcs == [out.data_ptr()]  # the promotion: one write, from out itself
        assert all(k in db.pool for k in keys)
        out2 = torch.zeros_like(out)
        db.get_blocks(keys, out2)  # now all in memory: no disk read at all
        assert torch.equal(out2, b) and spy.preadv_calls == 1


def test_a_one_block_read_lands_in_out_and_promotes_from_it(tmp_path, monkeypatch):
    # Scenario: 3 blocks on disk; one-block gets: each page lands in out's row (one preadv), its
    # promotion copies from out; a damaged block is NotFound with its row zeroed, counted once,
    # and promoted nowhere. The store's one-key reads take typed errors for bad arguments.
    from kvdb.errors import InvalidInput

    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=16 * PAGE) as db:
        keys, b = _on_disk(db, 3, seed=4)
        _flip(db, keys[2], back=PAGE // 2)
        spy = Spy(db, monkeypatch)
        out = torch.zeros((2, *LAYOUT.block_shape))
        db.get_blocks(keys[1:2], out[1:])  # a view: the row is out's second
        assert torch.equal(out[1], b[1]) and not out[0].any()
        assert spy.preadv_calls == 1 and all(_inside(a, n, out[1:]) for a, n in spy.pages_read)
        assert spy.arena_srcs == [out[1:].data_ptr()] and keys[1] in db.pool
        out[0] = 1
        with pytest.raises(NotFound):
            db.get_blocks(keys[2:3], out)
        assert not out[0].any() and keys[2] not in db.pool
        assert db._cold.stats()["corruptions"] == 1 and spy.arena_pages == 1
        entries = db._cold.lookup(keys[:1])
        row = np.zeros((1, PAGE), dtype=np.uint8)
        for bad in ((keys[0][:8], row, 0), (keys[0], row, 1), (keys[0], row[:, :8], 0),
                    (keys[0], row.astype(np.int16), 0), (keys[0], "row", 0), (keys[0], row, "0")):
            with pytest.raises(InvalidInput):
                db._cold.get_into([bad[0]], bad[1], [bad[2]], entries)
        assert db._cold.get_into(keys[:1], row, [0], entries) == [True]
        two = np.zeros((2, PAGE), dtype=np.uint8)
        with pytest.raises(InvalidInput):  # a row between int ends is checked too
            db._cold.get_into(keys[:2] + keys[:1], np.zeros((3, PAGE), dtype=np.uint8), [0, 1.0, 2])
        assert db._cold.get_into(keys[:2], two, [1, 0]) == [True, True]
        assert (row == b[0].view(torch.uint8).reshape(-1).numpy()).all()


def test_scattered_disk_rows_each_read_once(tmp_path, monkeypatch):
    # Scenario: disk keys at rows 1, 3, 4 of out (rows 0 and 2 resident): each page is read once
    # straight into its own row, and a key asked twice is promoted once.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=16 * PAGE) as db:
        keys = db.block_keys(list(range(5 * LAYOUT.block_tokens)))
        b = blocks_for(5, seed=3)
        db.put_blocks(keys, b, tier="disk", durability="group")
        db.get_blocks([keys[0], keys[2]], torch.zeros((2, *LAYOUT.block_shape)))
        spy = Spy(db, monkeypatch)
        ask = keys + [keys[3]]
        out = torch.zeros((6, *LAYOUT.block_shape))
        db.get_blocks(ask, out)
        assert torch.equal(out[:5], b) and torch.equal(out[5], b[3])
        rows = sorted((a - out.data_ptr()) // PAGE for a, _n in spy.pages_read)
        assert rows == [1, 3, 4, 5]  # row 5 (the repeat) is read into its own row too
        # promoted from out as each part is checked (the run 3-4, then 1): 3 pages, not 4
        assert set(spy.arena_srcs) == {out.data_ptr()} and spy.arena_pages == 3


def test_a_damaged_block_ends_the_prefix_and_counts(tmp_path, monkeypatch):
    # Scenario: 4 blocks on disk, the payload of block 2 flipped on disk: get_prefix returns 2
    # (rows 0-1 exact), get_blocks raises NotFound, the damage is counted, nothing damaged is
    # promoted; a key stored nowhere writes nothing into out.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=16 * PAGE) as db:
        keys = db.block_keys(list(range(4 * LAYOUT.block_tokens)))
        b = blocks_for(4, seed=5)
        db.put_blocks(keys, b, tier="disk", durability="sync")
        _flip(db, keys[2], 7)
        out = torch.zeros((4, *LAYOUT.block_shape))
        assert db.get_prefix(keys, out) == 2
        assert torch.equal(out[:2], b[:2])
        # the damaged block is never promoted; block 3, read in the same run and checked good,
        # is (promotion follows each page's own check, not the prefix)
        assert keys[2] not in db.pool and keys[3] in db.pool
        with pytest.raises(NotFound):
            db.get_blocks(keys[2:], torch.zeros((2, *LAYOUT.block_shape)))
        assert keys[2] not in db.pool
        assert db.stats()["tiers"]["disk"]["corruptions"] >= 2
        spy = Spy(db, monkeypatch)
        other = db.block_keys(list(range(100, 100 + LAYOUT.block_tokens)))
        out = torch.full((2, *LAYOUT.block_shape), 7.0)
        with pytest.raises(NotFound):
            db.get_blocks([keys[3], other[0]], out)
        assert spy.preadv_calls == 0 and bool((out == 7.0).all())  # stored nowhere: nothing read or written


def test_staged_reads_copy_each_run_once(tmp_path, monkeypatch):
    # Scenario: the path of a device ``out`` (forced here on the CPU): disk rows 1, 3, 4 of out are
    # read into the reused staging buffer, copied once per run of rows into out, and promoted
    # from the staging buffer; rows not read keep their bytes.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=16 * PAGE) as db:
        monkeypatch.setattr(type(db), "_reads_in_place", staticmethod(lambda dst: False))
        keys = db.block_keys(list(range(5 * LAYOUT.block_tokens)))
        b = blocks_for(5, seed=7)
        db.put_blocks(keys, b, tier="disk", durability="group")
        db.get_blocks([keys[0], keys[2]], torch.zeros((2, *LAYOUT.block_shape)))
        spy = Spy(db, monkeypatch)
        out = torch.zeros((5, *LAYOUT.block_shape))
        db.get_blocks(keys, out)
        assert torch.equal(out, b)
        stage = db._read_stage
        assert stage is not None and all(_inside(a, n, stage) for a, n in spy.pages_read)
        assert set(spy.arena_srcs) == {stage.data_ptr()} and spy.arena_pages == 3
        assert all(k in db.pool for k in keys)
        again = torch.zeros((3, *LAYOUT.block_shape))
        db.delete([keys[1]])
        assert db.get_prefix([keys[0], keys[1], keys[2]], again) == 1 and torch.equal(again[0], b[0])


@pytest.mark.parametrize("how", ["pin", "prefetch"])
def test_pin_and_prefetch_read_disk_pages_into_host_frames(tmp_path, monkeypatch, how):
    # Scenario: 6 blocks on disk, pinned (or prefetched): each page is read straight into a
    # host-arena frame lent for it (pool P6), no staging buffer and no arena write; the pinned
    # views hold the exact bytes. A key stored nowhere ends a prefix pin and its frame goes back.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=16 * PAGE) as db:
        keys = db.block_keys(list(range(6 * LAYOUT.block_tokens)))
        b = blocks_for(6, seed=9)
        db.put_blocks(keys, b, tier="disk", durability="group")
        spy = Spy(db, monkeypatch)
        arena = db.pool.host_arena()
        if how == "pin":
            with db.pin(keys) as pinned:
                assert all(torch.equal(p, b[i]) for i, p in enumerate(pinned.pages))
        else:
            assert db.prefetch(keys) == 6
        assert all(k in db.pool for k in keys)
        assert len(spy.pages_read) == 6 and all(_inside(a, n, arena) for a, n in spy.pages_read)
        assert spy.arena_srcs == []  # nothing copied into the arena: the reads landed there
        out = torch.zeros((6, *LAYOUT.block_shape))
        db.get_blocks(keys, out)
        assert torch.equal(out, b) and len(spy.pages_read) == 6  # served from memory
        if how == "pin":
            other = db.block_keys(list(range(500, 500 + 2 * LAYOUT.block_tokens)))
            db.put_blocks(other[:1], blocks_for(1, seed=2), tier="disk", durability="group")
            free = len(db.pool.tiers[HOST].free)
            with db.pin(other, prefix=True) as pinned:
                assert len(pinned.pages) == 1 and torch.equal(pinned.pages[0], blocks_for(1, seed=2)[0])
            assert len(db.pool.tiers[HOST].free) == free - 1  # the missing key's frame was given back


def test_a_full_host_tier_falls_back_to_a_staging_read(tmp_path, monkeypatch):
    # every host frame but one pinned: the 2 disk pages cannot each get a frame, so they are
    # read through a staging buffer and inserted (what fits); the pin then reports the shortage
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=4 * PAGE) as db:
        keys = db.block_keys(list(range(5 * LAYOUT.block_tokens)))
        b = blocks_for(5, seed=4)
        db.put_blocks(keys[:3], b[:3])
        db.put_blocks(keys[3:], b[3:], tier="disk", durability="group")
        with db.pin(keys[:3]):
            spy = Spy(db, monkeypatch)
            with pytest.raises(CapacityError):
                db.pin(keys[3:])
            assert len(spy.pages_read) == 2 and not any(_inside(a, n, db.pool.host_arena()) for a, n in spy.pages_read)
        with db.pin(keys[3:]) as pinned:
            assert all(torch.equal(p, b[3 + i]) for i, p in enumerate(pinned.pages))


def test_a_load_of_keys_stored_nowhere_evicts_nothing(tmp_path):
    # prefetch / pin of keys on no tier: no host frame is lent for them, so no resident page is
    # evicted to make room for a page that does not exist
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=4 * PAGE) as db:
        keys = db.block_keys(list(range(4 * LAYOUT.block_tokens)))
        db.put_blocks(keys, blocks_for(4, seed=1))
        ghosts = db.block_keys(list(range(900, 900 + 3 * LAYOUT.block_tokens)))
        disk = db.block_keys(list(range(700, 700 + LAYOUT.block_tokens)))
        db.put_blocks(disk, blocks_for(1, seed=6), tier="disk", durability="group")
        assert db.prefetch(ghosts) == 0
        assert all(k in db.pool for k in keys)  # nothing evicted for the ghosts
        assert db.prefetch(ghosts + disk) == 1  # one frame lent: the one stored key's
        assert sum(k in db.pool for k in keys) == 3 and disk[0] in db.pool


def test_a_batch_promoted_a_slice_at_a_time_is_one_request_to_the_replacer(tmp_path, monkeypatch):
    # Scenario: 12 blocks on disk read in slices of 3 records (4 slices, each promoted as it is
    # checked), key 0 resident. The host replacer hears of the promoted pages once, all of them
    # in chain order (its "last block of a call" and per-request clocks must not depend on the
    # slice size), then of the resident one.
    import kvdb.cold.read as read_mod

    monkeypatch.setattr(read_mod, "READ_SLICE_BYTES", 3 * (53 + PAGE))
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=32 * PAGE) as db:
        keys, b = _on_disk(db, 12, seed=11)
        db.get_blocks(keys[:1], torch.zeros((1, *LAYOUT.block_shape)))
        calls = _heard(db, monkeypatch)
        out = torch.zeros((12, *LAYOUT.block_shape))
        db.get_blocks(keys, out)
        assert torch.equal(out, b)
        assert calls == [keys[1:], keys[:1]]


def test_get_prefix_reports_only_the_keys_it_returns(tmp_path, monkeypatch):
    # Scenario: keys 0 and 3 resident, 1-2 on disk with block 1 damaged: get_prefix returns 1;
    # the replacer hears of key 0 (and of block 2, read good and promoted), not of key 3, past
    # the prefix the caller gets; a get_blocks that raises NotFound reports no resident key.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=16 * PAGE) as db:
        keys, _b = _on_disk(db, 4, seed=13, durability="sync")
        db.get_blocks([keys[0], keys[3]], torch.zeros((2, *LAYOUT.block_shape)))
        _flip(db, keys[1], 3)
        calls = _heard(db, monkeypatch)
        out = torch.zeros((4, *LAYOUT.block_shape))
        assert db.get_prefix(keys, out) == 1
        heard = [k for c in calls for k in c]
        assert keys[0] in heard and keys[1] not in heard and keys[3] not in heard
        calls.clear()
        with pytest.raises(NotFound):
            db.get_blocks(keys, out)
        heard = [k for c in calls for k in c]
        assert keys[0] not in heard and keys[3] not in heard
