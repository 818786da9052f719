"""The adapter under vLLM's ``kv_cache_dtype="fp8"`` (vLLM's ``fp8`` / ``fp8_e4m3`` MLA cache).

What vLLM asks (read from vLLM 0.32): the MLA prefill selector's ``MLAPrefillSelectorConfig`` holds the model dtype
and the MLA dims only, no KV-cache dtype; with an FP8 cache vLLM gathers and dequantizes the context itself
(``gather_and_maybe_dequant_cache``) and quantizes prefill queries to FP8 only for the backends it names
(``backend_supports_prefill_query_quantization``: FLASHINFER, TRTLLM_RAGGED, TOKENSPEED_MLA on SM100), so the
adapter gets bf16 q/k/v. vLLM's CPU platform has no FP8 MLA cache (``CPUMLABackend.supported_kv_cache_dtypes`` is
``["auto"]``), so the forward runs vLLM's own path on the cache dequantized the way vLLM's gather does, and is
compared with mla_bridge's FP8 path on the same bytes.
"""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.v1.attention.backends.mla.prefill.base", reason="needs the vllm package")

import torch  # noqa: E402
import vllm_harness as H  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.mla.prefill import selector  # noqa: E402

import mla_bridge  # noqa: E402
import mla_bridge.dispatch  # noqa: E402
import mla_bridge_vllm  # noqa: E402
from mla_bridge.cache import quantize_latent_cache  # noqa: E402
from mla_bridge_vllm.backend import MLABridgePrefillBackend  # noqa: E402

if not H.HAS_CPU_MLA_PREFILL:
    pytest.skip(f"vLLM {H.vllm_version()} has no CPU MLA prefill path to drive", allow_module_level=True)


def test_selector_asks_nothing_about_the_kv_cache_dtype():
    """If a vLLM adds a KV-cache dtype question to the prefill selector, the adapter must answer it: this fails."""
    fields = selector.MLAPrefillSelectorConfig._fields
    assert set(fields) == {"dtype", "mla_dimensions"}, fields


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_selectable_with_an_fp8_cache_and_gets_bf16_queries(monkeypatch, capability):
    from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    mla_bridge_vllm.register()
    vc = VllmConfig(
        model_config=ModelConfig(
            model=H._model_dir(), skip_tokenizer_init=True, dtype=torch.bfloat16, max_model_len=1024
        ),
        cache_config=CacheConfig(block_size=H.BLOCK, cache_dtype="fp8"),
        attention_config=AttentionConfig(mla_prefill_backend="custom"),
    )
    assert vc.cache_config.cache_dtype == "fp8"
    monkeypatch.setattr(mla_bridge.dispatch, "flashinfer_version", lambda: "0.7.4")
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(*capability))
    monkeypatch.setattr(
        current_platform, "is_device_capability_family", lambda fam, device_id=0: capability[0] * 10 == fam
    )
    selector._auto_select_mla_prefill_backend.cache_clear()
    assert selector.get_mla_prefill_backend(vc) is MLABridgePrefillBackend
    with set_current_vllm_config(vc):
        q_dtype = MLACommonMetadataBuilder.determine_prefill_query_data_type(vc, torch.bfloat16)
    assert q_dtype == torch.bfloat16  # never FP8 queries for MLA_BRIDGE, on SM100 neither
    selector._auto_select_mla_prefill_backend.cache_clear()


def test_forward_on_vllms_dequantized_cache_matches_mla_bridge_fp8():
    dtype = torch.bfloat16
    batch = H.make_batch(dtype, seed=4)
    cache8, scale = quantize_latent_cache(batch.cache)  # the rounding of vLLM's fp8 cache write
    # what vLLM's gather_and_maybe_dequant_cache hands the prefill path: float32(stored) * scale, rounded to bf16
    batch.cache = (cache8.float() * float(scale)).to(dtype)
    step = H.build_step(H.make_layer(dtype, batch.w), batch)
    out_vllm = H.forward(step, batch)

    ws = mla_bridge.Workspace("cpu", chunk_tokens=H.WORKSPACE_TOKENS)
    plan = mla_bridge.PrefillPlan.build(
        batch.query_lens,
        batch.context_lens,
        dims=mla_bridge.MLADims(num_heads=H.HEADS, softmax_scale=H.SCALE),
        workspace=ws,
        block_size=H.BLOCK,
        dtype=dtype,
        kv_cache_dtype="fp8",
    )
    out_core = mla_bridge.mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, cache8, batch.block_table, plan, kv_cache_scale=scale
    )
    # the float64 reference over the dequantized latents (the unpaged copies, dequantized the same way)
    batch.context = [
        (quantize_latent_cache(c.float(), scale)[0].float() * float(scale)).to(dtype) for c in batch.context
    ]
    ref = H.reference(batch)
    for out in (out_vllm, out_core):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out_core.double(), out_vllm.double(), rtol=1e-2, atol=1e-2)
