"""The bounds of the vLLM connector's socket (kvdb/integrations/vllm/endpoint.py): other
processes of the same user cannot take the scheduler's path, hold unbounded bytes or threads, or
crash the serving thread; the name cannot be squatted and both ends check each other; open calls
are bounded; kv_transfer_params too large to send are rejected with a hint outcome, not missed.

Other processes are real ones (``CHILD``, plain Python speaking the wire format, so each starts
in well under a second); the test process itself is the engine (the server counts this process
and its parent as the engine's own)."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

import kvdb
from kvdb.errors import EndpointError, FrameTooLarge
from kvdb.integrations.vllm import endpoint
from kvdb.integrations.vllm.endpoint import MAX_FRAME, connect, encode, recv_obj, socket_name
from kvdb.integrations.vllm.service import KvdbService, ServiceClient, call_oversized

LAYOUT = kvdb.BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float32)

CHILD = r"""
import hashlib, hmac, json, os, socket, struct, sys
path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
secret = bytes.fromhex(open(os.path.join(os.path.realpath(path), "vllm.key")).read())
name = b"\0kvdb-vllm-" + hashlib.sha256(b"kvdb vllm socket\0" + secret).hexdigest()[:40].encode()
def send(s, obj):
    d = json.dumps(obj).encode(); s.sendall(struct.pack(">I", len(d)) + d)
def recv(s):
    (k,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL)); return json.loads(s.recv(k, socket.MSG_WAITALL))
held, ok = [], 0
for i in range(n):
    s = socket.socket(socket.AF_UNIX); s.connect(name); held.append(s)
    try:
        mine = os.urandom(16); send(s, {"nonce": mine.hex()}); theirs = bytes.fromhex(recv(s)["nonce"])
        send(s, {"proof": hmac.new(secret, b"client\0" + theirs + mine, hashlib.sha256).hexdigest()})
        assert recv(s) == {"ok": True}
    except Exception:
        continue
    ok += 1
    if mode == "big":  # a 16 MiB frame begun and never finished
        s.sendall(struct.pack(">I", 16 << 20) + b"[")
print(ok, flush=True)
sys.stdin.read()
"""


class Child:
    """Another process of this user holding ``n`` authenticated connections (``mode`` "idle"), or
    ``n`` with a 16 MiB frame begun on each ("big"), until ``close``."""

    def __init__(self, path: str, mode: str, n: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, path, mode, str(n)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def held(self) -> int:
        line = self.proc.stdout.readline()
        assert line, f"child exited with {self.proc.wait()}"
        return int(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


def until(cond, timeout_s: float = 20.0) -> None:
    """Wait for ``cond()`` (what a server thread does next), failing only after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def lookup(client, req: str = "r", **kw) -> dict | None:
    return client.call({"op": "lookup", "req": req, "tenant": "t", "hashes": [], "params": None, **kw})


def counters(svc) -> dict:
    return svc.stats()["endpoint"]["counters"]


def test_other_processes_cannot_take_the_schedulers_path(served):
    # Scenario: on main, 16 idle connections from any process of the user made every lookup a
    # miss. Five other processes ask for 6, 4, 4, 4 and 1 connections: each gets at most 4, all
    # of them together 16; the scheduler (this process) is still answered.
    kids = [Child(served.path, "idle", n) for n in (6, 4, 4, 4)]
    try:
        assert [k.held() for k in kids] == [4, 4, 4, 4]
        last = Child(served.path, "idle", 1)
        kids.append(last)
        assert last.held() == 0
        # the server counts a refusal when it gets to the connection: wait for it, not for a time
        until(lambda: served.stats()["endpoint"]["counters"]["refused_connections"] == 3)
        assert served.stats()["endpoint"]["open"]["others"] == 16
        client = ServiceClient(served.path, timeout_s=5.0)
        assert lookup(client)["hit_blocks"] == 0
        assert served.stats()["endpoint"]["open"]["engine"] == 1
        client.close()
    finally:
        for k in kids:
            k.close()
    until(lambda: served.stats()["endpoint"]["open"]["others"] == 0)


def test_bytes_in_flight_are_capped_and_a_stalled_frame_is_dropped(served):
    # Scenario: on main, 16 clients each sending a 16 MiB frame slowly grew the worker by ~480 MiB.
    # Now a frame's length is reserved from a 64 MiB budget before its body is read (other
    # processes get 48 MiB of it), the body is read as it arrives, and a frame must end in time.
    served._server.frame_timeout_s = 3.0
    kid = Child(served.path, "big", 4)
    try:
        assert kid.held() == 4
        until(lambda: counters(served)["busy_frames"] == 1)  # the 4th: no budget left for it
        assert served.stats()["endpoint"]["inflight_bytes"] == 3 * MAX_FRAME
        client = ServiceClient(served.path, timeout_s=5.0)
        assert lookup(client)["hit_blocks"] == 0  # the engine's share is still there
        until(lambda: counters(served)["frame_timeouts"] == 3)
        assert served.stats()["endpoint"]["inflight_bytes"] == 0
        client.close()
    finally:
        kid.close()


