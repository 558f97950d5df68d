"""kvdb under a Hugging Face transformers model (transformers 5.x, decoder-only, full attention).

Usage (the contract later checks call)::

    db = kvdb.open(path, layout=layout_for(model.config, block_tokens=16), model_id="my-model")
    pc = PrefixCache(db, model)                  # InvalidInput if the db's layout does not fit
    cache, n_cached = pc.lookup(input_ids)        # longest stored prefix, as a cache object
    out = model(input_ids[:, n_cached:], past_key_values=cache, use_cache=True)
    pc.save(input_ids, out.past_key_values)       # stores every full block not yet stored

Tensor shapes
    transformers keeps one tensor per layer and direction, ``[batch, kv_heads, tokens, head_dim]``
    with RoPE already applied. A kvdb block is ``[layers, 2, block_tokens, kv_heads, head_dim]``
    (kvdb/format/layout.py). The two are related by a reshape and a permute:

        cache K of layer l, tokens [b*bt, (b+1)*bt)  ==  block b [l, 0]  permuted (t, h, d) -> (h, t, d)

Invariants
    I1  lookup never returns all of the prompt: at least one token is left to prefill (a model
        needs one input token to produce logits), so n_cached <= the last full block boundary
        strictly before the final token.
    I2  lookup returns only blocks the Db handed back intact; a block the Db reports corrupt or
        missing ends the prefix there (fewer cached tokens, never wrong KV).
    I3  RoPE is baked into stored keys, so a block is only valid at the position it was computed
        at. The prefix hash chain guarantees it: block i's key names tokens [0, (i+1)*bt), so it
        can only ever be looked up as block i. Its depth i is stored with it too (``positions``).
    I4  Save and restore move data in batches, never with a Python loop per token or block.
        Save: one ``torch.stack`` of every layer's K and V slice, one permute-copy into a
        preallocated block tensor, one ``put_blocks``. Restore: pin the prefix (zero-copy
        views of kvdb's arena; one view over all of them when the frames are consecutive),
        one permute-copy into a fresh [layers, 2, 1, kv_heads, tokens, head_dim] tensor whose
        per-layer slices become the cache's tensors. The one loop over layers hands each layer
        its slice: transformers keeps a separate tensor object per layer.

Only batch size 1 is supported (one prompt per call), and only models whose every layer is a
plain full-attention ``DynamicLayer``: sliding-window or linear-attention layers keep a cache
that is not a function of a stored prefix alone, so such models are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdb.format.layout import DTYPES_BY_NAME, BlockLayout
from kvdb.errors import CapacityError, InvalidInput, NotFound
from kvdb.prompts import Rendered

try:  # transformers is an optional extra: kvdb[transformers]
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvdb.integrations.transformers needs transformers 5.x: pip install 'kvdb[transformers]'"
    ) from e

__all__ = ["PrefixCache", "LookupStats", "layout_for", "blocks_from_cache", "cache_from_blocks"]


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _config_dtype(config) -> torch.dtype | None:
    dt = getattr(config, "dtype", None)
    if dt is None:
        dt = getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = DTYPES_BY_NAME.get(dt.replace("torch.", ""))
    return dt if isinstance(dt, torch.dtype) else None


def layout_for(config, block_tokens: int = 16, dtype: torch.dtype | str | None = None) -> BlockLayout:
    """The BlockLayout of a transformers model config.

    ``dtype`` defaults to the config's dtype, else float32 (what a model built from a config
    without a dtype runs in). Raises InvalidInput for a config that lacks the attention fields.
    """
    cfg = _text_config(config)
    try:
        num_layers = int(cfg.num_hidden_layers)
        num_heads = int(cfg.num_attention_heads)
    except (AttributeError, TypeError):
        raise InvalidInput(
            f"{type(config).__name__} has no num_hidden_layers / num_attention_heads: "
            "layout_for needs a decoder-only attention model config"
        ) from None
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // num_heads
    if dtype is None:
        dtype = _config_dtype(cfg) or torch.float32
    return BlockLayout(
        num_layers=num_layers,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        block_tokens=block_tokens,
        dtype=dtype,
    )


def _check_cache_layers(cache) -> None:
    bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
    if bad:
        raise InvalidInput(
            f"the model's cache has non full-attention layers ({sorted(set(bad))}); "
            "PrefixCache supports only models whose every layer is full attention"
        )


def blocks_from_cache(cache, start_tokens: int, num_blocks: int, block_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """Copy tokens [start, start + num_blocks*bt) of ``cache`` into ``out[:num_blocks]`` (I4).

    ``out``: [>= num_blocks, layers, 2, bt, kv_heads, head_dim], contiguous. One stack of every
    layer's K and V slice, one permute-copy into ``out``. Returns ``out[:num_blocks]``.
    """
    end = start_tokens + num_blocks * block_tokens
    layers = cache.layers
    num_layers = len(layers)
    # views only: slicing the batch-0 token range allocates nothing
    parts = [layer.keys[0, :, start_tokens:end] for layer in layers]
    parts += [layer.values[0, :, start_tokens:end] for layer in layers]
    heads, _, head_dim = parts[0].shape
    stacked = torch.stack(parts)  # [2L, H, n*bt, D]
    dst = out[:num_blocks]
    src = stacked.view(2, num_layers, heads, num_blocks, block_tokens, head_dim).permute(3, 1, 0, 4, 2, 5)
    dst.copy_(src)  # -> [n, L, 2, bt, H, D]
    return dst


def cache_from_blocks(config, blocks: torch.Tensor, device: torch.device | str | None = None):
    """A DynamicCache holding ``blocks`` ([n, L, 2, bt, H, D], any strides) as its first n*bt tokens.

    One permute-copy of all layers into a fresh [L, 2, 1, H, n*bt, D] tensor (fresh: the cache
    owns it and later forward passes extend it), whose per-layer slices become the layers' K and
    V (I4). ``blocks`` may alias kvdb's arena (pinned pages): it is only read.
    """
    cache = DynamicCache(config=config)
    _check_cache_layers(cache)
    n, num_layers, _, bt, heads, head_dim = blocks.shape
    if n == 0:
        return cache
    staged = torch.empty((num_layers, 2, 1, heads, n, bt, head_dim), dtype=blocks.dtype, device=device or blocks.device)
    staged.copy_(blocks.permute(1, 2, 4, 0, 3, 5).unsqueeze(2), non_blocking=True)
    staged = staged.view(num_layers, 2, 1, heads, n * bt, head_dim)
    for layer_idx, layer in enumerate(cache.layers):  # one tensor per layer: the cache's own structure
        _adopt(layer, staged[layer_idx, 0], staged[layer_idx, 1])
    return cache


def _adopt(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make an empty DynamicLayer hold ``keys`` / ``values`` without copying them again.

    ``DynamicLayer.update`` would ``torch.cat`` them onto an empty tensor: a second full copy
    of the prefix (measured: it doubled the restore time of an 8k-token prompt). This does what
    update does minus the cat; the result is checked against update in the tests. Pinned
    transformers range: pyproject.toml.
    """
    layer.lazy_initialization(keys, values)
    layer.keys = keys
    layer.values = values


