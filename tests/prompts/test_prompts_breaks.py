"""kvdb.prompts.breaks: what counts as a cache break and how many tokens it loses."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdb.errors import InvalidInput
from kvdb.prompts import BreakBook, PromptSession, SessionBreaks, render
from kvdb.sim.prompt_gen import shuffled_keys


def enc(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def tool(name: str, desc: str = "") -> dict:
    return {"name": name, "description": desc or f"the {name} tool", "inputSchema": {"type": "object", "required": ["q"]}}


SYSTEM = "You are an agent."
TOOLS = [tool("a"), tool("b"), tool("c"), tool("d")]
TASK = {"role": "user", "content": "do the thing"}
CALL = {"role": "assistant", "content": {"tool": "a", "arguments": {"q": "x", "k": 2}}}


def parts(tools=TOOLS, messages=(TASK,)):
    return {"system": SYSTEM, "tools": list(tools), "messages": list(messages)}


def raw(p):
    return render(p, encode=enc, canonical=False)


def test_first_call_and_plain_growth_are_no_breaks():
    s = SessionBreaks()
    r1 = s.observe(raw(parts()))
    assert (r1.shared, r1.could, r1.lost, r1.broke) == (0, 0, 0, False)
    p2 = raw(parts(messages=(TASK, CALL)))
    r2 = s.observe(p2)
    # everything but the previous prompt's generation segment is shared
    assert r2.shared == r2.could == p2.segments[-2].start and not r2.broke
    assert s.stats() == {"calls": 2, "breaks": 0, "tokens": r1.tokens + r2.tokens, "shared_tokens": r2.shared,
                         "tokens_lost": 0}


def test_tool_order_churn_is_a_break_with_the_tokens_it_lost():
    s = SessionBreaks()
    first = raw(parts())
    s.observe(first)
    again = raw(parts(tools=[TOOLS[1], TOOLS[0], *TOOLS[2:]]))
    r = s.observe(again)
    assert r.broke and r.shared == first.segments[0].end  # only the system prompt
    assert r.could == len(first.token_ids)
    assert r.lost == r.could - r.shared


def test_json_key_order_is_a_break_and_canonical_rendering_has_none():
    rng = random.Random(3)
    history = (TASK, CALL)
    noisy = parts(tools=[shuffled_keys(t, rng) for t in TOOLS], messages=[TASK, shuffled_keys(CALL, rng)])
    s = SessionBreaks()
    s.observe(raw(parts(messages=history)))
    assert s.observe(raw(noisy)).broke
    c = SessionBreaks()
    c.observe(render(parts(messages=history), encode=enc))
    r = c.observe(render(noisy, encode=enc))
    assert not r.broke and r.shared == r.could == r.tokens


def test_real_tool_list_changes_are_no_breaks_but_sorting_around_an_added_tool_is():
    # a tool removed: nothing could have kept what follows it
    s = SessionBreaks()
    s.observe(render(parts(), encode=enc))
    assert not s.observe(render(parts(tools=[TOOLS[0], *TOOLS[2:]]), encode=enc)).broke
    # a tool added: name order puts it mid-list (a break), first-seen order appends it (none)
    added = [*TOOLS, tool("aa")]
    s = SessionBreaks()
    s.observe(render(parts(), encode=enc))
    r = s.observe(render(parts(tools=added), encode=enc))
    assert r.broke and r.lost > 0
    s, session = SessionBreaks(), PromptSession()
    s.observe(render(parts(), encode=enc, tool_order="first_seen", session=session))
    r = s.observe(render(parts(tools=added[::-1]), encode=enc, tool_order="first_seen", session=session))
    assert not r.broke and r.shared > 0


def test_an_edited_message_is_no_break():
    s = SessionBreaks()
    s.observe(raw(parts(messages=(TASK, CALL))))
    edited = {"role": "assistant", "content": {"tool": "a", "arguments": {"q": "y", "k": 2}}}
    r = s.observe(raw(parts(messages=(TASK, edited))))
    assert not r.broke and r.shared == r.could


def test_the_best_earlier_prompt_counts_and_history_is_bounded():
    s = SessionBreaks(history=2)
    a, b = raw(parts(messages=(TASK,))), raw(parts(tools=TOOLS[:2], messages=(TASK,)))
    s.observe(a)
    s.observe(b)
    r = s.observe(raw(parts(messages=(TASK, CALL))))  # extends a, not b
    assert r.shared == a.segments[-1].start and not r.broke
    s.observe(raw(parts(tools=TOOLS[:1])))  # a falls out of the last 2
    r = s.observe(a)
    assert r.shared == r.could and r.shared < len(a.token_ids)


@given(perm=st.permutations(range(4)), seed=st.integers(0, 1000))
def test_canonical_rendering_never_breaks_on_order_or_key_noise(perm, seed):
    rng = random.Random(seed)
    s = SessionBreaks()
    msgs = [TASK]
    for call in range(3):
        tools = [shuffled_keys(TOOLS[i], rng) for i in perm]
        rng.shuffle(tools)
        r = s.observe(render(parts(tools=tools, messages=[shuffled_keys(m, rng) for m in msgs]), encode=enc))
        assert not r.broke and (call == 0 or r.shared > 0)
        msgs.append({"role": "tool", "content": {"n": call, "ok": True}})


def test_break_book_tracks_sessions_and_totals():
    book = BreakBook(max_sessions=2)
    p, q = raw(parts()), raw(parts(tools=TOOLS[::-1]))
    book.observe("s1", p)
    assert book.observe("s1", q).broke
    book.observe("s2", p)
    assert not book.observe("s2", p).broke
    assert book.session("s1")["breaks"] == 1 and book.session("s2")["breaks"] == 0
    book.observe("s3", p)  # s1 is the least recently observed: dropped
    assert book.session("s1") is None and len(book) == 2
    book.end("s2")
    assert book.session("s2") is None
    assert book.stats() == {"calls": 5, "breaks": 1, "tokens": 5 * len(p.token_ids),
                            "shared_tokens": book.totals["shared_tokens"], "tokens_lost": book.totals["tokens_lost"],
                            "sessions": 1}


def test_bad_input():
    with pytest.raises(InvalidInput, match="history"):
        SessionBreaks(history=0)
    with pytest.raises(InvalidInput, match="min_lost_tokens"):
        BreakBook(min_lost_tokens=-1)
    with pytest.raises(InvalidInput, match="max_sessions"):
        BreakBook(max_sessions=0)
    with pytest.raises(InvalidInput, match="rendered prompt"):
        SessionBreaks().observe([1, 2, 3])
    with pytest.raises(InvalidInput, match="session_id"):
        BreakBook().observe("", raw(parts()))
