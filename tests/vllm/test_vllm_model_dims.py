"""The vLLM adapter at the MLA dims of the models people serve: what ``MLABridgePrefillBackend`` answers vLLM for each
``MLADimensions`` of transformers' MLA model types on SM100, SM90, SM80 and vLLM's CPU platform, and its run path
(``__init__``, ``prepare_metadata``, ``run_prefill_new_tokens``, ``run_prefill_context_chunk``) at those dims on the
CPU against a float64 attention.

Runs with or without vLLM: where vLLM is installed its own ``MLADimensions`` / ``MLAPrefillBackend`` /
``current_platform`` are used; elsewhere (the core CI) stand-ins of vLLM 0.33's ``vllm.platforms`` and
``vllm.v1.attention.backends.mla.prefill.base`` are put in ``sys.modules`` for this module's tests only, and the
adapter's backend module is imported against them. Self-contained: no helper module of the suite is imported.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.util
import sys
import types
from typing import ClassVar, NamedTuple

import pytest
import torch

import mla_bridge.dispatch as dispatch
from mla_bridge import select_backend
from mla_bridge_vllm.plans import servable

#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) -> (model types, heads and kv_lora_rank the run test uses): one
#: entry per row of transformers' MLA model types (heads capped at 40 to keep the CPU run short).
MODEL_DIMS = {
    (128, 64, 128): ("deepseek_v2/v3, kimi, longcat...", 16, 512),
    (192, 64, 256): ("glm4_moe_lite, glm_moe_dsa, hy_v4", 20, 512),
    (256, 0, 256): ("glm5_next (no RoPE part)", 8, 512),
    (64, 64, 128): ("mistral4, mistral_large4", 32, 256),
    (64, 32, 64): ("minicpm3, axk2", 40, 256),
    (64, 32, 128): ("minicpm3 with v_head_dim 128 in its config", 8, 128),
    (192, 64, 128): ("dots3_note's sliding-window layers", 16, 1024),
}
#: head dims qk/vo -> the backend mla_bridge's dispatch table picks on (SM100, SM90, SM80); None: no FlashInfer row
#: serves them, so the adapter refuses (the torch reference is not handed to a serving engine on a GPU).
WANT = {
    (192, 128): ("flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2"),
    (256, 256): ("flashinfer-fa2", "flashinfer-fa3", "flashinfer-fa2"),
    (128, 128): ("flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2"),
    (96, 64): (None, None, None),
    (96, 128): (None, None, None),
    (256, 128): ("flashinfer-fa2", "flashinfer-fa2", "flashinfer-fa2"),
}
CAPABILITIES = ((10, 0), (9, 0), (8, 0))
DIMS_IDS = [f"{n}+{r}-{v}" for n, r, v in MODEL_DIMS]


class Capability(NamedTuple):
    """What vLLM passes as ``device_capability`` (its ``DeviceCapability``: ``major``, ``minor``)."""

    major: int
    minor: int


# ----------------------------------------------------------------------------------------------------------------
# vLLM, or stand-ins of the parts the backend module imports
# ----------------------------------------------------------------------------------------------------------------


def _has_vllm() -> bool:
    spec = importlib.util.find_spec("vllm")  # tests/vllm alone is a namespace package (origin None): not vLLM
    return spec is not None and spec.origin is not None


def _stand_in_modules() -> dict[str, types.ModuleType]:
    """vLLM 0.33's ``MLADimensions`` and ``MLAPrefillBackend`` (the members the adapter uses or inherits, with their
    semantics: an empty ``supported_mla_dimensions`` serves every dims; ``validate_configuration`` lists the
    capability, dtype, availability and dims reasons) and a ``current_platform`` answering as vLLM's CPU one."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MLADimensions:
        qk_nope_head_dim: int
        qk_rope_head_dim: int
        v_head_dim: int

        def __str__(self) -> str:
            return (
                f"(qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim})"
            )

    class MLAPrefillBackend(abc.ABC):
        supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
        supported_mla_dimensions: ClassVar[list[MLADimensions]] = []

        @staticmethod
        @abc.abstractmethod
        def get_name() -> str: ...

        @classmethod
        def supports_compute_capability(cls, device_capability) -> bool:
            return True

        @classmethod
        def supports_dtype(cls, dtype) -> bool:
            return dtype in cls.supported_dtypes

        @classmethod
        def supports_mla_dimensions(cls, mla_dimensions) -> bool:
            return not cls.supported_mla_dimensions or mla_dimensions in cls.supported_mla_dimensions

        @classmethod
        def is_available(cls) -> bool:
            return True

        @classmethod
        def validate_configuration(cls, device_capability, selector_config) -> list[str]:
            reasons = []
            if not cls.supports_compute_capability(device_capability):
                reasons.append(f"compute capability {device_capability.major}.{device_capability.minor} not supported")
            if not cls.supports_dtype(selector_config.dtype):
                reasons.append(f"dtype {selector_config.dtype} not supported")
            if not cls.is_available():
                reasons.append("required dependencies not available")
            if not cls.supports_mla_dimensions(selector_config.mla_dimensions):
                reasons.append(f"Model does not have supported MLA dimensions (got {selector_config.mla_dimensions})")
            return reasons

        def __init__(
            self, num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, vllm_config
        ) -> None:
            self.num_heads, self.scale, self.kv_lora_rank = num_heads, scale, kv_lora_rank
            self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
            )
            self.vllm_config = vllm_config

        def prepare_metadata(self, prefill_metadata) -> None:
            self._prefill_metadata = prefill_metadata

        @abc.abstractmethod
        def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None): ...

        @abc.abstractmethod
        def run_prefill_context_chunk(self, chunk, q, k, v, out=None): ...

    platform = types.SimpleNamespace(
        is_cpu=lambda: True, is_cuda=lambda: False, get_device_capability=lambda device_id=0: None
    )
    names = [
        "vllm",
        "vllm.platforms",
        "vllm.v1",
        "vllm.v1.attention",
        "vllm.v1.attention.backends",
        "vllm.v1.attention.backends.mla",
        "vllm.v1.attention.backends.mla.prefill",
        "vllm.v1.attention.backends.mla.prefill.base",
    ]
    modules = {name: types.ModuleType(name) for name in names}
    for name in names[1:]:
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, modules[name])
    modules["vllm.platforms"].current_platform = platform  # type: ignore[attr-defined]
    base = modules["vllm.v1.attention.backends.mla.prefill.base"]
    base.MLADimensions, base.MLAPrefillBackend = MLADimensions, MLAPrefillBackend  # type: ignore[attr-defined]
    return modules


