"""``kvdb``: the planner's policy -- approximate Belady from what is known now.

Each resident block is in one of two classes:

* **planned**: something says when it is needed next (``t_next``); among planned blocks the
  one wanted furthest in the future goes first (Belady on the estimate). Every agent's
  *last chain* (all blocks of its latest call) is planned for the estimated start of the
  agent's next call (kvdb.planner.policies.nextuse: the workflow's critical path when the
  session declared one, else tool-wait hints, fan-ins and residuals learned online). A block
  keeps the estimate of every agent whose last chain holds it, each with its deadline, and is
  planned for the earliest live one (a shared prompt is needed by whoever runs first); it
  becomes unplanned when none is left, and when no interested agent has anything left to
  run, a private block is released (H = -inf).
* **unplanned**: GreedyDual over a learned value. Key H = L + v with
  v = min(accesses, 64) ** alpha * (1 + priority), 0 for the last block of a call (almost
  always a partial block: the next turn's longer prompt changes its hash, so it is reused ~1 %
  of the time on the Mooncake traces vs ~40 % for its parent). L rises to the H of each
  victim, so an idle block ages out however valuable it was. kvdb.planner.policies.reuse
  keeps access counts of evicted blocks in a history of 32 ids per frame, at most 2^18
  (blocks return after hundreds of calls) and sets alpha from the median observed reuse gap over Tc: 1 when the
  cache holds blocks about as long as they take to return, up to 3 (frequent blocks held
  long, one-shot ones barely admitted) when it is far smaller. A block seen once is worth
  its call length class's learned P(seen again) over the overall one instead of 1.

Victim order: expired plans are demoted; then (1) an unplanned block at or below the floor L
(junk: last blocks, ended sessions, aged out, orphans once O1 learned they are not read
again); (2) the planned block with the furthest
``t_next`` if that lies beyond ``Tc`` (EWMA of the age of unplanned victims, and of the ones (2)
spares, T1: a block not
needed within Tc would not survive anyway) or nothing unplanned is left; (3) the unplanned
block with the least H. Ties go to the deeper block (R3): keys carry -depth.

T1  Tc follows the unplanned blocks that (2) spares too: when the one (3) would have taken is
    already older than Tc, Tc moves toward its age. Learning only from (3)'s victims locked
    Tc low: once a small Tc sent every eviction to (2), no unplanned block was evicted again,
    Tc never moved, and planned blocks wanted within seconds went before unplanned ones idle
    far longer (agentic-mix seed 702 at 0.5 %, the planner with workflows turned off at a fifth
    of the trace, as the guard does: 0.34 hit ratio from then on, against 0.52 over the same
    calls for the planner that never had them).

O1  Orphans (kvdb.planner.policies.orphans): blocks an agent's new call left out of its chain
    are worth their value times the learned P(read again), junk under JUNK_P; decided at
    CallFinished, when the whole call is known.

Plans are kept per agent (kvdb.planner.policies.agentplans): a block only its agent wants
follows that agent's one heap entry, so re-planning an agent costs O(log agents) plus its
shared blocks, not its whole chain. Costs per access: O(log n) heap pushes; stale heap entries
are skipped lazily and compacted. Re-planning happens only for agents whose estimate moved by
more than 0.5 s, plus the agent that just ran. Reads only the past, declared workflows and
hints (no peeking; tests/sim check it).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Hashable
from heapq import heapify, heappush
from typing import Any

from kvdb.buffer_pool.replacer import AccessContext, Replacer
from kvdb.errors import InvalidInput
from kvdb.planner.events import (
    CallFinished,
    CallStarted,
    HintGiven,
    SessionBegan,
    SessionEnded,
)
from kvdb.planner.policies.agentplans import ABSENT, HINT, LISTED, PINNED, AgentPlans
from kvdb.planner.policies.nextuse import LLM_CALL_S, NextUseEstimator, hint_plan
from kvdb.planner.policies.orphans import JUNK_P, OrphanEstimator
from kvdb.planner.policies.reuse import ReuseEstimator

VALUE_CAP = 64
_ABSENT, _LISTED, _PINNED, _VALUE_CAP = ABSENT, LISTED, PINNED, VALUE_CAP  # typed in planned.pxd: compiled, C compares
TC_ALPHA = 0.05  # EWMA weight in Tc of one victim's age (or a spared block's, T1)
HALF_LIFE_TICKS = 1000.0  # crf: half-life of a block's recency-frequency, in record_access calls


class PlannedCore(AgentPlans):
    """PlannedReplacer's state and methods (compiled when the extension is built)."""

    def __init__(self, num_frames: int, llm_call_s: float = LLM_CALL_S, unplanned: str = "gd",
                 half_life: float = HALF_LIFE_TICKS, workflows: bool = True) -> None:
        Replacer.__init__(self, num_frames)
        if not half_life > 0 or half_life == math.inf:
            raise InvalidInput(f"half_life must be a positive number of calls, got {half_life!r}")
        n = num_frames
        self._crf = array("d", [0.0]) * n  # combined recency-frequency at the last access
        self._hc = array("d", [0.0]) * n  # its key, lam * tick + log2(crf) (the crf ordering)
        self._tick_of = array("q", [0]) * n  # tick of the last access
        self._tick = 0  # record_access calls so far
        self._lam = 1.0 / half_life
        self._Lc = -math.inf  # the crf ordering's floor
        self._state = bytearray(n)
        self._planned = bytearray(n)
        self._leaf = bytearray(n)
        self._shared = bytearray(n)
        self._ver = array("q", [0]) * n  # version of the frame's GreedyDual entry
        self._h = array("d", [0.0]) * n
        self._depth = array("i", [0]) * n
        self._hits = array("q", [0]) * n
        self._last_s = array("d", [0.0]) * n
        self._id: list[Hashable] = [None] * n
        self._sess: list[str | None] = [None] * n
        self._gd: list[tuple] = []  # (H, -depth, ver, f)
        self._reuse = ReuseEstimator(n)  # counts of evicted blocks, value exponent
        self._kls = array("i", [-1]) * n  # first-access class while accessed once, else -1
        self._session_frames: dict[str, set[int]] = {}
        self._count = 0
        self._L = 0.0
        self._tc = math.inf
        self._now = 0.0
        self._sampled: tuple[int, bool] | None = None  # set by sampled_call for the next access only
        self._returns: dict[str, float] = {}  # session -> predicted return (from its hints)
        self._current: tuple = (None, None)  # (session, agent) of the call in progress
        self._chain_open = False  # whether the current call already started its agent's chain
        self._inc = array("q", [0]) * n  # incarnation: bumped each time the frame is freed
        self._init_plans(n)  # agents' chains, plans and interests (kvdb.planner.policies.agentplans)
        self._orph = bytearray(n)  # O1: 1 while the frame's block is an orphan
        self._orphans = OrphanEstimator(n)
        self._orph_pending: dict[tuple, list] = {}  # agent -> links its call in progress left out (O1)
        self._next = NextUseEstimator(llm_call_s)  # when each agent calls next
        self._next.use_workflows = bool(workflows)
        self.set_unplanned(unplanned)

    def predicted_return(self, session_id: str) -> float | None:
        """When the session's next call is expected (hint-based), for prefetch; None if unknown."""
        return self._returns.get(session_id)

    # -- bookkeeping --------------------------------------------------------------------
    def _push_gd(self, f: int) -> None:
        v = self._ver[f] + 1
        self._ver[f] = v
        heappush(self._gd, (self._key[f], -self._depth[f], v, f))
        if len(self._gd) > 4 * self.num_frames + 64:
            self._rebuild_gd()

    def _rebuild_gd(self) -> None:
        key = self._key
        self._gd = [(key[g], -self._depth[g], self._ver[g], g) for g in range(self.num_frames)
                    if self._state[g] != _ABSENT and not self._planned[g]]
        heapify(self._gd)

    def set_unplanned(self, mode: str) -> None:
        """Order unplanned blocks by GreedyDual value (``gd``) or by decayed recency-frequency
        (``crf``, LRFU's combined recency and frequency with this policy's half-life)."""
        if mode not in ("gd", "crf"):
            raise InvalidInput(f"unplanned must be 'gd' or 'crf', got {mode!r}")
        self.unplanned = mode
        self._use_crf = mode == "crf"
        self._key = self._hc if self._use_crf else self._h
        if hasattr(self, "_gd"):
            self._rebuild_gd()

    def set_workflows(self, on: bool) -> None:
        """Plan from declared workflows (True) or only from hints and learned gaps (False).
        Turning them off drops the plans they made (the next calls plan afresh)."""
        if self._next.use_workflows == bool(on):
            return
        if not on:
            for agent in list(self._agent_plan):
                if agent[1] is not HINT and self._next.has_workflow(agent[0]):
                    self._plan_agent(agent, None, self._now)
        self._next.use_workflows = bool(on)

    def _own(self, f: int, sid: str | None) -> None:
        old = self._sess[f]
        if old == sid:
            return
        if old is not None:
            fs = self._session_frames.get(old)
            if fs is not None:
                fs.discard(f)
            self._shared[f] = 1
        self._sess[f] = sid
        if sid is not None:
            self._session_frames.setdefault(sid, set()).add(f)

    # -- Replacer -----------------------------------------------------------------------
    def record_access(self, frames, ids=None, ctx: AccessContext | None = None) -> None:
        self._check_frames(frames)
        if ctx is not None and ctx.now_s > self._now:
            self._now = ctx.now_s
        now = self._now
        sid = ctx.session_id if ctx is not None else None
        hints = ctx.hints if ctx is not None else {}
        prio = 1 + hints.get("priority", 0)
        if sid is not None:
            plan = hint_plan(hints, now) if hints else None
            if plan is not None and "expected_tool_duration_s" in hints:
                self._returns[sid] = plan[0]
            else:
                self._returns.pop(sid, None)
        self._expire_plans(now)
        state, hits, reuse = self._state, self._hits, self._reuse
        agent = None  # (session, agent) whose last chain this call (re)starts or extends
        new_call = False
        if sid is not None:
            if self._current[0] == sid:
                agent = self._current
                new_call = not self._chain_open
                self._chain_open = True
            else:  # no CallStarted for it: every record_access is a call of its own
                agent = (sid, None)
                new_call = True
        wf = sid is not None and self._next.has_workflow(sid)
        last = len(frames) - 1
        if agent is not None:
            # the engine may report one call in several record_access calls (lookup, then the
            # new blocks): the first after CallStarted starts the agent's chain, later ones extend it
            inc = self._inc
            links = [(f, inc[f]) for f in frames]
            if not new_call:
                self._agent_chain.setdefault(agent, []).extend(links)
            else:
                if self._orph_pending:  # the agent's previous call never finished: decide its leftovers now
                    left = self._orph_pending.pop(agent, None)
                    if left:
                        self._orphan(agent, left)
                old = self._agent_chain.get(agent)
                self._agent_chain[agent] = links
                self._sess_agents.setdefault(sid, {})[agent] = None
                if old:  # the agent moved on: it no longer waits for blocks left out of its new chain
                    keep = set(frames)
                    left = []
                    prov = agent in self._prefixes.provisional  # a newcomer's first call (N1): no orphans
                    if prov:
                        self._prefixes.provisional.discard(agent)
                    for f, i in old:
                        if inc[f] == i and f not in keep:
                            self._drop_interest(f, agent)
                            if not prov and not self._leaf[f] and not self._shared[f]:  # never orphans (O1): most calls leave only their leaf
                                left.append((f, i))
                    if left:  # orphans once the whole call is known (O1): at CallFinished, or now without one
                        if agent[1] is None:
                            self._orphan(agent, left)
                        else:
                            self._orph_pending[agent] = left
            self._chain_changed(agent)
        L = self._L
        kls = self._kls
        call_len, ends = (len(frames), True) if self._sampled is None else self._sampled
        self._sampled = None
        k1 = reuse.klass(call_len)
        self._tick += 1
        tick, crf, tick_of, hc, lam = self._tick, self._crf, self._tick_of, self._hc, self._lam
        for j, f in enumerate(frames):
            bid = ids[j] if ids is not None else None
            if state[f] == _ABSENT or hits[f] == 0:
                if state[f] == _ABSENT:
                    state[f] = _LISTED
                    self._count += 1
                n = (reuse.recall(bid, now) if bid is not None else 0) + 1
                self._orphans.recalled(bid)  # an evicted orphan read again counts (O1)
                c, t0 = reuse.recalled if n > 1 and reuse.recalled is not None else (0.0, tick)
                self._id[f] = bid
                self._planned[f] = 0
                self._shared[f] = 0
                self._sess[f] = None
            else:
                n = hits[f] + 1
                reuse.observe_gap(now - self._last_s[f])
                if self._orph[f]:  # a resident orphan is read again (O1)
                    self._orph[f] = 0
                    self._orphans.read_again()
                c, t0 = crf[f], tick_of[f]
                if kls[f] >= 0:
                    reuse.seen_again(kls[f])
            crf[f] = c = 1.0 + c * 2.0 ** (lam * (t0 - tick))
            tick_of[f] = tick
            hits[f] = n
            self._depth[f] = j
            self._last_s[f] = now
            leaf = j == last and ends and call_len > 1
            self._leaf[f] = leaf
            if leaf:
                kls[f] = -1
                self._h[f] = L
                hc[f] = self._Lc
            else:
                hc[f] = lam * tick + math.log2(c * prio)
                if n == 1:
                    kls[f] = k1
                    self._h[f] = L + reuse.first_value(k1) * prio
                else:
                    kls[f] = -1
                    self._h[f] = L + reuse.value(n, _VALUE_CAP) * prio
            self._own(f, sid)
            if agent is not None and self._planned[f]:
                pass  # its interested agents re-plan it (at CallFinished, or from on_call below)
            else:  # an access fulfils the plan (or there was none)
                if self._planned[f]:
                    self._unplan_by_access(f)
                self._push_gd(f)
        if agent is not None:  # learned even under a workflow, so that it is warm if workflows are turned off
            plans = self._next.on_call(agent, hints, now, new_call)
            if not wf or "expected_tool_duration_s" in hints or self._next.looping():  # the agent goes on
                for a, t in plans if not wf else plans[:1]:
                    self._plan_agent(a, t, now)
        if reuse.epoch_due():
            reuse.update(self._tc)

    def _orphan(self, agent: tuple, left: list) -> None:
        """O1: blocks the agent's new call left out of its chain, that no other agent plans and no
        other session read, are orphans, valued by the learned P(an orphan is read again)."""
        inc, state = self._inc, self._state
        chain = {f for f, _ in self._agent_chain.get(agent, ())}
        p = self._orphans.p()
        junk = p < JUNK_P
        lp = math.log2(p)
        L = self._L
        k = 0
        for f, i in left:
            if (inc[f] != i or state[f] != _LISTED or f in chain or self._planned[f] or self._shared[f]
                    or self._leaf[f] or self._orph[f] or self._interest[f]):
                continue
            self._orph[f] = 1
            k += 1
            if junk:
                self._h[f] = L
                self._hc[f] = self._Lc
            else:
                if self._h[f] > L:
                    self._h[f] = L + (self._h[f] - L) * p
                self._hc[f] += lp
            self._push_gd(f)
        self._orphans.made(k)

    def orphan_reuse(self) -> dict[str, float]:
        """O1's estimate for EXPLAIN: orphans made and read again (decayed) and P(read again)."""
        return self._orphans.describe()

    def newcomer_reuse(self) -> dict[str, float]:
        """N1's estimate for EXPLAIN: agents' first calls scored, those that read their role's prefix, P(read)."""
        return self._prefixes.describe()

    def sampled_call(self, call_blocks: int, ends_call: bool) -> None:
        """The next ``record_access`` is a spatial sample of a call of ``call_blocks`` blocks
        (a guard's mini cache, kvdb/planner/policies/adaptive.py); ``ends_call`` says whether
        its last block is the call's last. Without this the sample's last block would count as
        the call's partial last block and go first (H = L), though the next turn reads it: a
        mini at 1/8 then misjudged the planner (agentic mix at 5 %: below LRU in the mini,
        above it at full size)."""
        self._sampled = (call_blocks, ends_call)

    def on_event(self, event: Any) -> None:
        if isinstance(event, CallStarted):
            self._current = (event.session_id, self._next.agent_of(event.session_id, event.node_id, event.agent_id))
            self._chain_open = False
            self._now = max(self._now, event.now_s)
        elif isinstance(event, SessionBegan):
            self._next.begin(event.session_id, event.workflow)
        elif isinstance(event, CallFinished):
            self._now = max(self._now, event.now_s)
            sid = event.session_id
            me = self._next.agent_of(sid, event.node_id, event.agent_id)
            if self._orph_pending:
                left = self._orph_pending.pop((sid, me), None)
                if left:
                    self._orphan((sid, me), left)
            starts = self._next.call_finished(sid, event.node_id, self._now)
            if starts is not None:
                chain = self._agent_chain.get((sid, me))
                if chain and (sid, me) not in self._prefixes.provisional:  # its role's prefix (N1)
                    inc, state, ids = self._inc, self._state, self._id
                    got = [ids[f] if inc[f] == i and state[f] != _ABSENT else None for f, i in chain]
                    self._prefixes.observe((sid, me), chain, got)
                    par = self._next.parallel(sid, event.node_id)  # N2: its parallel siblings
                    if par is not None:
                        self._prefixes.parallel(sid, par[0], [a for a in par[1] if not self._prefixes.called((sid, a))],
                                                chain, got)
                if "expected_tool_duration_s" in event.hints or self._next.looping():
                    # the call waits on a tool and its agent goes on after it (a ReAct loop inside
                    # its node): its own plan is the hint's, from on_call, not its next node's start
                    starts = {a: t for a, t in starts.items() if a != me}
                    me = None
                self._replan(sid, starts, self._now, changed=None if me is None else (sid, me))
        elif isinstance(event, HintGiven):
            self._now = max(self._now, event.now_s)
            plan = hint_plan(event.hints, self._now)
            if plan is not None and "expected_tool_duration_s" in event.hints:
                self._returns[event.session_id] = plan[0]
            prio = event.hints.get("priority")
            own = [f for f in sorted(self._session_frames.get(event.session_id, ()))
                   if self._state[f] != _ABSENT and not self._leaf[f] and not self._shared[f] and not self._orph[f]]
            for f in own:
                if prio is not None:
                    self._h[f] = self._L + self._reuse.value(self._hits[f], _VALUE_CAP) * (1 + prio)
                    self._hc[f] = self._lam * self._tick_of[f] + math.log2(self._crf[f] * (1 + prio))
                if plan is None and not self._planned[f]:
                    self._push_gd(f)
            if plan is not None and own:  # the session's own frames, planned as one pseudo-agent's chain
                key = (event.session_id, HINT)
                self._drop_plan(key)
                self._agent_chain[key] = [(f, self._inc[f]) for f in own]
                self._sess_agents.setdefault(event.session_id, {})[key] = None
                self._plan_agent(key, plan[0], self._now, plan[1])
        elif isinstance(event, SessionEnded):
            self._now = max(self._now, event.now_s)
            self._returns.pop(event.session_id, None)
            agents = list(self._sess_agents.pop(event.session_id, ()))
            self._next.end(event.session_id, [a for a in agents if a[1] is not HINT])
            self._prefixes.end(event.session_id)
            for key in agents:
                self._forget_agent(key)
                self._orph_pending.pop(key, None)
                self._prefixes.provisional.discard(key)
            for f in sorted(self._session_frames.pop(event.session_id, ())):
                self._sess[f] = None
                if self._state[f] == _ABSENT or self._shared[f]:
                    continue
                self._h[f] = self._hc[f] = -math.inf
                if self._planned[f]:
                    self._unplan(f)
                else:
                    self._push_gd(f)

    def evict(self) -> int | None:
        now = self._now
        self._expire_plans(now)
        g = self._top_live(self._gd, self._ver, self._planned, 0)
        if g is not None and g[0] <= (self._Lc if self._use_crf else self._L):
            f = g[-1]  # junk (a call's last block, an ended session, an orphan) or aged out: first to go
        elif (p := self._planned_victim()) is not None and (g is None or p[0] - now > self._tc):
            f = p[1]
            if g is not None:  # the unplanned block this spared has outlived Tc: Tc learns it (T1)
                age = now - self._last_s[g[-1]]
                if age > self._tc:
                    self._tc += TC_ALPHA * (age - self._tc)
        elif g is not None:
            f = g[-1]
            if self._use_crf:
                self._Lc = g[0]
            else:
                self._L = g[0]
            age = now - self._last_s[f]
            self._tc = age if self._tc == math.inf else self._tc + TC_ALPHA * (age - self._tc)
        else:
            return None
        self._forget(f)
        return f

    def _forget(self, f: int) -> None:
        if self._state[f] == _LISTED:
            self._count -= 1
        self._state[f] = _ABSENT
        self._ver[f] += 1
        self._planned[f] = 0
        bid = self._id[f]
        if bid is not None:
            self._reuse.remember(bid, self._hits[f], self._last_s[f], self._kls[f], self._crf[f], self._tick_of[f])
            self._id[f] = None
        self._hits[f] = 0
        self._kls[f] = -1
        self._inc[f] += 1
        if self._orph[f]:
            self._orph[f] = 0
            if bid is not None:
                self._orphans.evicted(bid)
        self._forget_frame(f)
        sid = self._sess[f]
        if sid is not None:
            fs = self._session_frames.get(sid)
            if fs is not None:
                fs.discard(f)
                if not fs:
                    del self._session_frames[sid]
            self._sess[f] = None

    def set_evictable(self, frame: int, evictable: bool) -> None:
        self._check(frame)
        s = self._state[frame]
        if evictable and s == _PINNED:
            self._state[frame] = _LISTED
            self._count += 1
            if self._hits[frame] == 0:  # pinned before its first access: give it a key and an age
                self._hits[frame] = 1
                self._last_s[frame] = self._now
                self._h[frame] = self._L + 1
                self._hc[frame] = self._lam * self._tick
                self._push_gd(frame)
            elif self._planned[frame]:
                self._unpinned(frame)
        elif not evictable and s == _LISTED:
            self._state[frame] = _PINNED
            self._count -= 1
        elif not evictable and s == _ABSENT:
            self._state[frame] = _PINNED
            self._hits[frame] = 0
            self._id[frame] = None
            self._sess[frame] = None

    def remove(self, frame: int) -> None:
        self._check(frame)
        if self._state[frame] != _ABSENT:
            self._forget(frame)

    def num_evictable(self) -> int:
        return self._count

    def debug_tc(self) -> float:
        return self._tc

    def debug_value(self, frame: int) -> float:
        """The frame's GreedyDual value above the floor L, H - L (tests only)."""
        return self._h[frame] - self._L


class PlannedReplacer(PlannedCore, Replacer):
    name = "kvdb"
