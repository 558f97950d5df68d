"""Block identity: namespaces and prefix hash chains.

Namespace digest
    A namespace covers everything that makes two KV blocks incompatible: model id and revision,
    dtype and layout, tensor / pipeline rank, and the tenant salt. It is SHA-256 over a
    version tag followed by every field in a fixed order, each encoded as

        field_no u8 | present u8 (0/1) | length u32 LE | value bytes

    (strings UTF-8, ints as i64 LE), truncated to 16 bytes. Presence tags and length prefixes
    keep absent, empty and concatenated values apart; nothing depends on Python's per-process
    hash seed, so every process and every node computes the same keys.

Chain
    key_0 = H(ns || tokens_0), key_i = H(key_{i-1} || tokens_i); tokens are uint32 LE, only
    full blocks get keys, H is SHA-256 truncated to 16 bytes (default; collision resistant,
    prompts are attacker input) or xxh3-128 (opt-in, trusted single-tenant deployments).

Tenants
    salt = HMAC-SHA256(key_secret, "tenant" || 0x00 || name)[:16]; each tenant gets its own chains, so a
    lookup by one tenant can never hit (or time) another tenant's blocks. A prompt may declare
    its first ``public_prefix_tokens`` public (a published system prompt or tool schema): those
    blocks chain in the public namespace (no salt) and are shared by all tenants; the chain
    then rebases into the tenant's namespace: seed = H(ns_tenant || last_public_key).

Engine keys
    Engines that hash blocks themselves (vLLM, SGLang) pass their own hashes;
    ``engine_keys`` maps each into the tenant's namespace. Bytes hashes (vLLM v1) and int
    hashes (older engines) are distinct namespaces, so 1 and b"\\x01" never share a key:
        bytes h  ->  H(ns || "engine" 0x00 || h)
        int h    ->  H(ns || "engine-int" 0x00 || h as signed little-endian, shortest form)
    (the two inputs differ at the byte after "engine"). Anything else is InvalidInput.

Segment keys
    A rendered prompt's segments (kvdb/prompts: the system prompt, one tool, one message) get
    a position-free content key: H(ns || "segment" 0x00 || tokens), tokens uint32 LE, H SHA-256
    truncated to 16 bytes whatever the block algorithm. It names the segment's tokens, not
    where they sit, so two prompts holding the same tool at different offsets share it; the
    tenant's namespace salts it, so tenants never share one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Iterable

import numpy as np
import xxhash

from kvdb import native
from kvdb.format.layout import BlockLayout
from kvdb.errors import InvalidInput
from kvdb.types import KEY_BYTES, BlockKey

NS_VERSION = b"kvdb-namespace-v1"
ALGORITHMS = ("sha256", "xxh3_128")
DEFAULT_TENANT = "default"
_UINT32_MAX = 0xFFFFFFFF


def _field(no: int, value) -> bytes:
    if value is None:
        return struct.pack("<BBI", no, 0, 0)
    if isinstance(value, bool):
        raise InvalidInput(f"namespace field {no} must not be a bool")
    if isinstance(value, int):
        raw = struct.pack("<q", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
    else:
        raise InvalidInput(f"namespace field {no} has unsupported type {type(value).__name__}")
    return struct.pack("<BBI", no, 1, len(raw)) + raw


def namespace_digest(
    *,
    model_id: str,
    layout: BlockLayout,
    algo: str = "sha256",
    model_revision: str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    pp_rank: int | None = None,
    pp_size: int | None = None,
    tenant_salt: bytes | None = None,
) -> bytes:
    """The 16-byte namespace digest (field numbers are stable: never renumber)."""
    if not isinstance(model_id, str) or not model_id:
        raise InvalidInput("model_id must be a non-empty string")
    fields = [
        model_id,
        model_revision,
        layout.dtype_name,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_tokens,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        tenant_salt,
        algo,
    ]
    h = hashlib.sha256(NS_VERSION)
    for no, value in enumerate(fields):
        h.update(_field(no, value))
    return h.digest()[:KEY_BYTES]


def check_tenant(tenant) -> str:
    """``tenant`` if it is a non-empty string that UTF-8 can encode (a lone surrogate such as
    "\\ud800" cannot); InvalidInput otherwise."""
    if not isinstance(tenant, str) or not tenant:
        raise InvalidInput(f"tenant must be a non-empty string, got {tenant!r}")
    try:
        tenant.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInput(f"tenant {tenant!r} is not valid Unicode text (UTF-8 cannot encode {e.object[e.start:e.end]!r} "
                           f"at position {e.start}); pass a string without lone surrogates") from None
    return tenant


#: the largest tensor / pipeline parallel size a namespace takes (far beyond any deployment)
MAX_PARALLEL = 1 << 20


def check_ranks(rank, size, kind: str) -> None:
    """A tensor (``kind`` "tp") or pipeline ("pp") rank and size, where given: 1 <= size <=
    MAX_PARALLEL, 0 <= rank (< size when both are given); InvalidInput otherwise. Their types
    are checked with the other namespace fields (``_field``: ints or None)."""
    def given(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if given(size) and not 1 <= size <= MAX_PARALLEL:
        raise InvalidInput(f"{kind}_size must be in [1, {MAX_PARALLEL}], got {size!r}")
    if given(rank) and not 0 <= rank < (size if given(size) else MAX_PARALLEL):
        bound = f"{kind}_size - 1 = {size - 1}" if given(size) else MAX_PARALLEL - 1
        raise InvalidInput(f"{kind}_rank must be in [0, {bound}], got {rank!r}")


def tenant_salt(key_secret: bytes, tenant: str) -> bytes:
    check_tenant(tenant)
    return hmac.new(key_secret, b"tenant\x00" + tenant.encode("utf-8"), hashlib.sha256).digest()[:KEY_BYTES]


def as_token_array(token_ids) -> np.ndarray:
    """Token ids (list, tuple, numpy, torch; 1-D or [1, n]) as a contiguous uint32 array."""
    if hasattr(token_ids, "detach"):  # torch tensor, on any device
        t = token_ids.detach()
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1:
            raise InvalidInput(f"token_ids must be 1-D (or [1, n]), got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex():
            raise InvalidInput(f"token_ids must be integers, got {t.dtype}")
        arr = t.cpu().numpy()
        if arr.dtype.kind not in "iu":  # torch.bool
            raise InvalidInput(f"token_ids must be integers, got {t.dtype}")
    else:
        arr = np.asarray(token_ids)
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.ndim != 1:
            raise InvalidInput(f"token_ids must be 1-D (or [1, n]), got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidInput(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype != np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _UINT32_MAX:
            bad = lo if lo < 0 else hi
            raise InvalidInput(f"token id {bad} is outside uint32 [0, {_UINT32_MAX}]")
    return np.ascontiguousarray(arr, dtype="<u4")


def _xxh3_chain(seed: bytes, toks: np.ndarray, block_tokens: int) -> bytes:
    n = toks.size // block_tokens
    raw = toks[: n * block_tokens].tobytes()
    step = block_tokens * 4
    out = bytearray()
    prev = seed
    for i in range(n):
        prev = xxhash.xxh3_128_digest(prev + raw[i * step : (i + 1) * step])
        out += prev
    return bytes(out)


def segment_key(namespace: bytes, token_bytes: bytes) -> BlockKey:
    """The segment key of ``token_bytes`` (uint32 LE token ids) in ``namespace`` (see above)."""
    return BlockKey(hashlib.sha256(namespace + b"segment\x00" + token_bytes).digest()[:KEY_BYTES])


def split_keys(buf: bytes) -> list[BlockKey]:
    return [BlockKey(buf[i : i + KEY_BYTES]) for i in range(0, len(buf), KEY_BYTES)]


class KeySpace:
    """Computes block keys for one model deployment; namespaces are cached per tenant."""

    def __init__(
        self,
        *,
        model_id: str,
        layout: BlockLayout,
        key_secret: bytes,
        algo: str = "sha256",
        model_revision: str | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        pp_rank: int | None = None,
        pp_size: int | None = None,
    ) -> None:
        if algo not in ALGORITHMS:
            raise InvalidInput(f"unknown key algorithm {algo!r}; one of {ALGORITHMS}")
        if not isinstance(key_secret, (bytes, bytearray)) or len(key_secret) < 16:
            raise InvalidInput("key_secret must be at least 16 bytes")
        check_ranks(tp_rank, tp_size, "tp")
        check_ranks(pp_rank, pp_size, "pp")
        self.layout = layout
        self.algo = algo
        self._secret = bytes(key_secret)
        self._ns_args = dict(
            model_id=model_id,
            layout=layout,
            algo=algo,
            model_revision=model_revision,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
        )
        self.public_namespace = namespace_digest(**self._ns_args, tenant_salt=None)
        self._tenant_ns: dict[str, bytes] = {}

    def namespace(self, tenant: str = DEFAULT_TENANT) -> bytes:
        ns = self._tenant_ns.get(tenant) if isinstance(tenant, str) else None
        if ns is None:  # tenant_salt rejects a non-str or empty tenant
            ns = namespace_digest(**self._ns_args, tenant_salt=tenant_salt(self._secret, tenant))
            self._tenant_ns[tenant] = ns
        return ns

    def _chain(self, seed: bytes, toks: np.ndarray) -> bytes:
        if self.algo == "sha256":
            return native.sha256_chain(seed, toks, self.layout.block_tokens)
        return _xxh3_chain(seed, toks, self.layout.block_tokens)

    def _rebase(self, ns: bytes, last_key: bytes) -> bytes:
        return hashlib.sha256(ns + last_key).digest()[:KEY_BYTES]

    def block_keys_bytes(
        self, token_ids, tenant: str = DEFAULT_TENANT, public_prefix_tokens: int = 0
    ) -> bytes:
        """All full blocks' keys, concatenated (16 bytes each): the allocation-free form."""
        toks = as_token_array(token_ids)
        bt = self.layout.block_tokens
        if not isinstance(public_prefix_tokens, int) or isinstance(public_prefix_tokens, bool) or public_prefix_tokens < 0:
            raise InvalidInput(f"public_prefix_tokens must be an int >= 0, got {public_prefix_tokens!r}")
        ns = self.namespace(tenant)
        n_public = min(public_prefix_tokens // bt, toks.size // bt)
        if n_public == 0:
            return self._chain(ns, toks)
        public = self._chain(self.public_namespace, toks[: n_public * bt])
        rest = self._chain(self._rebase(ns, public[-KEY_BYTES:]), toks[n_public * bt :])
        return public + rest

    def block_keys(
        self, token_ids, tenant: str = DEFAULT_TENANT, public_prefix_tokens: int = 0
    ) -> list[BlockKey]:
        return split_keys(self.block_keys_bytes(token_ids, tenant, public_prefix_tokens))

    def segment_key(self, token_ids, tenant: str = DEFAULT_TENANT) -> BlockKey:
        """The position-free content key of one prompt segment's tokens (kvdb/prompts)."""
        return segment_key(self.namespace(tenant), as_token_array(token_ids).tobytes())

    def engine_keys(self, hashes: Iterable[int | bytes], tenant: str = DEFAULT_TENANT) -> list[BlockKey]:
        """Map an engine's own block hashes (ints or bytes) into the tenant's namespace; an int
        and a bytes hash never map to the same key (see "Engine keys" above)."""
        if isinstance(hashes, (bytes, bytearray, str)) or not isinstance(hashes, Iterable):
            raise InvalidInput(f"hashes must be a sequence of engine block hashes (ints or bytes), "
                               f"got one {type(hashes).__name__}")
        ns = self.namespace(tenant)
        out = []
        for h in hashes:
            if isinstance(h, (bytes, bytearray)):
                tag, raw = b"engine\x00", bytes(h)
            elif isinstance(h, (int, np.integer)) and not isinstance(h, bool):
                v = int(h)
                tag, raw = b"engine-int\x00", v.to_bytes(max(1, (v.bit_length() + 8) // 8), "little", signed=True)
            else:
                raise InvalidInput(f"engine hash must be int or bytes, got {type(h).__name__}")
            out.append(BlockKey(hashlib.sha256(ns + tag + raw).digest()[:KEY_BYTES]))
        return out


def normalize_keys(keys) -> list[BlockKey]:
    """Keys as a list of 16-byte ``bytes``; accepts a list/tuple of bytes or an [n, 16] uint8 array."""
    if type(keys) is not list:  # a list (the common case) skips the abc checks (~1 us)
        if isinstance(keys, np.ndarray):
            if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_BYTES:
                raise InvalidInput(f"a key array must be uint8 [n, {KEY_BYTES}], got {keys.dtype} {keys.shape}")
            return split_keys(keys.tobytes())
        if isinstance(keys, (bytes, bytearray, memoryview, str)):
            raise InvalidInput(f"keys must be a sequence of {KEY_BYTES}-byte keys, not one {type(keys).__name__} object")
        if not isinstance(keys, Iterable):
            raise InvalidInput(f"keys must be a sequence of {KEY_BYTES}-byte keys, got {type(keys).__name__}")
        keys = list(keys)
    for k in keys:
        if type(k) is not bytes or len(k) != KEY_BYTES:
            break
    else:
        return keys
    # slow path: convert bytearray / memoryview keys, checking every one (not just the first)
    fixed = []
    for k in keys:
        if not isinstance(k, (bytes, bytearray, memoryview)) or memoryview(k).nbytes != KEY_BYTES:
            raise InvalidInput(f"each key must be {KEY_BYTES} bytes, got {k!r:.60}")
        fixed.append(BlockKey(bytes(k)))
    return fixed
