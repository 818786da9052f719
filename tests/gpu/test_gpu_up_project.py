"""GPU tests of the fused gather + up-projection kernel (mla_bridge.kernels.up_project, chosen by mla_bridge.kv).

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run on the H200:
    python -m pytest tests/gpu/test_gpu_up_project.py -q -m gpu
* fused == separate (gather + cuBLAS GEMM) for every pass of the fused and the chunked schedules, bf16 and FP8
  caches (the FP8 cache's scale as a tensor and as a float), identity and split weight layouts, block sizes 1/16, NaN in
  every cache slot no request reads: k_pe columns exactly equal (as values: the identity layout's GEMM adds +0.0, so
  it writes +0.0 where the kernel copies a -0.0), k_nope and v within one bf16 rounding step of the float32
  sums (the two GEMMs add the same products in another order); the GPU kept busy so the host runs ahead.
* mla_prefill with MLA_BRIDGE_KV=fused against the separate path and against float64 (the bf16 tolerances of
  tests/gpu/test_gpu_core.py), at DeepSeek-V2-Lite dims, fused and chunked schedules, bf16 and FP8 caches.
* the FP8 specialization gives the same bits in 1000 launches (the pipeline race of
  :mod:`mla_bridge.kernels.up_project`: with 3 stages about 1 launch in 200 was wrong).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, prepare_kv_b_proj  # noqa: E402
from mla_bridge import cache as C  # noqa: E402
from mla_bridge import kv as KV  # noqa: E402

BF16 = torch.bfloat16


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _case(
    block_size: int, fp8: bool, seed: int, q_lens=(300, 0, 129, 1), c_lens=(700, 1500, 3, 257), chunk_tokens=1024
):
    """A shuffled paged cache with NaN in every slot no request reads, DeepSeek-V2-Lite dims."""
    g = torch.Generator().manual_seed(seed)
    d = MLADims.deepseek_v2_lite()
    blocks = [-(-c // block_size) for c in c_lens]
    nb = sum(blocks) + 3
    full = torch.full((nb, block_size, d.latent_dim), float("nan"))
    order = torch.randperm(nb, generator=g).tolist()
    table = torch.full((len(c_lens), max(blocks) + 1), -1, dtype=torch.int32)
    k = 0
    for r, c in enumerate(c_lens):
        for b in range(blocks[r]):
            table[r, b] = order[k]
            m = min(block_size, c - b * block_size)
            full[order[k], :m] = torch.randn(m, d.latent_dim, generator=g)
            k += 1
    if fp8:
        cache, scale = C.quantize_latent_cache(full.to(dev()))
    else:
        cache, scale = full.to(BF16).to(dev()), None
    t = sum(q_lens)
    kv_c = torch.randn(t, d.kv_lora_rank, generator=g).to(BF16).to(dev())
    k_pe = torch.randn(t, d.qk_rope_head_dim, generator=g).to(BF16).to(dev())
    q = torch.randn(t, d.num_heads, d.head_dim_qk, generator=g).to(BF16).to(dev())
    w = (torch.randn(*d.kv_b_proj_shape, generator=g) * d.kv_lora_rank**-0.5).to(BF16).to(dev())
    ws = Workspace(dev(), chunk_tokens=chunk_tokens)
    return d, ws, list(q_lens), list(c_lens), cache, scale, table.to(dev()), q, kv_c, k_pe, w


def _passes(plan, kv_c, k_pe, cache, table, scale, weight, impl):
    x = KV.KVInputs(weight, kv_c, k_pe, cache, table, kv_cache_scale=scale, impl=impl)
    if plan.fused:
        return [KV.fused_schedule_kv(plan, x)]
    return [KV.new_tokens_kv(x)] + [KV.chunk_kv(c, x) for c in plan.chunks]


def _within_one_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """|a - b| <= one bf16 step (2**-7 relative) of the larger, plus 2**-14 for sums that cancel to near zero."""
    a, b = a.float(), b.float()
    bound = torch.maximum(a.abs(), b.abs()) * 2.0**-7 + 2.0**-14
    bad = (a - b).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements differ by more than one bf16 rounding"


@pytest.mark.parametrize("layout", ["identity", "split"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("fuse", [True, False])
def test_fused_kernel_equals_gather_then_gemm(block_size, fp8, layout, fuse):
    d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = _case(
        block_size, fp8, seed=block_size + 3 * fp8, chunk_tokens=4096 if fuse else 1024
    )
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=d,
        workspace=ws,
        block_size=block_size,
        dtype=BF16,
        fuse_context=fuse,
        kv_cache_dtype="fp8" if fp8 else None,
    )
    assert plan.fused == fuse and (fuse or len(plan.chunks) >= 2)
    cache, s = C.check_kv_cache(cache, scale, plan.kv_cache_dtype)
    weight = prepare_kv_b_proj(w, d, layout=layout)
    for scale_arg in (s, float(s)) if fp8 else (None,):
        torch.cuda._sleep(int(1e8))  # the host runs ahead: the kernel must read only what was written before it
        a = _passes(plan, kv_c, k_pe, cache, table, scale_arg, weight, "separate")
        b = _passes(plan, kv_c, k_pe, cache, table, scale_arg, weight, "fused")
        torch.cuda.synchronize()
        assert len(a) == len(b) == (1 if fuse else 1 + len(plan.chunks))
        nope = d.qk_nope_head_dim
        for (ka, va), (kb, vb) in zip(a, b):
            assert ka.shape == kb.shape and va.shape == vb.shape
            assert not torch.isnan(ka).any() and not torch.isnan(kb).any()  # no unused slot was read
            assert torch.equal(ka[..., nope:], kb[..., nope:])  # k_pe exact (the identity GEMM turns -0.0 into +0.0)
            _within_one_rounding(ka[..., :nope], kb[..., :nope])
            _within_one_rounding(va, vb)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("fuse", [True, False])
def test_mla_prefill_with_fused_kernel_matches_separate_and_float64(monkeypatch, fp8, fuse):
    d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = _case(
        16, fp8, seed=11 + fp8, chunk_tokens=4096 if fuse else 1024
    )
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=d,
        workspace=ws,
        block_size=16,
        dtype=BF16,
        fuse_context=fuse,
        kv_cache_dtype="fp8" if fp8 else None,
    )
    weight = prepare_kv_b_proj(w, d)
    outs = {}
    for impl in ("separate", "fused"):
        monkeypatch.setenv("MLA_BRIDGE_KV", impl)
        torch.cuda._sleep(int(1e8))
        outs[impl] = mla_prefill(q, kv_c, k_pe, weight, cache, table, plan, return_lse=True, kv_cache_scale=scale)
    torch.cuda.synchronize()
    (oa, la), (ob, lb) = outs["separate"], outs["fused"]
    torch.testing.assert_close(ob.float(), oa.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lb, la, atol=1e-2, rtol=0)
    # float64 over the same (dequantized) latents
    lat = (cache.float() * float(scale) if fp8 else cache.float()).double()
    bs = 16
    wv = w.double().view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    q64 = q.double()
    row = 0
    for r, (ql, cl) in enumerate(zip(q_lens, c_lens)):
        if ql == 0:
            continue
        ids = table[r, : -(-cl // bs)].long()
        ctx = lat[ids].reshape(-1, d.latent_dim)[:cl]
        if fp8:
            ctx = ctx.to(BF16).double()  # the kernel rounds the dequantized product to bf16 once
        new = torch.cat([kv_c[row : row + ql], k_pe[row : row + ql]], dim=-1).double()
        keys = torch.cat([ctx, new])
        kn = torch.einsum("nr,hdr->nhd", keys[:, : d.kv_lora_rank], wv[:, : d.qk_nope_head_dim])
        vv = torch.einsum("nr,hdr->nhd", keys[:, : d.kv_lora_rank], wv[:, d.qk_nope_head_dim :])
        kk = torch.cat([kn, keys[:, None, d.kv_lora_rank :].expand(-1, d.num_heads, -1)], dim=-1)
        s = torch.einsum("qhd,khd->hqk", q64[row : row + ql], kk) * d.softmax_scale
        n = cl + ql
        mask = torch.arange(n)[None, :] <= (torch.arange(ql)[:, None] + cl)
        s = s.masked_fill(~mask.to(s.device), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
        torch.testing.assert_close(ob[row : row + ql].double(), ref, atol=2e-2, rtol=2e-2)
        row += ql


def _launch_repeatedly(plan, kv_c, k_pe, cache, table, scale, weight, launches: int) -> tuple[torch.Tensor, int]:
    """The fused schedule's one pass by the fused kernel ``launches`` times, each into a fresh buffer (allocated over
    freed polluted memory every 50 launches), the GPU kept busy at times: (first result, launches whose result
    differs from the first in any bit), compared on the device with one synchronization at the end."""
    from mla_bridge.kernels.up_project import up_project_triton

    d = weight.dims
    shape = (int(plan.main_kv_indptr[-1]), d.num_heads, d.head_dim_qk + d.v_head_dim)
    args = dict(
        kv_cache=cache,
        block_table=table,
        req_ids=plan.ctx_req_ids,
        positions=plan.ctx_positions,
        ctx_dst=plan.ctx_dst,
        kv_c=kv_c,
        k_pe=k_pe,
        new_dst=plan.new_dst,
        kv_cache_scale=scale,
    )
    first = torch.empty(shape, dtype=BF16, device=dev())
    up_project_triton(first, weight, **args)
    differing = torch.zeros((), dtype=torch.int64, device=dev())
    for i in range(launches):
        if i % 50 == 0:
            junk = torch.randn(int(3e7) + i * 4099, device=dev()) * 1e20
            del junk
            torch.cuda._sleep(int(2e7))
        out = torch.empty(shape, dtype=BF16, device=dev())
        up_project_triton(out, weight, **args)
        differing += (out != first).any()
    torch.cuda.synchronize()
    return first, int(differing)


def test_fp8_fused_kernel_gives_the_same_bits_in_every_launch():
    """The regression test of the FP8 pipeline race (:mod:`mla_bridge.kernels.up_project`): compiled with 3 stages,
    about 1 launch in 200 of this case (block size 1, fused schedule) was wrong on the H200, so 1000 launches catch
    it with probability above 99%. Every launch equals the first bitwise, and the first is within one bf16 rounding
    of the separate path."""
    d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = _case(1, True, seed=4, chunk_tokens=4096)
    plan = PrefillPlan.build(
        q_lens, c_lens, dims=d, workspace=ws, block_size=1, dtype=BF16, fuse_context=True, kv_cache_dtype="fp8"
    )
    cache, s = C.check_kv_cache(cache, scale, plan.kv_cache_dtype)
    weight = prepare_kv_b_proj(w, d, layout="split")
    first, differing = _launch_repeatedly(plan, kv_c, k_pe, cache, table, s, weight, 1000)
    assert differing == 0, f"{differing} of 1000 launches differ from the first"
    ((k, v),) = _passes(plan, kv_c, k_pe, cache, table, s, weight, "separate")
    nope, qk = d.qk_nope_head_dim, d.head_dim_qk
    assert torch.equal(first[..., nope:qk], k[..., nope:])
    _within_one_rounding(first[..., :nope], k[..., :nope])
    _within_one_rounding(first[..., qk:], v)


@pytest.mark.parametrize("heads", [16, 20, 128])
def test_broadcast_kernel_equals_torch_copy(heads):
    """The split layout's k_pe broadcast (Triton) writes exactly what torch's copy_ of the expanded view writes, and
    nothing outside the k_pe columns; the GPU kept busy so the host runs ahead."""
    from mla_bridge.kernels.broadcast import broadcast_heads_triton

    g = torch.Generator(device=dev()).manual_seed(heads)
    n = 4099
    latent = torch.randn(n, 576, device=dev(), generator=g).to(BF16)
    buf = torch.randn(n, heads, 320, device=dev(), generator=g).to(BF16)
    want = buf.clone()
    torch.cuda._sleep(int(1e8))
    broadcast_heads_triton(buf[:, :, 256:], latent[:, 512:])
    want[:, :, 256:].copy_(latent[:, 512:].unsqueeze(1).expand(n, heads, 64))
    torch.cuda.synchronize()
    assert torch.equal(buf, want)


def test_split_layout_row_blocks_equal_the_identity_layout(monkeypatch):
    """The split layout's GEMM over row blocks (SPLIT_GEMM_ROWS made small here: 3500 rows in 4 blocks) gives every
    row: k_pe exactly, k_nope and v within one bf16 rounding of the identity layout's one GEMM."""
    import mla_bridge.weights as W

    d = MLADims.deepseek_v2_lite()
    g = torch.Generator(device=dev()).manual_seed(5)
    w = (torch.randn(*d.kv_b_proj_shape, device=dev(), generator=g) * d.kv_lora_rank**-0.5).to(BF16)
    latent = torch.randn(3500, 600, device=dev(), generator=g).to(BF16)[:, 7 : 7 + d.latent_dim]  # strided rows
    monkeypatch.setattr(W, "SPLIT_GEMM_ROWS", 1000)
    torch.cuda._sleep(int(1e8))
    k, v = prepare_kv_b_proj(w, d, layout="split").up_project(latent)
    ki, vi = prepare_kv_b_proj(w, d, layout="identity").up_project(latent)
    torch.cuda.synchronize()
    nope = d.qk_nope_head_dim
    assert torch.equal(k[..., nope:], latent[:, d.kv_lora_rank :].unsqueeze(1).expand(-1, d.num_heads, -1))
    _within_one_rounding(k[..., :nope], ki[..., :nope])
    _within_one_rounding(v, vi)


