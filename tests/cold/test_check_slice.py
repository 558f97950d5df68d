"""C3 for a slice of raw records read back to back (kvdb/cold/read.py ``check_fields``): every
field the index names is compared, for the whole slice at once, and each record's CRC-32C over
its head and page; one bad record fails alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdb.cold.read import TAIL_SLICE_BYTES, check_fields, plan_slices
from kvdb.format import index_value as iv
from kvdb.format.record import PUT_PAYLOAD_OFFSET, RECORD_HEADER_BYTES, Codec, put_rows, seal_rows

PAGE = 256


def check_slice(keys: list[bytes], entries: list, heads: np.ndarray, out: np.ndarray, rows, whole: int) -> list[bool]:
    """``check_fields`` with the keys as a list and the entries as BlockEntry objects, as the
    per-entry path (``check_raw``) takes them."""
    tab, _ = iv.entry_table(entries)
    return check_fields(np.frombuffer(b"".join(keys), dtype="V16"), tab["record_bytes"].astype(np.int64), tab["crc"],
                        tab["lsn"], heads, out, rows, whole).tolist()


def _slice(n: int = 6, first_lsn: int = 40):
    keys = [bytes([i]) * 16 for i in range(n)]
    pages = np.random.default_rng(n).integers(0, 256, (n, PAGE), dtype=np.uint8)
    heads = put_rows(b"".join(keys), np.full(n, -1, dtype=np.int64), 3, Codec.RAW, 0, PAGE, None, PAGE)
    crcs = seal_rows(heads, first_lsn, pages)
    entries = [iv.BlockEntry(1, 32 + i * (PUT_PAYLOAD_OFFSET + PAGE), PUT_PAYLOAD_OFFSET + PAGE, int(crcs[i]),
                             first_lsn + i, -1, 3, Codec.RAW, 0, PAGE) for i in range(n)]
    return keys, entries, np.ascontiguousarray(heads), pages


def test_a_clean_slice_passes():
    keys, entries, heads, pages = _slice()
    assert check_slice(keys, entries, heads, pages, range(len(keys)), len(keys)) == [True] * len(keys)


@pytest.mark.parametrize("what", ["page bit", "head bit", "entry lsn", "entry crc", "entry length", "other key",
                                  "record type", "short read"])
def test_each_mismatch_fails_its_record_only(what):
    keys, entries, heads, pages = _slice()
    whole, j = len(keys), 2
    if what == "page bit":
        pages[j, 17] ^= 0x10
    elif what == "head bit":
        heads[j, RECORD_HEADER_BYTES + 20] ^= 0x01  # inside the fixed body (namespace id): only the crc sees it
    elif what == "entry lsn":
        entries[j] = entries[j]._replace(lsn=entries[j].lsn + 1)
    elif what == "entry crc":
        entries[j] = entries[j]._replace(crc=entries[j].crc ^ 1)
    elif what == "entry length":
        entries[j] = entries[j]._replace(record_bytes=entries[j].record_bytes + 1)
    elif what == "other key":
        keys[j] = b"\xee" * 16  # the index named this record for another key
    elif what == "record type":
        heads[j, 8] = 2
    elif what == "short read":
        whole, j = 4, None  # the read returned 4 whole records: the rest are misses
    got = check_slice(keys, entries, heads, pages, range(len(keys)), whole)
    want = [True] * len(keys)
    if j is None:
        want[4:] = [False] * (len(keys) - 4)
    else:
        want[j] = False
    assert got == want
    assert all(type(x) is bool for x in got)  # callers test `is True`


def test_it_agrees_with_check_raw_record_by_record():
    # check_slice is check_raw (the per-entry path's C3) over a slice: the same verdict per record
    from kvdb.cold.read import check_raw

    keys, entries, heads, pages = _slice()
    pages[1, 3] ^= 0x40
    entries[3] = entries[3]._replace(lsn=entries[3].lsn + 2)
    keys[4] = b"\xab" * 16
    want = [check_raw(k, e, bytearray(heads[j].tobytes()), pages[j]) for j, (k, e) in enumerate(zip(keys, entries))]
    assert want == [True, False, True, False, False, True]
    assert check_slice(keys, entries, heads, pages, range(len(keys)), len(keys)) == want


def _plan(cand, want, per):
    """plan_slices of (segment, offset, key index) tuples, its slices' indices as lists."""
    seg, off, idx = (np.array([c[f] for c in cand], dtype=np.int64) for f in range(3))
    return [(s, o, p.tolist()) for s, o, p in plan_slices(seg, off, idx, want, per)]


