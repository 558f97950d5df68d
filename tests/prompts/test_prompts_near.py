"""near_match: a missed prompt's segments stored elsewhere, by segment key, with shift and
context; reports only, never hits. Runs on a real Db (host tier) through its public API."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL, open_db

from kvdb.errors import InvalidInput, KvdbError
from kvdb.prompts import render
from kvdb.prompts.book import PromptBook

BT = SMALL.block_tokens


def enc(text: str) -> list[int]:
    return list(text.encode("utf-8"))


TOOLS = [{"name": n, "description": f"tool {n} " * 3, "inputSchema": {"type": "object"}} for n in ("alpha", "beta", "gamma")]
A = {"system": "You are agent A.", "tools": TOOLS, "messages": [{"role": "user", "content": "first task"}]}


def store(db, book, parts, tenant="default", session_id=None, canonical=True):
    r = render(parts, encode=enc, keys=db, tenant=tenant, canonical=canonical)
    keys = db.block_keys(r.array, tenant)
    n = db.match_prefix(keys, peek=True)
    db.put_blocks(keys[n:], torch.zeros((len(keys) - n, *SMALL.block_shape)))
    return r, keys, book.note(db, r, session_id, tenant)


@pytest.fixture
def db(tmp_path):
    d = open_db(tmp_path / "db", host_pages=4096, layout=SMALL)
    yield d
    d.close()


def test_segments_stored_after_another_context_are_near_not_exact(db):
    book = PromptBook()
    a, a_keys, _ = store(db, book, A)
    b = render({**A, "system": "Agent B: a different one."}, encode=enc, keys=db)
    before = db.stats()
    m = book.near_match(db, b, "default")
    assert db.stats()["tiers"] == before["tiers"]  # a peek: no hits or misses counted
    # the exact prefix ends inside the system prompt (the template's header is the same)
    assert m.exact_blocks == db.match_prefix(db.block_keys(b.array), peek=True)
    assert m.exact_tokens == m.exact_blocks * BT < b.segments[0].end
    by_kind = [(s.kind, s.status) for s in m.segments]
    assert by_kind == [("system", "absent"), ("tool", "near"), ("tool", "near"), ("tool", "near"),
                       ("message", "near"), ("generation", "near")]
    shift = b.segments[1].start - a.segments[1].start
    for s, sa in zip(m.segments[1:5], a.segments[1:5]):
        assert s.stored_start == sa.start and s.shift == shift
        assert s.context_segments == a.segments.index(sa)
        assert s.shared_context_segments == 0 and not s.same_context  # the system prompt differs
        first = sa.start // BT
        assert s.offset == sa.start - first * BT
        assert list(s.block_keys) == a_keys[first: first + len(s.block_keys)]
        assert s.tokens_stored == min(sa.end, len(a_keys) * BT) - sa.start
    assert m.near_tokens == sum(s.tokens_stored for s in m.segments if s.status == "near")
    d = m.as_dict()
    assert d["segments"][1]["key"] == b.segments[1].key.hex() and d["exact_tokens"] == m.exact_tokens


def test_a_longer_prompt_is_exact_up_to_what_is_stored(db):
    book = PromptBook()
    a, a_keys, _ = store(db, book, A)
    longer = render({**A, "messages": [*A["messages"], {"role": "assistant", "content": {"tool": "alpha"}}]},
                    encode=enc, keys=db)
    m = book.near_match(db, longer, "default")
    assert m.exact_blocks == len(a_keys) - 0 and m.exact_tokens == m.exact_blocks * BT
    # system, tools, the user message: inside the exact prefix; the new message is nowhere
    assert [s.status for s in m.segments] == ["exact"] * 5 + ["absent", "near"]
    # the generation prompt is stored, in part (A's last block is partial), after a shorter context
    gen, a_gen = m.segments[-1], a.segments[-1]
    assert gen.shift == longer.segments[-2].tokens and gen.stored_start == a_gen.start
    assert gen.context_segments == gen.shared_context_segments == 5 and not gen.same_context
    assert gen.tokens_stored == len(a_keys) * BT - a_gen.start < a_gen.tokens


def test_tenants_never_see_each_others_segments(db):
    book = PromptBook()
    store(db, book, A, tenant="acme")
    other = render({**A, "system": "Another system prompt."}, encode=enc, keys=db, tenant="globex")
    m = book.near_match(db, other, "globex")
    assert all(s.status == "absent" for s in m.segments) and m.near_tokens == 0
    same_tenant = render({**A, "system": "Another system prompt."}, encode=enc, keys=db, tenant="acme")
    assert any(s.status == "near" for s in book.near_match(db, same_tenant, "acme").segments)


def test_unsalted_prompts_are_keyed_for_the_tenant_asked(db):
    book = PromptBook()
    store(db, book, A, tenant="acme")
    unsalted = render({**A, "system": "Another system prompt."}, encode=enc)
    assert any(s.status == "near" for s in book.near_match(db, unsalted, "acme").segments)
    assert not any(s.status == "near" for s in book.near_match(db, unsalted, "globex").segments)


def test_evicted_blocks_and_dropped_prompts_are_not_reported(db):
    book = PromptBook(max_prompts=1)
    a, a_keys, _ = store(db, book, A)
    b = render({**A, "system": "B"}, encode=enc, keys=db)
    assert any(s.status == "near" for s in book.near_match(db, b, "default").segments)
    db.delete(a_keys)
    assert all(s.status == "absent" for s in book.near_match(db, b, "default").segments)
    store(db, book, A)
    store(db, book, {"system": "C", "tools": TOOLS[:1]})  # A falls out of an index of one prompt
    m = book.near_match(db, b, "default")
    assert [s.status for s in m.segments if s.kind == "tool"] == ["near", "absent", "absent"]
    assert book.stats()["indexed_prompts"] == 1


def test_the_same_place_is_indexed_once_and_the_best_place_wins(db):
    book = PromptBook(per_key=2)
    for _ in range(3):
        store(db, book, A)  # the same blocks: one place per segment
    assert len(book._index.places(render(A, encode=enc, keys=db).segments[1].key)) == 1
    # the tools also stored after another system prompt; the first block (shared by both) gone:
    # of the two places, the one after the same context wins
    _, b_keys, _ = store(db, book, {**A, "system": "System B."})
    db.delete(b_keys[:1])
    c = render({**A, "system": "System B.", "messages": [{"role": "user", "content": "other"}]}, encode=enc, keys=db)
    m = book.near_match(db, c, "default")
    assert m.exact_blocks == 0
    for s in m.segments[1:4]:
        assert s.status == "near" and s.same_context and s.shift == 0 and s.shared_context_segments == s.index
    assert len(book._index.places(c.segments[1].key)) == 2


def test_note_counts_breaks_per_session(db):
    book = PromptBook()
    _, _, r1 = store(db, book, A, session_id="s", canonical=False)
    _, _, r2 = store(db, book, {**A, "tools": TOOLS[::-1]}, session_id="s", canonical=False)
    assert not r1.broke and r2.broke and r2.lost > 0
    assert book.session("s")["breaks"] == 1 and book.stats()["breaks"] == 1
    book.end("s")
    assert book.session("s") is None and book.stats()["calls"] == 2
    assert store(db, book, A)[2] is None  # no session: indexed, not accounted


def test_bad_input(db):
    book = PromptBook()
    with pytest.raises(InvalidInput, match="rendered prompt"):
        book.near_match(db, A, "default")
    with pytest.raises(InvalidInput, match="session_id"):
        book.note(db, render(A, encode=enc), "", "default")
    with pytest.raises(InvalidInput, match="tenant"):
        book.near_match(db, render(A, encode=enc), "")
    with pytest.raises(InvalidInput, match="max_prompts"):
        PromptBook(max_prompts=0)


def test_the_db_forwards_to_its_book_stats_explain_and_metrics(db):
    from prometheus_client import CollectorRegistry, generate_latest

    import kvdb.metrics

    reg = CollectorRegistry()
    kvdb.metrics.register(db, reg)
    db.begin_session("s1", tenant="acme")
    first = render(A, encode=enc, keys=db, tenant="acme", canonical=False)
    keys = db.block_keys(first.array, "acme")
    db.put_blocks(keys, torch.zeros((len(keys), *SMALL.block_shape)))
    assert not db.note_prompt(first, session_id="s1", tenant="acme").broke
    churned = render({**A, "tools": TOOLS[::-1]}, encode=enc, keys=db, tenant="acme", canonical=False)
    r = db.note_prompt(churned, session_id="s1", tenant="acme")
    assert r.broke and r.lost > 0
    assert db.note_prompt(churned, tenant="acme") is None  # indexed only
    s = db.stats()["prompts"]
    assert (s["calls"], s["breaks"], s["tokens_lost"], s["indexed_prompts"]) == (2, 1, r.lost, 3)
    assert db.explain(session_id="s1")["prompts"]["breaks"] == 1
    text = generate_latest(reg).decode()
    assert "kvdb_prompt_breaks_total 1.0" in text and f"kvdb_prompt_tokens_lost_total {float(r.lost)}" in text
    # near_match through the Db: the churned prompt's tools are stored at other places
    m = db.near_match(churned, tenant="acme")
    assert m.exact_blocks == db.match_prefix(db.block_keys(churned.array, "acme"), peek=True)
    assert [s.status for s in m.segments if s.kind == "tool"] == ["near"] * 3
    assert db.near_match(churned, tenant="globex").near_tokens == 0
    db.end_session("s1")
    assert db.stats()["prompts"]["sessions"] == 0 and db.stats()["prompts"]["breaks"] == 1
    db.begin_session("s2")
    assert db.explain(session_id="s2")["prompts"] is None
    db.close()
    with pytest.raises(KvdbError, match="closed"):
        db.near_match(churned, tenant="acme")
