"""IndexQueue: the index updates of appended records, on their way to RocksDB.

Every append of the cold store queues the index writes its records stand for, in lsn order,
under ``writer.lock`` (so queue order is lsn order): a PUT's entry, a DELETE's removals, a
metadata value. Block updates are also published at once in ``pending`` (key -> (lsn, encoded entry or
None)), where readers find them before RocksDB has them (``lookup``). A batch of puts appended
at once (``put_rows``) is one item of the queue, applied whole once its last lsn is durable. Whoever learns that the
log is durable up to some lsn writes the queue's durable prefix to RocksDB in one batch
(``apply``) and drops those keys from ``pending``; ``group`` commits leave that to the next
flush unless ``APPLY_BATCH`` updates wait (kvdb/cold/store.py).

Then the durability listeners run (``add_listener``: log shipping wakes its streams), outside
every lock.

Every queued update also carries what it changes in the live blocks per segment (``delta``:
(segment, bytes, blocks) triples, worked out by the live set, kvdb/cold/live.py); ``apply``
adds them to ``applied`` (segment -> [live bytes, live blocks] as the index holds them) and
writes the segments' new totals and ``Mapplied`` in the same RocksDB batch as the entries.

Invariants
    C1  RocksDB only ever holds index entries of fsynced records, applied in lsn order: any
        state a crash leaves it in is the log's state at some durable lsn (its memtable is not
        logged, so a crash rolls it back to an earlier such state, never forward).
    C7  every RocksDB batch that changes entries also holds the per-segment live totals they
        lead to and ``Mapplied``, the lsn of its last record: whatever a crash leaves, the
        entries, the totals and ``Mapplied`` agree (a flushed memtable holds whole batches), so
        an open reads the totals back instead of scanning every entry and replays only the
        records after ``Mapplied`` (kvdb/cold/recovery.py).

Locks
    ``lock``      serialises ``apply`` (and lets segment GC see the queue and the index hold
                  every record's effect, kvdb/cold/compact.py ``carry_forward``).
    writer.lock   the queue's order and ``pending`` change under it (taken after ``lock``).
"""

from __future__ import annotations

import collections
import threading

from kvdb.errors import CorruptionError
from kvdb.format import index_value as iv
from kvdb.format.record import META_TYPES, RECORD_HEADER_BYTES, RecordType, decode_delete, decode_meta, decode_put


def index_ops(segment_no: int, offset: int, rtype: int, lsn: int, crc: int, body) -> list:
    """The index writes one log record stands for (recovery's replay: kvdb/cold/store.py)."""
    if rtype == RecordType.PUT_BLOCK:
        p = decode_put(body)
        e = iv.BlockEntry(segment_no, offset, RECORD_HEADER_BYTES + len(body), crc, lsn, p.position,
                          p.namespace_id, p.codec, p.flags, p.raw_bytes)
        return [(iv.block_key(p.key), iv.encode_entry(e))]
    if rtype == RecordType.DELETE:
        return [(iv.block_key(k), None) for k in decode_delete(body)]
    if rtype in META_TYPES:
        name, value = decode_meta(body)
        return [(iv.record_meta_key(rtype, name), value if value else None)]
    return []


def location_delta(old, new) -> tuple:
    """What one key's newest record moving from ``old`` to ``new`` ((segment, offset, record
    bytes), None: not live) changes in the live totals: (segment, bytes, blocks) triples."""
    d: tuple = () if old is None else ((old[0], -old[2], -1),)
    return d if new is None else (*d, (new[0], new[2], 1))


def fold(totals: dict[int, list[int]], delta, touched: set[int]) -> None:
    """Add ``delta``'s triples to ``totals`` (segment -> [live bytes, live blocks]); the
    segments it names join ``touched``."""
    for seg, nbytes, nblocks in delta:
        t = totals.get(seg)
        if t is None:
            t = totals[seg] = [0, 0]
        t[0] += nbytes
        t[1] += nblocks
        touched.add(seg)


def live_ops(applied: dict[int, list[int]], segments) -> list[tuple[bytes, bytes | None]]:
    """Index writes of the live totals of ``segments`` (a segment with nothing live: no key)."""
    ops = []
    for seg in sorted(segments):
        nbytes, nblocks = applied.get(seg, (0, 0))
        if nblocks < 0 or nbytes < 0:  # the totals the index held disagreed with its entries
            raise CorruptionError(f"the index's live totals of segment {seg} come to {nblocks} blocks of {nbytes} "
                                  "bytes: they disagree with its entries; run `kvdb verify`, then remove the "
                                  "index/ directory to rebuild it from the log")
        ops.append((iv.live_key(seg), iv.encode_segment_live(nbytes, nblocks) if nblocks else None))
        if not nblocks:
            applied.pop(seg, None)
    return ops


#: marks a queue item that is a whole put_rows batch
BATCH = object()


