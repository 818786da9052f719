"""GPU tests of the Triton gather (mla_bridge.kernels.gather) and of mla_prefill with an FP8 e4m3 cache.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run on the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_gather.py -q -m gpu
* Triton gather == torch gather, bitwise (int16 views of bf16), for bf16 and FP8 caches, gather-only (chunked) and
  fused, block sizes 1/16/64, shuffled block tables, NaN in every unused cache slot, strided caches, scale as a
  float and as a device tensor; the GPU is kept busy (``torch.cuda._sleep``) so the host runs ahead of it.
* the gather that also writes k_pe into every head of the split layout's key buffer (``k_pe_out``) == gather then
  broadcast, bitwise.
* mla_prefill with an FP8 cache at DeepSeek-V2-Lite and V3 dims against float64 over the dequantized cache, within
  the bf16 tolerances of tests/gpu/test_gpu_core.py, fused and chunked; equal to the same call with the torch gather.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill  # noqa: E402
from mla_bridge import cache as C  # noqa: E402

BF16 = torch.bfloat16
OUT_TOL, PREFILL_RTOL, LSE_TOL = 2e-2, 2e-2, 1e-2
SLEEP = int(2e8)  # GPU cycles (about 0.1 s on the H200): longer than the host steps of a test


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
        b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32),
    )


def _case(block_size: int, fp8: bool, strided: bool, seed: int):
    """A shuffled paged cache [nb, bs, 576] with NaN in every block and slot no request reads; 3 requests."""
    g = torch.Generator().manual_seed(seed)
    lat = 576
    lens = [3 * block_size + 1, 5, 2 * block_size]
    blocks = [-(-n // block_size) for n in lens]
    nb = sum(blocks) + 4
    full = torch.full((nb, block_size, 2 * lat if strided else lat), float("nan"))
    order = torch.randperm(nb, generator=g).tolist()
    table = torch.full((3, max(blocks) + 1), -1, dtype=torch.int32)
    k = 0
    for r, n in enumerate(lens):
        for b in range(blocks[r]):
            table[r, b] = order[k]
            m = min(block_size, n - b * block_size)
            full[order[k], :m, :lat] = torch.randn(m, lat, generator=g) * 2
            k += 1
    latent = full[..., :lat]
    if fp8:
        q, scale = C.quantize_latent_cache(full.to(dev()))
        cache = q[..., :lat]
    else:
        cache, scale = latent.to(BF16).to(dev()), None
        if strided:
            cache = full.to(BF16).to(dev())[..., :lat]
    req = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in enumerate(lens)]).to(dev())
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev())
    return cache, scale, table.to(dev()), req, pos


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_triton_gather_equals_torch_gather_bitwise(block_size, fp8, strided):
    cache, scale, table, req, pos = _case(block_size, fp8, strided, seed=block_size + 7 * fp8)
    assert cache.is_contiguous() == (not strided)
    scales = (C._scale_value(scale, cache.device), float(scale)) if fp8 else (None,)
    for s in scales:
        for out_dtype in (BF16, torch.float16, torch.float32) if fp8 else (BF16,):
            torch.cuda._sleep(int(1e8))  # the host runs ahead: the kernels must not read anything not yet written
            a = C.gather_latent(cache, table, req, pos, dtype=out_dtype, kv_cache_scale=s, impl="torch")
            b = C.gather_latent(cache, table, req, pos, dtype=out_dtype, kv_cache_scale=s, impl="triton")
            torch.cuda.synchronize()
            assert not torch.isnan(a).any()  # no unused slot was read
            assert _bits_equal(a, b), (block_size, fp8, strided, s, out_dtype)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_triton_fused_latent_equals_torch_bitwise(block_size, fp8):
    """The fused schedule's key buffer of a real plan (context rows + new tokens), Triton vs torch."""
    d = MLADims.deepseek_v2_lite()
    cache, scale, table, req, pos = _case(block_size, fp8, False, seed=block_size + 1)
    c_lens = [3 * block_size + 1, 5, 2 * block_size]
    q_lens = [4, 0, 9]
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=d,
        workspace=Workspace(dev()),
        block_size=block_size,
        dtype=BF16,
        kv_cache_dtype="fp8" if fp8 else None,
    )
    assert plan.fused
    g = torch.Generator().manual_seed(3)
    t = sum(q_lens)
    kv_c = torch.randn(t, 512, generator=g).to(BF16).to(dev())
    k_pe = torch.randn(t, 1, 64, generator=g).to(BF16).to(dev())[:, 0]
    s = C._scale_value(scale, cache.device) if fp8 else None
    torch.cuda._sleep(int(1e8))
    a = C.fused_latent(plan, kv_c, k_pe, cache, table, s, impl="torch")
    b = C.fused_latent(plan, kv_c, k_pe, cache, table, s, impl="triton")
    torch.cuda.synchronize()
    assert not torch.isnan(a).any()
    assert _bits_equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
