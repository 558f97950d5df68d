"""Agent sessions as token prompts, for replays through a real engine (``kvdb bench vllm-agents``).

Two sources:

``gen``  the agent traces of ``kvdb gen`` (kvdb/sim/generator.py, any preset of
         kvdb/sim/shapes.py, e.g. ``agentic-mix``). A trace names each prompt by the ids of its
         blocks (``hash_ids``, prefix-chained); here every id becomes ``block_tokens`` token ids
         drawn from a generator seeded by the id, so two calls share exactly the token blocks
         their traces share. The last, partial block gets its own tokens.

``swe``  a coding agent in the manner of SWE-agent: one agent per session in one long ReAct
         loop (think, run a shell or editor command, read its output). Its shape follows two
         public analyses of real trajectories: the SWE-Bench Pro trajectory analysis of 2920
         SWE-agent runs by nilenso (https://nilenso.github.io/swe-bench-pro-cost-token-time-analysis/reference.html:
         median trajectory length between 29 and 78 steps by model; 53 to 78 for the two
         strongest), and "The Limits of Long-Context Reasoning in Automated Bug Fixing"
         (https://arxiv.org/html/2602.16069v1: successful mini-SWE-agent trajectories typically
         stay under 20k tokens of context). Each session: a system prompt and tool docs shared
         by every session (``swe_shared_tokens``), the issue (``swe_issue_tokens``), then per
         step the model's action and the command's output (log-normal, heavy-tailed), the
         command running for a log-normal time (``swe_tool_median_s``); steps are log-normal
         around ``swe_steps_median``, and a session ends when its context would pass
         ``max_context``. The numbers are this module's own choices within those figures,
         scaled down by the bench's sizes.

A replay is closed loop (``Call.deps``, ``Call.gap_s``): a call starts once every call of its
session that ended before it in the trace has ended in the replay, plus the trace's gap after
the last of them (a tool wait or a user's think time), scaled by the bench.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

VOCAB_LOW = 3  # ids 0..2 are the tiny Llama's specials


@dataclass
class Call:
    session_id: str
    agent_id: str
    tokens: list[int]
    max_tokens: int
    deps: list[int] = field(default_factory=list)  # indices (in the session's calls) that must end first
    gap_s: float = 0.0  # trace seconds after the last dep ended
    hints: dict[str, Any] = field(default_factory=dict)  # expected_tool_duration_s, ...
    prefix_blocks: int = 0  # blocks of the shared prefix (system prompt, tools) at the front
    last: bool = False  # the session's last call (end_session)


@dataclass
class Session:
    session_id: str
    start_s: float  # trace seconds after the first session's start
    calls: list[Call]


class _Tokens:
    """Token blocks by id: the same id, the same tokens, in every replay of every configuration."""

    def __init__(self, seed: int, vocab: int, bt: int) -> None:
        self.seed, self.vocab, self.bt = seed, vocab, bt
        self._cache: dict[Any, list[int]] = {}

    def block(self, key: Any, n: int | None = None) -> list[int]:
        got = self._cache.get(key)
        if got is None:
            rng = random.Random(f"{self.seed}:{key}")
            got = self._cache[key] = [rng.randrange(VOCAB_LOW, self.vocab) for _ in range(self.bt)]
        return got if n is None else got[:n]


def _close_loop(calls: list[tuple[float, float, Call]]) -> list[Call]:
    """(trace start, trace end, call) sorted by start -> calls with deps and gaps (closed loop)."""
    calls.sort(key=lambda c: c[0])
    out = []
    for i, (t, _, c) in enumerate(calls):
        before = [j for j in range(i) if calls[j][1] <= t + 1e-9]
        if before:
            last_end = max(calls[j][1] for j in before)
            c.deps, c.gap_s = before, max(0.0, t - last_end)
        out.append(c)
    if calls:
        max(calls, key=lambda c: c[1])[2].last = True  # the call that ends the session
    return out


def gen_sessions(params: dict[str, Any], *, vocab: int, max_tokens: int, max_context: int,
                 token_seed: int = 0) -> list[Session]:
    """Sessions from a ``kvdb gen`` trace (``params``: kvdb.sim.generator.load_params); calls whose
    prompt would pass ``max_context`` tokens are cut to their last full block under it."""
    from kvdb.sim.generator import generate

    bt = params["block_tokens"]
    llm = float(params["llm_call_s"])
    tok = _Tokens(token_seed, vocab, bt)
    per: dict[str, list] = {}
    starts: dict[str, float] = {}
    head = params["system_prompt_blocks"]
    for line in generate(params):
        t = line["timestamp"] / 1000.0
        if line.get("type") == "workflow":
            starts[line["session_id"]] = t
            continue
        if line.get("type") is not None:
            continue
        ids = line["hash_ids"]
        partial = line["input_length"] - (len(ids) - 1) * bt
        tokens = [x for i in ids[:-1] for x in tok.block(i)] + tok.block(("p", ids[-1]), partial)
        if len(tokens) > max_context:
            tokens = tokens[: (max_context // bt) * bt - 1]
        hints = {k: v for k, v in (line.get("hints") or {}).items() if k == "expected_tool_duration_s"}
        c = Call(line["session_id"], line["agent_id"], tokens, max(1, min(max_tokens, line["output_length"])),
                 hints=hints, prefix_blocks=min(head, len(tokens) // bt))
        per.setdefault(line["session_id"], []).append((t, t + llm, c))
    t0 = min(starts.values(), default=0.0)
    return [Session(sid, starts.get(sid, t0) - t0, _close_loop(calls)) for sid, calls in per.items()]


SWE_DEFAULTS: dict[str, Any] = {
    "sessions": 4,
    "session_interarrival_mean_s": 20.0,
    "swe_shared_tokens": 1536,  # system prompt and the tools' docs (the same in every session)
    "swe_issue_tokens": [200, 900],
    "swe_steps_median": 12,  # 53-78 in the analysis; scaled down with the contexts
    "swe_steps_sigma": 0.5,
    "swe_action_tokens": [20, 120],  # the model's thought and command, appended to the history
    "swe_output_median_tokens": 250,  # a command's output (a file view, a test run)
    "swe_output_sigma": 1.0,
    "swe_output_max_tokens": 2000,
    "swe_tool_median_s": 2.0,
    "swe_tool_sigma": 1.0,
    "swe_tool_max_s": 120.0,
    "llm_call_s": 2.0,
}


def swe_sessions(*, seed: int, vocab: int, max_tokens: int, max_context: int, block_tokens: int,
                 **overrides: Any) -> list[Session]:
    """SWE-agent-like sessions (module docstring); ``overrides``: keys of ``SWE_DEFAULTS``."""
    p = dict(SWE_DEFAULTS)
    unknown = set(overrides) - set(p)
    if unknown:
        raise ValueError(f"unknown swe parameters {sorted(unknown)}")
    p.update(overrides)
    rng = random.Random(f"swe:{seed}")
    tok = _Tokens(seed, vocab, block_tokens)
    shared = [x for k in range(math.ceil(p["swe_shared_tokens"] / block_tokens)) for x in tok.block(("swe-sys", k))]
    shared = shared[: p["swe_shared_tokens"]]
    head = len(shared) // block_tokens
    out, t_start = [], 0.0
    llm = float(p["llm_call_s"])

    def text(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, vocab) for _ in range(n)]

    for s in range(p["sessions"]):
        t_start += rng.expovariate(1.0 / p["session_interarrival_mean_s"])
        sid = f"swe{s}"
        ctx = shared + text(rng.randint(*p["swe_issue_tokens"]))
        steps = max(1, round(rng.lognormvariate(math.log(p["swe_steps_median"]), p["swe_steps_sigma"])))
        calls, t = [], t_start
        for k in range(steps):
            last = k == steps - 1
            wait = min(p["swe_tool_max_s"], rng.lognormvariate(math.log(p["swe_tool_median_s"]), p["swe_tool_sigma"]))
            hints = {} if last else {"expected_tool_duration_s": round(wait, 3)}
            c = Call(sid, "swe-agent", list(ctx), max_tokens, hints=hints, prefix_blocks=head)
            calls.append((t, t + llm, c))
            t += llm + wait
            ctx += text(rng.randint(*p["swe_action_tokens"]))
            ctx += text(min(p["swe_output_max_tokens"],
                            round(rng.lognormvariate(math.log(p["swe_output_median_tokens"]), p["swe_output_sigma"]))))
            if len(ctx) + max_tokens > max_context:
                break
        out.append(Session(sid, t_start, _close_loop(calls)))
    t0 = min((s.start_s for s in out), default=0.0)
    for s in out:
        s.start_s -= t0
    return out
