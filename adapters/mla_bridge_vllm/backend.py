"""mla_bridge as vLLM's MLA prefill kernel: ``MLABridgePrefillBackend``, a ``MLAPrefillBackend`` (vLLM >= 0.28).

vLLM hands the backend q/k/v already up-projected and gathered (q ``[T, H, 192]``, k ``[S, H, 192]``,
v ``[S, H, 128]`` for DeepSeek). Once per step, ``prepare_metadata`` turns vLLM's prefill metadata into mla_bridge
plans (:class:`mla_bridge_vllm.plans.PrefillStepPlans`) from host copies vLLM already keeps:

* new tokens: ``prefill_metadata.query_lens_cpu`` (vLLM >= 0.29; on 0.28 ``query_start_loc`` is copied to the host
  once per step, a device sync);
* each ``ContextChunk``: keys from ``chunk.seq_lens`` (a host tensor), queries from the new-token offsets of the
  chunk's ``request_slice``; the same values vLLM puts on the device as ``chunk.cu_seq_lens`` /
  ``chunk.query_start_loc``.

Every layer then runs the planned kernels; the LSE comes back as vLLM's merge wants it: natural log, ``[H, T]``.
Which kernel runs (FlashInfer cutlass on SM100, fa3 on SM90, fa2 on SM80+, the torch reference on CPU) and what is
supported is decided by :func:`mla_bridge.select_backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions, MLAPrefillBackend

from .plans import ChunkIndptrs, PrefillStepPlans, host_indptr_from_lens, servable, vllm_strides

if TYPE_CHECKING:
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

__all__ = ["MLABridgePrefillBackend", "BACKEND_NAME"]

BACKEND_NAME = "MLA_BRIDGE"
_NOT_SERVED = "mla_bridge serves NVIDIA GPUs (through FlashInfer) and vLLM's CPU platform only"


def _servable(device_capability: Any = "current", **kwargs: Any) -> tuple[bool, str]:
    """:func:`servable` for vLLM's platform: ``device_capability`` as vLLM passes it, or the current device's."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return servable(None, **kwargs)
    if not current_platform.is_cuda():
        return False, _NOT_SERVED
    if isinstance(device_capability, str):
        device_capability = current_platform.get_device_capability()
    if device_capability is None:
        return False, "the CUDA device's compute capability is unknown"
    return servable((int(device_capability.major), int(device_capability.minor)), **kwargs)


def _head_dims(dims: MLADimensions) -> tuple[int, int]:
    return dims.qk_nope_head_dim + dims.qk_rope_head_dim, dims.v_head_dim


