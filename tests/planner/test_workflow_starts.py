"""W5's estimated starts, kept between calls (kvdb/planner/workflow.py ``_settle``), against a
reading of W5 from scratch after every step of random workflows."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdb.planner.workflow import Workflow


def starts_from_scratch(wf: Workflow, now: float, llm_s: float, tool_s: float) -> dict[str, float]:
    """W5 read literally: every node's end in topological order, then each agent's earliest
    pending LLM start."""
    end: dict[str, float] = {}
    best = {n.agent_id: math.inf for n in wf.nodes.values() if n.agent_id is not None}
    for nid in wf.order:
        n = wf.nodes[nid]
        ends = [end[d] for d in n.deps]
        if nid in wf.done:
            t = wf.done_s.get(nid)
            end[nid] = max(ends, default=0.0) if t is None else t + (llm_s if n.kind == "llm" else 0.0)
        elif n.kind == "tool":
            dur = tool_s if n.expected_duration_s is None else n.expected_duration_s
            end[nid] = max(now, max(ends, default=now) + dur)
        else:
            start = max(now, max(ends, default=now))
            end[nid] = start + llm_s
            if n.agent_id is not None:
                best[n.agent_id] = min(best[n.agent_id], start)
    return best


@st.composite
def workflows(draw):
    n = draw(st.integers(1, 12))
    nodes = []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        node = {"id": f"n{i}", "deps": [f"n{d}" for d in deps]}
        if draw(st.booleans()) and i:
            node["kind"] = "tool"
            dur = draw(st.none() | st.floats(0, 50))
            if dur is not None:
                node["expected_duration_s"] = dur
        agent = draw(st.none() | st.sampled_from(["a", "b", "c"]))
        if agent is not None:
            node["agent_id"] = agent
        nodes.append(node)
    return nodes


steps = st.lists(st.tuples(st.integers(0, 11), st.none() | st.floats(0, 200), st.floats(0, 300),
                           st.sampled_from([0.0, 2.0, 3.5])), max_size=25)


@settings(max_examples=300, deadline=None)
@given(workflows(), steps)
def test_kept_starts_match_w5_from_scratch(nodes, seq):
    wf = Workflow.from_spec("s", nodes)
    for i, done_s, now, llm_s in seq:
        nid = f"n{i % len(nodes)}"
        wf.mark_done(nid, done_s)  # a node done twice (its own call after an implicit W4) moves its end
        for t in (now, now + 1.0, now):  # a repeated now is answered from the last result
            assert wf.agent_next_start(t, llm_s, 5.0) == starts_from_scratch(wf, t, llm_s, 5.0)
