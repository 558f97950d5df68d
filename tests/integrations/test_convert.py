"""Cache <-> block conversion and layout derivation, without a Db (kvdb/integrations/transformers.py)."""

from __future__ import annotations

import pytest
import torch

from kvdb.format.layout import BlockLayout
from kvdb.errors import InvalidInput
from kvdb.integrations.transformers import blocks_from_cache, cache_from_blocks, layout_for

from .conftest import tiny_llama_config

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")


def test_layout_for_llama_gqa():
    assert layout_for(tiny_llama_config()) == BlockLayout(
        num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.float32
    )


def test_layout_for_defaults_and_overrides():
    # no num_key_value_heads -> one kv head per attention head; explicit head_dim wins
    cfg = tiny_llama_config(num_key_value_heads=None, head_dim=32, num_hidden_layers=3)
    lay = layout_for(cfg, block_tokens=8, dtype=torch.bfloat16)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_tokens, lay.dtype) == (
        3, 4, 32, 8, torch.bfloat16,
    )
    cfg16 = tiny_llama_config(dtype="float16")
    assert layout_for(cfg16).dtype == torch.float16


def test_layout_for_refuses_non_attention_config():
    class NotAModel:
        hidden_size = 8

    with pytest.raises(InvalidInput, match="num_hidden_layers"):
        layout_for(NotAModel())


def test_blocks_from_cache_maps_every_element(llama, prompt):
    # Scenario: 150 tokens -> 9 full blocks; take blocks 2..6 and compare against an
    # element-by-element reference of the documented mapping.
    with torch.inference_mode():
        cache = llama(prompt, use_cache=True).past_key_values
    lay = layout_for(llama.config)
    out = torch.full((8, *lay.block_shape), float("nan"))
    got = blocks_from_cache(cache, 2 * 16, 5, 16, out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (5, *lay.block_shape)
    for b in range(5):
        for layer in range(4):
            tok = slice((2 + b) * 16, (3 + b) * 16)
            assert torch.equal(got[b, layer, 0], cache.layers[layer].keys[0, :, tok].transpose(0, 1))
            assert torch.equal(got[b, layer, 1], cache.layers[layer].values[0, :, tok].transpose(0, 1))
    assert torch.isnan(out[5:]).all()  # nothing written past the blocks asked for


def test_round_trip_is_bit_exact_and_suffix_logits_match_recompute(llama, prompt):
    # Scenario: prefill 150 tokens, keep 8 blocks (128 tokens) as blocks, rebuild a cache from
    # them, prefill the last 22 tokens: exactly the logits of the original cache cropped to
    # 128 tokens (the KV is bit-exact), and within 1e-5 of recomputing the 128-token prefix.
    lay = layout_for(llama.config)
    with torch.inference_mode():
        cache = llama(prompt, use_cache=True).past_key_values
        blocks = blocks_from_cache(cache, 0, 8, 16, torch.empty((8, *lay.block_shape)))
        rebuilt = cache_from_blocks(llama.config, blocks)
        assert rebuilt.get_seq_length() == 128
        for layer in range(4):
            assert torch.equal(rebuilt.layers[layer].keys, cache.layers[layer].keys[:, :, :128])
            assert torch.equal(rebuilt.layers[layer].values, cache.layers[layer].values[:, :, :128])
            assert rebuilt.layers[layer].keys.data_ptr() != blocks.data_ptr()  # no aliasing
        restored = llama(prompt[:, 128:], past_key_values=rebuilt, use_cache=True).logits
        cache.crop(128 - 150)  # the very KV the blocks came from
        original = llama(prompt[:, 128:], past_key_values=cache, use_cache=True).logits
        prefix = llama(prompt[:, :128], use_cache=True).past_key_values
        recomputed = llama(prompt[:, 128:], past_key_values=prefix, use_cache=True).logits
    assert torch.equal(restored, original)
    assert (restored - recomputed).abs().max().item() <= 1e-5


def test_swapped_blocks_change_logits(llama, prompt):
    # The oracle is sensitive: restoring blocks in the wrong order moves the logits (I3).
    lay = layout_for(llama.config)
    with torch.inference_mode():
        cache = llama(prompt, use_cache=True).past_key_values
        blocks = blocks_from_cache(cache, 0, 2, 16, torch.empty((2, *lay.block_shape)))
        good = llama(prompt[:, 32:], past_key_values=cache_from_blocks(llama.config, blocks)).logits
        bad = llama(prompt[:, 32:], past_key_values=cache_from_blocks(llama.config, blocks[[1, 0]])).logits
    assert not torch.equal(good, bad)


def test_empty_restore_is_a_fresh_cache(llama, prompt):
    lay = layout_for(llama.config)
    cache = cache_from_blocks(llama.config, torch.empty((0, *lay.block_shape)))
    assert cache.get_seq_length() == 0
    with torch.inference_mode():
        a = llama(prompt, past_key_values=cache, use_cache=True).logits
        b = llama(prompt, use_cache=True).logits
    assert torch.equal(a, b)


def test_sliding_window_model_refused():
    mistral = pytest.importorskip("transformers").MistralConfig(num_hidden_layers=2, sliding_window=32)
    lay = layout_for(mistral)
    with pytest.raises(InvalidInput, match="full attention"):
        cache_from_blocks(mistral, torch.empty((0, *lay.block_shape)))


def test_adopted_cache_equals_update_built_cache(llama, prompt):
    # cache_from_blocks hands each layer its slice instead of DynamicCache.update's cat: the
    # cache must be indistinguishable from one built through update.
    lay = layout_for(llama.config)
    with torch.inference_mode():
        cache = llama(prompt, use_cache=True).past_key_values
        blocks = blocks_from_cache(cache, 0, 5, 16, torch.empty((5, *lay.block_shape)))
        adopted = cache_from_blocks(llama.config, blocks)
        built = transformers_cache(llama.config)
        for layer in range(4):
            built.update(cache.layers[layer].keys[:, :, :80].clone(), cache.layers[layer].values[:, :, :80].clone(), layer)
        for a, b in zip(adopted.layers, built.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert a.is_initialized and a.keys.dtype == b.keys.dtype and a.device == b.device
        assert adopted.get_seq_length() == built.get_seq_length() == 80
        la = llama(prompt[:, 80:], past_key_values=adopted, use_cache=True).logits
        lb = llama(prompt[:, 80:], past_key_values=built, use_cache=True).logits
    assert torch.equal(la, lb)


def transformers_cache(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)
