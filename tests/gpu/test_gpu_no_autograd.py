"""GPU tests of the no-autograd rule where it matters: on CUDA FlashInfer's runs, the Triton gather / up-projection /
merge kernels write outside autograd, so an input autograd would differentiate must be refused by name (its gradient
or tangent would be lost without a word), before anything is written, while the GPU is still busy with earlier work
(no sync in the check). Under ``torch.no_grad()`` (no tangent) the same tensors run and give the plain result.

Marked ``gpu``: skipped (by tests/conftest.py) unless CUDA is available and FlashInfer imports. Run on the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_no_autograd.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

pytestmark = pytest.mark.gpu

from mla_bridge import (  # noqa: E402
    MLADims,
    PrefillPlan,
    PreparedKVBProj,
    Workspace,
    merge_attn_states,
    mla_prefill,
    plan_ragged,
    prepare_kv_b_proj,
    quantize_latent_cache,
)

BF16 = torch.bfloat16
SENTINEL = 7.0


def _batch(ref):
    dims = MLADims.deepseek_v2_lite()
    dev = torch.device("cuda", torch.cuda.current_device())
    batch = ref.make_mla_batch(dims, [40, 9], [300, 70], 16, dtype=BF16, seed=5, device=dev)
    cache, scale = quantize_latent_cache(torch.nan_to_num(batch.cache))
    plan = PrefillPlan.build(
        [40, 9],
        [300, 70],
        dims=dims,
        workspace=Workspace(dev, chunk_tokens=128),
        block_size=16,
        dtype=BF16,
        kv_cache_dtype="fp8",
    )
    assert plan.chunks  # main pass, then context chunks that read the scale
    return dims, batch, cache, scale, plan


def test_gpu_prefill_refuses_scale_weight_and_tangent(ref):
    """mla_prefill on CUDA (FP8 cache, chunked): a kv_cache_scale tensor requiring grad, a PreparedKVBProj whose
    weight requires grad (split and identity layouts), and a q carrying a forward-mode tangent under torch.no_grad()
    are each refused by name, out untouched; under torch.no_grad() the first two run and equal the plain call."""
    dims, batch, cache, scale, plan = _batch(ref)
    split, identity = prepare_kv_b_proj(batch.w, dims), prepare_kv_b_proj(batch.w, dims, layout="identity")
    args = (batch.q, batch.kv_c, batch.k_pe)
    want = mla_prefill(*args, split, cache, batch.block_table, plan, kv_cache_scale=scale)
    cases = [("kv_cache_scale", split, scale.clone().requires_grad_(True))]
    cases += [
        ("kv_b_proj_weight.weight", PreparedKVBProj(dims, w.layout, w.weight.clone().requires_grad_(True)), scale)
        for w in (split, identity)
    ]
    for name, weight, s in cases:
        out = torch.full_like(want, SENTINEL)
        torch.cuda._sleep(int(1e8))  # the host runs ahead: the refusal must not need the GPU
        with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording"):
            mla_prefill(*args, weight, cache, batch.block_table, plan, out=out, kv_cache_scale=s)
        assert bool((out == SENTINEL).all()), name
        with torch.no_grad():
            got = mla_prefill(*args, weight, cache, batch.block_table, plan, kv_cache_scale=s)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
    out = torch.full_like(want, SENTINEL)
    with torch.no_grad(), fwAD.dual_level():
        dual = fwAD.make_dual(batch.q, torch.ones_like(batch.q))
        with pytest.raises(ValueError, match=r"^q carries a forward-mode tangent"):
            mla_prefill(dual, *args[1:], split, cache, batch.block_table, plan, out=out, kv_cache_scale=scale)
    assert bool((out == SENTINEL).all())


def test_gpu_ragged_run_and_merge_refuse_out_lse_and_inputs_requiring_grad():
    """RaggedPlan.run on FlashInfer refuses an out / lse requiring grad (a non-leaf: written by FlashInfer its autograd
    history would be stale), untouched; merge_attn_states (Triton / FlashInfer on CUDA) refuses an input requiring
    grad. Under torch.no_grad() both run and give the plain result."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(3)
    q = torch.randn(50, 16, 192, generator=g).to(dev, BF16)
    k = torch.randn(80, 16, 192, generator=g).to(dev, BF16)
    v = torch.randn(80, 16, 128, generator=g).to(dev, BF16)
    ind_q, ind_k = torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 30, 80], dtype=torch.int32)
    plan = plan_ragged(
        ind_q,
        ind_k,
        num_heads=16,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=True,
        sm_scale=0.1,
        dtype=BF16,
        workspace=Workspace(dev),
    )
    assert plan.backend.is_flashinfer, plan
    want = plan.run(q, k, v)
    for name, shape, dtype in (("out", (50, 16, 128), BF16), ("lse", (50, 16), torch.float32)):
        buf = torch.full(shape, SENTINEL, dtype=dtype, device=dev, requires_grad=True) * 1
        torch.cuda._sleep(int(1e8))
        with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording"):
            plan.run(q, k, v, **{name: buf})
        assert bool((buf == SENTINEL).all()), name
        with torch.no_grad():
            got = plan.run(q, k, v, **{name: buf})
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    out_a = want[0].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"^out_a requires grad and autograd is recording"):
        merge_attn_states(out_a, want[1], want[0], want[1])
    with torch.no_grad():
        merged, lse = merge_attn_states(out_a, want[1], want[0], want[1])
    assert not merged.requires_grad
    torch.testing.assert_close(merged.float(), want[0].float(), atol=1e-2, rtol=1e-2)  # the same partial twice
