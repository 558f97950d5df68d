"""A byte-level BPE tokenizer trained here, on generated text (``tokenizers``; no downloads).

``kvdb bench cache-break`` needs a real tokenizer for two things: realistic token counts (JSON
punctuation, words split into sub-words) and a baseline time (what encoding the same text costs
in a production tokenizer's Rust core). ``train_bpe(texts)`` trains one like GPT-2's: a
byte-level pre-tokenizer and decoder, ``vocab_size`` merges, and the default template's markers
(kvdb/prompts/render.py) as special tokens, so they encode as one token each, as a chat
template's do. Training is deterministic for the same texts.
"""

from __future__ import annotations

from typing import Iterable

SPECIAL_TOKENS = ["<|system|>", "<|tool|>", "<|user|>", "<|assistant|>", "<|end|>"]


def train_bpe(texts: Iterable[str], *, vocab_size: int = 8192):
    """A ``tokenizers.Tokenizer``; ``tok.encode(s, add_special_tokens=False).ids`` encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encoder(tok):
    """``str -> list[int]`` for ``kvdb.prompts.render``."""
    enc = tok.encode

    def encode(text: str) -> list[int]:
        return enc(text, add_special_tokens=False).ids

    return encode