class MLABridgePrefillBackend(MLAPrefillBackend):
    """vLLM MLA prefill through mla_bridge (FlashInfer ragged kernels on GPU, the torch reference on CPU).

    Select it with ``--attention-config.mla_prefill_backend CUSTOM`` once :func:`mla_bridge_vllm.register` has run
    (the ``vllm.general_plugins`` entry point does that in every vLLM process).

    Supported dtypes: float16 and bfloat16 (FlashInfer's); on vLLM's CPU platform any floating dtype (the torch
    backend computes in float32). Dimensions: whatever a FlashInfer kernel of mla_bridge's dispatch table takes
    (:data:`mla_bridge.dispatch.BACKENDS`) at head dims ``qk_nope_head_dim + qk_rope_head_dim`` / ``v_head_dim``,
    ``qk_rope_head_dim`` 0 included: 192/128 (DeepSeek-V2/V3, Kimi, ...) and 128/128 (Mistral 4) on SM100 (cutlass),
    SM90 (fa3) and SM80 (fa2); 256/256 (GLM-4.7-Flash, GLM-5, glm5_next's 256+0) on fa3 (SM90) and fa2 (SM100,
    SM80); 256/128 on fa2 (the dims of dots3_note's sliding-window layers, which vLLM runs through that model's own
    prefill backend: a window is never served here); 96/64 (MiniCPM3) on none, so refused on a GPU with
    vLLM's words "Model does not have supported MLA dimensions (got ...)" and the dispatch's reason. On vLLM's CPU
    platform every dims. No FP8 query/output quantization.

    FP8 KV cache (``--kv-cache-dtype fp8``): selectable and correct as is. vLLM 0.32's prefill selector asks nothing
    about the cache dtype (``MLAPrefillSelectorConfig`` holds the model dtype and MLA dims only); vLLM dequantizes
    the context itself (``gather_and_maybe_dequant_cache``) and quantizes prefill queries to FP8 only for the
    backends it names (FLASHINFER, TRTLLM_RAGGED, TOKENSPEED_MLA on SM100), so this backend gets bf16 q/k/v
    (tests/vllm/test_vllm_fp8.py checks all three facts).
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # Empty: dims are answered by supports_mla_dimensions from mla_bridge's dispatch table, not by a list here.
    supported_mla_dimensions: ClassVar[list[MLADimensions]] = []

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    # --- what can be served: every answer comes from mla_bridge.select_backend ---------------------------------
    @classmethod
    def supports_compute_capability(cls, device_capability: Any) -> bool:
        return _servable(device_capability)[0]

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return _servable(dtype=dtype)[0]

    @classmethod
    def supports_mla_dimensions(cls, mla_dimensions: MLADimensions) -> bool:
        qk, vo = _head_dims(mla_dimensions)
        return _servable(head_dim_qk=qk, head_dim_vo=vo)[0]

    @classmethod
    def is_available(cls) -> bool:
        return _servable()[0]

    @classmethod
    def validate_configuration(cls, device_capability: Any, selector_config: Any) -> list[str]:
        """Why this backend cannot serve ``selector_config`` (its ``dtype`` and ``mla_dimensions``) on
        ``device_capability``, as vLLM's base class words it: ``[]`` when mla_bridge's dispatch serves the three
        together; else one entry per failing part, each with mla_bridge's reason. Dims that the capability and dtype
        alone would not refuse read ``"Model does not have supported MLA dimensions (got (qk_nope_head_dim=...,
        qk_rope_head_dim=..., v_head_dim=...); head dims qk/vo; mla_bridge: <reason>)"``, as vLLM's own message
        for dims starts; a capability or dtype that no backend serves reads ``"mla_bridge: <reason>"``."""
        dims, dtype = selector_config.mla_dimensions, selector_config.dtype
        qk, vo = _head_dims(dims)
        ok, why = _servable(device_capability, dtype=dtype, head_dim_qk=qk, head_dim_vo=vo)
        if ok:
            return []
        reasons = []
        served, why_not = _servable(device_capability, dtype=dtype)
        if not served:  # the capability or the dtype alone: say so, then whether the dims would do there
            reasons.append(f"mla_bridge: {why_not}")
            if not _servable(device_capability)[0]:
                return reasons  # nothing serves this device: its dims are no further reason
            ok, why = _servable(device_capability, head_dim_qk=qk, head_dim_vo=vo)
            if ok:
                return reasons
        reasons.append(
            f"Model does not have supported MLA dimensions (got {dims}; head dims {qk}/{vo}; mla_bridge: {why})"
        )
        return reasons

    def supports_out(self) -> bool:
        return True  # both run methods write into a given out [T, H, v_head_dim]

    # --- per step ---------------------------------------------------------------------------------------------
    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: Any,
    ) -> None:
        super().__init__(
            num_heads=num_heads,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            vllm_config=vllm_config,
        )
        self._plans: Optional[PrefillStepPlans] = None

    def _dtype(self, prefill_metadata: "MLACommonPrefillMetadata") -> torch.dtype:
        dtype = prefill_metadata.q_data_type
        if dtype is None:
            dtype = self.vllm_config.model_config.dtype
        out_dtype = prefill_metadata.output_dtype
        if out_dtype is not None and out_dtype != dtype:
            raise ValueError(
                f"mla_bridge_vllm: query dtype {dtype} differs from output dtype {out_dtype}; "
                f"FP8 prefill queries are not supported by mla_bridge"
            )
        return dtype

    def prepare_metadata(self, prefill_metadata: "MLACommonPrefillMetadata") -> None:
        """Plan this step's kernels once: the new tokens' causal pass and one pass per context chunk."""
        super().prepare_metadata(prefill_metadata)
        self._plans = None  # give the previous step's pooled FlashInfer wrappers back before planning
        query_lens = getattr(prefill_metadata, "query_lens_cpu", None)
        if query_lens is not None:
            qo = host_indptr_from_lens(query_lens)
        else:  # vLLM 0.28 does not fill query_lens_cpu: one host copy per step
            qo = prefill_metadata.query_start_loc.to("cpu", torch.int32)
        chunks = []
        ctx = prefill_metadata.chunked_context
        if ctx is not None:
            for chunk in ctx.chunks:
                r0, r1 = chunk.request_slice.start, chunk.request_slice.stop
                chunks.append(
                    ChunkIndptrs(chunk.index, qo[r0 : r1 + 1] - qo[r0], host_indptr_from_lens(chunk.seq_lens))
                )
        self._plans = PrefillStepPlans(
            qo,
            chunks,
            num_heads=self.num_heads,
            head_dim_qk=self.qk_nope_head_dim + self.qk_rope_head_dim,
            head_dim_vo=self.v_head_dim,
            sm_scale=self.scale,
            dtype=self._dtype(prefill_metadata),
            device=prefill_metadata.query_start_loc.device,
            strides=vllm_strides(self.num_heads, self.qk_nope_head_dim, self.v_head_dim),
        )

    def _step(self) -> PrefillStepPlans:
        if self._plans is None:
            raise RuntimeError("mla_bridge_vllm: run before prepare_metadata planned this step")
        return self._plans

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: Optional[torch.Tensor] = None,
        output_scale: Optional[torch.Tensor] = None,
    ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        if output_scale is not None:
            raise NotImplementedError(
                "mla_bridge_vllm: fused FP8 output quantization is not supported (supports_quant_output() is False)"
            )
        return self._step().run_new_tokens(q, k, v, return_softmax_lse, out=out)

    def run_prefill_context_chunk(
        self,
        chunk: "MLACommonPrefillMetadata.ContextChunk",
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._step().run_context_chunk(chunk.index, q, k, v, out=out)
