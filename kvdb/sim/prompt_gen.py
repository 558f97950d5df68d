"""Seeded MCP-like prompt workload (``kvdb gen --prompts``), in the kvdb prompt trace v1.

Tools come from ``servers`` MCP servers, ``tools_per_server`` each (JSON schemas: name,
description, inputSchema with typed, described properties and a required list); every session
of a tenant has the same system prompt. A session makes ``calls`` LLM calls; each call's prompt
is {system, tools, messages}: the user's task, then per earlier call the assistant's tool call
(a dict) and the tool's result (a dict). Text is drawn from a fixed pseudo-word vocabulary
(Zipf weights), the same for every seed, like a language.

Noise, drawn per call from its own random stream so that the same seed gives the same content
at every noise level:

``tool_order_churn``  probability that the servers return their lists in a new order this call
                      (server order and each server's order shuffled; kept until the next churn)
``json_key_noise``    probability that the client serialises this call with a random key order
                      in every JSON object (a map-ordered path); otherwise insertion order
``tool_list_change``  probability that a server's list changes this call
                      (``notifications/tools/list_changed``): a reserve tool added at a random
                      place in its server's list, or a tool removed, half and half; it lasts

The first two change only how a prompt is serialised; the third changes what it holds, so a
trace with ``tool_order_churn = json_key_noise = 0`` and the same ``tool_list_change`` is the
*clean* version of a noisy one (``clean(params)``).

Lines: a header ``{"type": "prompt_trace", "version": 1, "params": {...}}``, then per call
``{"type": "prompt", "session_id", "call", "tenant"?, "tools_changed", "parts"}`` in session
order; key order inside ``parts`` is the serialisation the client used.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any, Iterator

from kvdb.errors import InvalidInput
from kvdb.sim.generator import merge_params

DEFAULTS: dict[str, Any] = {
    "seed": 7,
    "sessions": 10,
    "calls": 20,
    "tenants": 1,
    "servers": 4,
    "tools_per_server": 5,
    "reserve_tools_per_server": 3,
    "system_words": [120, 180],
    "description_words": [10, 24],
    "properties": [1, 4],
    "property_words": [3, 10],
    "task_words": [40, 80],
    "result_words": [15, 90],
    "tool_order_churn": 0.0,
    "json_key_noise": 0.0,
    "tool_list_change": 0.0,
}
NOISE = ("tool_order_churn", "json_key_noise", "tool_list_change")
_RANGES = ("system_words", "description_words", "properties", "property_words", "task_words", "result_words")
_TYPES = ("string", "integer", "boolean", "number")

_SYLLABLES = [c + v for c in ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
                              "st", "tr", "ch", "sh") for v in ("a", "e", "i", "o", "u", "ar", "en", "on")]


def _vocabulary(n: int = 3000) -> tuple[list[str], list[float]]:
    rng = random.Random("kvdb-prompt-words-v1")
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))] = None
    out = list(words)
    return out, list(itertools.accumulate(1.0 / (r + 5) for r in range(len(out))))


_WORDS, _CUM = _vocabulary()


def load_params(path: str | None = None, **overrides: Any) -> dict[str, Any]:
    p = merge_params(DEFAULTS, path, overrides, "prompt workload parameters")
    for k in _RANGES:
        v = p[k]
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) and 0 <= v[0] <= v[1]):
            raise InvalidInput(f"prompt workload parameter {k!r} must be [min, max] integers, got {v!r}")
    for k in ("seed", "sessions", "calls", "tenants", "servers", "tools_per_server", "reserve_tools_per_server"):
        if not isinstance(p[k], int) or isinstance(p[k], bool) or p[k] < 0:
            raise InvalidInput(f"prompt workload parameter {k!r} must be an integer >= 0, got {p[k]!r}")
    for k in ("calls", "tenants", "servers", "tools_per_server"):
        if p[k] < 1:
            raise InvalidInput(f"prompt workload parameter {k!r} must be at least 1")
    for k in NOISE:
        v = p[k]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not 0 <= v <= 1:
            raise InvalidInput(f"prompt workload parameter {k!r} must be a probability in [0, 1], got {v!r}")
    return p


def clean(params: dict[str, Any]) -> dict[str, Any]:
    """The same workload without serialisation noise (tool-list changes are content: kept)."""
    return dict(params, tool_order_churn=0.0, json_key_noise=0.0)


def _words(rng: random.Random, lo_hi) -> str:
    return " ".join(rng.choices(_WORDS, cum_weights=_CUM, k=rng.randint(*lo_hi)))


def _sentence(rng: random.Random, lo_hi) -> str:
    return _words(rng, lo_hi).capitalize() + "."


def _tool(rng: random.Random, server: str, used: set, p: dict) -> dict:
    while True:
        name = f"{server}_{rng.choice(_WORDS[:400])}_{rng.choice(_WORDS[:400])}"
        if name not in used:
            used.add(name)
            break
    props: dict[str, Any] = {}
    for _ in range(rng.randint(*p["properties"])):
        props[rng.choice(_WORDS[:600])] = {"type": rng.choice(_TYPES), "description": _sentence(rng, p["property_words"])}
    required = [k for k in props if rng.random() < 0.5]
    return {"name": name, "description": _sentence(rng, p["description_words"]),
            "inputSchema": {"type": "object", "properties": props, "required": required}}


def _catalog(p: dict) -> tuple[list[list[dict]], list[list[dict]]]:
    rng = random.Random(f"{p['seed']}/catalog")
    used: set = set()
    names = rng.sample(_WORDS[:200], p["servers"])
    live = [[_tool(rng, s, used, p) for _ in range(p["tools_per_server"])] for s in names]
    reserve = [[_tool(rng, s, used, p) for _ in range(p["reserve_tools_per_server"])] for s in names]
    return live, reserve


def shuffled_keys(obj: Any, rng: random.Random) -> Any:
    """``obj`` (a JSON value) with every object's keys in a random order."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rng.shuffle(items)
        return {k: shuffled_keys(v, rng) for k, v in items}
    if isinstance(obj, list):
        return [shuffled_keys(v, rng) for v in obj]
    return obj