class IndexQueue:
    def __init__(self, index, writer) -> None:
        """``index``: the store's Index (kvdb/cold/index.py); ``writer``: its LogWriter (whose
        lock orders the queue, and which a failed index write fails, C5)."""
        self.index = index
        self.writer = writer
        self.lock = threading.Lock()
        # (lsn, index key, value|None, block key|None, delta|None), or for a put_rows batch
        # (its last lsn, None, (index keys, values, block keys, lsns), BATCH, delta)
        self._queue: collections.deque = collections.deque()
        self.applied: dict[int, list[int]] = {}  # segment -> [live bytes, live blocks] in the index
        self._pending: dict[bytes, tuple[int, bytes | None]] = {}  # block key -> (lsn, encoded entry or None)
        self._listeners: tuple = ()  # called with the new durable lsn
        self._batched = 0  # keys in queued put_rows batches, beyond one per batch

    def __len__(self) -> int:
        """Index updates queued (a put_rows batch counts its keys)."""
        return len(self._queue) + self._batched

    # -- queueing (caller holds writer.lock)

    def put_entries(self, entries, deltas) -> None:
        """(block key, BlockEntry) of appended PUT records, in lsn order, and their live deltas."""
        queue, pending, prefix, encode = self._queue, self._pending, iv.BLOCK_PREFIX, iv.encode_entry
        for (key, e), delta in zip(entries, deltas):
            value = encode(e)
            queue.append((e.lsn, prefix + key, value, key, delta))
            pending[key] = (e.lsn, value)

    def put_rows(self, keys: list[bytes], first_lsn: int, values: list[bytes], delta) -> None:
        """Appended PUT records of consecutive lsns from ``first_lsn``, their encoded entries
        (kvdb/format/index_value.py ``encode_entries``): one queue item, no Python step per key
        but the index key's bytes."""
        if not keys:
            return
        lsns = range(first_lsn, first_lsn + len(keys))
        prefix = iv.BLOCK_PREFIX
        ikeys = [prefix + k for k in keys]
        self._queue.append((lsns[-1], None, (ikeys, values, keys, lsns), BATCH, delta))
        self._batched += len(keys) - 1
        self._pending.update(zip(keys, zip(lsns, values)))

    def delete(self, lsn: int, keys: list[bytes], delta) -> None:
        """The keys of an appended DELETE record and its live delta."""
        for i, key in enumerate(keys):
            self._queue.append((lsn, iv.block_key(key), None, key, delta if i == len(keys) - 1 else None))
            self._pending[key] = (lsn, None)

    def metadata(self, lsn: int, index_key: bytes, value: bytes | None) -> None:
        """An appended metadata record (``value`` None: the name is removed)."""
        self._queue.append((lsn, index_key, value, None, None))

    def queued_index_keys(self) -> set[bytes]:
        """Index keys with an update still queued (caller holds ``lock`` and writer.lock)."""
        out: set[bytes] = set()
        for _lsn, ikey, v, k, _d in self._queue:
            if k is BATCH:
                out.update(v[0])
            else:
                out.add(ikey)
        return out

    # -- reading

    def lookup(self, keys: list[bytes]) -> list[iv.BlockEntry | None]:
        """Entries of ``keys``: from ``pending``, else from RocksDB."""
        return iv.decode_entries(self.values(keys))

    def values(self, keys: list[bytes]) -> list[bytes | None]:
        """Encoded entries of ``keys`` (None: not live): from ``pending``, else one multi-get."""
        pend = self._pending
        if not pend or pend.keys().isdisjoint(keys):  # none queued (an ingest of fresh keys): no loop here
            return self.index.get_values(keys)
        out: list = [None] * len(keys)
        missing = []
        get = pend.get
        for i, k in enumerate(keys):
            p = get(k)
            if p is None:
                missing.append(i)
            else:
                out[i] = p[1]
        if missing:
            got = self.index.get_values(keys if len(missing) == len(keys) else [keys[i] for i in missing])
            for i, v in zip(missing, got):
                out[i] = v
        return out

    def pending_locations(self) -> dict[bytes, tuple[int, int, int] | None]:
        """(segment, offset, record bytes) of every key with a queued update (None: deleted)."""
        loc = iv.entry_location
        items = tuple(self._pending.items())  # one step under the GIL: appends may run (no writer.lock)
        return {k: None if v is None else loc(v) for k, (_lsn, v) in items}

    def locate(self, keys: list[bytes]) -> list[tuple[int, int, int] | None]:
        """(segment, offset, record bytes) of each live one of ``keys``, None for the others."""
        loc = iv.entry_location
        return [None if v is None else loc(v) for v in self.values(keys)]

    # -- applying (C1)

    def apply(self, lsn: int) -> None:
        """Write the durable prefix of the queue (lsn <= ``lsn``) to RocksDB (C1), with the
        live totals of the segments it changes and ``Mapplied`` (C7), then tell the listeners.
        An index write error fails the log (C5)."""
        with self.lock:
            ops, done = [], []
            unbatched = 0
            q = self._queue
            applied = self.applied
            touched: set[int] = set()
            last = None
            while q and q[0][0] <= lsn:
                op_lsn, ikey, value, key, delta = q.popleft()
                last = op_lsn
                if delta:
                    fold(applied, delta, touched)
                if key is BATCH:
                    ikeys, values, keys, lsns = value
                    ops.extend(zip(ikeys, values))
                    done.extend(zip(keys, lsns))
                    unbatched += len(keys) - 1
                    continue
                ops.append((ikey, value))
                if key is not None:
                    done.append((key, op_lsn))
            try:
                if last is not None:
                    ops.extend(live_ops(applied, touched))
                    ops.append((iv.APPLIED_KEY, iv.encode_lsn(last)))
                self.index.write(ops)
            except Exception as e:
                self.writer.fail(e)
                raise
            with self.writer.lock:
                self._batched -= unbatched  # put_rows adds under writer.lock too
                for key, op_lsn in done:
                    p = self._pending.get(key)
                    if p is not None and p[0] == op_lsn:
                        del self._pending[key]
        self.notify(lsn)

    # -- durability listeners

    def notify(self, lsn: int) -> None:
        for fn in self._listeners:  # outside the locks: a listener only wakes threads
            fn(lsn)

    @property
    def listeners(self) -> tuple:
        return self._listeners

    def add_listener(self, fn) -> None:
        with self.lock:
            self._listeners = (*self._listeners, fn)

    def remove_listener(self, fn) -> None:
        with self.lock:
            self._listeners = tuple(f for f in self._listeners if f != fn)  # bound methods: ==


__all__ = ["IndexQueue", "fold", "index_ops", "live_ops", "location_delta"]
