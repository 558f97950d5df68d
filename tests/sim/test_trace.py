"""Trace reader: every malformed line is an InvalidInput naming source:line (or the node)."""

from __future__ import annotations

import pytest

from kvdb.errors import InvalidInput
from kvdb.sim.trace import Call, SessionEndLine, WorkflowLine, parse_trace


def test_mooncake_and_kvdb_lines_parse():
    t = parse_trace(
        '{"timestamp": 1200, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n'
        "\n"
        '{"timestamp": 1300, "type": "workflow", "session_id": "s", "nodes": [{"id": "a", "agent_id": "x"}]}\n'
        '{"timestamp": 1400, "session_id": "s", "node_id": "a", "hash_ids": ["k0"], "block_tokens": 16,'
        ' "hints": {"expected_tool_duration_s": 3}}\n'
        '{"timestamp": 1500, "type": "session_end", "session_id": "s"}\n'
    )
    kinds = [type(r) for r in t.records]
    assert kinds == [Call, WorkflowLine, Call, SessionEndLine]
    c0, c1 = t.calls
    assert (c0.index, c0.line_no, c0.now_s, c0.hash_ids, c0.input_tokens, c0.block_tokens) == (0, 1, 1.2, [0, 1], 700, 512)
    assert (c1.index, c1.line_no, c1.session_id, c1.input_tokens, c1.hints) == (1, 4, "s", 16, {"expected_tool_duration_s": 3})
    assert t.distinct_blocks() == 3


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{bad", "t:2: malformed JSON"),
        ("[1, 2]", "t:2: a trace line must be a JSON object"),
        ('{"timestamp": 1}', "t:2: a call line needs 'hash_ids'"),
        ('{"hash_ids": 3}', "t:2: 'hash_ids' must be a list"),
        ('{"hash_ids": [1, 1]}', "t:2: 'hash_ids' repeats a hash"),
        ('{"hash_ids": [1.5]}', "t:2: every hash id must be an integer or a string"),
        ('{"hash_ids": [1], "timestamp": -1}', "t:2: 'timestamp' must be a finite number"),
        ('{"hash_ids": [1], "block_tokens": 0}', "t:2: 'block_tokens' must be > 0"),
        ('{"hash_ids": [1], "hints": [1]}', "t:2: 'hints' must be an object"),
        ('{"type": "nope"}', "t:2: unknown line type 'nope'"),
        ('{"type": "workflow", "session_id": "s", "nodes": [{"id": "a", "deps": ["zz"]}]}',
         "node 'a' depends on 'zz', which is not a node of the workflow (dangling dep)"),
        ('{"type": "workflow", "session_id": "s", "nodes": [{"id": "a", "deps": ["b"]}, {"id": "b", "deps": ["a"]}]}',
         "cycle through node 'a'"),
        ('{"type": "session_end"}', "t:2: a session_end line needs a 'session_id'"),
        ('{"hash_ids": [1], "hints": {"expected_tool_duration_s": -3}}',
         "t:2: hint 'expected_tool_duration_s' = -3 is negative"),
        ('{"hash_ids": [1], "hints": {"ttl_s": NaN}}', "t:2: hint 'ttl_s' = nan is NaN"),
        ('{"hash_ids": [1], "hints": {"ttl_s": "soon"}}', "t:2: hint 'ttl_s' = 'soon' must be a number"),
        ('{"hash_ids": [1], "hints": {"colour": 1}}', "t:2: hint 'colour' = 1 unknown hint"),
    ],
)
def test_bad_lines_name_the_line(line, needle):
    with pytest.raises(InvalidInput) as e:
        parse_trace('{"hash_ids": [0]}\n' + line + "\n", source="t")
    assert needle in str(e.value)
