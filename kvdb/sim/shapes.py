"""The workload shapes ``kvdb gen`` can add to its agent traces (kvdb/sim/generator.py), each off
by default, and the presets that turn several on (``kvdb gen --shape agentic-mix``).

Shapes (parameter: what changes in the trace)
    ``chain_break_prob``      each call of an agent that has called before in its session gets,
                              with this probability, new shared context (``chain_break_blocks``
                              blocks, "from other agents") inserted *before* its own history:
                              its prompt no longer extends its previous one
    ``apps``                  > 0: every session belongs to one of ``apps`` applications
                              (Zipf-popular: app i weighs 1/(i+1)); each app has
                              ``app_system_prompts`` system prompts (coordinator, workers and
                              reviewer take prompt 0, 1 % n and 2 % n) of
                              ``system_prompt_blocks`` blocks, and one tool-schema block of
                              ``app_tool_schema_blocks`` blocks that every agent of every session
                              of the app puts after it (instead of per-tool schemas)
    ``react``                 every worker node, and the reviewer that replaces the
                              coordinator's fan-in call, is a ReAct loop of ``react_calls``
                              [min, max] calls with a tool wait after each but the last; tool
                              i waits ``react_wait_medians_s[i % len]`` at the median, with a
                              heavy tail: ``react_wait_tail`` "lognormal" (sigma
                              ``react_wait_sigma``) or "pareto" (shape
                              ``react_wait_pareto_alpha``), capped at ``tool_wait_max_s``
    ``namespaced_agent_ids``  calls name their agent ``ns/<session>/<agent>``; workflow nodes
                              keep ``<agent>``: only ``node_id`` links a call to its node
    ``tool_list_change_prob`` the probability that a session's tool list changes at the start of
                              a round after its first (sessions of one round never change): from
                              then on every agent's tool-schema blocks are version v of
                              ``tool_list_variants`` (shared with sessions that got the same v)
    ``hint_scale``, ``hint_shuffle``, ``wrong_workflow_prob``   wrong hints: every declared tool
                              duration (call hints and workflow tool nodes) times
                              ``hint_scale``; with ``hint_shuffle`` the declared durations are
                              permuted across the whole trace (each names another wait); with
                              probability ``wrong_workflow_prob`` a session's workflow declares
                              one phantom worker per round and one more round (plan and fan-in)
                              that never call

Determinism: each shape draws from its own ``random.Random`` seeded from (seed, shape name), so
turning one on leaves the draws of the others, and of the base trace, as they were: with
``namespaced_agent_ids`` only ``agent_id`` differs from the default trace, with wrong hints only
the declared durations and workflows. ``react`` changes the DAG, so the base draws too.
"""

from __future__ import annotations

import math
import random
from typing import Any

from kvdb.errors import InvalidInput

SHAPE_DEFAULTS: dict[str, Any] = {
    "chain_break_prob": 0.0,
    "chain_break_blocks": [1, 4],
    "apps": 0,
    "app_system_prompts": 2,
    "app_tool_schema_blocks": 16,
    "react": False,
    "react_calls": [1, 4],
    "react_wait_medians_s": [0.3, 2.0, 15.0],
    "react_wait_tail": "lognormal",
    "react_wait_sigma": 1.0,
    "react_wait_pareto_alpha": 1.5,
    "namespaced_agent_ids": False,
    "tool_list_change_prob": 0.0,
    "tool_list_variants": 3,
    "hint_scale": 1.0,
    "hint_shuffle": False,
    "wrong_workflow_prob": 0.0,
}

# Presets (``kvdb gen --shape NAME``): parameter overrides on top of the defaults and --params.
PRESETS: dict[str, dict[str, Any]] = {
    # the kinds of agent workload the planner was not tuned on (issue 13): every shape but the
    # wrong hints, at rates where each matters without drowning the others
    "agentic-mix": {
        "chain_break_prob": 0.3,
        "apps": 4,
        "app_tool_schema_blocks": 16,
        "react": True,
        "namespaced_agent_ids": True,
        "tool_list_change_prob": 0.2,
    },
}

TAILS = ("lognormal", "pareto")


