"""A tiny random-weight Llama checkpoint written to a local directory (no downloads).

vLLM loads models from a directory: ``config.json``, safetensors weights and a tokenizer. The
tests and ``kvdb bench vllm`` build one here from a seed, so every run sees the same weights:

    path = build_tiny_llama(tmp_dir)          # idempotent: an existing checkpoint is reused
    LLM(model=str(path), dtype="float32", ...)

The tokenizer is a word-level ``tokenizers`` model over the words ``w0 .. w{vocab-4}`` (plus
``<unk> <s> </s>``), built locally; prompts in the tests are token ids, so its only job is to
let vLLM start and detokenize.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
SPECIALS = ["<unk>", "<s>", "</s>"]


def build_tiny_llama(path, *, seed: int = 1234, initializer_range: float = 0.1, **overrides) -> Path:
    """Write the checkpoint to ``path`` (created) unless one with the same settings is there."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    kw = dict(DEFAULT, **overrides)
    stamp = json.dumps({"seed": seed, "initializer_range": initializer_range, **kw}, sort_keys=True)
    marker = path / "kvdb-tiny-llama.json"
    if marker.exists() and marker.read_text() == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(initializer_range=initializer_range, bos_token_id=1, eos_token_id=2,
                                      torch_dtype="float32", **kw)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    words = SPECIALS + [f"w{i}" for i in range(kw["vocab_size"] - len(SPECIALS))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(path)
    marker.write_text(stamp)
    return path
