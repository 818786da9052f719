"""Sparse attention prefill (DeepSeek Sparse Attention): mla_prefill(..., topk_indices=) over a plan built with
index_topk, against a float64 sparse attention written here from the indices in the UNABSORBED form (k = [k_nope
from the kv_b_proj up-projection, k_pe], v up-projected, a softmax over the selected keys only), which also checks
the library's absorption (W_UK into the query, W_UV after the attention)."""

from __future__ import annotations

import pytest
import torch

from mla_bridge import MLADims, PlanCache, PrefillPlan, Workspace, mla_prefill, prepare_kv_b_proj, quantize_latent_cache
from mla_bridge import sparse
from mla_bridge.cache import dequantize_latent

from tests.helpers.sparse_cases import (
    ATOL,
    CONTEXT_LENS,
    QUERY_LENS,
    own_positions,
    plan_for,
    random_indices,
    sparse_reference,
)


def run(batch, plan, indices, **kw):
    return mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        topk_indices=indices,
        return_lse=True,
        **kw,
    )


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("k", [4, 16, 200])  # 200: more than any request's sequence (75 positions)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_sparse_equals_float64_sparse_attention(ref, tiny_dims, block_size, k, fuse):
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, block_size, seed=block_size + k)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, block_size, k, chunk_tokens=23, fuse_context=fuse)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=k)
    out, lse = run(batch, plan, indices)
    exp_out, exp_lse = sparse_reference(batch, indices)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_padding_fewer_keys_than_k_and_rows_without_keys(ref, tiny_dims):
    """-1 anywhere in a row, rows with fewer picks than K, and rows with none (out 0, lse -inf: the dense passes'
    convention for a row without keys)."""
    k = 12
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=3)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=5, fill=0.5, allow_empty=True)
    indices[2] = -1  # one row without keys for certain
    out, lse = run(batch, plan, indices)
    exp_out, exp_lse = sparse_reference(batch, indices)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()


def test_repeated_position_counts_each_time(ref, tiny_dims):
    """A position listed twice is attended twice (as FlashMLA's sparse kernel): the reference does the same."""
    batch = ref.make_mla_batch(tiny_dims, [2], [6], 4, seed=8)
    plan = plan_for(tiny_dims, [2], [6], 4, 3)
    indices = torch.tensor([[5, 5, 0], [6, 1, 1]], dtype=torch.int32)
    out, lse = run(batch, plan, indices)
    exp_out, exp_lse = sparse_reference(batch, indices)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


@pytest.mark.parametrize("fuse", [True, False])
def test_all_keys_equals_dense_prefill(ref, tiny_dims, fuse):
    """Each token selecting its whole causal sequence (K at least the longest sequence) is dense prefill: the same
    out and lse as mla_prefill over a dense plan of the same lengths."""
    k = max(q + c for q, c in zip(QUERY_LENS, CONTEXT_LENS))
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=11)
    sparse_plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k, chunk_tokens=23, fuse_context=fuse)
    dense_plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, None, chunk_tokens=23, fuse_context=fuse)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=2)  # every causal position, shuffled
    out, lse = run(batch, sparse_plan, indices)
    dense_out, dense_lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, dense_plan, return_lse=True
    )
    torch.testing.assert_close(out, dense_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse, dense_lse, atol=2e-5, rtol=0)
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_fp8_cache(ref, tiny_dims):
    """An FP8 cache: the selected context rows are dequantized with the scale as the dense gather does (the
    reference reads the same dequantized values); with every key selected, the dense FP8 path's result."""
    k = 20
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=4)
    fp8, scale = quantize_latent_cache(batch.cache)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k, kv_cache_dtype="fp8")
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=1, fill=0.7)
    for stored in (fp8, fp8.view(torch.uint8)):
        out, lse = mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            stored,
            batch.block_table,
            plan,
            topk_indices=indices,
            return_lse=True,
            kv_cache_scale=scale,
        )
        exp_out, exp_lse = sparse_reference(batch, indices, cache=dequantize_latent(fp8, scale, torch.float32))
        ref.assert_out_close(out, exp_out, atol=ATOL)
        ref.assert_lse_close(lse, exp_lse, atol=ATOL)
    full = max(q + c for q, c in zip(QUERY_LENS, CONTEXT_LENS))
    all_plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, full, kv_cache_dtype="fp8")
    dense_plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, None, kv_cache_dtype="fp8")
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, fp8, batch.block_table)
    out = mla_prefill(
        *args, all_plan, topk_indices=random_indices(QUERY_LENS, CONTEXT_LENS, full), kv_cache_scale=scale
    )
    torch.testing.assert_close(out, mla_prefill(*args, dense_plan, kv_cache_scale=scale), atol=2e-5, rtol=0)


