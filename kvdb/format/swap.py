"""The re-seed swap: the files by which a Db directory takes over a full copy of another node's
state atomically (the protocol of kvdb/replication/reseed.py, invariant RS1).

Names only; the roll-forward that reads them is a directory-recovery step of the Db
(``kvdb.db.open.finish_swap_locked``, run under the directory's lock at every open)::

    PATH/replication/reseed.new/     STAGING_DIR: the copy being received, itself a Db
                                     directory (MANIFEST.json and KEY_SECRET copied in: COPIED)
        wal/  index/                 its durable state (MOVED)
        replication/applied_lsn      its position file (APPLIED_NAME: kvdb/format/position.py)
    PATH/replication/RESEED_SWAP     SWAP_MARKER: written (durably) once the copy is sealed
    PATH/replication/reseed.old/     ASIDE_DIR: where PATH/wal/ and PATH/index/ are moved
                                     before the copy's are moved in

With the marker present the swap is rolled forward from wherever it stopped (each of MOVED moved
in, the old one put aside first; the position file replaced; directories synced; the marker,
then the aside and staging directories removed). Without it a staging or aside directory is an
interrupted copy and is deleted: the directory keeps its old state.
"""

from __future__ import annotations

SWAP_MARKER = "RESEED_SWAP"
STAGING_DIR = "reseed.new"
ASIDE_DIR = "reseed.old"
MOVED = ("wal", "index")  # the Db's durable state (the cold tier); everything else stays
# the follower's own identity, copied into the staging Db: its store id (MANIFEST.json), so the
# copy's segments and index carry the follower's id, and its key secret -- the cluster's when the
# daemon was given one (docs/replication.md, "One key namespace per cluster"), which is what makes
# the leader's keys the follower's own
COPIED = ("MANIFEST.json", "KEY_SECRET")
APPLIED_NAME = "applied_lsn"  # a follower's position file, in PATH/replication/
REPLICATION_DIR = "replication"  # replication's state inside a Db directory