@pytest.fixture(scope="module")
def vllm_api():
    """``(backend module, MLADimensions, current_platform)``: vLLM's own where installed, else the stand-ins (put in
    ``sys.modules``, with the adapter's backend module imported against them, all taken back after the module)."""
    if _has_vllm():
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.mla.prefill.base import MLADimensions

        yield importlib.import_module("mla_bridge_vllm.backend"), MLADimensions, current_platform
        return
    import mla_bridge_vllm

    with pytest.MonkeyPatch.context() as mp:
        for name, module in _stand_in_modules().items():
            mp.setitem(sys.modules, name, module)
        mp.delitem(sys.modules, "mla_bridge_vllm.backend", raising=False)
        mp.setattr(mla_bridge_vllm, "backend", None, raising=False)  # the stand-in import's attribute, taken back
        backend = importlib.import_module("mla_bridge_vllm.backend")
        base = sys.modules["vllm.v1.attention.backends.mla.prefill.base"]
        yield backend, base.MLADimensions, sys.modules["vllm.platforms"].current_platform
        sys.modules.pop("mla_bridge_vllm.backend", None)


@pytest.fixture
def on_platform(vllm_api, monkeypatch):
    """``on_platform(capability or None)``: vLLM's platform answers as a CUDA device of that capability (FlashInfer
    0.7.4 installed, CUDA 12.8) or as vLLM's CPU platform."""
    _, _, platform = vllm_api
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # the cutlass row needs CUDA >= 12.8 on SM100

    def set_platform(capability):
        cpu = capability is None
        monkeypatch.setattr(platform, "is_cpu", lambda: cpu)
        monkeypatch.setattr(platform, "is_cuda", lambda: not cpu)
        monkeypatch.setattr(
            platform, "get_device_capability", lambda device_id=0: None if cpu else Capability(*capability)
        )

    return set_platform


def _selector_config(dims, dtype=torch.bfloat16):
    return types.SimpleNamespace(dtype=dtype, mla_dimensions=dims)  # the two fields vLLM's selector config carries


