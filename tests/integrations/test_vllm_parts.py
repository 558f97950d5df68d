"""The vLLM connector's parts without an engine: paged layouts, settings, sizes, the lookup socket.

The paged-layout tests write through vLLM's own CPU cache kernel, the one the forward pass uses,
so a layout kvdb got wrong shows up here as unequal bytes.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch

import kvdb
from kvdb.errors import InvalidInput
from kvdb.sizes import parse_size

pytestmark = pytest.mark.vllm
if os.environ.get("KVDB_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from kvdb.integrations.vllm.paged import KvMap, PagedLayout, probe_cpu_layout, strided_layout  # noqa: E402
from kvdb.integrations.vllm.endpoint import connect  # noqa: E402
from kvdb.integrations.vllm.service import MAX_FRAME, ServiceClient  # noqa: E402
from kvdb.integrations.vllm.settings import Settings  # noqa: E402

BT, H, D, NB = 32, 2, 32, 6


def cpu_writer(dtype):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, BT, D)

    def write(key, value, key_cache, value_cache, slot_mapping):
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

    return write


def write_tokens(t, write, block: int, k, v):
    """Write K/V [BT, H, D] into ``block`` of a CPU paged tensor the way the forward pass does."""
    kc, vc = t.view(t.shape[0], H, 2 * BT, D).chunk(2, dim=2)
    write(k, v, kc, vc, torch.arange(BT) + block * BT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_layout_probe_reads_back_what_the_kernel_wrote(dtype):
    write = cpu_writer(dtype)
    caches = [torch.zeros(NB, H, BT, 2 * D, dtype=dtype) for _ in range(3)]
    lay = probe_cpu_layout(caches[0], block_tokens=BT, num_heads=H, head_dim=D, write=write)
    g = torch.Generator().manual_seed(1)
    want = torch.randn(2, 3, 2, BT, H, D, generator=g).to(dtype)  # blocks 4 and 1, 3 layers
    for layer, t in enumerate(caches):
        for i, b in enumerate((4, 1)):
            write_tokens(t, write, b, want[i, layer, 0].contiguous(), want[i, layer, 1].contiguous())
    out = torch.zeros_like(want)
    lay.gather(caches, torch.tensor([4, 1]), out)
    assert torch.equal(out, want)
    # and back: scatter into empty caches lands the same bytes where the kernel put them
    fresh = [torch.zeros_like(t) for t in caches]
    lay.scatter(fresh, torch.tensor([4, 1]), out)
    for t, f in zip(caches, fresh):
        assert torch.equal(t[4], f[4]) and torch.equal(t[1], f[1])
        assert not f[0].any() and not f[2].any()  # nothing else written


def test_indexed_moves_when_the_packing_is_not_strided():
    """A tiled packing (no single stride per dim) goes through the index path, exactly."""
    g = torch.Generator().manual_seed(2)
    per = 2 * BT * H * D
    perm = torch.randperm(per, generator=g)
    within = perm.view(2, BT, H, D)
    lay = PagedLayout(block_tokens=BT, num_heads=H, head_dim=D, num_blocks=NB, block_stride=per,
                      maps=(KvMap(0, within[0].clone(), None), KvMap(0, within[1].clone(), None)), kind="test")
    assert not lay.affine
    caches = [torch.randn(NB, per, generator=g) for _ in range(2)]
    out = torch.empty(3, 2, 2, BT, H, D)
    ids = torch.tensor([5, 0, 3])
    lay.gather(caches, ids, out)
    for i, b in enumerate(ids.tolist()):
        for layer in range(2):
            assert torch.equal(out[i, layer].reshape(-1), caches[layer][b][perm])
    fresh = [torch.zeros_like(c) for c in caches]
    lay.scatter(fresh, ids, out)
    for c, f in zip(caches, fresh):
        assert torch.equal(c[ids], f[ids]) and not f[1].any()


@pytest.mark.parametrize("shape_order", ["kv_first", "blocks_first", "hnd_physical"])
def test_strided_layouts_of_gpu_backends(shape_order):
    g = torch.Generator().manual_seed(3)
    if shape_order == "kv_first":
        t = torch.randn(2, NB, BT, H, D, generator=g)
        ref = lambda b: t[:, b]  # noqa: E731
    elif shape_order == "blocks_first":
        t = torch.randn(NB, 2, BT, H, D, generator=g)
        ref = lambda b: t[b]  # noqa: E731
    else:  # physically [2, nb, H, BT, D], seen through a logical [2, nb, BT, H, D] view
        t = torch.randn(2, NB, H, BT, D, generator=g).transpose(2, 3)
        ref = lambda b: t[:, b]  # noqa: E731
    lay = strided_layout(t, block_tokens=BT, num_heads=H, head_dim=D)
    assert lay.affine
    out = torch.empty(2, 1, 2, BT, H, D)
    lay.gather([t], torch.tensor([3, 1]), out)
    assert torch.equal(out[0, 0], ref(3)) and torch.equal(out[1, 0], ref(1))
    lay.scatter([t], torch.tensor([0]), out[1:])
    assert torch.equal(ref(0), ref(1))


def test_unreadable_layouts_are_refused():
    with pytest.raises(InvalidInput, match="cannot read"):
        strided_layout(torch.zeros(NB, BT, H, D), block_tokens=BT, num_heads=H, head_dim=D)
    with pytest.raises(InvalidInput, match="quantized"):
        probe_cpu_layout(torch.zeros(NB, H, BT, 2 * D, dtype=torch.uint8), block_tokens=BT, num_heads=H,
                         head_dim=D, write=None)

    def drops(key, value, key_cache, value_cache, slot_mapping):  # a kernel that writes V only
        value_cache[0] = value.permute(1, 0, 2)

    with pytest.raises(InvalidInput, match="unwritten"):
        probe_cpu_layout(torch.zeros(NB, H, BT, 2 * D), block_tokens=BT, num_heads=H, head_dim=D, write=drops)


def test_sizes():
    assert parse_size("4GiB", "x") == 4 << 30
    assert parse_size(" 512 mib ", "x") == 512 << 20
    assert parse_size("1.5GB", "x") == 1_500_000_000
    assert parse_size(65536, "x") == 65536 and parse_size("0", "x") == 0
    assert parse_size(None, "x", allow_none=True) is None
    for bad in ("4 GiBs", "-1", "1.5B", "", "nan", True, 1.5, -3, 2**70, None):
        with pytest.raises(InvalidInput, match="x"):
            parse_size(bad, "x")


def test_settings_from_extra_config():
    s = Settings.from_extra({"path": "kv", "host_bytes": "1GiB", "disk_bytes": "0", "durability": "group"})
    assert (s.host_bytes, s.disk_bytes, s.durability, s.replacer) == (1 << 30, 0, "group", "kvdb")
    assert Settings.from_extra({"path": "kv"}).disk_bytes is None
    for extra, match in (({}, "path"), ({"path": "kv", "hostbytes": 1}, "unknown setting"),
                         ({"path": "kv", "durability": "fast"}, "durability"),
                         ({"path": "kv", "host_bytes": "lots"}, "host_bytes"),
                         ({"path": "kv", "lookup_timeout_s": 0}, "lookup_timeout_s"),
                         ({"path": "kv", "model_id": 3}, "model_id"),
                         ({"path": "kv", "shared_bytes": "1GiB"}, "needs 'shared'"),
                         ({"path": "kv", "shared": "redis://h:1"}, "mooncake://"),
                         ({"path": "kv", "shared": "mooncake://h:1", "shared_bytes": "lots"}, "shared_bytes"),
                         ({"path": "kv", "shared": ""}, "shared"),
                         ({"path": "kv", "key_secret_file": 7}, "key_secret_file")):
        with pytest.raises(InvalidInput, match=match):
            Settings.from_extra(extra)


def test_shared_pool_settings():
    s = Settings.from_extra({"path": "kv", "shared": "mooncake://10.0.0.5:50051?deadline_ms=200",
                             "shared_bytes": "1GiB", "key_secret_file": "cluster.keysecret"})
    assert (s.shared, s.shared_bytes, s.key_secret_file) == ("mooncake://10.0.0.5:50051?deadline_ms=200", 1 << 30,
                                                             "cluster.keysecret")
    plain = Settings.from_extra({"path": "kv"})
    assert (plain.shared, plain.shared_bytes, plain.key_secret_file) == (None, 0, None)


LAYOUT = kvdb.BlockLayout(num_layers=2, num_kv_heads=H, head_dim=D, block_tokens=BT, dtype=torch.float32)


def test_lookups_and_session_calls_over_the_socket(served):
    hashes = [bytes([i]) * 32 for i in range(4)]
    keys = served.db.engine_keys(hashes[:3], tenant="acme")
    served.db.put_blocks(keys, torch.zeros(3, *LAYOUT.block_shape))
    client = ServiceClient(served.path, timeout_s=5.0)
    wire = {"op": "lookup", "req": "r1", "tenant": "acme", "hashes": [h.hex() for h in hashes],
            "params": {"session_id": "s", "agent_id": "a", "priority": 2, "expected_tool_duration_s": 5.0}}
    got = client.call(wire)
    assert got["hit_blocks"] == 3
    assert [h["status"] for h in got["hints"]] == ["accepted"]
    assert client.call(dict(wire, tenant="other"))["hit_blocks"] == 0  # another tenant's keys
    done = client.call({"op": "finished", "req": "r1"})
    assert [(h["hint"], h["status"]) for h in done["hints"]] == [("expected_tool_duration_s", "accepted")]
    assert client.call({"op": "explain", "session_id": "s"})["agents"][0]["state"] == "waiting"
    assert "unknown op" in client.call({"op": "drop_everything"})["error"]
    assert "hex" in client.call(dict(wire, hashes=["zz"]))["error"]
    client.close()


def test_an_oversized_frame_closes_only_that_connection(served):
    s = connect(served.path, 5.0)
    s.sendall(struct.pack(">I", MAX_FRAME + 1))
    assert s.recv(1) == b""  # closed without buffering the body
    s.close()
    client = ServiceClient(served.path, timeout_s=5.0)
    assert client.call({"op": "lookup", "req": "r", "tenant": "t", "hashes": [], "params": None})["hit_blocks"] == 0
    client.close()


def test_a_client_with_no_worker_misses_instead_of_failing(tmp_path):
    client = ServiceClient(str(tmp_path / "nobody"), timeout_s=0.5)
    assert client.call({"op": "lookup", "req": "r", "tenant": "t", "hashes": [], "params": None}) is None
    assert client.failures == 1


TOOLS = [{"name": f"tool_{i}", "description": f"does thing {i} " * 4, "parameters": {"type": "object"}} for i in range(3)]


def byte_encode(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


def rendered_call(client, db, req: str, tools, *, canonical: bool, sid: str = "s"):
    """One request's lookup and end over the socket, with its rendered prompt in the params; the
    block hashes stand in for vLLM's (the service treats them as opaque)."""
    from kvdb.prompts import render, transfer_params

    r = render({"system": "you are an agent", "tools": tools, "messages": [{"role": "user", "content": "go"}]},
               encode=byte_encode, canonical=canonical)
    full = len(r.token_ids) // BT
    hashes = [bytes.fromhex(kvdb_digest(r.token_ids[: (i + 1) * BT])) for i in range(full)]
    got = client.call({"op": "lookup", "req": req, "tenant": "acme", "hashes": [h.hex() for h in hashes],
                       "params": {"session_id": sid, "prompt": transfer_params(r)}, "tokens": r.token_ids})
    new = db.engine_keys(hashes[got["hit_blocks"]:], tenant="acme")
    if new:  # what the worker saves once vLLM computed them
        db.put_blocks(new, torch.zeros(len(new), *LAYOUT.block_shape))
    done = client.call({"op": "finished", "req": req, "hashes": [h.hex() for h in hashes]})
    return r, got, done


