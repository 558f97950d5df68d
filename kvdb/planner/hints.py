"""Hints: advisory facts a caller gives the planner about a session.

Each hint is validated on its own and gets an outcome, never an exception for a merely
implausible value (docs/style.md "Errors": a rejected hint is an outcome):

    accepted   used as given
    clipped    outside its sane range; used at the nearest bound (the outcome says which)
    rejected   unusable (wrong type, NaN, negative, unknown name); ignored, with the reason

Numbers may be ints of any size: one past float's range (``10**400``) counts as infinite, so a
duration is clipped to its bound, never an OverflowError. ``prefix_hash`` takes a string (a
block key's 32 hex digits), an int (an engine's hash) or the 16-byte block key itself.

Bounds (why): tool waits and TTLs beyond a day say nothing a cache can act on, and a zero
TTL or duration is legal (it means "not coming back soon"). Priorities are small integers
0..9 (higher = more valuable), like nice levels turned around.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from kvdb.errors import InvalidInput
from kvdb.types import KEY_BYTES

MAX_DURATION_S = 86_400.0
MAX_PRIORITY = 9

ACCEPTED, CLIPPED, REJECTED = "accepted", "clipped", "rejected"

# name -> kind; kept stable: trace files and the engine API use these names
HINT_KINDS = {
    "expected_tool_duration_s": "duration",
    "ttl_s": "duration",
    "priority": "priority",
    "prefix_hash": "opaque",
    "tool": "opaque",
}


@dataclass(frozen=True)
class HintOutcome:
    name: str
    status: str  # accepted | clipped | rejected
    value: Any  # the value the planner will use (None when rejected)
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = {"hint": self.name, "status": self.status, "value": self.value}
        if self.reason:
            d["reason"] = self.reason
        return d


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:  # an int past float's range (10**400): as far out as a float goes
        return math.inf if v > 0 else -math.inf


def _opaque(name: str, value: Any) -> HintOutcome:
    """``tool`` and ``prefix_hash``: a string or an int; ``prefix_hash`` also takes the block
    key itself (16 bytes, as ``db.block_keys`` returns it), used as its 32 hex digits."""
    if name == "prefix_hash" and isinstance(value, (bytes, bytearray)):
        if len(value) != KEY_BYTES:
            return HintOutcome(name, REJECTED, None, f"a block key is {KEY_BYTES} bytes, got {len(value)}")
        return HintOutcome(name, ACCEPTED, bytes(value).hex())
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        what = "a string, an integer or a block key (bytes)" if name == "prefix_hash" else "a string or an integer"
        return HintOutcome(name, REJECTED, None, f"must be {what}, got {type(value).__name__}")
    return HintOutcome(name, ACCEPTED, value)


def check_hint(name: str, value: Any) -> HintOutcome:
    kind = HINT_KINDS.get(name)
    if kind is None:
        return HintOutcome(name, REJECTED, None, f"unknown hint; known: {sorted(HINT_KINDS)}")
    if kind == "opaque":
        return _opaque(name, value)
    x = _number(value)
    if x is None:
        return HintOutcome(name, REJECTED, None, f"must be a number, got {type(value).__name__}")
    if math.isnan(x):
        return HintOutcome(name, REJECTED, None, "is NaN")
    if kind == "duration":
        if x < 0:
            return HintOutcome(name, REJECTED, None, f"is negative ({x!r}); a duration must be >= 0")
        if x > MAX_DURATION_S:
            return HintOutcome(name, CLIPPED, MAX_DURATION_S, f"above {MAX_DURATION_S:g} s")
        return HintOutcome(name, ACCEPTED, x)
    # priority
    if isinstance(value, int):  # exact, however large (10**400 is clipped, not an overflow)
        x = p = value
    elif not math.isfinite(x):
        return HintOutcome(name, REJECTED, None, "must be finite")
    else:
        p = int(round(x))
    if p < 0:
        return HintOutcome(name, CLIPPED, 0, "below 0")
    if p > MAX_PRIORITY:
        return HintOutcome(name, CLIPPED, MAX_PRIORITY, f"above {MAX_PRIORITY}")
    if p != x:
        return HintOutcome(name, CLIPPED, p, "rounded to an integer")
    return HintOutcome(name, ACCEPTED, p)


def check_hints(hints: Mapping[str, Any]) -> tuple[dict[str, Any], list[HintOutcome]]:
    """Validate every hint; returns (usable values, outcome per hint in the given order).
    ``hints`` itself must be a mapping (InvalidInput): its values are what may be rejected."""
    if not isinstance(hints, Mapping):
        raise InvalidInput(f"hints must be a mapping of hint name to value, got {type(hints).__name__}")
    usable: dict[str, Any] = {}
    outcomes: list[HintOutcome] = []
    for name, value in hints.items():
        o = check_hint(str(name), value)
        outcomes.append(o)
        if o.status != REJECTED:
            usable[o.name] = o.value
    return usable, outcomes
