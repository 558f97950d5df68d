"""The worker half of the vLLM connector: owns the Db, moves blocks in and out of the paged cache.

    w = Worker(vllm_config, kv_cache_config, settings)   # opens the Db, serves the scheduler
    w.register(kv_caches)                                  # vLLM's per-layer paged tensors
    w.load(moves)       # kvdb -> paged cache (before the forward pass)
    w.save(moves)       # paged cache -> kvdb (after it)
    w.take_load_errors()

The Db's layout is read from vLLM's KV cache spec: ``num_layers`` attention layers, vLLM's
``block_size`` as ``block_tokens``, the spec's kv heads, head size and dtype. Models with more
than one KV cache group (sliding-window or hybrid attention) are refused: their cache is not a
function of a stored prefix alone. Tensor parallelism is not supported yet (one worker, one Db).

Data path of one step (kvdb/integrations/vllm/paged.py has the per-layer moves):

    load:  Db.get_prefix(keys, out=staging)  ->  PagedLayout.scatter(staging -> paged)
    save:  PagedLayout.gather(paged -> staging)  ->  Db.put_blocks(keys, staging, positions=)

``staging`` is one preallocated ``[n, layers, 2, block_tokens, kv_heads, head_dim]`` tensor,
grown (doubled) when a step moves more blocks than it holds.
"""

from __future__ import annotations

import atexit
import logging
import re

import torch

import kvdb
from kvdb import BlockLayout
from kvdb.db.open import read_key_secret_file
from kvdb.errors import InvalidInput, KvdbError
from kvdb.integrations.vllm.paged import PagedLayout, probe_cpu_layout, strided_layout
from kvdb.integrations.vllm.service import KvdbService
from kvdb.integrations.vllm.settings import Settings

log = logging.getLogger("kvdb.vllm")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
#: a producer's step waits at most this long for its saves to reach the pool (each pool call
#: has its own deadline, docs/shared.md S8; past it the blocks stay local and the consumer misses)
HANDOVER_WAIT_S = 5.0


