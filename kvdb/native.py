"""The only importer of kvdb's compiled core (``kvdb._native``, built from native/ by cffi).

Each native function has a pure-Python twin (``py_*``) that defines its meaning;
tests/test_native.py asserts that the two agree. The twins are also the fallback when the
compiled module is missing (``KVDB_PURE_PYTHON=1`` forces them), so kvdb still runs, slowly,
where the C core could not be built.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

from kvdb.compiled import PURE
from kvdb.errors import InvalidInput, KvdbError
from kvdb.types import KEY_BYTES

if sys.byteorder != "little":  # token bytes and on-disk integers are little-endian
    raise ImportError("kvdb supports little-endian hosts only")

_lib = None
_ffi = None

if not PURE:  # KVDB_PURE_PYTHON, read once at ``import kvdb`` (kvdb/compiled.py)
    try:
        from kvdb._native import ffi as _ffi  # type: ignore[import-not-found]
        from kvdb._native import lib as _lib
    except ImportError:  # pragma: no cover - exercised only on broken installs
        _lib = None

HAVE_NATIVE = _lib is not None

# ---------------------------------------------------------------- crc32c

_CRC_TABLE: list[int] = []


def _crc_table() -> list[int]:
    if not _CRC_TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC_TABLE.append(c)
    return _CRC_TABLE


def py_crc32c(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli), continuing from ``value``; bit-for-bit the native function."""
    table = _crc_table()
    crc = value ^ 0xFFFFFFFF
    for b in memoryview(data).cast("B"):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32c(data, value: int = 0) -> int:
    """CRC-32C of any buffer (bytes, memoryview, numpy array, contiguous CPU tensor bytes).
    Native: three interleaved hardware streams from 768 bytes up (kvdb_native.c ``crc_hw3``),
    the GIL released (cffi), so a reader's checks overlap its reads."""
    if _lib is None:
        return py_crc32c(data, value)
    buf = _ffi.from_buffer(data)
    return _lib.kvdb_crc32c(value, buf, len(buf))


def py_crc32c_rows(rows: np.ndarray, start: int, nbytes: int, init=None, then: np.ndarray | None = None) -> np.ndarray:
    """CRC-32C of ``rows[i, start:start + nbytes]`` for every row i of a C-contiguous uint8
    [n, width] array, continuing from ``init[i]`` (None: 0), then over ``then[i]`` (a second
    uint8 [n, m] array: a record's head and payload in two arrays); uint32 [n]."""
    out = np.zeros(rows.shape[0], dtype=np.uint32)
    for i in range(rows.shape[0]):
        c = py_crc32c(rows[i, start : start + nbytes], 0 if init is None else int(init[i]))
        out[i] = c if then is None else py_crc32c(then[i], c)
    return out


def _ptr(a, t="uint8_t *"):
    return _ffi.NULL if a is None else _ffi.cast(t, _ffi.from_buffer(a))


def crc32c_rows(rows: np.ndarray, start: int, nbytes: int, init=None, then: np.ndarray | None = None) -> np.ndarray:
    """``py_crc32c_rows`` in one native call for the whole batch, no Python object per row (a
    batch of records' checksums: kvdb/format/record.py ``seal_rows``)."""
    for a in (rows, then):
        if a is not None and (a.ndim != 2 or a.dtype != np.uint8 or not a.flags.c_contiguous):
            raise InvalidInput("crc32c_rows needs C-contiguous uint8 [n, width] arrays")
    n, width = rows.shape
    if start < 0 or nbytes < 0 or start + nbytes > width:
        raise InvalidInput(f"crc32c_rows: bytes {start}..{start + nbytes} outside rows of {width}")
    if then is not None and then.shape[0] != n:
        raise InvalidInput(f"crc32c_rows: {then.shape[0]} rows to continue over for {n} rows")
    if init is not None and len(init) != n:
        raise InvalidInput(f"crc32c_rows: {len(init)} seeds for {n} rows")
    if _lib is None:
        return py_crc32c_rows(rows, start, nbytes, init, then)
    out = np.empty(n, dtype=np.uint32)
    seeds = None if init is None else np.ascontiguousarray(init, dtype=np.uint32)
    _lib.kvdb_crc32c_rows(_ptr(rows), width, start, nbytes, _ptr(then), 0 if then is None else then.shape[1],
                          _ptr(seeds, "uint32_t *"), n, _ptr(out, "uint32_t *"))
    return out


