"""``KvdbConnector``: kvdb as vLLM's KV connector (vLLM v1 ``KVConnectorBase_V1``).

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvdbConnector", kv_connector_module_path="kvdb.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"path": "/var/lib/kvdb", "host_bytes": "8GiB"}))

Block identity: a kvdb block is one vLLM block (``block_tokens`` = vLLM's ``block_size``) and
its key is ``db.engine_keys([request.block_hashes[i]], tenant)``: vLLM's own prefix-chained
hash, salted per tenant (kvdb/keys.py). The tenant is the request's ``cache_salt`` (vLLM folds
it into the hashes too), else ``"default"``: requests with different salts never share blocks.

One step of the engine, and what each half does (docs/vllm.md has the whole picture):

    scheduler half (EngineCore process)            worker half (Worker process, owns the Db)
    get_num_new_matched_tokens -- lookup -------->  KvdbService.lookup: match_prefix (+ call_started)
    update_state_after_alloc: remember the load
    build_connector_meta: loads + saves of the step  ->  start_load_kv: get_prefix -> scatter into
                                                        the paged cache; a block that fails its
                                                        checksum ends the run (I3)
                                                     forward pass
                                                     wait_for_save: gather the step's newly full
                                                        blocks -> put_blocks
    request_finished -- finished ---------------->  KvdbService.finished (call_finished)

Invariants
    I1  A lookup never covers a request's last token: vLLM must compute at least one token to
        sample from, so hits stop at the last full block strictly before it.
    I2  A block is saved once its KV is in the paged cache: at the end of the step whose forward
        pass wrote its last token, and only full blocks (vLLM hashes only those). Blocks kvdb
        reported as stored for the request are not saved again.
    I3  A load never hands vLLM wrong bytes: ``Db.get_prefix`` stops at the first block that is
        missing or fails its checksum, and every block id from there on is reported by
        ``get_block_ids_with_load_errors``, so vLLM recomputes them (with
        ``kv_load_failure_policy="recompute"``; vLLM's default, ``"fail"``, fails the request).
    I4  Loads and saves are synchronous within the step (``start_load_kv`` returns with the
        blocks in place; ``wait_for_save`` with them handed to the Db), so vLLM may free or
        reuse a request's blocks as soon as it finishes.
    I5  ``kv_role`` is vLLM's: ``kv_both`` loads and saves; ``kv_producer`` (a prefill engine)
        saves and never loads (its lookups ask for no block; sessions and hints still run), and
        with a shared pool its saves are published before the step ends, so a request it
        returns can be continued by a ``kv_consumer`` (a decode engine) that loads from the
        pool and never saves (docs/vllm.md "Sharing blocks through a pool").
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvdb.errors import FrameTooLarge, InvalidInput
from kvdb.integrations.vllm.pool import PoolOps
from kvdb.integrations.vllm.service import ServiceClient, call_oversized, local_service
from kvdb.integrations.vllm.settings import Settings
from kvdb.integrations.vllm.worker import Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvdb.vllm")
DEFAULT_TENANT = "default"


@dataclass
class BlockMove:
    """Blocks of one request to load or save this step: hashes[i] lives in vLLM block block_ids[i]."""

    req_id: str
    tenant: str
    hashes: list[bytes]
    block_ids: list[int]
    first_block: int  # depth of hashes[0] in the request's chain


@dataclass
class KvdbConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockMove] = field(default_factory=list)
    saves: list[BlockMove] = field(default_factory=list)


@dataclass
class _ReqState:
    request: Any
    tenant: str | None  # None: the request is not cached in kvdb (its salt cannot name a tenant)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are in kvdb or queued to be saved (I2)
    load: tuple[int, int] | None = None  # (first block, count) to load when next scheduled
    local_blocks: int = 0  # blocks vLLM's own prefix cache had when kvdb was asked
    hint_outcomes: list = field(default_factory=list)
    hit_blocks: int = 0
    prompt: dict | None = None  # what became of kv_transfer_params["prompt"] (kvdb/integrations/vllm/service.py)
    prefix_blocks: int = 0  # blocks of its session's prefix_hash (pinned in vLLM's pool: pool.py)


def _session(request) -> str | None:
    params = getattr(request, "kv_transfer_params", None)
    sid = params.get("session_id") if isinstance(params, dict) else None
    return sid if isinstance(sid, str) and sid else None


def _tenant(request) -> str | None:
    salt = getattr(request, "cache_salt", None)
    if salt is None:
        return DEFAULT_TENANT
    if not isinstance(salt, str) or not salt:
        return None
    try:
        salt.encode("utf-8")
    except UnicodeError:
        return None  # a salt kvdb cannot name a tenant by: the request is neither looked up nor saved
    return salt


class KvdbConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvdb: kv_load_failure_policy=%r; with 'recompute' a block that fails its checksum is "
                        "recomputed instead of failing the request", self._kv_transfer_config.kv_load_failure_policy)
        ktc = self._kv_transfer_config  # I5: kv_producer saves only, kv_consumer loads only, kv_both both
        self.loads, self.saves = bool(ktc.is_kv_consumer), bool(ktc.is_kv_producer)
        self._reqs: dict[str, _ReqState] = {}
        self._client: ServiceClient | None = None
        self.worker: Worker | None = None
        self.pool_ops: PoolOps | None = None  # vLLM's own pool, from the scheduler (pool.py)
        if role == KVConnectorRole.WORKER:
            self.worker = Worker(vllm_config, kv_cache_config, self.settings)
        else:
            watch_parent()

    # ================================================================ scheduler half
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        """vLLM's scheduler hands over its BlockPool: kvdb's plans act on it (pool.py)."""
        s = self.settings
        if self.worker is None and (s.pool_demote or s.pool_pin_blocks):
            self.pool_ops = PoolOps(gpu_block_pool, cap=s.pool_pin_blocks, idle_s=s.session_idle_s)

    def _call(self, msg: dict) -> dict | None:
        svc = local_service(self.settings.path)
        if svc is not None:
            resp = svc.call(msg)
        else:
            if self._client is None:
                self._client = ServiceClient(self.settings.path, self.settings.lookup_timeout_s)
            try:
                resp = self._client.call(_wire(msg))
            except FrameTooLarge as e:  # kv_transfer_params too large to send: rejected, logged
                resp = call_oversized(self._client, _wire(msg), e)
        if resp is not None and "error" in resp:
            log.warning("kvdb: %s", resp["error"])
            return None
        return resp

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.pool_ops is not None:
            self.pool_ops.apply(sweep=False)  # before vLLM allocates for this request (pool.py P1)
        st = self._reqs.get(request.request_id)
        first = st is None
        if first:
            st = self._reqs[request.request_id] = _ReqState(request, _tenant(request))
        if st.tenant is None:
            return 0, False
        bt = self.block_size
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // bt)  # I1
        params = getattr(request, "kv_transfer_params", None)
        msg = {"op": "lookup", "req": request.request_id, "tenant": st.tenant,  # a producer looks up nothing (I5)
               "hashes": list(request.block_hashes[:usable]) if self.loads else [], "params": params}
        if first and isinstance(params, dict) and "prompt" in params:  # a rendered prompt: its tokens go along once
            ids = getattr(request, "prompt_token_ids", None)
            msg["tokens"] = list(ids) if ids is not None else None
        resp = self._call(msg)
        if resp is None:
            return 0, False
        if resp.get("hints"):
            st.hint_outcomes = resp["hints"]
        if resp.get("prompt"):
            st.prompt = resp["prompt"]
        n = int(resp["hit_blocks"])
        st.prefix_blocks = int(resp.get("prefix_blocks") or 0)
        st.hit_blocks = n
        st.saved = max(st.saved, n)
        st.local_blocks = num_computed_tokens // bt
        ext = n * bt - num_computed_tokens
        return (ext, False) if ext > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        st.load = (st.local_blocks, num_external_tokens // self.block_size)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.pool_ops is not None:
            self.pool_ops.apply()  # after this step's allocations: they hold from the next (pool.py P1)
        meta = KvdbConnectorMetadata()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan(st, new.req_id, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan(st, req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0), meta)
        return meta

    def _plan(self, st: _ReqState, req_id: str, done_tokens: int, meta: KvdbConnectorMetadata) -> None:
        if st.tenant is None:
            return
        hashes = st.request.block_hashes
        if st.load is not None:
            first, n = st.load
            st.load = None
            meta.loads.append(BlockMove(req_id, st.tenant, list(hashes[first:first + n]),
                                        st.block_ids[first:first + n], first))
        full = min(len(hashes), done_tokens // self.block_size, len(st.block_ids))  # I2
        if full > st.saved and self.saves:  # a consumer saves nothing (I5)
            meta.saves.append(BlockMove(req_id, st.tenant, list(hashes[st.saved:full]),
                                        st.block_ids[st.saved:full], st.saved))
            st.saved = full

    def update_connector_output(self, connector_output) -> None:
        """Blocks the worker could not load (I3) are recomputed by vLLM: the request's kvdb hit ends
        before the first of them, and they are saved again once recomputed."""
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        for st in self._reqs.values():
            idx = next((i for i, b in enumerate(st.block_ids[: st.hit_blocks]) if b in bad), None)
            if idx is not None:
                st.hit_blocks = idx
                st.saved = min(st.saved, idx)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        msg = {"op": "finished", "req": request.request_id}
        if st is not None and st.prompt is not None and st.prompt.get("status") == "accepted":
            n = len(getattr(request, "prompt_token_ids", None) or ()) // self.block_size
            msg["hashes"] = list(request.block_hashes[:n])  # the prompt's full blocks, noted under these
        pool_req = st is not None and self.pool_ops is not None and _session(request) is not None
        if pool_req:
            msg.update(pool=True, pool_stats=self.pool_ops.stats(),
                       hashes=list(request.block_hashes[:max(len(block_ids), len(msg.get("hashes", ())))]))
        resp = self._call(msg) or {}
        if pool_req:
            self._plan_pool(request, st, block_ids, resp)
        outcomes = (st.hint_outcomes if st is not None else []) + list(resp.get("hints") or [])
        if st is None:
            return False, None
        supplied = max(0, st.hit_blocks - st.local_blocks)  # blocks vLLM's own cache had are not kvdb's
        answer = {"hit_tokens": supplied * self.block_size, "hints": outcomes}
        if st.prompt is not None:
            answer["prompt"] = {**st.prompt, **(resp.get("prompt") or {})}
        return False, {"kvdb": answer}

    def _plan_pool(self, request: "Request", st: _ReqState, block_ids: list[int], resp: dict) -> None:
        """Queue what kvdb's answer to the request's end says about its blocks in vLLM's pool."""
        hashes = request.block_hashes
        full = min(len(hashes), len(block_ids))
        demote = [i for i in resp.get("demote") or () if isinstance(i, int) and 0 <= i < min(full, st.saved)]
        if demote and self.settings.pool_demote:
            self.pool_ops.demote([(block_ids[i], hashes[i]) for i in sorted(demote)])
        sid = _session(request)
        if st.prefix_blocks:
            self.pool_ops.pin(sid, [(block_ids[i], hashes[i]) for i in range(min(st.prefix_blocks, full))])
        if resp.get("session_ended"):
            self.pool_ops.unpin(sid)

    # ================================================================ worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker().register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvdbConnectorMetadata) and meta.loads:
            self._worker().load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # I4: start_load_kv already placed every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved once the step's forward pass is done (wait_for_save, I2)

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if isinstance(meta, KvdbConnectorMetadata) and meta.saves:
            self._worker().save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self):
        if self.pool_ops is not None:
            self.pool_ops.unpin_all()  # pool.py P5
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._client is not None:
            self._client.close()

    def _worker(self) -> Worker:
        if self.worker is None:
            raise InvalidInput("kvdb: a worker-side call reached the scheduler-side connector")
        return self.worker

    # ================================================================ introspection
    def explain(self, session_id: str) -> dict | None:
        """The Db's live plan of a session (``Db.explain(session_id=)``), from either half."""
        return self._call({"op": "explain", "session_id": session_id})

    def kvdb_stats(self) -> dict | None:
        """The connector's counters and ``Db.stats()``, from either half; ``pool``: the vLLM
        pool ops (pool.py) of the scheduler half, as it last sent them to the worker."""
        out = self._call({"op": "stats"})
        if out is not None and self.pool_ops is not None:
            out["pool"] = self.pool_ops.stats()
        return out


#: how often the engine process checks that the process which started it is still there
PARENT_POLL_S = 1.0
_watching = False


def watch_parent() -> None:
    """In a process vLLM spawned for its engine (``EngineCore``), stop the engine when the process
    that started it is gone. vLLM's engine has no check of its own: after a SIGKILL of the API
    server, the engine and its worker live on and the worker keeps the data directory locked, so
    a restarted server cannot open it. A SIGTERM to ourselves takes vLLM's own shutdown path:
    the engine stops its workers, whose connectors close the Db. In the caller's own process
    (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) there is nothing to watch."""
    global _watching
    parent = multiprocessing.parent_process()
    if parent is None or _watching:
        return
    _watching = True
    ppid = os.getppid()

    def run() -> None:
        while os.getppid() == ppid:
            time.sleep(PARENT_POLL_S)
        log.warning("kvdb: the process that started this vLLM engine (pid %d) is gone; stopping the engine so "
                    "that its worker closes the kvdb data directory", ppid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=run, name="kvdb-parent-watch", daemon=True).start()


def _wire(msg: dict) -> dict:
    if "hashes" in msg:
        msg = dict(msg, hashes=[bytes(h).hex() for h in msg["hashes"]])
    return msg
