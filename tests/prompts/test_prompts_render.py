"""kvdb.prompts.render: canonical JSON and tool order (property tests), segments, segment keys,
bad input. The encoder is the UTF-8 bytes of the text (a real, if simple, str -> list[int]);
test_prompts_bench.py runs the same code with a trained BPE."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvdb import BlockLayout
from kvdb.errors import InvalidInput
from kvdb.keys import KeySpace
from kvdb.sim.prompt_gen import shuffled_keys
from kvdb.prompts import DEFAULT_TEMPLATE, PromptSession, Template, canonical_text, render

LAYOUT = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4, dtype=torch.float16)
KS = KeySpace(model_id="m", layout=LAYOUT, key_secret=b"k" * 32)


def enc(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def tool(name: str, **props) -> dict:
    return {"name": name, "description": f"the {name} tool",
            "inputSchema": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}}


PARTS = {"system": "You are a careful agent.",
         "tools": [tool("search", q="string", n="integer"), tool("exec", code="string")],
         "messages": [{"role": "user", "content": "find it"},
                      {"role": "assistant", "content": {"tool": "search", "arguments": {"q": "x", "n": 3}}},
                      {"role": "tool", "content": [{"type": "text", "text": "found"}]}]}

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=5),
                           max_leaves=10)
small_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                            max_leaves=4)


tools_st = st.lists(st.tuples(st.text(min_size=1, max_size=4), st.dictionaries(st.text(max_size=4), small_values, max_size=3)),
                    max_size=5).map(lambda ts: [{"name": n, **{k: v for k, v in body.items() if k != "name"}} for n, body in ts])


@given(tools=tools_st, content=json_values.filter(lambda v: isinstance(v, (dict, list))), seed=st.integers(0, 2**32))
def test_any_key_order_or_tool_order_gives_the_same_tokens(tools, content, seed):
    rng = random.Random(seed)
    parts = {"system": "sys", "tools": tools, "messages": [{"role": "tool", "content": content}]}
    other_tools = [shuffled_keys(t, rng) for t in tools]
    rng.shuffle(other_tools)
    other = {"system": "sys", "tools": other_tools, "messages": [{"role": "tool", "content": shuffled_keys(content, rng)}]}
    a, b = render(parts, encode=enc, keys=KS), render(other, encode=enc, keys=KS)
    assert a.token_ids == b.token_ids
    assert [(s.kind, s.start, s.end, s.key) for s in a.segments] == [(s.kind, s.start, s.end, s.key) for s in b.segments]
    # raw mode keeps what it is given: the canons agree, the keys need not
    ra, rb = render(parts, encode=enc, canonical=False), render(other, encode=enc, canonical=False)
    assert sorted(s.canon for s in ra.segments) == sorted(s.canon for s in rb.segments)


@given(tools=tools_st, seed=st.integers(0, 2**32))
def test_first_seen_order_is_stable_within_a_session(tools, seed):
    rng = random.Random(seed)
    session = PromptSession()
    first = render({"tools": tools}, encode=enc, tool_order="first_seen", session=session)
    again = [shuffled_keys(t, rng) for t in tools]
    rng.shuffle(again)
    assert render({"tools": again}, encode=enc, tool_order="first_seen", session=session).token_ids == first.token_ids


def test_first_seen_keeps_the_prefix_when_a_tool_is_added():
    session = PromptSession()
    base = [tool("b"), tool("d")]
    r1 = render({"tools": base}, encode=enc, tool_order="first_seen", session=session)
    r2 = render({"tools": [tool("a"), *base[::-1]]}, encode=enc, tool_order="first_seen", session=session)
    assert r2.token_ids[: len(r1.token_ids) - len(enc(DEFAULT_TEMPLATE.generation))] == r1.token_ids[:r1.segments[-1].start]
    assert [s.label for s in r2.segments if s.kind == "tool"] == ["b", "d", "a"]
    by_name = render({"tools": [tool("a"), *base]}, encode=enc)
    assert [s.label for s in by_name.segments if s.kind == "tool"] == ["a", "b", "d"]
    # a new session starts from (name, hash) order
    assert render({"tools": [tool("d"), tool("b")]}, encode=enc, tool_order="first_seen",
                  session=PromptSession()).token_ids == r1.token_ids


def test_segments_tile_the_prompt_and_match_the_default_template():
    r = render(PARTS, encode=enc, keys=KS, tenant="acme")
    assert [s.kind for s in r.segments] == ["system", "tool", "tool", "message", "message", "message", "generation"]
    assert [s.label for s in r.segments] == ["", "exec", "search", "user", "assistant", "tool", ""]
    assert r.segments[0].start == 0 and r.segments[-1].end == len(r.token_ids)
    assert all(a.end == b.start for a, b in zip(r.segments, r.segments[1:]))
    assert r.token_ids == enc(r.text) and r.array.tolist() == r.token_ids
    assert r.text.startswith("<|system|>\nYou are a careful agent.<|end|>\n<|tool|>\n{\"description\":\"the exec tool\"")
    assert '<|assistant|>\n{"arguments":{"n":3,"q":"x"},"tool":"search"}<|end|>\n' in r.text
    assert r.text.endswith('<|tool|>\n[{"text":"found","type":"text"}]<|end|>\n<|assistant|>\n')
    for s in r.segments:  # each segment is its own text, encoded alone
        assert enc(r.text.encode()[s.start:s.end].decode()) == r.token_ids[s.start:s.end]


def test_raw_mode_keeps_order_and_serialisation():
    r = render(PARTS, encode=enc, canonical=False)
    assert [s.label for s in r.segments if s.kind == "tool"] == ["search", "exec"]
    assert json.dumps(PARTS["tools"][0], ensure_ascii=False) in r.text
    assert r.tenant is None and r.namespace is None
    with pytest.raises(InvalidInput, match="first_seen"):
        render(PARTS, encode=enc, canonical=False, tool_order="first_seen", session=PromptSession())


def test_canonical_whitespace():
    assert canonical_text("\n\na  \r\nb\t\rc \n\n") == "a\nb\nc"
    a = render({"system": "x \r\ny\n"}, encode=enc)
    b = render({"system": "\nx\ny  "}, encode=enc)
    assert a.token_ids == b.token_ids
    raw = render({"system": "x \r\ny\n"}, encode=enc, canonical=False)
    assert "x \r\ny\n" in raw.text and raw.segments[0].canon == a.segments[0].canon


def test_segment_keys_are_position_free_and_tenant_salted():
    a = render(PARTS, encode=enc, keys=KS, tenant="acme")
    moved = render({**PARTS, "system": "Another, longer system prompt."}, encode=enc, keys=KS, tenant="acme")
    assert a.segments[1].key == moved.segments[1].key and a.segments[1].start != moved.segments[1].start
    b = render(PARTS, encode=enc, keys=KS, tenant="globex")
    assert a.token_ids == b.token_ids
    assert not {s.key for s in a.segments} & {s.key for s in b.segments}
    # the format: H(ns || "segment" 0x00 || tokens u32 LE)[:16]
    s = a.segments[2]
    raw = a.array[s.start:s.end].astype("<u4").tobytes()
    assert s.key == hashlib.sha256(KS.namespace("acme") + b"segment\x00" + raw).digest()[:16]
    assert s.key == KS.segment_key(a.token_ids[s.start:s.end], "acme")
    # unsalted until keyed; keyed() salts for the tenant asked
    u = render(PARTS, encode=enc)
    assert u.tenant is None and u.keyed(KS, "acme").segments == a.segments
    assert a.keyed(KS, "acme") is a


@given(tenants=st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=4, unique=True),
       body=st.text(max_size=30))
def test_tenants_never_share_segment_keys(tenants, body):
    keys = [{s.key for s in render({"system": body or "x", "messages": [{"role": "user", "content": body}]},
                                   encode=enc, keys=KS, tenant=t).segments} for t in tenants]
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            assert not keys[i] & keys[j]


def test_templates():
    tpl = {"system": "[S]{text}\n", "tool": "[T]{text}\n", "message": "[{role}]{text}\n", "generation": ""}
    r = render(PARTS, encode=enc, template=tpl)
    assert r.text.startswith("[S]You are a careful agent.\n[T]") and r.text.endswith("[tool][{\"text\":\"found\",\"type\":\"text\"}]\n")
    assert r.segments[-1].kind == "message"
    assert Template.of(None) is DEFAULT_TEMPLATE
    for bad in ({"system": "no text"}, {"tool": "{text}{text}"}, {"message": "{text}{role}"}, {"system": "{role}{text}"},
                {"generation": "{text}"}, {"footer": "x"}):
        with pytest.raises(InvalidInput):
            render(PARTS, encode=enc, template=bad)
    with pytest.raises(InvalidInput, match="template must be"):
        render(PARTS, encode=enc, template="{text}")


@pytest.mark.parametrize("parts, match", [
    ("text", "parts must be a mapping"),
    ({"system": "x", "user": "y"}, "unknown prompt parts"),
    ({"system": 3}, "system"),
    ({"tools": {"name": "x"}}, "must be a list"),
    ({"tools": ["x"]}, r"tools\[0\] must be a JSON object"),
    ({"tools": [{"description": "no name"}]}, r"tools\[0\] needs a non-empty string 'name'"),
    ({"tools": [{"name": "x", "v": float("nan")}]}, "JSON"),
    ({"tools": [{"name": "x", "v": {1, 2}}]}, "JSON"),
    ({"messages": [{"role": "user"}]}, "missing"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "unknown keys"),
    ({"messages": [{"role": "", "content": "x"}]}, "role"),
    ({"messages": [{"role": "a|>b", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 3}]}, "content"),
    ({"messages": ["hi"]}, r"messages\[0\]"),
])
def test_bad_input_is_invalid_input(parts, match):
    with pytest.raises(InvalidInput, match=match):
        render(parts, encode=enc)


def test_bad_options_and_encoders():
    with pytest.raises(InvalidInput, match="encode must be a callable"):
        render(PARTS, encode=None)
    with pytest.raises(InvalidInput, match="tool_order"):
        render(PARTS, encode=enc, tool_order="random")
    with pytest.raises(InvalidInput, match="needs session"):
        render(PARTS, encode=enc, tool_order="first_seen")
    with pytest.raises(InvalidInput, match="canonical must be a bool"):
        render(PARTS, encode=enc, canonical="yes")
    with pytest.raises(InvalidInput, match="session must be"):
        render(PARTS, encode=enc, session={})
    with pytest.raises(InvalidInput, match="keys must be"):
        render(PARTS, encode=enc, keys="db")
    with pytest.raises(InvalidInput, match="tenant"):
        render(PARTS, encode=enc, keys=KS, tenant="")
    with pytest.raises(InvalidInput, match="uint32"):
        render(PARTS, encode=lambda s: [-1])
    with pytest.raises(InvalidInput, match="uint32"):
        render(PARTS, encode=lambda s: ["a"])


def test_a_session_encodes_each_segment_text_once():
    seen: list[str] = []

    def counting(text: str) -> list[int]:
        seen.append(text)
        return enc(text)

    session = PromptSession()
    first = render(PARTS, encode=counting, session=session)
    assert len(seen) == len(first.segments)
    more = {**PARTS, "messages": [*PARTS["messages"], {"role": "user", "content": "and then"}]}
    seen.clear()
    again = render(more, encode=counting, session=session, keys=KS)
    assert seen == ["<|user|>\nand then<|end|>\n"]  # only the new message
    assert again.token_ids == render(more, encode=enc, keys=KS).token_ids
    assert again.segments == render(more, encode=enc, keys=KS).segments
    # another encoder empties the cache; 0 turns it off; the bound holds
    other = render(PARTS, encode=lambda t: [b + 1 for b in enc(t)], session=session)
    assert other.token_ids == [t + 1 for t in first.token_ids]
    seen.clear()
    render(PARTS, encode=counting, session=PromptSession(max_cached_segments=0))
    render(PARTS, encode=counting, session=(small := PromptSession(max_cached_segments=2)))
    assert len(seen) == 2 * len(first.segments) and len(small.encoded(counting)) == 2
    with pytest.raises(InvalidInput, match="max_cached_segments"):
        PromptSession(max_cached_segments=-1)