# ---------------------------------------------------------------- hash chains


def py_sha256_chain(seed: bytes, tokens: np.ndarray, block_tokens: int) -> bytes:
    """key_i = SHA-256(key_{i-1} || tokens_i as uint32 LE)[:16], key_{-1} = seed."""
    toks = np.ascontiguousarray(tokens, dtype="<u4")
    n_blocks = toks.size // block_tokens
    raw = toks[: n_blocks * block_tokens].tobytes()
    step = block_tokens * 4
    out = bytearray()
    prev = seed
    for i in range(n_blocks):
        prev = hashlib.sha256(prev + raw[i * step : (i + 1) * step]).digest()[:KEY_BYTES]
        out += prev
    return bytes(out)


def sha256_chain(seed: bytes, tokens: np.ndarray, block_tokens: int) -> bytes:
    """Chain keys of every full block of ``tokens`` (uint32), concatenated (16 bytes each)."""
    if len(seed) != KEY_BYTES:
        raise InvalidInput(f"chain seed must be {KEY_BYTES} bytes, got {len(seed)}")
    if not isinstance(block_tokens, (int, np.integer)) or block_tokens <= 0:
        raise InvalidInput(f"block_tokens must be a positive int, got {block_tokens!r}")
    if _lib is None:
        return py_sha256_chain(seed, tokens, block_tokens)
    toks = np.ascontiguousarray(tokens, dtype="<u4")
    n_blocks = toks.size // block_tokens
    out = bytearray(n_blocks * KEY_BYTES)
    if n_blocks:
        _lib.kvdb_sha256_chain(
            _ffi.from_buffer(seed),
            _ffi.cast("const uint32_t *", _ffi.from_buffer(toks)),
            n_blocks,
            block_tokens,
            _ffi.from_buffer(out),
        )
    return bytes(out)


# ---------------------------------------------------------------- page copies


#: frame lists up to this long are bounds-checked in Python (a numpy min/max costs ~3 us each)
SMALL_FRAME_LISTS = 64


