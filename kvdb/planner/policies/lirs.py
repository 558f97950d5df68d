"""``lirs``: Low Inter-reference Recency Set (Jiang & Zhang, SIGMETRICS'02).

A block's IRR is the number of other distinct blocks touched between its last two references.
LIRS keeps the blocks of low IRR (LIR, at most ``lir_frames`` = c - ``hir_frames``) resident
and gives the rest of the cache (``hir_frames``, 1 % of c, the paper's choice) to resident HIR
blocks, which are the victims:

  S  the LIRS stack, bottom (oldest) first: LIR blocks, resident HIR blocks and non-resident
     HIR blocks (ghosts: ids of evicted blocks), ordered by recency. After every step the
     bottom is a LIR block ("stack pruning" drops the HIR entries below the oldest LIR);
  Q  resident HIR blocks in FIFO order, the next victim first.

Access to a LIR block: to S's top (then prune). To a resident HIR block: if it is in S its IRR
is below the oldest LIR's recency, so it becomes LIR and the bottom LIR becomes HIR (to Q's
end); if not, it goes to S's top and Q's end, still HIR. A new block whose id is a ghost in S
becomes LIR the same way; any other new block is HIR (S's top, Q's end) -- except while fewer
than ``lir_frames`` blocks are LIR (warm-up), when it is LIR. Eviction takes Q's front; if it
is still in S its entry stays there as a ghost. If Q holds no evictable frame, the oldest
evictable LIR block goes.

Non-resident HIR entries are bounded: at most ``ghost_factor`` x c of them (default 8, so S
holds at most 9c entries); beyond it the oldest ghost leaves S. The paper leaves S unbounded,
which lets one pass over a large working set grow it without limit. On the conversation trace
at 0.5 % capacity (docs/planner.md "Classic baselines") the block hit ratio is 0.0633 with 2 x c
ghosts and 0.0775 with 8 x c, the same as with no bound.

Each entry of S has a token (an increasing int) so that an evicted block's entry stays in
place as a ghost; stack pruning pops each entry once: O(1) amortized. Pinned frames stay in
S and Q and are passed over. Interface and R1-R4: kvdb/buffer_pool/replacer.py; the base:
kvdb/planner/policies/resident.py.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Hashable

from kvdb.errors import InvalidInput
from kvdb.planner.policies.resident import ResidentReplacer, share

HIR_SHARE = 0.01  # the paper's L_hirs: 1 % of the cache
_LIR, _HIR = 1, 2


class _Ghost:
    """A non-resident HIR entry of S."""

    __slots__ = ("bid",)

    def __init__(self, bid: Hashable) -> None:
        self.bid = bid


class LirsReplacer(ResidentReplacer):
    name = "lirs"

    def __init__(self, num_frames: int, capacity_frames: int | None = None, ghost_factor: float = 8.0) -> None:
        super().__init__(num_frames, capacity_frames)
        if not ghost_factor >= 0:
            raise InvalidInput(f"lirs's ghost_factor must be >= 0, got {ghost_factor!r}")
        c = self.capacity_frames
        self.hir_frames = share(c, HIR_SHARE) if c > 1 else 0
        self.lir_frames = c - self.hir_frames
        self.ghost_limit = int(ghost_factor * c)
        self._s: OrderedDict[int, int | _Ghost] = OrderedDict()  # token -> frame or ghost; first = bottom
        self._q: OrderedDict[int, None] = OrderedDict()  # resident HIR frames; first = next victim
        # ghost id -> its token in S, oldest first (an OrderedDict: a plain dict's first item
        # is found by skipping the deleted slots before it, O(n) between two resizes)
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()
        self._tok = array("q", [-1]) * num_frames  # a frame's token in S, -1 when not in S
        self._status = bytearray(num_frames)  # _LIR or _HIR for known frames
        self._next_tok = 0
        self._lir_count = 0

    # -- S --------------------------------------------------------------------------------
    def _push_top(self, f: int) -> None:
        t = self._tok[f]
        if t >= 0:
            self._s.move_to_end(t)
        else:
            t = self._next_tok
            self._next_tok += 1
            self._tok[f] = t
            self._s[t] = f

    def _drop_from_s(self, f: int) -> None:
        t = self._tok[f]
        if t >= 0:
            del self._s[t]
            self._tok[f] = -1

    def _prune(self) -> None:
        """Pop HIR entries (resident or ghosts) off the bottom until a LIR block is there."""
        s, status = self._s, self._status
        while s:
            t = next(iter(s))
            v = s[t]
            if isinstance(v, _Ghost):
                del self._ghosts[v.bid]
            elif status[v] == _LIR:
                return
            else:
                self._tok[v] = -1
            del s[t]

    def _demote_bottom_lir(self) -> None:
        """The LIR block at S's bottom becomes resident HIR (Q's end); then prune."""
        s = self._s
        t = next(iter(s))
        f = s.pop(t)
        self._tok[f] = -1
        self._status[f] = _HIR
        self._lir_count -= 1
        self._q[f] = None
        self._prune()

    def _make_lir(self, f: int) -> None:
        self._status[f] = _LIR
        self._lir_count += 1
        self._push_top(f)
        if self._lir_count > self.lir_frames:
            self._demote_bottom_lir()

    # -- hooks ------------------------------------------------------------------------------
    def _admit(self, f, bid) -> None:
        self._tok[f] = -1
        gt = self._ghosts.pop(bid, None) if bid is not None else None
        if gt is not None:  # a ghost hit: its reuse distance beat the oldest LIR's recency
            del self._s[gt]
            self._make_lir(f)
        elif self._lir_count < self.lir_frames:
            self._make_lir(f)
        else:
            self._status[f] = _HIR
            self._push_top(f)
            self._q[f] = None

    def _hit(self, f) -> None:
        if self._status[f] == _LIR:
            self._push_top(f)
            self._prune()
        elif self._tok[f] >= 0:  # resident HIR still in S: becomes LIR
            del self._q[f]
            self._make_lir(f)
        else:
            self._push_top(f)
            self._q.move_to_end(f)

    def _victim(self) -> int | None:
        f = self._first_unpinned(self._q)
        if f is not None:
            del self._q[f]
            t = self._tok[f]
            if t >= 0:
                self._tok[f] = -1
                bid = self._id_of[f]
                if bid is None or self.ghost_limit == 0:
                    del self._s[t]
                else:
                    self._add_ghost(t, bid)
            return f
        f = self._first_unpinned(v for v in self._s.values() if not isinstance(v, _Ghost))
        if f is None:
            return None
        self._drop_from_s(f)
        self._lir_count -= 1
        self._prune()
        return f

    def _add_ghost(self, t: int, bid: Hashable) -> None:
        old = self._ghosts.pop(bid, None)
        if old is not None:  # the same id evicted from two frames: keep the newer entry
            del self._s[old]
        self._s[t] = _Ghost(bid)
        self._ghosts[bid] = t
        if len(self._ghosts) > self.ghost_limit:
            del self._s[self._ghosts.popitem(last=False)[1]]

    def _forget(self, f) -> None:
        self._q.pop(f, None)
        self._drop_from_s(f)
        if self._status[f] == _LIR:
            self._lir_count -= 1
            self._prune()
        self._status[f] = 0

    def debug_stack(self) -> list[int | tuple]:
        """S from bottom to top: frames, and ghosts as ``(id,)`` (tests only)."""
        return [(v.bid,) if isinstance(v, _Ghost) else v for v in self._s.values()]

    def debug_queue(self) -> list[int]:
        return list(self._q)

    def debug_lir(self) -> list[int]:
        return [v for v in self._s.values() if not isinstance(v, _Ghost) and self._status[v] == _LIR]
