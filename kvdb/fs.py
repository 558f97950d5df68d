"""The file layer (an Env in LevelDB's sense), the floor under the byte formats: every byte the cold tier
writes to a log segment goes through an ``OsFs``, and the small state files (the manifest, the key
secret, replication's slots and positions) through ``write_file_atomic``.

``OsFs`` is the real one (os.* calls, fdatasync). ``FaultFs`` wraps it for crash and fault
tests (docs/style.md "Tests", in the manner of LevelDB's fault-injection Env and SQLite's crash VFS):

* it counts the I/O points of a run (create, write, sync, truncate, unlink);
* ``crash_at=N`` makes point N the moment the machine dies: a write there is torn (half of it
  reaches the file), every later call raises ``SimulatedCrash``; ``debug_crash()`` then rewinds
  every file to what a real crash could leave: mode "drop" keeps only synced bytes, mode "tear"
  keeps everything but the second half of the last write;
* ``fail_at=N, fail_errno=ENOSPC|EIO`` makes point N raise ``OSError`` (the store must turn it
  into ``StorageIOError`` and a sticky failed state);
* ``free_bytes=N`` (or a callable of the path) is what ``free_bytes`` answers: a disk that
  is nearly full, for the checks that look before they write (compaction).

Simplifications (documented, relied on by the tests): create, truncate and unlink count as
durable when they return -- the log fsyncs the directory right after each of them.
RocksDB does its own I/O and is not routed through here; tests model its crash separately.
"""

from __future__ import annotations

import errno as _errno
import os
import threading

from kvdb import native

IOV_MAX = 1024


class SimulatedCrash(BaseException):
    """The fault layer's machine died. A BaseException so that no ``except Exception`` in the
    code under test can swallow it (a dead process runs no handlers)."""


class OsFs:
    """Plain POSIX files. Handles are integer file descriptors."""

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def file_bytes(self, path: str) -> int:
        return os.stat(path).st_size

    def create(self, path: str) -> int:
        """A new empty file opened for appending (fails if it exists)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)

    def open_append(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_APPEND)

    def writev(self, fd: int, path: str, bufs: list, nbytes: int | None = None) -> None:
        """Append every buffer, in order, retrying short writes (``nbytes``: their total, if known)."""
        i = 0
        while i < len(bufs):
            chunk = bufs[i : i + IOV_MAX]
            want = nbytes if nbytes is not None and len(bufs) <= IOV_MAX else sum(memoryview(b).nbytes for b in chunk)
            done = os.writev(fd, chunk)
            if done != want:
                self._finish_short(fd, chunk, done)
            i += IOV_MAX

    def writev_rows(self, fd: int, path: str, heads, pays, nbytes: int | None = None) -> None:
        """Append records whose heads are the rows of ``heads`` and payloads the rows of ``pays``
        (C-contiguous uint8 arrays, one row per record): the bytes of ``writev`` of
        ``native.row_bufs(heads, pays)``, with the iovecs built natively (no Python object per
        record). A layer that overrides ``writev`` (faults, read-only) gets exactly that
        ``writev``, so every write still passes through it."""
        if type(self).writev is not OsFs.writev or not native.HAVE_NATIVE:
            self.writev(fd, path, native.row_bufs(heads, pays), nbytes)
            return
        native.writev_rows(fd, heads, pays)

    @staticmethod
    def _finish_short(fd: int, chunk: list, done: int) -> None:
        for b in chunk:
            mv = memoryview(b).cast("B")
            if done >= mv.nbytes:
                done -= mv.nbytes
                continue
            mv = mv[done:]
            done = 0
            while mv.nbytes:
                n = os.write(fd, mv)
                if n <= 0:
                    raise OSError(_errno.EIO, "write made no progress")
                mv = mv[n:]

    def sync(self, fd: int, path: str) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def open_read(self, path: str) -> int:
        return os.open(path, os.O_RDONLY)

    def preadv(self, fd: int, bufs: list, offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def preadv_rows(self, fd: int, heads, pages, rows, offset: int) -> int:
        """Read records lying back to back from ``offset`` -- each a head row of ``heads``, then
        a page -- into ``heads[j]`` and ``pages[rows[j]]``: the bytes of ``preadv`` of
        ``native.read_bufs(heads, pages, rows)``, with the iovecs built natively (no Python
        object per record). A layer that overrides or patches ``preadv`` (faults, a spy) gets
        the same reads as that ``preadv``, in calls of at most IOV_MAX buffers."""
        if getattr(self.preadv, "__func__", None) is _OS_PREADV and native.HAVE_NATIVE:
            return native.preadv_rows(fd, offset, heads, pages, rows)
        bufs, done = native.read_bufs(heads, pages, rows), 0
        for i in range(0, len(bufs), IOV_MAX):  # a preadv takes at most IOV_MAX buffers
            chunk = bufs[i : i + IOV_MAX]
            got = self.preadv(fd, chunk, offset + done)
            done += got
            if got < sum(memoryview(b).nbytes for b in chunk):
                break  # end of file (or a short read): what was read so far
        return done

    def pread(self, fd: int, nbytes: int, offset: int) -> bytes:
        return os.pread(fd, nbytes, offset)

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def truncate(self, path: str, nbytes: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def free_bytes(self, path: str) -> int:
        """Bytes an unprivileged writer may still write on the filesystem holding ``path``
        (``statvfs``: available blocks x fragment size)."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize


