"""Retention floor (replication slots): no segment holding a record above the floor is deleted,
by checkpoints or by compaction; lifting the floor lets them go."""

from __future__ import annotations

from cold_fixtures import TINY, key, pages_for

from kvdb.cold.store import ColdStore


def test_segments_above_the_floor_survive_compaction(tmp_path):
    # Scenario: 40 puts over 512-byte segments (two put records each: segment n starts at lsn
    # 2n-1), then every block deleted. With the floor at lsn 5 (a follower confirmed 5),
    # compaction deletes segments 1 and 2 (lsns 1-4) and keeps 3 on (5-6 holds lsn 6 > 5);
    # with no floor it deletes every wholly dead segment.
    store = ColdStore.open(tmp_path, TINY, segment_bytes=512, flush_interval_s=None)
    try:
        keys = [key(i) for i in range(40)]
        for i in range(0, 40, 4):
            store.put(keys[i : i + 4], pages_for(keys[i : i + 4]), durability="sync")
        store.delete(keys, durability="sync")
        before = store.segments.list()
        assert len(before) > 3
        floor = [5]
        store.set_retention(lambda: floor[0])
        store.compact()
        kept = store.segments.list()
        assert before[:3] == [1, 2, 3]
        assert 1 not in kept and 2 not in kept and set(before[2:]) <= set(kept)
        floor[0] = None  # the follower is gone / caught up: no retention
        store.compact()
        after = store.segments.list()
        assert not set(before) & set(after)
    finally:
        store.close()
