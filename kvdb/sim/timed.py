"""Timed replay: TTFT and job completion time under the cost model (kvdb.planner.cost).

Model (one GPU; what each policy changes is which blocks are where, and when):

  T1  Tiers: ``device`` (``device_blocks``, managed by the policy under test, same frame
      mechanics as the sequential replay S1-S3), ``host`` (``host_blocks``, LRU) and ``disk``
      (``disk_blocks``, LRU; 0 = none, the default). A block the policy evicts from the
      device is offloaded to host (to disk when there is no host tier), a host victim to disk
      (off the critical path: written out while the GPU did other work); disk victims are
      dropped. A block lives in one tier.
  T2  A call's prefix is served from the longest leading run of blocks present in any tier.
      Host blocks reload at ``host_bytes_per_s``; a disk block at depth j reloads at
      ``disk_bytes_per_s`` when that is cheaper than recomputing it at depth j, else it is
      recomputed; blocks past the run are recomputed (prefill FLOPs grow with depth). After
      the call all its blocks are on the device (then trimmed, T1).
  T3  Prefetch in flight: a policy that predicts when a session returns
      (``predicted_return(session_id)``: tokencake, kvdb) starts reloading that session's
      host and disk blocks ``prefetch_lead_s`` before the predicted return. The reload overlaps the
      wait by ``min(1, (arrival - (predicted - lead)) / reload_time)`` of its duration; a
      prediction later than the arrival hides nothing.
  T4  The GPU runs prefill (reload + recompute) one call at a time, FIFO in trace order;
      decode runs batched alongside and does not hold the queue. TTFT = queueing + reload on
      the critical path + recompute. A call ends after ``output_tokens * decode_s_per_token``
      more.
  T5  Arrivals are the trace's timestamps (open loop, so the queue stays in trace order).
      Job completion time of a session = its span in the trace + the sum of its calls'
      TTFTs (each slow prefill pushes the rest of the session back) + its last call's decode.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Hashable

from kvdb.errors import CapacityError, InvalidInput
from kvdb.planner.cost import DEFAULT_COST, CostModel
from kvdb.planner.policies import REPLAY_ONLY, make_policy
from kvdb.planner.sessions import Planner
from kvdb.sim.replay import block_id, policy_options
from kvdb.sim.trace import Call, SessionEndLine, Trace, WorkflowLine


@dataclass
class TimedResult:
    policy: str
    device_blocks: int
    host_blocks: int
    requests: int
    sessions: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    jct_mean_s: float
    jct_p99_s: float
    device_hits: int
    host_hits: int
    prefetched_blocks: int
    recomputed_blocks: int
    elapsed_s: float
    disk_blocks: int = 0
    disk_hits: int = 0  # blocks reloaded from disk (T2: cheaper than their recompute)
    hints: dict[str, int] = field(default_factory=dict)  # hint outcomes: accepted / clipped / rejected

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed_replay(trace: Trace, policy: str, device_blocks: int, host_blocks: int, *, disk_blocks: int = 0,
                 cost: CostModel = DEFAULT_COST, prefetch_lead_s: float = 2.0) -> TimedResult:
    if device_blocks < 1 or host_blocks < 0 or disk_blocks < 0:
        raise InvalidInput(f"need device_blocks >= 1, host_blocks >= 0 and disk_blocks >= 0, "
                           f"got {device_blocks}, {host_blocks}, {disk_blocks}")
    if policy in REPLAY_ONLY:
        raise InvalidInput(f"{policy!r} is replay-only (it reads the future); the timed replay runs online policies")
    calls = trace.calls
    longest = max((len(c.hash_ids) for c in calls), default=1)
    num_frames = device_blocks + max(longest, 1)
    repl = make_policy(policy, num_frames, **policy_options(policy, device_blocks))
    predict = getattr(repl, "predicted_return", None)
    planner = Planner([repl], clock=lambda: 0.0)
    table: dict[Hashable, int] = {}
    owner: list[Hashable] = [None] * num_frames
    free = list(range(num_frames - 1, -1, -1))
    host: OrderedDict[Hashable, None] = OrderedDict()
    disk: OrderedDict[Hashable, None] = OrderedDict()
    lag: dict[Any, float] = {}
    first_arrival: dict[Any, float] = {}
    last_finish: dict[Any, float] = {}
    last_ttft: dict[Any, float] = {}  # TTFT of the call that finishes last (already in its finish)
    gpu_free = 0.0
    ttfts: list[float] = []
    dev_hits = host_hits = disk_hits = prefetched = recomputed = 0
    t0 = time.perf_counter()
    for rec in trace.records:
        if isinstance(rec, WorkflowLine):  # the same checks as the sequential replay
            sid = rec.workflow.session_id
            if planner.find_session(sid) is not None:
                raise InvalidInput(f"{trace.source}:{rec.line_no}: session {sid!r} declared twice")
            planner.begin_session(sid, tenant=rec.tenant, workflow=rec.workflow, now_s=rec.now_s)
            continue
        if isinstance(rec, SessionEndLine):
            if planner.find_session(rec.session_id) is None:
                raise InvalidInput(f"{trace.source}:{rec.line_no}: session_end for {rec.session_id!r}, which is not open")
            planner.end_session(rec.session_id, now_s=rec.now_s)
            continue
        call: Call = rec
        skey = call.session_id if call.session_id is not None else ("call", call.index)
        arrival = call.now_s
        first_arrival.setdefault(skey, arrival)
        ids = [block_id(call, h) for h in call.hash_ids]
        n_dev = n_host = n_disk = served = 0  # served: the run of present blocks (T2)
        bt = call.block_tokens
        disk_recompute_s = 0.0  # disk blocks of the run that are cheaper to recompute (T2)
        for j, b in enumerate(ids):
            if b in table:
                n_dev += 1
            elif b in host:
                n_host += 1
            elif b in disk:
                one = cost.prefill_s(j, j + 1, bt)
                if cost.reload_s(1, bt, "disk") < one:
                    n_disk += 1
                else:
                    disk_recompute_s += one
                    recomputed += 1
            else:
                break
            served += 1
        predicted = predict(call.session_id) if (predict is not None and call.session_id is not None) else None
        reload_s = cost.reload_s(n_host, bt) + cost.reload_s(n_disk, bt, "disk")
        hidden = 0.0
        if predicted is not None and (n_host or n_disk) and reload_s > 0:
            start_pf = predicted - prefetch_lead_s
            hidden = max(0.0, min(1.0, (arrival - start_pf) / reload_s)) if arrival > start_pf else 0.0
            prefetched += int(round((n_host + n_disk) * hidden))
        recompute_s = cost.prefill_s(served, len(ids), bt) + disk_recompute_s
        start = max(arrival, gpu_free)
        ttft = (start - arrival) + reload_s * (1.0 - hidden) + recompute_s
        gpu_free = arrival + ttft
        finish = arrival + ttft + call.output_tokens * cost.decode_s_per_token
        ttfts.append(ttft)
        dev_hits += n_dev
        host_hits += n_host
        disk_hits += n_disk
        recomputed += len(ids) - served
        lag[skey] = lag.get(skey, 0.0) + ttft
        if finish >= last_finish.get(skey, 0.0):
            last_ttft[skey] = ttft
        last_finish[skey] = max(last_finish.get(skey, 0.0), finish)
        # the call's blocks go to the device (T2), then the policy trims it (T1)
        frames = []
        for b in ids:
            host.pop(b, None)
            disk.pop(b, None)
            f = table.get(b)
            if f is None:
                f = free.pop()
                table[b] = f
                owner[f] = b
            frames.append(f)
        try:
            ctx, _ = planner.call_started(call.session_id, node_id=call.node_id, agent_id=call.agent_id,
                                          tenant=call.tenant, hints=call.hints, now_s=arrival)
        except InvalidInput as e:
            raise InvalidInput(f"{trace.source}:{call.line_no}: {e}") from None
        if ids:
            repl.record_access(frames, ids, ctx)
        planner.call_finished(call.session_id, node_id=call.node_id, agent_id=call.agent_id,
                              hints=ctx.hints, now_s=arrival)
        while len(table) > device_blocks:
            f = repl.evict()
            if f is None:
                raise CapacityError(f"policy {policy!r} found no victim")
            b = owner[f]
            del table[b]
            owner[f] = None
            free.append(f)
            down = b
            if host_blocks:  # without a host tier, device victims go straight to disk
                host[b] = None
                down = host.popitem(last=False)[0] if len(host) > host_blocks else None
            if down is not None and disk_blocks:
                disk[down] = None
                if len(disk) > disk_blocks:
                    disk.popitem(last=False)
    # T5: span + accumulated TTFT (lag) + the decode of the call that ends last
    jcts = [last_finish[k] - first_arrival[k] + lag[k] - last_ttft[k] for k in last_finish]
    return TimedResult(
        policy=policy, device_blocks=device_blocks, host_blocks=host_blocks, requests=len(calls),
        sessions=len(jcts), ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p50_s=_pct(ttfts, 0.5), ttft_p99_s=_pct(ttfts, 0.99),
        jct_mean_s=sum(jcts) / len(jcts) if jcts else 0.0, jct_p99_s=_pct(jcts, 0.99),
        device_hits=dev_hits, host_hits=host_hits, prefetched_blocks=prefetched, recomputed_blocks=recomputed,
        elapsed_s=time.perf_counter() - t0, disk_blocks=disk_blocks, disk_hits=disk_hits,
        hints=dict(planner.outcome_counts),
    )