def test_gather_with_k_pe_out_equals_gather_then_broadcast_bitwise(block_size, fp8, fused):
    """The gather that also writes k_pe into every head of the split layout's key buffer (``k_pe_out``) == the
    torch gather followed by the broadcast: the kv_c columns and the k_pe heads bitwise, nothing else of the buffer
    written (16 heads, a [N, 16, 320] buffer's columns 256:320, as kv.chunk_kv hands it)."""
    d = MLADims.deepseek_v2_lite()
    cache, scale, table, req, pos = _case(block_size, fp8, False, seed=block_size + 5)
    s = C._scale_value(scale, cache.device) if fp8 else None
    if fused:
        c_lens, q_lens = [3 * block_size + 1, 5, 2 * block_size], [4, 0, 9]
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=d,
            workspace=Workspace(dev()),
            block_size=block_size,
            dtype=BF16,
            kv_cache_dtype="fp8" if fp8 else None,
        )
        g = torch.Generator().manual_seed(4)
        kv_c = torch.randn(sum(q_lens), 512, generator=g).to(BF16).to(dev())
        k_pe = torch.randn(sum(q_lens), 64, generator=g).to(BF16).to(dev())
        rows = int(plan.main_kv_indptr[-1])
        run = lambda impl, out: C.fused_latent(plan, kv_c, k_pe, cache, table, s, impl=impl, k_pe_out=out)  # noqa
        full = C.fused_latent(plan, kv_c, k_pe, cache, table, s, impl="torch")
    else:
        rows = req.shape[0]
        run = lambda impl, out: C.gather_latent(  # noqa: E731
            cache,
            table,
            req,
            pos,
            dtype=BF16,
            kv_cache_scale=s,  # noqa
            impl=impl,
            k_pe_out=out,
        )
        full = C.gather_latent(cache, table, req, pos, dtype=BF16, kv_cache_scale=s, impl="torch")
    got = {}
    for impl in ("torch", "triton"):
        buf = torch.full((rows, 16, 320), 3.0, dtype=BF16, device=dev())
        torch.cuda._sleep(int(1e8))
        got[impl] = (run(impl, buf[:, :, 256:]), buf)
    torch.cuda.synchronize()
    (la, ba), (lb, bb) = got["torch"], got["triton"]
    assert lb.shape == (rows, 512) and _bits_equal(la.contiguous(), lb) and _bits_equal(lb, full[:, :512])
    assert _bits_equal(ba, bb) and _bits_equal(bb[:, :, 256:], full[:, None, 512:].expand(rows, 16, 64).contiguous())
    assert (bb[:, :, :256] == 3).all()


def test_gather_impl_on_cuda_is_triton():
    assert C.gather_impl(dev()) == "triton"


def _v_batch(ref, dims, q_lens, c_lens, block_size, seed):
    batch = ref.make_mla_batch(dims, q_lens, c_lens, block_size, seed=seed, dtype=BF16, device=dev())
    batch.cache, batch.scale = C.quantize_latent_cache(batch.cache)
    deq = copy.copy(batch)
    deq.cache = batch.cache.double() * float(batch.scale)
    return batch, deq