def test_bf16(ref, tiny_dims):
    """bf16 inputs: within bf16 rounding of the float64 reference (the latent query and the attention in float32,
    the output rounded once)."""
    k = 16
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=6, dtype=torch.bfloat16)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k, dtype=torch.bfloat16)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=6, fill=0.8)
    out, lse = run(batch, plan, indices)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exp_out, exp_lse = sparse_reference(batch, indices)
    ref.assert_out_close(out, exp_out, atol=2e-2, rtol=2e-2)
    ref.assert_lse_close(lse, exp_lse, atol=1e-4)


@pytest.mark.parametrize("layout", ["raw", "split", "identity"])
def test_every_weight_layout(ref, tiny_dims, layout):
    """The absorbed weights come from any layout of the prepared kv_b_proj (the raw checkpoint weight too)."""
    k = 10
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=9)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=9)
    w = batch.w if layout == "raw" else prepare_kv_b_proj(batch.w, tiny_dims, layout=layout)
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, w, batch.cache, batch.block_table, plan, topk_indices=indices, return_lse=True
    )
    exp_out, exp_lse = sparse_reference(batch, indices)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


@pytest.mark.parametrize("layout", ["split", "identity"])
def test_absorbed_weights_are_views_of_kv_b_proj(tiny_dims, layout):
    d = tiny_dims
    w = torch.randn(d.kv_b_proj_shape)
    per_head = w.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    for prepared in (prepare_kv_b_proj(w, d, layout=layout),):
        w_uk, w_uv = prepared.absorbed_weights()
        assert w_uk.shape == (d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank)
        assert w_uv.shape == (d.num_heads, d.v_head_dim, d.kv_lora_rank)
        assert torch.equal(w_uk, per_head[:, : d.qk_nope_head_dim]) and torch.equal(
            w_uv, per_head[:, d.qk_nope_head_dim :]
        )
        assert w_uk.untyped_storage().data_ptr() == prepared.weight.untyped_storage().data_ptr()


def test_chunks_of_queries_give_the_same_rows(ref, tiny_dims, monkeypatch):
    """The pass goes through the queries in chunks (bounded memory): tiny chunks give the rows of one chunk."""
    k = 8
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=12)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=12, fill=0.6)
    whole_out, whole_lse = run(batch, plan, indices)
    monkeypatch.setattr(sparse, "SPARSE_CHUNK_PAIRS", 2 * k + 1)  # 2 queries per chunk
    out, lse = run(batch, plan, indices)
    torch.testing.assert_close(out, whole_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, whole_lse, atol=1e-6, rtol=0)
    monkeypatch.setattr(sparse, "SPARSE_CHUNK_PAIRS", 1)  # at least one query per chunk
    out, _ = run(batch, plan, indices)
    torch.testing.assert_close(out, whole_out, atol=1e-6, rtol=0)


