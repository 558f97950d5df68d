"""Cache-break accounting: pure objects, no Db (docs/prompts.md "Breaks").

A call's prompt *shares* with an earlier prompt of its session the tokens of their longest
common run of leading segments with equal keys (equal tokens). It *could have shared* the
tokens of the longest leading run that an earlier prompt matches up to order and serialisation:
segments with equal ``canon`` (the same content, however it was serialised) in the same order,
except that a run of tools matches the earlier prompt's run of tools as a set -- taken in the
earlier prompt's order for as long as the call has each of them, and passed whole only when the
call has exactly those tools. Both are maxima over the session's last ``history`` prompts;
``could`` counts the earlier prompt's tokens (what the call would have shared had it been
rendered that way).

A call *breaks* when it shares at least ``min_lost_tokens`` fewer than it could have; the
difference is its ``tokens_lost``. A tool really added or removed, a new message or an edited
one is no break: nothing could have shared it. A tool added mid-list by a name-sorted order is a
break (first-seen order would have kept the earlier prefix).

    counter = SessionBreaks()
    for rendered in prompts_of_one_session:
        report = counter.observe(rendered)      # CallBreaks(tokens, shared, could, lost, broke)
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass

from kvdb.errors import InvalidInput

__all__ = ["BreakBook", "CallBreaks", "SessionBreaks"]

# one earlier prompt: per segment (kind, key, canon, tokens)
_Prompt = tuple


@dataclass(frozen=True)
class CallBreaks:
    """One call: its ``tokens``, the leading tokens it ``shared`` with an earlier prompt of the
    session, those it ``could`` have shared, ``lost`` = could - shared, and whether it ``broke``."""

    tokens: int
    shared: int
    could: int
    lost: int
    broke: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _shared(cur: _Prompt, prev: _Prompt) -> int:
    n = 0
    for c, p in zip(cur, prev):
        if c[1] != p[1]:
            break
        n += c[3]
    return n


def _run_end(p: _Prompt, i: int) -> int:
    while i < len(p) and p[i][0] == "tool":
        i += 1
    return i


def _could(cur: _Prompt, prev: _Prompt) -> int:
    i = j = n = 0
    while i < len(cur) and j < len(prev):
        if cur[i][0] == "tool" and prev[j][0] == "tool":
            ci, pj = _run_end(cur, i), _run_end(prev, j)
            have = Counter(s[2] for s in cur[i:ci])
            k = j
            while k < pj and have[prev[k][2]] > 0:
                have[prev[k][2]] -= 1
                n += prev[k][3]
                k += 1
            if k < pj or ci - i != pj - j:
                break
            i, j = ci, pj
            continue
        if cur[i][2] != prev[j][2]:
            break
        n += prev[j][3]
        i += 1
        j += 1
    return n


class SessionBreaks:
    """Break accounting for one session: ``observe`` each call's rendered prompt in order."""

    __slots__ = ("history", "min_lost_tokens", "_prev", "calls", "breaks", "tokens", "shared_tokens", "tokens_lost")

    def __init__(self, *, history: int = 16, min_lost_tokens: int = 1) -> None:
        for name, v in (("history", history), ("min_lost_tokens", min_lost_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidInput(f"{name} must be an int >= 1, got {v!r}")
        self.history = history
        self.min_lost_tokens = min_lost_tokens
        self._prev: list[_Prompt] = []
        self.calls = self.breaks = self.tokens = self.shared_tokens = self.tokens_lost = 0

    def observe(self, rendered) -> CallBreaks:
        segs = getattr(rendered, "segments", None)
        if segs is None:
            raise InvalidInput(f"observe takes a rendered prompt (kvdb.prompts.render), got {type(rendered).__name__}")
        cur: _Prompt = tuple((s.kind, s.key, s.canon, s.end - s.start) for s in segs)
        tokens = sum(s[3] for s in cur)
        shared = could = 0
        for prev in self._prev:
            shared = max(shared, _shared(cur, prev))
            could = max(could, _could(cur, prev))
        lost = max(0, could - shared)
        broke = lost >= self.min_lost_tokens
        if cur not in self._prev:
            self._prev.append(cur)
            if len(self._prev) > self.history:
                del self._prev[0]
        self.calls += 1
        self.breaks += broke
        self.tokens += tokens
        self.shared_tokens += shared
        self.tokens_lost += lost
        return CallBreaks(tokens, shared, could, lost, broke)

    def stats(self) -> dict:
        return {"calls": self.calls, "breaks": self.breaks, "tokens": self.tokens,
                "shared_tokens": self.shared_tokens, "tokens_lost": self.tokens_lost}


class BreakBook:
    """Break accounting for many sessions, by id; totals survive a session's end. At most
    ``max_sessions`` are tracked: the least recently observed one is dropped past that."""

    def __init__(self, *, max_sessions: int = 65536, history: int = 16, min_lost_tokens: int = 1) -> None:
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise InvalidInput(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.max_sessions = max_sessions
        self._kw = dict(history=history, min_lost_tokens=min_lost_tokens)
        SessionBreaks(**self._kw)  # checks the options now
        self._sessions: OrderedDict[str, SessionBreaks] = OrderedDict()
        self.totals = dict.fromkeys(("calls", "breaks", "tokens", "shared_tokens", "tokens_lost"), 0)

    def observe(self, session_id: str, rendered) -> CallBreaks:
        if not isinstance(session_id, str) or not session_id:
            raise InvalidInput(f"session_id must be a non-empty string, got {session_id!r}")
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = SessionBreaks(**self._kw)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        r = s.observe(rendered)
        t = self.totals
        t["calls"] += 1
        t["breaks"] += r.broke
        t["tokens"] += r.tokens
        t["shared_tokens"] += r.shared
        t["tokens_lost"] += r.lost
        return r

    def session(self, session_id: str) -> dict | None:
        s = self._sessions.get(session_id)
        return None if s is None else s.stats()

    def end(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._sessions)

    def stats(self) -> dict:
        return dict(self.totals, sessions=len(self._sessions))
