"""The adapter as vLLM sees it: base class, plugin entry point, registry, AttentionConfig and vLLM's selector.

Runs against the real vLLM package (``bash scripts/test_vllm.sh``); skipped where vLLM is not installed.
"""

import pytest

pytest.importorskip("vllm")
# tests/vllm is itself an importable namespace "vllm" when tests/ is on sys.path: ask for a real vLLM module.
pytest.importorskip("vllm.v1.attention.backends.mla.prefill.base", reason="needs the vllm package")

import inspect  # noqa: E402
from importlib.metadata import entry_points  # noqa: E402

import torch  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.mla.prefill import registry, selector  # noqa: E402
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions, MLAPrefillBackend  # noqa: E402

import mla_bridge.dispatch  # noqa: E402
import mla_bridge_vllm  # noqa: E402
from mla_bridge_vllm.backend import MLABridgePrefillBackend  # noqa: E402

CUSTOM = registry.MLAPrefillBackendEnum.CUSTOM
DEEPSEEK = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@pytest.fixture
def custom_slot():
    """The CUSTOM slot as the test found it, restored afterwards."""
    had, path = CUSTOM.is_overridden(), (CUSTOM.get_path() if CUSTOM.is_overridden() else None)
    CUSTOM.clear_override()
    yield CUSTOM
    CUSTOM.clear_override()
    if had:
        registry.register_mla_prefill_backend(CUSTOM, path)


def test_satisfies_vllm_base_class():
    assert issubclass(MLABridgePrefillBackend, MLAPrefillBackend)
    assert not inspect.isabstract(MLABridgePrefillBackend)
    assert MLABridgePrefillBackend.__abstractmethods__ == frozenset()
    backend = MLABridgePrefillBackend(
        num_heads=16,
        scale=0.1147,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vllm_config=None,
    )
    clone = backend.clone()
    assert type(clone) is MLABridgePrefillBackend and clone is not backend
    assert (clone.num_heads, clone.scale, clone.v_head_dim) == (16, 0.1147, 128)
    assert MLABridgePrefillBackend.get_name() == "MLA_BRIDGE"
    assert backend.supports_out() is True
    # Same call signatures as vLLM's abstract methods (vLLM calls them with keywords).
    for name in ("run_prefill_new_tokens", "run_prefill_context_chunk", "prepare_metadata"):
        ours = list(inspect.signature(getattr(MLABridgePrefillBackend, name)).parameters)
        theirs = list(inspect.signature(getattr(MLAPrefillBackend, name)).parameters)
        assert ours == theirs, (name, ours, theirs)


def test_entry_point_is_installed_and_load_general_plugins_registers(custom_slot, monkeypatch):
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == "mla_bridge_vllm:register"]
    assert len(eps) == 1 and eps[0].name == "mla_bridge", eps
    with pytest.raises(ValueError, match="must be registered"):
        custom_slot.get_path()

    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm.plugins.load_general_plugins()
    assert custom_slot.get_path() == "mla_bridge_vllm.backend.MLABridgePrefillBackend"
    assert custom_slot.get_class() is MLABridgePrefillBackend
    mla_bridge_vllm.register()  # idempotent: vLLM loads plugins in every process, maybe more than once
    assert custom_slot.get_class() is MLABridgePrefillBackend


def test_attention_config_custom_names_the_slot():
    from vllm.config import AttentionConfig

    for spelling in ("custom", "CUSTOM"):
        assert AttentionConfig(mla_prefill_backend=spelling).mla_prefill_backend is CUSTOM


def _as_cuda(monkeypatch, capability):
    """Make vLLM's platform answer like a CUDA device of ``capability`` (the selector's non-CPU branch)."""
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(*capability))
    selector._auto_select_mla_prefill_backend.cache_clear()


@pytest.mark.parametrize(
    "capability,backend", [((9, 0), "flashinfer-fa3"), ((8, 0), "flashinfer-fa2"), ((12, 0), "flashinfer-fa2")]
)
def test_vllm_selector_picks_it_from_attention_config(custom_slot, monkeypatch, capability, backend):
    """vLLM's own ``get_mla_prefill_backend`` with ``mla_prefill_backend="custom"``, on a (stated) CUDA device with
    FlashInfer present, returns the adapter; mla_bridge's dispatch names the kernel it will run."""
    import vllm_harness

    mla_bridge_vllm.register()
    vc = vllm_harness.vllm_config(torch.bfloat16)  # made on the real (CPU) platform, before pretending CUDA
    monkeypatch.setattr(mla_bridge.dispatch, "flashinfer_version", lambda: "0.7.4")
    _as_cuda(monkeypatch, capability)
    assert vc.attention_config.mla_prefill_backend is CUSTOM
    assert selector.get_mla_prefill_backend(vc) is MLABridgePrefillBackend
    choice = mla_bridge.select_backend(capability=capability, dtype=torch.bfloat16, head_dim_qk=192, head_dim_vo=128)
    assert choice.name == backend


