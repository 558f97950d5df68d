"""Runs one vLLM scenario in its own process and writes what it saw as JSON (tests/integrations/test_vllm.py).

    python vllm_driver.py SCENARIO MODEL_DIR DB_PATH OUT.json [ARGS...]

A vLLM engine holds threads, a KV cache and (in the default mode) child processes for the rest
of its process's life, so each scenario is a fresh interpreter. Scenarios:

    first    one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, "uni" executor): prompt P twice with
             vLLM's own prefix cache reset between, P2 once, cache_salt and hint requests; compares
             the blocks it loaded into the paged cache with the Db's, bit for bit
    restart  one process on the path ``first`` used: P2 then P, each on a fresh engine cache
    mp       vLLM's default: EngineCore and Worker in their own processes; P twice, reset between
    prompts  one process, a fresh path: an agent's two calls whose tool lists differ only in order,
             rendered by kvdb.prompts canonically (session "canon") and raw (session "raw"), the
             segments in kv_transfer_params["prompt"]
    demote   one process: an agent's call ends with a tool-wait hint; the connector demotes its
             blocks in vLLM's own pool (kvdb/integrations/vllm/pool.py); a second request runs the
             queued op; reads the pool's free queue and the connector's counters
    stored   no engine: how many of P's blocks the Db at the path holds (read-only), and whether
             a writer can open it (nobody holds its lock)
    pool     (extra arguments URL ROLE MODE KEY_FILE NAMES) one engine on a shared Mooncake pool,
             kv_role ROLE, MODE "uni" (one process) or "mp" (vLLM's default): the prompts NAMES
             ("P,P2") once each in order, then the worker's counters and Db stats

No scenario closes the Db: the process ends with vLLM's engine and the Db open, as a user's
script does, and the Db's exit hook writes back what is in memory (tests/test_stops.py).
"""

from __future__ import annotations

import json
import os
import sys

import torch

BT = 128
MAX_TOKENS = 16


def prompt(seed: int, n: int = 2048) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


P, P2, P3 = prompt(7), prompt(8), prompt(9)


def make_llm(model: str, path: str, *, single: bool, role: str = "kv_both", **extra):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KvdbConnector", kv_connector_module_path="kvdb.integrations.vllm",
                           kv_role=role, kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"path": path, "host_bytes": "256MiB", **extra})
    return LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=4096, enable_prefix_caching=True,
               kv_transfer_config=ktc, gpu_memory_utilization=0.5, kv_cache_memory_bytes=256 << 20, seed=0,
               distributed_executor_backend="uni" if single else None)


def run(llm, ids, *, salt=None, params=None) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                        extra_args={"kv_transfer_params": params} if params is not None else None)
    p = TokensPrompt(prompt_token_ids=ids)
    if salt is not None:
        p["cache_salt"] = salt
    out = llm.generate([p], sp, use_tqdm=False)[0]
    llm.reset_prefix_cache()  # the next request sees only kvdb
    return {"cached": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids),
            "kvdb": (out.kv_transfer_params or {}).get("kvdb")}


def vllm_hashes(ids: list[int], salt=None) -> list[str]:
    """vLLM's own block hashes of a prompt (what the connector keys blocks by)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    from vllm import SamplingParams

    init_none_hash(get_hash_fn_by_name("sha256"))
    req = Request("h", ids, SamplingParams(max_tokens=1), None, cache_salt=salt,
                  block_hasher=get_request_block_hasher(BT, get_hash_fn_by_name("sha256")))
    return [bytes(h).hex() for h in req.block_hashes]


def first(model: str, path: str) -> dict:
    from kvdb.integrations.vllm.service import local_service

    llm = make_llm(model, path, single=True)
    res = {"p": [run(llm, P), run(llm, P)]}
    svc = local_service(path)
    w = svc.worker
    exact, compared = True, 0
    for keys, ids in w.last_loads:
        stored = torch.empty((len(keys), *w.layout.block_shape), dtype=w.layout.dtype)
        svc.db.get_blocks(keys, out=stored)
        paged = torch.empty_like(stored)
        w.paged.gather(w.caches, torch.as_tensor(ids), paged)
        exact &= torch.equal(paged, stored)
        compared += len(keys)
    res["bit_exact"], res["compared_blocks"] = exact, compared
    res["p2"] = run(llm, P2)
    res["salt"] = [run(llm, P, salt="tenant-a"), run(llm, P, salt="tenant-b"), run(llm, P, salt="tenant-a")]
    hints = {"session_id": "s1", "agent_id": "planner", "ttl_s": 600, "priority": 3,
             "expected_tool_duration_s": 30.0, "bogus_hint": 1}
    res["hinted"] = run(llm, P2[:1000], params=hints)
    res["malformed"] = run(llm, P2[:1000], params={"session_id": 5, "priority": "high"})
    res["explain"] = svc.db.explain(session_id="s1")
    res["stats"] = svc.stats()["connector"]
    res["hashes_p"] = vllm_hashes(P)
    return res


def restart(model: str, path: str) -> dict:
    llm = make_llm(model, path, single=True)
    return {"p2": run(llm, P2), "p": run(llm, P)}


def stored(model: str, path: str) -> dict:
    import kvdb
    from kvdb.errors import DbLockedError

    with kvdb.open(path, read_only=True) as db:
        n = db.match_prefix(db.engine_keys([bytes.fromhex(h) for h in vllm_hashes(P)]))
    try:
        kvdb.open(path).close()
        free = True
    except DbLockedError:
        free = False
    return {"p_blocks": n, "lock_free": free}


def mp(model: str, path: str) -> dict:
    llm = make_llm(model, path, single=False)
    return {"p": [run(llm, P), run(llm, P)]}


def pool(model: str, path: str, url: str, role: str, mode: str, key_file: str, names: str) -> dict:
    """One engine on a shared Mooncake pool (``url``) with its own data directory: each prompt of
    ``names`` ("P,P2") once, in order; then the worker's counters and Db stats over its socket."""
    from kvdb.integrations.vllm.service import ServiceClient

    llm = make_llm(model, path, single=mode == "uni", role=role, shared=url, key_secret_file=key_file)
    res = {name: run(llm, globals()[name]) for name in names.split(",")}
    res["stats"] = ServiceClient(path, 30.0).call({"op": "stats"})
    return res


