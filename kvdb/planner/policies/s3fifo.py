"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO.

  S  small FIFO, 10 % of the cache: every new block enters here;
  M  main FIFO, the rest: blocks that proved themselves;
  G  ghost FIFO of block ids evicted from S, as many entries as M's share of the cache.

Each resident block has a 2-bit frequency (0..3), raised by a hit and never by a move. A new
block whose id is in G goes straight to M (the ghost is dropped); any other to S. To evict:
while S holds at least its 10 %, S's tail is examined -- accessed again since it entered
(freq >= 1, the paper's "accessed at least once" in S) it moves to M's head with its frequency
reset, else it is the victim and its id goes to G; otherwise (or when S runs out) M's tail is
examined -- freq > 0: reinserted at M's head with freq - 1, else the victim (no ghost).

Most one-hit wonders leave through S after one short stay; each move is O(1) and a block can
be reinserted into M at most 3 times per hit count, so eviction is O(1) amortized. Pinned frames
are passed over. Interface and R1-R4: kvdb/buffer_pool/replacer.py; the base:
kvdb/planner/policies/resident.py.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvdb.planner.policies.resident import ResidentReplacer, share

SMALL_SHARE = 0.10  # the paper's S size


class S3FifoReplacer(ResidentReplacer):
    name = "s3fifo"

    def __init__(self, num_frames: int, capacity_frames: int | None = None) -> None:
        super().__init__(num_frames, capacity_frames)
        self.small_frames = share(self.capacity_frames, SMALL_SHARE)
        self.ghost_limit = max(1, self.capacity_frames - self.small_frames)
        self._small: OrderedDict[int, None] = OrderedDict()  # first = tail (oldest)
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq = bytearray(num_frames)

    def _admit(self, f, bid) -> None:
        self._freq[f] = 0
        if bid is not None and bid in self._ghost:
            del self._ghost[bid]
            self._main[f] = None
        else:
            self._small[f] = None

    def _hit(self, f) -> None:
        if self._freq[f] < 3:
            self._freq[f] += 1

    def _victim(self) -> int | None:
        if len(self._small) >= self.small_frames or not self._main:
            f = self._evict_small()
            if f is not None:
                return f
        f = self._evict_main()
        if f is None:  # M's frames are all pinned: S's share does not matter then
            f = self._evict_small()
        return f

    def _evict_small(self) -> int | None:
        small, freq = self._small, self._freq
        while True:
            f = self._first_unpinned(small)
            if f is None:
                return None
            del small[f]
            if freq[f] >= 1:
                freq[f] = 0
                self._main[f] = None
                continue
            bid = self._id_of[f]
            if bid is not None:
                self._ghost[bid] = None
                self._ghost.move_to_end(bid)
                if len(self._ghost) > self.ghost_limit:
                    self._ghost.popitem(last=False)
            return f

    def _evict_main(self) -> int | None:
        main, freq = self._main, self._freq
        while True:
            f = self._first_unpinned(main)
            if f is None:
                return None
            if freq[f] > 0:
                freq[f] -= 1
                main.move_to_end(f)
                continue
            del main[f]
            return f

    def _forget(self, f) -> None:
        self._small.pop(f, None)
        self._main.pop(f, None)

    def debug_queues(self) -> tuple[list[int], list[int], list[Hashable]]:
        """(S, M, G), each from its tail (next out) to its head (tests only)."""
        return list(self._small), list(self._main), list(self._ghost)