def kvdb_digest(ids) -> str:
    import hashlib

    return hashlib.sha256(str(ids).encode()).hexdigest()


@pytest.mark.parametrize("canonical", [True, False])
def test_rendered_prompt_segments_in_params_are_noted(served, canonical):
    # Scenario: one session, two calls whose tool lists differ only in order; the segments travel
    # in kv_transfer_params["prompt"], the tokens with the first lookup.
    client = ServiceClient(served.path, timeout_s=5.0)
    first, got, done = rendered_call(client, served.db, "r1", TOOLS, canonical=canonical)
    assert got["hints"] == [] and got["prompt"]["status"] == "accepted"
    assert got["prompt"]["segments"] == len(first.segments) == 6
    assert done["prompt"] == {"status": "noted", "tokens": len(first.token_ids), "shared": 0, "could": 0,
                              "lost": 0, "broke": False}
    second, got, done = rendered_call(client, served.db, "r2", TOOLS[::-1], canonical=canonical)
    prompts = served.db.stats()["prompts"]
    assert prompts["calls"] == 2 and served.counters.noted_prompts == 2
    if canonical:
        assert second.token_ids == first.token_ids
        assert done["prompt"]["broke"] is False and done["prompt"]["shared"] == len(first.token_ids)
        assert prompts["breaks"] == prompts["tokens_lost"] == 0
    else:  # the tools moved: shared only the system prompt, could have shared all but the message
        assert done["prompt"]["broke"] is True and done["prompt"]["lost"] > 0
        assert (prompts["breaks"], prompts["tokens_lost"]) == (1, done["prompt"]["lost"])
        assert got["prompt"]["near_segments"] >= 3  # the tools are stored, after another context
    assert served.db.explain(session_id="s")["prompts"]["calls"] == 2
    client.close()


