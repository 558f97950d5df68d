"""PrefixCache takes prompts rendered by kvdb.prompts.render (issue 17, part 4: the transformers
adapter): the same lookups and saves, plus break accounting through Db.note_prompt.

Scenario: an agent session whose tool list comes back in another order on its second call.
Canonical rendering keeps the prompt byte-identical, so the second call restores everything the
first stored and no break is counted; raw rendering breaks right after the system prompt and
the break and its lost tokens are counted, on the cache's stats and in the Db's.
"""

from __future__ import annotations

import pytest
import torch

import kvdb
from kvdb.errors import InvalidInput
from kvdb.integrations.transformers import PrefixCache, layout_for
from kvdb.prompts import render

from .conftest import VOCAB

BT = 16
TOOLS = [{"name": f"tool_{i}", "description": f"does thing {i} " * 6,
          "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}}
         for i in range(4)]


def encode(text: str) -> list[int]:
    return [3 + (sum(w.encode()) * 31 + len(w)) % (VOCAB - 3) for w in text.split()]


def parts(tools) -> dict:
    return {"system": "you are a careful agent " * 8, "tools": tools,
            "messages": [{"role": "user", "content": "please do the task " * 5}]}


@pytest.fixture
def pc(llama, tmp_path):
    db = kvdb.open(tmp_path / "db", layout=layout_for(llama.config, block_tokens=BT), model_id="tiny-llama",
                   host_bytes=64 << 20, disk_bytes=0)
    yield PrefixCache(db, llama)
    db.close()


@torch.no_grad()
def run_call(pc, llama, rendered, sid):
    cache, n = pc.lookup(rendered)
    ids = torch.tensor([rendered.token_ids])
    out = llama(ids[:, n:], past_key_values=cache, use_cache=True)
    pc.save(rendered, out.past_key_values, session_id=sid)
    return n


@pytest.mark.parametrize("canonical", [True, False])
def test_rendered_prompts_restore_and_count_breaks(pc, llama, canonical):
    first = render(parts(TOOLS), encode=encode, canonical=canonical)
    second = render(parts(TOOLS[::-1]), encode=encode, canonical=canonical)
    assert run_call(pc, llama, first, "s") == 0
    n = run_call(pc, llama, second, "s")
    full = (len(second.token_ids) - 1) // BT * BT
    if canonical:
        assert second.token_ids == first.token_ids
        assert n == full
        assert (pc.stats.breaks, pc.stats.tokens_lost) == (0, 0)
    else:
        assert second.token_ids != first.token_ids and n < full
        assert pc.stats.breaks == 1 and pc.stats.tokens_lost > 0
    assert pc.db.stats()["prompts"]["calls"] == 2
    assert pc.db.stats()["prompts"]["breaks"] == pc.stats.breaks


def test_session_id_needs_a_rendered_prompt(pc, llama):
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        out = llama(ids, use_cache=True)
    with pytest.raises(InvalidInput, match="rendered"):
        pc.save(ids, out.past_key_values, session_id="s")
