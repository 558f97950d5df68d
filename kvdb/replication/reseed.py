"""Re-seeding a follower: a full copy of the leader's live state, then log shipping from its lsn.

A follower whose position the leader's log no longer holds (compacted away, or a new follower
of a leader whose log does not start at 1) is re-seeded on the same log stream, right after
SHIP_POSITION (shipping.py); one that applied another leader's log, or is ahead of this one,
only when asked (``LogShipper.reseed(addr)``: its state would be thrown away)::

    leader                                                   follower (LogSink)
      RESEED_BEGIN {snapshot_lsn L, log_id, records N}   ->  opens a staging Db
      SHIP_RECORDS {reseed: true, count, bytes} [+ records] ->  applies them into it
                                                          <- SHIP_ACK {reseed_records}
      ...   (two batches in flight, like log shipping)
      RESEED_END {snapshot_lsn L, records N}             ->  flush + close the staging Db,
                                                             swap it in, reopen the Db
                                                          <- SHIP_ACK {applied_lsn: L}
      SHIP_RECORDS from L + 1 (ordinary log shipping)

Follower states (``LogSink.status()["reseed"]``, shown by ``kvdb replicate status``)::

    idle --RESEED_BEGIN--> receiving --RESEED_END--> swapping --reopened--> idle (applied L)
              receiving --error / dropped stream / crash--> idle (staging dropped, old state)

Invariants:
  RS1 The follower holds either its old state or the whole copy, whenever it crashes: the copy
      is built in ``PATH/replication/reseed.new`` (a Db directory with the follower's own
      MANIFEST.json and KEY_SECRET), made durable and closed, with its position file
      (lsn L, the leader's log id: kvdb/format/position.py) inside; only then is the marker ``PATH/replication/RESEED_SWAP``
      written. With the marker present the swap (wal/, index/ and the position file moved in,
      the old ones moved aside) is rolled forward by ``finish_swap``, which ``kvdb replicate
      serve`` runs before it opens the Db, and every Db open runs under its lock; without it a
      staging directory is an interrupted copy and is deleted. Either way the stream then
      resumes (a re-seed starts over). The swap's files: kvdb/format/swap.py; the roll-forward
      is a directory-recovery step of the Db (kvdb/db/open.py), so the Db needs nothing here.
  RS2 The copy is the leader's records, verbatim (each crc checked by the follower; sealed
      payloads stay sealed on the wire), and the copy followed by the log from L + 1 is the
      leader's state (kvdb/cold/export.py, "Snapshot consistency").
  RS3 The leader's retention floor (replication slots, shipping.py S4) is still the follower's
      old confirmed lsn, which is below L: the records after L stay in the leader's log until
      the follower confirms them.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from kvdb.db.open import finish_swap, finish_swap_locked
from kvdb.errors import KvdbError, ReplicationError
from kvdb.format import position
from kvdb.format.swap import APPLIED_NAME, ASIDE_DIR, COPIED, MOVED, STAGING_DIR, SWAP_MARKER
from kvdb.fs import OsFs, write_file_atomic

log = logging.getLogger("kvdb.replication")

__all__ = ["APPLIED_NAME", "ASIDE_DIR", "COPIED", "MOVED", "STAGING_DIR", "SWAP_MARKER", "Staging",
           "finish_swap", "finish_swap_locked", "snapshot_batches"]


class Staging:
    """The copy a follower is receiving: a Db in ``PATH/replication/reseed.new`` opened with
    ``reopen(dir, host_bytes=...)`` (the daemon's own options). Blocks go to its disk tier only."""

    def __init__(self, path, reopen, *, page_bytes: int, snapshot_lsn: int, log_id: str | None,
                 records_total: int, debug_after_records=None) -> None:
        self.path = Path(path)
        self.dir = self.path / "replication" / STAGING_DIR
        self.snapshot_lsn = int(snapshot_lsn)
        self.log_id = log_id
        self.progress = {"state": "receiving", "snapshot_lsn": self.snapshot_lsn, "records_total": int(records_total),
                         "records_received": 0, "bytes_received": 0, "started_unix_s": round(time.time(), 3)}
        self.debug_after_records = debug_after_records  # tests: called with the count after each batch
        shutil.rmtree(self.dir, ignore_errors=True)  # a copy interrupted earlier (RS1)
        self.dir.mkdir(parents=True)
        for name in COPIED:
            if (self.path / name).exists():
                shutil.copy2(self.path / name, self.dir / name)
        self.db = reopen(self.dir, host_bytes=page_bytes)
        if self.db.cold_store is None:
            self.abort()
            raise ReplicationError("a re-seed needs the follower's disk tier (it was opened with disk_bytes=0)")

    def received(self, records: int, nbytes: int) -> None:
        self.progress["records_received"] += records
        self.progress["bytes_received"] += nbytes
        if self.debug_after_records is not None:
            self.debug_after_records(self.progress["records_received"])

    def seal(self) -> None:
        """The copy is complete: make it durable with its position, close it, write the marker."""
        self.progress["state"] = "swapping"
        self.db.flush()
        (self.dir / "replication").mkdir(exist_ok=True)
        write_file_atomic(self.dir / "replication" / APPLIED_NAME,
                          position.encode_file(position.Position(1, self.snapshot_lsn, self.log_id)))
        self.db.close()
        # the copy's directory entries (wal/, index/, their files, replication/) must be on disk
        # before the marker says the copy is complete: fsync every directory of it, deepest first
        fs = OsFs()
        for root, _dirs, _files in sorted(os.walk(self.dir), key=lambda t: -t[0].count(os.sep)):
            fs.sync_dir(root)
        fs.sync_dir(str(self.path / "replication"))
        write_file_atomic(self.path / "replication" / SWAP_MARKER, b"reseed.new complete\n")

    def abort(self) -> None:
        try:
            self.db.close()
        except KvdbError as e:  # the copy is thrown away whatever went wrong with it
            log.warning("closing an abandoned re-seed copy in %s: %s", self.dir, e)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- leader side


def snapshot_batches(snap, max_bytes: int):
    """The snapshot's records (metadata first, then blocks) in lists of about ``max_bytes``."""
    batch, total = [], 0
    for rec in snap.metadata:
        if batch and total + len(rec) > max_bytes:
            yield batch
            batch, total = [], 0
        batch.append(rec)
        total += len(rec)
    step = 64
    for i in range(0, len(snap.keys), step):
        for rec in snap.read(snap.keys[i : i + step]):
            if batch and total + len(rec) > max_bytes:
                yield batch
                batch, total = [], 0
            batch.append(rec)
            total += len(rec)
    if batch:
        yield batch