def test_out_is_written_in_place_and_phases_reported(ref, tiny_dims):
    k = 8
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=13)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=13)
    out = torch.full((plan.num_tokens, tiny_dims.num_heads, tiny_dims.v_head_dim), float("nan"))
    phases = []
    got = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        out=out,
        topk_indices=indices,
        phase_hook=phases.append,
    )
    assert got is out and not torch.isnan(out).any()
    assert phases == ["sparse attention", "end"]
    ref.assert_out_close(out, sparse_reference(batch, indices)[0], atol=ATOL)


def test_no_new_tokens_and_no_context(ref, tiny_dims):
    """Edge batches: no new tokens at all (an empty result), and requests without any context."""
    plan = plan_for(tiny_dims, [0, 0], [5, 3], 4, 4)
    batch = ref.make_mla_batch(tiny_dims, [0, 0], [5, 3], 4)
    out, lse = run(batch, plan, torch.empty(0, 4, dtype=torch.int32))
    assert out.shape == (0, tiny_dims.num_heads, tiny_dims.v_head_dim) and lse.shape == (0, tiny_dims.num_heads)
    batch = ref.make_mla_batch(tiny_dims, [3, 2], [0, 0], 4, seed=2)
    plan = plan_for(tiny_dims, [3, 2], [0, 0], 4, 2)
    indices = random_indices([3, 2], [0, 0], 2, seed=2)
    out, lse = run(batch, plan, indices)
    exp_out, exp_lse = sparse_reference(batch, indices)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_plan_records_index_topk_in_its_key(tiny_dims):
    ws = Workspace("cpu")
    args = dict(dims=tiny_dims, workspace=ws, block_size=16, dtype=torch.float32)
    dense = PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, **args)
    sparse_plan = PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, index_topk=8, **args)
    assert dense.index_topk is None and sparse_plan.index_topk == 8 and "index_topk=8" in repr(sparse_plan)
    assert dense.key != sparse_plan.key != PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, index_topk=9, **args).key
    cache = PlanCache()
    a = cache.get(QUERY_LENS, CONTEXT_LENS, index_topk=8, **args)
    assert cache.get(QUERY_LENS, CONTEXT_LENS, index_topk=8, **args) is a
    assert cache.get(QUERY_LENS, CONTEXT_LENS, **args) is not a and a.key == sparse_plan.key
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(ValueError, match="index_topk must be a positive int"):
            PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, index_topk=bad, **args)
        with pytest.raises(ValueError, match="index_topk must be a positive int"):
            cache.get(QUERY_LENS, CONTEXT_LENS, index_topk=bad, **args)


# ------------------------------------------------------------------------------------------------------ refusals
def _refusal_cases(t, k):
    causal = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=0)
    own = own_positions(QUERY_LENS, CONTEXT_LENS)

    def with_pick(row, value):
        x = causal.clone()
        x[row, 0] = value
        return x

    # row 3 is request 1's first new token: own position 37, sequence of 41
    assert own[3] == 37
    return {
        "non-causal pick": (with_pick(3, 38), ValueError, r"topk_indices\[3, 0\] = 38 is after the query's own"),
        "past the sequence": (with_pick(3, 41), ValueError, "past request 1's sequence of 41 positions"),
        "far out of range": (with_pick(0, 10**6), ValueError, "past request 0's sequence"),
        "below -1": (with_pick(0, -2), ValueError, "below -1"),
        "int64": (causal.long(), TypeError, "topk_indices must be int32"),
        "float": (causal.float(), TypeError, "topk_indices must be int32"),
        "not a tensor": (causal.tolist(), TypeError, "topk_indices must be a torch.Tensor"),
        "too few rows": (causal[:-1], ValueError, r"topk_indices must be \[T=15"),
        "K other than the plan's": (torch.cat([causal, causal[:, :1]], 1), ValueError, "index_topk=8"),
        "1-d": (causal[:, 0], ValueError, r"topk_indices must be \[T="),
    }


