"""Cache-break resistance: canonical prompt rendering, segment keys, break accounting, near
matches (docs/prompts.md).

Modules: ``render`` (parts -> token ids and segments; canonical JSON, tool order, the default
template).
"""

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

__all__ = ["DEFAULT_TEMPLATE", "KINDS", "PromptSession", "Rendered", "Segment", "Template", "canonical_text", "render"]
