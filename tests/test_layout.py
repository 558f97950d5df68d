"""kvdb.format.layout.BlockLayout: block shape, page bytes, dtype names, validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvdb.format.layout import DTYPE_NAMES, DTYPES_BY_NAME, BlockLayout
from kvdb.errors import InvalidInput


def test_llama3_8b_bf16_page_is_2_mib():
    lay = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16)
    assert lay.block_shape == (32, 2, 16, 8, 128)
    assert lay.itemsize == 2
    assert lay.page_bytes == 2 * 1024 * 1024
    assert lay.dtype_name == "bfloat16"


@pytest.mark.parametrize(
    "dtype, itemsize",
    [
        (torch.float32, 4),
        (torch.float16, 2),
        (torch.bfloat16, 2),
        (torch.float8_e4m3fn, 1),
        (torch.float8_e5m2, 1),
        (torch.int8, 1),
        (torch.uint8, 1),
    ],
)
def test_page_bytes_match_a_real_tensor(dtype, itemsize):
    lay = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=5, block_tokens=7, dtype=dtype)
    block = torch.zeros(lay.block_shape, dtype=dtype)
    assert lay.itemsize == itemsize
    assert lay.page_bytes == block.numel() * block.element_size() == 3 * 2 * 7 * 2 * 5 * itemsize
    # the name round-trips and is stable (names enter the key namespace)
    assert DTYPES_BY_NAME[lay.dtype_name] is dtype


def test_dtype_names_are_stable():
    # these strings are part of every key's namespace digest: renaming one orphans stored data
    assert sorted(DTYPE_NAMES.values()) == [
        "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"
    ]


def test_dtype_by_name_equals_dtype_object():
    a = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype="float16")
    b = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype=torch.float16)
    assert a.dtype is torch.float16
    assert a == b and hash(a) == hash(b)
    assert BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4).dtype is torch.bfloat16


def test_to_dict_from_dict_round_trip_through_json():
    lay = BlockLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=32, dtype=torch.float8_e4m3fn)
    d = json.loads(json.dumps(lay.to_dict()))
    assert d == {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_tokens": 32, "dtype": "float8_e4m3fn"}
    assert BlockLayout.from_dict(d) == lay
    # numpy ints (e.g. from a config array) are ints too
    d2 = dict(d, num_layers=np.int64(4))
    assert BlockLayout.from_dict(d2) == lay


def test_layout_is_frozen():
    lay = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4)
    with pytest.raises(AttributeError):
        lay.num_layers = 2  # type: ignore[misc]


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_tokens"])
@pytest.mark.parametrize("bad", [0, -1, 1.0, "4", True, None])
def test_bad_dimensions_raise_invalid_input(field, bad):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
    args[field] = bad
    with pytest.raises(InvalidInput, match=f"BlockLayout.{field} must be a positive int"):
        BlockLayout(**args)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool, "float64", "bf16", 5])
def test_unsupported_dtype_raises_invalid_input(dtype):
    with pytest.raises(InvalidInput, match="unsupported dtype"):
        BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype=dtype)


@pytest.mark.parametrize(
    "d, msg",
    [
        ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16"}, "missing field 'block_tokens'"),
        ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4}, "missing field 'dtype'"),
        ({"num_layers": "x", "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4, "dtype": "float16"}, "must be ints"),
        ({"num_layers": 2.7, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4, "dtype": "float16"}, "must be ints"),
        ({"num_layers": 0, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4, "dtype": "float16"}, "positive int"),
        ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4, "dtype": "float64"}, "unsupported dtype"),
        (None, "must be a dict"),
        ([1, 1, 8, 4, "float16"], "must be a dict"),
    ],
)
def test_from_dict_rejects_bad_layouts(d, msg):
    with pytest.raises(InvalidInput, match=msg):
        BlockLayout.from_dict(d)
