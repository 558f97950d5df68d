"""A small random-weight Llama for the demo and the TTFT benchmark (no download, CPU).

Sizes: 4 layers, hidden 256, 4 heads, 2 kv heads (GQA), head dim 64, fp32 -- the same shape
the integration tests use. ``initializer_range=0.1`` so attention is not near-uniform (a wrong
restore would then barely move the logits; docs/integration.md "Correctness checks").
"""

from __future__ import annotations

import logging
import warnings

import torch

VOCAB = 1000
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2


def tiny_llama(max_tokens: int = 4096, seed: int = 0):
    """A LlamaForCausalLM in eval mode with seeded random weights."""
    import transformers

    quiet_transformers()
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        initializer_range=0.1,
        max_position_embeddings=max(max_tokens, 64),
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(cfg).eval()


def quiet_transformers() -> None:
    """Silence the ``past_key_values`` deprecation notice (kept: it works until 5.40, the pin)."""
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*past_key_values.*", category=FutureWarning)


def prefill(model, input_ids, cache=None):
    """One forward pass keeping only the last position's logits (what TTFT needs)."""
    return model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)


def prompt_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))
