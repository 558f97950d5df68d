"""Bad arguments leave no trace (issue 14, hole 6; docs/style.md "Errors": check arguments
before changing anything): every public call of the Db answers a malformed argument with a
typed ``InvalidInput`` that says what is wrong, and afterwards the store is as it was -- the
same stats, the same pool occupancy, the same log bytes on disk, the same sessions. Also
two API items of issue 15: ``prefix_hash`` takes the key object, and ``kvdb.open`` spells out
every option (no ``**kwargs``), as docs/api.md's row lists them."""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from helpers import LAYOUT, Clock, agent_call, blocks_for, open_db

import kvdb
from kvdb.errors import InvalidInput
from kvdb.planner.hints import ACCEPTED, CLIPPED, REJECTED, check_hint
from kvdb.prompts import render


def log_bytes(path) -> int:
    """Bytes of the log on disk (every segment under PATH/wal/)."""
    return sum(p.stat().st_size for p in (Path(path) / "wal").rglob("*") if p.is_file())


def snapshot(db, path) -> tuple:
    """What a call that raised must not have changed: stats (tiers, lookups, hints, plans,
    sessions, prompts), every open session's explain, and the log's size on disk."""
    return db.stats(), db.explain(session_id="s-open"), log_bytes(path)


# ---------------------------------------------------------------- positions: the frame leak


@pytest.mark.parametrize("durability", ["none", "group", "sync"])
def test_position_past_int32_stores_nothing_in_any_tier(tmp_path, durability):
    # Scenario: a 4-frame host tier over an unbounded disk tier; 4 puts with positions=[2**31]
    # each used to reserve a frame, fail with an OverflowError and leak it (under group/sync
    # the block was fsynced first). Now each is InvalidInput before anything happens, and 4
    # good puts afterwards fill the tier.
    with open_db(tmp_path, host_pages=4, disk_bytes=None) as db:
        keys = db.block_keys(list(range(32)))  # 8 blocks
        blocks = blocks_for(8)
        before = log_bytes(tmp_path)
        for i in range(4):
            with pytest.raises(InvalidInput, match=r"positions must be ints in \[0, 2147483647\].*2147483648"):
                db.put_blocks(keys[i : i + 1], blocks[i : i + 1], positions=[2**31], durability=durability)
        assert [db.contains(k) for k in keys[:4]] == [False] * 4
        assert db.stats()["tiers"]["host"]["pages"] == 0
        assert log_bytes(tmp_path) == before  # nothing appended, nothing fsynced
        assert db.put_blocks(keys[4:], blocks[4:], positions=[4, 5, 6, 2**31 - 1], durability=durability) == 4
        assert db.stats()["tiers"]["host"]["pages"] == 4  # no frame was lost
        out = torch.empty((4, *LAYOUT.block_shape))
        db.get_blocks(keys[4:], out=out)
        assert torch.equal(out, blocks[4:])


# ---------------------------------------------------------------- one value each, named in the issue


def test_match_prefix_of_none_is_invalid_input(tmp_path):
    with open_db(tmp_path) as db:
        with pytest.raises(InvalidInput, match="keys must be a sequence of 16-byte keys, got NoneType"):
            db.match_prefix(None)
        assert db.stats()["tiers"]["host"]["misses"] == 0


@pytest.mark.parametrize("tenant", ["\ud800", "acme\udfff"])
def test_unencodable_tenant_is_invalid_input(tmp_path, tenant):
    with open_db(tmp_path) as db:
        with pytest.raises(InvalidInput, match="not valid Unicode text"):
            db.block_keys(list(range(8)), tenant=tenant)
        with pytest.raises(InvalidInput, match="not valid Unicode text"):
            db.engine_keys([b"h"], tenant=tenant)
        with pytest.raises(InvalidInput, match="not valid Unicode text"):
            db.begin_session("s", tenant=tenant)
        with pytest.raises(InvalidInput, match="not valid Unicode text"):
            db.call_started("s", tenant=tenant)
        assert db.stats()["sessions"] == 0


