"""The demo agents' tools: loaded per call, the prompt's head rendered with kvdb.prompts.

Every LLM call starts with the system prompt and the agent's tool list. Agents load their tools
the way MCP clients do, at each call: the servers return them in whatever order they like (a
seeded shuffle per call), and worker1's server adds a tool (``write_file``) from round
``DemoConfig.tool_change_round`` on (``notifications/tools/list_changed``). The head is rendered
by ``kvdb.prompts.render`` canonically (tools by name, JSON with sorted keys), so every order
gives the same tokens; the demo also renders it raw, as sent, and counts what that would have
cost (docs/prompts.md "Breaks"). The whole prompt is accounted, not only its head: each turn
of the agent's history after the head (its role, each input, each output) is one more segment
(``HeadRenderer.prompt``), so a break in the head counts every history token it cost.

Text is seeded words and ``encode`` maps each whitespace-separated word to a token id (the model
has random weights; only prefix sharing matters). The template is bare (no wrapper tokens), and
a tool's canonical JSON has no spaces outside its description, so the head is exactly
``system_tokens`` + ``schema_tokens`` tokens while the tool list is the first one.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from kvdb.demo.model import VOCAB
from kvdb.errors import InvalidInput
from kvdb.prompts import BreakBook, Rendered, from_params, render
from kvdb.types import KEY_BYTES

__all__ = ["HeadRenderer", "encode", "tools_for"]

TOOL_NAMES = ("browse", "read_file", "run_code", "search")
ADDED_TOOL = "write_file"  # sorts after the others: canonical order appends it
_BARE = {"system": "{text}", "tool": "{text}", "message": "{text}", "generation": ""}


@functools.lru_cache(maxsize=1 << 16)
def _word_id(word: str) -> int:
    return int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "little") % VOCAB


def encode(text: str) -> list[int]:
    """One token per whitespace-separated word (a stand-in for a tokenizer's ``encode``)."""
    return [_word_id(w) for w in text.split()]


def _words(name: str, n: int, seed: int) -> str:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return " ".join(f"{name[:1]}{t}" for t in torch.randint(0, 100_000, (n,), generator=g).tolist())


def _tool(name: str, words: int, seed: int) -> dict:
    # parameters before description and name: the order a server's map might produce
    return {"parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
            "name": name, "description": _words(f"tool:{name}", max(1, words), seed)}


def tools_for(cfg, node: str, agent: str, round_: int) -> list[dict]:
    """The tools ``agent`` loaded for ``node``, in the order its servers returned them."""
    n = len(TOOL_NAMES)
    per = [cfg.schema_tokens // n + (i < cfg.schema_tokens % n) for i in range(n)]
    tools = [_tool(name, w, cfg.seed) for name, w in zip(TOOL_NAMES, per)]
    if cfg.tool_change_round and round_ >= cfg.tool_change_round and agent == "worker1":
        tools.append(_tool(ADDED_TOOL, per[0], cfg.seed))
    digest = hashlib.sha256(f"{cfg.seed}:order:{node}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return [tools[i] for i in torch.randperm(len(tools), generator=g).tolist()]


class HeadRenderer:
    """Renders each call's head (canonical: what the model reads) and keeps the raw render's
    break accounting on the side (``raw``, a ``kvdb.prompts.BreakBook``)."""

    def __init__(self, cfg) -> None:
        self.system = _words("system", cfg.system_tokens, cfg.seed)
        self.raw = BreakBook()
        self.orders: set[tuple[str, ...]] = set()

    def head(self, tools: list[dict]) -> Rendered:
        return render({"system": self.system, "tools": tools}, encode=encode, template=_BARE)

    def prompt(self, head: Rendered, turns: list[list[int]]) -> Rendered:
        """``head`` then one "message" segment per turn of history (kvdb.prompts.wire's format)."""
        segs = [[x.kind, x.start, x.end, x.canon.hex(), x.label] for x in head.segments]
        ids, pos = list(head.token_ids), len(head)
        for t in turns:
            if t:
                canon = hashlib.sha256(b"demo-turn\0" + str(t).encode()).hexdigest()[: 2 * KEY_BYTES]
                segs.append(["message", pos, pos + len(t), canon, "turn"])
                ids += t
                pos += len(t)
        r, reason, detail = from_params(ids, {"segments": segs})
        if r is None:
            raise InvalidInput(f"demo prompt: {reason}: {detail}")
        return r

    def observe_raw(self, db, agent: str, tools: list[dict], turns: list[list[int]]) -> None:
        """Account the prompt with ``tools`` rendered as they arrived, in ``agent``'s raw session."""
        self.orders.add(tuple(t["name"] for t in tools))
        raw = render({"system": self.system, "tools": tools}, encode=encode, template=_BARE, canonical=False)
        self.raw.observe(agent, self.prompt(raw, turns).keyed(db, "demo"))