@pytest.mark.parametrize(
    "case,capability,dtype,flashinfer,match",
    [
        ("no flashinfer", (9, 0), torch.bfloat16, False, "flashinfer-python is not installed"),
        ("pre-Ampere", (7, 5), torch.bfloat16, True, "needs SM80"),
        ("float32 on CUDA", (9, 0), torch.float32, True, "float16/bfloat16"),
    ],
)
def test_vllm_selector_refuses_what_no_kernel_serves(
    custom_slot, monkeypatch, case, capability, dtype, flashinfer, match
):
    """vLLM raises with mla_bridge's reason rather than silently running the float32 torch reference on a GPU."""
    import vllm_harness

    mla_bridge_vllm.register()
    vc = vllm_harness.vllm_config(dtype)  # made on the real (CPU) platform, before pretending CUDA
    monkeypatch.setattr(mla_bridge.dispatch, "flashinfer_version", lambda: "0.7.4" if flashinfer else None)
    _as_cuda(monkeypatch, capability)
    with pytest.raises(ValueError, match=match) as err:
        selector.get_mla_prefill_backend(vc)
    assert "CUSTOM" in str(err.value) and "mla_bridge" in str(err.value)


def test_capability_dtype_dims_answers_come_from_select_backend(monkeypatch):
    """Each answer is mla_bridge's dispatch table's: no list of our own."""
    monkeypatch.setattr(mla_bridge.dispatch, "flashinfer_version", lambda: "0.7.4")
    cls = MLABridgePrefillBackend
    assert cls.supports_compute_capability(None)  # vLLM's CPU platform: the torch backend
    _as_cuda(monkeypatch, (9, 0))
    assert cls.supports_compute_capability(DeviceCapability(9, 0))
    assert cls.supports_compute_capability(DeviceCapability(8, 6))
    assert not cls.supports_compute_capability(DeviceCapability(7, 5))
    assert not cls.supports_compute_capability(None)
    assert cls.supports_dtype(torch.bfloat16) and cls.supports_dtype(torch.float16)
    assert not cls.supports_dtype(torch.float32)
    assert cls.supports_mla_dimensions(DEEPSEEK)
    # 96/64 (MiniCPM3-like): fa3 refuses those dims and fa2 faults at head dim 96 (flashinfer#4299): no FlashInfer
    # kernel serves it; 128/64 + 64 (192/128 at other splits) still goes to fa3
    assert not cls.supports_mla_dimensions(MLADimensions(qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64))
    assert cls.supports_mla_dimensions(MLADimensions(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128))
    assert not cls.supports_mla_dimensions(MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=72, v_head_dim=128))
    assert cls.is_available()
    monkeypatch.setattr(mla_bridge.dispatch, "flashinfer_version", lambda: None)
    assert not cls.is_available()  # a GPU without FlashInfer: nothing fast can serve
    assert cls.supported_dtypes == [torch.float16, torch.bfloat16]


def test_other_platforms_are_not_served(monkeypatch):
    """ROCm, XPU, TPU...: mla_bridge has no kernel there (FlashInfer is NVIDIA-only, the torch backend is for CPU)."""
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    cls = MLABridgePrefillBackend
    assert not cls.is_available()
    assert not cls.supports_compute_capability(DeviceCapability(9, 4))
    assert not cls.supports_dtype(torch.bfloat16)


def test_cpu_platform_answers():
    """On vLLM's CPU platform the torch backend serves any floating dtype (it computes in float32)."""
    assert current_platform.is_cpu()
    cls = MLABridgePrefillBackend
    assert cls.is_available()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert cls.supports_dtype(dtype)
    assert cls.supports_mla_dimensions(DEEPSEEK)


def test_cli_flag_sets_the_custom_slot():
    """``vllm serve ... --attention-config.mla_prefill_backend CUSTOM``, parsed by vLLM's own argument parser."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct", "--attention-config.mla_prefill_backend", "CUSTOM"]
    )
    attention_config = EngineArgs.from_cli_args(args).attention_config
    if isinstance(attention_config, dict):
        from vllm.config import AttentionConfig

        attention_config = AttentionConfig(**attention_config)
    assert attention_config.mla_prefill_backend is CUSTOM