@pytest.mark.parametrize("fuse", [True, False])
def test_auto_sends_large_gathered_passes_to_cublas(monkeypatch, fuse):
    """kv_impl="auto" with the default (split) weight: a gathered pass of at least SEPARATE_FROM_ROWS rows takes the
    separate path, a smaller one the fused kernel; mla_prefill's result matches the fused kernel everywhere."""
    d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = _case(
        16,
        False,
        seed=21,
        q_lens=(200, 57),
        c_lens=(KV.SEPARATE_FROM_ROWS + 700, 300),
        chunk_tokens=2 * KV.SEPARATE_FROM_ROWS if fuse else KV.SEPARATE_FROM_ROWS,
    )
    plan = PrefillPlan.build(q_lens, c_lens, dims=d, workspace=ws, block_size=16, dtype=BF16, fuse_context=fuse)
    weight = prepare_kv_b_proj(w, d)
    assert weight.layout == "split"
    rows = [int(plan.main_kv_indptr[-1])] if plan.fused else [c.num_tokens for c in plan.chunks]
    chosen = [KV.pass_impl("auto", True, False, r, weight.layout) for r in rows]
    assert "separate" in chosen and (fuse or "fused" in chosen), (rows, chosen)
    outs = {}
    for impl in ("auto", "fused"):
        torch.cuda._sleep(int(1e8))
        outs[impl] = mla_prefill(q, kv_c, k_pe, weight, cache, table, plan, return_lse=True, kv_impl=impl)
    torch.cuda.synchronize()
    torch.testing.assert_close(outs["auto"][0].float(), outs["fused"][0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["auto"][1], outs["fused"][1], atol=1e-2, rtol=0)


def test_strided_k_pe_equals_contiguous_on_the_split_path():
    """A caller's k_pe with a last stride other than 1 (a view), on the chunked schedule's main pass (split layout:
    the broadcast kernel reads the new tokens' k_pe in place): bitwise the result of a contiguous k_pe. The k_pe
    broadcast once assumed a unit last stride and read the wrong columns."""
    d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = _case(16, False, seed=31, chunk_tokens=1024)
    plan = PrefillPlan.build(q_lens, c_lens, dims=d, workspace=ws, block_size=16, dtype=BF16, fuse_context=False)
    weight = prepare_kv_b_proj(w, d)
    wide = torch.zeros(k_pe.shape[0], 2 * d.qk_rope_head_dim, dtype=BF16, device=dev())
    wide[:, ::2] = k_pe
    strided = wide[:, ::2]
    assert strided.stride(-1) == 2 and torch.equal(strided, k_pe)
    torch.cuda._sleep(int(1e8))
    a = mla_prefill(q, kv_c, strided, weight, cache, table, plan, return_lse=True)
    b = mla_prefill(q, kv_c, k_pe, weight, cache, table, plan, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("fuse", [True, False])
def test_raw_weight_is_read_in_place_with_the_prepared_bits(monkeypatch, fp8, fuse):
    """A raw kv_b_proj weight: the fused kernel reads its rows where they lie (no rearranged copy) and gives bitwise
    what it gives from the split-prepared weight, for every pass; mla_prefill under "auto" (a large gathered pass on
    the separate path, which rearranges the raw weight once per call) and under "fused" returns the prepared
    weight's bits."""
    import mla_bridge.weights as W

    d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = _case(
        16, fp8, seed=41 + fp8, q_lens=(200, 57, 3), c_lens=(9000, 300, 0), chunk_tokens=16384 if fuse else 8192
    )
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=d,
        workspace=ws,
        block_size=16,
        dtype=BF16,
        fuse_context=fuse,
        kv_cache_dtype="fp8" if fp8 else None,
    )
    cache, s = C.check_kv_cache(cache, scale, plan.kv_cache_dtype)
    raw, split = W.as_prepared(w, d, BF16, dev()), prepare_kv_b_proj(w, d)
    assert raw.layout == W.CHECKPOINT_LAYOUT and raw.weight.data_ptr() == w.data_ptr()
    torch.cuda._sleep(int(1e8))
    a = _passes(plan, kv_c, k_pe, cache, table, s, raw, "fused")
    b = _passes(plan, kv_c, k_pe, cache, table, s, split, "fused")
    assert raw._gemm is None  # no fused pass rearranged it
    outs = {}
    for impl in ("auto", "fused"):
        torch.cuda._sleep(int(1e8))
        outs[impl] = [
            mla_prefill(q, kv_c, k_pe, weight, cache, table, plan, return_lse=True, kv_cache_scale=scale, kv_impl=impl)
            for weight in (w, split)
        ]
    torch.cuda.synchronize()
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    for impl, ((oa, la), (ob, lb)) in outs.items():
        assert torch.equal(oa, ob) and torch.equal(la, lb), impl


def test_held_raw_weight_view_sees_an_in_place_update_under_auto():
    """A checkpoint-layout PreparedKVBProj (``mla_bridge.weights.as_prepared`` of a raw weight) held across calls, the
    weight updated in place between them: under "auto" the chunked schedule runs fused passes (the new tokens, the last
    chunk) and a separate one (the chunk of SEPARATE_FROM_ROWS rows); every one of them reads the updated weight, so the
    second call returns the bits of a call with the raw tensor. (Before: the separate pass reused the split copy of the
    first call, the fused ones read the new weight.)"""
    import mla_bridge.weights as W

    d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = _case(
        16,
        False,
        seed=43,
        q_lens=(200, 57, 3),
        c_lens=(KV.SEPARATE_FROM_ROWS + 800, 300, 0),
        chunk_tokens=KV.SEPARATE_FROM_ROWS,
    )
    plan = PrefillPlan.build(q_lens, c_lens, dims=d, workspace=ws, block_size=16, dtype=BF16, fuse_context=False)
    rows = [KV.pass_impl("auto", True, False, c.req_ids.shape[0], "split") for c in plan.chunks]
    assert "separate" in rows and "fused" in rows, rows
    held = W.as_prepared(w, d, BF16, dev())
    torch.cuda._sleep(int(1e8))
    first = mla_prefill(q, kv_c, k_pe, held, cache, table, plan, kv_impl="auto")
    w.mul_(-0.5)  # in place, on the stream, after the first call
    second = mla_prefill(q, kv_c, k_pe, held, cache, table, plan, kv_impl="auto")
    want = mla_prefill(q, kv_c, k_pe, w, cache, table, plan, kv_impl="auto")
    torch.cuda.synchronize()
    assert not torch.equal(first, second)
    assert torch.equal(second, want)
