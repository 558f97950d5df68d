"""The replication wire format: one frame layout for every control-plane message.

Every message between two kvdb nodes is one frame on a TCP connection (all integers
little-endian)::

    offset  bytes  field
    0       4      magic      b"KVRP"
    4       1      version    PROTOCOL_VERSION (1); a peer speaking another version is refused
    5       1      type       MsgType (stable values below; never renumber)
    6       2      flags      0 (reserved; a frame with other bits set is rejected)
    8       8      seq        per-direction sequence number: 0, 1, 2, ... from the first frame
    16      4      meta_bytes length of the JSON metadata
    20      8      blob_bytes length of the binary blob
    28      m      meta       UTF-8 JSON object (sorted keys), e.g. {"keys": 3, "durability": "sync"}
    28+m    b      blob       raw bytes: block keys (16 bytes each), inline block data, log records
    28+m+b  32     tag        HMAC-SHA256(key, header || meta || blob)

The tag key is the direction's session key after the handshake (channel.py). Handshake frames
(HELLO, CHALLENGE, RESPONSE, and an ERROR sent before the session exists) use the fixed public
key ``HANDSHAKE_KEY``: their tag only detects damage; their authentication is the HMAC proofs
they carry. The sequence number inside the tagged header makes a replayed, dropped or reordered
frame fail the check on the receiving side.

Worked example: a PING (type 40) with meta ``{}`` and no blob as the first frame after the
handshake is the 28-byte header ``4b565250 01 28 0000 0000000000000000 02000000
0000000000000000``, then ``7b7d`` (``{}``), then the 32-byte tag.

Limits (a corrupt or hostile length must not make a node allocate gigabytes): meta at most
4 MiB, blob at most ``MAX_BLOB_BYTES`` (1 GiB) from an authenticated peer. Before the peer is
authenticated everything read from it -- every frame of the handshake, headers and tags included
-- fits in ``PREAUTH_MAX_BYTES`` (64 KiB; a handshake takes about 400 bytes), and the JSON of
each of those frames in ``PREAUTH_MAX_META_BYTES`` (4 KiB: parsing JSON builds objects several
times its size, so this bounds that too). A frame whose
header declares more than the receiver accepts is refused from its 28 bytes (``OversizeFrame``),
before anything of its body is read or allocated, and the connection is closed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field

from kvdb.errors import ReplicationError

MAGIC = b"KVRP"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBHQIQ")
HEADER_BYTES = HEADER.size  # 28
TAG_BYTES = 32
MAX_META_BYTES = 4 << 20
MAX_BLOB_BYTES = 1 << 30
PREAUTH_MAX_BYTES = 64 << 10  # everything read from a peer before it proved the secret
PREAUTH_MAX_META_BYTES = 4 << 10  # one handshake frame's JSON (bounds what parsing it may build)
HANDSHAKE_KEY = b"kvdb-replication-handshake-v1"


class MsgType(enum.IntEnum):
    """Frame types. On-wire values are stable: never renumber; retired values stay as comments."""

    HELLO = 1  # client -> server: {"version", "node", "nonce"} (nonce hex, 32 bytes)
    CHALLENGE = 2  # server -> client: {"nonce", "proof"}: the server proves it holds the secret
    RESPONSE = 3  # client -> server: {"proof"}
    WELCOME = 4  # server -> client: {"node", "transport"}: first frame under the session keys
    ERROR = 5  # either way: {"code", "message"}; the sender closes the connection after it

    OPEN_REGION = 10  # client -> server: {"bytes"}: ask for a landing region for bulk data
    REGION = 11  # server -> client: {"transport": descriptor, "addr", "bytes"}
    PUT_BLOCKS = 12  # client -> server: {"chunk", "blocks", "page_bytes", "durability", "inline",
    #                  "offset", "digests"}; blob: keys [+ data when inline]
    PUT_ACK = 13  # server -> client: {"blocks", "seq"}: durable on the server
    RESERVE_FRAMES = 14  # client -> server: {"chunks": [blocks per chunk]}: land a push in arena frames
    FRAMES = 15  # server -> client: {"transport", "base", "page_bytes", "frames": [[frame, ...] per
    #              chunk]} or {"frames": null, "reason"}: use the landing region instead

    LOOKUP = 20  # client -> server: {"keys", "fetch", "region"?}; blob: keys: longest stored prefix (+ blocks)
    LOOKUP_REPLY = 21  # server -> client: {"hits", "page_bytes", "via"?, "digests"?}; blob: blocks when inline

    SHIP_HELLO = 30  # leader -> follower: {"leader", "durable_lsn", "page_bytes", "region_bytes",
    #                  "log_id", "seal_check"}
    SHIP_POSITION = 31  # follower -> leader: {"applied_lsn", "log_id", "region", "reseed"}
    SHIP_RECORDS = 32  # leader -> follower: {"first_lsn", "last_lsn", "bytes", "inline", "offset"}
    #                    or, inside a re-seed, {"reseed": true, "count", "bytes", "inline", "offset"}
    SHIP_ACK = 33  # follower -> leader: {"applied_lsn"}: durable on the follower; inside a
    #                re-seed {"reseed_records"}: that many snapshot records received
    RESEED_BEGIN = 34  # leader -> follower: {"snapshot_lsn", "log_id", "records"}: a full copy follows
    RESEED_END = 35  # leader -> follower: {"snapshot_lsn", "records"}; answered by SHIP_ACK
    #                  {"applied_lsn": snapshot_lsn} once the copy replaced the follower's state

    PING = 40  # either way: {}
    PONG = 41
    STATUS = 42  # client -> server: {}
    STATUS_REPLY = 43  # server -> client: {"node", "role", "applied_lsn", "followers": [...]}


class ErrorCode(enum.IntEnum):
    """Codes carried by ERROR frames (stable values)."""

    AUTH = 1  # the peer failed authentication
    VERSION = 2  # unsupported protocol version
    PROTOCOL = 3  # unexpected or malformed message
    CORRUPT = 4  # a frame or a block failed its check
    INTERNAL = 5  # the server failed while serving the request (the message says why)
    INVALID = 6  # the request was well formed but not acceptable (wrong layout, too large)
    BUSY = 7  # sent before the handshake: the node is at its connection cap; try again later
    NAMESPACE = 8  # a follower refused a leader of another namespace, key secret included (namespace.py)


class FrameError(ReplicationError):
    """A frame failed a check: magic, version, flags, type, lengths, JSON, tag or sequence
    number, or it is not the message the protocol expects at this point."""


class OversizeFrame(FrameError):
    """A frame's header declared more bytes than the receiver accepts (its limits, or the
    pre-authentication cap); refused before its body is read."""


@dataclass
class Message:
    type: MsgType
    meta: dict = field(default_factory=dict)
    blob: memoryview = field(default_factory=lambda: memoryview(b""))
    seq: int = 0


def encode_meta(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode("utf-8")


def encode_header(mtype: int, seq: int, meta_bytes: int, blob_bytes: int) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(mtype), 0, seq, meta_bytes, blob_bytes)


def compute_tag(key: bytes, header: bytes, meta: bytes, blobs) -> bytes:
    """HMAC-SHA256 over header, meta and every blob part, in order, without joining them."""
    mac = hmac.new(key, header, hashlib.sha256)
    mac.update(meta)
    for b in blobs:
        mac.update(b)
    return mac.digest()


def decode_header(raw: bytes, max_body: int | None = None) -> tuple[int, int, int, int]:
    """Check a 28-byte header and return (type, seq, meta_bytes, blob_bytes). ``max_body``:
    the most meta + blob bytes the receiver takes now, before the peer is authenticated (what
    is left of ``PREAUTH_MAX_BYTES``; the meta then at most ``PREAUTH_MAX_META_BYTES``); None:
    the protocol's limits only. Nothing here allocates more than the header."""
    magic, version, mtype, flags, seq, meta_bytes, blob_bytes = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"corrupted message: bad magic {magic!r} (expected {MAGIC!r}); is the peer a kvdb node?")
    if version != PROTOCOL_VERSION:
        raise FrameError(
            f"peer speaks replication protocol version {version}, this node speaks "
            f"{PROTOCOL_VERSION}; run the same kvdb version on both nodes"
        )
    if flags != 0:
        raise FrameError(f"corrupted message: reserved flags 0x{flags:04x} are set")
    if mtype not in MsgType._value2member_map_:
        raise FrameError(f"corrupted message: unknown message type {mtype}")
    if meta_bytes > MAX_META_BYTES or blob_bytes > MAX_BLOB_BYTES:
        raise OversizeFrame(
            f"corrupted message: lengths meta={meta_bytes} blob={blob_bytes} exceed the limits "
            f"({MAX_META_BYTES}, {MAX_BLOB_BYTES})"
        )
    if max_body is not None and (meta_bytes + blob_bytes > max_body or meta_bytes > PREAUTH_MAX_META_BYTES):
        raise OversizeFrame(
            f"oversize message before authentication: lengths meta={meta_bytes} blob={blob_bytes} exceed the "
            f"limits of an unauthenticated peer ({PREAUTH_MAX_BYTES} bytes in all, {max(max_body, 0)} left; meta "
            f"at most {PREAUTH_MAX_META_BYTES})"
        )
    return mtype, seq, meta_bytes, blob_bytes


MAX_META_DEPTH = 32  # metadata nests a few levels; deeper JSON is refused before it is parsed


def _nesting(data: bytes) -> int:
    """The deepest ``[`` / ``{`` nesting of JSON text (brackets inside strings skipped)."""
    depth = deepest = 0
    in_str = esc = False
    for b in data:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:  # quote
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


def decode_meta(raw) -> dict:
    data = bytes(raw)
    # parsing builds an object per level: refuse deep nesting before json allocates it (a 4 KiB
    # pre-authentication frame of brackets made the parser build ~130 KB). The count is a C-speed
    # gate, so ordinary metadata is never scanned in Python.
    if data.count(b"[") + data.count(b"{") > MAX_META_DEPTH and _nesting(data) > MAX_META_DEPTH:
        raise FrameError(f"corrupted message: metadata nests deeper than {MAX_META_DEPTH} levels")
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: bad JSON, an int over 4300 digits
        raise FrameError(f"corrupted message: metadata is not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise FrameError("corrupted message: metadata is not a JSON object")
    return meta
