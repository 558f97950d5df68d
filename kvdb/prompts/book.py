"""What a Db keeps about rendered prompts: break accounting per session and the segment index
behind ``near_match``. The Db holds one ``PromptBook`` and forwards to it (``note_prompt``,
``near_match``, ``stats()["prompts"]``, ``explain(session_id=)["prompts"]``, the end of a
session); everything it asks of the Db goes through the Db's public API.

The book has its own lock and never calls the Db while holding it (the Db calls ``end`` under
the Db's lock; ``near_match`` snapshots the index, then asks the Db).
"""

from __future__ import annotations

import threading

from kvdb.errors import InvalidInput
from kvdb.keys import normalize_keys
from kvdb.prompts.breaks import BreakBook, CallBreaks
from kvdb.prompts.near import NearMatch, SegmentIndex, near_match
from kvdb.prompts.render import Rendered

__all__ = ["PromptBook"]


class PromptBook:
    def __init__(self, *, max_sessions: int = 65536, history: int = 16, max_prompts: int = 4096,
                 per_key: int = 4) -> None:
        self._lock = threading.Lock()
        self._breaks = BreakBook(max_sessions=max_sessions, history=history)
        self._index = SegmentIndex(max_prompts=max_prompts, per_key=per_key)
        self._near_calls = 0
        self._near_tokens = 0

    @staticmethod
    def _keyed(db, rendered, tenant: str) -> Rendered:
        if not isinstance(rendered, Rendered):
            raise InvalidInput(f"expected a rendered prompt (kvdb.prompts.render), got {type(rendered).__name__}")
        return rendered.keyed(db.keyspace, tenant)

    def note(self, db, rendered, session_id: str | None, tenant: str, block_keys=None) -> CallBreaks | None:
        """Index ``rendered``'s segments (stored under ``block_keys``, default its block keys)
        and, with ``session_id``, account its breaks; returns the call's CallBreaks (or None)."""
        r = self._keyed(db, rendered, tenant)
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise InvalidInput(f"session_id must be a non-empty string or None, got {session_id!r}")
        blocks = db.block_keys(r.array, tenant) if block_keys is None else normalize_keys(block_keys)
        with self._lock:
            self._index.add(r, blocks, db.layout.block_tokens)
            return None if session_id is None else self._breaks.observe(session_id, r)

    def near_match(self, db, rendered, tenant: str, block_keys=None) -> NearMatch:
        r = self._keyed(db, rendered, tenant)
        blocks = None if block_keys is None else normalize_keys(block_keys)

        def places_of(keys):
            with self._lock:
                return {k: self._index.places(k) for k in keys}

        res = near_match(db, r, places_of, tenant=tenant, block_keys=blocks)
        with self._lock:
            self._near_calls += 1
            self._near_tokens += res.near_tokens
        return res

    def end(self, session_id: str) -> None:
        with self._lock:
            self._breaks.end(session_id)

    def session(self, session_id: str) -> dict | None:
        with self._lock:
            return self._breaks.session(session_id)

    def stats(self) -> dict:
        with self._lock:
            out = self._breaks.stats()
            out["indexed_prompts"] = len(self._index)
            out["near_match_calls"] = self._near_calls
            out["near_tokens"] = self._near_tokens
            return out