@pytest.mark.parametrize(
    "case",
    [
        "non-causal pick",
        "past the sequence",
        "far out of range",
        "below -1",
        "int64",
        "float",
        "not a tensor",
        "too few rows",
        "K other than the plan's",
        "1-d",
    ],
)
def test_bad_indices_are_refused_and_nothing_is_written(ref, tiny_dims, case):
    k = 8
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k)
    indices, error, match = _refusal_cases(plan.num_tokens, k)[case]
    out = torch.full((plan.num_tokens, tiny_dims.num_heads, tiny_dims.v_head_dim), 7.0)
    with pytest.raises(error, match=match):
        mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            batch.cache,
            batch.block_table,
            plan,
            out=out,
            topk_indices=indices,
        )
    assert (out == 7.0).all()


def test_plan_and_indices_must_agree(ref, tiny_dims):
    """Indices with a plan built for dense prefill, and a sparse plan without indices, are refused by name (nothing
    written); validate_prefill_inputs refuses the same."""
    from mla_bridge.prefill import validate_prefill_inputs

    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16)
    dense = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, None)
    sparse_plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, 8)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, 8)
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table)
    out = torch.full((dense.num_tokens, tiny_dims.num_heads, tiny_dims.v_head_dim), 7.0)
    with pytest.raises(ValueError, match="topk_indices was given, but the plan was built for dense prefill"):
        mla_prefill(*args, dense, out=out, topk_indices=indices)
    with pytest.raises(ValueError, match="topk_indices is required: the plan was built with index_topk=8"):
        mla_prefill(*args, sparse_plan, out=out)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="built for dense prefill"):
        validate_prefill_inputs(*args, dense, topk_indices=indices)
    with pytest.raises(ValueError, match="topk_indices is required"):
        validate_prefill_inputs(*args, sparse_plan)
    validate_prefill_inputs(*args, sparse_plan, topk_indices=indices)
    with pytest.raises(ValueError, match="out shares memory with topk_indices"):
        shared = torch.zeros(dense.num_tokens * tiny_dims.num_heads * tiny_dims.v_head_dim)
        idx = shared.view(torch.int32)[: indices.numel()].view(indices.shape)
        idx.copy_(indices)
        mla_prefill(*args, sparse_plan, out=shared.view_as(out), topk_indices=idx)


def test_other_inputs_are_still_checked(ref, tiny_dims):
    """The sparse call checks every other input as the dense one does (before the indices)."""
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, 8)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, 8)
    with pytest.raises(ValueError, match="q must be"):
        mla_prefill(
            batch.q[:-1], batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, topk_indices=indices
        )
    with pytest.raises(ValueError, match="kv_cache_scale is required"):
        fp8_plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, 8, kv_cache_dtype="fp8")
        fp8, _ = quantize_latent_cache(batch.cache)
        mla_prefill(batch.q, batch.kv_c, batch.k_pe, batch.w, fp8, batch.block_table, fp8_plan, topk_indices=indices)


def test_dense_memory_formula_refuses_a_sparse_plan(tiny_dims):
    from mla_bridge.prefill import prefill_memory_bytes

    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, 8)
    with pytest.raises(ValueError, match="index_topk=8"):
        prefill_memory_bytes(plan)
    assert prefill_memory_bytes(plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, None)) > 0


def test_capture_refuses_a_sparse_plan(ref, tiny_dims):
    from mla_bridge import PrefillLayer, capture_prefill

    batch = ref.make_mla_batch(tiny_dims, [3], [5], 4)
    plan = plan_for(tiny_dims, [3], [5], 4, 4)
    layer = PrefillLayer(batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache)
    with pytest.raises(ValueError, match="index_topk=4"):
        capture_prefill(plan, [layer], block_table=batch.block_table)


