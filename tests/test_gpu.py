"""The device tier on a real CUDA device: arena, pinned host tier, async copies (skip without CUDA)."""

from __future__ import annotations

import pytest
import torch

import kvdb

pytestmark = pytest.mark.gpu

LAYOUT = kvdb.BlockLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.bfloat16)
PAGE = LAYOUT.page_bytes


def test_cuda_arena_roundtrip_and_demotion(tmp_path):
    # Scenario: 4 device pages on CUDA over 8 pinned host pages; 6 blocks put from the GPU
    # demote 2 to the host; every block reads back bit-exact into GPU and CPU outputs.
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="gpu", host_bytes=8 * PAGE, device_bytes=4 * PAGE,
                   device="cuda", disk_bytes=0) as db:
        host = db.pool.tiers[1].arena
        assert db.pool.tiers[0].arena.device.type == "cuda" and host.pinned and host.data.is_pinned()
        keys = db.block_keys(torch.arange(6 * 16))
        blocks = torch.randn((6, *LAYOUT.block_shape), device="cuda").to(torch.bfloat16)
        db.put_blocks(keys[:4], blocks[:4])
        db.put_blocks(keys[4:], blocks[4:])
        st = db.stats()["tiers"]
        assert (st["device"]["pages"], st["host"]["pages"], st["device"]["demotions"]) == (4, 2, 2)
        out_gpu = torch.empty_like(blocks)
        db.get_blocks(keys, out=out_gpu)
        assert torch.equal(out_gpu.view(torch.int16), blocks.view(torch.int16))
        out_cpu = torch.empty(blocks.shape, dtype=blocks.dtype)
        db.get_blocks(keys, out=out_cpu)
        assert torch.equal(out_cpu.view(torch.int16), blocks.cpu().view(torch.int16))
        with db.pin(keys) as pages:
            assert pages.tiers.count("device") == 4 and pages[5].device.type in ("cuda", "cpu")
        assert db.prefetch(keys[:2]) == 2


def test_cpu_blocks_into_cuda_tier(tmp_path):
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="gpu", host_bytes=2 * PAGE, device_bytes=2 * PAGE,
                   device="cuda", disk_bytes=0) as db:
        keys = db.block_keys(torch.arange(32))
        blocks = torch.randn((2, *LAYOUT.block_shape)).to(torch.bfloat16)
        db.put_blocks(keys, blocks)
        out = torch.empty_like(blocks)
        db.get_blocks(keys, out=out)
        assert torch.equal(out.view(torch.int16), blocks.view(torch.int16))