def layout_from_spec(vllm_config, kv_cache_config) -> tuple[BlockLayout, list[str]]:
    """kvdb's block layout for vLLM's KV cache config, and the attention layers in model order."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise InvalidInput(f"kvdb supports models with one KV cache group (full attention everywhere); this one "
                           f"has {len(groups)} (sliding-window or hybrid attention)")
    spec = groups[0].kv_cache_spec
    for name in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, name):
            raise InvalidInput(f"kvdb cannot store this model's KV cache ({type(spec).__name__} has no {name})")
    par = vllm_config.parallel_config
    if par.tensor_parallel_size * par.pipeline_parallel_size != 1:
        raise InvalidInput("kvdb's vLLM connector supports one worker (tensor and pipeline parallel size 1) for now")
    layers = sorted(groups[0].layer_names, key=_layer_order)
    layout = BlockLayout(num_layers=len(layers), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                         block_tokens=spec.block_size, dtype=spec.dtype)
    return layout, layers


def _layer_order(name: str):
    m = _LAYER_INDEX.search(name + ".")
    return (int(m.group(1)) if m else -1, name)


def model_id_of(vllm_config) -> str:
    mc = vllm_config.model_config
    rev = getattr(mc, "revision", None)
    return f"{mc.model}@{rev}" if rev else str(mc.model)


class Worker:
    def __init__(self, vllm_config, kv_cache_config, settings: Settings) -> None:
        self.vllm_config = vllm_config
        self.layout, self.layer_names = layout_from_spec(vllm_config, kv_cache_config)
        self.settings = settings
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        # a prefill engine (kv_producer) hands its requests over through the pool: its saves are
        # published before the step ends (docs/vllm.md "Sharing blocks through a pool")
        self.handover = getattr(ktc, "kv_role", None) == "kv_producer"
        key_secret = read_key_secret_file(settings.key_secret_file) if settings.key_secret_file else None
        self.db = kvdb.open(settings.path, layout=self.layout, model_id=settings.model_id or model_id_of(vllm_config),
                            host_bytes=settings.host_bytes, disk_bytes=settings.disk_bytes,
                            durability=settings.durability, replacer=settings.replacer, codec=settings.codec,
                            encryption_key_file=settings.encryption_key_file, session_idle_s=settings.session_idle_s,
                            key_secret=key_secret, shared=settings.shared, shared_bytes=settings.shared_bytes)
        try:
            self.service = KvdbService(self.db, settings.path)
            self.service.worker = self
            self.service.register()
        except BaseException:
            self.db.close()
            raise
        self.caches: list[torch.Tensor] = []
        self.paged: PagedLayout | None = None
        self._staging: torch.Tensor | None = None
        self._closed = False
        self._load_errors: set[int] = set()
        self.last_loads: list[tuple[list[bytes], list[int]]] = []  # (keys, vLLM block ids) placed by the last load
        atexit.register(self.close)  # blocks held only in memory are written back at a plain exit

    # ------------------------------------------------------------------ set-up
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise InvalidInput(f"vLLM registered no KV cache for layer(s) {missing[:3]}")
        self.caches = [kv_caches[n] for n in self.layer_names]
        self.paged = self._probe(self.caches[0])
        log.info("kvdb: %d layers, %s paged layout (%s moves), Db at %s", len(self.caches), self.paged.kind,
                 "strided" if self.paged.affine else "indexed", self.settings.path)

    def _probe(self, t: torch.Tensor) -> PagedLayout:
        lay = self.layout
        if t.dtype != lay.dtype:
            raise InvalidInput(f"vLLM's KV cache is {t.dtype}, its spec says {lay.dtype}")
        kw = dict(block_tokens=lay.block_tokens, num_heads=lay.num_kv_heads, head_dim=lay.head_dim)
        if t.device.type == "cpu" and t.dim() == 4:
            return probe_cpu_layout(t, write=self._cpu_writer(t), **kw)
        return strided_layout(t, **kw)

    def _cpu_writer(self, t: torch.Tensor):
        """vLLM's CPU cache-write kernel with the ISA the attention layers use."""
        from vllm import _custom_ops as ops

        layer = self.vllm_config.compilation_config.static_forward_context.get(self.layer_names[0])
        isa = getattr(layer, "isa", None)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(t.dtype, self.layout.block_tokens, self.layout.head_dim)

        def write(key, value, key_cache, value_cache, slot_mapping):
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

        return write

    def _registered(self) -> None:
        if self.paged is None:
            raise InvalidInput("kvdb: vLLM moved blocks before register_kv_caches gave the connector its KV cache")

    def _keys(self, m) -> tuple[list[bytes], torch.Tensor]:
        """A move's block keys in its tenant's namespace, and a staging tensor that holds them."""
        return self.db.engine_keys(m.hashes, tenant=m.tenant), self._buffer(len(m.hashes))

    def _buffer(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.shape[0] < n:
            size = max(n, 2 * (self._staging.shape[0] if self._staging is not None else 8))
            self._staging = torch.empty((size, *self.layout.block_shape), dtype=self.layout.dtype)
        return self._staging

    # ------------------------------------------------------------------ moves
    def load(self, moves) -> None:
        """Every move's blocks into the paged cache; blocks from the first unreadable one on are
        load errors (connector I3)."""
        self._registered()
        c = self.service.counters
        self.last_loads = []
        for m in moves:
            n = len(m.hashes)
            if n == 0:
                continue
            try:
                keys, buf = self._keys(m)
                good = self.db.get_prefix(keys, out=buf, ctx=self.service.ctx(m.req_id))
            except KvdbError as e:  # a Db that cannot read is a miss for every block, never a crash
                log.warning("kvdb: request %s: load failed (%s); vLLM recomputes its %d blocks", m.req_id, e, n)
                keys, good = [], 0
            if good:
                self.last_loads.append((keys[:good], list(m.block_ids[:good])))
                self.paged.scatter(self.caches, torch.as_tensor(m.block_ids[:good], dtype=torch.int64), buf)
            if good < n:
                self._load_errors.update(m.block_ids[good:])
                c.load_failed_blocks += n - good
                if keys:
                    log.warning("kvdb: request %s: %d of %d blocks could not be read back intact; vLLM recomputes "
                                "them", m.req_id, n - good, n)
                    self._drop(keys[good])
            c.loaded_blocks += good

    def _drop(self, key: bytes) -> None:
        """Forget a block that failed its checksum (or vanished), so that vLLM's recomputation of
        it is saved again instead of being skipped as already stored."""
        try:
            self.db.delete([key])
        except KvdbError as e:
            log.warning("kvdb: could not drop an unreadable block: %s", e)

    def save(self, moves) -> None:
        """Every move's blocks out of the paged cache into the Db (skipping stored keys)."""
        self._registered()
        stored = 0
        for m in moves:
            n = len(m.hashes)
            if n == 0:
                continue
            try:
                keys, buf = self._keys(m)
                self.paged.gather(self.caches, torch.as_tensor(m.block_ids, dtype=torch.int64), buf)
                saved = self.db.put_blocks(keys, buf[:n], positions=range(m.first_block, m.first_block + n),
                                           ctx=self.service.ctx(m.req_id))
                self.service.counters.saved_blocks += saved
                stored += saved
            except KvdbError as e:  # a save that cannot be made is a future miss, never a failed step
                self.service.counters.failed_saves += 1
                log.warning("kvdb: request %s: %d blocks not saved: %s", m.req_id, n, e)
        if stored:  # on disk soon, not at the background writer's next round: vLLM's default
            try:  # shutdown kills this process (docs/vllm.md "What survives a stop")
                self.db.flush(wait=False)
            except KvdbError as e:
                log.warning("kvdb: %d saved blocks not handed to the background writer: %s", stored, e)
        if stored and self.handover:  # a prefill engine's blocks are in the pool before vLLM hands the request on
            try:
                if not self.db.wait_published(HANDOVER_WAIT_S):
                    log.warning("kvdb: %d blocks not yet in the shared pool after %.0f s", stored, HANDOVER_WAIT_S)
            except KvdbError as e:
                log.warning("kvdb: %d blocks may not reach the shared pool: %s", stored, e)

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.service.unregister()
        self.db.close()
