"""The served models' MLA dims on the GPU: mla_prefill in bf16 (FlashInfer where a row serves the head dims, the torch
backend otherwise), each kv implementation (the Triton gather + cuBLAS, the fused Triton gather + up-projection) from a
bf16 and an FP8 cache, fused and chunked, against the float64 reference, within the CLI's bf16 tolerance.
Run on the H200: python3 -m pytest tests/gpu/test_gpu_model_dims.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill  # noqa: E402
from mla_bridge.cache import quantize_latent_cache  # noqa: E402
from mla_bridge.cli.prefill import TOLERANCE  # noqa: E402

MODEL_DIMS = {  # (num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    "kimi_k2": (64, 512, 128, 64, 128),
    "glm4_moe_lite": (20, 512, 192, 64, 256),
    "glm_moe_dsa": (64, 512, 192, 64, 256),
    "glm5_next": (64, 512, 256, 0, 256),
    "mistral4": (32, 256, 64, 64, 128),
    "minicpm3": (40, 256, 64, 32, 64),
    "axk2": (32, 128, 64, 32, 64),
    "dots3_note-swa": (64, 1024, 192, 64, 128),
}
EXPECTED_BACKEND_SM90 = {
    "kimi_k2": "flashinfer-fa3",
    "glm4_moe_lite": "flashinfer-fa3",
    "glm_moe_dsa": "flashinfer-fa3",
    "glm5_next": "flashinfer-fa3",
    "mistral4": "flashinfer-fa3",
    "minicpm3": "torch",
    "axk2": "torch",
    "dots3_note-swa": "flashinfer-fa2",
}
Q_LENS, C_LENS = [37, 5, 64, 1], [100, 0, 33, 250]


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
@pytest.mark.parametrize("kv_impl", ["separate", "fused"])
@pytest.mark.parametrize("name", MODEL_DIMS)
def test_model_dims_bf16_equal_float64(ref, name, kv_impl, kv_cache):
    h, r, n, p, v = MODEL_DIMS[name]
    dims = MLADims(num_heads=h, kv_lora_rank=r, qk_nope_head_dim=n, qk_rope_head_dim=p, v_head_dim=v)
    batch = ref.make_mla_batch(dims, Q_LENS, C_LENS, 16, seed=7, dtype=torch.bfloat16, device="cuda")
    cache, scale = batch.cache, None
    if kv_cache == "fp8":
        cache, scale = quantize_latent_cache(batch.cache.float())
        batch.cache = cache.double() * float(scale)  # the reference reads the same bytes in float64
    exp_out, exp_lse = ref.mla_reference(batch)
    (oa, orel), (la, lrel) = TOLERANCE["bfloat16"]
    for chunk, fuse in ((100_000, True), (128, False)):
        plan = PrefillPlan.build(
            Q_LENS,
            C_LENS,
            dims=dims,
            workspace=Workspace("cuda", chunk_tokens=chunk),
            block_size=16,
            dtype=torch.bfloat16,
            fuse_context=fuse,
            kv_cache_dtype="fp8" if kv_cache == "fp8" else None,
        )
        if torch.cuda.get_device_capability()[0] == 9:
            assert plan.backend.name == EXPECTED_BACKEND_SM90[name], plan.backend.reason
        torch.cuda._sleep(int(5e7))  # keep the GPU busy so the host runs ahead
        out, lse = mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            cache,
            batch.block_table,
            plan,
            return_lse=True,
            kv_cache_scale=scale,
            kv_impl=kv_impl,
        )
        out64, lse64 = out.double().cpu(), lse.double().cpu()
        ex_out = ((out64 - exp_out.cpu()).abs() - (oa + orel * exp_out.cpu().abs())).max().item()
        ex_lse = ((lse64 - exp_lse.cpu()).abs() - (la + lrel * exp_lse.cpu().abs())).max().item()
        print(f"{name} {kv_impl} {kv_cache} fuse={fuse}: {plan.backend.name}, excess out {ex_out:.3g} lse {ex_lse:.3g}")
        assert ex_out <= 0 and ex_lse <= 0, (name, kv_impl, kv_cache, fuse, ex_out, ex_lse)
