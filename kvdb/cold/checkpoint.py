"""Checkpointer: checkpoints, segment GC, the background flusher and automatic compaction.

A checkpoint makes everything written so far durable and indexed, writes (segment, offset,
applied lsn) and the persisted counters into RocksDB, flushes it and logs a CHECKPOINT record;
recovery replays the log from there (kvdb/wal/recovery.py). It also deletes the segments that
hold nothing live any more (segment GC). The flusher thread fsyncs ``none`` writes within
``flush_interval_s``, checkpoints every ``checkpoint_bytes`` of log and, once a second, asks
``maybe_compact`` whether the log has grown past ``max_space_amp`` x the live bytes. A run left
short of room on the disk (kvdb/cold/compact.py "Room first") is tried again after
``SPACE_RETRY_S``.

Invariants
    C2  a checkpoint (segment, offset, applied_lsn) is written to RocksDB and flushed only after
        every record before it is applied; recovery replays from there, so C1
        (kvdb/cold/apply.py) plus replay rebuilds exactly the durable log's state.
    C4  a segment file is deleted only after a flushed checkpoint lies beyond it and no live
        entry points into it; readers holding its fd keep reading (POSIX unlink semantics,
        kvdb/cold/read.py).
    C6  replaying every surviving segment from the first (the index rebuild: remove index/,
        reopen) yields exactly the live blocks and metadata: before a segment is deleted, its
        DELETEs that an older surviving PUT still needs and its live metadata are appended
        again (kvdb/cold/compact.py ``carry_forward``).

Locks
    ``lock``   one checkpoint or compaction at a time (taken before every lock of the store).
"""

from __future__ import annotations

import threading
import time

from kvdb.cold.compact import carry_forward, compact
from kvdb.format import index_value as iv
from kvdb.format.record import RecordType, encode_checkpoint

#: how often the flusher looks at the log's space (a directory listing)
AUTO_COMPACT_CHECK_S = 1.0
#: an automatic compaction copies only sealed segments at least this dead
AUTO_MIN_DEAD_FRACTION = 0.5
#: after a run that left segments for lack of room (kvdb/cold/compact.py), the next waits this long
SPACE_RETRY_S = 30.0