@pytest.mark.parametrize("option, value, match", [
    ("host_bytes", 10**30, "host_bytes must be between 0 and 2\\*\\*62"),
    ("disk_bytes", float("nan"), "disk_bytes must be a size in bytes"),
    ("device_free_fraction", 10**400, "device_free_fraction=.* past the range of a float"),
    ("session_idle_s", 10**400, "session_idle_s=.* past the range of a float"),
    ("max_space_amp", 10**400, "max_space_amp=.* past the range of a float"),
    ("writeback_s", 0, "writeback_s must be a positive finite number of seconds or None"),
    ("writeback_s", float("inf"), "writeback_s must be a positive finite number of seconds or None"),
    ("writeback_s", "1s", "writeback_s must be a number, got str"),
    ("tp_rank", -1, r"tp_rank must be in \[0, tp_size - 1 = 1\], got -1"),
    ("tp_rank", 2, r"tp_rank must be in \[0, tp_size - 1 = 1\], got 2"),
    ("pp_rank", -1, r"pp_rank must be in \[0, pp_size - 1 = 1\], got -1"),
    ("pp_rank", 5, r"pp_rank must be in \[0, pp_size - 1 = 1\], got 5"),
    ("tp_size", 0, r"tp_size must be in \[1, "),
    ("key_algo", "md5", "unknown key algorithm 'md5'"),
    ("codec", "lz4", "codec must be one of \\['raw', 'zstd'\\], got 'lz4'"),
    ("clock", 12.5, "clock must be a callable"),
], ids=lambda v: f"{v:.12}" if isinstance(v, str) else (repr(v) if abs(v) < 10**9 else "huge"))
def test_bad_open_options_touch_nothing(tmp_path, option, value, match):
    # Scenario: a new directory opened with one bad option: InvalidInput, and no directory made.
    kw = {"host_bytes": 4096, "tp_size": 2, "pp_size": 2, option: value}
    path = tmp_path / "new"
    with pytest.raises(InvalidInput, match=match):
        kvdb.open(path, layout=LAYOUT, model_id="m", **kw)
    assert not path.exists()


def test_engine_keys_of_ints_and_bytes_never_collide(tmp_path):
    # the rule (kvdb/keys.py "Engine keys"): int and bytes hashes are distinct namespaces
    with open_db(tmp_path) as db:
        assert db.engine_keys([1]) != db.engine_keys([b"\x01"])
        assert db.engine_keys([0]) != db.engine_keys([b"\x00"])
        assert db.engine_keys([-1]) != db.engine_keys([b"\xff"])
        assert db.engine_keys([b"\x01"]) == db.engine_keys([bytearray(b"\x01")])
        for bad, match in [(b"\x01\x02", "got one bytes"), (None, "got one NoneType"),
                           ([1.5], "engine hash must be int or bytes, got float"),
                           ([True], "engine hash must be int or bytes, got bool")]:
            with pytest.raises(InvalidInput, match=match):
                db.engine_keys(bad)


@pytest.mark.parametrize("name, value, status, used", [
    ("expected_tool_duration_s", 10**400, CLIPPED, 86_400.0),
    ("ttl_s", 10**400, CLIPPED, 86_400.0),
    ("ttl_s", -(10**400), REJECTED, None),
    ("priority", 10**400, CLIPPED, 9),
    ("priority", -(10**400), CLIPPED, 0),
    ("prefix_hash", 10**400, ACCEPTED, 10**400),
    ("prefix_hash", b"\x01" * 16, ACCEPTED, "01" * 16),
    ("prefix_hash", b"\x01" * 15, REJECTED, None),
], ids=lambda v: v if isinstance(v, str) else ("huge" if isinstance(v, int) and abs(v) > 10**9 else type(v).__name__))
def test_huge_hint_values_are_outcomes_not_overflow(name, value, status, used):
    o = check_hint(name, value)
    assert (o.status, o.value) == (status, used)