def _check_copy(dst, dst_frames, src, src_frames, page_bytes: int):
    """Frames as int64 arrays (or None) and the page count, after the bounds checks that keep
    the native memcpy inside both buffers."""
    if not isinstance(page_bytes, (int, np.integer)) or page_bytes <= 0:
        raise InvalidInput(f"page_bytes must be a positive int, got {page_bytes!r}")
    if dst_frames is None and src_frames is None:
        raise InvalidInput("copy_pages needs dst_frames or src_frames (both None gives no count)")
    if memoryview(dst).readonly:
        raise InvalidInput("copy_pages destination buffer is read-only")
    df = None if dst_frames is None else np.ascontiguousarray(dst_frames, dtype=np.int64).reshape(-1)
    sf = None if src_frames is None else np.ascontiguousarray(src_frames, dtype=np.int64).reshape(-1)
    if df is not None and sf is not None and df.size != sf.size:
        raise InvalidInput(f"copy_pages got {df.size} dst frames but {sf.size} src frames")
    n = df.size if df is not None else sf.size
    for name, buf, frames in (("dst", dst, df), ("src", src, sf)):
        _check_frames(frames, n, memoryview(buf).nbytes // page_bytes, f"copy_pages {name}")
    return df, sf, n


def _check_frames(frames: np.ndarray | None, n: int, num_pages: int, what: str) -> None:
    """Frames (int64; None: 0..n-1) all inside a buffer of ``num_pages`` pages, or InvalidInput:
    what keeps a native loop over them inside the buffer."""
    if frames is None or not n:
        lo, hi = 0, n
    elif n <= SMALL_FRAME_LISTS:  # numpy's reductions cost more than the copy of one page
        listed = frames.tolist()
        lo, hi = min(listed), max(listed) + 1
    else:
        lo, hi = int(frames.min()), int(frames.max()) + 1
    if lo < 0 or hi > num_pages:
        raise InvalidInput(f"{what} frames outside the {num_pages} pages of the buffer")


def py_crc32c_heads_pages(heads: np.ndarray, start: int, pages: np.ndarray, frames) -> np.ndarray:
    """For each i < len(frames): CRC-32C of ``heads[i, start:]``, continued over page
    ``pages[frames[i]]`` (a record whose head and page were read into different buffers);
    uint32 [len(frames)]."""
    return np.array([py_crc32c(pages[int(f)], py_crc32c(heads[i, start:])) for i, f in enumerate(frames)],
                    dtype=np.uint32)


def crc32c_heads_pages(heads: np.ndarray, start: int, pages: np.ndarray, frames) -> np.ndarray:
    """``py_crc32c_heads_pages`` in one native call (the GIL released) for a slice's records,
    ``pages`` a C-contiguous uint8 [m, page] array (a read's ``out``), ``frames`` the row of
    each record's page: kvdb/cold/read.py ``check_fields``."""
    fr = _check_heads_pages(heads, pages, frames, "crc32c_heads_pages")
    if not 0 <= start <= heads.shape[1]:
        raise InvalidInput(f"crc32c_heads_pages: start {start} outside heads of {heads.shape[1]} bytes")
    if _lib is None:
        return py_crc32c_heads_pages(heads, start, pages, fr)
    out = np.empty(fr.size, dtype=np.uint32)
    _lib.kvdb_crc32c_heads_pages(_ptr(heads), heads.shape[1], start, _ptr(pages), _ptr(fr, "int64_t *"),
                                 pages.shape[1], fr.size, _ptr(out, "uint32_t *"))
    return out


def _check_heads_pages(heads: np.ndarray, pages: np.ndarray, frames, what: str, writable: bool = False) -> np.ndarray:
    """``frames`` as int64 after the checks that keep a native loop over ``len(frames)``
    records inside ``heads`` (uint8 [>= n, head bytes]) and ``pages`` (uint8 [m, page bytes],
    every frame < m): both C-contiguous numpy arrays, and writable when the loop writes them;
    InvalidInput otherwise."""
    fr = np.ascontiguousarray(frames, dtype=np.int64).reshape(-1)
    for name, a in (("heads", heads), ("pages", pages)):
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != np.uint8 or not a.flags.c_contiguous \
                or (writable and not a.flags.writeable):
            raise InvalidInput(f"{what} needs its {name} as a C-contiguous{', writable' if writable else ''} "
                               f"uint8 [rows, bytes] numpy array")
    if heads.shape[0] < fr.size:
        raise InvalidInput(f"{what} has {heads.shape[0]} heads for {fr.size} records")
    _check_frames(fr, fr.size, pages.shape[0], what)
    return fr


def py_copy_pages(dst: np.ndarray, dst_frames, src: np.ndarray, src_frames, page_bytes: int) -> None:
    """dst page dst_frames[i] := src page src_frames[i]; ``None`` frames mean 0..n-1."""
    dst_frames, src_frames, n = _check_copy(dst, dst_frames, src, src_frames, page_bytes)
    d2 = dst.reshape(-1, page_bytes)
    s2 = src.reshape(-1, page_bytes)
    for i in range(n):
        d = i if dst_frames is None else int(dst_frames[i])
        s = i if src_frames is None else int(src_frames[i])
        d2[d] = s2[s]


def row_bufs(heads: np.ndarray, pays: np.ndarray, rows=None) -> list:
    """Head row j then payload row rows[j], for j < len(rows) (rows None: every head row, with
    its own payload row), as buffers for a ``writev`` or ``preadv``: the twin of ``writev_rows`` and ``preadv_rows``
    (kvdb/fs.py moves them with ``OsFs.writev`` / ``OsFs.preadv``)."""
    hb, pb = heads.shape[1], pays.shape[1]
    h, p = memoryview(heads).cast("B"), memoryview(pays).cast("B")
    at = range(heads.shape[0]) if rows is None else rows
    return [b for j, x in enumerate(at) for b in (h[j * hb : (j + 1) * hb], p[x * pb : (x + 1) * pb])]


def writev_rows(fd: int, heads: np.ndarray, pays: np.ndarray) -> None:
    """Append ``row_bufs(heads, pays)`` to ``fd`` in one native call (the iovecs built in C,
    the GIL released, short writes resumed); OSError on failure. ``heads`` [n, hb] and ``pays``
    [n, pb]: C-contiguous uint8 arrays of the same n."""
    if heads.ndim != 2 or pays.ndim != 2 or pays.shape[0] != heads.shape[0] or heads.dtype != np.uint8 \
            or pays.dtype != np.uint8 or not heads.flags.c_contiguous or not pays.flags.c_contiguous:
        raise InvalidInput("writev_rows takes two C-contiguous uint8 arrays with one row per record")
    n = heads.shape[0]
    err = _lib.kvdb_writev_rows(fd, _ffi.cast("const uint8_t *", _ffi.from_buffer(heads)), heads.shape[1],
                                _ffi.cast("const uint8_t *", _ffi.from_buffer(pays)), pays.shape[1], n)
    if err:
        raise OSError(err, os.strerror(err))


def read_bufs(heads: np.ndarray, pages: np.ndarray, rows) -> list:
    """``row_bufs`` for a read into ``heads`` and ``pages[rows]``, checked as ``preadv_rows``
    checks them (kvdb/fs.py reads them with ``OsFs.preadv``)."""
    return row_bufs(heads, pages, _check_heads_pages(heads, pages, rows, "preadv_rows", writable=True).tolist())


def preadv_rows(fd: int, offset: int, heads: np.ndarray, pages: np.ndarray, rows) -> int:
    """Read records lying back to back in ``fd`` from ``offset`` -- record j a head of
    ``heads.shape[1]`` bytes then a page -- into ``heads[j]`` and ``pages[rows[j]]``, in one
    native call (the iovecs built in C, the GIL released, short reads resumed). Returns the
    bytes read (fewer at end of file); OSError when a read fails. Without the native core: one
    ``os.preadv`` of ``read_bufs`` (at most IOV_MAX // 2 records, a short read not resumed;
    kvdb/fs.py ``OsFs.preadv_rows`` is the general twin)."""
    r = _check_heads_pages(heads, pages, rows, "preadv_rows", writable=True)
    if _lib is None:
        return os.preadv(fd, row_bufs(heads, pages, r.tolist()), offset)
    got = _lib.kvdb_preadv_rows(fd, offset, _ptr(heads), heads.shape[1], _ptr(pages), pages.shape[1],
                                _ptr(r, "int64_t *"), r.size)  # both checked writable above
    if got < 0:
        raise OSError(-got, os.strerror(-got))
    return got


def copy_pages(dst: np.ndarray, dst_frames, src: np.ndarray, src_frames, page_bytes: int) -> None:
    """Whole-page memcpy between two uint8 buffers in one native call (no Python loop)."""
    if _lib is None:
        py_copy_pages(dst, dst_frames, src, src_frames, page_bytes)
        return
    df, sf, n = _check_copy(dst, dst_frames, src, src_frames, page_bytes)
    _lib.kvdb_copy_pages(
        _ffi.cast("uint8_t *", _ffi.from_buffer(dst)),
        _ffi.NULL if df is None else _ffi.cast("const int64_t *", _ffi.from_buffer(df)),
        _ffi.cast("const uint8_t *", _ffi.from_buffer(src)),
        _ffi.NULL if sf is None else _ffi.cast("const int64_t *", _ffi.from_buffer(sf)),
        page_bytes,
        n,
    )


def _small_frames(frames, num_pages: int, name: str):
    """A short list of int frames as a C array after its bounds check; None when ``frames`` is
    not such a list (the caller takes the general path)."""
    if type(frames) is not list or not frames or len(frames) > SMALL_FRAME_LISTS:
        return None
    try:
        arr = _ffi.new("int64_t[]", frames)
    except (TypeError, OverflowError):
        return None
    if min(frames) < 0 or max(frames) >= num_pages:
        raise InvalidInput(f"copy_pages {name} frames outside the {num_pages} pages of the buffer")
    return arr


def _copy_one_page(dst, dst_frames, src, src_frames, page_bytes: int) -> bool:
    """One page named by int frames inside both tensors, copied by address: no frame arrays to
    build (a one-block read's promotion). The tensors are those ``copy_tensor_pages`` checked
    for its native path. False: not such a copy (the caller takes the frame-array path)."""
    if dst_frames is None:  # src_frames is a list then
        if len(src_frames) != 1:
            return False
        d, s = 0, src_frames[0]
    elif len(dst_frames) != 1 or (src_frames is not None and len(src_frames) != 1):
        return False
    else:
        d, s = dst_frames[0], 0 if src_frames is None else src_frames[0]
    if type(d) is not int or type(s) is not int or not (0 <= d < dst.shape[0] and 0 <= s < src.shape[0]):
        return False
    _lib.kvdb_copy_pages(_ffi.cast("uint8_t *", dst.data_ptr() + d * page_bytes), _ffi.NULL,
                         _ffi.cast("const uint8_t *", src.data_ptr() + s * page_bytes), _ffi.NULL, page_bytes, 1)
    return True


def copy_tensor_pages(dst, dst_frames, src, src_frames, page_bytes: int) -> None:
    """``copy_pages`` between two CPU uint8 tensors [pages, page_bytes] (contiguous): the same
    copy, the same bounds checks, without the numpy round trip. Short int lists of frames (one
    list may be None: 0..n-1) go straight to the native copy: a one-page copy costs ~3 us, not
    ~12 (the arena's hot path on small reads), and one page is copied by address. Any other
    tensor (not a CPU byte tensor of that shape) takes the numpy path and its checks."""
    fast = _lib is not None and (dst_frames is not None or src_frames is not None) \
        and dst.is_cpu and src.is_cpu and dst.itemsize == 1 and src.itemsize == 1 \
        and dst.dim() == 2 and src.dim() == 2 and dst.shape[1] == page_bytes and src.shape[1] == page_bytes \
        and dst.is_contiguous() and src.is_contiguous()
    if fast and _copy_one_page(dst, dst_frames, src, src_frames, page_bytes):
        return
    if fast:
        n = len(dst_frames if dst_frames is not None else src_frames)
        df = _ffi.NULL if dst_frames is None else _small_frames(dst_frames, dst.shape[0], "dst")
        sf = _ffi.NULL if src_frames is None else _small_frames(src_frames, src.shape[0], "src")
        fast = df is not None and sf is not None \
            and (dst_frames is None or src_frames is None or len(dst_frames) == len(src_frames)) \
            and (dst_frames is not None or n <= dst.shape[0]) and (src_frames is not None or n <= src.shape[0])
    if not fast:
        copy_pages(dst.detach().numpy(), dst_frames, src.detach().numpy(), src_frames, page_bytes)
        return
    _lib.kvdb_copy_pages(_ffi.cast("uint8_t *", dst.data_ptr()), df, _ffi.cast("const uint8_t *", src.data_ptr()),
                         sf, page_bytes, n)


# ---------------------------------------------------------------- group commit


class Committer:
    """The native group-commit thread of one log (native/kvdb_native.c "group commit").

    ``wait(lsn)`` blocks with the GIL released until ``lsn`` is durable and returns the durable
    lsn; after a failed fsync it raises ``OSError(errno)`` (then and for ever after, K2); after
    ``stop`` it returns the durable lsn when ``lsn`` is covered and raises ``CommitterClosed``
    otherwise. The pure-Python twin is kvdb/wal/commit.py's fsync leader
    (``GroupCommit(native_commit=False)``); tests run both."""

    def __init__(self, path: str, durable_lsn: int, gather_s: float, num_workers: int = 1) -> None:
        if _lib is None:
            raise RuntimeError("the native group committer needs the compiled core (kvdb._native)")
        c = _lib.kvdb_committer_open(os.fsencode(path), durable_lsn, int(gather_s * 1e9), num_workers)
        if c == _ffi.NULL:
            err = _ffi.errno
            raise OSError(err, f"cannot start the group commit thread: {os.strerror(err)}")
        # freed when the last reference goes: a thread inside wait() holds one (the argument)
        self._c = _ffi.gc(c, _lib.kvdb_committer_free)
        self._wait = _lib.kvdb_committer_wait

    def wait(self, lsn: int) -> int:
        r = self._wait(self._c, lsn)
        if r >= 0:
            return r
        if r == _lib.KVDB_COMMIT_CLOSED:
            raise CommitterClosed("the log's group commit thread has stopped")
        raise OSError(-r, os.strerror(-r))

    def set_path(self, path: str) -> None:
        r = _lib.kvdb_committer_set_path(self._c, os.fsencode(path))
        if r < 0:
            raise OSError(-r, os.strerror(-r))

    def publish(self, lsn: int) -> None:
        _lib.kvdb_committer_publish(self._c, lsn)

    def fail(self, err: int) -> None:
        _lib.kvdb_committer_fail(self._c, err)

    @property
    def durable_lsn(self) -> int:
        return _lib.kvdb_committer_durable(self._c)

    @property
    def num_fsyncs(self) -> int:
        return _lib.kvdb_committer_fsyncs(self._c)

    @property
    def error(self) -> int:
        return _lib.kvdb_committer_error(self._c)

    def debug_fail_next(self, err: int) -> None:
        """Tests: the committer's next fsync fails with ``err`` (EIO, ENOSPC)."""
        _lib.kvdb_committer_debug_fail_next(self._c, err)

    def debug_hold(self, hold: bool) -> None:
        """Tests: while held, the workers start no fsync (as if one were still running), so
        waiters queue up into a batch of known size; releasing wakes them. stop overrides it."""
        _lib.kvdb_committer_debug_hold(self._c, 1 if hold else 0)

    def debug_state(self) -> dict:
        """Tests: what the committer has seen, to order a test's threads by it instead of by
        sleeps: ``waiters`` blocked in wait, ``arrived`` (those no started fsync covers),
        ``expect`` (the batch it gathers for), workers ``sleeping`` without a deadline (nothing
        to do, or held), and ``naps``, how many times a worker went to sleep so."""
        out = _ffi.new("int64_t[5]")
        _lib.kvdb_committer_debug_state(self._c, out)
        return dict(zip(("waiters", "arrived", "expect", "sleeping", "naps"), out))

    def stop(self) -> None:
        """Fsync what waiters are owed (K4), join the thread, wake everyone. Idempotent."""
        _lib.kvdb_committer_stop(self._c)


class CommitterClosed(KvdbError):
    """A wait on a Committer that stopped before the lsn became durable."""


def commit_ceiling(path: str, threads: int, n_per_thread: int, record_bytes: int) -> tuple[float, int]:
    """Group commit with no Python in the way (native/kvdb_native.c "the commit ceiling"):
    ``threads`` pthreads append ``n_per_thread`` records each to a new file at ``path`` and wait
    for an fdatasync covering theirs (one gathering leader per fsync; threads = 1: write +
    fdatasync per record). Returns (seconds, fsyncs); the file is removed."""
    if _lib is None:
        raise RuntimeError("the commit ceiling needs the compiled core (kvdb._native)")
    secs = _ffi.new("double *")
    fsyncs = _ffi.new("int64_t *")
    r = _lib.kvdb_commit_ceiling(os.fsencode(path), threads, n_per_thread, record_bytes, secs, fsyncs)
    if r < 0:
        raise OSError(-r, f"commit ceiling in {path}: {os.strerror(-r)}")
    return secs[0], fsyncs[0]