def test_bad_prompt_params_are_ignored_with_a_counted_reason(served):
    from kvdb.prompts import render, transfer_params

    r = render({"system": "sys", "tools": TOOLS}, encode=byte_encode)
    good = transfer_params(r)
    seg0 = good["segments"][0]
    cases = [
        ("not_an_object", "segments please", r.token_ids),
        ("no_tokens", good, None),
        ("bad_segments", {"segments": []}, r.token_ids),
        ("bad_segment", {"segments": [seg0[:4]] + good["segments"][1:]}, r.token_ids),
        ("bad_segment", {"segments": [["tool_call", *seg0[1:]]] + good["segments"][1:]}, r.token_ids),
        ("bad_segment", {"segments": [[*seg0[:3], "zz" * 16, ""]] + good["segments"][1:]}, r.token_ids),
        ("not_tiling", {"segments": good["segments"][1:]}, r.token_ids),
        ("not_tiling", good, r.token_ids[:-1]),
        ("no_tokens", good, [-1] * len(r.token_ids)),
    ]
    for i, (reason, params, tokens) in enumerate(cases):
        got = served.lookup(f"bad{i}", "acme", [], {"session_id": "s", "prompt": params}, tokens)
        assert got["hit_blocks"] == 0 and got["hints"] == []  # the request goes on
        assert (got["prompt"]["status"], got["prompt"]["reason"]) == ("ignored", reason), (i, got)
        assert "prompt" not in served.finished(f"bad{i}")  # nothing to note
    c = served.counters.as_dict()
    assert c["ignored_prompts"] == len(cases) and c["noted_prompts"] == 0
    assert c["prompt_ignored_reasons"] == {"not_an_object": 1, "no_tokens": 2, "bad_segments": 1, "bad_segment": 3,
                                           "not_tiling": 2}
    assert served.db.stats()["prompts"]["calls"] == 0
    # a good one is accepted; a later lookup of the same request (a preemption) does not read it again
    assert served.lookup("ok", "acme", [], {"prompt": good}, r.token_ids)["prompt"]["status"] == "accepted"
    assert "prompt" not in served.lookup("ok", "acme", [], {"prompt": good}, None)
    assert served.finished("ok")["prompt"]["status"] == "noted"  # no session: indexed, no break accounting
    assert served.db.stats()["prompts"]["indexed_prompts"] == 1
