"""LogSink: the follower side of log shipping (the stream and invariants S1-S5: shipping.py).

Applies every record type the leader logs, in lsn order, through the Db's public API:

    PUT_BLOCK            one ``put_blocks`` per run of puts (raw, zstd-planes or sealed payloads)
    DELETE               ``db.delete``
    SESSION / TTL / LEASE ``db.cold_store.put_metadata`` (so ``find_metadata`` and TTL expiry
                         by compaction see the leader's entries); counted as ``metadata``
    CHECKPOINT           nothing (the follower checkpoints its own log); counted as ``skipped``

A follower takes a stream only from a leader of its own namespace (namespace.py: model, revision,
layout and dtype, key algorithm, tensor / pipeline rank, and the key secret, compared by its
fingerprint ``key_secret_id``): the leader's travels in SHIP_HELLO, and one of another namespace
is refused with ERROR{NAMESPACE} naming what differs, before any record (shipping.py S6); the
leader then reports that reason (state ``refused``, ``NamespaceError`` from ``sync_replicas``).
Only a sink made with ``allow_foreign_keys=True`` (a raw byte mirror: ``kvdb replicate serve
--allow-foreign-keys``) takes the records of a leader of another key secret, and warns once per
leader. A leader that sends no namespace (a bare log directory) is held to this follower's page
size.

A batch is decoded and checked whole (every crc, body, sealed payload) before anything of it is
applied, so a batch refused for damage or a wrong key leaves nothing half-applied.

Encryption at rest: a leader whose log is sealed (AES-256-GCM) sends its key check in
SHIP_HELLO; a follower streams only when its disk tier is sealed with the same key (else it
answers ERROR{INVALID} and applies nothing). Records travel sealed; the follower authenticates
and opens each payload in memory, and its own disk tier seals it again before it reaches disk,
so no block is ever plaintext on the wire or in a file of either node. A memory-only follower
(no disk tier) cannot follow an encrypted leader.

Re-seed (reseed.py): on RESEED_BEGIN the sink builds the copy in a staging Db, and on RESEED_END
swaps it in through ``swap_db`` (set by the NodeServer: it closes the Db, runs the swap, and
serves the reopened one). Without ``reopen`` (a sink not run by ``kvdb replicate serve``) the
sink refuses re-seeds and the leader marks it ``needs_reseed``.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch

from kvdb.cold.codec import decode_page
from kvdb.cold.export import key_matches, open_payload
from kvdb.errors import CorruptionError, InvalidInput, KvdbError, ReplicationError
from kvdb.format import position
from kvdb.format.record import (
    META_TYPES,
    RecordType,
    check_record,
    decode_delete,
    decode_meta,
    decode_put,
)
from kvdb.format.swap import APPLIED_NAME
from kvdb.fs import write_file_atomic
from kvdb.replication.channel import Channel
from kvdb.replication.namespace import key_namespace, key_refusal, mismatch, namespace_of
from kvdb.replication.protocol import ErrorCode, Message, MsgType
from kvdb.replication.reseed import Staging, finish_swap
from kvdb.replication.transport import Region

log = logging.getLogger("kvdb.replication")

META_KINDS = {RecordType.SESSION: "session", RecordType.TTL: "ttl", RecordType.LEASE: "lease"}


class LogSink:
    """Applies shipped records to a Db (S1, S2); ``serve_stream`` runs on a NodeServer connection."""

    def __init__(self, db, state_dir, *, durable: bool, reopen=None, allow_foreign_keys: bool = False) -> None:
        self.db = db
        # True: a raw byte mirror, which takes a leader of another key secret (namespace.py)
        self.allow_foreign_keys = allow_foreign_keys
        self.state_dir = Path(state_dir)
        self.durable = durable  # False: a memory-only follower; its position is not persisted
        self.reopen = reopen  # (path, host_bytes=) -> Db with the daemon's options; None: no re-seed
        self.swap_db = None  # (fn) -> new Db: set by the NodeServer that runs this sink
        self._lock = threading.Lock()  # one stream applies at a time; guards the counters
        self.log_id: str | None = None  # the leader log this follower's lsns belong to
        self._pos_seq, self._pos_whole = 0, True  # the position file's last slot write; rewrite it whole
        self._applied = self._load_applied() if durable else 0
        self.counters = {"records": 0, "puts": 0, "deletes": 0, "metadata": 0, "duplicates": 0, "skipped": 0,
                         "batches": 0, "reseeds": 0, "refused_streams": 0}
        self.leader: str | None = None
        # "same" | "differs" | "unknown": whether this follower computes the leader's keys (namespace.py)
        self.key_namespace = "unknown"
        self._warned_keys: set[str] = set()  # leaders a "differs" warning was logged for
        self.last_refusal: str | None = None  # why the last refused stream was refused
        self.staging: Staging | None = None  # the copy being received (reseed.py)
        self.last_reseed: dict | None = None
        self.debug_reseed_hook = None  # tests: called with the records received after each batch
        self._batch: np.ndarray | None = None  # decode buffer reused across batches (guarded by _lock)

    @classmethod
    def for_db(cls, db, reopen=None, *, allow_foreign_keys: bool = False) -> LogSink:
        durable = "disk" in db.stats().get("tiers", {})
        return cls(db, Path(db.path) / "replication", durable=durable, reopen=reopen if durable else None,
                   allow_foreign_keys=allow_foreign_keys)

    def _load_applied(self) -> int:
        """Read ``applied_lsn`` (kvdb/format/position.py): the lsn and the leader log it counts."""
        path = self.state_dir / APPLIED_NAME
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self._pos_seq, self._pos_whole = 0, True
            return 0
        pos = position.decode(raw, str(path))
        self._pos_seq, self._pos_whole = pos.seq, pos.seq == 0  # seq 0: the older text layout
        self.log_id = pos.log_id
        return pos.lsn

    def _persist(self, lsn: int) -> None:
        """S1: the applied position is durable before the batch is acknowledged (one slot
        pwrite + fdatasync; the whole file only the first time)."""
        path = self.state_dir / APPLIED_NAME
        pos = position.Position(self._pos_seq + 1, lsn, self.log_id)
        if self._pos_whole:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            write_file_atomic(path, position.encode_file(pos))
            self._pos_whole = False
        else:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, position.encode_slot(pos), (pos.seq % 2) * position.SLOT_BYTES)
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self._pos_seq = pos.seq

    def applied_lsn(self) -> int:
        return self._applied

    def status(self) -> dict:
        st = self.staging
        return {"applied_lsn": self._applied, "leader": self.leader, "log_id": self.log_id,
                "key_namespace": self.key_namespace, "allow_foreign_keys": self.allow_foreign_keys,
                "last_refusal": self.last_refusal, "durable": self.durable, **self.counters,
                "reseed": dict(st.progress) if st is not None else None, "last_reseed": self.last_reseed}

    # ------------------------------------------------------------------ applying

    def apply(self, buf, first_lsn: int, last_lsn: int) -> int:
        """Apply the consecutive records in ``buf`` (S2); returns the new applied lsn (S1)."""
        with self._lock:
            recs = self._check_records(buf)
            lsns = [r.lsn for r in recs]
            if not recs or lsns != list(range(first_lsn, last_lsn + 1)):
                raise ReplicationError(f"shipped batch holds lsns {lsns[:1]}..{lsns[-1:]}, "
                                       f"announced {first_lsn}..{last_lsn}")
            if first_lsn > self._applied + 1:
                raise ReplicationError(f"shipped batch starts at lsn {first_lsn}, after applied {self._applied}: "
                                       "records are missing")
            todo = [r for r in recs if r.lsn > self._applied]
            rows, ops = self._decode(todo, self.db)
            must_flush = self._apply_ops(self.db, rows, ops, "group" if self.durable else "none", None, self.counters)
            self.counters["duplicates"] += len(recs) - len(todo)
            self.counters["batches"] += 1
            if self.durable and todo:
                if must_flush:
                    self.db.flush()
                self._persist(last_lsn)
            self._applied = max(self._applied, last_lsn)
            return self._applied

    def _check_records(self, buf) -> list:
        recs = []
        off = 0
        while off < len(buf):
            status, rec = check_record(buf, off)
            if status != "ok":
                raise ReplicationError(f"shipped record at byte {off} of a batch fails its crc32c "
                                       f"({status}); nothing after lsn {self._applied} applied")
            recs.append(rec)
            off += rec.record_bytes
        return recs

    def _batch_rows(self, n: int, page: int) -> np.ndarray:
        """A reused [n, page] buffer: a fresh one per batch costs page faults, not just a copy."""
        if self._batch is None or self._batch.shape[0] < n or self._batch.shape[1] != page:
            self._batch = np.empty((max(n, 1), page), dtype=np.uint8)
        return self._batch[:n]

    def _decode(self, recs, db) -> tuple[np.ndarray, list]:
        """Decode and check every record before anything is applied: pages (unsealed when
        sealed) into one batch buffer, and the ops to run in lsn order."""
        lay = db.layout
        page = lay.page_bytes
        cold = db.cold_store
        rows = self._batch_rows(sum(1 for r in recs if r.rtype == RecordType.PUT_BLOCK), page)
        ops: list = []
        row = 0
        for rec in recs:
            t = rec.rtype
            try:
                if t == RecordType.PUT_BLOCK:
                    p = decode_put(rec.body)
                    if p.raw_bytes != page:
                        raise ReplicationError(f"record {rec.lsn} holds a {p.raw_bytes}-byte page; this follower "
                                               f"stores {page}-byte pages (another layout)")
                    decode_page(open_payload(cold, p), p.codec, lay.itemsize, rows[row])
                    if ops and ops[-1][0] == "put":
                        ops[-1][2].append(p.key)
                        ops[-1][3].append(p.position)
                    else:
                        ops.append(["put", row, [p.key], [p.position]])
                    row += 1
                elif t == RecordType.DELETE:
                    ops.append(["delete", decode_delete(rec.body)])
                elif t in META_TYPES:
                    name, value = decode_meta(rec.body)
                    ops.append(["meta", META_KINDS[RecordType(t)], name, value])
                else:
                    ops.append(["skip"])
            except (CorruptionError, InvalidInput) as e:
                raise ReplicationError(f"shipped record {rec.lsn} cannot be applied ({e}); nothing of its "
                                       f"batch was applied") from None
        return rows, ops

    @staticmethod
    def _apply_ops(db, rows, ops, durability: str, tier, counters: dict) -> bool:
        """Run decoded ops in order, counting them in ``counters``; True when the follower
        should flush (deletes, metadata)."""
        lay = db.layout
        cold = db.cold_store
        must_flush = False
        for op in ops:
            kind = op[0]
            if kind == "put":
                _, start, keys, pos = op
                n = len(keys)
                blocks = torch.from_numpy(rows[start : start + n]).view(lay.dtype).view(n, *lay.block_shape)
                positions = [max(x, 0) for x in pos] if any(x >= 0 for x in pos) else None
                db.put_blocks(keys, blocks, positions=positions, durability=durability, tier=tier)
                counters["puts"] += n
                counters["records"] += n
                continue
            if kind == "delete":
                db.delete(op[1])
                counters["deletes"] += 1
                must_flush = True
            elif kind == "meta" and cold is not None:
                cold.put_metadata(op[1], op[2], op[3], durability="none")  # made durable by the flush
                counters["metadata"] += 1
                must_flush = True
            else:
                counters["skipped"] += 1  # CHECKPOINT; metadata on a memory-only follower
            counters["records"] += 1
        return must_flush

    # ------------------------------------------------------------------ the stream

    def serve_stream(self, ch: Channel, hello: Message, open_region, release_region) -> None:
        """Run one leader's stream on an accepted connection until it closes; ``open_region(n)``
        / ``release_region(r)`` lend landing memory (the node's pool)."""
        self.leader = str(hello.meta.get("leader") or ch.peer_node)[:256]
        self.key_namespace = key_namespace(namespace_of(self.db), hello.meta.get("namespace"))
        why = self._refusal(hello.meta)
        if why is not None:
            with self._lock:
                self.counters["refused_streams"] += 1
                again, self.last_refusal = self.last_refusal == why, why
            if not again:  # once per reason, not once per retry of the leader (every second)
                log.warning("refused the log stream of leader %s: %s", self.leader, why)
            ch.send_error(ErrorCode.NAMESPACE, f"{why}; nothing was applied")
            return
        self._warn_foreign_keys()
        want = int(hello.meta.get("region_bytes") or 0)
        leader_log = hello.meta.get("log_id")
        seal_check = hello.meta.get("seal_check")
        if seal_check and not key_matches(self.db.cold_store, bytes.fromhex(str(seal_check))):
            why = ("this follower has no disk tier" if self.db.cold_store is None
                   else "its disk tier is not encrypted with that key")
            ch.send_error(ErrorCode.INVALID, f"the leader's log is encrypted at rest and {why}: open the follower "
                                             "with the leader's encryption key (kvdb replicate serve "
                                             "--encryption-key-file); nothing was applied")
            return
        with self._lock:
            if self._applied == 0 and leader_log:
                self.log_id = str(leader_log)  # a fresh follower adopts the first leader's log
            reply = {"applied_lsn": self._applied, "log_id": self.log_id, "key_namespace": self.key_namespace,
                     "reseed": self.reopen is not None and self.swap_db is not None}
        # a follower of another log gets no records, only a re-seed if the leader is told to (S5)
        other_log = bool(self._applied and leader_log and self.log_id not in (None, leader_log))
        region = open_region(want) if want > 0 else None
        try:
            if region is not None and region.tensor is not None:
                reply["region"] = {"transport": ch.local_meta.get("transport"), "addr": region.addr,
                                   "bytes": region.nbytes}
            self._serve(ch, reply, region, other_log)
        finally:
            if self.staging is not None:
                self._drop_staging()
            if region is not None:
                release_region(region)

    def _warn_foreign_keys(self) -> None:
        """A raw byte mirror (``allow_foreign_keys``) of a leader of another key secret: warned
        about once per leader (the stream is taken)."""
        if self.key_namespace == "differs" and self.leader not in self._warned_keys:
            self._warned_keys.add(self.leader)
            log.warning("this follower has another key secret than leader %s and takes its records as a raw byte "
                        "mirror (allow_foreign_keys): it holds the leader's blocks, but lookups by tokens here "
                        "compute other keys and find none of them", self.leader)

    def _refusal(self, hello: dict) -> str | None:
        """Why this follower refuses the stream SHIP_HELLO announces (S6), or None."""
        theirs = hello.get("namespace")
        if theirs is not None:
            ours, them = namespace_of(self.db), f"leader {self.leader}"
            why = mismatch(ours, theirs, us="this follower", them=them)
            if why is None and not self.allow_foreign_keys:
                why = key_refusal(ours, theirs, us="this follower", them=them)
            return why
        page, theirs_page = self.db.layout.page_bytes, hello.get("page_bytes")
        if theirs_page is not None and theirs_page != page:
            return (f"leader {self.leader} ships {theirs_page}-byte pages; this follower stores {page}-byte pages "
                    f"({self.db.layout})")
        return None

    def _landed(self, ch: Channel, msg: Message, region: Region | None):
        """The bytes of a SHIP_RECORDS message (inline, or in the landing region); None: refused."""
        m = msg.meta
        nbytes = m.get("bytes")
        if not isinstance(nbytes, int) or nbytes < 0:
            ch.send_error(ErrorCode.PROTOCOL, "SHIP_RECORDS needs bytes")
            return None
        if m.get("inline"):
            buf = msg.blob
        else:
            off = m.get("offset")
            if region is None or region.tensor is None or not isinstance(off, int) or off < 0 \
                    or off + nbytes > region.nbytes:
                ch.send_error(ErrorCode.PROTOCOL, "SHIP_RECORDS names bytes outside the landing region")
                return None
            buf = memoryview(region.tensor[off : off + nbytes].numpy())
        if len(buf) != nbytes:
            ch.send_error(ErrorCode.PROTOCOL, f"SHIP_RECORDS carries {len(buf)} bytes, announced {nbytes}")
            return None
        return buf

    def _serve(self, ch: Channel, reply: dict, region: Region | None, other_log: bool) -> None:
        ch.send(MsgType.SHIP_POSITION, reply)
        while not ch.closed:
            msg = ch.expect(MsgType.SHIP_RECORDS, MsgType.RESEED_BEGIN, MsgType.RESEED_END)
            if msg.type == MsgType.RESEED_BEGIN:
                if not self._begin_reseed(ch, msg):
                    return
                other_log = False
                continue
            if msg.type == MsgType.RESEED_END:
                if self.staging is None:
                    ch.send_error(ErrorCode.PROTOCOL, "RESEED_END without RESEED_BEGIN")
                    return
                ch.send(MsgType.SHIP_ACK, {"applied_lsn": self._end_reseed(ch)})
                continue
            buf = self._landed(ch, msg, region)
            if buf is None:
                return
            if msg.meta.get("reseed"):
                if self.staging is None:
                    ch.send_error(ErrorCode.PROTOCOL, "re-seed records without RESEED_BEGIN")
                    return
                ch.send(MsgType.SHIP_ACK, {"reseed_records": self._apply_snapshot(ch, buf)})
                continue
            if other_log or self.staging is not None:
                ch.send_error(ErrorCode.PROTOCOL, "log records refused: this follower holds another leader's "
                              "log, or a re-seed is in progress")
                return
            try:
                first, last = int(msg.meta["first_lsn"]), int(msg.meta["last_lsn"])
            except (KeyError, TypeError, ValueError):
                ch.send_error(ErrorCode.PROTOCOL, "SHIP_RECORDS needs first_lsn and last_lsn")
                return
            try:
                applied = self.apply(buf, first, last)
            except ReplicationError as e:
                ch.send_error(ErrorCode.CORRUPT, str(e))
                raise
            ch.send(MsgType.SHIP_ACK, {"applied_lsn": applied})

    # ------------------------------------------------------------------ re-seed (reseed.py)

    def _begin_reseed(self, ch: Channel, msg: Message) -> bool:
        if self.reopen is None or self.swap_db is None:
            ch.send_error(ErrorCode.INVALID, "this follower cannot be re-seeded (a memory-only node, or one not "
                                             "run by kvdb replicate serve, or itself a leader)")
            return False
        m = msg.meta
        if self.staging is not None:
            self._drop_staging()
        try:
            self.staging = Staging(self.db.path, self.reopen, page_bytes=self.db.layout.page_bytes,
                                   snapshot_lsn=int(m["snapshot_lsn"]), log_id=m.get("log_id"),
                                   records_total=int(m.get("records") or 0),
                                   debug_after_records=self.debug_reseed_hook)
        except (KeyError, TypeError, ValueError):
            ch.send_error(ErrorCode.PROTOCOL, "RESEED_BEGIN needs snapshot_lsn")
            return False
        except KvdbError as e:
            ch.send_error(ErrorCode.INTERNAL, f"cannot start a re-seed: {e}")
            return False
        return True

    def _apply_snapshot(self, ch: Channel, buf) -> int:
        st = self.staging
        with self._lock:
            recs = self._check_records(buf)
            if any(r.rtype not in (RecordType.PUT_BLOCK, *META_TYPES) for r in recs):
                raise ReplicationError("a re-seed batch holds a record that is neither a block nor metadata")
            rows, ops = self._decode(recs, st.db)
            # durable at RESEED_END (its flush); the copy's records are not counted as log records
            self._apply_ops(st.db, rows, ops, "none", "disk", dict.fromkeys(self.counters, 0))
        st.received(len(recs), len(buf))
        return st.progress["records_received"]

    def _end_reseed(self, ch: Channel) -> int:
        st = self.staging
        st.seal()  # RS1: from here on the swap is rolled forward whatever happens

        def swap():
            finish_swap(st.path)
            return self.reopen(st.path)

        # under the apply lock: a batch of another stream already applying finishes (and
        # persists its position) before the swap, never after it over the copy's position
        with self._lock:
            self.db = self.swap_db(swap, ch)
            self._applied = self._load_applied()  # the copy's position file, swapped in
            self.counters["reseeds"] += 1
            self.last_reseed = {**st.progress, "state": "done"}
            self.staging = None
        return self._applied

    def _drop_staging(self) -> None:
        st, self.staging = self.staging, None
        if st is not None and st.progress["state"] == "receiving":
            st.abort()
