"""kvdb.native: every native function agrees with its pure-Python twin (docs/style.md "Layout"),
plus known-answer vectors that pin the meaning of the twins themselves."""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdb import native
from kvdb.errors import InvalidInput
from kvdb.types import KEY_BYTES

pytestmark = pytest.mark.skipif(not native.HAVE_NATIVE, reason="compiled core kvdb._native not built")

u32 = st.integers(min_value=0, max_value=0xFFFFFFFF)


# ---------------------------------------------------------------- crc32c


@pytest.mark.parametrize("fn", [native.crc32c, native.py_crc32c], ids=["native", "python"])
def test_crc32c_known_answers(fn):
    # RFC 3720 (iSCSI) appendix B.4 and the canonical check value
    assert fn(b"123456789") == 0xE3069283
    assert fn(bytes(32)) == 0x8A9136AA
    assert fn(b"\xff" * 32) == 0x62A8AB43
    assert fn(bytes(range(32))) == 0x46DD794E
    assert fn(b"") == 0
    assert fn(b"", 0x12345678) == 0x12345678


@given(data=st.binary(max_size=300), value=u32)
def test_crc32c_native_matches_python(data, value):
    assert native.crc32c(data, value) == native.py_crc32c(data, value)


@given(data=st.binary(max_size=200), cut=st.integers(min_value=0, max_value=200))
def test_crc32c_continuation_equals_whole(data, cut):
    cut = min(cut, len(data))
    whole = native.crc32c(data)
    assert native.crc32c(data[cut:], native.crc32c(data[:cut])) == whole
    assert native.py_crc32c(data[cut:], native.py_crc32c(data[:cut])) == whole