def test_plan_slices_cuts_runs_in_file_order_and_the_last_slice_in_halves():
    # Records of 1 KiB: a run of 200 in segment 1 (given out of order), a lone record in segment 2
    # (left to the per-entry path), a run of 3 in segment 3. Slices hold at most 64 records; the
    # last run's last 64 records are cut in halves down to TAIL_SLICE_BYTES: segment 3's 3 records
    # are under it (no cut). With records of a quarter of TAIL_SLICE_BYTES and one run of 104,
    # the run's first 40 are a slice and its last 64 become 32, 16, 8, 4, 4.
    want = 1024
    cand = [(1, 32 + i * want, 1000 + i) for i in range(200)][::-1] + [(2, 32, 7)] + [(3, 32 + i * want, i) for i in range(3)]
    got = _plan(cand, want, 64)
    assert [(s, o, len(p)) for s, o, p in got] == \
        [(1, 32, 64), (1, 32 + 64 * want, 64), (1, 32 + 128 * want, 64), (1, 32 + 192 * want, 8), (3, 32, 3)]
    assert [i for _, _, p in got for i in p] == list(range(1000, 1200)) + [0, 1, 2]
    want = TAIL_SLICE_BYTES // 4
    got = _plan([(1, i * want, i) for i in range(64 + 40)], want, 64)
    assert [len(p) for _, _, p in got] == [40, 32, 16, 8, 4, 4]
    assert [o for _, o, _ in got] == [0, 40 * want, 72 * want, 88 * want, 96 * want, 100 * want]
    assert [i for _, _, p in got for i in p] == list(range(104))
    assert _plan([(1, 0, 0), (1, 5 * want, 1)], want, 64) == []  # no two back to back: no run


def _plan_by_records(cand, want, per):
    """plan_slices' contract, record by record: sort, grow runs of back-to-back records, cut."""
    cand = sorted(cand)
    runs, j = [], 0
    while j < len(cand):
        seg, off, _ = cand[j]
        run = [cand[j][2]]
        j += 1
        while j < len(cand) and cand[j][0] == seg and cand[j][1] == off + len(run) * want:
            run.append(cand[j][2])
            j += 1
        if len(run) > 1:
            runs.append((seg, off, run))
    slices = []
    for r, (seg, off, run) in enumerate(runs):
        body = len(run) - min(len(run), per) if r == len(runs) - 1 else len(run)
        slices.extend((seg, off + a * want, run[a : min(a + per, body)]) for a in range(0, body, per))
        part, off, tail = run[body:], off + body * want, max(1, TAIL_SLICE_BYTES // want)
        while len(part) > tail:
            h = len(part) // 2
            slices.append((seg, off, part[:h]))
            off += h * want
            part = part[h:]
        if part:
            slices.append((seg, off, part))
    return slices


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 40)), max_size=120),
       st.sampled_from([1024, TAIL_SLICE_BYTES // 8, TAIL_SLICE_BYTES // 2]), st.integers(1, 70))
def test_plan_slices_agrees_with_a_record_by_record_reading(recs, want, per):
    # Any records (segment, record number: a key listed twice reads the same record twice), in
    # any order: the array form cuts the same slices as the plain loop over sorted records.
    cand = [(seg, 32 + k * want, i) for i, (seg, k) in enumerate(recs)]
    assert _plan(cand, want, per) == _plan_by_records(cand, want, per)


def test_a_run_whose_read_fails_is_a_counted_miss_and_changes_nothing_stored(tmp_path):
    # A read error inside a run (the layer's preadv fails with EIO once) is a miss for the
    # slice's keys, their rows zeroed, counted in read_errors (as a lone record's is), never
    # wrong bytes; the next read of the same keys finds them all.
    import errno
    import os

    from cold_fixtures import TINY, key, pages_for

    from kvdb.cold.store import ColdStore
    from kvdb.fs import OsFs

    class FailOnce(OsFs):
        armed = False

        def preadv(self, fd, bufs, offset):
            if self.armed:
                self.armed = False
                raise OSError(errno.EIO, "injected")
            return os.preadv(fd, bufs, offset)

    fs = FailOnce()
    keys = [key(i) for i in range(8)]
    with ColdStore.open(tmp_path / "s", TINY, fs=fs, flush_interval_s=None) as store:
        want = pages_for(keys)
        store.put(keys, want)
        store.flush()
        out = np.full((8, TINY.page_bytes), 7, dtype=np.uint8)
        fs.armed = True
        found = store.get_into(keys, out)
        assert not any(found) and not out.any()  # one run, one slice: all eight missed, zeroed
        assert store.stats()["read_errors"] == 1
        assert all(store.get_into(keys, out)) and np.array_equal(out, want)
