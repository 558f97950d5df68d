"""Moving whole blocks between vLLM's paged KV cache and kvdb's block layout.

kvdb stores a block as ``[layers, 2, block_tokens, kv_heads, head_dim]`` (kvdb/format/layout.py),
the same bytes whichever engine computed it. vLLM keeps one tensor per attention layer whose
layout depends on the attention backend, and on the CPU also on the ISA and dtype:

    CPU_ATTN   [num_blocks, kv_heads, block_tokens, 2 * head_dim]; within a head the first half
               holds K and the second V, each packed the way the ISA kernel wants (on AVX-512
               fp32 K is stored transposed, [head_dim, block_tokens], V is not)
    FLASH_ATTN and kin  [2, num_blocks, block_tokens, kv_heads, head_dim] (or with the first two
               dims swapped), strides telling the physical order

Nothing about the packing is assumed. :func:`probe` finds, for one layer, where element
``(kv, token, head, dim)`` of block ``b`` lives: ``offset = kv_offset[kv] + b * block_stride +
within[kv][token, head, dim]``. On the CPU it asks vLLM's own cache-write kernel
(``cpu_attn_reshape_and_cache``, the one the forward pass uses) to write a block of distinct
codes and reads them back. For strided layouts it reads the tensor's strides.

Moves (I1: whole blocks, batched; no Python loop per token or block, one loop over layers
because vLLM keeps one tensor per layer):

    gather(caches, block_ids, out)   paged -> out [n, layers, 2, bt, heads, dim]
    scatter(caches, block_ids, src)  src [n, layers, 2, bt, heads, dim] -> paged

When ``within[kv]`` is affine in (token, head, dim) (true on every layout seen here), a block is
an ``as_strided`` view and a move is one ``index_select`` / ``index_copy_`` per layer and
direction; otherwise (a tiled packing) it is one gather / scatter through a precomputed int64
index of the block's elements.

I2: a layout is probed, never guessed from shapes alone, for packed (CPU) caches; a probe whose
codes do not come back as a permutation raises (a kernel that drops or duplicates elements must
not be taken for a layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdb.errors import InvalidInput

# dtypes a probe can represent exactly: codes are written as base-64 digits, exact in any of these
PROBE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DIGIT = 64


@dataclass
class KvMap:
    """Where one direction (K or V) of a block lives, relative to the block's first element."""

    kv_offset: int
    within: torch.Tensor  # int64 [bt, heads, dim]
    strides: tuple[int, int, int] | None  # (token, head, dim) when ``within`` is affine, else None


