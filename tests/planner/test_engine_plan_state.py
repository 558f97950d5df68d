"""Property test of the engine's plans (kvdb/db/plans/: waits.py E1-E4, prefixes.py X1-X3):
random sessions, calls, tool waits, prefix hints, deletes and clock moves against a dict model of what is
stored. Whatever the plan moves, nothing is lost and no byte changes (E4), the Db's prefix
pins are exactly accounted for and released with the last session (X1), and no timer
outlives its wait (E3)."""

from __future__ import annotations

import shutil
import tempfile

import torch
from helpers import SMALL as LAYOUT
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvdb

PAGE = LAYOUT.page_bytes
SESSIONS = ("s1", "s2", "s3")
TENANTS = ("acme", "evil")


WORKFLOW = [{"id": "n1", "agent_id": "a"},
            {"id": "t", "agent_id": "a", "kind": "tool", "deps": ["n1"], "expected_duration_s": 20},
            {"id": "n2", "agent_id": "a", "deps": ["t"]},
            {"id": "m1", "agent_id": "b"}]
NODES = {"a": ["n1", "n2"], "b": ["m1"]}


def block_of(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[:6], "little"))
    return torch.randn((1, *LAYOUT.block_shape), generator=g)


def tokens_of(chain: int, n_blocks: int) -> list[int]:
    shared = list(range(8))  # every chain starts with the same 2-block "system prompt"
    return shared + [10_000 * (chain + 1) + i for i in range(4 * (n_blocks - 2))]


class EnginePlans(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvdb-plans-")
        self.t = 0.0
        self.db = kvdb.open(self.dir, layout=LAYOUT, model_id="m", device_bytes=4 * PAGE, host_bytes=4 * PAGE,
                            device="cpu", disk_bytes=None, replacer="kvdb", clock=lambda: self.t,
                            key_secret=b"0123456789abcdef")  # fixed keys: hypothesis replays draws
        self.model: dict[bytes, torch.Tensor] = {}
        self.open: dict[str, str] = {}  # session -> tenant
        self.with_workflow: set[str] = set()

    def teardown(self) -> None:
        self.db.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(sid=st.sampled_from(SESSIONS), tenant=st.sampled_from(TENANTS),
          prefix=st.sampled_from([None, ("acme", 1), ("evil", 2), ("acme", 0)]), workflow=st.booleans())
    def begin(self, sid, tenant, prefix, workflow):
        if sid in self.open:
            return
        hints = {}
        if prefix is not None:
            t, n = prefix
            hints["prefix_hash"] = self.db.block_keys(tokens_of(0, 3), tenant=t)[n].hex()
        out = self.db.begin_session(sid, tenant=tenant, hints=hints, workflow=WORKFLOW if workflow else None)
        if workflow:
            self.with_workflow.add(sid)
        else:
            self.with_workflow.discard(sid)
        assert all(o.status in ("accepted", "clipped") for o in out)
        self.open[sid] = tenant

    @precondition(lambda self: self.open)
    @rule(data=st.data(), agent=st.sampled_from(["a", "b"]), chain=st.integers(0, 3), n=st.integers(2, 5),
          wait=st.sampled_from([None, 0.0, 5.0, 40.0, -1.0]))
    def call(self, data, agent, chain, n, wait):
        sid = data.draw(st.sampled_from(sorted(self.open)))
        keys = self.db.block_keys(tokens_of(chain, n), tenant=self.open[sid])
        node = data.draw(st.sampled_from(NODES[agent])) if sid in self.with_workflow else None
        ctx, _ = self.db.call_started(sid, agent_id=agent, node_id=node)
        have = self.db.match_prefix(keys, ctx=ctx)
        new = keys[have:]
        if new:
            self.db.put_blocks(new, torch.cat([block_of(k) for k in new]), ctx=ctx)
            for k in new:
                self.model.setdefault(k, block_of(k))
        self.db.call_finished(sid, agent_id=agent, node_id=node, hints=None if wait is None else {"expected_tool_duration_s": wait})

    @precondition(lambda self: self.open)
    @rule(data=st.data(), d=st.sampled_from([1.0, 60.0, float("nan")]))
    def hint(self, data, d):
        sid = data.draw(st.sampled_from(sorted(self.open)))
        self.db.hint(sid, expected_tool_duration_s=d)

    @rule(dt=st.sampled_from([0.1, 3.0, 30.0, 100.0]))
    def advance(self, dt):
        self.t += dt
        self.db.run_plans()

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def end(self, data):
        sid = data.draw(st.sampled_from(sorted(self.open)))
        self.db.end_session(sid)
        del self.open[sid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        k = data.draw(st.sampled_from(list(self.model)))
        assert self.db.delete([k]) == 1
        del self.model[k]

    @invariant()
    def nothing_lost_and_pins_accounted(self):
        db = self.db
        db.run_plans()
        keys = sorted(self.model)
        if keys:
            out = torch.empty((len(keys), *LAYOUT.block_shape))
            db.get_blocks(keys, out=out)
            assert torch.equal(out, torch.cat([self.model[k] for k in keys]))
        s = db.stats()
        pinned = sum(t["pinned_pages"] for name, t in s["tiers"].items() if name != "disk")
        assert pinned == s["plans"]["prefix_pinned_pages"]
        for name in ("device", "host"):
            assert s["tiers"][name]["pinned_pages"] <= s["tiers"][name]["capacity_pages"] // 2
        assert s["plans"]["timers"] <= s["plans"]["waiting_agents"]
        waiting = {p for agents in db._agents.values() for p in agents.values() if p.return_s is not None}
        assert waiting == db._waiting
        assert s["plans"]["failed_moves"] == 0, db._mover.last_error
        if not self.open:
            assert pinned == 0 and s["plans"]["timers"] == 0 and s["plans"]["prefixes"] == 0


TestEnginePlans = EnginePlans.TestCase
# each example opens a Db with its disk tier: fewer, shorter runs than the profile's default
# under ci (nightly keeps its count)
TestEnginePlans.settings = settings(settings.default, stateful_step_count=25,
                                    max_examples=min(settings.default.max_examples, 25)
                                    if settings.default.max_examples <= 50 else settings.default.max_examples)
