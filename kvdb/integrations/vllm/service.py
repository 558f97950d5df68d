"""The worker's Db as a service to vLLM's scheduler: lookups and session calls.

vLLM runs the connector twice: a scheduler half (answers "how many tokens of this prompt can
you load?") and a worker half (holds the paged KV cache and moves blocks). kvdb allows one Db
per data directory (kvdb/db/core.py, ``LOCK``), and the blocks must live where the KV cache is,
so the **worker owns the Db** and the scheduler asks it:

    same process (VLLM_ENABLE_V1_MULTIPROCESSING=0, or the "uni" executor inside EngineCore)
        the scheduler finds the worker's ``KvdbService`` in a process-wide registry keyed by the
        data directory's real path and calls it directly
    separate processes (vLLM's default multiprocess executor)
        the worker serves the same calls on a Unix socket in the abstract namespace, named from a
        secret it writes to the data directory at each start; the scheduler reads the secret and
        connects (kvdb/integrations/vllm/endpoint.py: the name, the checks both ways, the bounds)

Wire format (both directions): a 4-byte big-endian length, then a UTF-8 JSON object. Requests:
``{"op": "lookup", "req": id, "tenant": str, "hashes": [hex, ...], "params": {...} | null,
"tokens": [int, ...]}`` -> ``{"hit_blocks": n, "hints": [...], "prompt": {...}}``;
``{"op": "finished", "req": id, "hashes": [hex, ...], "pool": bool, "pool_stats": {...}}`` ->
``{"hints": [...], "prompt": {...}, "demote": [i, ...], "session_ended": bool}`` (``pool``: the
scheduler half holds vLLM's pool, kvdb/integrations/vllm/pool.py; a lookup's answer then also
carries ``prefix_blocks``, how many of its blocks its ``prefix_hash`` covers);
``{"op": "explain", "session_id": sid}``; ``{"op": "stats"}``. Errors come back as
``{"error": "..."}``. Frames over ``MAX_FRAME`` bytes close the connection; a request the
scheduler would send over it is refused before sending (``FrameTooLarge``): a lookup goes again
without its ``kv_transfer_params``, whose hint outcome says rejected (``call_oversized``).

Trust boundary (T1): a connection is served only when the peer process runs as this process's
user (``SO_PEERCRED``) and proves it holds the secret: the same user can read the data
directory anyway, anyone else gets nothing, not even whether a key is stored. T2: nothing a
client sends is evaluated; JSON only, nested at most 64 deep.

Open calls: a lookup's call is kept until its ``finished``; at most ``max_calls``
(``MAX_OPEN_CALLS``) are, the oldest beyond that ended as if finished (``evicted_calls``), so
lookups that never finish cannot grow the worker without bound.

Session calls (kvdb/db/core.py engine API) happen here, in the Db's process: a request's
``kv_transfer_params`` may carry ``session_id``, ``agent_id``, ``node_id`` and hints (``ttl_s``,
``priority``, ``prefix_hash``, ``expected_tool_duration_s``). The first lookup of a request is
its ``call_started`` (later lookups of the same request, e.g. after a preemption, are not); its
``AccessContext`` is kept for the request's saves; ``finished`` is its ``call_finished``. Every
hint comes back accepted / clipped / rejected with a reason; a malformed one never fails a
request.

Rendered prompts: ``kv_transfer_params["prompt"]`` may carry the segments of a prompt rendered by
``kvdb.prompts.render`` (``kvdb.prompts.transfer_params``; the format is kvdb/prompts/wire.py's),
with the request's ``tokens`` sent on its first lookup. The lookup checks them against the
tokens and answers a near-match report (``Db.near_match`` over the request's engine keys); the
end of the request notes the prompt (``Db.note_prompt`` under the engine keys of its full blocks,
in the session's break accounting when it has a ``session_id``): ``stats()["prompts"]`` and
``explain``. Bad segments are ignored with a counted reason (``prompt_ignored_reasons``), never
an error.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from kvdb.db.plans.waits import OFFLOAD_MIN_WAIT_S
from kvdb.errors import FrameTooLarge, KvdbError
from kvdb.integrations.vllm.endpoint import MAX_FRAME, Server, ServiceClient
from kvdb.prompts.wire import from_params

log = logging.getLogger("kvdb.vllm")

MAX_OPEN_CALLS = 4096  # calls of requests looked up and not yet finished (vLLM runs at most max_num_seqs)
# kv_transfer_params keys that name the call rather than hint about it
CALL_KEYS = ("session_id", "agent_id", "node_id")
# hints given when the call ends, not when it starts
FINISH_HINTS = ("expected_tool_duration_s",)
# keys vLLM itself and its disaggregated-prefill connectors put in kv_transfer_params
FOREIGN_PREFIXES = ("do_remote_", "remote_", "kvdb")
# the rendered prompt's segments (kvdb/prompts/wire.py), not a hint
PROMPT_KEY = "prompt"
# true in a session's last call: the session ends with it (its pins in vLLM's pool go too)
END_KEY = "end_session"

_registry: dict[str, "KvdbService"] = {}
_registry_lock = threading.Lock()


def service_key(path: str) -> str:
    return os.path.realpath(path)


def local_service(path: str) -> "KvdbService | None":
    with _registry_lock:
        return _registry.get(service_key(path))


@dataclass
class Counters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    load_failed_blocks: int = 0
    saved_blocks: int = 0
    failed_saves: int = 0
    rejected_hints: int = 0
    refused_requests: int = 0
    evicted_calls: int = 0  # calls ended because more than max_calls were open
    noted_prompts: int = 0
    ignored_prompts: int = 0
    prompt_ignored_reasons: dict = field(default_factory=dict)  # reason (kvdb/prompts/wire.py REASONS) -> count

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["prompt_ignored_reasons"] = dict(self.prompt_ignored_reasons)
        return d


@dataclass
class _Call:
    session_id: str | None
    agent_id: str | None
    node_id: str | None
    ctx: Any
    finish_hints: dict = field(default_factory=dict)
    tenant: str = ""
    prompt: Any = None  # the request's Rendered prompt, noted when it finishes
    end: bool = False  # the session ends with this call (END_KEY)


def _outcome(name: str, status: str, reason: str) -> dict:
    return {"hint": name, "status": status, "value": None, "reason": reason}


class KvdbService:
    """What the scheduler half may ask of the Db. Thread-safe (the Db is; ``_calls`` is locked)."""

    def __init__(self, db, path: str) -> None:
        self.db = db
        self.path = path
        self.counters = Counters()
        self._calls: dict[str, _Call] = {}
        self._lock = threading.Lock()
        self._server: Server | None = None
        self.max_calls = MAX_OPEN_CALLS
        self.worker = None  # the Worker that owns the Db (kvdb/integrations/vllm/worker.py), for introspection
        self.pool_stats: dict | None = None  # the scheduler half's vLLM pool ops (kvdb/integrations/vllm/pool.py)

    # -------------------------------------------------------------- registration
    def register(self, serve_socket: bool = True) -> None:
        with _registry_lock:
            _registry[service_key(self.path)] = self
        if serve_socket:
            self._server = Server(self.handle, self.path)

    def unregister(self) -> None:
        with _registry_lock:
            if _registry.get(service_key(self.path)) is self:
                del _registry[service_key(self.path)]
        if self._server is not None:
            self._server.close()
            self._server = None

    # -------------------------------------------------------------- calls
    def keys(self, tenant: str, hashes) -> list[bytes]:
        return self.db.engine_keys(hashes, tenant=tenant)

    def ctx(self, req_id: str):
        with self._lock:
            call = self._calls.get(req_id)
        return None if call is None else call.ctx

    def lookup(self, req_id: str, tenant: str, hashes: list[bytes], params: dict | None,
               tokens: list[int] | None = None) -> dict:
        """Leading blocks of ``hashes`` stored in any tier; the first lookup of ``req_id`` also
        starts its session call and reads its rendered prompt (``tokens``: the prompt's ids)."""
        outcomes: list[dict] = []
        with self._lock:
            known = req_id in self._calls
        call = None
        keys = self.keys(tenant, hashes) if hashes else []
        prefix = prefix_blocks(params, hashes, keys)
        if not known:
            if prefix and isinstance(params, dict) and len(str(params.get("prefix_hash"))) != 2 * len(keys[0]):
                params = dict(params, prefix_hash=keys[prefix - 1].hex())  # vLLM's hash -> its kvdb key
            call, outcomes = self._call_started(tenant, params)
            call.tenant = tenant
            with self._lock:
                self._calls[req_id] = call
                evicted = [self._calls.pop(next(iter(self._calls))) for _ in range(len(self._calls) - self.max_calls)]
            for old in evicted:  # ended as if finished, its rendered prompt not noted
                self.counters.evicted_calls += 1
                old.prompt = None
                self._end_call(old)
        ctx = self.ctx(req_id)
        n = self.db.match_prefix(keys, ctx=ctx) if keys else 0
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += len(keys)
        c.hit_blocks += n
        c.rejected_hints += sum(o.get("status") == "rejected" for o in outcomes)
        out = {"hit_blocks": n, "hints": outcomes}
        if prefix:
            out["prefix_blocks"] = prefix
        if call is not None and isinstance(params, dict) and PROMPT_KEY in params:
            out["prompt"] = self._read_prompt(call, params[PROMPT_KEY], tokens, keys)
        return out

    def _ignore_prompt(self, reason: str, detail: str) -> dict:
        c = self.counters
        c.ignored_prompts += 1
        c.prompt_ignored_reasons[reason] = c.prompt_ignored_reasons.get(reason, 0) + 1
        return {"status": "ignored", "reason": reason, "detail": detail}

    def _read_prompt(self, call: _Call, params: Any, tokens, keys: list[bytes]) -> dict:
        """The prompt's segments checked against its tokens, kept on ``call``; a near-match report."""
        if tokens is not None and not isinstance(tokens, list):
            tokens = None
        rendered, reason, detail = from_params(tokens, params)
        if rendered is None:
            return self._ignore_prompt(reason, detail)
        try:
            call.prompt = rendered.keyed(self.db.keyspace, call.tenant)
            near = self.db.near_match(call.prompt, tenant=call.tenant, block_keys=keys)
        except (KvdbError, TypeError, ValueError, OverflowError) as e:
            call.prompt = None
            return self._ignore_prompt("refused", f"{type(e).__name__}: {e}")
        return {"status": "accepted", "segments": len(rendered.segments), "exact_tokens": near.exact_tokens,
                "near_tokens": near.near_tokens,
                "near_segments": sum(s.status == "near" for s in near.segments)}

    def _note_prompt(self, call: _Call, hashes) -> dict:
        bt = self.db.layout.block_tokens
        full = len(call.prompt.token_ids) // bt
        try:
            keys = self.keys(call.tenant, list(hashes or ())[:full])
            got = self.db.note_prompt(call.prompt, session_id=call.session_id, tenant=call.tenant, block_keys=keys)
        except (KvdbError, TypeError, ValueError, OverflowError) as e:
            return self._ignore_prompt("refused", f"{type(e).__name__}: {e}")
        self.counters.noted_prompts += 1
        return {"status": "noted", **(got.as_dict() if got is not None else {})}

    def _call_started(self, tenant: str, params: dict | None) -> tuple[_Call, list[dict]]:
        if params is None:
            return _Call(None, None, None, None), []
        if not isinstance(params, dict):
            return _Call(None, None, None, None), [_outcome("kv_transfer_params", "rejected", "not a JSON object")]
        ids, outcomes = {}, []
        for name in CALL_KEYS:
            v = params.get(name)
            if v is None:
                continue
            if isinstance(v, str) and v and len(v) <= 256:
                ids[name] = v
            else:
                outcomes.append(_outcome(name, "rejected", "must be a non-empty string of at most 256 characters"))
        start, finish = {}, {}
        for name, v in params.items():
            if name in CALL_KEYS or name in (PROMPT_KEY, END_KEY) or not isinstance(name, str) or name.startswith(FOREIGN_PREFIXES):
                continue
            (finish if name in FINISH_HINTS else start)[name] = v
        sid = ids.get("session_id")
        if sid is None:
            if start or finish:
                outcomes += [_outcome(k, "rejected", "hints need a session_id") for k in (*start, *finish)]
            return _Call(None, None, None, None), outcomes
        try:
            ctx, got = self.db.call_started(sid, agent_id=ids.get("agent_id"), node_id=ids.get("node_id"),
                                            tenant=tenant, hints=start or None)
            outcomes += [o.as_dict() for o in got]
        except (KvdbError, TypeError, ValueError, OverflowError) as e:
            outcomes.append(_outcome("session_id", "rejected", f"{type(e).__name__}: {e}"))
            return _Call(None, None, None, None), outcomes
        return _Call(sid, ids.get("agent_id"), ids.get("node_id"), ctx, finish, end=params.get(END_KEY) is True), outcomes

    def finished(self, req_id: str, hashes=None, pool: bool = False) -> dict:
        """The end of ``req_id``: its session's ``call_finished``; its rendered prompt is noted
        under the engine keys of ``hashes`` (its full blocks; a prompt takes its own). With
        ``pool`` (the scheduler holds vLLM's pool): ``demote``, the indices into ``hashes`` of
        the blocks vLLM should reuse first (kvdb/integrations/vllm/pool.py), and
        ``session_ended`` when the call ended its session (``end_session``)."""
        with self._lock:
            call = self._calls.pop(req_id, None)
        if call is None:
            return {"hints": []}
        out = self._end_call(call, hashes)
        if call.session_id is None or not (pool or call.end):
            return out
        try:
            if pool and hashes:
                out["demote"] = self._demote(call, list(hashes))
            if call.end:
                self.db.end_session(call.session_id)
                out["session_ended"] = True
        except KvdbError as e:
            log.warning("kvdb: the end of request %s: %s", req_id, e)
        return out

    def _demote(self, call: _Call, hashes: list) -> list[int]:
        """Blocks of the call kvdb holds and vLLM may reuse first: the agent's private ones
        while it waits on a tool longer than the Db's own offload threshold (E1), or when its
        session ends with this call."""
        got = self.db.agent_private(call.session_id, call.agent_id)
        if got is None:
            return []
        left, private = got
        if not call.end and (left is None or left <= OFFLOAD_MIN_WAIT_S):
            return []
        keys = self.keys(call.tenant, hashes)
        stored = self.db.match_prefix(keys, peek=True)  # connector I2: vLLM may drop only what kvdb holds
        return [i for i in range(stored) if keys[i] in private]

    def _end_call(self, call: _Call, hashes=None) -> dict:
        prompt = {} if call.prompt is None else {"prompt": self._note_prompt(call, hashes)}
        if call.session_id is None:
            return {"hints": [], **prompt}
        try:
            got = self.db.call_finished(call.session_id, agent_id=call.agent_id, node_id=call.node_id,
                                        hints=call.finish_hints or None)
            outcomes = [o.as_dict() for o in got]
        except (KvdbError, TypeError, ValueError, OverflowError) as e:
            outcomes = [_outcome("expected_tool_duration_s", "rejected", f"{type(e).__name__}: {e}")]
        self.counters.rejected_hints += sum(o.get("status") == "rejected" for o in outcomes)
        return {"hints": outcomes, **prompt}

    def explain(self, session_id: str) -> dict:
        return self.db.explain(session_id=session_id)

    def stats(self) -> dict:
        out = {"connector": self.counters.as_dict(), "db": self.db.stats()}
        if self.pool_stats is not None:
            out["pool"] = dict(self.pool_stats)
        if self._server is not None:
            out["endpoint"] = self._server.status()
        return out

    # -------------------------------------------------------------- the wire
    def call(self, msg: dict) -> dict:
        """One request of the wire format, with ``hashes`` already bytes; errors come back as
        ``{"error": ...}``, never raised (a bad request must not take the worker down)."""
        op = msg.get("op")
        try:
            if op == "lookup":
                return self.lookup(str(msg["req"]), str(msg["tenant"]), list(msg["hashes"]), msg.get("params"),
                                   msg.get("tokens"))
            if op == "finished":
                if isinstance(msg.get("pool_stats"), dict):
                    self.pool_stats = msg["pool_stats"]
                return self.finished(str(msg["req"]), msg.get("hashes"), bool(msg.get("pool")))
            if op == "explain":
                return self.explain(str(msg["session_id"]))
            if op == "stats":
                return self.stats()
            return {"error": f"unknown op {op!r}"}
        except (KvdbError, KeyError, TypeError, ValueError, OverflowError) as e:
            return {"error": f"{op}: {type(e).__name__}: {e}"}

    def handle(self, msg: dict) -> dict:
        """A request off the socket: hashes arrive as hex strings."""
        if "hashes" in msg:
            try:
                msg = dict(msg, hashes=[bytes.fromhex(h) for h in msg["hashes"]])
            except (TypeError, ValueError) as e:
                return {"error": f"hashes must be hex strings: {e}"}
        return self.call(msg)


def call_oversized(client: ServiceClient, msg: dict, err: FrameTooLarge) -> dict | None:
    """A request the scheduler cannot send whole (``err``): logged as an error; a lookup goes again
    without its ``kv_transfer_params`` and tokens (its hits still count) and its hint outcomes say
    ``kv_transfer_params`` was rejected; anything else is a miss."""
    log.error("kvdb: request %s (%s): %s; its kv_transfer_params are ignored: keep them (and any rendered "
              "prompt) under %d MiB", msg.get("req"), msg.get("op"), err, MAX_FRAME >> 20)
    if msg.get("op") != "lookup":
        return None
    outcome = _outcome("kv_transfer_params", "rejected", f"{err}: ignored; the lookup went on without them")
    try:
        resp = client.call(dict(msg, params=None, tokens=None))
    except FrameTooLarge:
        resp = None
    if resp is None or "error" in resp:
        return {"hit_blocks": 0, "hints": [outcome]}
    return dict(resp, hints=[outcome, *resp.get("hints", [])])


def prefix_blocks(params: Any, hashes: list, keys: list[bytes]) -> int:
    """How many of the request's blocks its ``prefix_hash`` hint covers: the hint names the
    prefix's last block by vLLM's own block hash (hex) or by its kvdb key (hex, or the key);
    0 when it names none of the request's blocks."""
    if not isinstance(params, dict) or not keys:
        return 0
    v = params.get("prefix_hash")
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).hex()
    if not isinstance(v, str) or len(v) > 256:
        return 0
    v = v.lower()
    for seq in (keys, hashes):
        for i, h in enumerate(seq):
            if bytes(h).hex() == v:
                return i + 1
    return 0
