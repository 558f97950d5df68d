"""Prompt rendering: parts -> token ids and segments, canonical on request (docs/prompts.md).

    r = render({"system": "...", "tools": [schema, ...], "messages": [{"role": "user", "content": "..."}]},
               encode=tokenizer.encode, keys=db, tenant="acme")
    r.token_ids      # list[int]
    r.segments       # Segment(kind, start, end, key, ...) tiling token_ids
    db.block_keys(r.array, tenant="acme")

Segments
    One per piece: the system prompt, each tool, each message, then the generation prompt,
    each wrapped by the template and encoded *on its own* (``encode`` once per segment), so a
    segment's tokens do not depend on its neighbours and its key can be position-free. Segments
    tile ``token_ids`` in order: ``segments[i].end == segments[i + 1].start``.

Canonical mode (``canonical=True``, the default; it changes what the model reads: opt out with
``canonical=False`` to send the pieces exactly as given)
    * tools ordered by (name, content hash) or, with ``tool_order="first_seen"``, in the order
      the ``session`` first saw them (tools new in one call enter in (name, hash) order);
    * every JSON object (tool schemas, dict / list message contents) serialised with sorted keys,
      separators ``,`` and ``:``, no ASCII escaping, NaN and infinities refused;
    * text (the system prompt, string contents) with CR LF and CR turned into LF, spaces and tabs
      at line ends dropped, and leading / trailing blank lines dropped.
    Raw mode keeps the tools' order and the text as given and serialises JSON with ``json.dumps``
    defaults but ``ensure_ascii=False`` (insertion order, ``", "`` and ``": "``).

Keys
    With ``keys=`` (a Db or a KeySpace) each segment's ``key`` is its tenant-salted segment key
    (kvdb/keys.py "Segment keys"). Without it ``key`` is an unsalted digest of the same tokens,
    good within one process only; ``Db.note_prompt`` / ``Db.near_match`` re-key such a prompt.
    ``canon`` is a digest of the segment's canonical content (kind, role, canonical text): equal
    for two serialisations of the same tool or message; break accounting compares it, nothing
    looks it up.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from kvdb.errors import InvalidInput
from kvdb.keys import DEFAULT_TENANT, segment_key
from kvdb.types import KEY_BYTES

__all__ = ["DEFAULT_TEMPLATE", "KINDS", "PromptSession", "Rendered", "Segment", "Template", "render"]

KINDS = ("system", "tool", "message", "generation")
TOOL_ORDERS = ("name", "first_seen")
_PART_KEYS = ("system", "tools", "messages")
_MESSAGE_KEYS = frozenset(("role", "content"))

_TOK = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"
_TRAILING_WS = re.compile(r"[ \t]+(?=\n)|[ \t]+\Z")
_ROLE = re.compile(r"[A-Za-z0-9_.:-]{1,64}\Z")


_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_RAW_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


def _canonical_json(obj: Any) -> str:
    try:
        return _CANONICAL_JSON(obj)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"not serialisable as canonical JSON: {e}") from None


def _raw_json(obj: Any) -> str:
    try:
        return _RAW_JSON(obj)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"not serialisable as JSON: {e}") from None


def _is_mapping(x: Any) -> bool:
    return type(x) is dict or isinstance(x, Mapping)


def canonical_text(text: str) -> str:
    """Stable whitespace: LF line ends, no spaces or tabs at line ends, no blank edge lines."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _TRAILING_WS.sub("", text).strip("\n")


def _digest(*parts: bytes) -> bytes:
    return hashlib.sha256(b"\x00".join(parts)).digest()[:KEY_BYTES]


# ---------------------------------------------------------------------------------------- template