_OS_PREADV = OsFs.preadv  # the plain preadv: anything else (a subclass, a patch, a spy) is a layer


class ReadOnlyFs(OsFs):
    """An ``OsFs`` that never changes a byte (``read_only`` opens, kvdb/cold/store.py): reads
    work; the log writer's append fd is opened for reading only (so an append cannot write); a
    segment the writer would create (recovery starts a fresh one after a damaged tail) stays a
    phantom -- /dev/null read-only, its header dropped, nothing on disk; every other change
    raises OSError(EROFS). The store refuses appends before they get here."""

    def __init__(self) -> None:
        self._phantoms: set[int] = set()

    @staticmethod
    def _refuse(path: str):
        return OSError(_errno.EROFS, "opened read-only", path)

    def makedirs(self, path: str) -> None:
        if not os.path.isdir(path):
            raise self._refuse(path)

    def create(self, path: str) -> int:
        fd = os.open(os.devnull, os.O_RDONLY)
        self._phantoms.add(fd)
        return fd

    def open_append(self, path: str) -> int:
        return os.open(path, os.O_RDONLY)

    def writev(self, fd: int, path: str, bufs: list, nbytes: int | None = None) -> None:
        if fd not in self._phantoms:
            raise self._refuse(path)

    def close(self, fd: int) -> None:
        self._phantoms.discard(fd)
        os.close(fd)

    def sync(self, fd: int, path: str) -> None:
        return None  # nothing was written

    def truncate(self, path: str, nbytes: int) -> None:
        raise self._refuse(path)

    def unlink(self, path: str) -> None:
        raise self._refuse(path)

    def sync_dir(self, path: str) -> None:
        return None