def test_deep_nesting_and_non_objects_are_counted_errors(served):
    s = connect(served.path, 5.0)
    try:
        for body, counter in ((b"[" * 100_000 + b"]" * 100_000, "deep_frames"),
                              (b'{"op": "stats", "x": "' + b"[" * 1000 + b'"}', None),  # brackets in a string
                              (b"[1, 2]", "malformed_frames"), (b"{nope", "malformed_frames")):
            s.sendall(struct.pack(">I", len(body)) + body)
            got = recv_obj(s, MAX_FRAME, time.monotonic() + 5)
            assert ("error" in got) == (counter is not None), got
        assert counters(served)["deep_frames"] == 1 and counters(served)["malformed_frames"] == 2
        s.sendall(encode({"op": "lookup", "req": "r", "tenant": "t", "hashes": [], "params": None}))
        assert recv_obj(s, MAX_FRAME, time.monotonic() + 5)["hit_blocks"] == 0  # the connection goes on
    finally:
        s.close()


def handshake_raw(served, proof: str | None):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(served._server.name)
    if proof is None:
        return s
    s.sendall(encode({"nonce": os.urandom(16).hex()}))
    recv_obj(s, 1024, None)
    s.sendall(encode({"proof": proof}))
    return s


def test_a_peer_without_the_secret_gets_nothing(served):
    s = handshake_raw(served, "00" * 32)
    assert "wrong proof" in recv_obj(s, 1024, None)["error"]
    assert s.recv(1) == b""
    s.close()
    served._server.handshake_timeout_s = 0.5
    s = handshake_raw(served, None)  # says nothing
    assert s.recv(1) == b""
    s.close()
    s = handshake_raw(served, None)
    s.sendall(struct.pack(">I", 1 << 20))  # a handshake frame over its 1 KiB cap
    assert s.recv(1) == b""
    s.close()
    until(lambda: counters(served)["oversize_frames"] == 1)
    c = counters(served)
    assert (c["auth_failures"], c["handshake_timeouts"]) == (1, 1)


def fake_server(tmp_path, answer):
    """A same-user process on the name of a key it wrote, answering the hello with ``answer``."""
    path = tmp_path / "fake"
    path.mkdir()
    secret = endpoint.write_key(str(path))
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(socket_name(secret))
    srv.listen(1)

    def run():
        conn, _ = srv.accept()
        with conn:
            recv_obj(conn, 1024, None)
            conn.sendall(encode(answer))
            conn.recv(1)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return str(path), srv


def test_the_scheduler_checks_the_server(tmp_path, caplog, monkeypatch):
    path, srv = fake_server(tmp_path, {"nonce": "00" * 16, "proof": "00" * 32})
    client = ServiceClient(path, timeout_s=2.0)
    with caplog.at_level(logging.WARNING, "kvdb.vllm"):
        assert lookup(client) is None
    assert "does not hold the worker's secret" in caplog.text
    srv.close()
    key = endpoint.key_path(path)
    os.chmod(key, 0o644)
    with pytest.raises(EndpointError, match="not private"):
        endpoint.read_key(path)
    os.chmod(key, 0o600)
    monkeypatch.setattr(endpoint, "peer_creds", lambda conn: (1, os.getuid() + 1))
    srv2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv2.bind(socket_name(endpoint.read_key(path)))
    srv2.listen(1)
    with pytest.raises(EndpointError, match="held by uid"):
        connect(path, 2.0)
    srv2.close()


def test_a_name_already_bound_is_one_clear_error(tmp_path, monkeypatch):
    fixed = bytes(32)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(socket_name(fixed))
    real = endpoint.write_key
    monkeypatch.setattr(endpoint, "write_key", lambda path: (real(path), fixed)[1])
    path = str(tmp_path / "db")
    db = kvdb.open(path, layout=LAYOUT, model_id="m", host_bytes=1 << 20, disk_bytes=0)
    try:
        with pytest.raises(EndpointError) as e:
            KvdbService(db, path).register()
        msg = str(e.value)
        assert "\n" not in msg and "Address already in use" in msg and "start vLLM again" in msg
    finally:
        db.close()
        squatter.close()


def test_open_calls_are_bounded(served):
    # Scenario: on main, 20,000 lookups that never finished kept 20,000 calls (+128 MiB).
    served.max_calls = 8
    for i in range(20):
        served.lookup(f"r{i}", "t", [], {"session_id": f"s{i}"})
    assert list(served._calls) == [f"r{i}" for i in range(12, 20)]
    assert served.counters.evicted_calls == 12
    assert served.finished("r3") == {"hints": []}  # evicted: already ended
    assert served.finished("r19")["hints"] == []


def test_kv_transfer_params_too_large_are_rejected_not_missed(served, caplog):
    hashes = [bytes([i]) * 32 for i in range(3)]
    served.db.put_blocks(served.db.engine_keys(hashes, tenant="t"), torch.zeros(3, *LAYOUT.block_shape))
    client = ServiceClient(served.path, timeout_s=5.0)
    msg = {"op": "lookup", "req": "r", "tenant": "t", "hashes": [h.hex() for h in hashes],
           "params": {"session_id": "s", "blob": "x" * MAX_FRAME}}
    with pytest.raises(FrameTooLarge) as e:
        client.call(msg)
    with caplog.at_level(logging.ERROR, "kvdb.vllm"):
        got = call_oversized(client, msg, e.value)
    assert got["hit_blocks"] == 3
    assert got["hints"][0]["hint"] == "kv_transfer_params" and got["hints"][0]["status"] == "rejected"
    assert "under 16 MiB" in caplog.text
    assert json.dumps(got)  # what request_finished hands back
    client.close()