@given(data=st.binary(min_size=1, max_size=100), offset=st.integers(min_value=0, max_value=15))
def test_crc32c_unaligned_buffers(data, offset):
    # a view starting `offset` bytes into an 8-aligned numpy buffer exercises the head loop
    backing = np.zeros(len(data) + 16, dtype=np.uint8)
    backing[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
    view = backing[offset : offset + len(data)]
    assert native.crc32c(view) == native.py_crc32c(data) == native.crc32c(data)
    assert native.crc32c(memoryview(backing)[offset : offset + len(data)]) == native.py_crc32c(data)


def test_crc32c_accepts_typed_buffers():
    arr = np.arange(100, dtype=np.uint32)
    assert native.crc32c(arr) == native.py_crc32c(arr.tobytes())
    assert native.crc32c(bytearray(b"abc")) == native.py_crc32c(b"abc")


@pytest.mark.parametrize("width,start,nbytes", [(70, 8, 45), (70, 0, 70), (20000, 3, 19990), (5, 2, 0)])
def test_crc32c_rows_matches_python_row_by_row(width, start, nbytes):
    # one crc per row of a batch (kvdb/format/record.py seal_rows), with and without seeds;
    # long rows take the three-stream path (kvdb_native.c crc_hw3)
    rows = np.random.default_rng(width).integers(0, 256, (6, width), dtype=np.uint8)
    init = np.arange(6, dtype=np.uint32) * 0x01020304
    for seeds in (None, init):
        got = native.crc32c_rows(rows, start, nbytes, seeds)
        want = native.py_crc32c_rows(rows, start, nbytes, seeds)
        assert got.dtype == np.uint32 and got.tolist() == want.tolist()
        assert got.tolist() == [native.crc32c(rows[i, start : start + nbytes], 0 if seeds is None else int(seeds[i]))
                                for i in range(6)]
    then = np.random.default_rng(1).integers(0, 256, (6, width), dtype=np.uint8)  # a head, then its payload
    got = native.crc32c_rows(rows, start, nbytes, then=then)
    assert got.tolist() == native.py_crc32c_rows(rows, start, nbytes, then=then).tolist()
    assert got.tolist() == [native.crc32c(then[i], native.crc32c(rows[i, start : start + nbytes])) for i in range(6)]
    with pytest.raises(InvalidInput):
        native.crc32c_rows(rows, start, width + 1)
    with pytest.raises(InvalidInput):
        native.crc32c_rows(rows[:, ::2], 0, 1)
    with pytest.raises(InvalidInput):  # one seed per row: the C loop reads seeds[i] for every row
        native.crc32c_rows(rows, start, nbytes, [1])


# ---------------------------------------------------------------- sha256 chains


def _reference_chain(seed: bytes, tokens: list[int], block_tokens: int) -> bytes:
    """An independent spelling of the chain in kvdb/keys.py's header: struct-packed tokens, hashlib.sha256."""
    out, prev = b"", seed
    for i in range(len(tokens) // block_tokens):
        blk = tokens[i * block_tokens : (i + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(blk)}I", *blk)).digest()[:16]
        out += prev
    return out


def test_sha256_chain_known_answer():
    seed = bytes(range(16))
    toks = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9], dtype=np.uint32)
    first = hashlib.sha256(seed + struct.pack("<4I", 1, 2, 3, 4)).digest()[:16]
    second = hashlib.sha256(first + struct.pack("<4I", 5, 6, 7, 8)).digest()[:16]
    assert native.sha256_chain(seed, toks, 4) == first + second
    assert native.py_sha256_chain(seed, toks, 4) == first + second


@given(
    seed=st.binary(min_size=16, max_size=16),
    tokens=st.lists(u32, max_size=80),
    block_tokens=st.integers(min_value=1, max_value=20),
)
def test_sha256_chain_native_matches_python_and_reference(seed, tokens, block_tokens):
    toks = np.array(tokens, dtype=np.uint32)
    got = native.sha256_chain(seed, toks, block_tokens)
    assert len(got) == (len(tokens) // block_tokens) * KEY_BYTES  # only full blocks
    assert got == native.py_sha256_chain(seed, toks, block_tokens)
    assert got == _reference_chain(seed, tokens, block_tokens)


@given(
    tokens=st.lists(u32, min_size=8, max_size=40),
    offset=st.integers(min_value=1, max_value=3),
    block_tokens=st.integers(min_value=1, max_value=8),
)
def test_sha256_chain_unaligned_and_strided_tokens(tokens, offset, block_tokens):
    seed = b"\x5a" * 16
    want = _reference_chain(seed, tokens, block_tokens)
    # uint32 tokens starting at a byte offset that is not 4-aligned
    raw = np.zeros(len(tokens) * 4 + 8, dtype=np.uint8)
    raw[offset : offset + len(tokens) * 4] = np.frombuffer(np.array(tokens, "<u4").tobytes(), np.uint8)
    unaligned = raw[offset : offset + len(tokens) * 4].view("<u4")
    assert native.sha256_chain(seed, unaligned, block_tokens) == want
    # a strided view and a wider dtype are made contiguous uint32 first
    strided = np.repeat(np.array(tokens, dtype=np.uint32), 2)[::2]
    assert native.sha256_chain(seed, strided, block_tokens) == want
    assert native.sha256_chain(seed, np.array(tokens, dtype=np.int64), block_tokens) == want


def test_sha256_chain_prefix_property():
    # a key names its whole prefix: extending the prompt never changes earlier keys
    seed = bytes(16)
    toks = np.arange(64, dtype=np.uint32)
    full = native.sha256_chain(seed, toks, 8)
    assert native.sha256_chain(seed, toks[:40], 8) == full[: 5 * 16]
    changed = toks.copy()
    changed[20] += 1
    other = native.sha256_chain(seed, changed, 8)
    assert other[: 2 * 16] == full[: 2 * 16]
    assert all(other[i * 16 : (i + 1) * 16] != full[i * 16 : (i + 1) * 16] for i in range(2, 8))


def test_sha256_chain_rejects_bad_seed_and_block_size():
    toks = np.arange(8, dtype=np.uint32)
    with pytest.raises(InvalidInput, match="16 bytes"):
        native.sha256_chain(b"short", toks, 4)
    for bad in (0, -4, 2.0):
        with pytest.raises(InvalidInput, match="block_tokens"):
            native.sha256_chain(bytes(16), toks, bad)


# ---------------------------------------------------------------- page copies


@st.composite
def _copy_case(draw):
    page_bytes = draw(st.integers(min_value=1, max_value=64))
    num_src = draw(st.integers(min_value=1, max_value=12))
    num_dst = draw(st.integers(min_value=1, max_value=12))
    n = draw(st.integers(min_value=0, max_value=min(num_src, num_dst)))
    src_frames = draw(st.permutations(range(num_src)))[:n]
    dst_frames = draw(st.permutations(range(num_dst)))[:n]
    mode = draw(st.sampled_from(["both", "gather", "scatter"]))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    return page_bytes, num_src, num_dst, src_frames, dst_frames, mode, seed


@given(case=_copy_case())
def test_copy_pages_native_matches_python(case):
    page_bytes, num_src, num_dst, src_frames, dst_frames, mode, seed = case
    n = len(src_frames)
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size=num_src * page_bytes, dtype=np.uint8)
    if mode == "gather":  # arena -> dense batch
        dst_frames, num_dst = None, max(n, 1)
    elif mode == "scatter":  # dense batch -> arena
        src_frames = None
    dst_native = rng.integers(0, 256, size=num_dst * page_bytes, dtype=np.uint8)
    dst_python = dst_native.copy()
    before = dst_native.copy()
    native.copy_pages(dst_native, dst_frames, src, src_frames, page_bytes)
    native.py_copy_pages(dst_python, dst_frames, src, src_frames, page_bytes)
    assert np.array_equal(dst_native, dst_python)
    # and both mean exactly this: listed pages copied, every other byte untouched
    want = before.reshape(-1, page_bytes).copy()
    s2 = src.reshape(-1, page_bytes)
    for i in range(n):
        d = i if dst_frames is None else dst_frames[i]
        s = i if src_frames is None else src_frames[i]
        want[d] = s2[s]
    assert np.array_equal(dst_native.reshape(-1, page_bytes), want)


def test_copy_pages_unaligned_buffers_and_frame_dtypes():
    page_bytes = 24
    src_back = np.arange(5 * page_bytes + 3, dtype=np.uint64).astype(np.uint8)
    dst_back = np.zeros(4 * page_bytes + 5, dtype=np.uint8)
    src = src_back[3:]
    dst = dst_back[5:]
    native.copy_pages(dst, [3, 0], src, np.array([1, 4], dtype=np.int32), page_bytes)
    assert np.array_equal(dst[3 * page_bytes : 4 * page_bytes], src[page_bytes : 2 * page_bytes])
    assert np.array_equal(dst[:page_bytes], src[4 * page_bytes :])
    assert not dst_back[:5].any() and not dst[page_bytes : 3 * page_bytes].any()


def test_copy_pages_torch_tensors():
    torch = pytest.importorskip("torch")
    page_bytes = 16
    src = torch.arange(4 * page_bytes, dtype=torch.uint8)
    dst = torch.zeros(3 * page_bytes, dtype=torch.uint8)
    native.copy_pages(dst.numpy(), [2, 0], src.numpy(), [0, 3], page_bytes)
    assert torch.equal(dst[2 * page_bytes :], src[:page_bytes])
    assert torch.equal(dst[:page_bytes], src[3 * page_bytes :])
    assert not dst[page_bytes : 2 * page_bytes].any()


def _tensor_copy(dst, dst_frames, src, src_frames, page_bytes):
    """copy_tensor_pages over numpy test buffers, shared with torch as [pages, page_bytes]."""
    torch = pytest.importorskip("torch")
    native.copy_tensor_pages(torch.from_numpy(dst).view(-1, page_bytes), dst_frames,
                             torch.from_numpy(src).view(-1, page_bytes), src_frames, page_bytes)


@given(case=_copy_case())
def test_copy_tensor_pages_matches_python(case):
    # the arena's path: tensors, short int lists straight to the native copy, the rest through
    # copy_pages; the same bytes as the Python twin either way
    page_bytes, num_src, num_dst, src_frames, dst_frames, mode, seed = case
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size=num_src * page_bytes, dtype=np.uint8)
    if mode == "gather":
        dst_frames, num_dst = None, max(len(src_frames), 1)
    elif mode == "scatter":
        src_frames = None
    dst_tensor = rng.integers(0, 256, size=num_dst * page_bytes, dtype=np.uint8)
    dst_python = dst_tensor.copy()
    as_list = (lambda f: None if f is None else [int(x) for x in f])
    _tensor_copy(dst_tensor, as_list(dst_frames), src, as_list(src_frames), page_bytes)
    native.py_copy_pages(dst_python, dst_frames, src, src_frames, page_bytes)
    assert np.array_equal(dst_tensor, dst_python)