# ---------------------------------------------------------------------------------- which path serves (one place)
def test_select_sparse_takes_the_kernel_on_cuda_and_torch_elsewhere_with_the_reason(monkeypatch, tiny_dims):
    """select_sparse is the one place choosing: the Triton kernel on CUDA where Triton imports and the dims / dtype
    are the kernel's, the torch path otherwise, each with its reason (no Triton or GPU needed to ask)."""
    monkeypatch.delenv("MLA_BRIDGE_SPARSE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    v32 = MLADims.preset("deepseek-v3.2")
    cpu = sparse.select_sparse(v32, torch.bfloat16, "cpu", triton=True)
    assert (cpu.name, cpu.forced) == ("torch", False) and "cpu tensors" in cpu.reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter is for a forced kernel only, never the default
    assert sparse.select_sparse(v32, torch.bfloat16, "cpu", triton=True).name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    for dims in (v32, MLADims.preset("glm-5"), MLADims.preset("deepseek-v2-lite"), tiny_dims):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got = sparse.select_sparse(dims, dtype, "cuda", triton=True)
            assert (got.name, got.forced) == ("triton", False), (dims, dtype, got)
    no_triton = sparse.select_sparse(v32, torch.bfloat16, "cuda", triton=False)
    assert no_triton.name == "torch" and "Triton does not import" in no_triton.reason
    f64 = sparse.select_sparse(v32, torch.float64, "cuda", triton=True)
    assert f64.name == "torch" and "torch.float64" in f64.reason
    wide = MLADims(num_heads=8, kv_lora_rank=1024, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
    got = sparse.select_sparse(wide, torch.bfloat16, "cuda", triton=True)
    assert got.name == "torch" and "kv_lora_rank 1024 > 512" in got.reason
    rope = MLADims(num_heads=8, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=256, v_head_dim=64)
    got = sparse.select_sparse(rope, torch.bfloat16, "cuda", triton=True)
    assert got.name == "torch" and "qk_rope_head_dim 256 > 128" in got.reason
    no_rope = MLADims(num_heads=8, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=0, v_head_dim=64)
    assert sparse.select_sparse(no_rope, torch.bfloat16, "cuda", triton=True).name == "triton"
    assert sparse.kernel_why_not(v32, torch.bfloat16) is None


def test_the_hopper_kernel_serves_sm90_half_precision_at_the_dims_it_was_checked_at():
    """The Triton path's launches over the gathered latents take the warp-specialized Hopper kernel on compute
    capability 9.0 with Triton 3.6 only (its Gluon dialect changes between releases), for bf16/fp16, 64 heads or
    more, at the DSA models' kv_lora_rank 512 and rope 64 (the dims it was checked at on a GPU)."""
    v32, glm5 = MLADims.preset("deepseek-v3.2"), MLADims.preset("glm-5")
    t36 = (3, 6)
    for dims in (v32, glm5):
        for dtype in (torch.bfloat16, torch.float16):
            assert sparse.sm90_kernel_serves(dims, dtype, (9, 0), t36)
        assert not sparse.sm90_kernel_serves(dims, torch.float32, (9, 0), t36)
        for cap in ((8, 0), (8, 9), (10, 0), (12, 0), None):
            assert not sparse.sm90_kernel_serves(dims, torch.bfloat16, cap, t36)
        for version in ((3, 5), (3, 9), (4, 0), None):  # None: no Triton
            assert not sparse.sm90_kernel_serves(dims, torch.bfloat16, (9, 0), version)

    def dims_of(rank, rope, heads=64):
        return MLADims(num_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=64, qk_rope_head_dim=rope, v_head_dim=64)

    assert sparse.sm90_kernel_serves(dims_of(512, 64, heads=80), torch.bfloat16, (9, 0), t36)
    assert not sparse.sm90_kernel_serves(dims_of(512, 64, heads=32), torch.bfloat16, (9, 0), t36)  # blocks of 64
    # only the dims it was checked at on a GPU (the DSA models'); other shapes compile but run the portable kernel
    for rank, rope in ((256, 64), (64, 16), (512, 32), (512, 128), (512, 0), (384, 64), (512, 48)):
        assert not sparse.sm90_kernel_serves(dims_of(rank, rope), torch.bfloat16, (9, 0), t36), (rank, rope)


def test_the_triton_path_takes_the_hopper_kernel_only_over_gathered_latents(monkeypatch, tiny_dims):
    """triton_kernel_for (the Triton path's choice, which mla-bridge prefill reports): "hopper" where the plan gathers
    the context into the fused key latents and sm90_kernel_serves takes it, "portable" otherwise. A CPU plan is
    always "portable"; the SM90 cases use a stand-in carrying what the choice reads (no SM90 device here)."""
    from types import SimpleNamespace

    v32 = MLADims.preset("deepseek-v3.2")
    cpu_plan = PrefillPlan.build([3], [5], dims=v32, workspace=Workspace("cpu"), block_size=4, index_topk=4)
    assert cpu_plan.capability is None and sparse.triton_kernel_for(cpu_plan) == "portable"
    monkeypatch.setattr(sparse, "kernel_triton_version", lambda: (3, 6))
    meta = torch.zeros(1, 4, dtype=torch.int32)

    def stand_in(dims=v32, dtype=torch.bfloat16, capability=(9, 0), latents=True):
        return SimpleNamespace(
            dims=dims, dtype=dtype, capability=capability, sparse_latent_meta=meta if latents else None
        )

    assert sparse.triton_kernel_for(stand_in()) == "hopper"
    assert sparse.triton_kernel_for(stand_in(latents=False)) == "portable"  # the cache read through block_table
    assert sparse.triton_kernel_for(stand_in(capability=(10, 0))) == "portable"
    assert sparse.triton_kernel_for(stand_in(dtype=torch.float32)) == "portable"
    assert sparse.triton_kernel_for(stand_in(dims=tiny_dims)) == "portable"
    monkeypatch.setattr(sparse, "kernel_triton_version", lambda: (3, 9))
    assert sparse.triton_kernel_for(stand_in()) == "portable"


def test_mla_bridge_sparse_forces_a_path_or_says_why_it_cannot(monkeypatch, tiny_dims):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    v32 = MLADims.preset("deepseek-v3.2")
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", " Torch ")
    got = sparse.select_sparse(v32, torch.bfloat16, "cuda", triton=True)
    assert (got.name, got.forced, got.reason) == ("torch", True, "forced by MLA_BRIDGE_SPARSE=torch")
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "triton")
    got = sparse.select_sparse(v32, torch.bfloat16, "cuda", triton=True)
    assert (got.name, got.forced) == ("triton", True)
    with pytest.raises(ValueError, match="MLA_BRIDGE_SPARSE=triton runs a Triton kernel: it needs a CUDA device"):
        sparse.select_sparse(v32, torch.bfloat16, "cpu", triton=True)
    with pytest.raises(ValueError, match="MLA_BRIDGE_SPARSE=triton, but Triton does not import here"):
        sparse.select_sparse(v32, torch.bfloat16, "cuda", triton=False)
    with pytest.raises(ValueError, match="cannot serve this layer: the kernel computes float16, bfloat16 or float32"):
        sparse.select_sparse(v32, torch.float64, "cuda", triton=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a developer's run: the kernel on CPU tensors
    assert sparse.select_sparse(v32, torch.float32, "cpu", triton=True).name == "triton"
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "auto")
    assert sparse.select_sparse(v32, torch.float32, "cpu", triton=True).name == "torch"
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "flashmla")
    with pytest.raises(ValueError, match="MLA_BRIDGE_SPARSE='flashmla': expected one of triton, torch or auto"):
        sparse.select_sparse(v32, torch.float32, "cpu")