def test_huge_hints_through_the_session_api(tmp_path):
    with open_db(tmp_path) as db:
        _, out = db.call_started("s", agent_id="a", hints={"ttl_s": 10**400, "priority": 10**400})
        assert [(o.status, o.value) for o in out] == [(CLIPPED, 86_400.0), (CLIPPED, 9)]
        out = db.call_finished("s", agent_id="a", hints={"expected_tool_duration_s": 10**400})
        assert [(o.status, o.value) for o in out] == [(CLIPPED, 86_400.0)]
        assert [(o.status, o.value) for o in db.hint("s", ttl_s=10**400)] == [(CLIPPED, 86_400.0)]
        with pytest.raises(InvalidInput, match="expected_duration_s must be a finite number >= 0"):
            db.begin_session("w", workflow=[{"id": "t", "kind": "tool", "expected_duration_s": 10**400}])
        with pytest.raises(InvalidInput, match="expected_duration_s must be a finite number >= 0"):
            db.explain({"nodes": [{"id": "t", "kind": "tool", "expected_duration_s": 10**400}]})


# ---------------------------------------------------------------- the sweep: every call, bad arguments, no trace

KEYS = [bytes([i]) * 16 for i in range(3)]
NAN, INF, HUGE = float("nan"), float("inf"), 10**400


def _prompt():
    return render({"system": "You are terse.", "messages": [{"role": "user", "content": "hello there"}]},
                  encode=lambda text: [ord(c) for c in text])


def _out(n=3):
    return torch.empty((n, *LAYOUT.block_shape))


