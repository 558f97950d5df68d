"""BlockLayout: the shape, dtype and byte size of one KV block (one page).

A block holds every layer's keys and values for ``block_tokens`` consecutive tokens:

    block_shape = [num_layers, 2, block_tokens, num_kv_heads, head_dim]   (2 = key, value)
    page_bytes  = prod(block_shape) * dtype.itemsize

Example: Llama-3-8B (32 layers, 8 kv heads, head dim 128) in bf16 with 16-token blocks gives
32*2*16*8*128*2 = 2 MiB pages.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch

from kvdb.errors import InvalidInput

#: stable names of the dtypes kvdb stores; they enter the namespace digest, so never rename
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class BlockLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidInput(f"BlockLayout.{name} must be a positive int, got {v!r}")
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES_BY_NAME:
                raise InvalidInput(f"unsupported dtype {self.dtype!r}; one of {sorted(DTYPES_BY_NAME)}")
            object.__setattr__(self, "dtype", DTYPES_BY_NAME[self.dtype])
        if self.dtype not in DTYPE_NAMES:
            raise InvalidInput(f"unsupported dtype {self.dtype}; one of {sorted(DTYPES_BY_NAME)}")

    @functools.cached_property  # asked on every call of the hot paths; the fields are frozen
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize  # no tensor made: page_bytes is asked on every call

    @functools.cached_property
    def page_bytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_tokens": self.block_tokens,
            "dtype": self.dtype_name,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BlockLayout":
        if not isinstance(d, dict):
            raise InvalidInput(f"a layout must be a dict, got {type(d).__name__}")
        try:
            # operator.index: ints (numpy ints too), never a silently truncated float or a str
            return cls(
                num_layers=operator.index(d["num_layers"]),
                num_kv_heads=operator.index(d["num_kv_heads"]),
                head_dim=operator.index(d["head_dim"]),
                block_tokens=operator.index(d["block_tokens"]),
                dtype=d["dtype"],
            )
        except KeyError as e:
            raise InvalidInput(f"layout is missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise InvalidInput(f"layout fields must be ints and a dtype name: {e}") from None
