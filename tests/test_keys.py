"""kvdb.keys: block identity (the rules: kvdb/keys.py's header).

The namespace encoding and the chain are re-derived here from the module docstring with
struct and hashlib only, so a change to the key format fails a test instead of silently
orphaning every stored block.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import assume, given
from hypothesis import strategies as st

from kvdb import BlockLayout
from kvdb.errors import InvalidInput
from kvdb.keys import (
    NS_VERSION,
    KeySpace,
    as_token_array,
    namespace_digest,
    normalize_keys,
    tenant_salt,
)

SECRET = b"s" * 32
LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.float16)
BT = LAYOUT.block_tokens


def make_space(**kw) -> KeySpace:
    args = dict(model_id="m", layout=LAYOUT, key_secret=SECRET)
    args.update(kw)
    return KeySpace(**args)


# ---------------------------------------------------------------- an independent spelling


def _ref_field(no: int, value) -> bytes:
    if value is None:
        return bytes([no, 0]) + (0).to_bytes(4, "little")
    raw = value.to_bytes(8, "little", signed=True) if isinstance(value, int) else (
        value.encode() if isinstance(value, str) else value
    )
    return bytes([no, 1]) + len(raw).to_bytes(4, "little") + raw


def _ref_namespace(model_id, layout, algo="sha256", revision=None, salt=None, tp=(None, None), pp=(None, None)):
    fields = [model_id, revision, layout.dtype_name, layout.num_layers, layout.num_kv_heads,
              layout.head_dim, layout.block_tokens, tp[0], tp[1], pp[0], pp[1], salt, algo]
    return hashlib.sha256(b"kvdb-namespace-v1" + b"".join(_ref_field(i, v) for i, v in enumerate(fields))).digest()[:16]


def _ref_salt(tenant: str) -> bytes:
    return hmac.new(SECRET, b"tenant\x00" + tenant.encode(), hashlib.sha256).digest()[:16]


def _ref_chain(seed: bytes, tokens, bt: int, algo: str = "sha256") -> list[bytes]:
    out, prev = [], seed
    for i in range(len(tokens) // bt):
        data = prev + struct.pack(f"<{bt}I", *tokens[i * bt : (i + 1) * bt])
        prev = hashlib.sha256(data).digest()[:16] if algo == "sha256" else xxhash.xxh3_128_digest(data)
        out.append(prev)
    return out


def test_namespace_and_chain_match_the_documented_format():
    assert NS_VERSION == b"kvdb-namespace-v1"
    assert tenant_salt(SECRET, "acme") == _ref_salt("acme")
    public = _ref_namespace("m", LAYOUT)
    acme = _ref_namespace("m", LAYOUT, salt=_ref_salt("acme"))
    ks = make_space()
    assert ks.public_namespace == public
    assert ks.namespace("acme") == acme
    toks = list(range(100, 114))  # 3 full blocks + 2 tokens
    assert ks.block_keys(toks, tenant="acme") == _ref_chain(acme, toks, BT)
    # public prefix of 2 blocks, then the chain rebases into the tenant namespace
    pub = _ref_chain(public, toks[:8], BT)
    rest = _ref_chain(hashlib.sha256(acme + pub[-1]).digest()[:16], toks[8:], BT)
    assert ks.block_keys(toks, tenant="acme", public_prefix_tokens=8) == pub + rest
    # xxh3: the same chain over xxh3-128 digests, namespace says which algorithm
    kx = make_space(algo="xxh3_128")
    acme_x = _ref_namespace("m", LAYOUT, algo="xxh3_128", salt=_ref_salt("acme"))
    assert kx.block_keys(toks, tenant="acme") == _ref_chain(acme_x, toks, BT, "xxh3_128")
    # engine keys
    assert ks.engine_keys([b"\x01\x02", 7], tenant="acme") == [
        hashlib.sha256(acme + b"engine\x00" + b"\x01\x02").digest()[:16],
        hashlib.sha256(acme + b"engine-int\x00" + b"\x07").digest()[:16],
    ]


def test_namespace_digest_covers_parallel_ranks():
    got = namespace_digest(model_id="m", layout=LAYOUT, tp_rank=1, tp_size=4, pp_rank=0, pp_size=2)
    assert got == _ref_namespace("m", LAYOUT, tp=(1, 4), pp=(0, 2))
    assert got != namespace_digest(model_id="m", layout=LAYOUT, tp_rank=0, tp_size=4, pp_rank=0, pp_size=2)
    assert got != namespace_digest(model_id="m", layout=LAYOUT, tp_rank=1, tp_size=4, pp_rank=1, pp_size=2)


# ---------------------------------------------------------------- determinism


_SUBPROCESS_SCRIPT = r"""
import json, torch
from kvdb import BlockLayout
from kvdb.keys import KeySpace
layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.float16)
out = {}
for algo in ("sha256", "xxh3_128"):
    ks = KeySpace(model_id="m", layout=layout, key_secret=b"s" * 32, algo=algo, model_revision="r1")
    for tenant in sorted({"acme", "globex", "default"}):  # a set: iteration order is seeded
        toks = list(range(40))
        out[f"{algo}/{tenant}"] = ks.block_keys_bytes(toks, tenant=tenant).hex()
        out[f"{algo}/{tenant}/public"] = ks.block_keys_bytes(toks, tenant=tenant, public_prefix_tokens=12).hex()
        out[f"{algo}/{tenant}/engine"] = [k.hex() for k in ks.engine_keys([1, -5, b"abc"], tenant=tenant)]
