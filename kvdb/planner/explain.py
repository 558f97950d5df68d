"""EXPLAIN for a workflow: the plan the planner would follow, as a tree.

Input: a workflow spec ``{"session_id", "nodes": [...], "shared_prefix_blocks", "block_tokens",
"offload_after_s"}``; nodes may carry ``prompt_blocks`` (the blocks of the node's prompt,
default 8 + 2 per earlier call of its agent). Output, per node in topological order:

    id, agent_id, kind, deps, start_s   estimated start (critical path: LLM calls take
                                        ``llm_call_s``, tools their expected_duration_s)
    reuse: [{"blocks": n, "from": "device" | "host", "what": "shared prefix" | "agent history"}]
    prefetch_deadline_s                 when host blocks must be back on the device
    expected_prefill_saved_s            recompute time the reuse saves (kvdb.planner.cost)

An agent's history is offloaded to host when its next node starts more than
``offload_after_s`` (default 5 s) after its previous one ended (a long tool wait), and
prefetched back with deadline = start_s; otherwise it stays on the device.
The tree nests each node under the dep that finishes last (its critical-path parent).
"""

from __future__ import annotations

from typing import Any, Mapping

from kvdb.errors import InvalidInput
from kvdb.planner.cost import DEFAULT_COST, CostModel
from kvdb.planner.workflow import Workflow

LLM_CALL_S = 2.0


def explain(spec: Mapping[str, Any], *, cost: CostModel = DEFAULT_COST) -> dict[str, Any]:
    if not isinstance(spec, Mapping) or "nodes" not in spec:
        raise InvalidInput("a workflow file must be a JSON object with 'nodes'")
    sid = str(spec.get("session_id", "workflow"))
    wf = Workflow.from_spec(sid, spec["nodes"], where=f"workflow {sid!r}")
    raw = {str(n["id"]): n for n in spec["nodes"]}
    shared = int(spec.get("shared_prefix_blocks", 8))
    bt = int(spec.get("block_tokens", 512))
    offload_after = float(spec.get("offload_after_s", 5.0))
    if shared < 0 or bt < 1 or offload_after < 0:
        raise InvalidInput("shared_prefix_blocks >= 0, block_tokens >= 1 and offload_after_s >= 0 are required")
    end: dict[str, float] = {}
    start: dict[str, float] = {}
    parent: dict[str, str | None] = {}
    agent_last: dict[str, tuple[float, int]] = {}  # agent -> (end of its last llm node, prompt blocks)
    agent_calls: dict[str, int] = {}
    rows: dict[str, dict[str, Any]] = {}
    for nid in wf.order:
        n = wf.nodes[nid]
        s = max((end[d] for d in n.deps), default=0.0)
        parent[nid] = max(n.deps, key=lambda d: (end[d], d)) if n.deps else None
        start[nid] = s
        row: dict[str, Any] = {"id": nid, "agent_id": n.agent_id, "kind": n.kind, "deps": list(n.deps),
                               "start_s": round(s, 3)}
        if n.kind == "tool":
            end[nid] = s + (n.expected_duration_s or 0.0)
            row["expected_duration_s"] = n.expected_duration_s
            row["plan"] = "offload the agent's blocks to host" if (n.expected_duration_s or 0.0) > offload_after else "keep on device"
        else:
            end[nid] = s + LLM_CALL_S
            k = agent_calls.get(n.agent_id or "", 0)
            pb = raw[nid].get("prompt_blocks", shared + 2 * (k + 1))
            if not isinstance(pb, int) or pb < 0:
                raise InvalidInput(f"workflow {sid!r}: node {nid!r}: prompt_blocks must be an integer >= 0")
            reuse = []
            reused = min(shared, pb)
            if reused:
                reuse.append({"blocks": reused, "from": "device", "what": "shared prefix"})
            prev = agent_last.get(n.agent_id or "")
            deadline = None
            if prev is not None:
                hist = max(0, min(prev[1], pb) - reused)
                if hist:
                    gap = s - prev[0]
                    tier = "host" if gap > offload_after else "device"
                    reuse.append({"blocks": hist, "from": tier, "what": "agent history"})
                    if tier == "host":
                        deadline = round(s - cost.reload_s(hist, bt), 3)
                    reused += hist
            row["prompt_blocks"] = pb
            row["reuse"] = reuse
            row["prefetch_deadline_s"] = deadline
            row["expected_prefill_saved_s"] = round(cost.prefill_s(0, reused, bt), 4)
            agent_calls[n.agent_id or ""] = k + 1
            agent_last[n.agent_id or ""] = (end[nid], pb)
        rows[nid] = row
    children: dict[str | None, list[str]] = {}
    for nid in wf.order:
        children.setdefault(parent[nid], []).append(nid)

    def tree(nid: str) -> dict[str, Any]:
        r = dict(rows[nid])
        r["children"] = [tree(c) for c in children.get(nid, [])]
        return r

    total = sum(r.get("expected_prefill_saved_s", 0.0) for r in rows.values())
    return {"session_id": sid, "block_tokens": bt, "cost_model": cost.as_dict(),
            "expected_prefill_saved_s": round(total, 4),
            "makespan_s": round(max(end.values(), default=0.0), 3),
            "plan": [tree(r) for r in children.get(None, [])]}


def render(plan: Mapping[str, Any]) -> str:
    """Indented text tree for terminals."""
    out = [f"workflow {plan['session_id']}: makespan ~{plan['makespan_s']} s, "
           f"expected prefill saved {plan['expected_prefill_saved_s']} s"]

    def walk(node: Mapping[str, Any], depth: int) -> None:
        pad = "  " * depth
        head = f"{pad}-> {node['id']} [{node['kind']}"
        head += f", agent {node['agent_id']}]" if node.get("agent_id") else "]"
        head += f" start {node['start_s']} s"
        if node["kind"] == "tool":
            head += f", {node.get('plan')}"
        else:
            parts = [f"{r['blocks']} {r['what']} from {r['from']}" for r in node.get("reuse", [])]
            head += f"; reuse {', '.join(parts) if parts else 'nothing'}"
            if node.get("prefetch_deadline_s") is not None:
                head += f"; prefetch by {node['prefetch_deadline_s']} s"
            head += f"; saves {node['expected_prefill_saved_s']} s"
        out.append(head)
        for c in node.get("children", []):
            walk(c, depth + 1)

    for n in plan["plan"]:
        walk(n, 1)
    return "\n".join(out)
