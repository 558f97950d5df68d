"""Re-seeding a follower from a full copy of the leader (reseed.py): the forced re-seed of a
follower of another log, an automatic one of a follower left behind the log, a follower killed
in the middle (old or new state, then resumed), and the swap rolled forward from every point
a crash can interrupt it."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import kvdb
from kvdb.errors import CorruptionError, ReplicationError
from kvdb.format import position
from kvdb.format.index_value import STORE_KEY
from kvdb.format.record import decode_segment_header
from kvdb.replication import NodeServer, Peer
from kvdb.replication.replicator import Replicator
from kvdb.replication.reseed import (
    ASIDE_DIR,
    STAGING_DIR,
    SWAP_MARKER,
    Staging,
    finish_swap,
)
from kvdb.replication.sink import LogSink

from .conftest import KEY_SECRET, LAYOUT, SECRET, TRANSPORTS, make_blocks, make_keys, open_db, wait_for

_wait = functools.partial(wait_for, poll_s=0.002)  # fast: some tests catch a re-seed mid-copy

PAGE = LAYOUT.page_bytes
RECORD_BYTES = 53 + PAGE  # one raw PUT_BLOCK record


def _reopen(path, host_bytes=64 * PAGE):
    return kvdb.open(path, host_bytes=host_bytes, key_secret=KEY_SECRET)  # the daemon's options: the cluster's


def _blocks_of(db, keys) -> dict:
    out = torch.empty((1, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    got = {}
    for k in keys:
        if db.match_prefix([k], peek=True):
            db.get_blocks([k], out=out)
            got[k] = out.clone()
    return got


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_follower_of_another_log_is_reseeded_when_asked(netns, tmp_path, kind):
    # Scenario: follower f applied leader A's log (blocks ka). Leader B (another data directory:
    # blocks kb, a deleted block, a lease) finds f on another log: needs_reseed, nothing sent.
    # db.reseed_replica(f) streams B's copy in batches of 3 records; the first attempt fails
    # after 6 records (a fault): f still holds exactly A's state and its position, and no
    # staging copy is left. The retry replaces f's state by B's; B's next writes stream on; the
    # directory then opens as an ordinary Db with exactly B's blocks and lease.
    ka, kb = make_keys(4, tag=70), make_keys(12, tag=71)
    ba, bb = make_blocks(4, seed=70), make_blocks(12, seed=71)
    fdb = open_db(tmp_path / "f")
    srv = NodeServer(fdb, "127.0.0.1:0", SECRET, transport=kind, sink=LogSink.for_db(fdb, reopen=_reopen)).start()
    sink = srv.sink
    try:
        with open_db(tmp_path / "a") as a:
            rep = Replicator(a, replicas=[srv.address], secret=SECRET, transport=kind)
            a.put_blocks(ka, ba, durability="group")
            lsn_a = rep.sync_replicas(30)
            rep.close()
        with open_db(tmp_path / "b") as b:
            b.put_blocks(kb, bb, durability="group")
            b.delete(kb[-2:])
            b.cold_store.put_metadata("lease", b"l", b"holder")
            rep = Replicator(b, replicas=[srv.address], secret=SECRET, transport=kind)
            try:
                _wait(lambda: rep.status()["followers"][0]["state"] == "needs_reseed", "needs_reseed")
                rep.shipper.batch_bytes = 3 * RECORD_BYTES
                failed, seen = [], {}

                def fault(received: int) -> None:
                    if received >= 6 and not failed:
                        failed.append(received)
                        assert set(_blocks_of(srv.db, ka + kb)) == set(ka)  # the old state, untouched
                        with Peer(srv.address, secret=SECRET, transport="tcp") as p:  # what `status` shows
                            seen["follower"] = p.status()["follower"]["reseed"]
                        seen["leader"] = rep.status()["followers"][0]
                        raise ReplicationError("injected: the stream broke mid re-seed")

                sink.debug_reseed_hook = fault
                rep.reseed(srv.address)
                _wait(lambda: rep.status()["followers"][0]["reseeds"] == 1, "the re-seed")
                lsn = rep.sync_replicas(30)
                assert failed == [6]
                assert {k: seen["follower"][k] for k in ("state", "records_received", "records_total")} == \
                    {"state": "receiving", "records_received": 6, "records_total": 11}
                assert seen["leader"]["state"] == "reseeding" and seen["leader"]["reseed"]["records_sent"] >= 6
                assert sink.applied_lsn() == lsn and sink.log_id == rep.shipper.log_id
                st = sink.status()
                assert st["reseed"] is None and st["reseeds"] == 1
                assert st["last_reseed"]["records_received"] == st["last_reseed"]["records_total"] == 11
                assert set(_blocks_of(srv.db, ka + kb)) == set(kb[:-2])
                kc, bc = make_keys(2, tag=72), make_blocks(2, seed=72)
                b.put_blocks(kc, bc, durability="group")
                assert rep.sync_replicas(30) > lsn
                want = _blocks_of(b, ka + kb + kc)
            finally:
                rep.close()
    finally:
        srv.stop()
        srv.db.close()
    assert not (tmp_path / "f" / "replication" / STAGING_DIR).exists()
    # the copy was written by f's own staging Db (f's MANIFEST.json copied in): every file of it
    # carries f's store id, not b's (kvdb/format/swap.py COPIED)
    f_id = json.loads((tmp_path / "f" / "MANIFEST.json").read_text())["store_id"]
    assert f_id != json.loads((tmp_path / "b" / "MANIFEST.json").read_text())["store_id"]
    assert {decode_segment_header(p.read_bytes()[:48]).store_id.hex() for p in (tmp_path / "f" / "wal").glob("*.log")} \
        == {f_id}
    with open_db(tmp_path / "f") as plain:
        assert plain.cold_store.index.get(STORE_KEY).hex() == f_id
        got = _blocks_of(plain, ka + kb + kc)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert plain.cold_store.find_metadata("lease", b"l") == b"holder"
        assert plain.cold_store.contains(ka) == [False] * 4
    assert lsn_a < lsn


@pytest.mark.parametrize("finisher", ["finish_swap", "open"])
def test_finish_swap_rolls_forward_from_every_crash_point(tmp_path, finisher):
    # Scenario (RS1): a follower holds blocks A; a complete copy holding blocks B is sealed
    # (marker written). A crash after any prefix of the swap's steps -- old wal/ moved aside,
    # new wal/ moved in, the same for index/, the position file moved in -- is finished by
    # finish_swap: the directory then opens with exactly B and the copy's position. Without
    # the marker (a crash while the copy was received) the copy is dropped and A stays.
    # A plain open of the directory finishes it the same way (it takes the lock first).
    ka, kb = make_keys(3, tag=73), make_keys(5, tag=74)
    steps = [("wal", "aside"), ("wal", "in"), ("index", "aside"), ("index", "in"), ("applied", "in")]
    for crash_at in range(len(steps) + 1):
        path = tmp_path / f"f{crash_at}"
        with open_db(path) as db:
            db.put_blocks(ka, make_blocks(3, seed=73), durability="group")
        st = Staging(path, _reopen, page_bytes=PAGE, snapshot_lsn=42, log_id="cafe", records_total=5)
        st.db.put_blocks(kb, make_blocks(5, seed=74), durability="none", tier="disk")
        st.seal()
        rep = path / "replication"
        (rep / ASIDE_DIR).mkdir()
        for name, how in steps[:crash_at]:
            if name == "applied":
                os.replace(rep / STAGING_DIR / "replication" / "applied_lsn", rep / "applied_lsn")
            elif how == "aside":
                os.rename(path / name, rep / ASIDE_DIR / name)
            else:
                os.rename(rep / STAGING_DIR / name, path / name)
        if finisher == "finish_swap":
            assert finish_swap(path) is True
        else:
            open_db(path).close()
        assert not (rep / SWAP_MARKER).exists() and not (rep / STAGING_DIR).exists()
        with open_db(path) as db:
            assert set(_blocks_of(db, ka + kb)) == set(kb), crash_at
        got = position.decode((rep / "applied_lsn").read_bytes())
        assert (got.lsn, got.log_id) == (42, "cafe")
    # no marker: an interrupted copy is dropped, the old state stays
    path = tmp_path / "nomarker"
    with open_db(path) as db:
        db.put_blocks(ka, make_blocks(3, seed=73), durability="group")
    st = Staging(path, _reopen, page_bytes=PAGE, snapshot_lsn=42, log_id="cafe", records_total=5)
    st.db.put_blocks(kb, make_blocks(5, seed=74), durability="none", tier="disk")
    st.db.close()  # the process died here: no seal, no marker
    if finisher == "finish_swap":
        assert finish_swap(path) is False
    else:
        open_db(path).close()
    assert not (path / "replication" / STAGING_DIR).exists()
    with open_db(path) as db:
        assert set(_blocks_of(db, ka + kb)) == set(ka)


def test_a_sealed_copy_that_lost_its_log_is_refused_not_half_swapped(tmp_path):
    # Scenario (review): the marker exists but the copy's wal/ is gone (a crash lost a
    # directory entry). finish_swap must not move the copy's index/ over the old log: it
    # raises CorruptionError naming what to remove, and the old state still opens whole.
    ka, kb = make_keys(3, tag=75), make_keys(5, tag=76)
    path = tmp_path / "f"
    with open_db(path) as db:
        db.put_blocks(ka, make_blocks(3, seed=75), durability="group")
    st = Staging(path, _reopen, page_bytes=PAGE, snapshot_lsn=42, log_id="cafe", records_total=5)
    st.db.put_blocks(kb, make_blocks(5, seed=76), durability="none", tier="disk")
    st.seal()
    shutil.rmtree(path / "replication" / STAGING_DIR / "wal")
    with pytest.raises(CorruptionError, match="wal"):
        finish_swap(path)
    with pytest.raises(CorruptionError, match="wal"):
        open_db(path)  # a plain open refuses the same way
    os.remove(path / "replication" / SWAP_MARKER)
    shutil.rmtree(path / "replication" / STAGING_DIR)
    with open_db(path) as db:
        assert set(_blocks_of(db, ka + kb)) == set(ka)


def _lookup_all(addr: str, keys) -> set:
    held = set()
    with Peer(addr, secret=SECRET, transport="tcp") as p:
        for k in keys:
            if p.lookup([k], fetch=False)[0]:
                held.add(k)
    return held


@pytest.mark.slow
def test_a_follower_behind_the_log_killed_mid_reseed_holds_old_or_new_and_resumes(netns, tmp_path, secret_file,
                                                                                     nodes):
    # Scenario: follower F (a kvdb replicate serve process) confirmed blocks k1. While the
    # leader ships to nobody, it writes k2 (160 blocks), deletes k1 and compacts away the
    # segments F would need: F is behind the log and is re-seeded without being asked, in
    # batches of 4 records. F is SIGKILLed once the leader saw part of the copy applied. Its
    # directory then holds either exactly k1 (the old state) or exactly k2 (the copy), never a
    # mix. Restarted, F is re-seeded again and streams on; `kvdb replicate status` shows the
    # completed re-seed.
    k1, b1 = make_keys(4, tag=75), make_blocks(4, seed=75)
    k2, b2 = make_keys(160, tag=76), make_blocks(160, seed=76)
    f = nodes(tmp_path / "f", secret_file, transport="tcp")
    db = open_db(tmp_path / "leader")
    db.cold_store.writer.segment_bytes = 16 * RECORD_BYTES  # test: small segments, so compaction frees some
    try:
        rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
        db.put_blocks(k1, b1, durability="group")
        lsn1 = rep.sync_replicas(30)
        rep.close()
        f.kill()
        db.cold_store.set_retention(None)  # nobody replicates now: no slot holds the log
        for i in range(0, 160, 16):
            db.put_blocks(k2[i : i + 16], b2[i : i + 16], durability="group")
        db.delete(k1)
        db.cold_store.compact()
        rep = Replicator(db, replicas=[f.address], secret=SECRET, transport="tcp")
        assert rep.shipper.source.first_lsn() > lsn1 + 1  # F's next record is gone
        rep.shipper.batch_bytes = 4 * RECORD_BYTES
        f.start()
        _wait(lambda: (rep.status()["followers"][0]["reseed"] or {}).get("records_confirmed", 0) >= 8
              or rep.status()["followers"][0]["reseeds"], "part of the copy applied")  # (or all of it)
        f.kill()
        finish_swap(tmp_path / "f")  # what the restarted daemon does first
        with open_db(tmp_path / "f") as plain:
            held = set(_blocks_of(plain, k1 + k2))
        assert held in (set(k1), set(k2)), f"{len(held & set(k1))} of k1 and {len(held & set(k2))} of k2"
        f.start()
        lsn = rep.sync_replicas(60)
        assert rep.status()["followers"][0]["reseeds"] >= 1
        k3, b3 = make_keys(2, tag=77), make_blocks(2, seed=77)
        db.put_blocks(k3, b3, durability="group")
        assert rep.sync_replicas(30) > lsn
        assert _lookup_all(f.address, k1 + k2 + k3) == set(k2 + k3)
        r = subprocess.run([sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "replicate", "status",
                            "--peer", f.address, "--secret-file", str(secret_file), "--json"],
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        if held == set(k1):  # killed before the swap: re-seeded again after the restart
            last = json.loads(r.stdout)["follower"]["last_reseed"]
            assert last["state"] == "done" and last["records_received"] == last["records_total"] == 160
        rep.close()
    finally:
        db.close()
    assert f.stop() == 0
    shutil.rmtree(tmp_path / "leader")


def test_a_memory_only_follower_is_not_reseeded(netns, tmp_path):
    # Scenario: a memory-only follower (no disk tier: nothing to swap) of another log is asked
    # to re-seed: it refuses, and the leader keeps it needs_reseed with the reason.
    fdb = kvdb.open(tmp_path / "f", layout=LAYOUT, model_id="test-model", host_bytes=64 * PAGE, disk_bytes=0,
                    key_secret=KEY_SECRET)
    srv = NodeServer(fdb, "127.0.0.1:0", SECRET, transport="tcp", sink=LogSink.for_db(fdb, reopen=_reopen)).start()
    try:
        with open_db(tmp_path / "b") as b:
            b.put_blocks(make_keys(2, tag=78), make_blocks(2, seed=78), durability="group")
            rep = Replicator(b, replicas=[srv.address], secret=SECRET, transport="tcp")
            rep.sync_replicas(30)
            rep.reseed(srv.address)
            st = _wait(lambda: rep.status()["followers"][0]["state"] == "needs_reseed" and rep.status()["followers"][0],
                       "needs_reseed")
            assert "cannot be re-seeded" in st["error"]
            rep.close()
    finally:
        srv.stop()
        fdb.close()
