"""Zero-copy landing: blocks written straight into reserved host-arena frames (pool invariant P6),
then committed in place through the Db's one write path (kvdb/db/write.py). Used by
replication pushes.

Part of the class ``kvdb.db.core.Db`` (a mixin; its state and lock are the Db's).
"""

from __future__ import annotations

from typing import Sequence

from kvdb.buffer_pool.replacer import AccessContext
from kvdb.db.handles import ReservedFrames
from kvdb.errors import InvalidInput
from kvdb.keys import normalize_keys


class LandingMixin:
    def reserve_frames(self, n: int) -> ReservedFrames:
        """Lend ``n`` host-tier frames to be written in place (pool invariant P6): free frames
        first, then pages evicted as a put would evict them. All or nothing: CapacityError
        (nothing evicted) when fewer than ``n`` frames are free or evictable. Every reservation
        ends in ``commit_frames`` or ``release_frames``."""
        self._check_writable()
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidInput(f"reserve_frames needs a count >= 0, got {n!r}")
        with self._lock:
            self._check()
            return ReservedFrames(self.pool.host_arena(), self.pool.reserve_host_frames(n))

    @staticmethod
    def _frame_list(frames) -> list[int]:
        if isinstance(frames, ReservedFrames):
            return list(frames.frames)
        try:
            out = [int(f) for f in frames]
        except (TypeError, ValueError):
            raise InvalidInput("frames must be a ReservedFrames or a sequence of frame numbers") from None
        return out

    def release_frames(self, frames) -> None:
        """Hand reserved frames back unread (e.g. their bytes failed a check): nothing becomes
        visible and the frames are free again."""
        self._check()
        fl = self._frame_list(frames)
        with self._lock:
            self._check()
            self.pool.release_host_frames(fl)

    def commit_frames(self, keys, frames, *, positions: Sequence[int] | None = None,
                      durability: str | None = None, ctx: AccessContext | None = None) -> int:
        """Store the bytes written into reserved ``frames`` under ``keys`` without copying them:
        frame i becomes the host-tier page of keys[i]. Same rules as ``put_blocks`` -- keys
        already stored (in memory or on disk) are skipped, "group"/"sync" write the pages to the
        disk tier before returning -- and returns how many were new. The reservation is used up
        whatever happens: frames not committed (skipped keys, duplicates, an error on the way)
        are released. InvalidInput, with nothing changed, for frames not reserved."""
        self._check_writable()
        fl = self._frame_list(frames)
        with self._lock:
            self._check()
            self.pool.check_reserved(fl)
        try:
            keys = normalize_keys(keys)
            n = len(keys)
            if len(fl) != n:
                raise InvalidInput(f"{n} keys for {len(fl)} reserved frames")
            pos = self._check_positions(positions, n)
            durability = self._check_durability(durability)
            arena = self.pool.host_arena()

            def place(rows: list[int], dirty: bool) -> None:
                if rows:
                    rpos = [pos[i] for i in rows]
                    self.pool.commit_host_frames([keys[i] for i in rows], [fl[i] for i in rows], rpos, dirty=dirty,
                                                 ctx=ctx or AccessContext(positions=rpos))
                committed = {fl[i] for i in rows}
                self.pool.release_host_frames([f for f in fl if f not in committed])

            return self._store(keys, pos, lambda rows: self._select(arena, [fl[i] for i in rows]), durability, place)
        except BaseException:
            with self._lock:
                if self._state != "closed":
                    self.pool.release_host_frames(self.pool.still_reserved(fl))
            raise