@dataclass(frozen=True)
class Template:
    """How each piece is wrapped; ``{text}`` marks the piece (once, required), ``{role}`` a
    message's role. ``generation`` ends every prompt (empty: no generation segment)."""

    system: str = "<|system|>\n{text}<|end|>\n"
    tool: str = "<|tool|>\n{text}<|end|>\n"
    message: str = "<|{role}|>\n{text}<|end|>\n"
    generation: str = "<|assistant|>\n"
    _split: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("system", "tool", "message"):
            v = getattr(self, name)
            if not isinstance(v, str) or v.count("{text}") != 1:
                raise InvalidInput(f"template {name!r} must be a string with exactly one {{text}}, got {v!r}")
            pre, post = v.split("{text}")
            if name != "message" and "{role}" in v:
                raise InvalidInput(f"template {name!r} has {{role}}; only 'message' has a role")
            if "{role}" in post:
                raise InvalidInput("template 'message' must put {role} before {text}")
            self._split[name] = (pre, post)
        if not isinstance(self.generation, str) or "{" in self.generation:
            raise InvalidInput(f"template 'generation' must be a plain string, got {self.generation!r}")

    @classmethod
    def of(cls, template: "Template | Mapping[str, str] | None") -> "Template":
        if template is None:
            return DEFAULT_TEMPLATE
        if isinstance(template, Template):
            return template
        if isinstance(template, Mapping):
            unknown = sorted(set(template) - {"system", "tool", "message", "generation"})
            if unknown:
                raise InvalidInput(f"unknown template keys {unknown}; known: system, tool, message, generation")
            return cls(**template)
        raise InvalidInput(f"template must be a Template, a mapping or None, got {type(template).__name__}")

    def wrap(self, kind: str, text: str, role: str = "") -> str:
        pre, post = self._split[kind]
        if role:
            pre = pre.replace("{role}", role)
        return pre + text + post


DEFAULT_TEMPLATE = Template()


# ---------------------------------------------------------------------------------------- results


class Segment(NamedTuple):
    """Tokens ``[start, end)`` of one piece. ``key``: the position-free content key (tenant
    salted when rendered with ``keys=``); ``canon``: the digest of its canonical content;
    ``label``: the tool's name or the message's role ("" otherwise)."""

    kind: str
    start: int
    end: int
    key: bytes
    canon: bytes
    label: str = ""

    @property
    def tokens(self) -> int:
        return self.end - self.start


class Rendered:
    """A rendered prompt: ``token_ids``, ``segments``, ``text`` (what was encoded, segment after
    segment), ``array`` (the ids as uint32, for ``db.block_keys``), and the ``tenant`` and
    ``namespace`` its keys are salted with (both None when unsalted)."""

    __slots__ = ("token_ids", "segments", "text", "tenant", "namespace", "canonical", "_raw")

    def __init__(self, token_ids: list[int], segments: tuple[Segment, ...], text: str, raw: bytes,
                 tenant: str | None, namespace: bytes | None, canonical: bool) -> None:
        self.token_ids = token_ids
        self.segments = segments
        self.text = text
        self.tenant = tenant
        self.namespace = namespace
        self.canonical = canonical
        self._raw = raw

    @property
    def array(self) -> np.ndarray:
        return np.frombuffer(self._raw, dtype="<u4")

    def __len__(self) -> int:
        return len(self.token_ids)

    def keyed(self, keyspace, tenant: str = DEFAULT_TENANT) -> "Rendered":
        """This prompt with its segment keys salted for ``tenant`` in ``keyspace`` (itself when
        they already are)."""
        ks = getattr(keyspace, "keyspace", keyspace)
        ns = ks.namespace(tenant)
        if self.namespace == ns:
            return self
        raw = memoryview(self._raw)
        segs = tuple(Segment(s.kind, s.start, s.end, segment_key(ns, bytes(raw[4 * s.start: 4 * s.end])), s.canon,
                             s.label) for s in self.segments)
        return Rendered(self.token_ids, segs, self.text, self._raw, tenant, ns, self.canonical)

    def __repr__(self) -> str:
        kinds = {k: sum(1 for s in self.segments if s.kind == k) for k in KINDS}
        return (f"Rendered({len(self.token_ids)} tokens, {len(self.segments)} segments "
                f"{ {k: v for k, v in kinds.items() if v} }, canonical={self.canonical}, tenant={self.tenant!r})")