class FaultFs(OsFs):
    """OsFs plus counted I/O points, simulated crashes and injected errors (see module doc)."""

    def __init__(self, *, crash_at: int | None = None, fail_at: int | None = None,
                 fail_errno: int = _errno.EIO, fail_repeats: bool = False, free_bytes=None) -> None:
        self.crash_at = crash_at
        self.free = free_bytes  # None: the real filesystem's
        self.fail_at = fail_at
        self.fail_errno = fail_errno
        self.fail_repeats = fail_repeats  # every point from fail_at on fails (a dead disk)
        self.num_points = 0  # I/O points seen so far
        self.crashed = False
        self._lock = threading.Lock()  # guards the counters and the per-file sizes below
        self._written: dict[str, int] = {}  # path -> bytes written (synced or not)
        self._synced: dict[str, int] = {}  # path -> bytes known durable
        self._last_write: dict[str, tuple[int, int]] = {}  # path -> (offset, length) of its last write

    # -- the point counter

    def _point(self, what: str) -> str:
        """Count one I/O point; returns "go", "crash" or raises."""
        with self._lock:
            if self.crashed:
                raise SimulatedCrash(f"machine already crashed ({what})")
            self.num_points += 1
            n = self.num_points
            if self.crash_at is not None and n >= self.crash_at:
                self.crashed = True
                return "crash"
            if self.fail_at is not None and (n == self.fail_at or (self.fail_repeats and n > self.fail_at)):
                raise OSError(self.fail_errno, f"injected {_errno.errorcode.get(self.fail_errno, self.fail_errno)} at I/O point {n} ({what})")
        return "go"

    def _track(self, path: str) -> None:
        if path not in self._written:
            size = os.path.getsize(path) if os.path.exists(path) else 0
            self._written[path] = size
            self._synced[path] = size

    def free_bytes(self, path: str) -> int:
        if self.free is None:
            return super().free_bytes(path)
        return self.free(path) if callable(self.free) else self.free

    # -- mutating calls

    def create(self, path: str) -> int:
        if self._point("create") == "crash":
            raise SimulatedCrash("crash before create")
        fd = super().create(path)
        with self._lock:
            self._written[path] = 0
            self._synced[path] = 0
        return fd

    def open_append(self, path: str) -> int:
        with self._lock:
            self._track(path)
        return super().open_append(path)

    def writev(self, fd: int, path: str, bufs: list, nbytes: int | None = None) -> None:
        verdict = self._point("write")
        total = sum(memoryview(b).nbytes for b in bufs)
        if verdict == "crash":
            data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
            os.write(fd, data[: total // 2])  # the torn write: its first half reached the disk
            with self._lock:
                self._track(path)
                self._last_write[path] = (self._written[path], total // 2)
                self._written[path] += total // 2
            raise SimulatedCrash("crash during write")
        super().writev(fd, path, bufs, total)
        with self._lock:
            self._track(path)
            self._last_write[path] = (self._written[path], total)
            self._written[path] += total

    def sync(self, fd: int, path: str) -> None:
        if self._point("sync") == "crash":
            raise SimulatedCrash("crash before sync")
        super().sync(fd, path)
        with self._lock:
            self._track(path)
            self._synced[path] = self._written[path]

    def truncate(self, path: str, nbytes: int) -> None:
        if self._point("truncate") == "crash":
            raise SimulatedCrash("crash before truncate")
        super().truncate(path, nbytes)
        with self._lock:
            self._written[path] = nbytes
            self._synced[path] = nbytes
            self._last_write.pop(path, None)

    def unlink(self, path: str) -> None:
        if self._point("unlink") == "crash":
            raise SimulatedCrash("crash before unlink")
        super().unlink(path)
        with self._lock:
            for d in (self._written, self._synced, self._last_write):
                d.pop(path, None)

    # -- after the crash

    def debug_crash(self, mode: str = "drop") -> dict[str, int]:
        """Rewind every written file to a state a real crash could leave; returns path -> kept bytes.

        "drop": only synced bytes survive. "tear": every written byte survives except the second
        half of each file's last unsynced write (the page cache flushed some, not all)."""
        if mode not in ("drop", "tear"):
            raise ValueError(f"crash mode must be 'drop' or 'tear', got {mode!r}")
        kept = {}
        with self._lock:
            self.crashed = True
            for path, written in self._written.items():
                if not os.path.exists(path):
                    continue
                keep = self._synced[path]
                if mode == "tear" and written > keep:
                    off, n = self._last_write.get(path, (written, 0))
                    keep = max(keep, min(written, off + n // 2)) if off + n == written else written
                with open(path, "r+b") as f:
                    f.truncate(keep)
                kept[path] = keep
        return kept


def write_file_atomic(path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new whole file:
    write a temporary beside it, fsync, rename over, fsync the directory. For small state files
    (manifest, key secret, replication slots), not for the log."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def drop_page_cache(path) -> None:
    """Make ``path``'s data durable, then ask the kernel to drop its pages from the page cache,
    so that the next read comes from the device (benchmarks of cold reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
