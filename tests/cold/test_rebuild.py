"""Rebuilding the index from the log alone (remove PATH/index/, reopen) gives exactly the live
set, after checkpoints and compaction have deleted segments (invariant C6, kvdb/cold/checkpoint.py): a deleted,
evicted or overwritten block never comes back, metadata survives, removed metadata stays removed.

Layout of every scenario: 128-byte pages (PUT records of 181 bytes) in 512-byte segments, so a
segment holds two puts, or a put, a delete and a put.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvdb.cold import ColdStore
from kvdb.cold.compact import compact
from kvdb.errors import CorruptionError, InvalidInput
from kvdb.format.record import segment_name
from kvdb.fs import FaultFs

from cold_fixtures import TINY, key, pages_for

K, L, M, N, P = (key(i) for i in range(1, 6))


def open_store(path, **kw) -> ColdStore:
    kw.setdefault("flush_interval_s", None)
    kw.setdefault("segment_bytes", 512)
    return ColdStore.open(path, TINY, **kw)


def segments(store) -> list[int]:
    return store.segments.list()


def live(store, keys) -> dict[bytes, bytes]:
    out = np.zeros((len(keys), TINY.page_bytes), np.uint8)
    found = store.get_into(keys, out)
    return {k: out[i].tobytes() for i, k in enumerate(keys) if found[i]}


def rebuilt(path, **kw) -> ColdStore:
    """The documented rebuild: the store is closed, its index/ removed, the store reopened."""
    shutil.rmtree(path / "index")
    return open_store(path, **kw)


def put(store, keys, salt=0):
    store.put(keys, pages_for(keys, salt), durability="sync")


def delete_in_a_dead_segment(s: ColdStore) -> None:
    """Segment 1: PUT K, PUT L (L stays live). Segment 2: PUT M, DELETE K, PUT N. Segment 3:
    PUT P, DELETE M N. Segment 2 is now wholly dead, segment 1 holds the dead PUT of K."""
    put(s, [K, L])
    put(s, [M])
    s.delete([K], "sync")
    put(s, [N])
    put(s, [P])
    s.delete([M, N], "sync")
    assert {k: seg for k, seg, _off, _rb in s.live.scan()} == {L: 1, P: 3}


@pytest.mark.parametrize("gc", ["checkpoint", "compact"])
def test_delete_in_a_collected_segment_stays_deleted(tmp_path, gc):
    # Scenario: K's DELETE sits in segment 2, which GC deletes (a checkpoint finds it wholly
    # dead; or compaction, set to leave the half-dead segment 1 alone); segment 1 with the
    # dead PUT of K survives. Rebuilt from the log, K is absent, L and P are exact.
    with open_store(tmp_path) as s:
        delete_in_a_dead_segment(s)
        if gc == "checkpoint":
            s.checkpoint()
        else:
            compact(s, min_dead_fraction=0.6)
        segs = segments(s)
        assert 1 in segs and 2 not in segs
        want = live(s, [K, L, M, N, P])
        assert sorted(want) == sorted([L, P])
    with rebuilt(tmp_path) as s:
        assert live(s, [K, L, M, N, P]) == want
        assert s.contains([K, L, M, N, P]) == [False, True, False, False, True]
        assert s.stats()["pages"] == 2
        assert s.verify().ok


def test_put_after_a_collected_delete_wins(tmp_path):
    # Scenario: as above, then K is put again (after the GC, and once more after a second GC
    # that may drop whatever carried the tombstone): the newest version is what comes back.
    with open_store(tmp_path) as s:
        delete_in_a_dead_segment(s)
        s.checkpoint()
        put(s, [K], salt=7)
        s.checkpoint()
    with rebuilt(tmp_path) as s:
        assert live(s, [K]) == {K: pages_for([K], 7)[0].tobytes()}
        s.delete([K], "sync")
        put(s, [M, N, P], salt=2)  # K's tombstone's segment dies
        s.delete([M, N, P], "sync")
        s.compact()
    with rebuilt(tmp_path) as s:
        assert live(s, [K, L, M, N, P]) == {L: pages_for([L])[0].tobytes()}
        assert s.verify().ok


def test_eviction_in_a_collected_segment_stays_evicted(tmp_path):
    # Scenario: disk_bytes holds 3 records. Segment 1: K, L. Segment 2: M, then N evicts K
    # (DELETE K in the same append). M and N are deleted, P opens segment 3, segment 2 is
    # collected, segment 1 survives for L.
    with open_store(tmp_path, disk_bytes=3 * 181) as s:
        put(s, [K, L])
        put(s, [M])
        put(s, [N])  # evicts K: segment 2 holds PUT M, DELETE K, PUT N
        assert {k: seg for k, seg, _off, _rb in s.live.scan()} == {L: 1, M: 2, N: 2}
        s.delete([M, N], "sync")
        put(s, [P])  # segment 3
        s.checkpoint()
        assert 1 in segments(s) and 2 not in segments(s)
    with rebuilt(tmp_path, disk_bytes=3 * 181) as s:
        assert live(s, [K, L, M, N, P]) == {k: pages_for([k])[0].tobytes() for k in (L, P)}
        assert s.stats()["bytes"] == 2 * 181


def test_metadata_survives_collection_and_removals_stay(tmp_path):
    # Scenario: a session entry set in segment 1 and removed in segment 2; a TTL set only in
    # segment 2; a lease set in segment 2 and set again in segment 3. Segment 2 is collected.
    with open_store(tmp_path) as s:
        s.put_metadata("session", b"s1", b"open", "sync")
        put(s, [K, L])
        put(s, [M])
        s.put_metadata("session", b"s1", b"", "sync")
        s.put_metadata("ttl", L, (123).to_bytes(8, "little"), "sync")
        s.put_metadata("lease", b"l1", b"a", "sync")
        put(s, [N])
        s.put_metadata("lease", b"l1", b"b", "sync")
        s.delete([K, M, N], "sync")
        s.checkpoint()
        segs = segments(s)
        assert 1 in segs and 2 not in segs
    with rebuilt(tmp_path) as s:
        assert s.find_metadata("session", b"s1") is None
        assert s.find_metadata("ttl", L) == (123).to_bytes(8, "little")
        assert s.find_metadata("lease", b"l1") == b"b"
        assert live(s, [K, L, M, N]) == {L: pages_for([L])[0].tobytes()}


def test_damaged_index_is_an_error_missing_index_is_rebuilt(tmp_path):
    # Scenario: a damaged index is never silently rebuilt (open raises, verify says 3); the
    # documented way out is to remove index/ -- then the rebuild gives the pre-crash live set.
    with open_store(tmp_path) as s:
        delete_in_a_dead_segment(s)
        s.checkpoint()
        want = live(s, [K, L, M, N, P])
    for m in (tmp_path / "index").glob("MANIFEST-*"):
        m.unlink()
    with pytest.raises(CorruptionError, match="index"):
        open_store(tmp_path)
    with rebuilt(tmp_path) as s:
        assert live(s, [K, L, M, N, P]) == want
        assert s.stats()["recovery"]["damage"] == 0
        assert s.verify().ok


def test_encrypted_store_rebuilds_with_its_key_only(tmp_path):
    # Scenario: an encrypted store loses its index (where the key check lives). Without a key,
    # or with another key, the rebuild is refused with a clear error (and can be tried again);
    # with its key it gives the live set, and the key check is back in the index.
    kf, other = tmp_path / "key", tmp_path / "other"
    kf.write_bytes(bytes(range(32)))
    other.write_bytes(bytes(range(1, 33)))
    db = tmp_path / "db"
    with open_store(db, encryption_key_file=str(kf)) as s:
        delete_in_a_dead_segment(s)
        s.checkpoint()
        want = live(s, [K, L, M, N, P])
    shutil.rmtree(db / "index")
    with pytest.raises(InvalidInput, match="is encrypted"):
        open_store(db)
    with pytest.raises(InvalidInput, match="does not match"):
        open_store(db, encryption_key_file=str(other))
    with rebuilt(db, encryption_key_file=str(kf)) as s:
        assert live(s, [K, L, M, N, P]) == want
    with pytest.raises(InvalidInput, match="does not match"):
        open_store(db, encryption_key_file=str(other))


def test_gc_never_deletes_a_segment_whose_death_is_not_yet_durable(tmp_path):
    # Scenario: segment 1 holds K (live) and L (deleted). While a checkpoint runs (after its
    # index flush) K is deleted with durability "none", which kills segment 1 -- but that DELETE
    # is not under the checkpoint. The machine then dies, losing unsynced bytes. Segment 1 must
    # still be there: K (acknowledged, its delete not) reads back exactly; verify is clean.
    fs = FaultFs()
    s = open_store(tmp_path, fs=fs)
    put(s, [K, L])
    put(s, [M])
    s.delete([L], "sync")
    s.debug_on_index_flush = lambda st: st.delete([K], "none") if st.contains([K])[0] else None
    s.checkpoint()
    s.debug_crash_close()
    fs.debug_crash("drop")
    with open_store(tmp_path) as s:
        got = live(s, [K, L, M])
        assert got == {k: pages_for([k])[0].tobytes() for k in (K, M)} or got == {M: pages_for([M])[0].tobytes()}
        assert s.stats()["corruptions"] == 0
        assert s.verify().ok


def test_a_dead_segment_that_cannot_be_read_whole_is_kept(tmp_path):
    # Scenario: as in the first test, but a bit of K's DELETE record in segment 2 flips before
    # the checkpoint. GC cannot judge segment 2, so it keeps it (and the damage stays visible:
    # recovery and verify report it) instead of dropping the tombstone silently.
    with open_store(tmp_path) as s:
        delete_in_a_dead_segment(s)
        seg2 = tmp_path / "wal" / segment_name(2)
        with open(seg2, "r+b") as f:  # PUT M at 32 (181 bytes), then DELETE K: its first key byte
            f.seek(32 + 181 + 17 + 4)
            b = f.read(1)
            f.seek(32 + 181 + 17 + 4)
            f.write(bytes([b[0] ^ 1]))
        s.checkpoint()
        assert 2 in segments(s)
    with rebuilt(tmp_path) as s:
        assert s.recovery.damage
        assert not s.verify().ok
