"""Sequential replay: hit ratios of a policy on a trace (the format: kvdb/sim/trace.py).

Semantics, shared by every policy and by the Belady bound:
  S1  a call's hits are its longest run of leading cached blocks;
  S2  after the call every block of it is offered to the cache: the policy sees one
      ``record_access`` with all the call's frames in chain order (new blocks get free frames);
  S3  then victims are evicted until at most ``capacity_blocks`` blocks stay resident -- so an
      offered block may leave at once, and within one call deeper blocks go first (R3);
  S4  a policy only ever sees the lines before and at the current call, the declared
      workflows and the hints (Belady alone is handed the future, to be the bound).

The simulated pool has ``capacity + longest call`` frames so that S2 never runs out of frames
before S3 trims. The longest call is a trace-wide figure, so no policy may size itself by the
pool (S4): ARC and the other policies sized by the cache (``CAPACITY_SIZED``) get ``capacity_frames`` (``policy_options``). Block identity is the hash id, or (tenant, hash id) when a tenant is named.
Workflow / session lines drive the same ``Planner`` the engine uses.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Hashable, Iterable

from kvdb.errors import CapacityError, InvalidInput
from kvdb.planner.policies import CAPACITY_SIZED, REPLAY_ONLY, make_policy
from kvdb.planner.sessions import Planner
from kvdb.sim.trace import Call, SessionEndLine, Trace, WorkflowLine


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int
    requests: int
    accesses: int
    hits: int
    block_hit_ratio: float
    token_hit_ratio: float
    policy_us_per_access: float
    input_tokens: int
    hit_tokens: int
    hints: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def block_id(call: Call, h: Hashable) -> Hashable:
    return h if call.tenant is None else (call.tenant, h)


def capacity_for(trace: Trace, fraction: float) -> int:
    """``fraction`` of the trace's distinct blocks, rounded down (0.01 of 182790 -> 1827)."""
    if not 0 < fraction <= 1:
        raise InvalidInput(f"a capacity fraction must be in (0, 1], got {fraction!r}")
    n = int(trace.distinct_blocks() * fraction)
    if n < 1:
        raise InvalidInput(f"{fraction!r} of {trace.distinct_blocks()} distinct blocks is under one block")
    return n


def policy_options(policy: str, capacity_blocks: int, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Options for ``make_policy`` in a replay: ARC's (and every ``CAPACITY_SIZED`` policy's) c is
    the resident capacity, not the pool."""
    opts = dict(options or {})
    if policy in CAPACITY_SIZED:
        opts.setdefault("capacity_frames", capacity_blocks)
    return opts


def replay(
    trace: Trace,
    policy: str,
    capacity_blocks: int,
    *,
    per_request: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[int], None] | None = None,
    options: dict[str, Any] | None = None,
) -> ReplayResult:
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
        raise InvalidInput(f"capacity must be a positive number of blocks, got {capacity_blocks!r}")
    calls = trace.calls
    longest = max((len(c.hash_ids) for c in calls), default=1)
    num_frames = capacity_blocks + max(longest, 1)
    future = None
    if policy in REPLAY_ONLY:
        future = [[block_id(c, h) for h in c.hash_ids] for c in calls]
    repl = make_policy(policy, num_frames, future=future, **policy_options(policy, capacity_blocks, options))
    planner = Planner([repl], clock=lambda: 0.0)

    table: dict[Hashable, int] = {}
    owner: list[Hashable] = [None] * num_frames
    free = list(range(num_frames - 1, -1, -1))
    hits_total = accesses = in_tok = hit_tok = 0
    policy_ns = 0
    perf = time.perf_counter_ns
    t0 = time.perf_counter()
    record_access, evict = repl.record_access, repl.evict
    for rec in trace.records:
        if isinstance(rec, WorkflowLine):
            sid = rec.workflow.session_id
            if planner.find_session(sid) is not None:
                raise InvalidInput(f"{trace.source}:{rec.line_no}: session {sid!r} declared twice")
            t = perf()
            planner.begin_session(sid, tenant=rec.tenant, workflow=rec.workflow, now_s=rec.now_s)
            policy_ns += perf() - t
            continue
        if isinstance(rec, SessionEndLine):
            if planner.find_session(rec.session_id) is None:
                raise InvalidInput(f"{trace.source}:{rec.line_no}: session_end for {rec.session_id!r}, which is not open")
            t = perf()
            planner.end_session(rec.session_id, now_s=rec.now_s)
            policy_ns += perf() - t
            continue
        call = rec
        ids = [block_id(call, h) for h in call.hash_ids]
        n_hit = 0
        for b in ids:
            if b in table:
                n_hit += 1
            else:
                break
        frames = []
        for b in ids:
            f = table.get(b)
            if f is None:
                f = free.pop()
                table[b] = f
                owner[f] = b
            frames.append(f)
        t = perf()
        try:
            ctx, _ = planner.call_started(call.session_id, node_id=call.node_id, agent_id=call.agent_id,
                                          tenant=call.tenant, hints=call.hints, now_s=call.now_s)
        except InvalidInput as e:
            raise InvalidInput(f"{trace.source}:{call.line_no}: {e}") from None
        if ids:
            record_access(frames, ids, ctx)
        planner.call_finished(call.session_id, node_id=call.node_id, agent_id=call.agent_id,
                              hints=ctx.hints, now_s=call.now_s)
        while len(table) > capacity_blocks:
            f = evict()
            if f is None:
                raise CapacityError(f"policy {policy!r} found no victim with {len(table)} blocks resident")
            del table[owner[f]]
            owner[f] = None
            free.append(f)
        policy_ns += perf() - t
        hits_total += n_hit
        accesses += len(ids)
        in_tok += call.input_tokens
        ht = min(n_hit * call.block_tokens, call.input_tokens)
        hit_tok += ht
        if per_request is not None:
            per_request({"call": call.index, "line": call.line_no, "session_id": call.session_id,
                         "blocks": len(ids), "hits": n_hit, "hit_tokens": ht, "hit_blocks": call.hash_ids[:n_hit]})
        if progress is not None:
            progress(1)
    return ReplayResult(
        policy=policy,
        capacity_blocks=capacity_blocks,
        requests=len(calls),
        accesses=accesses,
        hits=hits_total,
        block_hit_ratio=hits_total / accesses if accesses else 0.0,
        token_hit_ratio=hit_tok / in_tok if in_tok else 0.0,
        policy_us_per_access=policy_ns / 1000 / accesses if accesses else 0.0,
        input_tokens=in_tok,
        hit_tokens=hit_tok,
        hints=dict(planner.outcome_counts),
        elapsed_s=time.perf_counter() - t0,
    )


def gap_closure(h_policy: float, h_lru: float, h_belady: float) -> float | None:
    """(H_policy - H_lru) / (H_belady - H_lru); None when Belady has no headroom over LRU."""
    d = h_belady - h_lru
    return None if d <= 0 else (h_policy - h_lru) / d


def sweep(trace: Trace, policies: Iterable[str], capacities: Iterable[int], **kw: Any) -> list[ReplayResult]:
    return [replay(trace, p, c, **kw) for c in capacities for p in policies]