def demote(model: str, path: str) -> dict:
    llm = make_llm(model, path, single=True)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def gen(ids, params):
        sp = SamplingParams(max_tokens=4, temperature=0,
                            extra_args={"kv_transfer_params": params} if params else None)
        return llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    bp = sched.kv_cache_manager.block_pool
    gen(P2[:300], {"session_id": "other"})  # older: vLLM's LRU alone would reuse its blocks first
    gen(P, {"session_id": "agent", "agent_id": "a", "expected_tool_duration_s": 30.0})
    waiting = vllm_hashes_bytes(P)
    gen(prompt(9, 200), None)  # the next request's lookup applies the queued demote
    cached = [b for b in bp.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
    mine = {make_key(h) for h in waiting}
    lead = 0
    for b in cached:
        if b.block_hash not in mine:
            break
        lead += 1
    return {"pool": sched.connector.pool_ops.stats(), "leading_cached_of_agent": lead,
            "agent_cached": sum(b.block_hash in mine for b in cached), "cached": len(cached)}


def vllm_hashes_bytes(ids):
    return [bytes.fromhex(x) for x in vllm_hashes(ids)]


def make_key(h: bytes):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return make_block_hash_with_group_id(h, 0)


TOOLS = [{"name": f"tool_{i}", "description": f"looks up record kind {i} in the inventory and returns it. " * 4,
          "parameters": {"type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string"}},
                         "required": ["id"]}} for i in range(4)]


def byte_encode(text: str) -> list[int]:
    return [3 + b for b in text.encode()]  # ids 3..258, inside the tiny Llama's vocabulary


def agent_call(tools, question: str, *, canonical: bool):
    from kvdb.prompts import render

    return render({"system": "You are a careful inventory agent. Use the tools. " * 3, "tools": tools,
                   "messages": [{"role": "user", "content": question}]}, encode=byte_encode, canonical=canonical)


def prompts(model: str, path: str) -> dict:
    from kvdb.integrations.vllm.service import local_service
    from kvdb.prompts import transfer_params

    llm = make_llm(model, path, single=True)
    res = {}
    for mode in ("canon", "raw"):
        calls = []
        for tools, q in ((TOOLS, "How many units of record 7 are left?"), (TOOLS[::-1], "And of record 9?")):
            r = agent_call(tools, q, canonical=mode == "canon")
            out = run(llm, r.token_ids, params={"session_id": mode, "prompt": transfer_params(r)})
            calls.append(dict(out, prompt_tokens=len(r.token_ids), tool_end=r.segments[-3].end))
        res[mode] = calls
    svc = local_service(path)
    res["stats"] = svc.db.stats()["prompts"]
    res["explain"] = {m: svc.db.explain(session_id=m)["prompts"] for m in ("canon", "raw")}
    res["connector"] = svc.stats()["connector"]
    return res


if __name__ == "__main__":
    scenario, model, path, out = sys.argv[1:5]
    if scenario != "mp" and not (scenario == "pool" and sys.argv[7] == "mp"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    scenarios = {"first": first, "restart": restart, "mp": mp, "prompts": prompts, "stored": stored, "pool": pool,
                 "demote": demote}
    result = scenarios[scenario](model, path, *sys.argv[5:])
    with open(out, "w") as f:
        json.dump(result, f, default=str)
