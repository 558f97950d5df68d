"""N1, N2: an agent that has not called yet will read what its kind read in sessions like its own,
or what its parallel siblings just read -- learned online (kvdb.planner.policies.planned).

Agent applications are templates: every session of one app runs the same roles, and a role's
first prompt begins with the app's system prompt for it and its tool schemas. A declared
workflow says when an agent that has not called yet starts (W5), but the planner plans an
agent's *last chain*, and a newcomer has none: before N1 the blocks its first call would read
were planned only for agents that had called, and went when those agents' next calls were
further off than other chains' (apps traces at 0.5 %: first calls of agents hit 11 blocks each
against LRU's 19, which keeps what the coordinator just read; Belady 20).

* Sessions are told apart by their *signature*, the id of their first call's first block
  (an app's entry prompt). Per (signature, agent name) the *role prefix* is the longest run
  of block ids that every first call of that agent in such sessions began with (its last,
  partial block never counted); the frames are those of the latest call that read it whole.
  One first call alone says nothing about what is common (its own task is in it too): a role
  prefix is planned, and first calls are scored against it, once two first calls formed it.
* A newcomer's estimated start plans its role prefix through a *provisional chain* (the
  planner keeps it as the agent's last chain until the agent's first call replaces it).
* Whether newcomers read it is learned, not assumed: at each first call with a role prefix
  known, a *read* when the call began with all of it, and a miss each time a newcomer's plan
  expires before it calls. P(read) = (read + 1) / (first calls + 2), both halved past
  ``WINDOW``; the plan's distance from now is stretched by 1 / P ** 2, as
  kvdb.planner.policies.nextuse stretches an estimate by the chance its agent calls again.
* At most ``MAX_ROLES`` role prefixes are kept, the oldest dropped first.

N2, siblings: the nodes of a fan-out (pending LLM nodes with the same deps) run side by side,
and their agents' first prompts often begin alike past the role prefix (the session's task).
LRU keeps what the first of them just read; before N2 the planner planned it for that agent's
next call only, often further off than other chains, and evicted it under the others' feet
(apps traces at 0.5 %: such first calls hit 3,185 blocks against LRU's 5,986).

* A finished call of a node starts or shrinks its *group* (session, the node's deps): the
  first call's chain less its partial last block, then what each later call shares with it.
  The group's agents that have not called are planned to read it, due now (their deps are
  done): ``REPLAN_TOLERANCE_S`` away stretched by 1 / P ** 2, until ``PLAN_SLACK_S`` past that.
* P(a sibling reads it) is the session's own record (how much of its plan each sibling read,
  a sibling whose plan expired read nothing) with the global rate as a prior of weight 2. A
  sibling whose plan expired is not planned from its group again.
* The role prefix is the surer guess when it is known and the group's chain begins with
  another block (another kind's call), or when one call alone formed the group and what later
  siblings read of its part past the role prefix is under half (learned, planned or not).

docs/planner.md, "Newcomers" and "Siblings".
"""

from __future__ import annotations

from collections.abc import Hashable

from kvdb.planner.policies.rate import Rate

WINDOW = 1024.0  # first calls and reads are halved when the first calls pass this
MAX_ROLES = 4096  # role prefixes kept, oldest dropped first


