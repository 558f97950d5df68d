"""``kvdb.open``'s sizes (issue 15): strings as operators write them ("4GiB", kvdb/sizes.py) or
ints; NaN, negatives, fractions of a byte and sizes no machine has are InvalidInput naming the
option; a device tier without CUDA is InvalidInput unless asked for in CPU memory (device="cpu")."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYOUT, PAGE

import kvdb
from kvdb.errors import InvalidInput


def test_sizes_as_strings(tmp_path):
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes="4KiB", disk_bytes="1 MiB") as db:
        tiers = db.stats()["tiers"]
        assert tiers["host"]["capacity_bytes"] == 4096 and tiers["disk"]["disk_bytes"] == 1 << 20
    with kvdb.open(tmp_path, host_bytes=str(2 * PAGE), device_bytes="0", disk_bytes=None) as db:
        assert db.stats()["tiers"]["host"]["capacity_pages"] == 2


@pytest.mark.parametrize("name", ["host_bytes", "device_bytes", "disk_bytes"])
@pytest.mark.parametrize("bad", [float("nan"), -1, "-4GiB", "nan", "1.5B", "4 parsecs", True, 2 ** 70, 1.0e30])
def test_bad_sizes_are_invalid_input(tmp_path, name, bad):
    with pytest.raises(InvalidInput, match=name):
        kvdb.open(tmp_path / "db", layout=LAYOUT, model_id="m", **{name: bad})
    assert not (tmp_path / "db").exists()  # refused before the directory was made


def test_host_bytes_past_this_machines_memory(tmp_path):
    with pytest.raises(InvalidInput, match="host_bytes.*memory"):
        kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes="1000TiB")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_device_tier_without_cuda_needs_device_cpu(tmp_path):
    with pytest.raises(InvalidInput, match="CUDA is not available"):
        kvdb.open(tmp_path / "a", layout=LAYOUT, model_id="m", device_bytes=4 * PAGE)
    with pytest.raises(InvalidInput, match="CUDA is not available"):
        kvdb.open(tmp_path / "a", layout=LAYOUT, model_id="m", device_bytes=4 * PAGE, device="cuda")
    # asked for in CPU memory (tests, the demo): a device tier there
    with kvdb.open(tmp_path / "b", layout=LAYOUT, model_id="m", device_bytes=4 * PAGE, device="cpu") as db:
        assert db.stats()["tiers"]["device"]["capacity_pages"] == 4