class Checkpointer:
    def __init__(self, store, *, checkpoint_lsn: int, checkpoint_bytes: int, max_space_amp: float | None) -> None:
        """``store``: the ColdStore (kvdb/cold/store.py) whose parts it drives."""
        self.store = store
        self.lock = threading.Lock()
        self.lsn = checkpoint_lsn  # applied lsn of the last checkpoint
        self.log_bytes = 0  # log bytes appended since the last checkpoint (appends add, under writer.lock)
        self.checkpoint_bytes = checkpoint_bytes
        self.max_space_amp = max_space_amp
        self.stopping = threading.Event()  # close(): the flusher exits, a compaction stops between chunks
        self._flusher: threading.Thread | None = None
        self._auto_floor = 0  # maybe_compact waits until the log grows past this again
        self._auto_checked = 0.0
        self._space_retry_at = 0.0  # maybe_compact waits until then after a run short of room
        self.space_warned = False  # a compaction short of room has been logged (compact.py)

    # -- checkpoints (C2) and segment GC (C4, C6)

    def checkpoint(self) -> None:
        with self.lock:
            self.checkpoint_locked()

    def checkpoint_locked(self) -> None:
        """Caller holds ``lock``."""
        st = self.store
        w = st.writer
        with st.sticky_io("checkpoint"):
            with w.lock:
                active = w.segment_no
            # chosen before the checkpoint's lsn is read: every record that made them dead (and
            # every record carried out of them, C6) is then fsynced and under the checkpoint
            dead = self._collectable_segments(active)
            with w.lock:
                seg, off, last = w.segment_no, w.offset, w.next_lsn - 1
            st.commit.sync_to(last)
            st.queue.apply(last)
            saved = st.persisted_counters()
            st.index.write([(iv.CHECKPOINT_KEY, iv.encode_checkpoint(iv.Checkpoint(seg, off, last))),
                            (iv.STATS_KEY, iv.encode_stats(saved))])
            st.index.flush()
            if st.debug_on_index_flush is not None:
                st.debug_on_index_flush(st)
            with w.lock:
                w.append([(RecordType.CHECKPOINT, [encode_checkpoint(last)])])
                self.log_bytes = 0
            self.lsn = last
            st.count(checkpoints=1)
            self._delete_segments(dead)

    def _collectable_segments(self, before: int) -> list[int]:
        """Sealed segments below ``before`` with no live block, not held for a log reader, whose
        records a replay no longer needs once ``carry_forward`` has appended what it does (C6)."""
        st = self.store
        floor = st.retention_floor()
        with st.writer.lock:
            segments = st.segments.list()
            dead = st.live.dead_segments(segments, before)
            if floor is not None:  # kept for a log reader that has not confirmed them yet
                dead = [s for s in dead if (st.segments.last_lsn(s, segments) or floor + 1) <= floor]
        return carry_forward(st, dead, segments) if dead else []

    def _delete_segments(self, dead: list[int]) -> None:
        """C4: called with a flushed checkpoint beyond ``dead``."""
        st = self.store
        with st.writer.lock:
            st.live.drop_segments(dead)  # sealed and wholly dead: nothing can make them live again
        for s in dead:
            st.reader.retire(s)
        st.segments.delete(dead)
        if dead:
            st.count(segments_deleted=len(dead))

    # -- the flusher

    def start_flusher(self, interval_s: float, name: str) -> None:
        self._flusher = threading.Thread(target=self._flush_loop, args=(interval_s,), name=name, daemon=True)
        self._flusher.start()

    def stop_flusher(self) -> None:
        self.stopping.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()

    def _flush_loop(self, interval_s: float) -> None:
        st = self.store
        w = st.writer
        while not self.stopping.wait(interval_s):
            if st.failed or st.closed:
                return
            try:
                if w.next_lsn - 1 > st.commit.durable_lsn or len(st.queue):
                    st.flush()
                if self.log_bytes >= self.checkpoint_bytes:
                    st.checkpoint()
                if self.max_space_amp is not None:
                    now = time.monotonic()
                    if now - self._auto_checked >= AUTO_COMPACT_CHECK_S:
                        self._auto_checked = now
                        self.maybe_compact()
            except BaseException as e:  # the store is failed now; callers see DbFailedError
                if w.error is None:
                    w.fail(e)
                return

    # -- automatic compaction

    def dead_fraction(self) -> float:
        """How dead a sealed segment must be for an automatic compaction to copy it: half, or
        less under a bound below 2 (a log above ``amp`` x live is more than 1 - 1/amp dead, so
        some segment is at least that dead)."""
        amp = self.max_space_amp
        return AUTO_MIN_DEAD_FRACTION if amp is None else min(AUTO_MIN_DEAD_FRACTION, 1.0 - 1.0 / amp)

    def maybe_compact(self) -> dict | None:
        """See ColdStore.maybe_compact."""
        amp = self.max_space_amp
        if amp is None:
            return None
        st = self.store
        if time.monotonic() < self._space_retry_at:
            return None  # short of room a moment ago
        sp = st.space()
        seg = st.writer.segment_bytes
        self._auto_floor = min(self._auto_floor, sp["log_bytes"] + seg)  # the log shrank: look again sooner
        if sp["log_bytes"] <= amp * sp["live_bytes"] or sp["reclaimable_bytes"] < seg \
                or sp["log_bytes"] < self._auto_floor:
            return None
        out = compact(st, min_dead_fraction=self.dead_fraction(), stop=self.stopping, auto=True)
        if out["space_deferred_segments"]:  # retried later, when there may be room
            self._space_retry_at, self._auto_floor = time.monotonic() + SPACE_RETRY_S, 0
            return out
        after = st.space()
        # a run that left the log above the bound waits for growth; one that did not, for nothing
        self._auto_floor = after["log_bytes"] + seg if after["log_bytes"] > amp * after["live_bytes"] else 0
        return out


__all__ = ["AUTO_COMPACT_CHECK_S", "AUTO_MIN_DEAD_FRACTION", "SPACE_RETRY_S", "Checkpointer"]
