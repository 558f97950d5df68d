"""kvdb's plans applied to vLLM's own KV pool, from the scheduler half of the connector.

vLLM 0.32 hands a KV connector its scheduler's ``BlockPool`` (``Scheduler.__init__`` ->
``bind_kv_cache_manager`` -> ``bind_gpu_block_pool``); vLLM's own CPU-offloading connector uses
it to pin blocks while it copies them. kvdb uses it, without any change to vLLM, for two of
its plans (docs/vllm.md, "The planner inside vLLM"):

    demote  an agent that waits on a tool: its cached blocks (those kvdb holds, and that no
            other open agent's chain or protected prefix holds) go to the front of vLLM's free
            queue, so vLLM reuses them before any other cached block. They keep their hash:
            until they are reused they are still a prefix hit; once reused, the agent's next
            call gets them from kvdb (its lookup and load, after kvdb's own prefetch into its
            host tier)
    pin     a shared prefix a session names (``prefix_hash``): its cached blocks get one more
            reference (``BlockPool.touch``), so vLLM cannot evict them, up to ``cap`` blocks
    unpin   when the session ends (``end_session`` in its last call's ``kv_transfer_params``),
            idles past ``idle_s``, or vLLM shuts the connector down: ``BlockPool.free_blocks``
            puts the blocks back at the tail of the free queue, still cached

What this cannot do: a waiting agent's blocks already count as free in vLLM (a finished
request's blocks go back to the free queue at once), so demoting them frees no room; it only
decides which cached blocks survive the next allocations. Nothing here loads blocks into
vLLM's pool: vLLM loads only for a scheduled request, through the connector's lookup.

Invariants (tests/integrations/test_vllm_pool.py)
  P1  Ops are queued from any thread (``queue.SimpleQueue``) and applied only by ``apply()``,
      which the connector calls on the EngineCore's main thread inside its own hooks (the top
      of ``get_num_new_matched_tokens`` and ``build_connector_meta``): the pool has no lock.
  P2  An op names blocks by (block id, the request's block hash); a block is touched only
      while its hash is still that one (vLLM reuses ids). Any other block is skipped, counted.
  P3  Demote moves only free blocks (``ref_cnt == 0``, not the null block) and keeps their
      hash; they go behind the free queue's leading run of blocks with no hash (empty blocks
      are still reused first: they hold nothing) and ahead of every other cached block, the
      request's deepest block first (a chain is useless past its first missing block).
  P4  Pin touches a block once, whatever number of sessions name it (refcounted per session),
      never beyond ``cap`` pinned blocks; pinning does not check ``ref_cnt`` (a running
      request's block stays pinned after it finishes).
  P5  Unpin releases exactly what pin took; ``unpin_all`` (connector shutdown) leaves no block
      pinned, so ``reset_prefix_cache`` works again. While blocks are pinned vLLM's
      ``reset_prefix_cache`` refuses (it needs every block free).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

log = logging.getLogger("kvdb.vllm")

#: blocks of the free queue's head walked to find its first cached block (P3); past it the
#: demoted blocks go there: that many empty blocks are reused first anyway
SCAN_LIMIT = 4096
GROUP = 0  # kvdb supports models with one KV cache group (kvdb/integrations/vllm/worker.py)


@dataclass
class PoolCounters:
    demote_ops: int = 0
    demoted_blocks: int = 0
    demote_in_use: int = 0  # blocks a running request holds (ref_cnt > 0): left where they are
    pin_ops: int = 0
    pinned_blocks: int = 0  # pinned now
    pin_capped: int = 0  # blocks not pinned: the cap was reached
    unpin_ops: int = 0
    unpinned_blocks: int = 0
    stale_blocks: int = 0  # blocks whose hash changed (reused) before the op ran (P2)
    queued_ops: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


_with_group = None  # vLLM's make_block_hash_with_group_id, imported at its first use


def _hash_key(block_hash: bytes) -> bytes:
    global _with_group
    if _with_group is None:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id as _with_group
    return _with_group(block_hash, GROUP)


class PoolOps:
    """Queued operations on one vLLM ``BlockPool`` (P1-P5)."""

    def __init__(self, pool: Any, *, cap: int = 0, idle_s: float | None = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        # never more than half the pool: vLLM must still be able to run a request
        self.cap = max(0, min(int(cap), (pool.num_gpu_blocks - 1) // 2))
        self.idle_s = idle_s
        self.clock = clock
        self.counters = PoolCounters()
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._pins: dict[str, set[int]] = {}  # session -> block ids it pinned
        self._refs: dict[int, int] = {}  # block id -> sessions pinning it
        self._seen: dict[str, float] = {}  # session -> last pin op (idle unpin)

    # ---------------------------------------------------------------- queueing (any thread)
    def demote(self, blocks: Iterable[tuple[int, bytes]]) -> None:
        """``blocks``: (block id, block hash) in chain order."""
        self._put(("demote", list(blocks)))

    def pin(self, session_id: str, blocks: Iterable[tuple[int, bytes]]) -> None:
        if self.cap:
            self._put(("pin", session_id, list(blocks)))

    def unpin(self, session_id: str) -> None:
        self._put(("unpin", session_id))

    def _put(self, op: tuple) -> None:
        self.counters.queued_ops += 1
        self._ops.put(op)

    # ---------------------------------------------------------------- applying (main thread)
    def apply(self, sweep: bool = True) -> int:
        """Every queued op, in order (P1); returns how many ran. ``sweep``: also unpin the
        sessions idle past ``idle_s`` (once a step is enough: at ``build_connector_meta``)."""
        n = 0
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                break
            n += 1
            self.counters.queued_ops -= 1
            try:
                getattr(self, "_" + op[0])(*op[1:])
            except Exception:  # a pool op is an optimisation: it must never fail the step
                log.exception("kvdb: vLLM pool op %s failed", op[0])
        if sweep and self.idle_s is not None and self._seen:
            now = self.clock()
            for sid in [s for s, t in self._seen.items() if now - t > self.idle_s]:
                self._unpin(sid)
        return n

    def _current(self, block_id: int, block_hash: bytes):
        """The pool's block ``block_id`` if it still holds ``block_hash`` (P2), else None."""
        blocks = self.pool.blocks
        if not 0 <= block_id < len(blocks):
            return None
        b = blocks[block_id]
        if b.is_null or b.block_hash is None or b.block_hash != _hash_key(block_hash):
            self.counters.stale_blocks += 1
            return None
        return b

    def _demote(self, blocks: list[tuple[int, bytes]]) -> None:
        c = self.counters
        c.demote_ops += 1
        move = []
        for bid, h in reversed(blocks):  # deepest first (P3)
            b = self._current(bid, h)
            if b is None:
                continue
            if b.ref_cnt != 0 or bid in self._refs:
                c.demote_in_use += 1
                continue
            move.append(b)
        if not move:
            return
        q = self.pool.free_block_queue
        for b in move:
            q.remove(b)
        _insert_before_first_cached(q, move)
        c.demoted_blocks += len(move)

    def _pin(self, session_id: str, blocks: list[tuple[int, bytes]]) -> None:
        c = self.counters
        c.pin_ops += 1
        self._seen[session_id] = self.clock()
        mine = self._pins.setdefault(session_id, set())
        for bid, h in blocks:
            if bid in mine:
                continue
            b = self._current(bid, h)
            if b is None:
                continue
            if bid not in self._refs:
                if c.pinned_blocks >= self.cap:
                    c.pin_capped += 1
                    continue
                self.pool.touch([b])
                c.pinned_blocks += 1
            self._refs[bid] = self._refs.get(bid, 0) + 1
            mine.add(bid)

    def _unpin(self, session_id: str) -> None:
        self._seen.pop(session_id, None)
        mine = self._pins.pop(session_id, None)
        if mine is None:
            return
        c = self.counters
        c.unpin_ops += 1
        free = []
        for bid in sorted(mine):
            n = self._refs[bid] - 1
            if n:
                self._refs[bid] = n
                continue
            del self._refs[bid]
            free.append(self.pool.blocks[bid])
        if free:
            self.pool.free_blocks(free)
            c.pinned_blocks -= len(free)
            c.unpinned_blocks += len(free)

    def unpin_all(self) -> None:
        """Every pin released (P5): the connector's shutdown, on the main thread."""
        self.apply()
        for sid in list(self._pins):
            self._unpin(sid)

    def stats(self) -> dict:
        return self.counters.as_dict()


def _insert_before_first_cached(q, blocks: list) -> None:
    """Link ``blocks`` (not in ``q``) into vLLM's free queue just before its first block with a
    hash, or after ``SCAN_LIMIT`` leading empty blocks (P3). vLLM's own ``prepend_n`` links
    the same way at the head; this is it with another anchor."""
    prev = q.fake_free_list_head
    nxt = prev.next_free_block
    walked = 0
    while nxt is not q.fake_free_list_tail and nxt.block_hash is None and walked < SCAN_LIMIT:
        prev, nxt = nxt, nxt.next_free_block
        walked += 1
    for b in blocks:
        b.prev_free_block = prev
        prev.next_free_block = b
        prev = b
    prev.next_free_block = nxt
    nxt.prev_free_block = prev
    q.num_free_blocks += len(blocks)
