"""Shared fixtures: a real transformers Llama with random weights (no download).

4 layers, hidden 256, 4 heads, 2 kv heads (GQA), head dim 64, fp32. ``initializer_range=0.1``
because the default 0.02 gives near-uniform attention, under which a wrong restore barely moves
the logits (docs/integration.md "Correctness checks").
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 1000


def tiny_llama_config(**overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        max_position_embeddings=4096,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """These tests run a tiny model: one intra-op thread costs little on an idle 2-core box
    (~1.2x), while two threads on an oversubscribed one spin against each other (measured:
    the whole package 91 s with two threads vs 20 s with one at load 8). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llama():
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    return model


@pytest.fixture
def prompt():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (1, 150), generator=g)


@pytest.fixture
def served(request, tmp_path):
    """A Db (the test module's ``LAYOUT``) served on the vLLM connector's socket, as a worker does."""
    import kvdb
    from kvdb.integrations.vllm.service import KvdbService

    path = str(tmp_path / "db")
    db = kvdb.open(path, layout=request.module.LAYOUT, model_id="m", host_bytes=1 << 20, disk_bytes=0)
    svc = KvdbService(db, path)
    svc.register()
    yield svc
    svc.unregister()
    db.close()