class PromptSession:
    """What one agent session remembers across its calls: the rank of every tool (by name and
    content hash) in the order the session first saw it (``tool_order="first_seen"``), and the
    token ids of its last ``max_cached_segments`` segment texts, so that a piece it has sent
    before (a tool, the history) is not encoded again. A segment is encoded on its own, so its
    text decides its tokens: the cache is exact for a deterministic ``encode`` (a tokenizer's);
    it is emptied when ``render`` is given another ``encode`` (pass the same callable; 0 turns
    it off)."""

    __slots__ = ("_ranks", "_cache", "_encode", "max_cached_segments")

    def __init__(self, *, max_cached_segments: int = 512) -> None:
        if not isinstance(max_cached_segments, int) or isinstance(max_cached_segments, bool) or max_cached_segments < 0:
            raise InvalidInput(f"max_cached_segments must be an int >= 0, got {max_cached_segments!r}")
        self.max_cached_segments = max_cached_segments
        self._ranks: dict[tuple[str, bytes], int] = {}
        self._cache: dict[str, tuple[list[int], bytes]] = {}
        self._encode: Callable | None = None

    def order(self, idents: Sequence[tuple[str, bytes]]) -> list[int]:
        """Indices of ``idents`` in first-seen order; unseen ones are ranked now, in (name, hash) order."""
        ranks = self._ranks
        new = sorted({i for i in idents if i not in ranks})
        for i in new:
            ranks[i] = len(ranks)
        return sorted(range(len(idents)), key=lambda j: (ranks[idents[j]], j))

    def encoded(self, encode: Callable) -> dict[str, tuple[list[int], bytes]] | None:
        """The cache of segment text -> (ids, uint32 LE bytes) for ``encode`` (None when off)."""
        if not self.max_cached_segments:
            return None
        if self._encode is None or self._encode != encode:
            self._cache.clear()
            self._encode = encode
        return self._cache

    def __len__(self) -> int:
        return len(self._ranks)


# ---------------------------------------------------------------------------------------- render


def _tool_name(tool: Any, i: int) -> str:
    if not _is_mapping(tool):
        raise InvalidInput(f"tools[{i}] must be a JSON object (dict), got {type(tool).__name__}")
    name = tool.get("name")
    if name is None and _is_mapping(tool.get("function")):  # OpenAI style {"type": "function", "function": {...}}
        name = tool["function"].get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"tools[{i}] needs a non-empty string 'name' (or 'function': {{'name': ...}})")
    return name


def _check_parts(parts: Any) -> tuple[str | None, Sequence, Sequence]:
    if not isinstance(parts, Mapping):
        raise InvalidInput(f"parts must be a mapping with system / tools / messages, got {type(parts).__name__}")
    unknown = sorted(set(parts) - set(_PART_KEYS))
    if unknown:
        raise InvalidInput(f"unknown prompt parts {unknown}; known: {list(_PART_KEYS)}")
    system = parts.get("system")
    if system is not None and not isinstance(system, str):
        raise InvalidInput(f"parts['system'] must be a string, got {type(system).__name__}")
    tools = parts.get("tools") or ()
    messages = parts.get("messages") or ()
    for name, v in (("tools", tools), ("messages", messages)):
        if not isinstance(v, (list, tuple)):
            raise InvalidInput(f"parts[{name!r}] must be a list, got {type(v).__name__}")
    return system, tools, messages


