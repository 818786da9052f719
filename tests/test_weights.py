"""kv_b_proj prepared once (mla_bridge.weights): the prepared form computes what the raw weight computes (bitwise for
the identity layout on the CPU, within float32 rounding for the split layout), is checked against the plan, and is
never re-prepared inside mla_prefill."""

from __future__ import annotations

import pytest
import torch

import mla_bridge.weights as weights_mod
from mla_bridge import MLADims, PrefillPlan, PreparedKVBProj, Workspace, mla_prefill, prepare_kv_b_proj
from mla_bridge.prefill import prefill_memory_bytes
from mla_bridge.ragged import _kernel_ready
from mla_bridge.weights import up_projection_weight

QUERY_LENS = [3, 4, 1, 0, 5]
CONTEXT_LENS = [0, 37, 5, 9, 20]


def _plan(dims, fuse, chunk_tokens=16, dtype=torch.float32):
    return PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, dims=dims, workspace=Workspace("cpu", chunk_tokens=chunk_tokens
                                                                                          if not fuse else 1000),
                             block_size=8, dtype=dtype, fuse_context=fuse)


def _run(batch, plan, weight):
    return mla_prefill(batch.q, batch.kv_c, batch.k_pe, weight, batch.cache, batch.block_table, plan, return_lse=True)


def test_identity_layout_is_the_rearranged_weight(tiny_dims):
    w = torch.randn(tiny_dims.kv_b_proj_shape)
    p = prepare_kv_b_proj(w, tiny_dims)
    assert isinstance(p, PreparedKVBProj) and p.layout == "identity"
    assert torch.equal(p.weight, up_projection_weight(w, tiny_dims))
    d = tiny_dims
    assert list(p.weight.shape) == [d.num_heads * (d.head_dim_qk + d.v_head_dim), d.latent_dim]
    assert p.dtype == w.dtype and p.device == w.device and p.nbytes == p.weight.numel() * 4
    w.zero_()  # the prepared copy does not alias the raw weight
    assert p.weight.abs().sum() > 0


def test_up_projection_weight_still_importable_from_prefill(tiny_dims):
    from mla_bridge.prefill import up_projection_weight as old

    assert old is up_projection_weight


@pytest.mark.parametrize("fuse", [True, False])
def test_prepared_equals_raw_bitwise(ref, tiny_dims, fuse):
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=3)
    plan = _plan(tiny_dims, fuse)
    assert plan.fused == fuse and (fuse or len(plan.chunks) > 1)
    raw_out, raw_lse = _run(batch, plan, batch.w)
    out, lse = _run(batch, plan, prepare_kv_b_proj(batch.w, tiny_dims))
    assert torch.equal(out, raw_out) and torch.equal(lse, raw_lse)


@pytest.mark.parametrize("fuse", [True, False])
def test_split_layout_matches_the_reference(ref, tiny_dims, fuse):
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=4)
    plan = _plan(tiny_dims, fuse)
    out, lse = _run(batch, plan, prepare_kv_b_proj(batch.w, tiny_dims, layout="split"))
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=3e-5)
    ref.assert_lse_close(lse, exp_lse, atol=3e-5)
    raw_out, _ = _run(batch, plan, batch.w)
    torch.testing.assert_close(out, raw_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_layout_k_and_v(tiny_dims, dtype):
    d = tiny_dims
    g = torch.Generator().manual_seed(0)
    w = torch.randn(d.kv_b_proj_shape, generator=g).to(dtype)
    latent = torch.randn(11, d.latent_dim + 8, generator=g).to(dtype)[:, 3:3 + d.latent_dim]  # strided rows
    k_id, v_id = prepare_kv_b_proj(w, d).up_project(latent)
    k, v = prepare_kv_b_proj(w, d, layout="split").up_project(latent)
    assert k.shape == k_id.shape == (11, d.num_heads, d.head_dim_qk) and v.shape == v_id.shape
    # k_pe is copied exactly into every head, in both layouts
    want_pe = latent[:, d.kv_lora_rank:].unsqueeze(1).expand(-1, d.num_heads, -1)
    assert torch.equal(k[..., d.qk_nope_head_dim:], want_pe) and torch.equal(k_id[..., d.qk_nope_head_dim:], want_pe)
    # k_nope and v: the bare GEMM, within accumulation-order rounding
    kv = (latent[:, :d.kv_lora_rank].double() @ w.double().t()).view(11, d.num_heads, -1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(k[..., :d.qk_nope_head_dim].double(), kv[..., :d.qk_nope_head_dim], **tol)
    torch.testing.assert_close(v.double(), kv[..., d.qk_nope_head_dim:], **tol)
    # one buffer, strided views the kernels read in place
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert _kernel_ready(k) and _kernel_ready(v)


def test_prepared_weight_is_not_prepared_again(ref, tiny_dims, monkeypatch):
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=5)
    plan = _plan(tiny_dims, False)
    prepared = prepare_kv_b_proj(batch.w, tiny_dims)
    calls = []
    real = weights_mod.prepare_kv_b_proj
    monkeypatch.setattr(weights_mod, "prepare_kv_b_proj", lambda *a, **k: calls.append(1) or real(*a, **k))
    _run(batch, plan, prepared)
    assert calls == []
    _run(batch, plan, batch.w)  # the raw weight: prepared inside the call, every call
    _run(batch, plan, batch.w)
    assert len(calls) == 2


def test_bad_inputs_are_named(ref, tiny_dims):
    d = tiny_dims
    batch = ref.make_mla_batch(d, QUERY_LENS, CONTEXT_LENS, 8, seed=6)
    plan = _plan(d, True)
    with pytest.raises(ValueError, match=r"^kv_b_proj_weight must be \[H\*\(qk_nope_head_dim\+v_head_dim\)"):
        prepare_kv_b_proj(batch.w.t(), d)
    with pytest.raises(TypeError, match="^kv_b_proj_weight must be a torch.Tensor"):
        prepare_kv_b_proj(batch.w.numpy(), d)
    with pytest.raises(TypeError, match="^dims must be an MLADims"):
        prepare_kv_b_proj(batch.w, {"num_heads": 4})
    with pytest.raises(ValueError, match="^layout must be one of"):
        prepare_kv_b_proj(batch.w, d, layout="fused")
    other = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    wrong_dims = prepare_kv_b_proj(torch.randn(other.kv_b_proj_shape), other)
    with pytest.raises(ValueError, match="^kv_b_proj_weight was prepared for 2 heads.*the plan has 4 heads"):
        _run(batch, plan, wrong_dims)
    with pytest.raises(TypeError, match=r"^kv_b_proj_weight must have dtype torch.float32 .*PreparedKVBProj of "
                                        r"torch.float64"):
        _run(batch, plan, prepare_kv_b_proj(batch.w.double(), d))


def test_memory_budget_leaves_out_a_prepared_weight(tiny_dims):
    plan = _plan(tiny_dims, True)
    d = tiny_dims
    weight_bytes = d.num_heads * (d.head_dim_qk + d.v_head_dim) * d.latent_dim * 4
    assert prefill_memory_bytes(plan) - prefill_memory_bytes(plan, prepared_weight=True) == weight_bytes
