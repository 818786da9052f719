"""The Triton kernel of the sparse attention (mla_bridge.kernels.sparse_attention) under Triton's interpreter, on CPU
tensors at tiny sizes: where Triton is installed (a development venv; CI has none, and there the test skips), each
case runs mla_prefill with ``MLA_BRIDGE_SPARSE=triton`` in a subprocess with ``TRITON_INTERPRET=1`` (the
``triton_interpreted`` fixture) and compares it with the float64 sparse reference of tests/helpers/sparse_cases.py and with the
torch path. On a CUDA machine the compiled kernel is tested by tests/gpu/test_gpu_sparse.py instead.

Tolerances: float32 plans 3e-5 (out and lse) against float64 (the kernel's dots are ieee float32); bf16 / fp16 plans
within their rounding (out 2e-2 absolute and relative, lse 1e-2: the kernel rounds the latent query and its latent
output to the plan's dtype, the torch path neither).

Under the interpreter bf16 dots are computed from float32 copies of the tiles (Triton 3.9's interpreter multiplies
bf16 tiles wrongly), which are the same exact products; FP8 caches (dequantized once into the latents, or per tile
in the kernel) and fp16 are interpreted as compiled. Not checked here: speed, register or shared-memory limits, the direct launch path.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import reference as R
from tests.helpers.sparse_cases import ATOL, CONTEXT_LENS, QUERY_LENS, plan_for, random_indices, sparse_reference

GPU_TESTS = "tests/gpu/test_gpu_sparse.py"


def _run(batch, plan, indices, cache=None, scale=None, impl="triton", return_lse=True):
    from mla_bridge.prefill import as_prepared
    from mla_bridge.sparse import sparse_prefill

    cache = batch.cache if cache is None else cache
    return sparse_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        as_prepared(batch.w, plan.dims, plan.dtype, plan.device),
        cache,
        batch.block_table,
        plan,
        indices,
        return_lse=return_lse,
        kv_cache_scale=scale,
        impl=impl,
    )


def _close(got, want, atol, rtol=0.0):
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, equal_nan=False)


def _check(out, lse, exp_out, exp_lse, atol, rtol=0.0, lse_atol=None):
    _close(out, exp_out, atol, rtol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(exp_lse))
    finite = torch.isfinite(exp_lse)
    _close(lse[finite], exp_lse[finite], atol if lse_atol is None else lse_atol)


def interpreted_cases() -> str:
    """Each case: the kernel (MLA_BRIDGE_SPARSE=triton through mla_prefill, or sparse_prefill with impl="triton")
    against float64 and the torch path. Returns "ok N"."""
    from mla_bridge import MLADims, mla_prefill, quantize_latent_cache
    from mla_bridge import sparse
    from mla_bridge.cache import dequantize_latent

    n = 0
    tiny = MLADims(**R.TINY)
    # float32: block sizes 1/16/64, K 4/16 and K larger than every sequence, -1 anywhere and rows without keys,
    # context in the fused and the chunked schedules
    for block_size, k, fuse in ((1, 4, True), (16, 16, False), (64, 200, True), (16, 12, True)):
        batch = R.make_mla_batch(tiny, QUERY_LENS, CONTEXT_LENS, block_size, seed=block_size + k)
        plan = plan_for(tiny, QUERY_LENS, CONTEXT_LENS, block_size, k, chunk_tokens=23, fuse_context=fuse)
        indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=k, fill=0.6, allow_empty=True)
        indices[2] = -1
        out, lse = mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            batch.cache,
            batch.block_table,
            plan,
            topk_indices=indices,
            return_lse=True,
        )
        exp_out, exp_lse = sparse_reference(batch, indices)
        _check(out, lse, exp_out, exp_lse, ATOL)
        assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()
        t_out, t_lse = _run(batch, plan, indices, impl="torch")
        _check(out, lse, t_out, t_lse, ATOL)
        n += 1

    # each on both routes: the context gathered once into the fused key latents (the default budget) and read
    # through block_table per tile (latents above one chunk's k / v memory: chunk_tokens=23)
    for chunk_tokens in (None, 23):
        # the padding last (an indexer's early rows: the loop stops after the last pick), K beyond one scan step (256),
        # a pick past the scan step's end, repeated picks, strided indices
        ql, cl = [3, 2], [300, 1]
        batch = R.make_mla_batch(tiny, ql, cl, 16, seed=21)
        k = 300
        plan = plan_for(tiny, ql, cl, 16, k, chunk_tokens=chunk_tokens)
        assert (plan.sparse_latent_meta is not None) == (chunk_tokens is None)
        wide = torch.full((5, 2 * k), -1, dtype=torch.int32)
        indices = wide[:, ::2]
        indices[0, :40] = torch.arange(40)
        indices[1, 280] = 299  # the only pick, beyond the first 256 indices
        indices[1, 10] = 299  # listed twice: attended twice
        indices[2] = torch.randperm(303, generator=torch.Generator().manual_seed(2))[:k].to(torch.int32)  # own: 302
        indices[3, :2] = torch.tensor([0, 1])
        indices[4, k - 1] = 2
        assert not indices.is_contiguous()
        out, lse = _run(batch, plan, indices)
        exp_out, exp_lse = sparse_reference(batch, indices)
        _check(out, lse, exp_out, exp_lse, ATOL)
        n += 1

        # a pick past its request's sequence (not checked on CUDA) is skipped, never read
        bad = indices.clone()
        bad[3, 5] = 40  # request 1's sequence has 3 positions
        bad[0, 100] = 10**6
        out_bad, lse_bad = _run(batch, plan, bad)
        _check(out_bad, lse_bad, exp_out, exp_lse, ATOL)
        n += 1

        # kv_c one element off the cache's 16-element grid: context and new rows in two loads per tile (as for FP8)
        shifted = torch.empty(batch.kv_c.numel() + 1)[1:].view_as(batch.kv_c)
        shifted.copy_(batch.kv_c)
        moved = R.MLABatch(**{**vars(batch), "kv_c": shifted})
        out_shifted, lse_shifted = _run(moved, plan, indices)
        _check(out_shifted, lse_shifted, exp_out, exp_lse, ATOL)
        n += 1

        # launches in chunks of tokens, no LSE asked for
        small = sparse.SPARSE_KERNEL_CHUNK_ROWS
        sparse.SPARSE_KERNEL_CHUNK_ROWS = 2 * tiny.num_heads  # two tokens per launch
        try:
            out_chunked = _run(batch, plan, indices, return_lse=False)
        finally:
            sparse.SPARSE_KERNEL_CHUNK_ROWS = small
        _close(out_chunked, out, 1e-6)
        n += 1

    # other dims: kv_lora_rank not a power of two, no RoPE part, heads over several head blocks
    for dims in (
        MLADims(num_heads=3, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8),
        MLADims(num_heads=40, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=24, v_head_dim=8),
    ):
        batch = R.make_mla_batch(dims, QUERY_LENS, CONTEXT_LENS, 16, seed=dims.num_heads)
        plan = plan_for(dims, QUERY_LENS, CONTEXT_LENS, 16, 10)
        indices = random_indices(QUERY_LENS, CONTEXT_LENS, 10, seed=dims.num_heads, fill=0.7)
        out, lse = _run(batch, plan, indices)
        _check(out, lse, *sparse_reference(batch, indices), ATOL)
        n += 1

    # FP8 caches (a tensor and a float scale), float32 and bf16 plans: the context dequantized once into the fused
    # key latents, or (latents larger than one chunk's k / v memory: chunk_tokens=1) converted by the kernel per tile
    for dtype, chunk_tokens in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, 1), (torch.bfloat16, 1)):
        batch = R.make_mla_batch(tiny, QUERY_LENS, CONTEXT_LENS, 16, seed=4)
        fp8, scale = quantize_latent_cache(batch.cache)
        for name in ("q", "kv_c", "k_pe", "w"):
            setattr(batch, name, getattr(batch, name).to(dtype))
        plan = plan_for(
            tiny, QUERY_LENS, CONTEXT_LENS, 16, 20, kv_cache_dtype="fp8", dtype=dtype, chunk_tokens=chunk_tokens
        )
        assert (plan.sparse_latent_meta is not None) == (chunk_tokens is None)
        indices = random_indices(QUERY_LENS, CONTEXT_LENS, 20, seed=1, fill=0.7)
        exp = sparse_reference(batch, indices, cache=dequantize_latent(fp8, scale, torch.float64))
        for s in (scale, float(scale)):
            out, lse = _run(batch, plan, indices, cache=fp8, scale=s)
            if dtype == torch.float32:
                _check(out, lse, *exp, ATOL)
            else:
                _check(out, lse, *exp, 2e-2, 2e-2, lse_atol=1e-2)
            t_out, t_lse = _run(batch, plan, indices, cache=fp8, scale=s, impl="torch")
            _check(out, lse, t_out, t_lse, 2e-2 if dtype != torch.float32 else ATOL, 2e-2, lse_atol=1e-2)
            n += 1

    # bf16 and fp16 plans (bf16 on both routes)
    for dtype, chunk_tokens in ((torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, 3)):
        batch = R.make_mla_batch(tiny, QUERY_LENS, CONTEXT_LENS, 16, seed=6, dtype=dtype)
        plan = plan_for(tiny, QUERY_LENS, CONTEXT_LENS, 16, 16, dtype=dtype, chunk_tokens=chunk_tokens)
        assert (plan.sparse_latent_meta is not None) == (chunk_tokens is None)
        indices = random_indices(QUERY_LENS, CONTEXT_LENS, 16, seed=6, fill=0.8)
        out, lse = _run(batch, plan, indices)
        assert out.dtype == dtype and lse.dtype == torch.float32
        _check(out, lse, *sparse_reference(batch, indices), 2e-2, 2e-2, lse_atol=1e-2)
        _check(out, lse, *_run(batch, plan, indices, impl="torch"), 2e-2, 2e-2, lse_atol=1e-2)
        n += 1
    return f"ok {n}"


def test_sparse_kernel_interpreted(triton_interpreted):
    """Where Triton is installed: :func:`interpreted_cases` under the interpreter (``MLA_BRIDGE_SPARSE=triton``)."""
    out = triton_interpreted("tests.test_sparse_kernel:interpreted_cases", GPU_TESTS, MLA_BRIDGE_SPARSE="triton")
    assert out.strip() == "ok 25", out


def test_default_tiles_are_64_rows_for_every_cache():
    """At kv_lora_rank 512 a tile of 64 selected rows is faster than 32 (docs/results.md). Each tile is read in one load (an FP8 cache's picks partitioned first, context then new rows), so 64 rows fit an
    SM90 block's shared memory in two stages (221440 bytes of 232448, compiled for sm_90a) for bf16 and FP8 caches
    alike; two loads per tile needed 258816."""
    pytest.importorskip("triton")
    from mla_bridge.kernels.sparse_attention import default_config

    assert default_config(128, 512, 2048, torch.bfloat16) == (64, 64, 8, 2)
    assert default_config(20, 256, 2048, torch.bfloat16) == (32, 64, 4, 2)
    assert default_config(128, 512, 16, torch.bfloat16).block_k == 16  # never wider than the picks
    assert default_config(128, 512, 2048, torch.float32) == (16, 16, 4, 1)
