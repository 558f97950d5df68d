"""The planner's cost model: what missing a block costs versus reloading it.

Stated constants (a Llama-3-8B-like model in bf16 on one H100-class GPU; change them with
``CostModel(...)``, every figure the simulator reports names the model it used):

    params                 8.0e9        linear FLOPs per token = 2 * params
    layers                 32           attention FLOPs per token at context c = 4 * layers * hidden * c
    hidden                 4096
    kv_bytes_per_token     131072       2 (K,V) * 32 layers * 8 kv heads * 128 dims * 2 bytes
    gpu_flops_per_s        4.0e14       ~40 % of 989 TFLOP/s dense bf16 (prefill is compute bound)
    host_bytes_per_s       2.5e10       host -> device over PCIe 5 (one direction, achieved)
    disk_bytes_per_s       2.0e9        NVMe read into pinned host memory
    decode_s_per_token     0.02         time per output token under continuous batching

Prefill of block j (0-based depth, T = block_tokens tokens) costs
``2 * params * T + 4 * layers * hidden * T * (j * T + T / 2)`` FLOPs: the linear part is flat,
the attention part grows with depth, so deep blocks are the most expensive to lose. With the
defaults a 512-token block at depth 0 takes ~21 ms to recompute and ~2.7 ms to reload from
host memory; at depth 60 recompute is ~41 ms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CostModel:
    params: float = 8.0e9
    layers: int = 32
    hidden: int = 4096
    kv_bytes_per_token: int = 131072
    gpu_flops_per_s: float = 4.0e14
    host_bytes_per_s: float = 2.5e10
    disk_bytes_per_s: float = 2.0e9
    decode_s_per_token: float = 0.02

    def prefill_flops(self, first_depth: int, end_depth: int, block_tokens: int) -> float:
        """FLOPs to recompute blocks [first_depth, end_depth) of a chain (closed form)."""
        n = end_depth - first_depth
        if n <= 0:
            return 0.0
        t = float(block_tokens)
        linear = 2.0 * self.params * t * n
        depth_sum = (first_depth + end_depth - 1) * n / 2.0  # sum of j over the range
        attn = 4.0 * self.layers * self.hidden * t * (t * depth_sum + n * t / 2.0)
        return linear + attn

    def prefill_s(self, first_depth: int, end_depth: int, block_tokens: int) -> float:
        return self.prefill_flops(first_depth, end_depth, block_tokens) / self.gpu_flops_per_s

    def block_bytes(self, block_tokens: int) -> int:
        return self.kv_bytes_per_token * block_tokens

    def reload_s(self, num_blocks: int, block_tokens: int, tier: str = "host") -> float:
        bw = self.host_bytes_per_s if tier == "host" else self.disk_bytes_per_s
        return num_blocks * self.block_bytes(block_tokens) / bw

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULT_COST = CostModel()
