"""What a peer without the secret can make a node do (issue 14, hole 1; docs/replication.md
"Threat model"): every frame it sends is capped, its whole handshake has one deadline, its
connections are bounded, and each way it is turned away is counted.

Everything here talks to nodes over loopback only (127.0.0.1, the inline TCP transport: no
engine, no other interface), and every loop is bounded.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import threading
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvdb
from kvdb.errors import ReplicationError
from kvdb.replication import NodeServer, Peer
from kvdb.replication import protocol
from kvdb.replication.channel import Channel, RemoteError
from kvdb.replication.protocol import PREAUTH_MAX_BYTES, ErrorCode, MsgType

from .conftest import LAYOUT, SECRET, wait_for

ALLOC_SLACK_BYTES = 16 << 10  # interpreter objects beside the capped buffers

OUTCOMES = ("auth_failures", "handshake_timeouts", "oversize_frames", "malformed_frames", "handshakes_abandoned",
            "rejected_connections")
HEADER = struct.Struct("<4sBBHQIQ")


def _open(path):
    return kvdb.open(path, layout=LAYOUT, model_id="test-model", host_bytes=4 * LAYOUT.page_bytes, disk_bytes=0)


def _frame(mtype: int, meta: bytes, blob: bytes = b"", *, seq: int = 0, magic: bytes = protocol.MAGIC,
           version: int = protocol.PROTOCOL_VERSION, flags: int = 0, declared: tuple[int, int] | None = None,
           good_tag: bool = True) -> bytes:
    """A frame as an unauthenticated peer can make one: the handshake key is public, so its tag
    may well be right."""
    m, b = declared if declared is not None else (len(meta), len(blob))
    header = HEADER.pack(magic, version, mtype, flags, seq, m, b)
    tag = protocol.compute_tag(protocol.HANDSHAKE_KEY, header, meta, [blob]) if good_tag else os.urandom(32)
    return header + meta + blob + tag


def _hello(seq: int = 0) -> bytes:
    meta = protocol.encode_meta({"version": protocol.PROTOCOL_VERSION, "node": "x", "nonce": os.urandom(32).hex()})
    return _frame(MsgType.HELLO, meta, seq=seq)


def _closed_by_server(sock: socket.socket, limit_s: float = 60.0) -> bool:
    """Read until the server closes (EOF or reset); False if it is still open after
    ``limit_s`` (a hang guard, far beyond any deadline these nodes use)."""
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):  # small reads: this side's allocations are measured too
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except socket.timeout:
        return False
    return True


def _outcomes(srv) -> dict:
    c = srv.status()["counters"]
    return {k: c[k] for k in OUTCOMES}


def _quiet_outcomes(srv, settle_s: float = 0.2) -> dict:
    """The outcome counters once the node has no handshake in flight and they held still for
    ``settle_s`` (a connection is counted just after the node closes it)."""
    deadline = time.monotonic() + 30
    last = None
    while time.monotonic() < deadline:
        now = _outcomes(srv)
        if now == last and srv.status()["connections_open"]["handshaking"] == 0:
            return now
        last = now
        time.sleep(settle_s)
    return last


# ---------------------------------------------------------------- the frame decoder, fuzzed


@pytest.fixture(scope="module")
def fuzz_node(tmp_path_factory):
    db = _open(tmp_path_factory.mktemp("fuzz") / "db")
    srv = NodeServer(db, "127.0.0.1:0", SECRET, transport="tcp", handshake_timeout_s=30).start()
    with socket.create_connection(("127.0.0.1", int(srv.address.rsplit(":", 1)[1])), timeout=60) as s:
        s.sendall(b"warm-up: imports a first connection makes")
        _closed_by_server(s)
    yield srv
    srv.stop()
    db.close()


_BODY_LEN = st.integers(0, 2**32 - 1)
_valid_types = st.one_of(st.sampled_from([int(MsgType.HELLO), int(MsgType.RESPONSE), int(MsgType.ERROR)]),
                         st.sampled_from([int(t) for t in MsgType]))
_metas = st.one_of(
    st.binary(max_size=64),
    st.dictionaries(st.sampled_from(["version", "node", "proof", "code", "message", "x"]),
                    st.one_of(st.integers(-2**70, 2**70), st.text(max_size=20), st.none(), st.booleans(),
                              st.lists(st.integers(), max_size=4), st.binary(min_size=32, max_size=32).map(bytes.hex)),
                    max_size=4)
    .map(lambda d: json.dumps(d).encode()),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting: RecursionError in json
    st.integers(4300, 5000).map(lambda n: b'{"x": ' + b"9" * n + b"}"),  # over Python's int digit limit
)


@st.composite
def hostile_frames(draw):
    """(bytes to send, whether the header is valid, whether it declares more than the cap):
    after an optional valid HELLO, one frame that is damaged, unexpected, or oversize, sent
    whole; an oversize one is followed by up to 256 KiB of the body it declared."""
    first = _hello() if draw(st.booleans(), label="after a valid HELLO") else b""
    kind = draw(st.sampled_from(["header", "oversize", "body"]), label="kind")
    mtype = draw(st.one_of(_valid_types, st.integers(0, 255)), label="type")
    meta = draw(_metas, label="meta")
    blob = draw(st.binary(max_size=256), label="blob")
    if kind == "header":  # a header field is wrong
        field = draw(st.sampled_from(["magic", "version", "flags", "type"]))
        kw = {"magic": draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != protocol.MAGIC))} \
            if field == "magic" else \
            {"version": draw(st.integers(0, 255).filter(lambda v: v != protocol.PROTOCOL_VERSION))} \
            if field == "version" else {"flags": draw(st.integers(1, 0xFFFF))} if field == "flags" else {}
        if field == "type":
            mtype = draw(st.integers(0, 255).filter(lambda t: t not in MsgType._value2member_map_))
        return first + _frame(mtype, meta, blob, **kw), False, False
    mtype = draw(_valid_types) if mtype not in MsgType._value2member_map_ else mtype
    if kind == "oversize":  # lengths over what is left of the cap, e.g. a 1 GiB body
        m = draw(st.one_of(st.just(len(meta)), _BODY_LEN))
        b = draw(st.one_of(st.just(1 << 30), _BODY_LEN))
        left = PREAUTH_MAX_BYTES - len(first) - protocol.HEADER_BYTES - protocol.TAG_BYTES
        if m + b <= left and m <= protocol.PREAUTH_MAX_META_BYTES:
            b = left - m + 1 + draw(st.integers(0, 1 << 30))
        body = os.urandom(draw(st.integers(0, 256 << 10)))
        return first + HEADER.pack(protocol.MAGIC, 1, mtype, 0, 0, m, b) + body, True, True
    # a whole frame within the cap: a wrong tag, bad JSON, an unexpected type or a wrong proof
    good_tag = draw(st.booleans(), label="right tag")
    seq = 1 if first else 0
    return first + _frame(mtype, meta, blob, seq=seq, good_tag=good_tag), True, \
        len(meta) > protocol.PREAUTH_MAX_META_BYTES


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=hostile_frames())
def test_every_malformed_or_oversize_frame_closes_counts_and_allocates_at_most_the_cap(fuzz_node, case):
    # Property (channel.py I4, node.py): whatever an unauthenticated peer sends -- a damaged
    # header, a frame declaring a 1 GiB body, a wrong tag, JSON that is not an object or nests
    # deeper than the parser goes, an unexpected message, a wrong proof -- the node closes the
    # connection by itself (this side never closes first), counts it under exactly one
    # handshake outcome (oversize_frames exactly when the header declared more than the cap),
    # opens no session, and no receive buffer -- nor all of them together -- exceeds
    # PREAUTH_MAX_BYTES; all that Python allocates meanwhile (this side included) stays within the cap.
    raw, header_ok, oversize = case
    before = _quiet_outcomes(fuzz_node)  # an earlier example's connection is fully counted
    sessions = fuzz_node.status()["counters"]["connections"]
    sizes: list[int] = []
    real = Channel._buffer

    def spy(n: int):
        sizes.append(n)
        return real(n)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Channel, "_buffer", staticmethod(spy), raising=False)
        mp.setattr(logging.getLogger("kvdb.replication"), "disabled", True)  # log records are not the node's
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            with socket.create_connection(("127.0.0.1", int(fuzz_node.address.rsplit(":", 1)[1])), timeout=60) as s:
                try:
                    s.sendall(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the node closed while the declared body was still coming: what it should do
                closed = _closed_by_server(s)  # the node has read and parsed all it will
                peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    after = wait_for(lambda: (a := _outcomes(fuzz_node)) != before and a, "the outcome counted")
    assert closed, "the node left a hostile connection open"
    went_up = {k: after[k] - before[k] for k in OUTCOMES if after[k] != before[k]}
    assert len(went_up) == 1 and list(went_up.values()) == [1], went_up
    assert fuzz_node.status()["counters"]["connections"] == sessions
    if not header_ok:
        assert went_up == {"malformed_frames": 1}
    assert ("oversize_frames" in went_up) == oversize
    assert sizes, "no receive buffer was allocated through Channel._buffer"
    assert max(sizes) <= PREAUTH_MAX_BYTES and sum(sizes) <= PREAUTH_MAX_BYTES
    # the receive buffers are held to the cap exactly (above); everything Python allocates besides
    # (frame objects, socket bookkeeping on both sides) gets a fixed slack, far below any body an
    # attacker declares (up to 1 GiB here); deep JSON is refused before it is parsed
    # (protocol.MAX_META_DEPTH). Measured: 66,219 bytes for a 64 KiB frame
    assert peak <= PREAUTH_MAX_BYTES + ALLOC_SLACK_BYTES, \
        f"{peak} bytes allocated while the node refused one hostile connection"


def test_each_refusal_names_its_cause(fuzz_node):
    # The property's cases one by one, with the counter each goes to.
    cases = {
        "malformed_frames": _frame(MsgType.HELLO, b"{}", magic=b"HTTP"),
        "oversize_frames": HEADER.pack(protocol.MAGIC, 1, MsgType.HELLO, 0, 0, 16, 1 << 30),
        "handshakes_abandoned": _hello()[:10],
        "auth_failures": _hello() + _frame(MsgType.RESPONSE, protocol.encode_meta({"proof": "00" * 32}), seq=1),
    }
    for counter, raw in cases.items():
        before = _outcomes(fuzz_node)
        with socket.create_connection(("127.0.0.1", int(fuzz_node.address.rsplit(":", 1)[1])), timeout=60) as s:
            s.sendall(raw)
            if counter == "handshakes_abandoned":
                s.shutdown(socket.SHUT_WR)  # the peer goes away mid-frame
            assert _closed_by_server(s)
        wait_for(lambda c=counter: _outcomes(fuzz_node)[c] == before[c] + 1, counter)


# ---------------------------------------------------------------- the handshake deadline


def test_a_trickling_peer_is_cut_at_the_handshake_deadline(tmp_path):
    # Scenario: a peer sends a valid HELLO one byte every 0.1 s. Each byte would have reset a
    # timeout per recv (the old 30 s); the handshake's one deadline (0.5 s here) cuts it long
    # before the frame is complete (it would take about 14 s), counted in handshake_timeouts.
    db = _open(tmp_path / "db")
    srv = NodeServer(db, "127.0.0.1:0", SECRET, transport="tcp", handshake_timeout_s=0.5).start()
    try:
        hello = _hello()
        sent, cut = 0, False
        with socket.create_connection(("127.0.0.1", int(srv.address.rsplit(":", 1)[1])), timeout=10) as s:
            for byte in hello:
                try:
                    s.send(bytes([byte]))
                    sent += 1
                    time.sleep(0.1)
                    if select.select([s], [], [], 0)[0] and s.recv(4096) == b"":
                        cut = True
                        break
                except (BrokenPipeError, ConnectionResetError):
                    cut = True
                    break
        assert cut and sent < len(hello), f"the trickle sent all {len(hello)} bytes of its HELLO and stayed open"
        wait_for(lambda: srv.status()["counters"]["handshake_timeouts"] == 1, "the timeout counted")
        assert srv.status()["counters"]["connections"] == 0
        with Peer(srv.address, secret=SECRET, transport="tcp") as p:  # an honest peer still gets in
            p.ping()
    finally:
        srv.stop()
        db.close()


# ---------------------------------------------------------------- connection and thread caps


def _conn_threads() -> int:
    """Connection threads alive in this process (the node names each after its peer)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("kvdb-conn-"))