def check_shape_params(p: dict[str, Any]) -> None:
    """Raise InvalidInput naming the first shape parameter that is out of range."""
    for k in ("chain_break_blocks", "react_calls"):
        v = p[k]
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                and 1 <= v[0] <= v[1]):
            raise InvalidInput(f"generator parameter {k!r} must be [min, max] integers >= 1, got {v!r}")
    for k in ("apps", "app_system_prompts", "app_tool_schema_blocks", "tool_list_variants"):
        if isinstance(p[k], bool) or not isinstance(p[k], int) or p[k] < 0:
            raise InvalidInput(f"generator parameter {k!r} must be an integer >= 0, got {p[k]!r}")
    if p["app_system_prompts"] < 1 or p["tool_list_variants"] < 1:
        raise InvalidInput("app_system_prompts and tool_list_variants must be at least 1")
    for k in ("chain_break_prob", "tool_list_change_prob", "wrong_workflow_prob"):
        v = p[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise InvalidInput(f"generator parameter {k!r} must be a probability in [0, 1], got {v!r}")
    for k in ("react_wait_sigma", "react_wait_pareto_alpha", "hint_scale"):
        v = p[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InvalidInput(f"generator parameter {k!r} must be a finite number > 0, got {v!r}")
    m = p["react_wait_medians_s"]
    if not (isinstance(m, list) and m and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                              and math.isfinite(x) and x > 0 for x in m)):
        raise InvalidInput(f"generator parameter 'react_wait_medians_s' must be a non-empty list of numbers > 0, got {m!r}")
    if p["react_wait_tail"] not in TAILS:
        raise InvalidInput(f"generator parameter 'react_wait_tail' must be one of {TAILS}, got {p['react_wait_tail']!r}")
    for k in ("react", "namespaced_agent_ids", "hint_shuffle"):
        if not isinstance(p[k], bool):
            raise InvalidInput(f"generator parameter {k!r} must be true or false, got {p[k]!r}")


def preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise InvalidInput(f"unknown workload shape {name!r}; one of {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])


class Shapes:
    """One generation's shape draws: a ``random.Random`` per shape, seeded from (seed, name)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.p = params
        seed = params["seed"]
        self.chain_rng = random.Random(f"{seed}:chain")
        self.app_rng = random.Random(f"{seed}:apps")
        self.tools_rng = random.Random(f"{seed}:tools")
        self.hint_rng = random.Random(f"{seed}:hints")
        self.workflow_rng = random.Random(f"{seed}:workflow")
        self._app_weights = [1.0 / (i + 1) for i in range(params["apps"])]
        self.declared: list[tuple[float, list[tuple[dict[str, Any], str]]]] = []  # declared waits and where they go

    # -- a: chain breaks -------------------------------------------------------------------
    def breaks(self) -> bool:
        """Whether an agent's next call gets new shared context before its own history."""
        return self.p["chain_break_prob"] > 0 and self.chain_rng.random() < self.p["chain_break_prob"]

    def context_blocks(self) -> int:
        return self.chain_rng.randint(*self.p["chain_break_blocks"])

    # -- b: applications -------------------------------------------------------------------
    def app_for_session(self) -> int | None:
        if self.p["apps"] == 0:
            return None
        return self.app_rng.choices(range(self.p["apps"]), weights=self._app_weights)[0]

    def system_prompt(self, app: int, agent: str, tenant: str | None) -> list[tuple]:
        role = 0 if agent == "coordinator" else 2 if agent == "reviewer" else 1
        idx = role % self.p["app_system_prompts"]
        return [("appsys", tenant, app, idx, k) for k in range(self.p["system_prompt_blocks"])]

    def app_tools(self, app: int, version: int, tenant: str | None) -> list[tuple]:
        return [("apptools", tenant, app, version, k) for k in range(self.p["app_tool_schema_blocks"])]

    # -- c: ReAct waits --------------------------------------------------------------------
    def react_wait_s(self, rng: random.Random, tool_index: int) -> float:
        """A heavy-tailed tool wait whose median is the tool's ``react_wait_medians_s`` entry."""
        med = self.p["react_wait_medians_s"]
        m = float(med[tool_index % len(med)])
        if self.p["react_wait_tail"] == "pareto":
            a = self.p["react_wait_pareto_alpha"]
            x = m / 2.0 ** (1.0 / a) * (1.0 - rng.random()) ** (-1.0 / a)  # x_m * U^(-1/a); median m
        else:
            x = rng.lognormvariate(math.log(m), self.p["react_wait_sigma"])
        return min(self.p["tool_wait_max_s"], x)

    # -- d: namespaced agent ids -----------------------------------------------------------
    def call_agent_id(self, session_id: str, agent: str) -> str:
        return f"ns/{session_id}/{agent}" if self.p["namespaced_agent_ids"] else agent

    # -- e: changing tool lists ------------------------------------------------------------
    def tool_change_round(self, rounds: int) -> tuple[int, int] | None:
        """(the round whose start changes the tool list, the new version), or None."""
        if self.p["tool_list_change_prob"] == 0:
            return None
        changes = self.tools_rng.random() < self.p["tool_list_change_prob"]
        r = self.tools_rng.randint(1, max(1, rounds - 1))
        v = self.tools_rng.randint(1, self.p["tool_list_variants"])
        return (r, v) if changes and rounds > 1 else None

    # -- f: wrong hints --------------------------------------------------------------------
    def declare(self, value_s: float, targets: list[tuple[dict[str, Any], str]]) -> None:
        """Record a declared wait (true wait x noise) and the dict keys that carry it."""
        if self.p["hint_shuffle"] or self.p["hint_scale"] != 1.0:
            self.declared.append((value_s, targets))

    def mispredict(self) -> None:
        """Scale and / or permute every declared wait, in place in the lines that carry them."""
        values = [v for v, _ in self.declared]
        if self.p["hint_shuffle"]:
            self.hint_rng.shuffle(values)
        for v, (_, targets) in zip(values, self.declared):
            for d, key in targets:
                d[key] = round(v * self.p["hint_scale"], 3)

    def wrong_workflow(self) -> bool:
        return self.p["wrong_workflow_prob"] > 0 and self.workflow_rng.random() < self.p["wrong_workflow_prob"]