class PagedLayout:
    """The probed map of one layer's paged tensor, shared by every layer of the same shape."""

    def __init__(self, *, block_tokens: int, num_heads: int, head_dim: int, num_blocks: int,
                 block_stride: int, maps: tuple[KvMap, KvMap], kind: str) -> None:
        self.block_tokens, self.num_heads, self.head_dim = block_tokens, num_heads, head_dim
        self.num_blocks, self.block_stride, self.maps, self.kind = num_blocks, block_stride, maps, kind

    @property
    def affine(self) -> bool:
        return all(m.strides is not None for m in self.maps)

    def _views(self, t: torch.Tensor) -> list[torch.Tensor]:
        """[num_blocks, bt, heads, dim] strided views of K and V over the layer tensor's memory."""
        out = []
        for m in self.maps:
            st, sh, sd = m.strides  # type: ignore[misc]
            out.append(torch.as_strided(t, (self.num_blocks, self.block_tokens, self.num_heads, self.head_dim),
                                        (self.block_stride, st, sh, sd), t.storage_offset() + m.kv_offset + int(m.within[0, 0, 0])))
        return out

    def _flat_index(self, kv: int, block_ids: torch.Tensor) -> torch.Tensor:
        m = self.maps[kv]
        base = block_ids.to(torch.int64)[:, None] * self.block_stride + m.kv_offset
        return (base + m.within.reshape(1, -1)).reshape(-1)

    def gather(self, caches: list[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """out[i, l] = block ``block_ids[i]`` of layer l, in kvdb's [2, bt, heads, dim] order."""
        n = block_ids.numel()
        for layer, t in enumerate(caches):
            if self.affine:
                for kv, view in enumerate(self._views(t)):
                    out[:n, layer, kv] = view.index_select(0, block_ids)
            else:
                flat = _flat(t)
                for kv in range(2):
                    out[:n, layer, kv] = flat[self._flat_index(kv, block_ids)].view(
                        n, self.block_tokens, self.num_heads, self.head_dim)

    def scatter(self, caches: list[torch.Tensor], block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Block ``block_ids[i]`` of layer l = src[i, l] (kvdb's order), bit for bit."""
        n = block_ids.numel()
        for layer, t in enumerate(caches):
            if self.affine:
                for kv, view in enumerate(self._views(t)):
                    view.index_copy_(0, block_ids, src[:n, layer, kv])
            else:
                flat = _flat(t)
                for kv in range(2):
                    flat[self._flat_index(kv, block_ids)] = src[:n, layer, kv].reshape(-1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,),
                            t.storage_offset())


def _affine(within: torch.Tensor) -> tuple[int, int, int] | None:
    bt, h, d = within.shape
    o = within - within[0, 0, 0]
    st = int(o[1, 0, 0]) if bt > 1 else 0
    sh = int(o[0, 1, 0]) if h > 1 else 0
    sd = int(o[0, 0, 1]) if d > 1 else 0
    idx = (torch.arange(bt)[:, None, None] * st + torch.arange(h)[None, :, None] * sh
           + torch.arange(d)[None, None, :] * sd)
    return (st, sh, sd) if torch.equal(idx, o) else None


def _kv_map(kv_offset: int, within: torch.Tensor) -> KvMap:
    return KvMap(kv_offset, within, _affine(within))


def strided_layout(t: torch.Tensor, *, block_tokens: int, num_heads: int, head_dim: int) -> PagedLayout:
    """The layout of a ``[2, nb, bt, heads, dim]`` or ``[nb, 2, bt, heads, dim]`` tensor (GPU backends)."""
    shape = tuple(t.shape)
    if len(shape) != 5 or shape[2:] != (block_tokens, num_heads, head_dim) or 2 not in shape[:2]:
        raise InvalidInput(f"kvdb cannot read a paged KV cache of shape {list(shape)} (expected [2, blocks, "
                           f"{block_tokens}, {num_heads}, {head_dim}] or [blocks, 2, ...])")
    kv_dim, blk_dim = (0, 1) if shape[0] == 2 else (1, 0)
    s = t.stride()
    grid = (torch.arange(block_tokens)[:, None, None] * s[2] + torch.arange(num_heads)[None, :, None] * s[3]
            + torch.arange(head_dim)[None, None, :] * s[4])
    maps = (_kv_map(0, grid), _kv_map(s[kv_dim], grid))
    return PagedLayout(block_tokens=block_tokens, num_heads=num_heads, head_dim=head_dim, num_blocks=shape[blk_dim],
                       block_stride=s[blk_dim], maps=maps, kind="strided")


def probe_cpu_layout(t: torch.Tensor, *, block_tokens: int, num_heads: int, head_dim: int, write) -> PagedLayout:
    """The layout of a CPU_ATTN layer tensor ``[nb, heads, bt, 2 * dim]``.

    ``write(key, value, key_cache, value_cache, slot_mapping)`` is vLLM's cache-write kernel with
    the layer's ISA bound. It fills one scratch block with codes 0..E-1 (E = 2 * bt * heads * dim,
    base-64 digit by digit so that every dtype holds them exactly), and the codes read back name
    where each element went.
    """
    nb = t.shape[0]
    if tuple(t.shape[1:]) != (num_heads, block_tokens, 2 * head_dim) or not t.is_contiguous():
        raise InvalidInput(f"kvdb cannot read a CPU paged KV cache of shape {list(t.shape)} (expected [blocks, "
                           f"{num_heads}, {block_tokens}, {2 * head_dim}], contiguous)")
    if t.dtype not in PROBE_DTYPES:
        raise InvalidInput(f"kvdb stores KV caches of dtypes {[str(d) for d in PROBE_DTYPES]}, not {t.dtype} "
                           "(a quantized KV cache has per-block scales kvdb does not keep)")
    n_el = 2 * block_tokens * num_heads * head_dim
    codes = torch.arange(n_el, dtype=torch.int64).view(2, block_tokens, num_heads, head_dim)
    found = torch.zeros(num_heads * block_tokens * 2 * head_dim, dtype=torch.int64)
    scale = 1
    scratch = torch.empty((1, num_heads, block_tokens, 2 * head_dim), dtype=t.dtype)
    while scale < n_el:
        digits = ((codes // scale) % _DIGIT).to(t.dtype)
        scratch.fill_(-1)
        kv = scratch.view(1, num_heads, 2 * block_tokens, head_dim)
        key_cache, value_cache = kv.chunk(2, dim=2)
        write(digits[0].contiguous(), digits[1].contiguous(), key_cache, value_cache,
              torch.arange(block_tokens, dtype=torch.int64))
        got = scratch.reshape(-1).to(torch.int64)
        if bool((got < 0).any()):
            raise InvalidInput("vLLM's CPU cache kernel left part of a block unwritten; kvdb cannot map this layout")
        found += got * scale
        scale *= _DIGIT
    # found[p] = the code stored at position p; invert it: code -> position
    where = torch.full((n_el,), -1, dtype=torch.int64)
    where[found] = torch.arange(n_el)
    if bool((where < 0).any()) or found.numel() != n_el:
        raise InvalidInput("vLLM's CPU cache kernel did not store a block as a permutation of its elements")
    where = where.view(2, block_tokens, num_heads, head_dim)
    maps = (_kv_map(0, where[0].clone()), _kv_map(0, where[1].clone()))
    return PagedLayout(block_tokens=block_tokens, num_heads=num_heads, head_dim=head_dim, num_blocks=nb,
                       block_stride=t.stride(0), maps=maps, kind="cpu")
