"""Prometheus exposition of a Db's stats."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, generate_latest

import kvdb
import kvdb.metrics

LAYOUT = kvdb.BlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=2, dtype=torch.float32)


def test_metrics_follow_stats(tmp_path):
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=2 * LAYOUT.page_bytes, disk_bytes=0) as db:
        reg = CollectorRegistry()
        kvdb.metrics.register(db, reg)
        keys = db.block_keys(list(range(6)))
        for k in keys:  # 3 puts into 2 frames: the third evicts the least recent (key 0)
            db.put_blocks([k], torch.zeros((1, *LAYOUT.block_shape)))
        assert db.match_prefix(keys) == 0
        text = generate_latest(reg).decode()
        assert 'kvdb_pages{tier="host"} 2.0' in text
        assert 'kvdb_evictions_total{tier="host"} 1.0' in text
        assert 'kvdb_hits_total{tier="host"} 0.0' in text  # key 0 is gone: the prefix is empty
        assert 'kvdb_misses_total{tier="host"} 1.0' in text
        assert "kvdb_sessions 0.0" in text


# ---------------------------------------------------------------- the HTTP endpoint (MetricsServer)
def _get(server, headers: dict | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def _until(cond, timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def test_the_metrics_endpoint_binds_loopback_and_asks_for_its_token():
    srv = kvdb.metrics.MetricsServer(CollectorRegistry(), port=0, token=b"s3cret-token-0123456789")
    try:
        assert srv.sock.getsockname()[0] == "127.0.0.1" and srv.url.startswith("http://127.0.0.1:")
        assert _get(srv)[0] == 401
        assert _get(srv, {"Authorization": "Bearer nope"})[0] == 401
        code, text = _get(srv, {"Authorization": "Bearer s3cret-token-0123456789"})
        assert code == 200 and 'kvdb_metrics_requests_total{outcome="unauthorized"} 2.0' in text
    finally:
        srv.close()


def test_half_sent_requests_hold_neither_threads_nor_the_endpoint():
    # Scenario: on main, 300 half-sent requests gave the metrics server 300 more threads. Now at
    # most 4 requests are served at once (one more is answered 503), each must arrive in time.
    import socket
    import threading

    before = threading.active_count()
    srv = kvdb.metrics.MetricsServer(CollectorRegistry(), port=0, max_threads=4, read_timeout_s=3.0)
    held = []
    try:
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            held.append(s)
        _until(lambda: srv.status()["counters"]["refused"] == 46)
        assert srv.status()["threads"] == 4 and threading.active_count() <= before + 5
        _until(lambda: srv.status()["counters"]["timeouts"] == 4)  # dropped at their deadline
        _until(lambda: srv.status()["threads"] == 0)
        assert _get(srv)[0] == 200
    finally:
        for s in held:
            s.close()
        srv.close()


def test_replicate_serve_metrics_options(tmp_path):
    import click
    import pytest

    from kvdb.cli.replicate import _start_metrics

    assert _start_metrics(None, None, None) is None
    srv = _start_metrics(0, None, None)  # --metrics-port: loopback, whatever --listen says
    assert srv.host == "127.0.0.1"
    srv.close()
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123\n")
    srv = _start_metrics(None, "127.0.0.1:0", str(token))
    assert srv.token == b"0123456789abcdef0123"
    srv.close()
    token.write_text("short")
    for args, hint in (((0, "127.0.0.1:0", None), "--metrics-listen"), ((None, "nope", None), "--metrics-listen"),
                       ((None, None, str(token)), "--metrics-token-file"), ((0, None, str(token)), "--metrics-token-file")):
        with pytest.raises(click.BadParameter) as e:
            _start_metrics(*args)
        assert e.value.param_hint == hint