print(json.dumps(out, sort_keys=True))
"""


@pytest.mark.slow
def test_keys_identical_across_processes_and_hash_seeds():
    procs = []
    for seed in ("0", "4242"):  # this process, with its random seed, is the third
        env = dict(os.environ, PYTHONHASHSEED=seed)
        procs.append(subprocess.Popen([sys.executable, "-c", _SUBPROCESS_SCRIPT], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout))
    assert outs[0] == outs[1]
    assert len(outs[0]) == 18
    # and this process (random hash seed) computes the very same keys
    ks = make_space(model_revision="r1")
    assert outs[0]["sha256/acme"] == ks.block_keys_bytes(list(range(40)), tenant="acme").hex()


def test_deterministic_within_a_process_and_across_keyspaces():
    toks = np.arange(1000, 1100, dtype=np.int64)
    a = make_space().block_keys(toks, tenant="t")
    assert a == make_space().block_keys(toks, tenant="t")
    assert a == make_space().block_keys(toks.tolist(), tenant="t")
    assert a == make_space().block_keys(torch.from_numpy(toks)[None, :], tenant="t")  # [1, n] batch
    assert len(a) == 25 and len(set(a)) == 25
    assert all(type(k) is bytes and len(k) == 16 for k in a)


# ---------------------------------------------------------------- tenants and public prefixes


tenant_names = st.text(min_size=1, max_size=12)
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=BT, max_size=6 * BT)


@given(tokens=token_lists, t1=tenant_names, t2=tenant_names, other=token_lists)
def test_different_tenants_never_share_a_key(tokens, t1, t2, other):
    assume(t1 != t2)
    ks = make_space()
    mine = set(ks.block_keys(tokens, tenant=t1))
    # not for this prompt, and not for any other prompt either
    assert mine.isdisjoint(ks.block_keys(tokens, tenant=t2))
    assert mine.isdisjoint(ks.block_keys(other, tenant=t2))


def test_tenant_salt_depends_on_the_secret():
    toks = list(range(16))
    a = make_space().block_keys(toks, tenant="acme")
    b = make_space(key_secret=b"t" * 32).block_keys(toks, tenant="acme")
    assert set(a).isdisjoint(b)


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=6 * BT),
    public_prefix_tokens=st.integers(min_value=0, max_value=8 * BT),
)
def test_public_prefix_blocks_shared_later_blocks_not(tokens, public_prefix_tokens):
    ks = make_space()
    a = ks.block_keys(tokens, tenant="acme", public_prefix_tokens=public_prefix_tokens)
    b = ks.block_keys(tokens, tenant="globex", public_prefix_tokens=public_prefix_tokens)
    n_blocks = len(tokens) // BT
    n_public = min(public_prefix_tokens // BT, n_blocks)  # a partial public block is private
    assert len(a) == len(b) == n_blocks
    assert a[:n_public] == b[:n_public]
    assert set(a[n_public:]).isdisjoint(b[n_public:])
    # the public blocks are the public namespace's chain, whoever asks
    assert a[:n_public] == _ref_chain(ks.public_namespace, tokens[: n_public * BT], BT)
    # without a declaration nothing is shared, and private keys differ from public ones
    assert set(ks.block_keys(tokens, tenant="acme")).isdisjoint(b)


def test_public_prefix_rejects_bad_values():
    ks = make_space()
    for bad in (-1, 1.5, "8", None):
        with pytest.raises(InvalidInput, match="public_prefix_tokens"):
            ks.block_keys(list(range(8)), public_prefix_tokens=bad)


def test_engine_keys_are_tenant_separated():
    ks = make_space()
    hashes = [0, 1, -1, 2**64 + 3, b"\x00" * 32, np.int64(9)]
    a = ks.engine_keys(hashes, tenant="acme")
    b = ks.engine_keys(hashes, tenant="globex")
    assert len(a) == len(set(a)) == 6
    assert set(a).isdisjoint(b)
    assert a == ks.engine_keys(hashes, tenant="acme")
    # engine keys never equal chain keys of the same tenant
    assert set(a).isdisjoint(ks.block_keys(list(range(64)), tenant="acme"))
    for bad in (1.0, True, "abc", None):
        with pytest.raises(InvalidInput, match="engine hash"):
            ks.engine_keys([bad], tenant="acme")


# ---------------------------------------------------------------- namespace fields


def test_namespace_fields_cannot_collide():
    toks = list(range(16))

    def keys(**kw):
        return make_space(**kw).block_keys(toks, tenant="acme")

    base = keys()
    # absent vs empty revision
    assert keys(model_revision=None) == base
    assert keys(model_revision="") != base
    # concatenation shifting between adjacent fields
    assert keys(model_id="ab", model_revision="c") != keys(model_id="a", model_revision="bc")
    assert keys(model_id="abc") != keys(model_id="ab", model_revision="c")
    # absent vs zero for an int field, and which int field carries the value
    assert keys(tp_rank=0) != base
    assert keys(tp_rank=1, tp_size=None) != keys(tp_rank=None, tp_size=1)
    assert keys(pp_rank=1) != keys(tp_rank=1)
    assert len({bytes(k[0]) for k in [base, keys(model_revision=""), keys(tp_rank=0), keys(tp_size=1)]}) == 4


@pytest.mark.parametrize(
    "change",
    [
        dict(model_id="m2"),
        dict(model_revision="r2"),
        dict(layout=BlockLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.float16)),
        dict(layout=BlockLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4, dtype=torch.float16)),
        dict(layout=BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.bfloat16)),
        dict(layout=BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.float32)),
        dict(algo="xxh3_128"),
    ],
    ids=["model", "revision", "layers", "heads-vs-dim", "bf16", "fp32", "xxh3"],
)
def test_model_layout_dtype_or_algo_change_changes_every_key(change):
    toks = list(range(32))
    base = make_space().block_keys(toks, tenant="acme")
    other = make_space(**change).block_keys(toks, tenant="acme")
    assert len(other) == len(base) == 8
    assert set(base).isdisjoint(other)


def test_block_size_change_changes_keys():
    toks = list(range(32))
    small = make_space().block_keys(toks)
    big_layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=8, dtype=torch.float16)
    big = make_space(layout=big_layout).block_keys(toks)
    assert len(small) == 8 and len(big) == 4
    assert set(small).isdisjoint(big)


def test_xxh3_keys_work_and_differ_from_sha256():
    toks = np.arange(64, dtype=np.uint32)
    kx = make_space(algo="xxh3_128")
    x = kx.block_keys(toks, tenant="acme")
    assert x == kx.block_keys(toks, tenant="acme")
    assert len(x) == 16 and len(set(x)) == 16 and all(len(k) == 16 for k in x)
    assert set(x).isdisjoint(make_space().block_keys(toks, tenant="acme"))
    # the tenant and public-prefix rules hold for xxh3 too
    y = kx.block_keys(toks, tenant="globex", public_prefix_tokens=8)
    z = kx.block_keys(toks, tenant="acme", public_prefix_tokens=8)
    assert y[:2] == z[:2] and set(y[2:]).isdisjoint(z[2:])
    assert set(y[2:]).isdisjoint(x)


# ---------------------------------------------------------------- full blocks only


@pytest.mark.parametrize("n_tokens, n_keys", [(0, 0), (1, 0), (3, 0), (4, 1), (7, 1), (8, 2), (41, 10)])
def test_only_full_blocks_get_keys(n_tokens, n_keys):
    ks = make_space()
    toks = list(range(n_tokens))
    keys = ks.block_keys(toks)
    assert len(keys) == n_keys
    assert len(ks.block_keys_bytes(toks)) == 16 * n_keys
    # the trailing partial block changes nothing
    assert keys == ks.block_keys(toks[: n_keys * BT])


def test_block_keys_bytes_is_block_keys_concatenated():
    ks = make_space()
    toks = list(range(50))
    assert ks.block_keys_bytes(toks, tenant="x", public_prefix_tokens=4) == b"".join(
        ks.block_keys(toks, tenant="x", public_prefix_tokens=4)
    )


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "tokens, msg",
    [
        ([1, -1, 2], "token id -1 is outside uint32"),
        ([1, 2**32], f"token id {2**32} is outside uint32"),
        (np.array([0, -(2**40)], dtype=np.int64), "outside uint32"),
        (np.array([2**63], dtype=np.uint64), "outside uint32"),
        (torch.tensor([5, -3]), "token id -3 is outside uint32"),
        ([1.0, 2.0], "must be integers"),
        (np.array([1.5]), "must be integers"),
        (torch.tensor([1.0, 2.0]), "must be integers"),
        (torch.tensor([1, 2], dtype=torch.bfloat16), "must be integers"),
        (torch.tensor([True, False]), "must be integers"),
        (np.array([True]), "must be integers"),
        (["1", "2"], "must be integers"),
        ([[1, 2], [3, 4]], "must be 1-D"),
        (np.zeros((1, 2, 4), dtype=np.int64), "must be 1-D"),
        (torch.zeros((2, 4), dtype=torch.int64), "must be 1-D"),
        (np.int64(5), "must be 1-D"),
    ],
)
def test_bad_tokens_raise_invalid_input(tokens, msg):
    with pytest.raises(InvalidInput, match=msg):
        make_space().block_keys(tokens)


def test_token_extremes_accepted():
    ks = make_space()
    assert len(ks.block_keys([0, 0, 2**32 - 1, 2**32 - 1])) == 1
    assert as_token_array([]).dtype == np.uint32 and as_token_array([]).size == 0
    assert as_token_array(np.array([7], dtype=np.uint64)).tolist() == [7]
    assert as_token_array(torch.tensor([[1, 2, 3]], dtype=torch.int32)).tolist() == [1, 2, 3]


def test_bad_keyspace_arguments_raise_invalid_input():
    with pytest.raises(InvalidInput, match="unknown key algorithm"):
        make_space(algo="md5")
    with pytest.raises(InvalidInput, match="at least 16 bytes"):
        make_space(key_secret=b"x" * 15)
    with pytest.raises(InvalidInput, match="at least 16 bytes"):
        make_space(key_secret="s" * 32)
    with pytest.raises(InvalidInput, match="model_id"):
        make_space(model_id="")
    with pytest.raises(InvalidInput, match="model_id"):
        make_space(model_id=None)
    with pytest.raises(InvalidInput, match="namespace field"):
        make_space(model_revision=1.5)
    with pytest.raises(InvalidInput, match="namespace field"):
        make_space(tp_rank=True)


@pytest.mark.parametrize("tenant", ["", None, 5, b"acme", ["acme"]])
def test_bad_tenant_raises_invalid_input(tenant):
    ks = make_space()
    with pytest.raises(InvalidInput, match="tenant"):
        ks.block_keys(list(range(8)), tenant=tenant)
    with pytest.raises(InvalidInput, match="tenant"):
        ks.engine_keys([1], tenant=tenant)


# ---------------------------------------------------------------- normalize_keys


def test_normalize_keys_accepts_lists_tuples_and_arrays():
    ks = make_space()
    keys = ks.block_keys(list(range(12)))
    assert normalize_keys(keys) is keys  # the common case allocates nothing
    assert normalize_keys(tuple(keys)) == keys
    arr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(3, 16)
    assert normalize_keys(arr) == keys
    assert normalize_keys(np.zeros((0, 16), dtype=np.uint8)) == []
    assert normalize_keys([]) == []
    mixed = [bytearray(keys[0]), memoryview(keys[1]), keys[2]]
    got = normalize_keys(mixed)
    assert got == keys and all(type(k) is bytes for k in got)
    assert normalize_keys(iter(keys)) == keys


@pytest.mark.parametrize(
    "keys, msg",
    [
        ([b"x" * 15], "16 bytes"),
        ([b"x" * 16, b"x" * 17], "16 bytes"),
        ([bytearray(16), b"short"], "16 bytes"),  # a convertible key first must not hide a bad one
        ([bytearray(16), 16], "16 bytes"),
        ([bytearray(16), "x" * 16], "16 bytes"),
        (["x" * 16], "16 bytes"),
        ([None], "16 bytes"),
        (b"x" * 32, "not one bytes object"),
        (np.zeros((2, 15), dtype=np.uint8), "uint8"),
        (np.zeros((2, 16), dtype=np.int8), "uint8"),
        (np.zeros(32, dtype=np.uint8), "uint8"),
    ],
)
def test_normalize_keys_rejects_wrong_lengths_and_types(keys, msg):
    with pytest.raises(InvalidInput, match=msg):
        normalize_keys(keys)


# ---------------------------------------------------------------- kvdb bench keys


def test_bench_keys_reports_its_figures_next_to_the_baseline():
    from kvdb.bench.keys import bench_keys

    res = bench_keys(prompt_tokens=100, block_tokens=16, repeats=1)
    assert res["prompt_tokens"] == 100 and res["block_tokens"] == 16 and res["blocks"] == 6
    for name in ("hashlib_blocks_per_s", "keys_blocks_per_s", "xxh3_keys_blocks_per_s"):
        assert res[name] > 0
    assert res["ratio"] == pytest.approx(res["keys_blocks_per_s"] / res["hashlib_blocks_per_s"], rel=0.01)
    for bad in (dict(prompt_tokens=0), dict(block_tokens=-1), dict(prompt_tokens=8, block_tokens=16)):
        with pytest.raises(InvalidInput):
            bench_keys(**bad)
