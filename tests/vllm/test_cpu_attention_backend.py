"""The suite's vLLM set-up means the same on any x86 CPU, AMX or not.

vLLM's CPU platform picks its AMX MLA attention backend (``AMX_MLA``, compiled ops only) whenever
``torch.cpu._is_amx_tile_supported()`` is True, unless ``CPU_MLA`` is named in ``AttentionConfig.backend``. The lean
vLLM install has no compiled CPU ops, so on an AMX machine the harness failed in ``amx_mla.py``
(``torch.ops._C.convert_weight_packed`` missing) until it named ``CPU_MLA``. Here the whole set-up (config, layer,
metadata, forward) runs with the AMX answer forced both ways, on whatever CPU runs the tests.
"""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.v1.attention.backends.mla.prefill.base", reason="needs the vllm package")

import torch  # noqa: E402
import vllm_harness as H  # noqa: E402

if not H.HAS_CPU_MLA_PREFILL:
    pytest.skip(f"vLLM {H.vllm_version()} has no CPU MLA prefill path to drive", allow_module_level=True)

from vllm.v1.attention import selector as attn_selector  # noqa: E402

from mla_bridge_vllm.backend import MLABridgePrefillBackend  # noqa: E402


@pytest.fixture(params=[False, True], ids=["no-amx", "amx"])
def forced_amx(request, monkeypatch):
    """``torch.cpu._is_amx_tile_supported`` answers ``request.param``; the harness makes a fresh config (vLLM
    adjusts it to the platform when it is made) and vLLM's cached attention-backend choice is cleared."""
    amx = request.param
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(H, "_CONFIGS", {})
    attn_selector._cached_get_attn_backend.cache_clear()
    yield amx
    attn_selector._cached_get_attn_backend.cache_clear()


def test_setup_runs_vllm_cpu_mla_with_and_without_amx(forced_amx):
    assert torch.cpu._is_amx_tile_supported() is forced_amx
    dtype = torch.bfloat16
    batch = H.make_batch(dtype, seed=5)
    layer = H.make_layer(dtype, batch.w)
    assert layer.attn_backend.get_name() == "CPU_MLA"
    assert H.vllm_config(dtype).cache_config.block_size == H.BLOCK
    step = H.build_step(layer, batch)
    assert isinstance(step.backend, MLABridgePrefillBackend)
    out = H.forward(step, batch)
    ref = H.reference(batch)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