def _arguments(rng: random.Random, tool: dict) -> dict:
    out: dict[str, Any] = {}
    for k, spec in tool["inputSchema"]["properties"].items():
        t = spec["type"]
        out[k] = (rng.randint(0, 10_000) if t == "integer" else round(rng.uniform(0, 100), 2) if t == "number"
                  else rng.random() < 0.5 if t == "boolean" else _words(rng, (1, 6)))
    return out


def generate(params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yield the trace's lines (dicts): the header, then every call of every session."""
    p = params
    yield {"type": "prompt_trace", "version": 1, "params": p}
    live0, reserve0 = _catalog(p)
    systems = [_sentence(random.Random(f"{p['seed']}/system/{t}"), p["system_words"]) + "\n\n"
               + _sentence(random.Random(f"{p['seed']}/system2/{t}"), p["system_words"]) for t in range(p["tenants"])]
    for s in range(p["sessions"]):
        content = random.Random(f"{p['seed']}/s{s}/content")
        noise = random.Random(f"{p['seed']}/s{s}/noise")
        changes = random.Random(f"{p['seed']}/s{s}/changes")
        tenant = s % p["tenants"]
        live = [list(srv) for srv in live0]  # per server, its list in the order it returns it
        reserve = [list(srv) for srv in reserve0]
        order = list(range(len(live)))  # the order the servers' lists arrive in
        messages: list[dict[str, Any]] = [{"role": "user", "content": _sentence(content, p["task_words"])}]
        for c in range(p["calls"]):
            changed = False
            if c > 0 and changes.random() < p["tool_list_change"]:
                srv = changes.randrange(len(live))
                if changes.random() < 0.5 and reserve[srv]:
                    live[srv].insert(changes.randint(0, len(live[srv])), reserve[srv].pop(0))
                    changed = True
                elif len(live[srv]) > 1:  # the victim by name: the same tool whatever the order
                    victim = sorted(t["name"] for t in live[srv])[changes.randrange(len(live[srv]))]
                    live[srv] = [t for t in live[srv] if t["name"] != victim]
                    changed = True
            if noise.random() < p["tool_order_churn"]:
                noise.shuffle(order)
                for lst in live:
                    noise.shuffle(lst)
            tools = [t for srv in order for t in live[srv]]
            msgs = messages
            if noise.random() < p["json_key_noise"]:
                tools = [shuffled_keys(t, noise) for t in tools]
                msgs = [m if isinstance(m["content"], str) else {"role": m["role"], "content": shuffled_keys(m["content"], noise)}
                        for m in messages]
            line: dict[str, Any] = {"type": "prompt", "session_id": f"s{s}", "call": c}
            if p["tenants"] > 1:
                line["tenant"] = f"t{tenant}"
            line["tools_changed"] = changed
            line["parts"] = {"system": systems[tenant], "tools": tools, "messages": list(msgs)}
            yield line
            # the call's outcome: a tool call and its result (chosen by name: order-independent)
            names = sorted((t["name"], t) for srv in live for t in srv)
            tool = names[content.randrange(len(names))][1]
            messages.append({"role": "assistant", "content": {"tool": tool["name"], "arguments": _arguments(content, tool)}})
            messages.append({"role": "tool", "content": {"content": [{"type": "text", "text": _sentence(content, p["result_words"])}],
                                                         "isError": content.random() < 0.05}})


def write_trace(params: dict[str, Any], path: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for line in generate(params):
            f.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(params, call lines) of a prompt trace file."""
    from kvdb.errors import NotFound

    try:
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(x) for x in f if x.strip()]
    except FileNotFoundError:
        raise NotFound(f"prompt trace {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{path}: malformed JSON line ({e.msg})") from None
    if not lines or lines[0].get("type") != "prompt_trace" or lines[0].get("version") != 1:
        raise InvalidInput(f"{path}: not a kvdb prompt trace v1 (no prompt_trace header line)")
    calls = [x for x in lines[1:] if x.get("type") == "prompt"]
    return lines[0]["params"], calls
