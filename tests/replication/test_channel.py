"""Control channel: frame checks, handshake, per-message authentication (no listener needed:
the two ends talk over a socketpair, so nothing here touches the network)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdb.errors import AuthError, ReplicationError
from kvdb.replication import protocol
from kvdb.replication.channel import Channel, accept, client_handshake, load_secret, parse_addr
from kvdb.replication.protocol import MsgType

from .conftest import SECRET


def _pair(client_secret=SECRET, server_secret=SECRET):
    """Run both handshake halves; returns (client_channel_or_exc, server_channel_or_exc)."""
    a, b = socket.socketpair()
    out = {}

    def server():
        try:
            out["s"] = accept(b, "client", server_secret, {"node": "srv", "transport": {"kind": "tcp"}})
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["s"] = e

    t = threading.Thread(target=server)
    t.start()
    try:
        c = client_handshake(a, "srv", client_secret, node="cli")
    except Exception as e:  # noqa: BLE001
        c = e
    t.join(10)
    return c, out["s"]


def test_handshake_then_messages_in_both_directions():
    # Scenario: a good handshake; WELCOME names the server; frames flow both ways with blobs.
    c, s = _pair()
    assert isinstance(c, Channel) and isinstance(s, Channel)
    assert c.peer_node == "srv" and s.peer_node == "cli"
    c.send(MsgType.PING, {"x": 1}, [b"abc", memoryview(b"defg")])
    m = s.recv()
    assert (m.type, m.meta, bytes(m.blob), m.seq) == (MsgType.PING, {"x": 1}, b"abcdefg", 2)
    s.send(MsgType.PONG, {})
    assert c.recv().type == MsgType.PONG


def test_wrong_secret_is_auth_error_on_both_sides():
    # Scenario: client and server hold different secrets (I2): both raise AuthError, no session.
    c, s = _pair(client_secret=b"x" * 32)
    assert isinstance(c, AuthError) and "different shared secrets" in str(c)
    assert isinstance(s, AuthError)


def test_missing_secret_is_auth_error(tmp_path):
    with pytest.raises(AuthError, match="no replication secret"):
        load_secret(None)
    with pytest.raises(AuthError, match="cannot read"):
        load_secret(tmp_path / "absent")
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    with pytest.raises(AuthError, match="has 3 bytes"):
        load_secret(short)
    good = tmp_path / "good"
    good.write_bytes(b"  " + SECRET + b"\n")
    assert load_secret(good) == SECRET


def test_corrupted_message_is_replication_error():
    # Scenario: one bit of a frame flips after it was tagged (I3): the receiver refuses it and
    # closes the channel; the next frame is not read.
    c, s = _pair()
    c.debug_corrupt_next_send()
    c.send(MsgType.PING, {"n": 1})
    with pytest.raises(ReplicationError, match="corrupted message.*HMAC"):
        s.recv()
    assert s.closed


def test_replayed_frame_is_refused():
    # Scenario: a captured frame is sent again: the tag is right but the sequence number is old.
    a, b = socket.socketpair()
    sender, receiver = Channel(a, "a"), Channel(b, "b")
    sender.send(MsgType.PING, {})
    frame_seq0 = protocol.encode_header(MsgType.PING, 0, 2, 0) + b"{}"
    tag = protocol.compute_tag(protocol.HANDSHAKE_KEY, protocol.encode_header(MsgType.PING, 0, 2, 0), b"{}", [])
    assert receiver.recv().seq == 0
    a.sendall(frame_seq0 + tag)
    with pytest.raises(ReplicationError, match="sequence number 0, expected 1"):
        receiver.recv()


def test_frame_from_another_session_key_is_refused():
    # Scenario: a frame tagged with the handshake key arrives after the session keys are in use.
    c, s = _pair()
    c._send_key = protocol.HANDSHAKE_KEY
    c.send(MsgType.PING, {})
    with pytest.raises(ReplicationError, match="HMAC"):
        s.recv()


@pytest.mark.parametrize(
    "header, message",
    [
        (struct.pack("<4sBBHQIQ", b"HTTP", 1, 40, 0, 0, 2, 0), "bad magic"),
        (struct.pack("<4sBBHQIQ", b"KVRP", 9, 40, 0, 0, 2, 0), "version 9"),
        (struct.pack("<4sBBHQIQ", b"KVRP", 1, 99, 0, 0, 2, 0), "unknown message type 99"),
        (struct.pack("<4sBBHQIQ", b"KVRP", 1, 40, 4, 0, 2, 0), "reserved flags"),
        (struct.pack("<4sBBHQIQ", b"KVRP", 1, 40, 0, 0, 2, 1 << 40), "exceed the limits"),
    ],
)
def test_bad_headers_are_refused_before_reading_the_body(header, message):
    a, b = socket.socketpair()
    receiver = Channel(b, "peer")
    a.sendall(header)
    with pytest.raises(ReplicationError, match=message):
        receiver.recv()
    assert receiver.closed


def test_peer_closing_mid_frame_is_a_clear_error():
    a, b = socket.socketpair()
    receiver = Channel(b, "peer")
    a.sendall(protocol.encode_header(MsgType.PING, 0, 100, 0) + b"{")
    a.close()
    with pytest.raises(ReplicationError, match="connection to peer lost"):
        receiver.recv()


def test_golden_ping_header():
    # The worked example of protocol.py, byte for byte.
    assert protocol.encode_header(MsgType.PING, 0, 2, 0).hex() == (
        "4b565250" "01" "28" "0000" "0000000000000000" "02000000" "0000000000000000"
    )
    assert protocol.HEADER_BYTES == 28


def test_parse_addr():
    assert parse_addr("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert parse_addr("[::1]:80") == ("::1", 80)
    for bad in ("nohost", ":80", "h:", "h:99999", "h:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_addr(bad)


def _frame_bytes(meta: dict, blob: bytes) -> bytes:
    a, b = socket.socketpair()
    Channel(a, "w").send(MsgType.PING, meta, [blob])
    a.close()
    out = b""
    while chunk := b.recv(1 << 16):
        out += chunk
    b.close()
    return out


def _receive(raw: bytes):
    a, b = socket.socketpair()
    a.sendall(raw)
    a.close()  # a length that grew runs into EOF, not into a hang
    return Channel(b, "r").recv()


_metas = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=16),
                                                         st.booleans(), st.none()), max_size=4)


@given(meta=_metas, blob=st.binary(max_size=300))
def test_frames_round_trip(meta, blob):
    m = _receive(_frame_bytes(meta, blob))
    assert (m.type, m.meta, bytes(m.blob), m.seq) == (MsgType.PING, meta, blob, 0)


@given(meta=_metas, blob=st.binary(max_size=300), data=st.data())
def test_any_damaged_byte_is_refused_never_misread(meta, blob, data):
    # I1/I3: whichever byte of a frame changes (header, meta, blob or tag), the receiver raises
    # ReplicationError; it never hands back a message.
    raw = bytearray(_frame_bytes(meta, blob))
    i = data.draw(st.integers(0, len(raw) - 1), label="byte")
    raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(ReplicationError):
        _receive(bytes(raw))