# ----------------------------------------------------------------------------------------------------------------
# what the backend answers vLLM
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nope,rope,v", MODEL_DIMS, ids=DIMS_IDS)
def test_cuda_answers_are_the_dispatch_tables(vllm_api, on_platform, nope, rope, v):
    """On SM100, SM90 and SM80: served exactly where a FlashInfer row of mla_bridge's dispatch serves head dims
    ``(nope + rope) / v``; refused otherwise, with vLLM's words for dims followed by mla_bridge's reason."""
    backend, MLADimensions, _ = vllm_api
    cls = backend.MLABridgePrefillBackend
    dims = MLADimensions(qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
    qk, vo = nope + rope, v
    for capability, want in zip(CAPABILITIES, WANT[(qk, vo)]):
        on_platform(capability)
        choice = select_backend(capability=capability, dtype=torch.bfloat16, head_dim_qk=qk, head_dim_vo=vo)
        assert (choice.name if choice.is_flashinfer else None) == want, (capability, choice.reason)
        ok, why = servable(capability, dtype=torch.bfloat16, head_dim_qk=qk, head_dim_vo=vo)
        assert ok is (want is not None) and (why.startswith(f"{want}: ") if ok else "no FlashInfer backend" in why)
        assert cls.supports_mla_dimensions(dims) is ok, capability
        reasons = cls.validate_configuration(Capability(*capability), _selector_config(dims))
        if ok:
            assert reasons == []
            continue
        assert len(reasons) == 1, reasons
        assert reasons[0].startswith(f"Model does not have supported MLA dimensions (got {dims}; head dims {qk}/{vo}")
        assert f"mla_bridge: no FlashInfer backend serves capability {capability[0]}.{capability[1]}" in reasons[0]
        assert f"head_dim_qk {qk} is not a multiple of 64" in reasons[0]  # fa2's reason names the dim
        assert str(dims) == f"(qk_nope_head_dim={nope}, qk_rope_head_dim={rope}, v_head_dim={v})"


@pytest.mark.parametrize("nope,rope,v", MODEL_DIMS, ids=DIMS_IDS)
def test_cpu_platform_serves_every_model_dims(vllm_api, on_platform, nope, rope, v):
    backend, MLADimensions, _ = vllm_api
    cls = backend.MLABridgePrefillBackend
    dims = MLADimensions(qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
    on_platform(None)
    assert cls.supports_mla_dimensions(dims)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert cls.validate_configuration(None, _selector_config(dims, dtype)) == []
    ok, why = servable(None, dtype=torch.bfloat16, head_dim_qk=nope + rope, head_dim_vo=v)
    assert ok and why.startswith("torch: ")


def test_capability_and_dtype_reasons_come_before_the_dims(vllm_api, on_platform):
    """A capability no backend serves is the one reason (dims do not matter there); a dtype FlashInfer does not run
    is named, and dims refused at that capability whatever the dtype are named too."""
    backend, MLADimensions, _ = vllm_api
    cls = backend.MLABridgePrefillBackend
    glm = MLADimensions(qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)
    minicpm = MLADimensions(qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
    on_platform((7, 5))
    for dims in (glm, minicpm):
        (reason,) = cls.validate_configuration(Capability(7, 5), _selector_config(dims))
        assert reason.startswith("mla_bridge: no FlashInfer backend serves capability 7.5") and "needs SM80" in reason
    on_platform((9, 0))
    (reason,) = cls.validate_configuration(Capability(9, 0), _selector_config(glm, torch.float32))
    assert reason.startswith("mla_bridge: ") and "float16/bfloat16" in reason
    dtype_reason, dims_reason = cls.validate_configuration(Capability(9, 0), _selector_config(minicpm, torch.float32))
    assert "float16/bfloat16" in dtype_reason
    assert dims_reason.startswith(f"Model does not have supported MLA dimensions (got {minicpm}; head dims 96/64")


# ----------------------------------------------------------------------------------------------------------------
# the run path at these dims, on the CPU
# ----------------------------------------------------------------------------------------------------------------

# Four requests; chunk 2 continues request 2's context begun in chunk 1; request 1 has no context.
QUERY_LENS, CONTEXT_LENS = (3, 2, 4, 1), (6, 0, 9, 3)
#: (index, request slice, context start per request, context tokens per request), as vLLM's ContextChunk holds them
CHUNKS = ((0, slice(0, 1), (0,), (6,)), (1, slice(2, 3), (0,), (4,)), (2, slice(2, 4), (4, 0), (5, 3)))


def _metadata(dtype):
    """The fields of vLLM's ``MLACommonPrefillMetadata`` the backend reads (host query lengths, the context
    chunks)."""
    lens = torch.tensor(QUERY_LENS, dtype=torch.int32)
    chunks = [
        types.SimpleNamespace(index=i, request_slice=rs, starts=starts, seq_lens=torch.tensor(n, dtype=torch.int32))
        for i, rs, starts, n in CHUNKS
    ]
    return types.SimpleNamespace(
        query_lens_cpu=lens,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]),
        chunked_context=types.SimpleNamespace(chunks=chunks),
        q_data_type=dtype,
        output_dtype=dtype,
    )


def _up_project(latent, w, heads, nope, rope, v):
    """vLLM's ``forward_mha`` k / v of ``latent [S, rank + rope]``: k a fresh ``[S, H, nope + rope]`` (k_nope ++ the
    broadcast k_pe; k_pe ``[S, 1, 0]`` without a RoPE part), v a strided view of the ``[S, H, nope + v]`` product."""
    rank = latent.shape[-1] - rope
    kv_nope = (latent[:, :rank] @ w.t()).view(-1, heads, nope + v)
    k_nope, v_view = kv_nope.split([nope, v], dim=-1)
    k = torch.empty(*k_nope.shape[:-1], nope + rope, dtype=k_nope.dtype)
    k[..., :nope] = k_nope
    k[..., nope:] = latent[:, None, rank:]
    return k, v_view


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partials of the same queries (lse ``[H, T]`` natural log, -inf: no key) merged, in float64."""
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa, wb = torch.exp(lse_a.double() - safe).t()[..., None], torch.exp(lse_b.double() - safe).t()[..., None]
    return out_a.double() * wa + out_b.double() * wb, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nope,rope,v", MODEL_DIMS, ids=DIMS_IDS)
def test_run_path_at_model_dims_equals_float64(vllm_api, on_platform, monkeypatch, nope, rope, v, dtype):
    """``__init__`` with the model's dims, ``prepare_metadata`` (plans of head dims ``nope + rope`` / ``v``), then
    the new tokens' pass and each context chunk's as ``forward_mha`` drives them, merged: a float64 attention over
    each request's context and its new tokens (causal)."""
    backend, _, _ = vllm_api
    on_platform(None)
    _, heads, rank = MODEL_DIMS[(nope, rope, v)]
    scale = (nope + rope) ** -0.5
    g = torch.Generator().manual_seed(nope + rope + v)
    t = sum(QUERY_LENS)
    w = (torch.randn(heads * (nope + v), rank, generator=g) * rank**-0.5).to(dtype)
    q = torch.randn(t, heads, nope + rope, generator=g).to(dtype)
    new_latent = torch.randn(t, rank + rope, generator=g).to(dtype)
    context = [torch.randn(c, rank + rope, generator=g).to(dtype) for c in CONTEXT_LENS]

    impl = backend.MLABridgePrefillBackend(
        num_heads=heads,
        scale=scale,
        kv_lora_rank=rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype)),
    )
    made = []
    real_plans = backend.PrefillStepPlans

    def record(*args, **kwargs):
        made.append(real_plans(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(backend, "PrefillStepPlans", record)
    impl.prepare_metadata(_metadata(dtype))
    (plans,) = made
    assert sorted(plans.chunks) == [0, 1, 2]
    for plan in (plans.main, *plans.chunks.values()):
        assert (plan.spec.head_dim_qk, plan.spec.head_dim_vo, plan.spec.num_heads) == (nope + rope, v, heads)
        assert plan.spec.sm_scale == scale and plan.backend.name == "torch"

    k, v_new = _up_project(new_latent, w, heads, nope, rope, v)
    out, lse = impl.run_prefill_new_tokens(q, k, v_new, return_softmax_lse=True)
    assert out.shape == (t, heads, v) and out.dtype == dtype and lse.shape == (heads, t)
    acc_out, acc_lse = out.double(), lse.double()
    qo = [0]
    for n in QUERY_LENS:
        qo.append(qo[-1] + n)
    for chunk in _metadata(dtype).chunked_context.chunks:
        r0, r1 = chunk.request_slice.start, chunk.request_slice.stop
        latent = torch.cat([context[r][s : s + int(n)] for r, s, n in zip(range(r0, r1), chunk.starts, chunk.seq_lens)])
        ck, cv = _up_project(latent, w, heads, nope, rope, v)
        c_out, c_lse = impl.run_prefill_context_chunk(chunk, q[qo[r0] : qo[r1]], ck, cv)
        assert c_out.shape == (qo[r1] - qo[r0], heads, v) and c_lse.shape == (heads, qo[r1] - qo[r0])
        merged = _merge(acc_out[qo[r0] : qo[r1]], acc_lse[:, qo[r0] : qo[r1]], c_out, c_lse)
        acc_out[qo[r0] : qo[r1]], acc_lse[:, qo[r0] : qo[r1]] = merged

    want = torch.zeros(t, heads, v, dtype=torch.float64)
    w64 = w.double()
    for r, (n, ctx) in enumerate(zip(QUERY_LENS, context)):
        seq = torch.cat([ctx, new_latent[qo[r] : qo[r + 1]]]).double()
        kv = (seq[:, :rank] @ w64.t()).view(-1, heads, nope + v)
        keys = torch.cat([kv[..., :nope], seq[:, None, rank:].expand(-1, heads, rope)], -1)
        mask = torch.ones(n, len(seq), dtype=torch.bool).tril(len(seq) - n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qo[r] : qo[r + 1]].double().transpose(0, 1),
            keys.transpose(0, 1),
            kv[..., nope:].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        want[qo[r] : qo[r + 1]] = o.transpose(0, 1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(acc_out, want, **tol)