def test_mla_prefill_refuses_a_sparse_switch_that_cannot_serve_before_any_work(ref, tiny_dims, monkeypatch):
    """On this CPU machine ``MLA_BRIDGE_SPARSE=triton`` cannot serve (no CUDA, and no interpreter asked for): refused
    with the reason and nothing written; ``=torch`` and unset run the torch path, bitwise alike."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k = 8
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=14)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, k)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, k, seed=14)
    out = torch.full((plan.num_tokens, tiny_dims.num_heads, tiny_dims.v_head_dim), 7.0)
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan)
    for value, match in (("triton", "needs a CUDA device"), ("bogus", "MLA_BRIDGE_SPARSE='bogus'")):
        monkeypatch.setenv("MLA_BRIDGE_SPARSE", value)
        with pytest.raises(ValueError, match=match):
            mla_prefill(*args, out=out, topk_indices=indices)
        assert (out == 7.0).all()
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "torch")
    forced, forced_lse = mla_prefill(*args, topk_indices=indices, return_lse=True)
    monkeypatch.delenv("MLA_BRIDGE_SPARSE")
    auto, auto_lse = mla_prefill(*args, topk_indices=indices, return_lse=True)
    assert torch.equal(forced, auto) and torch.equal(forced_lse, auto_lse)
    ref.assert_out_close(auto, sparse_reference(batch, indices)[0], atol=ATOL)


def test_token_meta_places_each_pick(tiny_dims):
    """The kernel's per-token table: request, context length, sequence length, kv_c row of sequence position 0."""
    plan = plan_for(tiny_dims, [2, 0, 3], [5, 4, 0], 4, 4)
    assert sparse.token_meta(plan).tolist() == [
        [0, 5, 7, -5],
        [0, 5, 7, -5],
        [2, 0, 3, 2],
        [2, 0, 3, 2],
        [2, 0, 3, 2],
    ]
    req, own = sparse.token_positions(plan)  # each token's request and its position in that request's sequence
    assert req.tolist() == [0, 0, 2, 2, 2] and own.tolist() == [5, 6, 0, 1, 2]