def test_a_one_page_tensor_copy_lands_where_asked():
    # one page (a one-block read's promotion) is copied by address, not through frame arrays:
    # each way round (scatter, gather, both listed), exactly the page asked for moves; frames
    # that are not ints, and frames outside a tensor, take the general path (copy or raise)
    torch = pytest.importorskip("torch")
    page_bytes = 32
    src = torch.arange(4 * page_bytes, dtype=torch.uint8).view(4, page_bytes)
    for dst_frames, src_frames, d, s in [([2], None, 2, 0), (None, [3], 0, 3), ([1], [2], 1, 2),
                                         ([np.int64(0)], [1], 0, 1)]:
        dst = torch.zeros((3, page_bytes), dtype=torch.uint8)
        native.copy_tensor_pages(dst, dst_frames, src, src_frames, page_bytes)
        want = torch.zeros_like(dst)
        want[d] = src[s]
        assert torch.equal(dst, want)
    dst = torch.zeros((3, page_bytes), dtype=torch.uint8)
    with pytest.raises(InvalidInput, match="dst frames outside the 3 pages"):
        native.copy_tensor_pages(dst, [3], src, None, page_bytes)
    with pytest.raises(InvalidInput, match="src frames outside the 4 pages"):
        native.copy_tensor_pages(dst, [0], src, [-1], page_bytes)
    assert not dst.any()


@pytest.mark.parametrize("fn", [native.copy_pages, native.py_copy_pages, _tensor_copy],
                         ids=["native", "python", "tensor"])
