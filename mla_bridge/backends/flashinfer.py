"""FlashInfer ragged prefill (``BatchPrefillWithRaggedKVCacheWrapper``): plan once per batch, run per layer.

The only module that talks to FlashInfer's attention wrapper, and the one place where FlashInfer's base-2 LSE
becomes mla_bridge's natural-log LSE: ``run(..., lse_base="ln")`` (FlashInfer 0.7.4 scales its base-2 LSE by ln 2
in one small kernel, or fuses it into the ``[H, T]`` transpose for ``lse_layout="HN"``).

The wrapper is built exactly as FlashInfer documents for each backend: ``kv_layout="NHD"``, an explicit
``backend=`` ("cutlass" on SM100, as vLLM's B200 path does; "fa3" on SM90; "fa2"), planned with int32 host indptrs
(no device sync inside plan), ``num_kv_heads == num_qo_heads`` (MLA prefill is MHA), the real q/kv/o dtypes, and no
sliding window or logits soft cap (explicit cutlass would silently ignore both).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["make_kernel", "FlashInferRaggedKernel", "new_wrapper"]


def new_wrapper(float_workspace: torch.Tensor, backend: str) -> Any:
    """A FlashInfer ragged wrapper for ``backend`` sharing ``float_workspace`` (NHD layout)."""
    import flashinfer

    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(float_workspace, kv_layout="NHD", backend=backend)


class FlashInferRaggedKernel:
    """A planned FlashInfer wrapper, held from the workspace pool for as long as this object lives."""

    def __init__(self, choice: Any, workspace: Any, spec: Any):
        self.spec = spec
        self.backend = choice.flashinfer_backend
        self.wrapper = workspace.acquire_wrapper(self.backend, self, new_wrapper)
        workspace.plan_with_growth(lambda: self.wrapper.plan(
            spec.qo_indptr,  # int32, on the CPU: plan reads it there and copies it to the device itself
            spec.kv_indptr,
            spec.num_heads,
            spec.num_heads,
            spec.head_dim_qk,
            head_dim_vo=spec.head_dim_vo,
            causal=spec.causal,
            sm_scale=spec.sm_scale,
            q_data_type=spec.dtype,
            kv_data_type=spec.dtype,
            o_data_type=spec.dtype,
        ))

    def run(self, q, k, v, out, lse, lse_layout):
        return self.wrapper.run(q, k, v, out=out, lse=lse, return_lse=True, lse_base="ln", lse_layout=lse_layout)


def make_kernel(choice: Any, workspace: Any, spec: Any) -> FlashInferRaggedKernel:
    return FlashInferRaggedKernel(choice, workspace, spec)
