"""FlashInfer ragged prefill (``BatchPrefillWithRaggedKVCacheWrapper``): plan once per batch, run per layer.

The only module that talks to FlashInfer's attention wrapper, and the one place where FlashInfer's base-2 LSE
becomes mla_bridge's natural-log LSE: ``run(..., lse_base="ln")`` (FlashInfer 0.7.4 scales its base-2 LSE by ln 2
in one small kernel, or fuses it into the ``[H, T]`` transpose for ``lse_layout="HN"``).

The wrapper is built exactly as FlashInfer documents for each backend: ``kv_layout="NHD"``, an explicit
``backend=`` ("cutlass" on SM100, as vLLM's B200 path does; "fa3" on SM90; "fa2"), planned with int32 host indptrs
(no device sync inside plan), ``num_kv_heads == num_qo_heads`` (MLA prefill is MHA), the real q/kv/o dtypes, and no
sliding window or logits soft cap (explicit cutlass would silently ignore both).

Asynchrony (FlashInfer 0.7.4 ``prefill.py``): ``plan()`` writes the schedule into the wrapper's one page-locked host
buffer and queues its copy to the wrapper's device buffer on the current stream without waiting; ``run()`` reads
that device buffer (and, for fa2, split-KV partials at fixed offsets of the float workspace) on the current stream.
So this kernel records a CUDA event after ``plan()`` and after every run (on the run's stream); the
:class:`mla_bridge.Workspace` pool hands the wrapper to another plan only once the plan is gone and those events
have completed. A run on a stream other than the plan's first makes that stream wait for the plan's event. fa2 runs
use the float-workspace region of their stream (:meth:`mla_bridge.Workspace.float_region`). fa2 and cutlass write
``out`` as if it were contiguous (they ignore its strides): a non-contiguous ``out`` is written through a
contiguous temporary and copied (one extra device copy, only then).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["make_kernel", "FlashInferRaggedKernel", "new_wrapper"]

#: FlashInfer backends that build out's strides from its shape (they would write a strided ``out`` wrongly).
CONTIGUOUS_OUT_BACKENDS = ("fa2", "cutlass")
#: FlashInfer backends that keep temporaries in the float workspace (MLA_NOTES: fa3 and cutlass do not).
FLOAT_WORKSPACE_BACKENDS = ("fa2",)


def new_wrapper(float_workspace: torch.Tensor, backend: str) -> Any:
    """A FlashInfer ragged wrapper for ``backend`` sharing ``float_workspace`` (NHD layout)."""
    import flashinfer

    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(float_workspace, kv_layout="NHD", backend=backend)


class FlashInferRaggedKernel:
    """A planned FlashInfer wrapper, leased from the workspace pool for as long as this object lives and the GPU
    still has work of it queued (see the module docstring)."""

    def __init__(self, choice: Any, workspace: Any, spec: Any):
        self.spec = spec
        self.backend = choice.flashinfer_backend
        self.workspace = workspace
        self._cuda = workspace.device.type == "cuda"
        self._contiguous_out = self.backend in CONTIGUOUS_OUT_BACKENDS
        self._regions = self._cuda and self.backend in FLOAT_WORKSPACE_BACKENDS
        self.lease = workspace.acquire(self.backend, self, new_wrapper)
        self.wrapper = self.lease.wrapper
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
        ), lease=self.lease)
        if self._cuda and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(workspace.device)
            event = torch.cuda.Event()
            event.record(stream)
            self.lease.plan_stream = stream.cuda_stream
            self.lease.plan_event = event

    def order_after_plan(self) -> None:
        """Make the current stream wait for this plan's host-to-device copies (nothing on the plan's own stream,
        nothing once a run on this stream already waited)."""
        if self._cuda and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(self.workspace.device)
            self._run_event(stream, stream.cuda_stream)

    def _run_event(self, stream: Any, ptr: int) -> Any:
        """The event of this stream's runs; made (and the stream ordered after the plan's copies) on first use."""
        lease = self.lease
        event = lease.run_events.get(ptr)
        if event is None:
            plan_event = lease.plan_event
            if plan_event is not None and ptr != lease.plan_stream:
                stream.wait_event(plan_event)
            event = lease.run_events[ptr] = torch.cuda.Event()
        return event

    def _float_region(self, key: Any) -> None:
        buf = self.workspace.float_region(key)
        if self.wrapper._float_workspace_buffer is not buf:
            # FlashInfer's plan stored offsets into a buffer of this size; the run reads the buffer it is handed.
            self.wrapper._float_workspace_buffer = buf

    def _captured(self) -> None:
        """A run being captured into a CUDA graph: the wrapper leaves the pool for good (until the graph owner hands
        it back through RaggedPlan.retain_for_graph), and fa2 gets a float workspace of its own, since replays may
        overlap any other work. No event is queried or recorded while a stream captures (CUDA forbids it in the
        default global capture mode): the plan must have been made before the capture began (torch.cuda.graph
        synchronizes the device when it starts)."""
        lease = self.lease
        lease.captured = True
        if self._regions:
            if lease.region is None:
                lease.region = self.workspace._new_float_buffer(self.wrapper._float_workspace_buffer.numel())
            self.wrapper._float_workspace_buffer = lease.region

    def external_wrapper(self, key: str) -> Any:
        """The wrapper for a runtime that runs it on a stream torch cannot see (``key`` names it): fa2 then uses the
        float-workspace region of ``key``. The caller keeps the plan alive while such runs may be queued."""
        if self._regions:
            self._float_region(key)
        return self.wrapper

    def run(self, q, k, v, out, lse, lse_layout):
        if not self._cuda:
            return self._run(q, k, v, out, lse, lse_layout)
        if torch.cuda.is_current_stream_capturing():
            self._captured()
            return self._run(q, k, v, out, lse, lse_layout)
        stream = torch.cuda.current_stream(self.workspace.device)
        ptr = stream.cuda_stream
        event = self._run_event(stream, ptr)
        if self._regions:
            self._float_region(ptr)
        result = self._run(q, k, v, out, lse, lse_layout)
        event.record(stream)
        return result

    def _run(self, q, k, v, out, lse, lse_layout):
        if self._contiguous_out and not out.is_contiguous():
            tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            self.wrapper.run(q, k, v, out=tmp, lse=lse, return_lse=True, lse_base="ln", lse_layout=lse_layout)
            out.copy_(tmp)
            return out, lse
        return self.wrapper.run(q, k, v, out=out, lse=lse, return_lse=True, lse_base="ln", lse_layout=lse_layout)


def make_kernel(choice: Any, workspace: Any, spec: Any) -> FlashInferRaggedKernel:
    return FlashInferRaggedKernel(choice, workspace, spec)