def test_copy_pages_rejects_out_of_bounds_frames(fn):
    # the native memcpy has no bounds of its own: these must fail before it runs
    page_bytes = 8
    src = np.arange(3 * page_bytes, dtype=np.uint8)
    dst = np.zeros(2 * page_bytes, dtype=np.uint8)
    cases = [
        ([2], [0], "dst frames outside the 2 pages"),
        ([-1], [0], "dst frames outside"),
        ([0], [3], "src frames outside the 3 pages"),
        (None, [0, 1, 2], "dst frames outside the 2 pages"),  # dense dst too short
        ([0, 1], None, None),  # fine: dense src of 2 pages
        ([0, 1], [0], "2 dst frames but 1 src frames"),
        (None, None, "dst_frames or src_frames"),
    ]
    for dst_frames, src_frames, msg in cases:
        if msg is None:
            fn(dst, dst_frames, src, src_frames, page_bytes)
            continue
        with pytest.raises(InvalidInput, match=msg):
            fn(dst, dst_frames, src, src_frames, page_bytes)
    assert np.array_equal(dst, src[: 2 * page_bytes])  # only the valid case wrote
    if fn is _tensor_copy:
        return  # a tensor has no read-only flag nor a page size of 0
    with pytest.raises(InvalidInput, match="page_bytes"):
        fn(dst, [0], src, [0], 0)
    frozen = np.zeros(page_bytes, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidInput, match="read-only"):
        fn(frozen, [0], src, [0], page_bytes)
    assert not frozen.any()


# ---------------------------------------------------------------- the portable crc32c path


@pytest.fixture(scope="module")
def crc_sw(tmp_path_factory):
    """The slicing-by-8 table path of kvdb_native.c (ARM hosts, x86 without SSE4.2), which an
    SSE4.2 machine never runs through kvdb.native: a harness in the same translation unit
    exposes the static function, compiled here with the system C compiler."""
    import shutil
    import subprocess
    from pathlib import Path

    from cffi import FFI

    cc = shutil.which("cc") or shutil.which("gcc")
    src = Path(__file__).resolve().parents[1] / "native" / "kvdb_native.c"
    if cc is None or not src.exists():
        pytest.skip("no C compiler or no native/ source tree")
    d = tmp_path_factory.mktemp("crc_sw")
    (d / "harness.c").write_text(
        f'#include "{src}"\n'
        "uint32_t harness_crc_sw(uint32_t crc, const uint8_t *p, size_t n) { return ~crc_sw(~crc, p, n); }\n"
    )
    lib_path = d / "libharness.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib_path), str(d / "harness.c"), "-lcrypto"],
                   check=True, capture_output=True)
    ffi = FFI()
    ffi.cdef("uint32_t harness_crc_sw(uint32_t crc, const uint8_t *p, size_t n);")
    lib = ffi.dlopen(str(lib_path))
    return lambda data, value=0: lib.harness_crc_sw(value, ffi.from_buffer(data), len(data))


def test_crc32c_table_path_known_answers(crc_sw):
    assert crc_sw(b"123456789") == 0xE3069283
    assert crc_sw(bytes(32)) == 0x8A9136AA
    assert crc_sw(b"\xff" * 32) == 0x62A8AB43


@given(data=st.binary(max_size=300), value=u32, offset=st.integers(min_value=0, max_value=7))
def test_crc32c_table_path_matches_python(crc_sw, data, value, offset):
    backing = np.zeros(len(data) + 8, dtype=np.uint8)  # misaligned start exercises the head loop
    view = backing[offset : offset + len(data)]
    view[:] = np.frombuffer(data, dtype=np.uint8)
    assert crc_sw(view, value) == native.py_crc32c(data, value) == native.crc32c(data, value)


# ---------------------------------------------------------------- group commit (Committer)
# Its pure-Python twin is the leader/follower group commit of kvdb/wal/writer.py; the two are
# compared end to end (same log bytes) in tests/cold/test_group_commit.py.


