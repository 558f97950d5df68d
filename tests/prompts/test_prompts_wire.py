"""kvdb/prompts/wire.py: a rendered prompt's segments as JSON and back (what vLLM's
kv_transfer_params["prompt"] carries)."""

from __future__ import annotations

import json

import torch

import kvdb
from kvdb.keys import KeySpace
from kvdb.prompts import from_params, render, transfer_params

TOOLS = [{"name": "b", "description": "second tool"}, {"name": "a", "description": "first tool"}]


def encode(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


def test_segments_round_trip_through_json_and_are_rekeyed_per_tenant():
    layout = kvdb.BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16, dtype=torch.float16)
    ks = KeySpace(model_id="m", layout=layout, key_secret=b"k" * 32)
    r = render({"system": "be brief", "tools": TOOLS, "messages": [{"role": "user", "content": "hi"}]},
               encode=encode, keys=ks, tenant="acme")
    params = json.loads(json.dumps(transfer_params(r)))
    back, reason, detail = from_params(r.token_ids, params)
    assert (reason, detail) == ("", "")
    assert [(s.kind, s.start, s.end, s.canon, s.label) for s in back.segments] == \
        [(s.kind, s.start, s.end, s.canon, s.label) for s in r.segments]
    assert bytes(back.array) == bytes(r.array)
    # keys are never sent: recomputed for the tenant, equal to the render's own
    assert [s.key for s in back.keyed(ks, "acme").segments] == [s.key for s in r.segments]
    assert all(a.key != b.key for a, b in zip(back.keyed(ks, "other").segments, r.segments))


def test_bad_params_give_a_reason_never_an_exception():
    r = render({"system": "be brief"}, encode=encode)
    seg = transfer_params(r)["segments"]
    for params, ids, reason in ((None, r.token_ids, "not_an_object"), ({"segments": seg}, [], "no_tokens"),
                                ({"segments": "x"}, r.token_ids, "bad_segments"),
                                ({"segments": [[*seg[0][:3], 5, ""], *seg[1:]]}, r.token_ids, "bad_segment"),
                                ({"segments": seg[:1]}, r.token_ids, "not_tiling"),
                                ({"segments": seg}, [*r.token_ids[:-1], 1 << 40], "no_tokens")):
        got, why, detail = from_params(ids, params)
        assert got is None and why == reason and detail
