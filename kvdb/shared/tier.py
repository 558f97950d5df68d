"""The shared tier of one Db: publishing its new blocks to the pool, fetching lookup misses from it.

Invariants (docs/shared.md; tests cite them):
  S1  The local log stays the only durable copy; the pool may drop anything at any time and
      the Db answers the same (a pool miss is a local miss).
  S2  ``offer`` never waits for the pool: it copies the new pages into staging slots (none
      free: the put is dropped, counted) and the publisher thread puts them in batches.
      ``wait_published`` returns once every offer made before it is published or dropped.
  S3  A block fetched from the pool lands in the host tier (``commit_frames``, durability
      "none": written back to the log on eviction, like any put) and is never re-published.
      Plain pages land with no copy: the Store writes each payload straight into a reserved
      host frame (pool invariant P6), the header into a staging slot.
  S5  Every fetched object is checked (kvdb/format/shared_object.py): a bad one is a counted
      corruption and a miss, never bytes.
  S6  Keys are de-duplicated within each batch; kvdb removes without ``force`` only.
  S7  Lookups never probe: a miss fetches the missing leading keys (a get, which is what the
      caller reads next), and a key the pool did not have is remembered absent for
      ``ABSENT_S``, so a lookup loop neither calls the pool again nor renews any lease.
  S8  Every call runs under kvdb's deadline on a fixed set of workers (kvdb/shared/calls.py).
  S9  A full pool drops puts (counted), never fails them.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import torch

from kvdb.errors import CapacityError
from kvdb.format import shared_object as fmt
from kvdb.shared.calls import LATE, OK, Calls
from kvdb.shared.client import NO_SPACE, OBJECT_NOT_FOUND, StoreClient, unreachable
from kvdb.shared.url import SharedConfig

#: a key the pool did not have is not asked for again for this long (S7)
ABSENT_S = 0.25
#: objects per pool call
BATCH = 32


class SharedTier:
    def __init__(self, db, cfg: SharedConfig, ns: str, sealer=None, clock=time.monotonic) -> None:
        self.db = db
        self.cfg = cfg
        self.ns = ns
        self.sealer = sealer
        self._clock = clock
        self.page_bytes = db.layout.page_bytes
        self.sealed = sealer is not None
        self.payload_bytes = fmt.payload_bytes(self.page_bytes, self.sealed)
        self.obj_bytes = fmt.object_bytes(self.page_bytes, self.sealed)
        slots = max(4 * BATCH, cfg.staging_bytes // self.obj_bytes)  # two batches each way at least
        n_put, n_get = slots // 2, slots - slots // 2
        # staging: one registered buffer, prefaulted. Puts: whole object rows (the page is copied
        # in, the header written before it). Gets: whole rows for sealed pages (unsealed from
        # there into a host frame); only the 64-byte header for plain pages, whose payload the
        # Store writes straight into a reserved host-tier frame (pool invariant P6).
        self._get_row = self.obj_bytes if self.sealed else fmt.HEADER_BYTES
        self._mem = _populated(n_put * self.obj_bytes + n_get * self._get_row)
        self.staging = np.frombuffer(self._mem, dtype=np.uint8)
        self._put_rows = self.staging[: n_put * self.obj_bytes].reshape(n_put, self.obj_bytes)
        self._get_rows = self.staging[n_put * self.obj_bytes :].reshape(n_get, self._get_row)
        self._put_t = torch.from_numpy(self._put_rows)
        # free slots, reused last-in first-out (the rows used last are the ones in cache)
        self._free_put = deque(range(n_put))
        self._free_get = deque(range(n_get))
        self._slot_mu = threading.Lock()
        self.client: StoreClient | None = None
        self._ready = False
        self.calls = Calls(cfg.workers, cfg.deadline_s, self._probe, clock)
        self._absent: dict[bytes, float] = {}
        self.counts = {"hits": 0, "misses": 0, "puts": 0, "put_bytes": 0, "get_bytes": 0, "dropped_puts": 0,
                       "dropped_full": 0, "corruptions": 0, "removes": 0, "lookups": 0}
        # the publisher (S2): offers in order, each with its sequence number
        self._pending: deque = deque()
        self._cv = threading.Condition()
        self._offered = 0
        self._done = 0
        self._stop = False
        self._connect()
        self._publisher = threading.Thread(target=self._publish_loop, name="kvdb-shared-publish", daemon=True)
        self._publisher.start()

    # ------------------------------------------------------------------ connecting

    def _connect(self) -> None:
        """Set the client up within the deadline; a pool not reachable now leaves the breaker
        open, and its probe sets it up later (the Db opens all the same: S1)."""
        status, ok = self.calls.run(self._setup)
        if status != OK or not ok:
            self.calls.trip()

    def _setup(self) -> bool:
        if self._ready:
            return True
        client = StoreClient(self.cfg)
        if client.setup() != 0:
            client.close()
            return False
        if client.register(self.staging.ctypes.data, self.staging.nbytes) != 0:
            client.close()
            return False
        if not self.sealed:
            arena = self.db.pool.host_arena()
            if client.register(arena.data_ptr(), arena.numel()) != 0:
                client.close()
                return False
        self.client = client
        self._ready = True
        return True

    def _probe(self) -> bool:
        if not self._ready:
            return self._setup()
        return self.client.exists(f"{fmt.NAME_PREFIX}/{self.ns}/probe") >= 0  # never stored: no lease

    # ------------------------------------------------------------------ slots

    def _take(self, free: deque, n: int) -> list[int]:
        with self._slot_mu:
            k = min(n, len(free))
            return sorted(free.pop() for _ in range(k))

    def _give(self, free: deque, slots: list[int]) -> None:
        with self._slot_mu:
            free.extend(slots)

    def _on_slots(self, call, keys: list[bytes], slots: list[int], free: deque) -> tuple[str, object]:
        """``call(names, ptrs, sizes)`` of the objects of ``keys`` in put staging ``slots``, under
        the deadline (S8); the slots go back to ``free`` when a late call finally returns."""
        base, row = self._put_rows.ctypes.data, self.obj_bytes
        names, ptrs = fmt.object_names(self.ns, keys), [base + s * row for s in slots]
        sizes = [row] * len(keys)
        return self.calls.run(lambda: call(names, ptrs, sizes), on_late=lambda: self._give(free, slots))

    # ------------------------------------------------------------------ publishing (S2)

    def offer(self, keys: list[bytes], pages: torch.Tensor) -> None:
        """Queue new blocks (``pages``: [n, page_bytes] uint8, any device) for the pool."""
        n = len(keys)
        if not n:
            return
        if self.calls.state != "closed":  # the pool is down: drop at once, copy nothing
            self.counts["dropped_puts"] += n
            self._note_offer_done()
            return
        slots = self._take(self._free_put, n)
        if len(slots) < n:
            self.counts["dropped_puts"] += n - len(slots)
        if not slots:
            self._note_offer_done()
            return
        src = pages[: len(slots)]
        dst = self._put_t[:, fmt.HEADER_BYTES : fmt.HEADER_BYTES + self.page_bytes]
        if slots == list(range(slots[0], slots[0] + len(slots))):
            dst[slots[0] : slots[0] + len(slots)].copy_(src)
        else:
            dst.index_copy_(0, torch.as_tensor(slots), src.cpu())
        with self._cv:
            self._offered += 1
            self._pending.append((self._offered, list(keys[: len(slots)]), slots))
            self._cv.notify_all()

    def _note_offer_done(self) -> None:
        with self._cv:
            self._offered += 1
            self._pending.append((self._offered, [], []))
            self._cv.notify_all()

    def wait_published(self, timeout_s: float | None = None) -> bool:
        """Wait until every offer made before this call is published or dropped (S2)."""
        with self._cv:
            target = self._offered
            return self._cv.wait_for(lambda: self._done >= target or self._stop, timeout_s)

    def _publish_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._stop)
                if self._stop and not self._pending:
                    return
                batch, count, last = [], 0, 0
                while self._pending and (count < BATCH or not batch):
                    seq, keys, slots = self._pending.popleft()
                    batch.append((keys, slots))
                    count += len(keys)
                    last = seq
            try:
                self._publish([k for keys, _ in batch for k in keys], [s for _, slots in batch for s in slots])
            finally:
                with self._cv:
                    self._done = last
                    self._cv.notify_all()

    def _publish(self, keys: list[bytes], slots: list[int]) -> None:
        if not keys:
            return
        seen: set[bytes] = set()
        keep = [i for i, k in enumerate(keys) if k not in seen and not seen.add(k)]  # S6
        if len(keep) != len(keys):
            kept = set(keep)
            self._give(self._free_put, [slots[i] for i in range(len(keys)) if i not in kept])
            keys, slots = [keys[i] for i in keep], [slots[i] for i in keep]
        for k, s in zip(keys, slots):
            row = self._put_rows[s]
            if self.sealed:
                page = row[fmt.HEADER_BYTES : fmt.HEADER_BYTES + self.page_bytes]
                sealed = self.sealer.seal(page, fmt.sealed_aad(self.ns, k))
                row[fmt.HEADER_BYTES : fmt.HEADER_BYTES + self.payload_bytes] = np.frombuffer(sealed, dtype=np.uint8)
            fmt.write_header(row, k, self.payload_bytes, self.sealed)
        status, codes = self._on_slots(self.client.put_from, keys, slots, self._free_put)
        if status == LATE:
            self.counts["dropped_puts"] += len(keys)
            return
        self._give(self._free_put, slots)
        if status != OK:
            self.counts["dropped_puts"] += len(keys)
            return
        ok = sum(1 for c in codes if c == 0)
        full = sum(1 for c in codes if c == NO_SPACE)
        self.counts["puts"] += ok
        self.counts["put_bytes"] += ok * self.obj_bytes
        self.counts["dropped_full"] += full
        self.counts["dropped_puts"] += len(keys) - ok
        self._judge(codes)

    def _judge(self, codes: list[int]) -> None:
        if codes and all(unreachable(c) for c in codes):
            self.calls.fail()
        else:
            self.calls.succeed()

    # ------------------------------------------------------------------ fetching (S3, S5, S7)

    def fetch_prefix(self, keys: list[bytes], local: int) -> int:
        """The lookup-miss hook: fetch ``keys[local:]``'s leading run from the pool into the Db;
        returns how many leading keys the Db holds now."""
        self.counts["lookups"] += 1
        i = local
        while i < len(keys):
            chunk = self._not_absent(keys[i : i + BATCH])
            if not chunk:
                break
            got = self._fetch(chunk, prefix=True)
            i += got
            if got < BATCH:
                break
        return i

    def fetch_any(self, keys: list[bytes]) -> None:
        """Fetch whichever of ``keys`` the pool has (a read of keys the Db does not hold)."""
        keys = [k for k in dict.fromkeys(keys) if not self._is_absent(k)]
        for i in range(0, len(keys), BATCH):
            self._fetch(keys[i : i + BATCH], prefix=False)

    def _is_absent(self, key: bytes) -> bool:
        t = self._absent.get(key)
        if t is None:
            return False
        if self._clock() < t:
            return True
        self._absent.pop(key, None)
        return False

    def _mark_absent(self, key: bytes, now: float) -> None:
        """The pool lacks ``key`` until ``now + ABSENT_S``. Every entry lives ABSENT_S, so the
        dict's order is expiry order (a key marked again moves to the end): expired entries are
        dropped from the front, and the dict holds only the last ABSENT_S's misses."""
        a = self._absent
        a.pop(key, None)
        a[key] = now + ABSENT_S
        while a:
            first = next(iter(a))
            if a.get(first, now + 1) > now:
                break
            a.pop(first, None)

    def _not_absent(self, keys: list[bytes]) -> list[bytes]:
        for j, k in enumerate(keys):
            if self._is_absent(k):
                return keys[:j]
        return keys

    def _fetch(self, keys: list[bytes], prefix: bool) -> int:
        """Get ``keys`` (each once: S6) into reserved host-tier frames, check them (S5), commit
        the good ones (the leading run when ``prefix``) to the host tier (S3), release the rest;
        returns how many leading keys landed. A plain page lands with no copy: the Store writes
        the header into a staging slot and the payload into the frame. A sealed one lands in a
        staging row and is unsealed into the frame."""
        if self.calls.state != "closed":
            self.calls.run(lambda: None)  # lets a due probe start; refused while open
            return 0
        uniq = list(dict.fromkeys(keys))
        slots = self._take(self._free_get, len(uniq))
        if not slots:
            return 0
        uniq = uniq[: len(slots)]
        try:
            frames = self.db.reserve_frames(len(uniq))
        except CapacityError:
            self._give(self._free_get, slots)
            return 0
        frame_list = list(frames.frames)
        db, free = self.db, self._free_get

        def release() -> None:  # a late call's slots and frames, once it has returned
            self._give(free, slots)
            db.release_frames(frame_list)

        names = fmt.object_names(self.ns, uniq)
        base, row = self._get_rows.ctypes.data, self._get_row
        heads = [base + s * row for s in slots]
        client = self.client
        if self.sealed:
            sizes = [self.obj_bytes] * len(uniq)
            status, codes = self.calls.run(lambda: client.get_into(names, heads, sizes), on_late=release)
        else:
            arena, page = frames.arena, self.page_bytes
            ptrs = [[h, arena.data_ptr() + f * page] for h, f in zip(heads, frame_list)]
            sizes = [[fmt.HEADER_BYTES, page]] * len(uniq)
            status, codes = self.calls.run(lambda: client.get_into_parts(names, ptrs, sizes), on_late=release)
        if status == LATE:
            self.counts["misses"] += len(uniq)
            return 0
        committed = False
        try:
            if status != OK:
                self.counts["misses"] += len(uniq)
                return 0
            self._judge(codes)
            good: dict[bytes, int] = {}  # key -> its index in uniq
            now = self._clock()
            arena_np = frames.arena.numpy()  # the host tier: CPU memory
            for j, (k, s, c) in enumerate(zip(uniq, slots, codes)):
                if c == OBJECT_NOT_FOUND:
                    self._mark_absent(k, now)
                    continue
                if c < 0:
                    continue
                frame = arena_np[frame_list[j]]
                if self.sealed:
                    obj = self._get_rows[s]
                    why = fmt.check(obj[: fmt.HEADER_BYTES], obj[fmt.HEADER_BYTES :], k, self.payload_bytes, True, c)
                    if why is None:
                        why = self._unseal(k, obj, frame)
                else:
                    why = fmt.check(self._get_rows[s], frame, k, self.payload_bytes, False, c)
                if why is not None:
                    self.counts["corruptions"] += 1
                    continue
                good[k] = j
            run = []
            for k in keys:
                if k not in good:
                    if prefix:
                        break
                    continue
                run.append(k)
            run = list(dict.fromkeys(run))
            self.counts["misses"] += len(uniq) - len(good)
            committed = True
            landed = self._land(run, [frame_list[good[k]] for k in run], frame_list)
            if prefix:
                n = 0
                for k in keys:
                    if k not in landed:
                        break
                    n += 1
                return n
            return len(landed)
        finally:
            self._give(self._free_get, slots)
            if not committed:
                db.release_frames(frame_list)

    def _unseal(self, key: bytes, obj: np.ndarray, frame: np.ndarray) -> str | None:
        from kvdb.errors import CorruptionError

        body = obj[fmt.HEADER_BYTES : fmt.HEADER_BYTES + self.payload_bytes]
        try:
            page = self.sealer.open(body, fmt.sealed_aad(self.ns, key))
        except CorruptionError as e:
            return str(e)
        frame[: self.page_bytes] = np.frombuffer(page, dtype=np.uint8)
        return None

    def _land(self, keys: list[bytes], use: list[int], reserved: list[int]) -> set[bytes]:
        """Commit the checked frames ``use`` (one per key) into the Db's host tier (S3, durability
        "none"), release the other ``reserved`` frames; the keys that landed."""
        if not keys:
            self.db.release_frames(reserved)
            return set()
        keep = set(use)
        self.db.release_frames([f for f in reserved if f not in keep])
        self.db.commit_frames(keys, use, durability="none")
        self.counts["hits"] += len(keys)
        self.counts["get_bytes"] += len(keys) * self.obj_bytes
        return set(keys)

    # ------------------------------------------------------------------ removal, stats, close

    def remove(self, keys: list[bytes]) -> None:
        """Best-effort removal of deleted blocks (never ``force``: an object under another
        reader's lease stays until the lease ends, S6)."""
        if not keys or self.calls.state != "closed":
            return
        now = self._clock()
        for k in keys:
            self._mark_absent(k, now)
        names = fmt.object_names(self.ns, list(dict.fromkeys(keys)))
        client = self.client
        status, codes = self.calls.run(lambda: client.remove(names))
        if status == OK:
            self.counts["removes"] += sum(1 for c in codes if c == 0)

    def stats(self) -> dict:
        out = dict(self.counts)
        out.update({f"calls_{k}": v for k, v in self.calls.counts.items()})
        out["deadline_misses"] = self.calls.counts["late"]
        out["breaker"] = self.calls.state
        out["threads"] = self.calls.threads()
        out["master"] = self.cfg.master
        out["namespace"] = self.ns
        return out

    def close(self) -> None:
        self.wait_published(timeout_s=self.cfg.deadline_s * 4)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._publisher.join(self.cfg.deadline_s * 4)
        self.calls.close()
        client, self.client = self.client, None
        if client is not None and self.calls.state == "closed":  # a dead pool's close would stall
            client.close()


def _populated(nbytes: int):
    """Anonymous memory of ``nbytes`` (huge pages where the kernel gives them on request), every
    page faulted in now: staging is touched once at attach, never for the first time under a
    pool call (a first touch under a transfer halved its speed)."""
    import mmap

    mem = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    np.frombuffer(mem, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
    return mem
