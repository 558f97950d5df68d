"""``2q``: the full version of 2Q (Johnson & Shasha, VLDB'94): A1in FIFO, A1out ghosts, Am LRU.

  A1in   FIFO of blocks seen once, Kin = 25 % of the cache;
  A1out  FIFO of the *ids* of blocks paged out of A1in, Kout = 50 % of the cache;
  Am     LRU of blocks re-referenced after they left A1in.

A hit in Am moves the block to Am's recent end; a hit in A1in does nothing (correlated
references inside one burst prove nothing). A new block whose id is in A1out was referenced
again after a full stay in A1in: it goes to Am; any other new block goes to A1in. To evict
("reclaimfor"): when A1in holds more than Kin, its oldest block goes and its id enters A1out
(A1out trims its oldest beyond Kout); otherwise Am's least recent block goes, leaving no ghost.
All O(1). Pinned frames are passed over. Interface and R1-R4: kvdb/buffer_pool/replacer.py; the
base: kvdb/planner/policies/resident.py.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvdb.planner.policies.resident import ResidentReplacer, share

KIN_SHARE = 0.25  # the paper's recommended A1in size
KOUT_SHARE = 0.50  # and A1out's


class TwoQReplacer(ResidentReplacer):
    name = "2q"

    def __init__(self, num_frames: int, capacity_frames: int | None = None) -> None:
        super().__init__(num_frames, capacity_frames)
        self.kin_frames = share(self.capacity_frames, KIN_SHARE)
        self.kout_ids = share(self.capacity_frames, KOUT_SHARE)
        self._a1in: OrderedDict[int, None] = OrderedDict()  # first = oldest
        self._a1out: OrderedDict[Hashable, None] = OrderedDict()
        self._am: OrderedDict[int, None] = OrderedDict()  # first = least recent

    def _admit(self, f, bid) -> None:
        if bid is not None and bid in self._a1out:
            del self._a1out[bid]
            self._am[f] = None
        else:
            self._a1in[f] = None

    def _hit(self, f) -> None:
        if f in self._am:
            self._am.move_to_end(f)

    def _victim(self) -> int | None:
        if len(self._a1in) > self.kin_frames or not self._am:
            f = self._first_unpinned(self._a1in)
            if f is not None:
                return self._page_out_a1in(f)
        f = self._first_unpinned(self._am)
        if f is not None:
            del self._am[f]
            return f
        f = self._first_unpinned(self._a1in)
        return None if f is None else self._page_out_a1in(f)

    def _page_out_a1in(self, f: int) -> int:
        del self._a1in[f]
        bid = self._id_of[f]
        if bid is not None:
            self._a1out[bid] = None
            self._a1out.move_to_end(bid)
            if len(self._a1out) > self.kout_ids:
                self._a1out.popitem(last=False)
        return f

    def _forget(self, f) -> None:
        self._a1in.pop(f, None)
        self._am.pop(f, None)

    def debug_queues(self) -> tuple[list[int], list[Hashable], list[int]]:
        """(A1in, A1out, Am), each from the next out to the most recent (tests only)."""
        return list(self._a1in), list(self._a1out), list(self._am)
