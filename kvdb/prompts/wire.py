"""A rendered prompt's segments as JSON, for an engine in another process (vLLM's
``kv_transfer_params["prompt"]``, kvdb/integrations/vllm/): ``transfer_params`` writes them,
``from_params`` reads them back against the token ids the engine got.

    {"segments": [[kind, start, end, canon, label], ...]}

One entry per segment, in order: ``kind`` one of ``KINDS``; ``[start, end)`` its tokens, the
entries tiling ``[0, len(token_ids))``; ``canon`` the hex digest of its canonical content
(32 hex digits, what break accounting compares); ``label`` the tool's name or message's role.
Segment keys are not sent: they are recomputed from the tokens, salted for the request's
tenant (``Rendered.keyed``), so a client cannot name another tenant's segments.

Worked example: a system prompt of 12 tokens then the generation prompt of 4 ->
``{"segments": [["system", 0, 12, "9f..(32)", ""], ["generation", 12, 16, "3a..(32)", ""]]}``.

``from_params`` never raises on bad input: it returns ``(None, reason, detail)`` with a short
stable ``reason`` (one of ``REASONS``) that a caller counts.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Sequence

from kvdb.prompts.render import KINDS, Rendered, Segment
from kvdb.types import KEY_BYTES

__all__ = ["MAX_SEGMENTS", "REASONS", "from_params", "transfer_params"]

MAX_SEGMENTS = 1 << 16
MAX_LABEL_CHARS = 256
# why segments were ignored; "refused": they parsed, but the Db refused them (its error says why)
REASONS = ("not_an_object", "no_tokens", "bad_segments", "too_many_segments", "bad_segment", "not_tiling", "refused")
_TOK = "I" if array("I").itemsize == 4 else "L"


def transfer_params(rendered: Rendered) -> dict:
    """``rendered``'s segments as a JSON-ready dict (the module docstring's format)."""
    return {"segments": [[s.kind, s.start, s.end, s.canon.hex(), s.label] for s in rendered.segments]}


def _int(x: Any) -> bool:
    return type(x) is int


def from_params(token_ids: Sequence[int] | None, params: Any) -> tuple[Rendered | None, str, str]:
    """The prompt ``params`` describes over ``token_ids`` (unsalted keys: key it with
    ``Rendered.keyed``), or ``(None, reason, detail)``."""
    if not isinstance(params, dict):
        return None, "not_an_object", f"expected a JSON object, got {type(params).__name__}"
    if token_ids is None or len(token_ids) == 0:
        return None, "no_tokens", "the request has no prompt token ids"
    segs = params.get("segments")
    if not isinstance(segs, list) or not segs:
        return None, "bad_segments", "'segments' must be a non-empty list"
    if len(segs) > MAX_SEGMENTS:
        return None, "too_many_segments", f"{len(segs)} segments, at most {MAX_SEGMENTS}"
    n = len(token_ids)
    out, pos = [], 0
    for i, e in enumerate(segs):
        if not (isinstance(e, list) and len(e) == 5):
            return None, "bad_segment", f"segments[{i}] must be [kind, start, end, canon, label]"
        kind, start, end, canon, label = e
        if kind not in KINDS or not _int(start) or not _int(end) or not isinstance(label, str) \
                or len(label) > MAX_LABEL_CHARS or not isinstance(canon, str) or len(canon) != 2 * KEY_BYTES:
            return None, "bad_segment", f"segments[{i}] = {str(e)[:200]} is not [kind, start, end, canon, label]"
        try:
            digest = bytes.fromhex(canon)
        except ValueError:
            return None, "bad_segment", f"segments[{i}]: canon {canon[:40]!r} is not hex"
        if start != pos or end <= start or end > n:
            return None, "not_tiling", f"segments[{i}] = [{start}, {end}) does not follow {pos} within {n} tokens"
        out.append(Segment(kind, start, end, b"", digest, label))
        pos = end
    if pos != n:
        return None, "not_tiling", f"the segments cover {pos} of the prompt's {n} tokens"
    try:
        arr = array(_TOK, token_ids)
    except (TypeError, OverflowError) as e:
        return None, "no_tokens", f"token ids out of uint32 range ({e})"
    ids = token_ids if type(token_ids) is list else arr.tolist()
    if sys.byteorder != "little":
        arr.byteswap()
    return Rendered(ids, tuple(out), "", arr.tobytes(), None, None, True), "", ""
