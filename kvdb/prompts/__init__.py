"""Cache-break resistance: canonical prompt rendering, segment keys, break accounting, near
matches (docs/prompts.md).

Modules: ``render`` (parts -> token ids and segments; canonical JSON, tool order, the default
template), ``breaks`` (per-session cache-break accounting, pure objects), ``near`` (where a
missed prompt's segments are stored: reports, never hits), ``book`` (what a Db keeps: both of
the above behind one lock), ``wire`` (segments as JSON for an engine in another process).
"""

from kvdb.prompts.book import PromptBook
from kvdb.prompts.breaks import BreakBook, CallBreaks, SessionBreaks
from kvdb.prompts.near import NearMatch, SegmentIndex, SegmentMatch
from kvdb.prompts.render import (
    DEFAULT_TEMPLATE,
    KINDS,
    PromptSession,
    Rendered,
    Segment,
    Template,
    canonical_text,
    render,
)
from kvdb.prompts.wire import from_params, transfer_params

__all__ = ["BreakBook", "CallBreaks", "DEFAULT_TEMPLATE", "KINDS", "NearMatch", "PromptBook", "PromptSession",
           "Rendered", "Segment", "SegmentIndex", "SegmentMatch", "SessionBreaks", "Template", "canonical_text", "from_params",
           "render", "transfer_params"]
