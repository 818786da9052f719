"""GPU tests of mla_bridge.kernels.launch: a launch through the compiled kernel's launcher equals Triton's own launch.

Marked ``gpu`` (run on the H200: ``python -m pytest tests/gpu/test_gpu_launch.py -q -m gpu``). For each of the
Triton kernels (merge, gather, fused gather + up-projection), every launch is queued behind ``torch.cuda._sleep``
so the host runs ahead of the GPU, and new inputs are written before each launch, so a launch that read stale
arguments would show:

* the second launch of a specialization takes the direct path (its cache entry holds a compiled kernel);
* its outputs are bitwise those of ``MLA_BRIDGE_TRITON_LAUNCH=jit`` (``kernel[grid]`` every time) on the same inputs;
* a misaligned view (a pointer 2 bytes past 16-byte alignment) gets a specialization of its own, also bitwise.
"""

from __future__ import annotations

import pytest
import torch

import mla_bridge.kernels.launch as launch_mod
from mla_bridge import MLADims, prepare_kv_b_proj

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _twice(monkeypatch, mode, make, call):
    """``call(*make(seed))`` for two seeds in ``mode``, each behind a GPU sleep; the outputs of each."""
    monkeypatch.setenv(launch_mod.LAUNCH_ENV, mode)
    outs = []
    for seed in (1, 2):
        inputs = make(seed)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e7))
        outs.append(call(*inputs))
    torch.cuda.synchronize()
    return [[t.clone() for t in o] for o in outs]


def _assert_direct_equals_jit(monkeypatch, fn, make, call):
    jit = _twice(monkeypatch, "jit", make, call)
    launch_mod._CACHES.pop(id(fn), None)
    direct = _twice(monkeypatch, "direct", make, call)
    entries = launch_mod._CACHES.get(id(fn), {})
    assert entries and all(e is not False for e in entries.values()), "the direct path was not taken"
    for a, b in zip(jit, direct):
        for x, y in zip(a, b):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("misaligned", [False, True])
def test_merge_direct_launch_is_bitwise(monkeypatch, misaligned):
    from mla_bridge.kernels import merge as km

    t, h, d = 3000, 16, 128

    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        out = torch.randn(t, h, d, device="cuda", generator=g).to(BF16)
        big = torch.randn(t, h, d + 8, device="cuda", generator=g).to(BF16)
        out_b = big[..., 1 : d + 1] if misaligned else big[..., :d]
        lse = torch.randn(t, h, device="cuda", generator=g)
        lse_b = torch.randn(t, h, device="cuda", generator=g) * 1.4
        return out, lse, out_b, lse_b

    def call(out, lse, out_b, lse_b):
        km.merge_triton(out, lse, out, lse, out_b, lse_b, True)
        return out, lse

    _assert_direct_equals_jit(monkeypatch, km._merge_kernel, make, call)


@pytest.mark.parametrize("fp8", [False, True])
def test_gather_direct_launch_is_bitwise(monkeypatch, fp8):
    from mla_bridge.kernels import gather as kg

    blocks, bs, n = 512, 16, 5000

    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        cache = torch.randn(blocks, bs, 576, device="cuda", generator=g).to(BF16)
        if fp8:
            cache = cache.to(torch.float8_e4m3fn)
        table = torch.randperm(blocks, device="cuda", generator=g).view(8, -1).int()
        req = torch.randint(0, 8, (n,), device="cuda", generator=g)
        pos = torch.randint(0, blocks // 8 * bs, (n,), device="cuda", generator=g)
        scale = torch.tensor(0.37 * seed, device="cuda") if fp8 else None
        return cache, table, req, pos, scale

    def call(cache, table, req, pos, scale):
        out = torch.empty(n, 576, device="cuda", dtype=BF16)
        kg.gather_latent_triton(out, cache, table, req, pos, scale)
        return (out,)

    _assert_direct_equals_jit(monkeypatch, kg._gather_kernel, make, call)


def test_fused_up_projection_direct_launch_is_bitwise(monkeypatch):
    from mla_bridge.kernels import up_project as ku

    d = MLADims.deepseek_v2_lite()
    blocks, bs, n = 256, 16, 3000

    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        cache = torch.randn(blocks, bs, 576, device="cuda", generator=g).to(BF16)
        table = torch.randperm(blocks, device="cuda", generator=g).view(4, -1).int()
        req = torch.randint(0, 4, (n,), device="cuda", generator=g)
        pos = torch.randint(0, blocks // 4 * bs, (n,), device="cuda", generator=g)
        w = prepare_kv_b_proj((torch.randn(d.kv_b_proj_shape, device="cuda", generator=g) * 0.05).to(BF16), d)
        return cache, table, req, pos, w

    def call(cache, table, req, pos, w):
        out = torch.empty(n, d.num_heads, d.head_dim_qk + d.v_head_dim, device="cuda", dtype=BF16)
        ku.up_project_triton(out, w, kv_cache=cache, block_table=table, req_ids=req, positions=pos)
        return (out,)

    _assert_direct_equals_jit(monkeypatch, ku._up_project_kernel, make, call)


@pytest.mark.parametrize("kv_impl", ["separate", "fused"])
def test_chunked_mla_prefill_direct_equals_jit(monkeypatch, kv_impl):
    """A chunked mla_prefill over an FP8 cache (gather or fused kernel per chunk, Triton merge), layer after layer
    with the host ahead of the GPU: bitwise the same out and lse with direct launches as with kernel[grid]."""
    from mla_bridge import PrefillPlan, Workspace, mla_prefill

    d = MLADims.deepseek_v2_lite()
    q_lens, c_lens, bs = [300, 1, 517], [1000, 4000, 33], 16
    g = torch.Generator(device="cuda").manual_seed(5)
    t, blocks = sum(q_lens), sum(-(-c // bs) for c in c_lens) + 3
    q = torch.randn(t, d.num_heads, d.head_dim_qk, device="cuda", generator=g).to(BF16)
    kv_c = torch.randn(t, d.kv_lora_rank, device="cuda", generator=g).to(BF16)
    k_pe = torch.randn(t, d.qk_rope_head_dim, device="cuda", generator=g).to(BF16)
    w = prepare_kv_b_proj((torch.randn(d.kv_b_proj_shape, device="cuda", generator=g) * 0.05).to(BF16), d)
    cache = torch.randn(blocks, bs, d.latent_dim, device="cuda", generator=g).to(torch.float8_e4m3fn)
    table = torch.randint(0, blocks, (3, -(-max(c_lens) // bs)), device="cuda", generator=g, dtype=torch.int32)
    scale = torch.tensor(0.05, device="cuda")
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=d,
        workspace=Workspace("cuda", chunk_tokens=1024),
        block_size=bs,
        dtype=BF16,
        kv_cache_dtype="fp8",
    )
    assert len(plan.chunks) >= 4
    results = {}
    for mode in ("jit", "direct", "direct"):
        monkeypatch.setenv(launch_mod.LAUNCH_ENV, mode)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e8))
        runs = [
            mla_prefill(q, kv_c, k_pe, w, cache, table, plan, return_lse=True, kv_cache_scale=scale, kv_impl=kv_impl)
            for _ in range(3)
        ]
        torch.cuda.synchronize()
        results.setdefault(mode, []).extend(runs)
    ref_out, ref_lse = results["jit"][0]
    for out, lse in results["jit"][1:] + results["direct"]:
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