def test_connections_over_the_caps_are_refused_and_threads_stay_bounded(tmp_path):
    # Scenario: a node allows 2 handshakes at once and 3 connections in all. Two idle
    # unauthenticated connections fill the handshakes: a third is answered ERROR{BUSY} and
    # closed without a thread. Once they go away, three authenticated peers fill the
    # connections: a fourth is refused the same way (ReplicationError naming the cap). The
    # node never runs more than 3 connection threads; after one peer leaves, another gets in.
    wait_for(lambda: _conn_threads() == 0, "connection threads of earlier tests ended")
    db = _open(tmp_path / "db")
    srv = NodeServer(db, "127.0.0.1:0", SECRET, transport="tcp", max_connections=3, max_handshakes=2,
                     handshake_timeout_s=60).start()
    port = int(srv.address.rsplit(":", 1)[1])
    peers: list[Peer] = []
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        wait_for(lambda: srv.status()["connections_open"]["handshaking"] == 2, "two handshakes in progress")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
            with pytest.raises(RemoteError, match="connection cap") as e:
                Channel(third, "node").recv()
            assert e.value.code == ErrorCode.BUSY
        assert srv.status()["counters"]["rejected_connections"] == 1
        assert _conn_threads() == 2
        for s in idle:
            s.close()
        wait_for(lambda: srv.status()["counters"]["handshakes_abandoned"] == 2, "the idle connections gone")

        peers = [Peer(srv.address, secret=SECRET, transport="tcp") for _ in range(3)]
        wait_for(lambda: srv.status()["connections_open"] == {"serving": 3, "handshaking": 0}, "three sessions")
        with pytest.raises(ReplicationError, match="refused the connection.*connection cap"):
            Peer(srv.address, secret=SECRET, transport="tcp")
        assert peers[0].status()["counters"]["rejected_connections"] == 2
        assert _conn_threads() <= 3
        peers.pop().close()
        wait_for(lambda: srv.status()["connections_open"]["serving"] == 2, "one peer gone")
        peers.append(Peer(srv.address, secret=SECRET, transport="tcp"))
        peers[-1].ping()
        st = peers[-1].status()
        assert st["limits"] == {"max_connections": 3, "max_handshakes": 2, "handshake_timeout_s": 60.0,
                                "preauth_max_bytes": PREAUTH_MAX_BYTES}
    finally:
        for p in peers:
            p.close()
        srv.stop()
        db.close()