# (call, match): each must raise InvalidInput matching ``match`` and change nothing
SWEEP = [
    (lambda db: db.put_blocks(None, blocks_for(1)), "keys must be a sequence"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), positions=[2**31]), "positions must be ints"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), positions=[-1]), "positions must be ints"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), positions=[1.5]), "positions must be ints"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), positions=7), "positions must be a sequence"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), positions=[1, 2]), "positions has 2 entries for 1 keys"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), durability="fast"), "durability must be one of"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), tier="gpu"), "tier must be None or 'disk'"),
    (lambda db: db.put_blocks(KEYS[:1], blocks_for(1), ctx="s"), "ctx must be the context call_started"),
    (lambda db: db.put_blocks([b"short"], blocks_for(1)), "each key must be 16 bytes"),
    (lambda db: db.match_prefix(None), "keys must be a sequence"),
    (lambda db: db.match_prefix(KEYS[0]), "not one bytes"),
    (lambda db: db.match_prefix(KEYS, ctx=1), "ctx must be"),
    (lambda db: db.contains(b"short"), "each key must be 16 bytes"),
    (lambda db: db.get_blocks(None, out=_out()), "keys must be a sequence"),
    (lambda db: db.get_blocks(KEYS, out=_out(), ctx=[]), "ctx must be"),
    (lambda db: db.get_blocks(KEYS, out=_out(2)), "shape"),
    (lambda db: db.get_prefix(7, out=_out()), "keys must be a sequence"),
    (lambda db: db.pin(None), "keys must be a sequence"),
    (lambda db: db.pin(KEYS, ctx="x"), "ctx must be"),
    (lambda db: db.delete(None), "keys must be a sequence"),
    (lambda db: db.delete("abc"), "not one str"),
    (lambda db: db.prefetch(None), "keys must be a sequence"),
    (lambda db: db.offload(None), "keys must be a sequence"),
    (lambda db: db.offload(KEYS, to="gpu"), "offload to must be"),
    (lambda db: db.reserve_frames(-1), "count >= 0"),
    (lambda db: db.block_keys([1, 2, 3, 4], tenant="\ud800"), "not valid Unicode"),
    (lambda db: db.block_keys([-1, 2, 3, 4]), "outside uint32"),
    (lambda db: db.block_keys([1, 2, 3, 4], public_prefix_tokens=True), "public_prefix_tokens must be an int"),
    (lambda db: db.engine_keys(None), "engine block hashes"),
    (lambda db: db.engine_keys([1.5]), "engine hash must be int or bytes"),
    (lambda db: db.begin_session(5), "session id must be a non-empty string"),
    (lambda db: db.begin_session("new", tenant="\ud800"), "not valid Unicode"),
    (lambda db: db.begin_session("new", hints=[("ttl_s", 1)]), "hints must be a mapping"),
    (lambda db: db.begin_session("new", now_s=HUGE), "now_s must be a finite number"),
    (lambda db: db.begin_session("new", now_s=NAN), "now_s must be a finite number"),
    (lambda db: db.begin_session("s-open"), "already open"),
    (lambda db: db.call_started(5), "session id must be a non-empty string"),
    (lambda db: db.call_started("new", now_s=INF), "now_s must be a finite number"),
    (lambda db: db.call_started("new", now_s="soon"), "now_s must be a number"),
    (lambda db: db.call_started("new", hints="ttl_s"), "hints must be a mapping"),
    (lambda db: db.call_started("new", tenant="\ud800"), "not valid Unicode"),
    (lambda db: db.call_started("s-open", hints={"ttl_s": 5}, now_s=HUGE), "now_s must be a finite number"),
    (lambda db: db.call_finished("s-open", agent_id="a", hints={"ttl_s": 5}, now_s=HUGE), "now_s must be"),
    (lambda db: db.call_finished(["s-open"]), "session id must be a non-empty string"),
    (lambda db: db.call_started("s-open", agent_id=["a"]), "agent_id must be a non-empty string or None"),
    (lambda db: db.call_started("new", node_id={"n": 1}), "node_id must be a non-empty string or None"),
    (lambda db: db.call_finished("s-open", agent_id=["a"]), "agent_id must be a non-empty string or None"),
    (lambda db: db.hint("s-open", agent_id=["a"], ttl_s=5), "agent_id must be a non-empty string or None"),
    (lambda db: db.hint("s-open", ttl_s=5, now_s=NAN), "now_s must be a finite number"),
    (lambda db: db.hint("s-open", agent_id="nobody", ttl_s=5), "has no agent 'nobody'"),
    (lambda db: db.end_session("s-open", now_s=HUGE), "now_s must be a finite number"),
    (lambda db: db.explain(), "explain needs a workflow spec"),
    (lambda db: db.note_prompt(None), "expected a rendered prompt"),
    (lambda db: db.note_prompt(_prompt(), block_keys=5), "keys must be a sequence"),
    (lambda db: db.note_prompt(_prompt(), session_id="s-open", tenant="\ud800"), "not valid Unicode"),
    (lambda db: db.near_match(_prompt(), tenant=""), "tenant must be a non-empty string"),
    (lambda db: db.near_match("a prompt"), "expected a rendered prompt"),
    (lambda db: db.push(KEYS, "127.0.0.1:1"), "this Db has no replication"),
    (lambda db: db.sync_replicas(), "this Db has no replication"),
    (lambda db: db.push(None, "127.0.0.1:1"), "keys must be a sequence"),
    (lambda db: db.push(KEYS, 7070), "peer must be a 'host:port' string"),
    (lambda db: db.push(KEYS, "127.0.0.1:1", durability="later"), "durability must be one of"),
    (lambda db: db.sync_replicas(timeout_s=NAN), "timeout_s must be a finite number"),
    (lambda db: db.sync_replicas(timeout_s=HUGE), "timeout_s must be a finite number"),
]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    # Scenario: one Db with a 4-frame host tier over a disk tier, 2 blocks stored (one on disk
    # only) and one open session with one finished call; each bad call runs against it in turn.
    path = tmp_path_factory.mktemp("sweep")
    db = open_db(path, host_pages=4, disk_bytes=None, durability="group")
    db.put_blocks(KEYS[:2], blocks_for(2), positions=[0, 1])
    db.offload(KEYS[1:2], to="disk")
    db.begin_session("s-open", tenant="acme", hints={"ttl_s": 60})
    db.call_started("s-open", agent_id="a")
    db.call_finished("s-open", agent_id="a")
    yield db, path
    db.close()


@pytest.mark.parametrize("call, match", SWEEP, ids=[f"{i}-{m[:24]}" for i, (_, m) in enumerate(SWEEP)])
def test_bad_arguments_raise_invalid_input_and_change_nothing(swept, call, match):
    db, path = swept
    before = snapshot(db, path)
    with pytest.raises(InvalidInput, match=match):
        call(db)
    assert snapshot(db, path) == before
    assert db.stats()["tiers"]["host"]["pages"] == 1  # KEYS[0] in memory, KEYS[1] on disk only
    assert db.match_prefix(KEYS, peek=True) == 2


def test_snapshot_sees_a_change(swept):
    # the sweep's oracle is not blind: a good call moves it
    db, path = swept
    before = snapshot(db, path)
    db.hint("s-open", priority=3)
    assert snapshot(db, path) != before
    assert math.isfinite(db.stats()["sessions"])