def test_a_sparse_plan_places_each_token_in_the_fused_key_latents(ref, tiny_dims):
    """The Triton path gathers the context once into the fused key latents (each request's context, then its new
    tokens; an FP8 cache's dequantized) and reads every pick there: the plan's second table gives each token's
    request, context length 0, sequence length and its request's first key row, which is where fused_latent puts
    the request's position 0 (main_kv_indptr). Caches of the plan's dtype and FP8 caches alike."""
    from mla_bridge.cache import dequantize_latent, fused_latent, quantize_latent_cache

    q_lens, c_lens = [2, 0, 3], [5, 4, 0]
    batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=3)
    fp8, scale = quantize_latent_cache(batch.cache)
    new_rows = torch.cat([batch.kv_c, batch.k_pe.reshape(len(batch.kv_c), -1)], 1)
    for kind, cache, cache_scale in ((None, batch.cache, None), ("fp8", fp8, scale)):
        plan = plan_for(tiny_dims, q_lens, c_lens, 4, 4, kv_cache_dtype=kind)
        assert plan.fused
        starts = plan.main_kv_indptr.tolist()  # [0, 7, 7, 10]: request 1 has no new token, its context is not gathered
        assert plan.sparse_latent_meta.tolist() == [
            [0, 0, 7, starts[0]],
            [0, 0, 7, starts[0]],
            [2, 0, 3, starts[2]],
            [2, 0, 3, starts[2]],
            [2, 0, 3, starts[2]],
        ]
        # row start + p of the fused latents is position p of the request's sequence
        latent = fused_latent(plan, batch.kv_c, batch.k_pe, cache, batch.block_table, cache_scale)
        stored = batch.cache if kind is None else dequantize_latent(fp8, scale, latent.dtype)
        context = torch.stack([stored[int(batch.block_table[0, p // 4]), p % 4] for p in range(5)])
        assert torch.equal(latent[starts[0] : starts[0] + 5], context)  # request 0's context, read through block_table
        assert torch.equal(latent[starts[0] + 5 : starts[0] + 7], new_rows[:2])  # request 0's new tokens, after 5
        assert torch.equal(latent[starts[2] : starts[2] + 3], new_rows[2:])
        # the chunked schedule has the same table (the sparse pass runs no chunk); fused latents larger than one
        # chunk's up-projected k / v (chunk_tokens=1) are read from the paged cache in the kernel: none
        chunked = plan_for(tiny_dims, q_lens, c_lens, 4, 4, kv_cache_dtype=kind, fuse_context=False)
        assert not chunked.fused and torch.equal(chunked.sparse_latent_meta, plan.sparse_latent_meta)
        assert torch.equal(fused_latent(chunked, batch.kv_c, batch.k_pe, cache, batch.block_table, cache_scale), latent)
        assert plan_for(tiny_dims, q_lens, c_lens, 4, 4, kv_cache_dtype=kind, chunk_tokens=1).sparse_latent_meta is None


def test_token_meta_is_made_once_per_plan(tiny_dims):
    """The table is the plan's, made at its build: every layer reads the same tensor (it was made, and copied to the
    device from pageable memory, in each call: on CUDA a copy that waits for the GPU, so the host could not run
    ahead). A dense plan has none."""
    plan = plan_for(tiny_dims, [2, 0, 3], [5, 4, 0], 4, 4)
    assert sparse.token_meta(plan) is sparse.token_meta(plan) is plan.sparse_token_meta
    assert plan.sparse_token_meta.dtype == torch.int32 and plan.sparse_token_meta.shape == (5, 4)
    dense = PrefillPlan.build([2], [5], dims=tiny_dims, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32)
    assert dense.sparse_token_meta is None
    with pytest.raises(ValueError, match="the plan is dense"):
        sparse.token_meta(dense)


def test_sparse_prefill_takes_a_path_by_name(ref, tiny_dims):
    """``impl=`` (tests and benchmarks) names a path; another name is refused before anything is written."""
    from mla_bridge.prefill import as_prepared

    batch = ref.make_mla_batch(tiny_dims, [3], [5], 4, seed=15)
    plan = plan_for(tiny_dims, [3], [5], 4, 4)
    indices = random_indices([3], [5], 4, seed=15)
    w = as_prepared(batch.w, tiny_dims, torch.float32, plan.device)
    args = (batch.q, batch.kv_c, batch.k_pe, w, batch.cache, batch.block_table, plan, indices)
    out = torch.full((3, tiny_dims.num_heads, tiny_dims.v_head_dim), 7.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        sparse.sparse_prefill(*args, out=out, impl="flashmla")
    assert (out == 7.0).all()
    got = sparse.sparse_prefill(*args, impl="torch")
    ref.assert_out_close(got, sparse_reference(batch, indices)[0], atol=ATOL)


def test_partition_picks_puts_context_rows_first_then_new_rows_then_none():
    """The sparse kernel reads each tile from one source: a row's picks of cached context first, then those of its
    new tokens, each in the caller's order, then -1 (no pick, or one past the request's sequence, never read), with
    the count of context picks."""
    from mla_bridge.kernels.sparse_picks import partition_picks

    meta = torch.tensor([[0, 4, 7, 0], [1, 0, 3, 5], [2, 5, 5, 0]], dtype=torch.int32)  # context 4, 0, 5 tokens
    picks = torch.tensor([[5, -1, 2, 6, 0, 9], [2, 0, -1, 1, 7, -1], [4, 3, -1, 0, 1, 2]], dtype=torch.int32)
    got, n_ctx = partition_picks(picks, meta)
    want = [[2, 0, 5, 6, -1, -1], [2, 0, 1, -1, -1, -1], [4, 3, 0, 1, 2, -1]]
    assert got.tolist() == want and got.dtype == torch.int32
    assert n_ctx.tolist() == [2, 0, 5] and n_ctx.dtype == torch.int32
