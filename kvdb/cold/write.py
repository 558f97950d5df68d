"""LogAppender: the cold store's appends, and the bookkeeping each one owes.

Puts are encoded (codec, seal) outside any lock (``encode``). Then, under ``writer.lock``, every
append of the store goes through here: its records are written (kvdb/wal/writer.py), and before
the lock is let go its index updates are queued in lsn order and published to readers
(kvdb/cold/apply.py) with what they change in the live totals (kvdb/cold/live.py: the old
locations of their keys are looked up first, from pending or the index), the log bytes since the last
checkpoint grow (kvdb/cold/checkpoint.py) and the writer-side counters (puts, deletes,
evictions) change -- all under that one lock, so none of them can disagree with the log's
order.

Under ``disk_bytes`` a put batch is planned first (``LiveSet.plan_evictions``): the oldest live
blocks are evicted by a DELETE record appended in the same writev, ahead of the puts.

Raw, unsealed pages (the default) take the batch path: ``encode`` builds every record's 53
leading bytes at once with numpy (kvdb/format/record.py ``put_rows``; pages under
``INLINE_PAGE_BYTES`` copied in behind them, so a batch is one buffer), the writer fills lsns
and crcs and writes each segment's share with one writev (kvdb/wal/writer.py ``append_rows``),
and the bookkeeping goes in bulk: the index entries encoded at once, one queue item, the live
set updated by run (``PutRows``). Codecs and sealing keep one Python step per page.

``append_batches`` is the commit queue's hook (kvdb/wal/commit.py): it appends every batch the
queue's leader gathered, with one writev when no eviction is planned.
"""

from __future__ import annotations

import numpy as np

from kvdb.cold.codec import aad, encode_page
from kvdb.format import index_value as iv
from kvdb.format.record import (
    FLAG_SEALED,
    NO_POSITION,
    PUT_FIXED,
    RECORD_HEADER_BYTES,
    RecordType,
    Codec,
    buffer_bytes,
    encode_delete,
    encode_meta,
    encode_put_fixed,
    put_rows,
)

#: pages below this many bytes are copied behind their record heads, so a batch is one buffer
#: and one crc call per record; larger ones are written from the caller's rows (a head and a
#: page per record in the writev), where the copy would cost more than two iovecs per record
#: (4 KiB pages, `kvdb bench scale`: ~1.1 us per block copied, ~0.3 us for the iovecs)
INLINE_PAGE_BYTES = 1024


class PutRows:
    """A put batch of raw, unsealed pages, encoded at once (``LogAppender.encode``)."""

    __slots__ = ("keys", "rows", "payloads", "positions", "namespace_id", "page_bytes", "olds", "olds_lsn")

    def __init__(self, keys, rows, payloads, positions, namespace_id: int, page_bytes: int) -> None:
        self.olds = self.olds_lsn = None  # see LogAppender.encode_new
        self.keys = keys  # list[bytes]
        self.rows = rows  # uint8 [n, 53] or [n, 53 + page_bytes] (put_rows)
        self.payloads = payloads  # uint8 [n, page_bytes] when not inside rows, else None
        self.positions = positions  # int64 [n]
        self.namespace_id = namespace_id
        self.page_bytes = page_bytes

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def record_bytes(self) -> int:
        return self.rows.shape[1] + (0 if self.payloads is None else self.payloads.shape[1])

    def tail(self, start: int) -> "PutRows":
        """The batch from its ``start``-th block on."""
        return PutRows(self.keys[start:], self.rows[start:], None if self.payloads is None else self.payloads[start:],
                       self.positions[start:], self.namespace_id, self.page_bytes)


class PutItems(list):
    """A put batch of (key, fixed PUT fields, payload) items (codecs, sealing) that may carry the
    old locations of its keys (``LogAppender.encode_new``)."""

    olds = olds_lsn = None


