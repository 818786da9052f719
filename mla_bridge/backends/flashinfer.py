"""FlashInfer ragged prefill (``BatchPrefillWithRaggedKVCacheWrapper``): plan once per batch, run per layer.

The only module that talks to FlashInfer's attention wrapper, and the one place where FlashInfer's base-2 LSE
becomes mla_bridge's natural-log LSE: one in-place float32 multiply by ln 2 (what FlashInfer 0.7.4's
``run(..., lse_base="ln")`` does; for ``lse_layout="HN"`` FlashInfer fuses it into the ``[H, T]`` transpose). A
caller that reads base 2 itself may ask for it unconverted (``lse_base="log2"``, see :meth:`RaggedPlan.run`).

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
use the float-workspace region of their stream (:meth:`mla_bridge.Workspace.float_region`), handed to the launch as
its argument: the direct call puts it in FlashInfer's argument list; ``wrapper.run`` (which reads the wrapper's one
``_float_workspace_buffer`` attribute) is called with the attribute set to the region and restored, under the
kernel's lock, so that threads running one plan on several streams never read each other's region. A captured fa2
run gets a region of its own, of the size the plan was laid out against (``plan()`` places the split-KV partials at
offsets for the buffer size it saw), allocated while the stream captures (from the graph's private pool: the graph
owns it, and two graphs never share one). fa2 and cutlass write ``out`` as if it were contiguous (they ignore its
strides): a non-contiguous ``out`` is written through a contiguous temporary and copied (one extra device copy,
only then).

Memory a plan holds (:meth:`FlashInferRaggedKernel.held_bytes`): the wrapper's int workspace, sized to what its
``plan()`` writes (:func:`int_workspace_bytes`, :meth:`mla_bridge.Workspace.fit_int_workspace`) on the device and as
much page-locked host memory, the indptr copies ``plan()`` makes, and for cutlass the work-index buffers FlashInfer's
``fmha_varlen_plan`` allocates per plan (three of 131072 int32 and one of SMs + 1: about 1.5 MiB, fixed by FlashInfer).
The float workspace is the workspace's, shared by every plan.

Host time per run: a planned fa2/fa3 run with ``lse_layout="NH"`` calls FlashInfer's own
``module.ragged_run`` (the function ``wrapper.run`` ends in) with the argument list ``wrapper.run`` builds, recorded
once per plan (:class:`DirectRun`), then converts the LSE to natural log with one in-place multiply by ln 2 (what
``run(..., lse_base="ln")`` does, bitwise): the same launch on the same arguments, without ``wrapper.run``'s
per-call Python. The wrapper's buffers (int workspace, plan info, indptr buffers) are read from the wrapper at every
call, never taken from the recording; fa2's float workspace is the call's argument (its stream's region). Where the
recording
cannot be made (a FlashInfer whose run does not end in exactly one ``_cached_module.ragged_run`` call, a FlashInfer
version outside those the recording knows, another backend), ``wrapper.run`` is called as before.
``MLA_BRIDGE_FLASHINFER_DIRECT=0`` turns the direct call off. Every read or write of the wrapper's private attributes
goes through :mod:`mla_bridge.backends.flashinfer_internals`.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Optional

import torch

from .. import switches
from ..workspace import current_stream
from . import flashinfer_internals as internals

__all__ = [
    "make_kernel",
    "FlashInferRaggedKernel",
    "new_wrapper",
    "DirectRun",
    "DIRECT_ENV",
    "direct_enabled",
    "int_workspace_bytes",
]

_LN2 = math.log(2.0)
#: ``MLA_BRIDGE_FLASHINFER_DIRECT=0`` makes every run go through ``wrapper.run`` (for comparison).
DIRECT_ENV = switches.FLASHINFER_DIRECT


def direct_enabled() -> bool:
    """Whether fa2/fa3 runs call ``module.ragged_run`` directly (:class:`DirectRun`): ``MLA_BRIDGE_FLASHINFER_DIRECT``
    unset, empty, "1" or "auto" (the default, on), or "0" (off: every run goes through ``wrapper.run``).

    Raises:
        ValueError: any other value (the message names the variable).
    """
    return switches.flashinfer_direct()


#: FlashInfer backends that build out's strides from its shape (they would write a strided ``out`` wrongly).
CONTIGUOUS_OUT_BACKENDS = ("fa2", "cutlass")
#: FlashInfer backends that keep temporaries in the float workspace (MLA_NOTES: fa3 and cutlass do not).
FLOAT_WORKSPACE_BACKENDS = ("fa2",)


#: SMs assumed where FlashInfer's schedule depends on the device's count (fa2's split-KV batch of up to 2 CTAs per SM,
#: fa3's per-CTA work pointers): more than any GPU FlashInfer 0.7.4 plans for (H200: 132, B200: 148). A device with
#: more still plans right: its int workspace grows when FlashInfer reports it too small.
MAX_SMS = 256


def int_workspace_bytes(backend: str, spec: Any) -> int:
    """An upper bound on the bytes FlashInfer 0.7.4's ragged ``plan()`` of ``spec`` (its host ``qo_indptr``, heads,
    head dims) allocates from the wrapper's int workspace, for ``backend`` ("fa2", "fa3" or "cutlass").

    From ``include/flashinfer/attention/scheduler.cuh`` (each allocation aligned to 16 bytes, counted with 15 bytes of
    padding; ``T`` query tokens, ``B`` requests, ``H`` heads, MHA as mla_bridge plans it, no CUDA-graph mode):

    * fa2 (``PrefillPlanImpl``): request / q-tile / kv-tile indices of ``padded_batch_size`` int32 each, o_indptr
      ``[B + 1]``, the kv chunk size, and with split-KV merge_indptr ``[T + 1]``. ``padded_batch_size`` is the number
      of (request, q tile, kv chunk) work items: unsplit ``sum(ceil(q_len / CTA_TILE_Q))`` with CTA_TILE_Q 16, 64 or
      128, so at most ``(T + 15 B) / 16``; split at most ``2 x SMs`` (``PrefillBinarySearchKVChunkSize`` keeps the
      split batch within it).
    * fa3 (``PrefillSM90Plan``): seven arrays of one int32 per work item and ``SMs + 1`` work pointers; work items are
      ``sum(ceil(q_len / CTA_TILE_Q))`` per head (CTA_TILE_Q 128, 192 for head_dim_vo 64; at most ``(T + (CTA_TILE_Q
      - 1) B) / CTA_TILE_Q``) for every head, or for one when that schedule has more than 4096 items per head
      (``same_schedule_for_all_heads``).
    * cutlass: none (``fmha_varlen_plan`` allocates its own work buffers; ``prefill.py``).

    SMs are taken as :data:`MAX_SMS`. O(1): the bounds read ``T`` and ``B`` only, not each request's length.
    """
    b, t, h = spec.batch_size, spec.num_qo_tokens, spec.num_heads

    def arrays(count: int, entries: int) -> int:  # ``count`` int32 arrays of ``entries``, each aligned to 16 bytes
        return count * (4 * entries + 15)

    if backend == "fa2":
        work = max((t + 15 * b) // 16, 2 * MAX_SMS)
        return arrays(3, work) + arrays(1, b + 1) + 4 + arrays(1, t + 1)
    if backend == "fa3":
        cta = 192 if spec.head_dim_vo == 64 else 128
        per_head = (t + (cta - 1) * b) // cta
        same_for_all_heads = -(-t // cta) + b - 1 > 4096
        return arrays(7, per_head * (1 if same_for_all_heads else h)) + arrays(1, MAX_SMS + 1)
    return 0


def new_wrapper(float_workspace: torch.Tensor, backend: str) -> Any:
    """A FlashInfer ragged wrapper for ``backend`` sharing ``float_workspace`` (NHD layout)."""
    import flashinfer

    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(float_workspace, kv_layout="NHD", backend=backend)


class DirectRun:
    """FlashInfer's ``module.ragged_run`` with the argument list ``wrapper.run`` builds for a planned batch, recorded
    once (nothing is launched while recording) and replayed with each call's q/k/v/out/lse and float workspace (see
    the module docstring).

    :meth:`record` returns ``None`` when the wrapper does not look like FlashInfer 0.7's (then use ``wrapper.run``).
    ``fw``: the float workspace's position in the argument list (None: FlashInfer's call has none).
    """

    __slots__ = ("fn", "args", "q", "k", "v", "out", "lse", "live", "fw")

    def __init__(self, fn, args, slots, live, fw=None):
        self.fn, self.args, self.live, self.fw = fn, args, live, fw
        self.q, self.k, self.v, self.out, self.lse = slots

    @classmethod
    def record(cls, wrapper: Any, shapes: tuple, dtype: torch.dtype, device: torch.device) -> "Optional[DirectRun]":
        """Record ``wrapper.run(q, k, v, out=out, lse=lse, return_lse=True, lse_base="log2", lse_layout="NH")`` on
        stand-ins of ``shapes = (q, k, v, out, lse)`` (one element each, expanded: no memory), through
        :func:`mla_bridge.backends.flashinfer_internals.record_ragged_run`; None where it cannot be made."""
        if internals.recording_why_not(wrapper) is not None:
            return None
        stand_ins = internals.stand_ins(shapes, dtype, device)
        try:
            fn, args = internals.record_ragged_run(wrapper, *stand_ins)
            slots = internals.argument_slots(args, stand_ins)
            fw, live = internals.live_slots(wrapper, args)
        except Exception:  # noqa: BLE001 - FlashInfer refused the stand-ins or changed: use wrapper.run
            return None
        for i in slots:
            args[i] = None  # the recording keeps no stand-in alive
        return cls(fn, args, slots, live, fw)

    def __call__(
        self, wrapper: Any, q, k, v, out, lse, natural: bool = True, float_workspace: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch; ``float_workspace``: the float workspace to hand it (default: the wrapper's own)."""
        args = self.args.copy()
        args[self.q], args[self.k], args[self.v], args[self.out], args[self.lse] = q, k, v, out, lse
        internals.live_values(wrapper, self.live, args)
        fw = self.fw
        if fw is not None:
            args[fw] = float_workspace if float_workspace is not None else internals.float_workspace(wrapper)
        self.fn(*args)
        if natural and lse is not None:
            lse.mul_(_LN2)  # base 2 -> natural log, as FlashInfer's run(..., lse_base="ln") finishes it
        return out, lse


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
        # Held while the wrapper's _float_workspace_buffer attribute is pointed at a region (wrapper.run reads it).
        self._lock = threading.Lock()
        self.lease = workspace.acquire(self.backend, self, new_wrapper)
        self.wrapper = self.lease.wrapper
        workspace.fit_int_workspace(self.lease, int_workspace_bytes(self.backend, spec))
        workspace.plan_with_growth(
            lambda: self.wrapper.plan(
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
            ),
            lease=self.lease,
        )
        # The size plan() laid fa2's split-KV partials out for: the least float workspace a run of this plan needs.
        self.float_bytes = internals.float_workspace(self.wrapper).numel() if self._regions else 0
        if self._cuda and not torch.cuda.is_current_stream_capturing():
            ptr, stream = current_stream(workspace.device)
            self.lease.record_plan(stream, ptr)
        # Ordered like the plan's other copies (the plan event, order_after_plan); while the plan holds its wrapper
        # the pool never plans that wrapper again, so the values stay the plan's.
        self.device_kv_indptr = internals.device_kv_indptr(self.wrapper, spec.kv_indptr, workspace.device)

    def held_bytes(self) -> tuple[int, int]:
        """``(device bytes, page-locked host bytes)`` this plan's wrapper holds for it (see the module docstring):
        the int workspace and its page-locked twin, the indptr copies ``plan()`` made, and a plan info made of
        tensors (cutlass's work-index buffers). Read from the wrapper's attributes as they are."""
        return internals.held_bytes(self.wrapper)

    def order_after_plan(self) -> None:
        """Make the current stream wait for this plan's host-to-device copies (nothing on the plan's own stream,
        nothing once a run on this stream already waited)."""
        if self._cuda and not torch.cuda.is_current_stream_capturing():
            ptr, stream = current_stream(self.workspace.device)
            self._run_event(stream, ptr)

    def _run_event(self, stream: Any, ptr: int) -> Any:
        """The event of this stream's runs; made (and the stream ordered after the plan's copies) on first use."""
        lease = self.lease
        event = lease.run_events.get(ptr)
        if event is None:
            plan_event = lease.plan_event
            if plan_event is not None and ptr != lease.plan_stream:
                stream.wait_event(plan_event)
            event = lease.run_events[ptr] = lease.event()
        return event

    def _captured(self) -> Optional[torch.Tensor]:
        """A run being captured into a CUDA graph: the wrapper stays out of the pool while that graph may replay it
        (:meth:`mla_bridge.Workspace.captured`), and fa2 gets a float region of its own, returned here: the size the
        plan was laid out against, allocated now, while the stream captures, so from the graph's private memory
        pool (the graph owns it; another graph, or another capture, never shares it; freed once this run is
        recorded, a later run of the same capture may reuse it, in stream order). No event is queried or recorded
        while a stream captures (CUDA forbids it in the default global capture mode): the plan must have been made
        before the capture began (torch.cuda.graph synchronizes the device when it starts)."""
        self.workspace.captured(self.lease)
        if self._regions:
            return self.workspace._new_float_buffer(self.float_bytes)
        return None

    def external_wrapper(self, key: str) -> Any:
        """The wrapper for a runtime that runs it on a stream torch cannot see (``key`` names it): fa2 then uses the
        float-workspace region of ``key``, set as the wrapper's ``_float_workspace_buffer`` (that runtime reads the
        attribute; this kernel's own runs never do: they are handed their stream's region). The caller keeps the
        plan alive while such runs may be queued."""
        if self._regions:
            buf = self.workspace.float_region(key)
            with self._lock:
                internals.set_float_workspace(self.wrapper, buf)
        return self.wrapper

    def run(self, q, k, v, out, lse, lse_layout, lse_base="ln"):
        """Fill ``out`` and ``lse`` (``lse_base``: "ln", natural log, or "log2", FlashInfer's own base 2); an ``lse``
        of None: FlashInfer writes none (``maybe_lse``)."""
        if not self._cuda:
            return self._run(q, k, v, out, lse, lse_layout, lse_base, None)
        if torch.cuda.is_current_stream_capturing():
            return self._run(q, k, v, out, lse, lse_layout, lse_base, self._captured())
        ptr, stream = current_stream(self.workspace.device)
        event = self._run_event(stream, ptr)
        region = self.workspace.float_region(ptr) if self._regions else None
        result = self._run(q, k, v, out, lse, lse_layout, lse_base, region)
        event.record(stream)
        return result

    _direct: Any = None  # DirectRun once recorded, False where it cannot be (then wrapper.run)

    def _direct_run(self) -> Optional[DirectRun]:
        direct: Any = self._direct
        if direct is None:
            if self._cuda and torch.cuda.is_current_stream_capturing():
                return None  # recorded on an eager run, never while a graph captures
            direct = False
            if direct_enabled() and self.backend in ("fa2", "fa3"):
                s = self.spec
                with self._lock:  # the float workspace is found in the call by identity with the attribute
                    direct = DirectRun.record(self.wrapper, s.shapes, s.dtype, s.device) or False
                if direct and self._regions and direct.fw is None:
                    direct = False  # no float workspace argument to hand fa2's region to: wrapper.run
            self._direct = direct
        return direct or None

    def _run(self, q, k, v, out, lse, lse_layout, lse_base, region):
        """``region``: fa2's float workspace for this run (None: the wrapper's own, for a backend that uses none)."""
        if lse_layout == "NH":
            direct = self._direct_run()
            if direct is not None and (not self._contiguous_out or out.is_contiguous()):
                return direct(self.wrapper, q, k, v, out, lse, lse_base == "ln", region)
        if region is None:
            return self._wrapper_run(q, k, v, out, lse, lse_layout, lse_base)
        wrapper = self.wrapper
        with self._lock:  # wrapper.run reads the one attribute: no other thread may point it elsewhere meanwhile
            previous = internals.float_workspace(wrapper)
            internals.set_float_workspace(wrapper, region)
            try:
                return self._wrapper_run(q, k, v, out, lse, lse_layout, lse_base)
            finally:
                internals.set_float_workspace(wrapper, previous)

    def _wrapper_run(self, q, k, v, out, lse, lse_layout, lse_base):
        if self._contiguous_out and not out.is_contiguous():
            tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            self.wrapper.run(
                q, k, v, out=tmp, lse=lse, return_lse=lse is not None, lse_base=lse_base, lse_layout=lse_layout
            )
            out.copy_(tmp)
            return out, lse
        self.wrapper.run(
            q, k, v, out=out, lse=lse, return_lse=lse is not None, lse_base=lse_base, lse_layout=lse_layout
        )
        return out, lse


def make_kernel(choice: Any, workspace: Any, spec: Any) -> FlashInferRaggedKernel:
    return FlashInferRaggedKernel(choice, workspace, spec)
