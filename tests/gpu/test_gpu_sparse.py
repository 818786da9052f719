"""GPU tests of the sparse prefill's torch path (mla_bridge.sparse) on CUDA.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run on the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_sparse.py -q -m gpu
* bf16 on CUDA (the context rows gathered by the gather of mla_bridge.cache, Triton where it imports) against the
  same call on the CPU in float32 (itself checked against float64 in tests/test_sparse.py), at DeepSeek-V2-Lite dims,
  bf16 and FP8 caches, block sizes 1/16/64;
* the Triton gather and the torch gather (MLA_BRIDGE_GATHER=torch) give bitwise the same sparse output;
* every causal key selected equals dense mla_prefill on the GPU within bf16 tolerances.
No speed is measured: the torch path is a correct fallback; a fused CUDA kernel is not part of this release.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, quantize_latent_cache  # noqa: E402

V2_LITE = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
QUERY_LENS = [37, 0, 130, 9]
CONTEXT_LENS = [300, 40, 0, 1025]
OUT_TOL, LSE_TOL = 2e-2, 1e-2


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def indices(k: int, seed: int, fill: float = 0.8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for q, c in zip(QUERY_LENS, CONTEXT_LENS):
        for j in range(q):
            own = c + j
            most = min(k, own + 1)
            m = max(1, int(most * fill))
            row = torch.full((k,), -1, dtype=torch.int32)
            row[torch.randperm(k, generator=g)[:m]] = torch.randperm(own + 1, generator=g)[:m].to(torch.int32)
            rows.append(row)
    return torch.stack(rows)


def bf16_batch(ref, dims, block_size, seed):
    """A batch whose values are bf16 numbers (held as float32), so that the CPU float32 call and the CUDA bf16 call
    read the same inputs."""
    batch = ref.make_mla_batch(dims, QUERY_LENS, CONTEXT_LENS, block_size, seed=seed)
    for name in ("q", "kv_c", "k_pe", "w", "cache"):
        setattr(batch, name, getattr(batch, name).to(torch.bfloat16).float())
    return batch


def call(batch, plan, idx, cache, scale, device):
    to = lambda x: x.to(device)  # noqa: E731
    return mla_prefill(
        to(batch.q).to(plan.dtype),
        to(batch.kv_c).to(plan.dtype),
        to(batch.k_pe).to(plan.dtype),
        to(batch.w).to(plan.dtype),
        to(cache),
        to(batch.block_table),
        plan,
        topk_indices=None if idx is None else to(idx),
        return_lse=True,
        kv_cache_scale=None if scale is None else (scale if isinstance(scale, float) else to(scale)),
    )


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_cuda_bf16_equals_cpu_float32(ref, block_size, fp8):
    dims = MLADims(**V2_LITE)
    k = 256
    batch = bf16_batch(ref, dims, block_size, seed=block_size)
    idx = indices(k, seed=block_size)
    cache, scale, cpu_cache = batch.cache.to(torch.bfloat16), None, batch.cache
    kind = None
    if fp8:
        cache, scale = quantize_latent_cache(batch.cache)
        scale = float(scale)
        cpu_cache, kind = cache, "fp8"
    gpu_plan = PrefillPlan.build(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=dims,
        workspace=Workspace(dev()),
        block_size=block_size,
        dtype=torch.bfloat16,
        index_topk=k,
        kv_cache_dtype=kind,
    )
    cpu_plan = PrefillPlan.build(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=dims,
        workspace=Workspace("cpu"),
        block_size=block_size,
        dtype=torch.float32,
        index_topk=k,
        kv_cache_dtype=kind,
    )
    out, lse = call(batch, gpu_plan, idx, cache, scale, dev())
    exp_out, exp_lse = call(batch, cpu_plan, idx, cpu_cache, scale, "cpu")
    torch.testing.assert_close(out.float().cpu(), exp_out, atol=OUT_TOL, rtol=OUT_TOL)
    torch.testing.assert_close(lse.cpu(), exp_lse, atol=LSE_TOL, rtol=0)


def test_triton_and_torch_gather_agree(ref, monkeypatch):
    dims = MLADims(**V2_LITE)
    k = 128
    batch = bf16_batch(ref, dims, 16, seed=3)
    idx = indices(k, seed=3)
    plan = PrefillPlan.build(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=dims,
        workspace=Workspace(dev()),
        block_size=16,
        dtype=torch.bfloat16,
        index_topk=k,
    )
    cache = batch.cache.to(torch.bfloat16)
    auto, auto_lse = call(batch, plan, idx, cache, None, dev())
    monkeypatch.setenv("MLA_BRIDGE_GATHER", "torch")
    forced, forced_lse = call(batch, plan, idx, cache, None, dev())
    assert torch.equal(auto.view(torch.int16), forced.view(torch.int16)) and torch.equal(auto_lse, forced_lse)


def test_all_keys_equals_dense_on_the_gpu(ref):
    dims = MLADims(**V2_LITE)
    k = max(q + c for q, c in zip(QUERY_LENS, CONTEXT_LENS))
    batch = bf16_batch(ref, dims, 16, seed=4)
    idx = indices(k, seed=4, fill=1.0)
    ws = Workspace(dev())
    args = dict(dims=dims, workspace=ws, block_size=16, dtype=torch.bfloat16)
    sparse_plan = PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, index_topk=k, **args)
    dense_plan = PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, **args)
    cache = batch.cache.to(torch.bfloat16)
    out, lse = call(batch, sparse_plan, idx, cache, None, dev())
    dense_out, dense_lse = call(batch, dense_plan, None, cache, None, dev())
    torch.testing.assert_close(out.float(), dense_out.float(), atol=OUT_TOL, rtol=OUT_TOL)
    torch.testing.assert_close(lse, dense_lse, atol=LSE_TOL, rtol=0)
