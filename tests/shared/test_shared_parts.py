"""The shared tier's parts without a pool: the object format, the ``shared=`` option, the
deadline calls and breaker, and that a Db without ``shared`` loads nothing of Mooncake."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kvdb
from kvdb.errors import InvalidInput
from kvdb.format import shared_object as fmt
from kvdb.shared.calls import BUSY, LATE, OK, OPEN, Calls
from kvdb.shared.url import parse_shared

KEY = bytes(range(16))


def make_object(page: bytes, key: bytes = KEY) -> np.ndarray:
    row = np.zeros(fmt.HEADER_BYTES + len(page), dtype=np.uint8)
    row[fmt.HEADER_BYTES:] = np.frombuffer(page, np.uint8)
    fmt.write_header(row, key, len(page), False)
    return row


def test_object_worked_example():
    """kvdb/format/shared_object.py's worked example, byte for byte."""
    row = make_object(b"\xde\xad\xbe\xef")
    b = row.tobytes()
    assert b[:4] == b"KVSO" and b[4:8] == b"\x01\x00\x00\x00" and b[8:24] == KEY
    assert b[24:32] == (4).to_bytes(8, "little") and b[48:64] == bytes(16) and b[64:] == b"\xde\xad\xbe\xef"
    assert fmt.check(row[:64], row[64:], KEY, 4, False, len(b)) is None


def test_object_checks_catch_every_damage():
    """S5: torn, short, foreign key, foreign flags, garbage."""
    row = make_object(bytes(range(200)))
    n = len(row)
    ok = lambda r, key=KEY, got=n: fmt.check(r[:64], r[64:], key, 200, False, got)  # noqa: E731
    assert ok(row) is None
    for i in (0, 9, 30, 40, 64, n - 1):
        bad = row.copy()
        bad[i] ^= 0x40
        assert ok(bad) is not None, i
    assert ok(row, got=n - 1) is not None
    assert ok(row, key=bytes(16)) is not None
    assert fmt.check(row[:64], row[64:], KEY, 200, True, n) is not None
    assert ok(np.zeros(n, np.uint8)) is not None


def test_namespace_names_differ_per_model_and_secret():
    a = fmt.namespace_name({"model_id": "a", "key_secret_id": "x"})
    assert a != fmt.namespace_name({"model_id": "b", "key_secret_id": "x"})
    assert a != fmt.namespace_name({"model_id": "a", "key_secret_id": "y"})
    assert fmt.object_names(a, [KEY]) == [f"kvdb1/{a}/{KEY.hex()}"]


@pytest.mark.parametrize("url", ["http://h:1", "mooncake://h", "mooncake://:5", "mooncake://h:1/x",
                                 "mooncake://h:1?protocol=udp", "mooncake://h:1?protocol=rdma",
                                 "mooncake://h:1?bogus=1", "mooncake://h:1?deadline_ms=0",
                                 "mooncake://h:1?workers=0", "mooncake://h:99999", 5])
def test_bad_urls_are_invalid_input(url):
    with pytest.raises(InvalidInput):
        parse_shared(url)


def test_url_options_and_sizes():
    c = parse_shared("mooncake://10.0.0.1:50051?protocol=rdma&device=mlx5_0&deadline_ms=200&workers=2", "512MiB")
    assert (c.master, c.protocol, c.device, c.deadline_s, c.workers, c.lend_bytes) == \
        ("10.0.0.1:50051", "rdma", "mlx5_0", 0.2, 2, 512 << 20)
    with pytest.raises(InvalidInput):
        parse_shared("mooncake://h:1", "lots")


def test_bad_shared_options_change_nothing(tmp_path):
    """Checked before the directory is touched: no directory made."""
    for kw in ({"shared": "nope://x:1"}, {"shared": "mooncake://h:1", "shared_bytes": -1},
               {"shared_bytes": "1GiB"}):
        with pytest.raises(InvalidInput):
            kvdb.open(tmp_path / "d", **kw)
        assert not (tmp_path / "d").exists()


def test_calls_deadline_bounded_workers_and_breaker():
    """S8: a stuck call costs its caller one deadline, keeps its worker, never adds threads; a
    late call opens the breaker; the probe closes it."""
    release = threading.Event()
    up = {"ok": False}
    calls = Calls(2, 0.05, probe=lambda: up["ok"])
    assert calls.run(lambda: 7) == (OK, 7)
    t0 = time.monotonic()
    assert calls.run(release.wait)[0] == LATE
    assert time.monotonic() - t0 < 1.0
    assert calls.state == "open" and calls.run(lambda: 1)[0] == OPEN
    calls.state = "closed"  # force a second stuck call
    assert calls.run(release.wait)[0] == LATE
    calls.state = "closed"
    assert calls.run(lambda: 1)[0] == BUSY  # both workers stuck: no third thread
    assert calls.threads() == 2
    freed = []
    release.set()
    time.sleep(0.1)
    up["ok"] = True
    calls.state, calls._next_probe = "open", 0.0  # noqa: SLF001 - a probe due now
    assert calls.run(lambda: 1)[0] == OPEN  # starts the probe
    deadline = time.monotonic() + 5
    while calls.state != "closed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.state == "closed" and calls.run(lambda: 3) == (OK, 3)
    assert calls.threads() == 2 and not freed
    calls.close()


def test_three_failures_trip_the_breaker():
    calls = Calls(1, 1.0, probe=lambda: False)
    for _ in range(2):
        calls.fail()
    assert calls.state == "closed"
    calls.fail()
    assert calls.state == "open" and calls.counts["trips"] == 1
    calls.close()


def test_a_db_without_shared_loads_no_mooncake(tmp_path):
    code = f"""
import sys, torch, kvdb
lay = kvdb.BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype=torch.float16)
with kvdb.open({str(tmp_path / 'd')!r}, layout=lay, model_id="m", host_bytes=1 << 20) as db:
    db.put_blocks(db.block_keys(list(range(8))), torch.zeros((2, *lay.block_shape), dtype=lay.dtype))
    db.flush(); db.stats()
bad = [m for m in sys.modules if m.startswith(("mooncake", "kvdb.shared"))]
assert not bad, bad
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_wait_published_without_a_shared_tier(tmp_path):
    layout = kvdb.BlockLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype=torch.float16)
    with kvdb.open(tmp_path / "db", layout=layout, model_id="m", host_bytes=1 << 20, disk_bytes=0) as db:
        assert db.wait_published() is True and db.wait_published(timeout_s=0) is True
        for bad in (-1, float("nan"), float("inf"), True, "1", 10**400):
            with pytest.raises(InvalidInput, match="timeout_s"):
                db.wait_published(timeout_s=bad)