# ---------------------------------------------------------------- issue 15: the API as the docs show it


def test_prefix_hash_takes_the_key_object_itself(tmp_path):
    # Scenario: docs/api.md says prefix_hash is "the key of a shared prefix's last block": the
    # BlockKey from db.block_keys resolves and protects the prefix just as its .hex() does.
    with open_db(tmp_path, Clock()) as db:
        keys = db.block_keys(list(range(12)), tenant="acme")  # 3 blocks
        db.begin_session("s0", tenant="acme")
        agent_call(db, "s0", "a", keys, blocks_for(3))
        out = db.begin_session("s1", tenant="acme", hints={"prefix_hash": keys[1]})
        assert [(o.name, o.status, o.value) for o in out] == [("prefix_hash", "accepted", keys[1].hex())]
        db.run_plans()
        assert db.explain(session_id="s1")["prefix"]["blocks"] == 2
        out = db.begin_session("s2", tenant="acme", hints={"prefix_hash": keys[1].hex()})
        assert out[0].status == "accepted"
        assert db.stats()["plans"]["prefixes"] == 1  # the same prefix, named both ways


def _api_doc_open_params() -> list[str]:
    """kvdb.open's parameters as docs/api.md's row lists them (the option reference the README links)."""
    api = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    row = next(line for line in api.splitlines() if line.startswith("| `kvdb.open("))
    inside = re.search(r"`kvdb\.open\((.*?)\)`", row).group(1)
    names = []
    for part in inside.split(", "):
        part = part.split("=")[0].strip()
        if part != "*":
            names.extend(part.split("/"))  # tp_rank/tp_size/pp_rank/pp_size=None
    return names


def test_kvdb_open_signature_is_explicit_and_matches_db_and_api_doc():
    sig = inspect.signature(kvdb.open)
    params = sig.parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # every Db option, with the Db's own default (kvdb.open passes each through unchanged)
    db_params = inspect.signature(kvdb.Db.__init__).parameters
    for name, p in db_params.items():
        if name == "self":
            continue
        assert name in params, f"kvdb.open lacks Db's option {name}"
        assert params[name].default == p.default, name
    assert list(params) == _api_doc_open_params()


# ---------------------------------------------------------------- property: a put either stores or leaves no trace

_POSITION = st.one_of(st.sampled_from([-1, 0, 2**31 - 1, 2**31, 2**63, -(2**63)]),
                      st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True), st.booleans(),
                      st.none())
_BAD_KEY = st.one_of(st.binary(max_size=15), st.binary(min_size=17, max_size=20), st.integers(), st.none())


@st.composite
def _put_args(draw):
    n = draw(st.integers(min_value=1, max_value=3))
    keys = draw(st.lists(st.binary(min_size=16, max_size=16), min_size=n, max_size=n, unique=True))
    if draw(st.integers(0, 3)) == 0:  # now and then one malformed key
        keys[draw(st.integers(0, n - 1))] = draw(_BAD_KEY)
    positions = draw(st.one_of(st.none(), st.lists(_POSITION, min_size=n, max_size=n), st.lists(_POSITION, max_size=4)))
    durability = draw(st.sampled_from([None, "none", "group", "sync", "fast", 1]))
    tier = draw(st.sampled_from([None, None, "disk", "host"]))
    return keys, positions, durability, tier


@given(args=_put_args())
def test_put_blocks_stores_or_leaves_no_trace(swept, args):
    # any arguments: either the put succeeds, or it raises InvalidInput and nothing changed
    # (never another exception type, never a frame or a log record left behind)
    keys, positions, durability, tier = args
    db, path = swept
    before = snapshot(db, path)
    try:
        db.put_blocks(keys, blocks_for(len(keys)), positions=positions, durability=durability, tier=tier)
    except InvalidInput:
        assert snapshot(db, path) == before
        return
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert positions is None or all(isinstance(p, int) and 0 <= p < 2**31 for p in positions)
    assert all(db.contains(k) for k in keys)
    db.delete([k for k in keys if k not in KEYS[:2]])  # the sweep's fixture stays as it was