class SessionPrefixes:
    """Role prefixes by (session signature, agent name); the agents each session has seen call;
    P(a newcomer reads its role prefix)."""

    def __init__(self) -> None:
        self._sig: dict[Hashable, Hashable] = {}  # session -> id of its first call's first block
        self._agents: dict[Hashable, set] = {}  # session -> names of its agents that called
        self._ids: dict[tuple, list] = {}  # (signature, name) -> ids every first call of it began with
        self._links: dict[tuple, list] = {}  # ... and their (frame, incarnation), from the latest reader
        self._formed: dict[tuple, int] = {}  # ... and how many first calls formed it (1, or 2: enough)
        self.provisional: set = set()  # agents whose last chain is a provisional one (not called yet)
        self._rate = Rate(WINDOW)  # newcomers with a role prefix: first calls (and expired plans), reads of all of it
        self._groups: dict[Hashable, dict] = {}  # session -> deps -> [ids, links, calls]: what its parallel nodes' calls began with
        self._member: dict[Hashable, dict] = {}  # session -> newcomer name -> deps of the group it is planned from (None: none)
        self._sib = Rate(WINDOW)  # siblings planned from their group: first calls (and expired plans), how much of it they read
        self._ext = Rate(WINDOW)  # a first sibling's chain past the role prefix: later siblings' first calls, how much of it they read
        self._sess_sib: dict[Hashable, tuple] = {}  # session -> (its siblings' first calls, how much of their plans they read)

    def _role(self, agent: tuple) -> list | None:
        """The newcomer's role prefix's ids, once two first calls formed it."""
        sig = self._sig.get(agent[0])
        key = (sig, agent[1])
        return self._ids[key] if sig is not None and self._formed.get(key, 0) >= 2 else None

    def _raw_group(self, agent: tuple) -> list | None:
        """The newcomer's group, whatever the role prefix says; None without one (or an empty one)."""
        m = self._member.get(agent[0])
        deps = None if m is None else m.get(agent[1])
        g = None if deps is None else self._groups[agent[0]].get(deps)
        return g if g is not None and g[0] else None

    def _group(self, agent: tuple, g: list | None) -> list | None:
        """[ids, links, calls] of the group the newcomer is planned from (``g``, its raw group);
        None when its role prefix is the surer guess: the group's chain begins with another
        kind's block, or one call alone formed it and its part past the role prefix has mostly
        not been read."""
        role = None if g is None else self._role(agent)
        if role:
            if role[0] != g[0][0]:
                return None
            if g[2] < 2 and (len(g[0]) <= len(role) or self._ext.p() < 0.5):
                return None
        return g

    def called(self, agent: tuple) -> bool:
        """Whether the agent called in its session (a newcomer has not)."""
        s = self._agents.get(agent[0])
        return s is not None and agent[1] in s

    def plan_of(self, agent: tuple) -> tuple:
        """(the links a newcomer is planned to read, P(it reads them), whether they are its group's):
        its group's chain (N2; P from the session's own siblings so far, the global rate as a prior
        of weight 2), else its role prefix (N1); no links when neither is known."""
        g = self._group(agent, self._raw_group(agent))
        if g is not None:
            n, r = self._sess_sib.get(agent[0], (0.0, 0.0))
            return g[1], (r + 2.0 * self._sib.p()) / (n + 2.0), True
        sig = self._sig.get(agent[0])
        if sig is None or self._formed.get((sig, agent[1]), 0) < 2:
            return [], self._rate.p(), False
        return self._links[(sig, agent[1])], self._rate.p(), False

    def observe(self, agent: tuple, links: list, ids: list) -> None:
        """A finished call of ``agent`` = (session, name): its chain's links and block ids (None
        for a block no longer resident). A first call tells whether newcomers read their role
        prefix and shrinks it to what the call shares with it; a call that read it all refreshes
        its frames."""
        sid, name = agent
        if not ids or ids[0] is None:
            return
        sig = self._sig.get(sid)
        if sig is None:
            sig = self._sig[sid] = ids[0]
        agents = self._agents.setdefault(sid, set())
        first = name not in agents
        agents.add(name)
        key = (sig, name)
        old = self._ids.get(key)
        n = len(ids) - 1  # the call's last block is partial: never common
        if old is None and not first:
            return
        k = 0
        m = n if old is None else min(len(old), n)
        while k < m and ids[k] is not None and (old is None or ids[k] == old[k]):
            k += 1
        if first:
            g = self._raw_group(agent)
            if g is not None:  # N2: how much of its group's chain the newcomer read
                planned = self._group(agent, g) is not None
                del self._member[sid][name]
                j = 0
                while j < len(g[0]) and j < n and ids[j] == g[0][j]:
                    j += 1
                if planned:
                    self._sib_count(sid, j / len(g[0]))
                role = self._role(agent)
                if g[2] == 1 and role and role[0] == g[0][0] and len(g[0]) > len(role):
                    self._ext.add(1.0, max(0, j - len(role)) / (len(g[0]) - len(role)))  # planned or not
            formed = self._formed.get(key, 0)
            if formed >= 2 and old:
                self._rate.add(1.0, 1.0 if k == len(old) else 0.0)
            if old is None and len(self._ids) >= MAX_ROLES:
                oldest = next(iter(self._ids))
                del self._ids[oldest]
                del self._links[oldest]
                del self._formed[oldest]
            self._ids[key] = ids[:k]
            self._links[key] = links[:k]
            self._formed[key] = 2 if formed else 1
        elif k == len(old):
            self._links[key] = links[:k]

    def parallel(self, sid: Hashable, deps: tuple, names: list, links: list, ids: list) -> None:
        """N2: a finished call of a node whose deps are ``deps``; ``names``, the agents of the
        other pending nodes with the same deps that have not called yet (its parallel siblings),
        are planned to read what the group's calls began with: the first call's chain (less its
        partial last block), shrunk to what each later one shares with it."""
        groups = self._groups.setdefault(sid, {})
        g = groups.get(deps)
        n = len(ids) - 1
        k = 0
        if g is None:
            while k < n and ids[k] is not None:
                k += 1
            groups[deps] = [ids[:k], links[:k], 1]
        else:
            old = g[0]
            while k < n and k < len(old) and ids[k] is not None and ids[k] == old[k]:
                k += 1
            if k:
                g[0], g[1], g[2] = old[:k], links[:k], g[2] + 1
        m = self._member.setdefault(sid, {})
        for name in names:
            m.setdefault(name, deps)

    def missed(self, agent: tuple, sibling: bool) -> None:
        """A newcomer's plan (from its group when ``sibling``) expired before it called: counted as
        a first call that did not read it (a declared node that does not run keeps its chain from
        being planned at once)."""
        if sibling:  # a sibling due now that did not call: not planned from its group again
            self._sib_count(agent[0], 0.0)
            self._member[agent[0]][agent[1]] = None  # kept: parallel() does not add it back
        else:
            self._rate.add(1.0, 0.0)

    def _sib_count(self, sid: Hashable, read: float) -> None:
        n, r = self._sess_sib.get(sid, (0.0, 0.0))
        self._sess_sib[sid] = (n + 1.0, r + read)
        self._sib.add(1.0, read)

    def end(self, sid: Hashable) -> None:
        """The session ended (the planner forgets its agents, provisional ones included)."""
        self._sig.pop(sid, None)
        self._agents.pop(sid, None)
        self._groups.pop(sid, None)
        self._member.pop(sid, None)
        self._sess_sib.pop(sid, None)

    def describe(self) -> dict[str, float]:
        return {"first_calls": self._rate.trials, "read_prefix": self._rate.reads, "p_read": self._rate.p(),
                "sibling_first_calls": self._sib.trials, "sibling_read": self._sib.reads, "p_sibling_read": self._sib.p(),
                "p_extension_read": self._ext.p()}

