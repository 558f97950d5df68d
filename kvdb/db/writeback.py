"""The background writer: pages stored with durability "none" reach the disk tier within about
``writeback_s`` seconds of their put, so that a stop which runs no exit hook finds them there.

Durability "none" acknowledges a put once its page is in memory (dirty, kvdb/db/write.py). Without
more, a dirty page reaches the log only when it is evicted, flushed or the Db closes; a process
stopped without its exit hooks (SIGTERM's default action, SIGKILL, an engine's shutdown deadline)
loses every page put since the open, and a Db with gigabytes of dirty DRAM needs that long to
close. The background writer bounds both: every ``writeback_s`` it writes the dirty pages back, a
batch at a time, as a database's background writer does; a stop has little left to write. The
bytes are in the log (the page cache) when a page turns clean: a killed process keeps them, an
operating-system crash keeps what an fsync covered (the log's flusher, kvdb/cold/store.py).

Invariants
    B1  a batch is copied under the Db's lock into the writer's own buffer and written outside it:
        a put, read or eviction waits for at most one copy of ``BATCH_BYTES``, never for the disk.
    B2  a page turns clean only once its bytes are in the log, and only while it is resident.
    B3  a batch and ``Db.delete`` exclude each other (``Db._writeback_mu``, taken before the Db's
        lock): a block deleted while its batch is written is never written back after the delete.
    B4  the thread holds the Db weakly: a Db its owner dropped is still collected and closed
        (kvdb/db/core.py), and ``close()`` stops the thread before its own write-back.
    B5  an I/O error fails the Db as an eviction's write-back does, and ends the thread.
"""

from __future__ import annotations

import threading
import weakref

import torch

from kvdb.errors import KvdbError

#: the most bytes one background batch copies under the Db's lock (B1)
BATCH_BYTES = 32 << 20


def write_back_batch(db, staging: torch.Tensor) -> int:
    """Write one batch of ``db``'s dirty pages (at most ``len(staging)``) to its disk tier;
    returns how many pages (0: nothing was dirty, or the Db is no longer open)."""
    with db._writeback_mu:  # B3
        with db._lock:
            if db._state != "open":
                return 0
            batch = next(db.pool.dirty_batches(staging.numel(), staging, views=False), None)  # B1
        if batch is None:
            return 0
        keys, pages, positions = batch
        db._cold_call(db._cold.put, keys, pages.numpy(), positions, "none")
        with db._lock:
            if db._state == "open":
                db.pool.mark_clean(keys)  # B2: skips keys no longer resident
        return len(keys)


class BackgroundWriter:
    """One daemon thread per Db with a disk tier (and ``writeback_s`` not None)."""

    def __init__(self, db, interval_s: float, page_bytes: int) -> None:
        self.interval_s = interval_s
        self._per = max(1, BATCH_BYTES // page_bytes)
        self._page_bytes = page_bytes
        self._stop = threading.Event()
        self._kick = threading.Event()  # a round now (``Db.flush(wait=False)``), not after the interval
        self._thread = threading.Thread(target=self._run, args=(weakref.ref(db),), name="kvdb-writeback",
                                         daemon=True)
        self._thread.start()

    def _run(self, ref) -> None:
        staging = None
        while not self._stop.is_set():
            self._kick.wait(self.interval_s)
            self._kick.clear()
            if self._stop.is_set():
                return
            db = ref()  # B4: a strong reference only for one round
            if db is None:
                return
            try:
                if staging is None:
                    with torch.inference_mode(False):
                        staging = torch.empty((self._per, self._page_bytes), dtype=torch.uint8)
                while not self._stop.is_set() and write_back_batch(db, staging):
                    pass
            except KvdbError:  # B5: the Db failed (it says so to its callers) or closed meanwhile
                return
            finally:
                del db

    def kick(self) -> None:
        """Start a round now."""
        self._kick.set()

    def stop(self) -> None:
        """Stop the thread after the batch it is writing (idempotent)."""
        self._stop.set()
        self._kick.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()


__all__ = ["BATCH_BYTES", "BackgroundWriter", "write_back_batch"]
