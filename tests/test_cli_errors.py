"""User errors in the CLI (issue 15): one line on stderr, never a traceback, and the documented
exit codes (kvdb/cli/main.py: 2 usage, 1 runtime, 3 corruption)."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli

SECRET = "0123456789abcdef0123456789abcdef\n"


run = run_cli


def check(r, code: int, *needles: str):
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == code, r.output
    for n in needles:
        assert n in r.output, r.output


@pytest.fixture
def trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "hash_ids": [0, 1, 2]}) + "\n")
    return p


def test_sim_on_a_binary_file(tmp_path):
    p = tmp_path / "bin.trace"
    p.write_bytes(bytes(range(256)) * 4)
    check(run("sim", p, "--policy", "lru", "--capacity", "4"), 1, "kvdb: error:", "not a text file")


def test_sim_on_an_empty_trace(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    check(run("sim", p, "--policy", "lru", "--capacity", "4"), 1, "kvdb: error:", "empty trace")


def test_sim_negative_capacity_is_a_usage_error(trace):
    check(run("sim", trace, "--policy", "lru", "--capacity", "-5"), 2, "--capacity")
    check(run("sim", trace, "--policy", "lru", "--capacity-fraction", "-0.5"), 2, "--capacity-fraction")
    check(run("sim", trace, "--policy", "nope", "--capacity", "4"), 2, "unknown policy")


def test_sim_unwritable_output_is_a_runtime_error(trace, tmp_path):
    out = tmp_path / "missing-dir" / "per-request.jsonl"
    check(run("sim", trace, "--policy", "lru", "--capacity", "4", "--per-request-out", out), 1, "kvdb: error:")


def test_gen_with_a_missing_params_file(tmp_path):
    check(run("gen", "--params", tmp_path / "nope.json", "-o", tmp_path / "t.jsonl"), 2, "nope.json")
    check(run("gen", "--prompts", "--params", tmp_path / "nope.json", "-o", tmp_path / "t.jsonl"), 2, "nope.json")


def test_gen_with_an_unwritable_output(tmp_path):
    check(run("gen", "--sessions", "1", "-o", tmp_path / "missing-dir" / "t.jsonl"), 1,
          "kvdb: error:", "cannot write the trace")


def test_replicate_serve_on_an_address_the_host_lacks(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    db = tmp_path / "db"
    # 203.0.113.0/24 is TEST-NET-3 (RFC 5737): never an address of this host
    r = run("replicate", "serve", "--db", db, "--listen", "203.0.113.7:0", "--secret-file", secret,
            "--transport", "tcp", "--model-id", "m")
    check(r, 2, "--listen", "203.0.113.7")
    assert not db.exists()  # refused before the data directory was made
    r = run("replicate", "serve", "--db", db, "--listen", "no-such-host.invalid:0", "--secret-file", secret,
            "--transport", "tcp")
    check(r, 2, "--listen")
    r = run("replicate", "serve", "--db", db, "--listen", "localhost", "--secret-file", secret, "--transport", "tcp")
    check(r, 2, "--listen")
    assert not db.exists()
