"""Log shipping, leader side: a leader streams its log to followers, which apply it
idempotently (the follower side is sink.py; re-seeding a follower from a copy is reseed.py).

Records travel verbatim (the exact bytes of kvdb/format/record.py: header, crc32c, body), so
the follower checks every record's own crc before applying it, whatever carried it.

Stream on one authenticated channel (leader connects to each follower)::

    leader                                         follower (NodeServer with a LogSink)
      SHIP_HELLO {leader, durable_lsn, page_bytes, region_bytes, log_id, seal_check, namespace}  ->
                                                   <- SHIP_POSITION {applied_lsn, log_id, region?, reseed}
      [RESEED_BEGIN ... RESEED_END: a full copy, when the follower is behind the log (reseed.py)]
      SHIP_RECORDS {first_lsn, last_lsn, bytes, inline|offset} [+ records]  ->
      SHIP_RECORDS ...  (at most two batches in flight; with the Transfer Engine the records
                         land in the follower's region halves, like a push)
                                                   <- SHIP_ACK {applied_lsn}   (durable there)

Leader follower-thread states::

    connecting --handshake + SHIP_POSITION--> streaming --error / drop--> disconnected
        |   └--behind the log, or reseed() asked--> reseeding --copy swapped in--> streaming
        ^                                                                      |
        └----------------------------- backoff (0.1 s .. 1 s) -----------------┘
    AuthError -> auth_failed; the follower refused the stream (ERROR{NAMESPACE}: another
    namespace -- model, revision, layout, dtype, key algorithm, rank, key secret --; ERROR{INVALID}:
    no key for an encrypted log, not a follower) -> refused. Both are retried with the longest
    backoff and keep their state and reason until a stream starts; ``sync`` raises at once while
    a follower it waits for is in either (AuthError for auth_failed, NamespaceError for another
    namespace), with the follower's own reason, instead of running into its timeout. Each is
    logged once per follower and reason.
    another leader's log, or ahead of this log (and no reseed() asked), or behind the log but
    not re-seedable (memory-only) -> needs_reseed (stops retrying until reseed()).

Invariants:
  S1. A follower acknowledges lsn L only after every record <= L is applied with the Db's
      strongest durability and L is persisted as its applied position (``applied_lsn`` file).
  S2. Applying is idempotent: a record <= applied_lsn is skipped; re-applying a PUT of a stored
      key or a DELETE of an absent key changes nothing, so a follower that crashed between
      applying and persisting its position converges when the leader re-sends.
  S3. The leader ships only records its log made durable (``LogSource.durable_lsn``): a follower
      never holds a record the leader could lose in a crash.
  S4. Replication slots: the leader persists each follower's confirmed lsn (``slots.json``,
      kvdb/format/slots.py) and ``retained_lsn(state_dir)`` (slots.py) is the lowest one:
      compaction must keep every record above it.
  S5. Lsns are only compared within one log: the leader's ``log_id`` (kvdb/format/slots.py)
      travels in SHIP_HELLO and is stored with the follower's position; a follower of another
      log is never streamed to.
  S6. A follower applies nothing of a leader of another namespace (namespace.py): the leader's
      namespace travels in SHIP_HELLO and the follower refuses the stream before SHIP_POSITION
      (the key secret as its fingerprint, ``key_secret_id``: a follower of another key secret
      refuses unless it was made a raw byte mirror, ``allow_foreign_keys``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Protocol

from kvdb.cold.export import Snapshot
from kvdb.errors import (
    AuthError,
    InvalidInput,
    KvdbError,
    NamespaceError,
    ReplicationError,
)
from kvdb.replication.channel import Channel, RemoteError, connect
from kvdb.replication.namespace import key_namespace
from kvdb.replication.protocol import ErrorCode, MsgType
from kvdb.replication.reseed import snapshot_batches
from kvdb.replication.sendbuf import SendBuffers
from kvdb.replication.slots import log_id_of, read_slots, write_slots
from kvdb.replication.transport import Transport, get_transport

log = logging.getLogger("kvdb.replication")

DEFAULT_BATCH_BYTES = 32 << 20
#: The streams are woken by the leader store's durability listener right after each group
#: commit, sync put or flush (``notify``); an idle stream looks again after POLL_S at the
#: latest, as a safety net.
POLL_S = 0.05


# ---------------------------------------------------------------- leader side: the log


class LogSource(Protocol):
    """What the leader reads its log through: a segment directory (kvdb/wal/source.py
    ``SegmentLogSource``, the Db's log), or any other log that answers these calls."""

    def durable_lsn(self) -> int:
        """The highest lsn made durable (0 when empty)."""

    def first_lsn(self) -> int:
        """The oldest lsn still readable (1 when nothing was compacted away)."""

    def read_records(self, after_lsn: int, max_bytes: int, upto_lsn: int) -> list[tuple[int, memoryview]]:
        """Consecutive encoded records with after_lsn < lsn <= upto_lsn, at least one if any,
        about max_bytes in all."""


# ---------------------------------------------------------------- leader side: shipping


class _Follower:
    __slots__ = ("addr", "auth_failures", "blocked", "channel", "confirmed_lsn", "connects", "error", "key_namespace",
                 "namespace_refusals", "refusals", "reseed", "reseed_asked", "reseeds", "sent_lsn", "state", "thread")

    def __init__(self, addr: str, confirmed: int) -> None:
        self.addr = addr
        self.state = "connecting"
        self.confirmed_lsn = confirmed
        self.sent_lsn = confirmed
        self.error: str | None = None
        self.thread: threading.Thread | None = None
        self.connects = 0
        self.channel: Channel | None = None  # the open stream, closed by stop() to unblock it
        self.reseed: dict | None = None  # progress of a re-seed being sent (reseed.py)
        self.reseed_asked = False  # LogShipper.reseed(): re-seed at the next connection whatever its position
        self.reseeds = 0
        # why this follower cannot be streamed to until it is reconfigured: ("auth_failed" |
        # "refused", reason, refused for another namespace); kept across retries, cleared when a stream starts
        self.blocked: tuple[str, str, bool] | None = None
        self.auth_failures = 0  # handshakes it refused for this leader's secret
        self.refusals = 0  # streams it refused (ERROR{INVALID} or ERROR{NAMESPACE})
        self.namespace_refusals = 0  # of those, refused for another namespace (key secret included)
        self.key_namespace = "unknown"  # whether it computes this leader's keys (namespace.py), as it said


class LogShipper:
    """Streams ``source`` to each address in ``replicas`` (one thread each); see the module doc."""

    def __init__(self, source: LogSource, replicas, secret: bytes, *, state_dir=None, node: str = "",
                 transport: Transport | str | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 page_bytes: int | None = None, store=None, seal_check: bytes | None = None,
                 namespace: dict | None = None) -> None:
        self.source = source
        self.namespace = namespace  # the leader Db's namespace (namespace.py; None: a bare log, not checked)
        self.store = store  # the leader's ColdStore: re-seed snapshots (None: followers are not re-seeded)
        self.seal_check = seal_check  # the log's encryption key check (None: not encrypted)
        self.secret = secret
        self.node = node
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self._transport_arg = transport
        self.batch_bytes = int(batch_bytes)
        self.poll_s = POLL_S  # an idle stream's longest wait between looks
        self.page_bytes = page_bytes
        self._cond = threading.Condition()  # guards every _Follower field, _stopping and _wakes
        self._stopping = False
        self._wakes = 0  # notify() calls so far: a stream waits only if none came since it looked
        self._listening = False  # registered as the store's durability listener
        slots = read_slots(self.state_dir) if self.state_dir is not None else {}
        self.log_id = log_id_of(self.state_dir)
        self.followers = [_Follower(a, slots.get(a, 0)) for a in replicas]
        self._slots_lock = threading.Lock()  # one writer of slots.json at a time; guards _slots_saved_at
        self._slots_saved_at = 0.0

    # -- lifecycle

    def start(self) -> LogShipper:
        if self.store is not None and hasattr(self.store, "add_durable_listener"):
            self.store.add_durable_listener(self._on_durable)
            self._listening = True
        for f in self.followers:
            f.thread = threading.Thread(target=self._run, args=(f,), name=f"kvdb-ship-{f.addr}", daemon=True)
            f.thread.start()
        return self

    def stop(self) -> None:
        if self._listening:
            self.store.remove_durable_listener(self._on_durable)
            self._listening = False
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            chans = [f.channel for f in self.followers if f.channel is not None]
        for ch in chans:  # a stream blocked on a silent follower wakes up
            ch.close()
        for f in self.followers:
            if f.thread is not None:
                f.thread.join(10)
        self._save_slots(force=True)

    def notify(self) -> None:
        """New records were made durable: wake the streams (they also poll)."""
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()

    def _on_durable(self, lsn: int) -> None:
        self.notify()

    def poll_only(self, interval_s: float) -> None:
        """Stop listening to the store and look for new records every ``interval_s`` (the
        polling baseline of ``kvdb bench replication``)."""
        if self._listening:
            self.store.remove_durable_listener(self._on_durable)
            self._listening = False
        self.poll_s = interval_s

    def sync(self, timeout_s: float) -> int:
        """Wait until every follower confirmed everything durable now; returns that lsn."""
        target = self.source.durable_lsn()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                lagging = [f for f in self.followers if f.confirmed_lsn < target]
                if not lagging:
                    return target
                left = deadline - time.monotonic()
                blocked = [f for f in lagging if f.blocked is not None]
                if left <= 0 or self._stopping or blocked:
                    desc = ", ".join(f"{f.addr} at {f.confirmed_lsn} ({f.state}{': ' + f.error if f.error else ''})"
                                     for f in lagging)
                    if not blocked:
                        raise ReplicationError(f"followers have not confirmed lsn {target} within {timeout_s} s: "
                                               f"{desc}")
                    # the follower said why it will not confirm: waiting out the timeout changes nothing
                    err = (AuthError if any(f.blocked[0] == "auth_failed" for f in blocked) else
                           NamespaceError if any(f.blocked[2] for f in blocked) else ReplicationError)
                    raise err(f"followers cannot confirm lsn {target}: {desc}")
                self._cond.wait(min(left, 0.1))

    def status(self) -> list[dict]:
        last = self.source.durable_lsn()
        with self._cond:
            return [{"addr": f.addr, "state": f.state, "confirmed_lsn": f.confirmed_lsn,
                     "lag_records": max(0, last - f.confirmed_lsn), "error": f.error, "connects": f.connects,
                     "reseed": dict(f.reseed) if f.reseed else None, "reseeds": f.reseeds,
                     "auth_failures": f.auth_failures, "refusals": f.refusals,
                     "namespace_refusals": f.namespace_refusals, "key_namespace": f.key_namespace}
                    for f in self.followers]

    def counters(self) -> dict:
        """Summed over the followers: handshakes refused for this leader's secret, streams refused
        (and of those, for another namespace)."""
        with self._cond:
            return {"auth_failures": sum(f.auth_failures for f in self.followers),
                    "refused_streams": sum(f.refusals for f in self.followers),
                    "namespace_refusals": sum(f.namespace_refusals for f in self.followers)}

    def reseed(self, addr: str) -> None:
        """Re-seed follower ``addr`` at its next connection (now: its stream is restarted), also
        when it holds another leader's log or is ahead of this one (its state is replaced)."""
        with self._cond:
            f = next((x for x in self.followers if x.addr == addr), None)
            if f is None:
                raise InvalidInput(f"{addr} is not a follower of this leader ({[x.addr for x in self.followers]})")
            if self.store is None:
                raise InvalidInput("this leader cannot re-seed followers (it ships a log directory, not a Db)")
            f.reseed_asked = True
            ch = f.channel
            self._cond.notify_all()  # a follower thread parked in needs_reseed goes on
        if ch is not None:
            ch.close()  # the running stream reconnects and re-seeds

    def _save_slots(self, force: bool = False) -> None:
        if self.state_dir is None:
            return
        with self._slots_lock:
            now = time.monotonic()
            if not force and now - self._slots_saved_at < 0.5:
                return
            self._slots_saved_at = now
            with self._cond:
                slots = {f.addr: f.confirmed_lsn for f in self.followers}
            write_slots(self.state_dir, slots)

    # -- one follower

    def _set(self, f: _Follower, **kw) -> None:
        with self._cond:
            for k, v in kw.items():
                setattr(f, k, v)
            self._cond.notify_all()

    def _block(self, f: _Follower, state: str, e: Exception, namespace: bool = False) -> None:
        """The follower will not take this stream until it is reconfigured (see the module doc);
        ``namespace``: it refused this leader's namespace (``sync`` raises NamespaceError)."""
        why = str(e)
        with self._cond:
            again = f.blocked == (state, why, namespace)
            f.blocked, f.state, f.error = (state, why, namespace), state, why
            if state == "auth_failed":
                f.auth_failures += 1
            else:
                f.refusals += 1
                f.namespace_refusals += namespace
            self._cond.notify_all()
        if not again:  # once per follower and reason, not once per retry
            log.error("log stream to follower %s: %s (%s; retried every second)", f.addr, why, state)

    def _run(self, f: _Follower) -> None:
        backoff = 0.1
        while not self._stopping:
            connects = f.connects
            try:
                self._stream(f)
            except AuthError as e:
                self._block(f, "auth_failed", e)
                backoff = 1.0
            except RemoteError as e:
                if e.code in (ErrorCode.INVALID, ErrorCode.NAMESPACE):
                    self._block(f, "refused", e, namespace=e.code == ErrorCode.NAMESPACE)
                    backoff = 1.0
                else:
                    self._set(f, state="disconnected", error=str(e))
                    log.info("log stream to %s: %s", f.addr, e)
            except _Reseed as e:
                self._set(f, state="needs_reseed", error=str(e), blocked=None)
                log.error("%s", e)
                with self._cond:  # parked until reseed() is asked for, or the shipper stops
                    while not (self._stopping or f.reseed_asked):
                        self._cond.wait()
                continue
            except (ReplicationError, OSError, KvdbError) as e:
                self._set(f, state="disconnected", error=str(e))
                log.info("log stream to %s: %s", f.addr, e)
            if f.connects > connects and f.state == "disconnected":
                backoff = 0.1  # it was streaming: retry soon
            with self._cond:
                if not self._stopping:
                    self._cond.wait(backoff)
            backoff = min(1.0, backoff * 2)
        self._set(f, state="stopped")

    def _stream(self, f: _Follower) -> None:
        if f.blocked is None:  # a blocked follower keeps its state and reason until a stream starts
            self._set(f, state="connecting")
        ch = connect(f.addr, self.secret, node=self.node, timeout_s=30)
        # its WELCOME's namespace: whether it computes this leader's keys, also when it refuses
        self._set(f, channel=ch, key_namespace=key_namespace(self.namespace or {}, ch.peer_meta.get("namespace")))
        try:
            transport = (self._transport_arg if isinstance(self._transport_arg, Transport)
                         else get_transport(self._transport_arg, local_host=ch.sock.getsockname()[0]))
            engine = transport.can_write_to(ch.peer_meta.get("transport"))
            ch.send(MsgType.SHIP_HELLO, {"leader": self.node, "durable_lsn": self.source.durable_lsn(),
                                         "page_bytes": self.page_bytes, "log_id": self.log_id,
                                         "seal_check": self.seal_check.hex() if self.seal_check else None,
                                         "namespace": self.namespace,
                                         "region_bytes": 2 * self.batch_bytes if engine else 0})
            pos = ch.expect(MsgType.SHIP_POSITION).meta
            applied = int(pos.get("applied_lsn", 0))
            self._set(f, key_namespace=str(pos.get("key_namespace") or f.key_namespace)[:16])
            region = pos.get("region") if engine else None
            if engine and not region:
                engine = False
            why, automatic = self._needs_reseed(f, applied, pos.get("log_id"))
            if why is not None and not (automatic or f.reseed_asked):
                raise _Reseed(f"{why}; re-seed it (LogShipper.reseed / db.reseed_replica)")
            bufs = SendBuffers(transport, int(region["bytes"]) // 2 if engine else 0)
            try:
                if why is not None or f.reseed_asked:
                    if self.store is None or not pos.get("reseed"):
                        with self._cond:
                            f.reseed_asked = False  # cannot be done: parked until asked again
                        raise _Reseed(f"{why or 'a re-seed was asked for'}, and "
                                      + ("this leader has no Db to copy" if self.store is None else
                                         "the follower cannot be re-seeded (memory-only, or not run by "
                                         "kvdb replicate serve); copy the leader's data directory to it"))
                    applied = self._send_snapshot(f, ch, transport, region, bufs)
                self._set(f, state="streaming", confirmed_lsn=applied, sent_lsn=applied, error=None,
                          connects=f.connects + 1, blocked=None)
                self._save_slots(force=True)
                self._pump(f, ch, transport, region, bufs)
            finally:
                bufs.release()
        finally:
            self._set(f, channel=None)
            ch.close()

    def _needs_reseed(self, f: _Follower, applied: int, theirs) -> tuple[str | None, bool]:
        """Why follower ``f`` at ``applied`` cannot be streamed to (None: it can), and whether a
        re-seed is automatic (it is only behind: nothing of its own would be lost)."""
        if applied and self.log_id and theirs not in (None, "-", self.log_id):
            return (f"follower {f.addr} has applied lsn {applied} of another leader log ({theirs}, this one is "
                    f"{self.log_id})"), False
        first, last = self.source.first_lsn(), self.source.durable_lsn()
        if applied > last:
            return (f"follower {f.addr} has applied lsn {applied} but this leader's log ends at {last}: it holds "
                    "another history"), False
        if applied + 1 < first:
            return f"follower {f.addr} needs records after lsn {applied} but the leader's log starts at {first}", True
        return None, False

    def _send_snapshot(self, f: _Follower, ch: Channel, transport, region, bufs) -> int:
        """Stream a full copy of the leader's live state (reseed.py); returns its lsn, which the
        follower now holds. Two batches in flight, acknowledged as they are applied."""
        snap = Snapshot.take(self.store)
        total = len(snap.keys) + len(snap.metadata)
        progress = {"snapshot_lsn": snap.lsn, "records_total": total, "records_sent": 0, "records_confirmed": 0}
        self._set(f, state="reseeding", reseed=progress, error=None, blocked=None)
        self._save_slots(force=True)  # RS3: its old slot (<= snap.lsn) holds the log after snap.lsn
        log.info("re-seeding follower %s from a copy as of lsn %d (%d records)", f.addr, snap.lsn, total)
        ch.send(MsgType.RESEED_BEGIN, {"snapshot_lsn": snap.lsn, "log_id": self.log_id, "records": total})
        half = int(region["bytes"]) // 2 if region else self.batch_bytes
        in_flight: deque[int] = deque()
        sent = 0
        for batch_no, recs in enumerate(snapshot_batches(snap, min(self.batch_bytes, half))):
            if self._stopping:
                raise ReplicationError("the leader is stopping")
            if len(in_flight) == 2:
                self._reseed_ack(f, ch, in_flight.popleft())
            self._send_batch(ch, transport, region, bufs, half, batch_no, [(0, memoryview(r)) for r in recs],
                             {"reseed": True})
            sent += len(recs)
            in_flight.append(sent)
            self._set(f, reseed={**progress, "records_sent": sent, "records_total": max(total, sent)})
        while in_flight:
            self._reseed_ack(f, ch, in_flight.popleft())
        ch.send(MsgType.RESEED_END, {"snapshot_lsn": snap.lsn, "records": sent})
        got = int(ch.expect(MsgType.SHIP_ACK).meta.get("applied_lsn", -1))
        if got != snap.lsn:
            raise ReplicationError(f"follower {f.addr} ended its re-seed at lsn {got}, expected {snap.lsn}")
        with self._cond:
            f.reseed_asked = False
            f.reseeds += 1
        self._set(f, reseed=None)
        log.info("follower %s re-seeded at lsn %d (%d records, %d gone meanwhile)", f.addr, snap.lsn, sent,
                 snap.records_missing)
        return snap.lsn

    def _reseed_ack(self, f: _Follower, ch: Channel, want: int) -> None:
        got = int(ch.expect(MsgType.SHIP_ACK).meta.get("reseed_records", -1))
        if got != want:
            raise ReplicationError(f"follower {f.addr} acknowledged {got} re-seed records, expected {want}")
        with self._cond:
            if f.reseed is not None:
                f.reseed = {**f.reseed, "records_confirmed": got}

    def _pump(self, f: _Follower, ch: Channel, transport: Transport, region: dict | None, bufs) -> None:
        in_flight: deque[int] = deque()
        half = int(region["bytes"]) // 2 if region else self.batch_bytes
        batch_no = 0
        while True:
            with self._cond:
                if self._stopping:
                    return
                wakes = self._wakes  # read before durable_lsn: a commit after it is not missed
                if f.reseed_asked:
                    raise ReplicationError(f"stream to {f.addr} restarted for a re-seed")
            sent = f.sent_lsn
            upto = self.source.durable_lsn()
            recs = []
            if len(in_flight) < 2 and upto > sent:
                recs = self.source.read_records(sent, min(self.batch_bytes, half), upto)
            if recs:
                self._send_batch(ch, transport, region, bufs, half, batch_no, recs)
                batch_no += 1
                self._set(f, sent_lsn=recs[-1][0])
                in_flight.append(recs[-1][0])
                continue
            if in_flight:
                ack = ch.expect(MsgType.SHIP_ACK)
                want = in_flight.popleft()
                got = int(ack.meta.get("applied_lsn", -1))
                if got != want:
                    raise ReplicationError(f"follower {f.addr} acknowledged lsn {got}, expected {want}")
                self._set(f, confirmed_lsn=got)
                self._save_slots()
                continue
            with self._cond:
                if not self._stopping and self._wakes == wakes:
                    self._cond.wait(self.poll_s)  # notify() (a commit, sync_replicas) wakes it at once

    def _send_batch(self, ch, transport, region, bufs, half, batch_no, recs, meta=None) -> None:
        total = sum(b.nbytes for _, b in recs)
        meta = meta or {"first_lsn": recs[0][0], "last_lsn": recs[-1][0]}
        meta.update(bytes=total, count=len(recs))
        if region is None or total > half:
            meta["inline"] = True
            ch.send(MsgType.SHIP_RECORDS, meta, [b for _, b in recs])
            return
        off = (batch_no % 2) * half
        src = bufs.source(recs, off)
        transport.write(region["transport"], [(src, total)], [int(region["addr"]) + off])
        meta.update(inline=False, offset=off)
        ch.send(MsgType.SHIP_RECORDS, meta)


class _Reseed(ReplicationError):
    pass
