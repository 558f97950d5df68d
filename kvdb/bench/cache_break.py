"""``kvdb bench cache-break``: prefix-cache hit rates on a noisy MCP-like workload, rendered four
ways, and what rendering costs next to the tokenizer (docs/prompts.md "Benchmark").

Workload: kvdb/sim/prompt_gen.py (sessions x calls, tools from MCP servers, a growing history),
at each noise level (tool-order churn, JSON key-order noise, tool-list changes). Per seed and
level, four replays, each through a fresh Db (host tier only, room for everything: capacity is
not what is measured) with ``db.block_keys`` + ``match_prefix`` + ``put_blocks`` per call:

``clean``       the same calls without order or key noise (the tool-list changes, which are
                content, kept), rendered raw: what a careful client gets;
``raw``         the noisy calls rendered as given (``canonical=False``);
``canonical``   the noisy calls rendered canonically, tools by (name, content hash);
``first_seen``  canonically, tools in each session's first-seen order.

Hit rate = hit blocks / full blocks over all calls. Breaks: ``db.note_prompt`` per call
(kvdb/prompts/breaks.py), per call. The tokenizer is a byte-level BPE trained here on a
workload of ``tokenizer_seed`` (kvdb/bench/bpe.py), never on an evaluated seed.

Cost (one replay per seed: the canonical one at the middle level; every call): ``render`` is
``kvdb.prompts.render`` with segment keys, less the time inside ``encode`` (timed around each
call; reported apart: the segments a session has not encoded before, ``PromptSession`` keeps the
rest); ``block keys`` is ``db.block_keys``; the baseline, in the same loop, is the tokenizer
encoding the very same text (``rendered.text``) in one call. Goal: (render + block keys) <= 0.5
x tokenizer (``render_keys_vs_tokenizer``; with render's own encodes added:
``render_encode_keys_vs_tokenizer``); and canonical >= 0.95 x clean at every level.
"""

from __future__ import annotations

import tempfile
import time
from statistics import mean
from typing import Callable

import torch

from kvdb.errors import InvalidInput
from kvdb.format.layout import BlockLayout
from kvdb.prompts import PromptSession, render
from kvdb.sim import prompt_gen

LEVELS: dict[str, dict[str, float]] = {
    "low": {"tool_order_churn": 0.1, "json_key_noise": 0.1, "tool_list_change": 0.02},
    "mid": {"tool_order_churn": 0.3, "json_key_noise": 0.3, "tool_list_change": 0.05},
    "high": {"tool_order_churn": 0.6, "json_key_noise": 0.6, "tool_list_change": 0.1},
    "max": {"tool_order_churn": 1.0, "json_key_noise": 1.0, "tool_list_change": 0.1},
}
TIMED_LEVEL = "mid"
MODES = ("clean", "raw", "canonical", "first_seen")
DEFAULT_SEEDS = (41, 42, 43)
TOKENIZER_SEED = 1000
GOAL_CANONICAL_VS_CLEAN = 0.95
GOAL_RENDER_VS_TOKENIZER = 0.5
_LAYOUT = dict(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float16)


def build_tokenizer(seed: int = TOKENIZER_SEED, vocab_size: int = 8192):
    """The bench's BPE, trained on the last prompt of every session of a ``seed`` workload,
    rendered raw and canonically at the highest noise level (both serialisations)."""
    from kvdb.bench.bpe import train_bpe

    p = prompt_gen.load_params(seed=seed, **LEVELS["max"])
    last = p["calls"] - 1
    texts = [render(c["parts"], encode=_nothing, canonical=canon).text
             for c in prompt_gen.generate(p) if c.get("call") == last for canon in (False, True)]
    return train_bpe(texts, vocab_size=vocab_size)


def _nothing(text: str) -> list[int]:
    return []