@pytest.mark.parametrize("fuse,budget", [(True, 100_000), (False, 100_000), (False, 48)])
@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3"])
def test_mla_prefill_fp8_cache_vs_float64(ref, preset, fuse, budget, monkeypatch):
    dims = MLADims.preset(preset)
    q_lens, c_lens = [5, 0, 17, 3], [40, 9, 100, 0]
    batch, deq = _v_batch(ref, dims, q_lens, c_lens, 16, seed=21)
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=budget),
        block_size=16,
        dtype=BF16,
        fuse_context=fuse,
        kv_cache_dtype="fp8",
    )
    torch.cuda._sleep(int(1e8))
    out, lse = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        return_lse=True,
        kv_cache_scale=batch.scale,
    )
    exp_out, exp_lse = ref.mla_reference(deq)
    ref.assert_out_close(out, exp_out, atol=OUT_TOL, rtol=PREFILL_RTOL)
    ref.assert_lse_close(lse, exp_lse, atol=LSE_TOL, rtol=PREFILL_RTOL)
    monkeypatch.setenv("MLA_BRIDGE_GATHER", "torch")
    out_t = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        kv_cache_scale=float(batch.scale),
    )
    assert _bits_equal(out, out_t)  # same kernels after a bitwise-equal gather


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
def test_chunk_gathers_read_the_pass_kv_indptr_on_another_stream(block_size, fp8, dtype):
    """A chunked plan on CUDA keeps no per-token index tensor: each chunk's rows are its pass's kv_indptr on the
    device, the copy FlashInfer's plan() made (bf16), or for the torch backend (float32) the plan's own copy, covered
    by its own event. Built while the GPU sleeps and read on a side stream after order_on_current_stream, the Triton
    gather and the fused up-projection from those rows equal, bitwise, the torch gather and the same kernel from the
    CPU plan's per-token indices (a request split across chunks, a request without new tokens, 3-4 chunks)."""
    from mla_bridge import prepare_kv_b_proj
    from mla_bridge.kernels.up_project import up_project_triton

    d = MLADims.deepseek_v2_lite()
    cache, scale, table, _, _ = _case(block_size, fp8, False, seed=block_size + 11 * fp8)
    if not fp8:
        cache = cache.to(dtype)
    c_lens, q_lens = [3 * block_size + 1, 5, 2 * block_size], [4, 0, 9]
    budget = block_size + 3
    kw = dict(block_size=block_size, dtype=dtype, fuse_context=False, kv_cache_dtype="fp8" if fp8 else None)
    cpu = PrefillPlan.build(q_lens, c_lens, dims=d, workspace=Workspace("cpu", chunk_tokens=budget), **kw)
    w = prepare_kv_b_proj(
        (torch.randn(*d.kv_b_proj_shape, generator=torch.Generator().manual_seed(5)) * 0.05).to(dtype).to(dev()),
        d,
        layout="split",
    )
    s = C._scale_value(scale, cache.device) if fp8 else None
    side = torch.cuda.Stream()
    for attempt in range(2):  # the first compiles every kernel; the second runs them all while the GPU sleeps
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP)
        plan = PrefillPlan.build(q_lens, c_lens, dims=d, workspace=Workspace(dev(), chunk_tokens=budget), **kw)
        passes = [(c, h) for c, h in zip(plan.chunks, cpu.chunks) if c.plan is not None]
        assert len(plan.chunks) == len(cpu.chunks) >= 3 and len(passes) >= 2
        assert any(c.first_start > 0 for c, _ in passes)
        for c, _ in passes:
            assert c.rows.indices is None
            if dtype == BF16:
                assert c.rows.kv_indptr is c.plan.flashinfer_wrapper._kv_indptr_buf
        assert (plan._ready is None) == (dtype == BF16)
        got = []
        with torch.cuda.stream(side):
            plan.order_on_current_stream()
            for c, _ in passes:
                buf = torch.empty(c.num_tokens, d.num_heads, d.head_dim_qk + d.v_head_dim, dtype=dtype, device=dev())
                up_project_triton(buf, w, kv_cache=cache, block_table=table, rows=c.rows, kv_cache_scale=s)
                got.append((C.gather_rows(cache, table, c.rows, dtype=dtype, kv_cache_scale=s, impl="triton"), buf))
        torch.cuda.synchronize()
        for (c, host), (lat, buf) in zip(passes, got):
            assert torch.equal(c.rows.kv_indptr.cpu(), c.plan.kv_indptr)
            req, pos = (t.to(dev()) for t in host.token_indices())
            want = C.gather_latent(cache, table, req, pos, dtype=dtype, kv_cache_scale=s, impl="torch")
            assert not torch.isnan(want).any() and _bits_equal(lat, want), (attempt, c.req_start, c.first_start)
            ref_buf = torch.empty_like(buf)
            up_project_triton(
                ref_buf, w, kv_cache=cache, block_table=table, req_ids=req, positions=pos, kv_cache_scale=s
            )
            assert _bits_equal(buf, ref_buf), (attempt, c.req_start)
            # the torch path of a CUDA chunk: its indices made from the rows on the device
            r, p = c.token_indices()
            assert r.is_cuda and torch.equal(r, req) and torch.equal(p, pos)