# ---------------------------------------------------------------- memory under a flood


def _rss(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _flood(port: int, n: int, body_bytes: int) -> None:
    """``n`` connections opened at once, then each declares a HELLO with a 1 GiB body and sends
    up to ``body_bytes`` of it; all closed at the end."""
    header = HEADER.pack(protocol.MAGIC, 1, MsgType.HELLO, 0, 0, 16, 1 << 30)
    chunk = os.urandom(64 << 10)
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        for s in socks:
            try:
                s.sendall(header)
                for _ in range(body_bytes // len(chunk)):
                    s.sendall(chunk)
            except OSError:  # the node closed it: what it should do
                pass
        for s in socks:  # every one answered (closed) before the count is read
            _closed_by_server(s, limit_s=30)
    finally:
        for s in socks:
            s.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc (VmHWM, clear_refs)")
def test_server_rss_grows_by_less_than_the_cap_under_100_hostile_connections(tmp_path, secret_file, nodes):
    # Scenario: a `kvdb replicate serve` process (default limits: 16 handshakes at once, 64 KiB
    # before authentication) gets 100 connections at once; then each declares a HELLO with a
    # 1 GiB body and sends 1 MiB of it. A first flood warms the process up (threads,
    # allocator); then its peak RSS is reset and a second flood runs. The peak RSS grows by
    # less than the node's pre-authentication cap (16 x 64 KiB = 1 MiB), where buffering the
    # bodies would add 100 MiB; every connection is accounted for as an oversize frame or a
    # refused connection (those over the handshake cap).
    node = nodes(tmp_path / "node", secret_file, transport="tcp")
    port, pid = node.port, node.proc.pid
    _flood(port, 100, 1 << 20)
    with Peer(node.address, secret=SECRET, transport="tcp") as p:
        p.status()
    time.sleep(0.5)  # let the first flood's threads end (not a timing assertion: it only warms up)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss(pid, "VmRSS")
    _flood(port, 100, 1 << 20)
    peak = _rss(pid, "VmHWM")
    with Peer(node.address, secret=SECRET, transport="tcp") as p:
        st = wait_for(lambda: (s := p.status()) and s["counters"]["oversize_frames"]
                      + s["counters"]["rejected_connections"] == 200 and s, "all 200 connections accounted for")
    cap = st["limits"]["max_handshakes"] * st["limits"]["preauth_max_bytes"]
    growth = peak - base
    print(f"server RSS {base / 2**20:.1f} MiB, peak under the flood +{growth / 1024:.0f} KiB (cap {cap // 1024} KiB); "
          f"oversize {st['counters']['oversize_frames']}, rejected {st['counters']['rejected_connections']}")
    assert growth <= cap, f"the server's RSS grew by {growth} bytes under 100 hostile connections (cap {cap})"
    assert node.stop() == 0
