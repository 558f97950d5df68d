"""N1: an agent that has not called yet will read what its kind read in sessions like its own --
learned online (kvdb.planner.policies.planned).

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

docs/planner.md, "Newcomers".
"""

from __future__ import annotations

from collections.abc import Hashable

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
        self.first_calls = 0.0
        self.read = 0.0

    def p(self) -> float:
        return (self.read + 1.0) / (self.first_calls + 2.0)

    def called(self, agent: tuple) -> bool:
        """Whether the agent called in its session (a newcomer has not)."""
        s = self._agents.get(agent[0])
        return s is not None and agent[1] in s

    def prefix(self, agent: tuple) -> list:
        """The links a newcomer is planned to read; empty when its role prefix is unknown."""
        sig = self._sig.get(agent[0])
        if sig is None or self._formed.get((sig, agent[1]), 0) < 2:
            return []
        return self._links[(sig, agent[1])]

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
            formed = self._formed.get(key, 0)
            if formed >= 2 and old:
                self._count(k == len(old))
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

    def missed(self) -> None:
        """A newcomer's plan expired before it called: counted as a first call that did not read
        its prefix (a declared node that does not run keeps its chain from being planned at once)."""
        self._count(False)

    def _count(self, read: bool) -> None:
        self.first_calls += 1.0
        if read:
            self.read += 1.0
        if self.first_calls > WINDOW:
            self.first_calls *= 0.5
            self.read *= 0.5

    def end(self, sid: Hashable) -> None:
        """The session ended (the planner forgets its agents, provisional ones included)."""
        self._sig.pop(sid, None)
        self._agents.pop(sid, None)

    def describe(self) -> dict[str, float]:
        return {"first_calls": self.first_calls, "read_prefix": self.read, "p_read": self.p()}