class LogAppender:
    def __init__(self, store, counters: dict) -> None:
        """``store``: the ColdStore whose parts it updates; ``counters``: its counters dict,
        whose writer-side keys change here, under writer.lock."""
        self.store = store
        self.counters = counters

    def encode(self, keys: list[bytes], pages, positions, namespace_id: int):
        """(key, fixed PUT fields, payload) per page, sealed when the store is encrypted; a
        ``PutRows`` for raw, unsealed pages (uint8 [n, page_bytes])."""
        st = self.store
        codec, itemsize, page_bytes, sealer = st.codec, st.itemsize, st.page_bytes, st.sealer
        if codec == Codec.RAW and sealer is None:
            if positions is None:
                pos = np.full(len(keys), NO_POSITION, dtype=np.int64)
            else:
                pos = np.array([NO_POSITION if p is None else int(p) for p in positions], dtype=np.int64)
            inline = page_bytes < INLINE_PAGE_BYTES
            rows = put_rows(b"".join(keys), pos, namespace_id, Codec.RAW, 0, page_bytes,
                            pages if inline else None, page_bytes)
            return PutRows(keys, rows, None if inline else pages, pos, namespace_id, page_bytes)
        items = []
        for i, key in enumerate(keys):
            pos = NO_POSITION if positions is None or positions[i] is None else int(positions[i])
            used, payload = encode_page(pages[i], codec, itemsize)
            flags = 0
            if sealer is not None:
                payload = sealer.seal(payload, aad(key, namespace_id, pos, used))
                flags |= FLAG_SEALED
            fixed = encode_put_fixed(key, namespace_id, pos, used, flags, page_bytes)
            items.append((key, fixed, payload))
        return items

    def encode_new(self, keys: list[bytes], pages, positions, namespace_id: int, if_absent: bool):
        """``encode``, and with ``if_absent`` the keys already live left out first: (the batch,
        None when nothing is left; which keys are written, None without ``if_absent``). The one
        lookup of their locations travels with the batch: the append uses it unless the log
        changed since (``_olds``), so a put of new keys asks RocksDB once, not twice."""
        if not keys:
            return None, [] if if_absent else None
        if not if_absent:
            return self.encode(keys, pages, positions, namespace_id), None
        st = self.store
        with st.writer.lock:  # no append half done: its pending entries are all published
            seen = st.writer.next_lsn
        olds = st.live.locate(keys)
        written = [o is None for o in olds]
        if not all(written):
            keys = [k for k, w in zip(keys, written) if w]
            pages = pages[np.asarray(written)]
            positions = None if positions is None else [p for p, w in zip(positions, written) if w]
        if not keys:
            return None, written
        items = self.encode(keys, pages, positions, namespace_id)
        if isinstance(items, list):
            items = PutItems(items)
        items.olds, items.olds_lsn = [None] * len(keys), seen
        return items, written

    def _olds(self, items, keys: list[bytes]) -> list:
        """Caller holds writer.lock: the old locations of a batch's keys, looked up again unless
        the batch carries them from a moment the log has not changed since."""
        olds = getattr(items, "olds", None)  # a plain list (append_batches' merged one) carries none
        if olds is not None and items.olds_lsn == self.store.writer.next_lsn:
            return olds
        return self.store.live.locate(keys)

    def append_puts(self, items: list) -> int:
        """Append one put batch (evicting first under ``disk_bytes``); returns the last lsn."""
        st = self.store
        w = st.writer
        with w.lock:
            st.check()
            if isinstance(items, PutRows):
                return self._append_rows(items)
            keys = [k for k, _f, _p in items]
            olds = self._olds(items, keys)
            evict: list[bytes] = []
            if st.disk_bytes is not None:
                sizes = [RECORD_HEADER_BYTES + len(f) + buffer_bytes(p) for _k, f, p in items]
                dropped, evict, evict_olds = st.live.plan_evictions(sizes, keys, olds, st.disk_bytes)
                if dropped:
                    self.counters["evictions"] += dropped
                    items, olds = items[dropped:], olds[dropped:]
            records = []
            if evict:
                records.append((RecordType.DELETE, [encode_delete(evict)]))
            records.extend((RecordType.PUT_BLOCK, [fixed, payload]) for _k, fixed, payload in items)
            locs = w.append(records)  # an I/O error fails the writer (C5)
            if evict:
                self.note_delete(locs[0].lsn, evict, evict_olds)
                self.counters["evictions"] += len(evict)
                locs = locs[1:]
            self._note_puts(items, locs, olds)
            return w.next_lsn - 1

    def append_batches(self, batches: list[list]) -> int:
        """The commit queue's hook: append several put batches in order; one writev for all of
        them unless eviction is on (then each batch is planned on its own, as alone)."""
        st = self.store
        w = st.writer
        with w.lock:
            if st.disk_bytes is not None or len(batches) == 1 or any(isinstance(b, PutRows) for b in batches):
                for items in batches:
                    last = self.append_puts(items)
                return last
            st.check()
            items = [it for b in batches for it in b]
            olds = st.live.locate([k for k, _f, _p in items])
            locs = w.append([(RecordType.PUT_BLOCK, [fixed, payload]) for _k, fixed, payload in items])
            self._note_puts(items, locs, olds)
            return w.next_lsn - 1

    def _append_rows(self, batch: PutRows) -> int:
        """``append_puts`` of a PutRows batch (caller holds writer.lock): eviction planned the
        same way, the DELETE its own record ahead of the batch's writev."""
        st = self.store
        w = st.writer
        rbytes = batch.record_bytes
        olds = self._olds(batch, batch.keys)
        if st.disk_bytes is not None:
            dropped, evict, evict_olds = st.live.plan_evictions([rbytes] * len(batch), batch.keys, olds, st.disk_bytes)
            if dropped:
                self.counters["evictions"] += dropped
                batch, olds = batch.tail(dropped), olds[dropped:]
            if evict:
                (loc,) = w.append([(RecordType.DELETE, [encode_delete(evict)])])  # an I/O error fails the writer (C5)
                self.note_delete(loc.lsn, evict, evict_olds)
                st.ckpt.log_bytes += loc.record_bytes
                self.counters["evictions"] += len(evict)
        if not len(batch):
            return w.next_lsn - 1
        runs, crcs = w.append_rows(batch.rows, batch.payloads)  # an I/O error fails the writer (C5)
        segs = np.concatenate([np.full(c, s, dtype=np.uint32) for s, _o, _l, c in runs])
        offs = np.concatenate([o + rbytes * np.arange(c, dtype=np.uint64) for _s, o, _l, c in runs])
        first = runs[0][2]
        values = iv.encode_entries(segs, offs, rbytes, crcs, np.arange(first, first + len(batch), dtype=np.uint64),
                                   batch.positions, batch.namespace_id, Codec.RAW, 0, batch.page_bytes)
        delta = st.live.change_runs(batch.keys, olds, [(s, o, c) for s, o, _lsn, c in runs], rbytes)
        st.queue.put_rows(batch.keys, first, values, delta)
        st.ckpt.log_bytes += rbytes * len(batch)
        self.counters["puts"] += len(batch)
        return w.next_lsn - 1

    def _note_puts(self, items: list, locs: list, olds: list) -> None:
        """Caller holds writer.lock: queue the index updates of appended puts (whose keys were
        at ``olds`` before), publish them."""
        st = self.store
        entries, news = [], []
        nbytes = 0
        for (key, fixed, _payload), loc in zip(items, locs):
            _, ns, pos, codec, flags, _, raw = PUT_FIXED.unpack(fixed)
            seg, lsn, rbytes = loc.segment_no, loc.lsn, loc.record_bytes
            entries.append((key, iv.BlockEntry(seg, loc.offset, rbytes, loc.crc, lsn, pos, ns, codec, flags, raw)))
            news.append((seg, loc.offset, rbytes))
            nbytes += rbytes
        st.queue.put_entries(entries, st.live.change([k for k, _f, _p in items], olds, news))
        st.ckpt.log_bytes += nbytes
        self.counters["puts"] += len(items)

    def note_delete(self, lsn: int, keys: list[bytes], olds: list | None = None) -> None:
        """Caller holds writer.lock: the keys of an appended DELETE record (at ``olds``, looked
        up when not given) are gone."""
        st = self.store
        if olds is None:
            olds = st.live.locate(keys)
        st.queue.delete(lsn, keys, st.live.change_summed(keys, olds, [None] * len(keys)))

    def append_delete(self, keys: list[bytes]):
        """Delete the live ones of ``keys``: (the DELETE record's lsn, how many), or (None, 0)."""
        st = self.store
        w = st.writer
        with w.lock:
            st.check()
            keys = list(dict.fromkeys(keys))
            olds = st.live.locate(keys)
            live = [k for k, o in zip(keys, olds) if o is not None]
            if not live:
                return None, 0
            (loc,) = w.append([(RecordType.DELETE, [encode_delete(live)])])  # an I/O error fails the writer (C5)
            self.note_delete(loc.lsn, live, [o for o in olds if o is not None])
            st.ckpt.log_bytes += loc.record_bytes
            self.counters["deletes"] += len(live)
        return loc.lsn, len(live)

    def append_metadata(self, rtype: int, name: bytes, value: bytes) -> int:
        """A SESSION / TTL / LEASE record (empty ``value``: removed); returns its lsn."""
        st = self.store
        w = st.writer
        with w.lock:
            st.check()
            (loc,) = w.append([(rtype, [encode_meta(name, value)])])  # an I/O error fails the writer (C5)
            st.queue.metadata(loc.lsn, iv.record_meta_key(rtype, name), value or None)
            st.ckpt.log_bytes += loc.record_bytes
        return loc.lsn


__all__ = ["LogAppender"]