def render(parts: Mapping[str, Any], *, encode: Callable[[str], Sequence[int]], canonical: bool = True,
           tool_order: str = "name", template: Template | Mapping[str, str] | None = None,
           session: PromptSession | None = None, keys=None, tenant: str = DEFAULT_TENANT) -> Rendered:
    """Render ``parts`` = {"system": str, "tools": [dict, ...], "messages": [{"role", "content"}, ...]}
    into token ids and segments (see the module docstring). ``encode``: any ``str -> list[int]``;
    ``keys``: a Db or KeySpace to salt segment keys for ``tenant``."""
    if not callable(encode):
        raise InvalidInput(f"encode must be a callable str -> list[int], got {type(encode).__name__}")
    if not isinstance(canonical, bool):
        raise InvalidInput(f"canonical must be a bool, got {canonical!r}")
    if tool_order not in TOOL_ORDERS:
        raise InvalidInput(f"tool_order must be one of {TOOL_ORDERS}, got {tool_order!r}")
    if tool_order == "first_seen":
        if not canonical:
            raise InvalidInput("tool_order='first_seen' is a canonical ordering: pass canonical=True")
        if not isinstance(session, PromptSession):
            raise InvalidInput("tool_order='first_seen' needs session=PromptSession() (it remembers the order)")
    elif session is not None and not isinstance(session, PromptSession):
        raise InvalidInput(f"session must be a PromptSession, got {type(session).__name__}")
    tpl = Template.of(template)
    system, tools, messages = _check_parts(parts)
    if keys is not None:
        ks = getattr(keys, "keyspace", keys)
        if not hasattr(ks, "namespace"):
            raise InvalidInput(f"keys must be a Db or a KeySpace, got {type(keys).__name__}")
        ns = ks.namespace(tenant)
    else:
        ns = None

    # the pieces: (kind, label, body text, canon)
    pieces: list[tuple[str, str, str, bytes]] = []
    if system:
        ct = canonical_text(system)
        pieces.append(("system", "", ct if canonical else system, _digest(b"system", ct.encode())))
    if tools:
        tl = []
        for i, tool in enumerate(tools):
            name = _tool_name(tool, i)
            cj = _canonical_json(tool)
            tl.append((name, cj, _digest(b"tool", cj.encode()), tool))
        if canonical:
            if tool_order == "name":
                tl.sort(key=lambda t: (t[0], t[2]))
            else:
                tl = [tl[j] for j in session.order([(t[0], t[2]) for t in tl])]  # type: ignore[union-attr]
            pieces.extend(("tool", name, cj, canon) for name, cj, canon, _ in tl)
        else:
            pieces.extend(("tool", name, _raw_json(tool), canon) for name, _, canon, tool in tl)
    for i, m in enumerate(messages):
        if not _is_mapping(m):
            raise InvalidInput(f"messages[{i}] must be a mapping with role and content, got {type(m).__name__}")
        if m.keys() != _MESSAGE_KEYS:
            extra = sorted(set(m) - _MESSAGE_KEYS)
            raise InvalidInput(f"messages[{i}] must have exactly 'role' and 'content'"
                               + (f"; unknown keys {extra}" if extra else f"; missing {sorted(_MESSAGE_KEYS - set(m))}"))
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or not _ROLE.match(role):
            raise InvalidInput(f"messages[{i}]['role'] must be 1-64 characters of [A-Za-z0-9_.:-], got {role!r}")
        if isinstance(content, str):
            ct = canonical_text(content)
            pieces.append(("message", role, ct if canonical else content,
                           _digest(b"message", role.encode(), b"text", ct.encode())))
        elif isinstance(content, (dict, list)):
            cj = _canonical_json(content)
            pieces.append(("message", role, cj if canonical else _raw_json(content),
                           _digest(b"message", role.encode(), b"json", cj.encode())))
        else:
            raise InvalidInput(f"messages[{i}]['content'] must be a str, dict or list, got {type(content).__name__}")

    texts = [tpl.wrap(kind, body, label if kind == "message" else "") for kind, label, body, _ in pieces]
    if tpl.generation:
        pieces.append(("generation", "", "", _digest(b"generation", tpl.generation.encode())))
        texts.append(tpl.generation)

    token_ids: list[int] = []
    chunks: list[bytes] = []
    segments = []
    pos = 0
    cache = session.encoded(encode) if session is not None else None
    for (kind, label, _, canon), text in zip(pieces, texts):
        hit = cache.pop(text, None) if cache is not None else None
        if hit is None:
            ids = encode(text)
            try:
                arr = array(_TOK, ids)
            except (TypeError, OverflowError) as e:
                raise InvalidInput(f"encode must return token ids in uint32 range, got {type(ids).__name__} ({e})") from None
            if type(ids) is not list:
                ids = arr.tolist()
            if _SWAP:
                arr.byteswap()
            hit = (ids, arr.tobytes())
        if cache is not None:  # most recently used last; the oldest goes past the bound
            cache[text] = hit
            if len(cache) > session.max_cached_segments:  # type: ignore[union-attr]
                del cache[next(iter(cache))]
        ids, raw = hit
        token_ids.extend(ids)
        chunks.append(raw)
        end = pos + len(ids)
        key = segment_key(ns, raw) if ns is not None else _digest(b"kvdb-segment-unsalted", raw)
        segments.append(Segment(kind, pos, end, key, canon, label))
        pos = end
    return Rendered(token_ids, tuple(segments), "".join(texts), b"".join(chunks),
                    tenant if ns is not None else None, ns, canonical)