def _as_batch(pages: list[torch.Tensor]) -> torch.Tensor | None:
    """One [n, *block_shape] view over pinned pages when they sit in consecutive frames of one
    arena (the usual case: a chain is inserted in one batch), else None."""
    first = pages[0]
    step = first.numel()
    base = first.data_ptr()
    size = first.element_size()
    for i, p in enumerate(pages):
        if p.data_ptr() != base + i * step * size or p.device != first.device:
            return None
    return torch.as_strided(first, (len(pages), *first.shape), (step, *first.stride()), first.storage_offset())


@dataclass
class LookupStats:
    """Counters of one PrefixCache (token counts, not blocks)."""

    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    saved_blocks: int = 0
    refused_blocks: int = 0  # matched by the index but not handed back intact (I2)
    staged_lookups: int = 0  # read with get_blocks: the prefix could not be pinned at once
    breaks: int = 0  # saved rendered prompts that broke their session's cache (kvdb/prompts/breaks.py)
    tokens_lost: int = 0  # tokens those breaks could have shared and did not


class PrefixCache:
    """Restores and saves a transformers model's KV through a kvdb Db (see the module doc).

    Not thread-safe (it reuses one staging buffer): use one PrefixCache per engine thread; they
    can share the Db, which is.
    """

    def __init__(self, db, model, *, tenant: str = "default"):
        config = model.config
        want = layout_for(config, block_tokens=db.layout.block_tokens, dtype=_model_dtype(model))
        have = db.layout
        if have != want:
            diffs = [
                f"{name}: db has {getattr(have, name)}, model needs {getattr(want, name)}"
                for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "dtype")
                if getattr(have, name) != getattr(want, name)
            ]
            raise InvalidInput(
                "the Db's block layout does not fit this model (" + "; ".join(diffs) + "); "
                "open the Db with layout=layout_for(model.config, ...) and the model's dtype"
            )
        _check_cache_layers(DynamicCache(config=config))
        self.db = db
        self.model = model
        self.config = config
        self.layout = have
        self.tenant = tenant
        self.stats = LookupStats()
        self._device = _model_device(model)
        self._buf = torch.empty((0, *have.block_shape), dtype=have.dtype)  # grows, never shrinks

    # ---- helpers ------------------------------------------------------------------------
    def _tokens(self, input_ids) -> list[int]:
        if isinstance(input_ids, Rendered):  # a prompt rendered by kvdb.prompts.render
            return list(input_ids.token_ids)
        if not isinstance(input_ids, torch.Tensor):
            raise InvalidInput(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise InvalidInput(f"PrefixCache handles one prompt at a time; got batch size {input_ids.shape[0]}")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise InvalidInput(f"input_ids must be [1, tokens] or [tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise InvalidInput(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        return input_ids.tolist()

    def _buffer(self, num_blocks: int) -> torch.Tensor:
        if self._buf.shape[0] < num_blocks:
            cap = max(num_blocks, 2 * self._buf.shape[0])
            self._buf = torch.empty((cap, *self.layout.block_shape), dtype=self.layout.dtype)
        return self._buf

    def _restore(self, keys: list, n: int):
        """(cache, good): a cache of the longest intact prefix of keys[:n] (I2).

        Fast path: pin keys[:n] (zero-copy views into kvdb's arena; disk blocks are read into
        memory first), permute-copy them straight into the cache's tensors, unpin. A block that
        vanished between match and read, or failed its checksum on the way up from disk, ends
        the pinned run (``Db.pin(prefix=True)``). When the blocks cannot all be pinned at once
        (a tier smaller than the prefix: CapacityError), the longest readable run is read with
        ``Db.get_prefix`` into a staging buffer instead.
        """
        if n == 0:
            return cache_from_blocks(self.config, self._buf[:0], device=self._device), 0
        try:
            pinned = self.db.pin(keys[:n], prefix=True)
        except CapacityError:
            self.stats.staged_lookups += 1
            blocks = self._buffer(n)[:n]
            good = self.db.get_prefix(keys[:n], out=blocks)
            return cache_from_blocks(self.config, blocks[:good], device=self._device), good
        good = len(pinned)
        with pinned:
            if good == 0:
                return cache_from_blocks(self.config, self._buf[:0], device=self._device), 0
            src = _as_batch(pinned.pages)
            if src is None:  # scattered frames: gather them in one op into the staging buffer
                src = torch.stack(pinned.pages, out=self._buffer(good)[:good])
            return cache_from_blocks(self.config, src, device=self._device), good

    def keys(self, input_ids) -> list:
        """The block keys of every full block of ``input_ids`` in this cache's tenant."""
        return self.db.block_keys(self._tokens(input_ids), tenant=self.tenant)

    # ---- the contract ----------------------------------------------------------------------
    def lookup(self, input_ids, *, ctx=None):
        """(cache, n_cached): a DynamicCache with the longest stored prefix and its token count.
        ``input_ids``: a [1, tokens] tensor or a prompt rendered by ``kvdb.prompts.render``.

        n_cached is a multiple of block_tokens and at most the last block boundary strictly
        before the final token (I1). Blocks the Db cannot hand back intact end the prefix (I2).
        ``ctx`` (a kvdb.buffer_pool.replacer.AccessContext) goes to ``Db.match_prefix`` for the
        replacer: session, hints, clock.
        """
        tokens = self._tokens(input_ids)
        bt = self.layout.block_tokens
        usable = (len(tokens) - 1) // bt if tokens else 0
        keys = self.db.block_keys(tokens[: usable * bt], tenant=self.tenant) if usable else []
        n = self.db.match_prefix(keys, ctx=ctx) if keys else 0
        cache, good = self._restore(keys, n)
        if good < n:
            self.stats.refused_blocks += n - good
            n = good
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(tokens)
        self.stats.hit_tokens += n * bt
        return cache, n * bt

    def save(self, input_ids, past_key_values, *, session_id: str | None = None, **put_kwargs) -> int:
        """Store every full block of ``input_ids`` that the Db does not hold yet; returns how many.

        ``past_key_values`` must hold the KV of ``input_ids`` from token 0 (what a forward pass
        over the prompt, with or without a restored prefix, returns). ``input_ids`` may be a
        tensor or a prompt rendered by ``kvdb.prompts.render``; a rendered one is also noted with
        ``Db.note_prompt`` (its segments become findable by ``near_match``; with ``session_id``
        it counts in that session's cache breaks, and ``stats.breaks`` / ``stats.tokens_lost``
        add up what this cache saw). Extra keyword arguments go to ``Db.put_blocks`` (e.g. a tier
        or durability where the Db supports them).
        """
        stored = self._save(input_ids, past_key_values, **put_kwargs)
        if isinstance(input_ids, Rendered):
            got = self.db.note_prompt(input_ids, session_id=session_id, tenant=self.tenant)
            if got is not None:
                self.stats.breaks += int(got.broke)
                self.stats.tokens_lost += got.lost
        elif session_id is not None:
            raise InvalidInput("session_id is for prompts rendered by kvdb.prompts.render (break accounting)")
        return stored

    def _save(self, input_ids, past_key_values, **put_kwargs) -> int:
        tokens = self._tokens(input_ids)
        bt = self.layout.block_tokens
        if past_key_values is None or not hasattr(past_key_values, "layers"):
            raise InvalidInput("save needs the cache object a forward pass with use_cache=True returned")
        if len(past_key_values.layers) != self.layout.num_layers:
            raise InvalidInput(
                f"the cache has {len(past_key_values.layers)} layers, the layout {self.layout.num_layers}"
            )
        cached_tokens = past_key_values.get_seq_length()
        num_full = min(len(tokens), cached_tokens) // bt
        if num_full == 0:
            return 0
        keys = self.db.block_keys(tokens[: num_full * bt], tenant=self.tenant)
        have = self.db.match_prefix(keys, peek=True)  # a check, not a use: no hits, no recency
        todo = num_full - have
        if todo <= 0:
            return 0
        blocks = blocks_from_cache(past_key_values, have * bt, todo, bt, self._buffer(todo))
        positions = list(range(have, num_full))  # block depth in the chain (I3)
        # put_blocks skips keys stored further down the chain (after a hole left by an eviction)
        stored = self.db.put_blocks(keys[have:], blocks, positions=positions, **put_kwargs)
        self.stats.saved_blocks += stored
        return stored


def _model_dtype(model) -> torch.dtype:
    dt = getattr(model, "dtype", None)
    if isinstance(dt, torch.dtype):
        return dt
    return next(model.parameters()).dtype


def _model_device(model) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(model.parameters()).device
