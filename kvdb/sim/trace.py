"""The kvdb agent trace v1: its format, and the readers.

Format
    JSON Lines, one object per line, in time order (replays take lines in file order; blank
    lines are skipped). A Mooncake FAST'25 line is a valid call line::

        {"timestamp": 1200, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

    Every line
        ``timestamp``   milliseconds (Mooncake's unit), a finite number >= 0, default 0;
                        readers convert it to ``now_s``
        ``type``        "call" (default), "workflow" or "session_end"

    Call lines (one LLM call)
        ``hash_ids``      required: a list of distinct integers or strings; ``hash_ids[j]``
                          names the whole prefix up to block j, so equal ids mean shared blocks
        ``block_tokens``  tokens per block, an integer > 0, default 512
        ``input_length``  prompt tokens, default ``len(hash_ids) * block_tokens``
        ``output_length`` generated tokens, default 0
        ``session_id``, ``agent_id``, ``node_id``, ``tenant``   optional strings (integers are
                          read as strings). A session is opened by its first call when no
                          workflow line declared it; ``node_id`` names a node of the session's
                          workflow; with ``tenant`` a block's identity is (tenant, hash id)
        ``hints``         an object of hints (kvdb/planner/hints.py): ``expected_tool_duration_s``
                          (the session waits about this long after this call before its next),
                          ``ttl_s``, ``priority``, ``prefix_hash``, ``tool``

    Workflow lines (at a session's start: its planned DAG)
        ``session_id``  required
        ``nodes``       required: ``[{"id", "agent_id", "deps": [ids], "kind": "llm" | "tool",
                        "expected_duration_s"}]`` (kind defaults to "llm"; tools may carry an
                        expected duration), checked by kvdb/planner/workflow.py (W1, W2)
        ``tenant``      optional

    Session-end lines
        ``session_id``  required

    Example (a coordinator plans, one worker runs a tool, the coordinator aggregates)::

        {"timestamp": 0, "type": "workflow", "session_id": "s1", "nodes": [
            {"id": "plan", "agent_id": "coord"}, {"id": "w", "agent_id": "w1", "deps": ["plan"]},
            {"id": "t", "kind": "tool", "deps": ["w"], "expected_duration_s": 30},
            {"id": "agg", "agent_id": "coord", "deps": ["t"]}]}
        {"timestamp": 0, "session_id": "s1", "agent_id": "coord", "node_id": "plan", "hash_ids": [0, 1]}
        {"timestamp": 2000, "session_id": "s1", "agent_id": "w1", "node_id": "w", "hash_ids": [0, 2],
         "hints": {"expected_tool_duration_s": 30}}
        {"timestamp": 34000, "session_id": "s1", "agent_id": "coord", "node_id": "agg", "hash_ids": [0, 1, 3]}
        {"timestamp": 36000, "type": "session_end", "session_id": "s1"}

    (each line on one line in a file). How a replay uses the lines: kvdb/sim/replay.py (S1-S4).
    ``kvdb gen`` writes traces in this format (kvdb/sim/generator.py).

Readers
    Every malformed line raises InvalidInput naming ``source:line``; nothing is skipped
    silently. That includes hints the planner would reject (negative, NaN or non-numeric
    durations, unknown names): in a trace file they are damaged data. Through the engine API
    (Planner.hint) the same values are outcomes, not errors. Hints that would only be clipped
    are kept as written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Iterator

from kvdb.errors import InvalidInput
from kvdb.planner.hints import REJECTED, check_hint
from kvdb.planner.workflow import Workflow

DEFAULT_BLOCK_TOKENS = 512


@dataclass(slots=True)
class Call:
    index: int  # 0-based position among the trace's calls
    line_no: int
    now_s: float
    hash_ids: list[Hashable]
    input_tokens: int
    output_tokens: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    session_id: str | None = None
    agent_id: str | None = None
    node_id: str | None = None
    tenant: str | None = None
    hints: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class WorkflowLine:
    line_no: int
    now_s: float
    workflow: Workflow
    tenant: str | None = None


@dataclass(slots=True)
class SessionEndLine:
    line_no: int
    now_s: float
    session_id: str


Record = Call | WorkflowLine | SessionEndLine


def _opt_str(d: dict, key: str, where: str) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise InvalidInput(f"{where}: {key!r} must be a string, got {type(v).__name__}")
    return str(v)


def _nonneg_int(d: dict, key: str, where: str, default: int | None) -> int | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidInput(f"{where}: {key!r} must be an integer >= 0, got {v!r}")
    return v


def parse_line(text: str, line_no: int, call_index: int, source: str = "trace") -> Record | None:
    """One JSONL line -> a record; blank lines give None."""
    where = f"{source}:{line_no}"
    if not text.strip():
        return None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise InvalidInput(f"{where}: a trace line must be a JSON object, got {type(d).__name__}")
    ts = d.get("timestamp", 0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise InvalidInput(f"{where}: 'timestamp' must be a finite number >= 0 (milliseconds), got {ts!r}")
    now_s = ts / 1000.0
    kind = d.get("type", "call")
    if kind == "workflow":
        sid = _opt_str(d, "session_id", where)
        if sid is None:
            raise InvalidInput(f"{where}: a workflow line needs a 'session_id'")
        if "nodes" not in d:
            raise InvalidInput(f"{where}: a workflow line needs 'nodes'")
        wf = Workflow.from_spec(sid, d["nodes"], where=f"{where}: session {sid!r}")
        return WorkflowLine(line_no, now_s, wf, _opt_str(d, "tenant", where))
    if kind == "session_end":
        sid = _opt_str(d, "session_id", where)
        if sid is None:
            raise InvalidInput(f"{where}: a session_end line needs a 'session_id'")
        return SessionEndLine(line_no, now_s, sid)
    if kind != "call":
        raise InvalidInput(f"{where}: unknown line type {kind!r}; one of call, workflow, session_end")
    if "hash_ids" not in d:
        raise InvalidInput(f"{where}: a call line needs 'hash_ids' (the block hashes of its prefix)")
    ids = d["hash_ids"]
    if not isinstance(ids, list):
        raise InvalidInput(f"{where}: 'hash_ids' must be a list, got {type(ids).__name__}")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, (int, str)):
            raise InvalidInput(f"{where}: every hash id must be an integer or a string, got {h!r}")
    if len(set(ids)) != len(ids):
        raise InvalidInput(f"{where}: 'hash_ids' repeats a hash; each names a distinct prefix")
    block_tokens = _nonneg_int(d, "block_tokens", where, DEFAULT_BLOCK_TOKENS)
    if block_tokens == 0:
        raise InvalidInput(f"{where}: 'block_tokens' must be > 0")
    input_tokens = _nonneg_int(d, "input_length", where, len(ids) * block_tokens)
    output_tokens = _nonneg_int(d, "output_length", where, 0)
    hints = d.get("hints", {})
    if not isinstance(hints, dict):
        raise InvalidInput(f"{where}: 'hints' must be an object, got {type(hints).__name__}")
    for name, value in hints.items():
        o = check_hint(str(name), value)
        if o.status == REJECTED:
            raise InvalidInput(f"{where}: hint {name!r} = {value!r} {o.reason}")
    return Call(
        call_index, line_no, now_s, ids, input_tokens, output_tokens, block_tokens,
        _opt_str(d, "session_id", where), _opt_str(d, "agent_id", where),
        _opt_str(d, "node_id", where), _opt_str(d, "tenant", where), hints,
    )


def iter_records(lines: Iterable[str], source: str = "trace") -> Iterator[Record]:
    n_calls = 0
    for line_no, text in enumerate(lines, start=1):
        r = parse_line(text, line_no, n_calls, source)
        if r is None:
            continue
        if isinstance(r, Call):
            n_calls += 1
        yield r


@dataclass
class Trace:
    source: str
    records: list[Record]

    @property
    def calls(self) -> list[Call]:
        return [r for r in self.records if isinstance(r, Call)]

    def distinct_blocks(self) -> int:
        seen: set = set()
        for r in self.records:
            if isinstance(r, Call):
                seen.update(r.hash_ids)
        return len(seen)


def read_trace(path: str) -> Trace:
    try:
        with open(path, encoding="utf-8") as f:
            return Trace(str(path), list(iter_records(f, source=str(path))))
    except FileNotFoundError:
        from kvdb.errors import NotFound

        raise NotFound(f"trace {path!r} does not exist") from None


def parse_trace(text: str, source: str = "trace") -> Trace:
    return Trace(source, list(iter_records(text.splitlines(), source)))
