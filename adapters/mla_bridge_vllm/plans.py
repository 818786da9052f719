"""The kernel-calling part of the vLLM adapter, free of vLLM imports (so it runs and is tested where vLLM is absent,
such as the H200).

One :class:`PrefillStepPlans` per vLLM scheduler step: a causal :class:`mla_bridge.RaggedPlan` for the new tokens
(``kv_indptr == qo_indptr``) and one non-causal plan per vLLM context chunk, all planned from host (CPU) indptrs.
Each run returns what vLLM's MLA prefill expects: ``out [T, H, v_head_dim]`` and, when asked (and only then
computed), the LSE in natural log, laid out ``[H, T]`` (``RaggedPlan.run(..., lse_layout="HN")``, written that way by
the kernel, no transpose copy). Plans come from the one plan cache the adapters share
(:func:`mla_bridge.plan_cache.shared_plan_cache`): a step equal to an earlier one reuses its plans.

:func:`servable` answers "can mla_bridge serve this?" for vLLM's capability/dtype/dims questions by asking
:func:`mla_bridge.select_backend` (the one dispatch table); there is no second table here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mla_bridge import RaggedPlan, select_backend
from mla_bridge.plan_cache import PlanCache, shared_plan_cache
from mla_bridge.ragged import indptr_from_lens as host_indptr_from_lens
from mla_bridge.workspace import Workspace, default_workspace

__all__ = ["ChunkIndptrs", "PrefillStepPlans", "servable", "host_indptr_from_lens", "vllm_strides"]


def vllm_strides(num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> tuple:
    """``(q, k, v)`` strides (:func:`mla_bridge.plan_ragged`'s ``strides``) of the tensors vLLM's ``forward_mha``
    hands over: q and k contiguous (k a fresh concat of k_nope and the broadcast k_pe), v a view into the up-projected
    ``[S, H, qk_nope_head_dim + v_head_dim]`` buffer (``kv_nope.split``): token stride ``H x (nope + v)``, head stride
    ``nope + v``. Declared at plan time, they let the dispatch bound what the kernels address (v reaches ``S x H x
    256`` elements for DeepSeek, not ``S x H x 128``); a v that vLLM hands over contiguous reaches less, so the
    declaration is never short."""
    row = qk_nope_head_dim + v_head_dim
    return (None, None, (num_heads * row, row))


def servable(
    capability: Optional[tuple[int, int]],
    *,
    dtype: Optional[torch.dtype] = None,
    head_dim_qk: Optional[int] = None,
    head_dim_vo: Optional[int] = None,
) -> tuple[bool, str]:
    """Whether mla_bridge serves MLA prefill for vLLM here, and why (in words), from :func:`select_backend`.

    ``capability`` ``None`` means no CUDA device (vLLM's CPU platform): the torch backend serves bf16, fp16, fp32 and
    fp64 (:data:`mla_bridge.dispatch.TORCH_DTYPES`; FP8 q/k/v: no backend serves them).
    On a CUDA device (``(major, minor)``) only a FlashInfer backend counts: the torch backend is a float32
    reference, far too slow to hand a serving engine, so it serves there only when forced with ``MLA_BRIDGE_BACKEND``.
    """
    kw: dict[str, Any] = dict(dtype=dtype, out_dtype=dtype, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo)
    if dtype is not None and not dtype.is_floating_point:  # plan_ragged would refuse it on every backend
        return False, (
            f"{dtype} is not a floating dtype (mla_bridge runs float16, bfloat16 and, on the CPU, float32 and float64)"
        )
    try:
        if capability is None:
            choice = select_backend("cpu", **kw)
        else:
            choice = select_backend(capability=(int(capability[0]), int(capability[1])), **kw)
    except ValueError as err:  # a backend forced through MLA_BRIDGE_BACKEND cannot serve, or none serves the dtype
        return False, str(err)
    if capability is None or choice.is_flashinfer or choice.forced:
        return True, f"{choice.name}: {choice.reason}"
    reasons = "; ".join(f"{name}: {why}" for name, why in choice.passed_over)
    return False, f"no FlashInfer backend serves capability {capability[0]}.{capability[1]} ({reasons})"


_WARNED = [False]


def _warn_if_reference(*plans: RaggedPlan) -> None:
    """Once per process: a batch on a GPU that no FlashInfer kernel serves runs the (slow) float32 torch reference."""
    for plan in plans:
        if plan.backend.name == "torch" and not plan.backend.forced and not _WARNED[0]:
            _WARNED[0] = True
            why = "; ".join(f"{name}: {reason}" for name, reason in plan.backend.passed_over)
            warnings.warn(
                f"mla_bridge_vllm: no FlashInfer kernel serves this batch ({why}); it runs on the float32 "
                f"torch reference backend, which is slow",
                RuntimeWarning,
                stacklevel=3,
            )


@dataclass(frozen=True)
class ChunkIndptrs:
    """Host indptrs of one vLLM context chunk: queries over its requests' new tokens, keys over their context."""

    index: int
    qo_indptr: torch.Tensor  # int32, CPU, [requests in chunk + 1]
    kv_indptr: torch.Tensor  # int32, CPU, [requests in chunk + 1]


class PrefillStepPlans:
    """The plans of one vLLM step: made once (in ``prepare_metadata``), run once per layer.

    Args:
        qo_indptr: host int32 ``[num_prefills + 1]``, the prefill requests' new-token offsets.
        chunks: the context chunks' host indptrs, in vLLM's chunk order (``chunk.index`` 0, 1, ...).
        num_heads, head_dim_qk, head_dim_vo, sm_scale, dtype: the layer's sizes, logit scale and q/k/v/out dtype.
        device: where q/k/v live.
        workspace: mla_bridge's workspace for ``device`` (default: the process-wide one).
        backend: force an mla_bridge backend by name (default: :func:`select_backend` decides per plan).
        strides: ``(q, k, v)`` strides of the tensors the runs will be handed (:func:`vllm_strides` for vLLM's;
            default: contiguous), for the dispatch's bound on 32-bit element offsets (:func:`mla_bridge.plan_ragged`).
        cache: where the plans are looked up and kept (default: :func:`mla_bridge.plan_cache.shared_plan_cache`): a
            step whose lengths, sizes and chunks equal an earlier one's reuses its plans.

    vLLM replaces a step's plans at the next step while the GPU may still run the last one: that is safe, since the
    workspace pool gives a dropped plan's FlashInfer wrapper to a later plan only once the GPU has finished the work
    queued with it (:class:`mla_bridge.Workspace`).
    """

    def __init__(
        self,
        qo_indptr: torch.Tensor,
        chunks: Sequence[ChunkIndptrs],
        *,
        num_heads: int,
        head_dim_qk: int,
        head_dim_vo: int,
        sm_scale: float,
        dtype: torch.dtype,
        device: "torch.device | str",
        workspace: Optional[Workspace] = None,
        backend: Optional[str] = None,
        strides: Optional[Sequence] = None,
        cache: Optional[PlanCache] = None,
    ):
        plans = shared_plan_cache() if cache is None else cache
        ws = workspace if workspace is not None else default_workspace(device)
        common: dict[str, Any] = dict(
            num_heads=num_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            sm_scale=sm_scale,
            dtype=dtype,
            workspace=ws,
            backend=backend,
            strides=strides,
        )
        self.main: RaggedPlan = plans.get_ragged(qo_indptr, qo_indptr, causal=True, **common)
        self.chunks: dict[int, RaggedPlan] = {
            c.index: plans.get_ragged(c.qo_indptr, c.kv_indptr, causal=False, **common) for c in chunks
        }
        if ws.device.type == "cuda":
            _warn_if_reference(self.main, *self.chunks.values())

    def run_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: Optional[torch.Tensor] = None,
    ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        """Causal attention of the new tokens: ``out``, or ``(out, lse [H, T] natural log)`` with
        ``return_softmax_lse`` (only then is an LSE computed: FlashInfer's ``return_lse=False`` otherwise).

        Raises:
            TypeError: ``return_softmax_lse`` not a bool; the core's errors (:meth:`mla_bridge.RaggedPlan.run`)."""
        return self.main.run(q, k, v, out=out, lse_layout="HN", return_lse=return_softmax_lse)

    def run_context_chunk(
        self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of chunk ``index``'s queries over its context: ``(out, lse [H, T] natural log)``."""
        plan = self.chunks.get(index)
        if plan is None:
            raise KeyError(
                f"mla_bridge_vllm: context chunk {index} was not planned this step "
                f"(planned: {sorted(self.chunks)}); prepare_metadata must run first"
            )
        return plan.run(q, k, v, out=out, lse_layout="HN")

    def __repr__(self) -> str:
        return f"PrefillStepPlans(main={self.main!r}, chunks={len(self.chunks)})"
