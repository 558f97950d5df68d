"""Near matches: where a missed prompt's segments are stored, at which shift, after which context.

kvdb's hits are exact: a block key names the block's whole token prefix, so KV found by
``match_prefix`` is what the model would compute. A segment (a tool, a message) stored in
another prompt was computed *after another context* and, unless that context is identical and
the shift is 0, its KV differs from what this prompt would compute (on random weights greedy
output diverged within 0-2 tokens even with half the tokens recomputed). So ``near_match``
only *reports*: for each segment of the prompt past its exact prefix, whether that segment's
tokens are stored in some earlier prompt (by segment key), which blocks hold them, the shift
(this prompt's start - the stored start) and the stored context (the segments before it there,
how many of them this prompt shares). An engine that splices KV (CacheBlend, EPIC) may decide to
use it and recompute what it must; kvdb never counts it as a hit and never returns its KV as one.

The index is in memory, bounded: the last ``max_prompts`` noted prompts; per segment key the
newest ``per_key`` distinct stored places. Whether the blocks are still stored is checked at
query time (``match_prefix(peek=True)``: no stats, no recency).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from kvdb.errors import InvalidInput

__all__ = ["NearMatch", "SegmentIndex", "SegmentMatch", "near_match"]

EXACT, NEAR, ABSENT = "exact", "near", "absent"


class _Record:
    """One noted prompt: its segment keys, bounds and block keys."""

    __slots__ = ("keys", "starts", "ends", "blocks", "alive")

    def __init__(self, keys, starts, ends, blocks) -> None:
        self.keys: tuple[bytes, ...] = keys
        self.starts: tuple[int, ...] = starts
        self.ends: tuple[int, ...] = ends
        self.blocks: list[bytes] = blocks
        self.alive = True


@dataclass(frozen=True)
class SegmentMatch:
    """One segment of the asked prompt. ``status``: "exact" (inside the exact prefix), "near"
    (stored elsewhere: see the other fields) or "absent". For "near": ``shift`` = this start -
    ``stored_start``; ``block_keys`` hold it from token ``offset`` of the first; ``tokens_stored``
    of its tokens are there now; the stored copy came after ``context_segments`` segments, the
    first ``shared_context_segments`` of which this prompt has too (``same_context``: all, and
    as many as here)."""

    index: int
    kind: str
    label: str
    start: int
    end: int
    key: bytes
    status: str
    shift: int | None = None
    stored_start: int | None = None
    block_keys: tuple[bytes, ...] = ()
    offset: int | None = None
    tokens_stored: int = 0
    context_segments: int | None = None
    shared_context_segments: int | None = None
    same_context: bool = False

    def as_dict(self) -> dict:
        d = asdict(self)
        d["key"] = self.key.hex()
        d["block_keys"] = [k.hex() for k in self.block_keys]
        return d


@dataclass(frozen=True)
class NearMatch:
    """The exact prefix (``exact_blocks`` / ``exact_tokens``: what ``match_prefix`` finds) and,
    per segment, what is stored elsewhere. ``near_tokens`` sums ``tokens_stored`` over "near"
    segments: tokens an engine *might* splice, never hits."""

    tokens: int
    exact_blocks: int
    exact_tokens: int
    near_tokens: int
    segments: tuple[SegmentMatch, ...]

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "exact_blocks": self.exact_blocks, "exact_tokens": self.exact_tokens,
                "near_tokens": self.near_tokens, "segments": [s.as_dict() for s in self.segments]}


class SegmentIndex:
    """Segment key -> the places it is stored (prompt record, segment index), newest first.
    Not thread-safe: kvdb/prompts/book.py holds a lock around it."""

    def __init__(self, *, max_prompts: int = 4096, per_key: int = 4) -> None:
        for name, v in (("max_prompts", max_prompts), ("per_key", per_key)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidInput(f"{name} must be an int >= 1, got {v!r}")
        self.max_prompts = max_prompts
        self.per_key = per_key
        self._records: OrderedDict[int, _Record] = OrderedDict()
        self._by_key: dict[bytes, list[tuple[_Record, int]]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._records)

    def add(self, rendered, block_keys: Sequence[bytes], block_tokens: int) -> None:
        """Note where ``rendered``'s segments are stored: under ``block_keys`` (its full blocks)."""
        segs = rendered.segments
        rec = _Record(tuple(s.key for s in segs), tuple(s.start for s in segs), tuple(s.end for s in segs),
                      list(block_keys))
        self._records[self._next] = rec
        self._next += 1
        while len(self._records) > self.max_prompts:
            self._drop(self._records.popitem(last=False)[1])
        nb = len(rec.blocks)
        for j, key in enumerate(rec.keys):
            b0 = rec.starts[j] // block_tokens
            if b0 >= nb:
                break  # the rest of the prompt is in its partial last block: not stored
            place = (rec.blocks[b0], rec.starts[j] - b0 * block_tokens)
            occ = self._by_key.get(key)
            if occ is None:
                self._by_key[key] = [(rec, j)]
                continue
            # one entry per stored place (the first block's key names its whole prefix)
            occ[:] = [(r, i) for r, i in occ
                      if (r.blocks[r.starts[i] // block_tokens], r.starts[i] % block_tokens) != place]
            occ.insert(0, (rec, j))
            del occ[self.per_key:]

    def _drop(self, old: _Record) -> None:
        old.alive = False
        for key in set(old.keys):
            occ = self._by_key.get(key)
            if occ is not None:
                occ[:] = [o for o in occ if o[0] is not old]
                if not occ:
                    del self._by_key[key]

    def places(self, key: bytes) -> list[tuple[_Record, int]]:
        return [o for o in self._by_key.get(key, ()) if o[0].alive]


def _common(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def near_match(db, rendered, places_of, *, tenant: str, block_keys=None) -> NearMatch:
    """The near-match report of ``rendered`` (keyed for ``tenant``) over ``db``'s public API;
    ``places_of(keys)`` gives each segment key's stored places (a snapshot of the index);
    ``block_keys``: the keys its blocks are stored under (default ``db.block_keys`` of its tokens)."""
    bt = db.layout.block_tokens
    blocks = db.block_keys(rendered.array, tenant) if block_keys is None else block_keys
    n = db.match_prefix(blocks, peek=True)
    exact_tokens = n * bt
    seg_keys = [s.key for s in rendered.segments]
    places = places_of([s.key for s in rendered.segments if s.end > exact_tokens])
    out, near_tokens = [], 0
    for i, s in enumerate(rendered.segments):
        if s.end <= exact_tokens:
            out.append(SegmentMatch(i, s.kind, s.label, s.start, s.end, s.key, EXACT, tokens_stored=s.tokens))
            continue
        best, best_score = None, None
        for rec, j in places.get(s.key, ()):
            start, end = rec.starts[j], rec.ends[j]
            b0, b1 = start // bt, min(-(-end // bt), len(rec.blocks))
            held = rec.blocks[b0:b1]
            m = db.match_prefix(held, peek=True) if held else 0
            stored = min(end, (b0 + m) * bt) - start
            if stored <= 0:
                continue
            shared_ctx = _common(rec.keys[:j], seg_keys[:i])
            same = shared_ctx == j == i
            shift = s.start - start
            score = (stored, same, shared_ctx, -abs(shift))
            if best_score is None or score > best_score:
                best_score = score
                best = SegmentMatch(i, s.kind, s.label, s.start, s.end, s.key, NEAR, shift=shift, stored_start=start,
                                    block_keys=tuple(held[:m]), offset=start - b0 * bt,
                                    tokens_stored=stored, context_segments=j, shared_context_segments=shared_ctx,
                                    same_context=same)
        if best is None:
            out.append(SegmentMatch(i, s.kind, s.label, s.start, s.end, s.key, ABSENT))
        else:
            near_tokens += best.tokens_stored
            out.append(best)
    return NearMatch(len(rendered.token_ids), n, exact_tokens, near_tokens, tuple(out))
