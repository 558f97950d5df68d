"""Cache-break resistance: canonical prompt rendering, segment keys, break accounting, near
matches (docs/prompts.md).

Modules: ``render`` (parts -> token ids and segments; canonical JSON, tool order, the default
template), ``breaks`` (per-session cache-break accounting, pure objects).
"""

from kvdb.prompts.breaks import BreakBook, CallBreaks, SessionBreaks
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

__all__ = ["BreakBook", "CallBreaks", "DEFAULT_TEMPLATE", "KINDS", "PromptSession", "Rendered", "Segment",
           "SessionBreaks", "Template", "canonical_text", "render"]