def _memo(encode: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
    """``encode`` remembered per text: the hit-rate replays render the same pieces many times."""
    cache: dict[str, list[int]] = {}

    def encode_memo(text: str) -> list[int]:
        ids = cache.get(text)
        if ids is None:
            ids = cache[text] = encode(text)
        return ids

    return encode_memo


def _replay(calls, mode: str, encode, block_tokens: int, timing: dict | None, tok_encode=None) -> dict:
    import kvdb

    layout = BlockLayout(block_tokens=block_tokens, **_LAYOUT)
    canonical = mode in ("canonical", "first_seen")
    order = "first_seen" if mode == "first_seen" else "name"
    sessions: dict[str, PromptSession] = {}
    hits = blocks = tokens = 0
    perf = time.perf_counter
    inside = [0.0]
    if timing is not None:
        plain = encode

        def encode(text: str, _plain=plain) -> list[int]:  # noqa: F811 - timed around each call
            t = perf()
            ids = _plain(text)
            inside[0] += perf() - t
            return ids

    with tempfile.TemporaryDirectory(prefix="kvdb-bench-cache-break-") as d:
        db = kvdb.open(d, layout=layout, model_id="bench-cache-break", host_bytes=256 << 20, disk_bytes=0)
        try:
            zeros = torch.zeros((1, *layout.block_shape), dtype=layout.dtype)
            for c in calls:
                sid, tenant = c["session_id"], c.get("tenant", "default")
                session = sessions.setdefault(sid, PromptSession())
                t0 = perf()
                inside[0] = 0.0
                r = render(c["parts"], encode=encode, canonical=canonical, tool_order=order,
                           session=session, keys=db, tenant=tenant)
                t1 = perf()
                keys = db.block_keys(r.array, tenant)
                t2 = perf()
                if timing is not None:
                    tok_encode(r.text)
                    t3 = perf()
                    timing["render_s"] += t1 - t0 - inside[0]
                    timing["encode_in_render_s"] += inside[0]
                    timing["block_keys_s"] += t2 - t1
                    timing["tokenizer_s"] += t3 - t2
                    timing["calls"] += 1
                n = db.match_prefix(keys)
                if n < len(keys):
                    db.put_blocks(keys[n:], zeros.expand(len(keys) - n, *layout.block_shape).contiguous())
                t4 = perf()
                db.note_prompt(r, session_id=sid, tenant=tenant, block_keys=keys)
                if timing is not None:
                    timing["note_prompt_s"] += perf() - t4
                hits += n
                blocks += len(keys)
                tokens += len(r.token_ids)
            breaks = db.stats()["prompts"]
        finally:
            db.close()
    return {"hit_rate": hits / blocks if blocks else 0.0, "breaks_per_call": breaks["breaks"] / max(1, breaks["calls"]),
            "tokens_lost_per_call": breaks["tokens_lost"] / max(1, breaks["calls"]),
            "tokens_per_call": tokens / max(1, len(calls))}


def bench_cache_break(*, seeds=DEFAULT_SEEDS, levels=tuple(LEVELS), sessions: int | None = None,
                      calls: int | None = None, block_tokens: int = 16, tokenizer_seed: int = TOKENIZER_SEED,
                      progress: Callable[[int], None] | None = None) -> dict:
    """Hit rates per mode and level (means over ``seeds``; per-seed figures under ``runs``),
    breaks per call, and the cost of rendering next to the tokenizer."""
    seeds = list(seeds)
    if not seeds or any(not isinstance(s, int) or isinstance(s, bool) for s in seeds):
        raise InvalidInput(f"seeds must be a non-empty list of ints, got {seeds!r}")
    if tokenizer_seed in seeds:
        raise InvalidInput(f"the tokenizer is trained on seed {tokenizer_seed}: evaluate other seeds")
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown or not levels:
        raise InvalidInput(f"unknown noise levels {unknown}; known: {list(LEVELS)}")
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidInput(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    from kvdb.bench.bpe import encoder

    t0 = time.perf_counter()
    tok = build_tokenizer(tokenizer_seed)
    train_s = time.perf_counter() - t0
    tok_encode = encoder(tok)
    timing = dict.fromkeys(("render_s", "encode_in_render_s", "block_keys_s", "tokenizer_s", "note_prompt_s"), 0.0)
    timing["calls"] = 0
    runs = []
    for seed in seeds:
        encode = _memo(tok_encode)
        for level in levels:
            p = prompt_gen.load_params(seed=seed, sessions=sessions, calls=calls, **LEVELS[level])
            noisy = list(prompt_gen.generate(p))[1:]
            clean = list(prompt_gen.generate(prompt_gen.clean(p)))[1:]
            row = {"seed": seed, "level": level, "tools_changed_per_call": mean(c["tools_changed"] for c in noisy)}
            for mode in MODES:
                timed = mode == "canonical" and level == (TIMED_LEVEL if TIMED_LEVEL in levels else levels[0])
                res = _replay(clean if mode == "clean" else noisy, mode, tok_encode if timed else encode, block_tokens,
                              timing if timed else None, tok_encode)
                row[mode] = res
                if progress:
                    progress(1)
            runs.append(row)

    def agg(level: str, mode: str, field: str) -> float:
        return round(mean(r[mode][field] for r in runs if r["level"] == level), 4)

    out: dict = {"seeds": seeds, "levels": {lv: LEVELS[lv] for lv in levels}, "block_tokens": block_tokens}
    for mode in MODES:
        out[f"hit_rate_{mode}"] = {lv: agg(lv, mode, "hit_rate") for lv in levels}
    ratios = {lv: round(min(r["canonical"]["hit_rate"] / r["clean"]["hit_rate"] for r in runs if r["level"] == lv), 4)
              for lv in levels}
    out["canonical_vs_clean_min"] = ratios
    out["breaks_per_call"] = {mode: {lv: agg(lv, mode, "breaks_per_call") for lv in levels} for mode in MODES}
    out["tokens_lost_per_call"] = {mode: {lv: agg(lv, mode, "tokens_lost_per_call") for lv in levels} for mode in MODES}
    out["tokens_per_call"] = {mode: {lv: agg(lv, mode, "tokens_per_call") for lv in levels} for mode in MODES}
    out["tools_changed_per_call"] = {lv: round(mean(r["tools_changed_per_call"] for r in runs if r["level"] == lv), 4)
                                     for lv in levels}
    n = max(1, timing["calls"])
    ms = {k[:-2]: timing[k] / n * 1e3 for k in timing if k.endswith("_s")}
    out["render_ms_per_call"] = round(ms["render"], 4)
    out["block_keys_ms_per_call"] = round(ms["block_keys"], 4)
    out["tokenizer_ms_per_call"] = round(ms["tokenizer"], 4)
    out["encode_in_render_ms_per_call"] = round(ms["encode_in_render"], 4)
    out["note_prompt_ms_per_call"] = round(ms["note_prompt"], 4)
    out["render_keys_vs_tokenizer"] = round((ms["render"] + ms["block_keys"]) / max(ms["tokenizer"], 1e-9), 4)
    out["render_encode_keys_vs_tokenizer"] = round((ms["render"] + ms["encode_in_render"] + ms["block_keys"])
                                                   / max(ms["tokenizer"], 1e-9), 4)
    out["timed_calls"] = timing["calls"]
    out["goals"] = {
        "canonical_vs_clean": f">= {GOAL_CANONICAL_VS_CLEAN} at every level",
        "canonical_vs_clean_met": all(v >= GOAL_CANONICAL_VS_CLEAN for v in ratios.values()),
        "render_keys_vs_tokenizer": f"<= {GOAL_RENDER_VS_TOKENIZER}",
        "render_keys_vs_tokenizer_met": out["render_keys_vs_tokenizer"] <= GOAL_RENDER_VS_TOKENIZER,
    }
    out["tokenizer"] = {"kind": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                        "trained_on_seed": tokenizer_seed, "train_s": round(train_s, 3)}
    out["runs"] = runs
    return out