def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    """Poll the committer's state until ``cond()`` (the polling only observes: the order of the
    steps comes from what the committer reports, not from how long anything took)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def _start_wait(c, lsn: int, got: dict) -> threading.Thread:
    t = threading.Thread(target=lambda: got.__setitem__(lsn, c.wait(lsn)), daemon=True)
    t.start()
    return t


def _join_all(threads, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


@pytest.fixture
def committer(tmp_path):
    path = tmp_path / "seg"
    path.write_bytes(b"")
    c = native.Committer(str(path), 10, gather_s=0.0005, num_workers=2)
    yield c
    c.stop()


def test_committer_waits_publishes_and_counts(committer):
    c = committer
    assert c.durable_lsn == 10
    assert c.wait(7) == 10  # already durable: no fsync
    assert c.num_fsyncs == 0
    assert c.wait(12) == 12  # one fsync covers it
    assert c.num_fsyncs == 1
    c.publish(15)  # an fsync done by the writer itself
    assert c.durable_lsn == 15 and c.wait(14) == 15
    c.publish(13)  # durable only grows (K1)
    assert c.durable_lsn == 15


def test_committer_wakes_every_waiter_of_a_batch(committer):
    # Scenario: 20 writers wait while the workers are held (as if an fsync were running); once
    # released, one fsync covers all 20 and wakes every one of them, though two workers are free.
    c = committer
    c.debug_hold(True)
    got: dict = {}
    threads = [_start_wait(c, n, got) for n in range(11, 31)]
    _until(lambda: c.debug_state()["waiters"] == 20, "all 20 writers wait")
    assert c.num_fsyncs == 0 and c.durable_lsn == 10 and got == {}
    c.debug_hold(False)
    _join_all(threads)
    assert got == {n: 30 for n in range(11, 31)}  # durable moved once, from 10 to 30
    assert c.num_fsyncs == 1


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_committer_failed_fsync_is_sticky(committer, err):
    c = committer
    assert c.wait(11) == 11
    c.debug_fail_next(err)
    with pytest.raises(OSError) as e:
        c.wait(12)
    assert e.value.errno == err and c.error == err
    with pytest.raises(OSError):  # K2: no later fsync acknowledges anything
        c.wait(13)
    assert c.durable_lsn == 11
    assert c.wait(11) == 11  # what was durable stays so
    c.publish(20)  # not even the writer's own fsync (it cannot know the pages survived)
    assert c.durable_lsn == 11


def test_committer_fail_wakes_waiters(committer):
    c = committer
    c.fail(errno.EIO)
    with pytest.raises(OSError):
        c.wait(12)


def test_committer_stop_drains_then_refuses(tmp_path):
    # K4: a waiter either gets a durable lsn covering it (it waited before stop: drained) or
    # CommitterClosed (it came after stop, and its lsn is not durable); nobody hangs; a wait
    # after stop that is covered still returns; stop is idempotent.
    path = tmp_path / "seg"
    path.write_bytes(b"")
    for _round in range(20):
        c = native.Committer(str(path), 0, gather_s=0.002, num_workers=3)
        got: dict = {}

        def waiter(n: int, c=c, got=got) -> None:
            try:
                got[n] = c.wait(n)
            except native.CommitterClosed:
                got[n] = "closed"

        threads = [threading.Thread(target=waiter, args=(n,)) for n in range(1, 9)]
        for t in threads:
            t.start()
        c.stop()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert sorted(got) == list(range(1, 9))
        for n, r in got.items():
            assert (r == "closed" and n > c.durable_lsn) or (r != "closed" and r >= n)
        with pytest.raises(native.CommitterClosed):
            c.wait(c.durable_lsn + 1)
        assert c.wait(c.durable_lsn) == c.durable_lsn
        c.stop()


def test_committer_follows_the_active_segment(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"")
    b.write_bytes(b"")
    c = native.Committer(str(a), 0, gather_s=0.0, num_workers=1)
    try:
        assert c.wait(1) == 1
        c.set_path(str(b))
        a.unlink()  # the workers reopen the new path; the old one may go
        assert c.wait(2) == 2
        c.set_path(str(tmp_path / "missing"))
        with pytest.raises(OSError) as e:  # cannot open it: a failure like any other (K2)
            c.wait(3)
        assert e.value.errno == errno.ENOENT
    finally:
        c.stop()


def test_committer_rejects_bad_worker_counts(tmp_path):
    with pytest.raises(OSError):
        native.Committer(str(tmp_path), 0, gather_s=0.0, num_workers=0)


def test_committer_publish_recounts_waiters_so_the_next_one_is_not_stranded(tmp_path):
    # Scenario (found in review): a batch of waiters makes the worker expect a batch as large
    # next time. A waiter covered by a publish (the writer's own fsync) must not stay counted
    # as waiting, or the next lone waiter does not signal the worker, asleep without a deadline
    # by then, and blocks until some other fsync. The steps are ordered by the committer's
    # state (debug_hold, debug_state); t8's wait must end by itself: a hang is the failure.
    path = tmp_path / "seg"
    path.write_bytes(b"")
    c = native.Committer(str(path), 0, gather_s=0.05, num_workers=1)
    got: dict = {}
    try:
        c.debug_hold(True)  # 5 waiters, then one fsync for all: the worker expects 5 from now on
        batch = [_start_wait(c, n, got) for n in range(1, 6)]
        _until(lambda: c.debug_state()["waiters"] == 5, "5 writers wait")
        c.debug_hold(False)
        _join_all(batch)
        assert c.num_fsyncs == 1 and c.debug_state()["expect"] == 5
        c.debug_hold(True)  # a lone waiter, counted as arrived, then covered by a publish
        t7 = _start_wait(c, 7, got)
        _until(lambda: c.debug_state()["arrived"] == 1, "the waiter for 7 is counted")
        c.publish(7)
        t7.join(30)
        assert got[7] == 7 and c.num_fsyncs == 1  # the publish covered it, no fsync
        naps = c.debug_state()["naps"]
        c.debug_hold(False)  # nothing is wanted now: the worker sleeps without a deadline
        _until(lambda: (s := c.debug_state())["naps"] > naps and s["sleeping"] == 1, "the worker sleeps again")
        t8 = _start_wait(c, 8, got)
        t8.join(10)
        assert not t8.is_alive(), "a lone waiter after a publish was never committed"
        assert got[8] == 8 and c.num_fsyncs == 2
    finally:
        c.publish(100)
        c.stop()


#: lengths around the three-stream path's edges (kvdb_native.c crc_hw3: one stream under 768
#: bytes, then blocks of 3 x 8192 and 3 x 256, then one stream for the rest)
_EDGES = [767, 768, 769, 3 * 256 * 2 + 7, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 3 * 8192 + 768 + 5,
          4096 + 53, 65536 + 53, 2 * 3 * 8192 + 3 * 256 + 255, 3 << 20]


@pytest.mark.parametrize("n", _EDGES)
def test_crc32c_long_buffers_agree_with_the_table_loop(crc_sw, n):
    # the three-stream path against the independent slicing-by-8 table path, every start
    # alignment, continued from a seed and split anywhere
    data = np.random.default_rng(n).integers(0, 256, n + 8, dtype=np.uint8)
    for off in range(8):
        view = data[off : off + n]
        assert native.crc32c(view) == crc_sw(view)
        assert native.crc32c(view, 0x1234ABCD) == crc_sw(view, 0x1234ABCD)
    for buf in (memoryview(view), view.tobytes(), view.reshape(1, n)):
        assert native.crc32c(buf) == crc_sw(view)
    assert native.crc32c(view[n // 3 :], native.crc32c(view[: n // 3])) == native.crc32c(view)
    assert native.crc32c(view[:5000]) == native.py_crc32c(view[:5000].tobytes())


@given(n=st.integers(min_value=0, max_value=80_000), off=st.integers(min_value=0, max_value=7), value=u32,
       seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_crc32c_any_length_agrees_with_the_table_loop(crc_sw, n, off, value, seed):
    data = np.random.default_rng(seed).integers(0, 256, n + off, dtype=np.uint8)[off:]
    assert native.crc32c(data, value) == crc_sw(data, value)


@given(k=st.integers(min_value=0, max_value=6), width=st.integers(min_value=8, max_value=80),
       page=st.sampled_from([1, 64, 4096, 30_000]), seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_crc32c_heads_pages_matches_python(k, width, page, seed):
    rng = np.random.default_rng(seed)
    heads = rng.integers(0, 256, (k + 1, width), dtype=np.uint8)  # one spare head: n may be < rows
    out = rng.integers(0, 256, (2 * k + 1, page), dtype=np.uint8)
    frames = rng.permutation(2 * k + 1)[:k]  # rows anywhere, in any order
    got = native.crc32c_heads_pages(heads, 8, out, frames)
    assert got.tolist() == native.py_crc32c_heads_pages(heads, 8, out, frames).tolist()
    assert got.tolist() == [native.crc32c(out[f], native.crc32c(heads[i, 8:])) for i, f in enumerate(frames)]


def test_crc32c_heads_pages_rejects_what_it_cannot_read():
    heads = np.zeros((2, 53), dtype=np.uint8)
    out = np.zeros((2, 4096), dtype=np.uint8)
    for pages, frames in ((out, [0, 2]), (out, [-1]), (out[:, :2048], [0]), (out.ravel(), [0]), (bytearray(4096), [0]),
                          (np.zeros((4, 4096), dtype=np.uint8)[::2], [0])):
        with pytest.raises(InvalidInput):
            native.crc32c_heads_pages(heads, 8, pages, frames)
    with pytest.raises(InvalidInput):
        native.crc32c_heads_pages(heads[:1], 8, out, [0, 1])  # fewer heads than pages
    with pytest.raises(InvalidInput):
        native.crc32c_heads_pages(heads, 54, out, [0])
    with pytest.raises(InvalidInput):
        native.crc32c_heads_pages(heads[:, ::2], 8, out, [0])


# ---------------------------------------------------------------- the commit ceiling (bench)


@pytest.mark.skipif(not native.HAVE_NATIVE, reason="needs the compiled core")
def test_commit_ceiling_counts_fsyncs_and_removes_its_file(tmp_path):
    path = tmp_path / "ceiling"
    secs, fsyncs = native.commit_ceiling(str(path), 1, 20, 4149)
    assert secs > 0 and fsyncs == 20  # one writer: one fdatasync per record
    assert not path.exists()
    # Four writers, 50 records each: a writer appends its next record only once an fsync
    # covered the last one, so an fsync covers 1 to 4 records (50 to 200 fsyncs). They share:
    # a leader waits (up to 1 ms) for the others' records, and records appended during an
    # fsync share the next one, so 200 fsyncs, none shared, would take 200 such misses in a row.
    secs, fsyncs = native.commit_ceiling(str(path), 4, 50, 4149)
    assert secs > 0 and 50 <= fsyncs < 200
    assert not path.exists()


@pytest.mark.skipif(not native.HAVE_NATIVE, reason="needs the compiled core")
def test_commit_ceiling_bad_arguments_are_errors(tmp_path):
    with pytest.raises(OSError) as e:
        native.commit_ceiling(str(tmp_path / "x"), 0, 10, 100)
    assert e.value.errno == errno.EINVAL
    (tmp_path / "taken").write_bytes(b"keep me")
    with pytest.raises(OSError) as e:
        native.commit_ceiling(str(tmp_path / "taken"), 2, 5, 100)  # never overwrites a file
    assert e.value.errno == errno.EEXIST
    assert (tmp_path / "taken").read_bytes() == b"keep me"
    with pytest.raises(OSError):
        native.commit_ceiling(str(tmp_path / "no-such-dir" / "x"), 2, 5, 100)


# ---------------------------------------------------------------- writev_rows


@pytest.mark.parametrize("n,hb,pb", [(1, 53, 4096), (3, 53, 7), (1300, 53, 100), (512, 1, 1)])
def test_writev_rows_writes_what_writev_of_its_row_bufs_writes(tmp_path, n, hb, pb):
    # The native append (iovecs built in C, 512 records a writev: 1300 takes three calls) against
    # its twin, OsFs.writev of row_bufs; appended after bytes already in the file (O_APPEND).
    from kvdb.fs import OsFs

    rng = np.random.default_rng(n)
    heads = rng.integers(0, 256, (n, hb), dtype=np.uint8)
    pays = rng.integers(0, 256, (n, pb), dtype=np.uint8)
    want = b"lead" + b"".join(heads[i].tobytes() + pays[i].tobytes() for i in range(n))
    fs = OsFs()
    for name, write in (("native", lambda fd: native.writev_rows(fd, heads, pays)),
                        ("twin", lambda fd: fs.writev(fd, "", native.row_bufs(heads, pays))),
                        ("fs", lambda fd: fs.writev_rows(fd, "", heads, pays, n * (hb + pb)))):
        path = str(tmp_path / name)
        fd = fs.create(path)
        try:
            fs.writev(fd, path, [b"lead"])
            write(fd)
        finally:
            fs.close(fd)
        assert open(path, "rb").read() == want, name


def test_writev_rows_errors_and_bad_arrays(tmp_path):
    heads, pays = np.zeros((2, 53), np.uint8), np.zeros((2, 64), np.uint8)
    fd = os.open(str(tmp_path / "r"), os.O_RDONLY | os.O_CREAT, 0o644)  # not open for writing
    try:
        with pytest.raises(OSError) as e:
            native.writev_rows(fd, heads, pays)
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)
    for h, p in ((heads, pays[:1]), (heads[:, ::2], pays), (heads.astype(np.int16), pays), (heads[0], pays)):
        with pytest.raises(InvalidInput):
            native.writev_rows(1, h, p)


def test_a_file_layer_that_overrides_writev_sees_the_row_appends(tmp_path):
    # FaultFs counts every write as an I/O point (and can tear or fail it): writev_rows must go
    # through its writev, not straight to the native call.
    from kvdb.fs import FaultFs

    fs = FaultFs(fail_at=2, fail_errno=errno.ENOSPC)
    path = str(tmp_path / "f")
    fd = fs.create(path)  # point 1
    try:
        with pytest.raises(OSError) as e:
            fs.writev_rows(fd, path, np.zeros((3, 53), np.uint8), np.ones((3, 8), np.uint8), 3 * 61)  # point 2
        assert e.value.errno == errno.ENOSPC and fs.num_points == 2
        fs.writev_rows(fd, path, np.zeros((3, 53), np.uint8), np.ones((3, 8), np.uint8), 3 * 61)
        assert fs.num_points == 3 and os.path.getsize(path) == 3 * 61
    finally:
        fs.close(fd)


# ---------------------------------------------------------------- preadv_rows


@pytest.mark.parametrize("n,hb,pb", [(1, 64, 4096), (3, 64, 7), (1300, 53, 100), (512, 1, 1)])
def test_preadv_rows_reads_what_preadv_of_its_read_bufs_reads(tmp_path, n, hb, pb):
    # The native read (iovecs built in C, 512 records a preadv: 1300 takes three calls) against
    # its twin, OsFs.preadv of read_bufs, from an offset, pages landing in shuffled rows of a
    # larger buffer; the rows not named stay untouched. A layer overriding preadv reads them in
    # preadv calls of at most IOV_MAX buffers.
    from kvdb.fs import IOV_MAX, OsFs

    class Layer(OsFs):
        def preadv(self, fd, bufs, offset):
            assert len(bufs) <= IOV_MAX
            return super().preadv(fd, bufs, offset)

    layer = Layer()

    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, 7 + n * (hb + pb), dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    rows = rng.permutation(n + 5)[:n]
    recs = np.frombuffer(data[7:], np.uint8).reshape(n, hb + pb)
    fs = OsFs()
    fd = fs.open_read(str(path))
    try:
        reads = [("native", lambda h, p: native.preadv_rows(fd, 7, h, p, rows)),
                 ("fs", lambda h, p: fs.preadv_rows(fd, h, p, rows, 7)),
                 ("layer", lambda h, p: layer.preadv_rows(fd, h, p, rows, 7))]  # through its preadv
        if 2 * n <= IOV_MAX:  # one preadv takes at most IOV_MAX buffers
            reads.append(("twin", lambda h, p: fs.preadv(fd, native.read_bufs(h, p, rows), 7)))
        for name, read in reads:
            heads, pages = np.zeros((n, hb), np.uint8), np.full((n + 5, pb), 0xEE, np.uint8)
            assert read(heads, pages) == n * (hb + pb), name
            assert np.array_equal(heads, recs[:, :hb]) and np.array_equal(pages[rows], recs[:, hb:]), name
            rest = np.setdiff1d(np.arange(n + 5), rows)
            assert (pages[rest] == 0xEE).all(), name
    finally:
        fs.close(fd)


def test_preadv_rows_stops_at_end_of_file_and_reports_errors(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(200)) * 3)  # 600 bytes: two records of 64 + 200, then 72 more
    fd = os.open(str(path), os.O_RDONLY)
    try:
        heads, pages = np.zeros((3, 64), np.uint8), np.zeros((3, 200), np.uint8)
        assert native.preadv_rows(fd, 0, heads, pages, [0, 1, 2]) == 600  # the third record cut short
        assert pages[2, :8].tolist() == [p % 200 for p in range(592, 600)] and not pages[2, 8:].any()
        assert native.preadv_rows(fd, 600, heads, pages, [0]) == 0  # at end of file: nothing
    finally:
        os.close(fd)
    # the same through a file layer (its own preadv, no resume): what was read, then the end
    from kvdb.fs import OsFs

    class Layer(OsFs):
        def preadv(self, fd, bufs, offset):
            return super().preadv(fd, bufs, offset)

    fd = os.open(str(path), os.O_RDONLY)
    try:
        heads, pages = np.zeros((600, 1), np.uint8), np.zeros((600, 1), np.uint8)  # 1200 iovecs: two calls
        assert Layer().preadv_rows(fd, heads, pages, list(range(600)), 0) == 600  # 300 records, then EOF
        assert heads[:300, 0].tolist() == [p % 200 for p in range(0, 600, 2)] and not heads[300:].any()
    finally:
        os.close(fd)
    wfd = os.open(str(tmp_path / "w"), os.O_WRONLY | os.O_CREAT, 0o644)  # not open for reading
    try:
        with pytest.raises(OSError) as e:
            native.preadv_rows(wfd, 0, heads, pages, [0])
        assert e.value.errno == errno.EBADF
    finally:
        os.close(wfd)


def test_preadv_rows_refuses_what_it_cannot_read_into():
    heads, pages = np.zeros((2, 64), np.uint8), np.zeros((4, 100), np.uint8)
    ro = pages.copy()
    ro.flags.writeable = False
    for h, p, rows in ((heads, pages, [0, 4]), (heads, pages, [-1, 0]), (heads[:1], pages, [0, 1]),
                       (heads, pages[:, ::2], [0, 1]), (heads, pages.astype(np.int16), [0, 1]), (heads, ro, [0, 1]),
                       (heads[0], pages, [0]), (heads, pages.tolist(), [0, 1])):
        for fn in (lambda: native.preadv_rows(0, 0, h, p, rows), lambda: native.read_bufs(h, p, rows)):
            with pytest.raises(InvalidInput):
                fn()


def test_a_file_layer_that_overrides_preadv_sees_the_row_reads(tmp_path, monkeypatch):
    # A layer that overrides preadv (a class, one instance, or a patch of OsFs itself: a test's
    # spy) gets the row reads as that preadv, not as the native call.
    from kvdb.fs import OsFs

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 2)
    seen = []

    class Spy(OsFs):
        def preadv(self, fd, bufs, offset):
            seen.append(("class", len(bufs), offset))
            return super().preadv(fd, bufs, offset)

    inst = OsFs()
    inst.preadv = lambda fd, bufs, offset: seen.append(("instance", len(bufs), offset)) or os.preadv(fd, bufs, offset)
    monkeypatch.setattr(OsFs, "preadv", lambda self, fd, bufs, offset: seen.append(("patched", len(bufs), offset))
                        or os.preadv(fd, bufs, offset))
    for fs in (Spy(), inst, OsFs()):
        fd = fs.open_read(str(path))
        try:
            heads, pages = np.zeros((2, 56), np.uint8), np.zeros((2, 200), np.uint8)
            assert fs.preadv_rows(fd, heads, pages, [1, 0], 0) == 512
            assert pages[1].tolist() == pages[0].tolist() == list(range(56, 256)) and heads[1].tolist() == list(range(56))
        finally:
            os.close(fd)
    assert seen == [("class", 4, 0), ("patched", 4, 0), ("instance", 4, 0), ("patched", 4, 0)]
