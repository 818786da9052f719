"""Ragged attention: validate, plan once per batch (:func:`plan_ragged`), run once per layer (:meth:`RaggedPlan.run`).

Conventions at every public boundary (FlashInfer's ragged layout, vLLM's MLA prefill):
  * ``qo_indptr`` / ``kv_indptr``: int32 prefix sums ``[batch + 1]`` starting at 0; request ``r`` owns query rows
    ``qo_indptr[r]:qo_indptr[r+1]`` and key rows ``kv_indptr[r]:kv_indptr[r+1]``.
  * q ``[T, H, head_dim_qk]``, k ``[S, H, head_dim_qk]``, v ``[S, H, head_dim_vo]``, out ``[T, H, head_dim_vo]``,
    ``T = qo_indptr[-1]``, ``S = kv_indptr[-1]``; k/v heads equal q heads (MLA prefill runs as MHA).
  * ``causal`` is bottom-right aligned: query ``i`` of a request sees keys ``j <= i + kv_len - q_len``.
  * ``lse`` is float32, natural log, ``[T, H]`` (``lse_layout="NH"``) or ``[H, T]`` ("HN", vLLM's layout).
    Rows with no visible key give out 0 and lse -inf.
All checks run on the host before any kernel; a failed check writes nothing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from .backends import make_kernel
from .checks import (
    INT32_MAX,
    as_sm_scale,
    kernel_ready,
    kernel_strides,
    not_a_bool,
    offsets_why_not,
    positive_int,
    refuse_beyond_memory,
    strided_extent,
)
from .dispatch import OFFSET_LIMITS, TORCH_DTYPES, BackendChoice, select_backend
from .inference import forward_ad_active, refuse_autograd
from .workspace import Workspace, default_workspace

__all__ = [
    "RaggedPlan",
    "RaggedSpec",
    "plan_ragged",
    "ragged_prefill",
    "qkv_sizes",
    "as_host_indptr",
    "as_sm_scale",
    "indptr_from_lens",
]

IndptrLike = Union[torch.Tensor, Sequence[int]]
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_LOG2E = 1.0 / math.log(2.0)


def indptr_from_lens(lens: "torch.Tensor | Sequence[int] | np.ndarray", name: str = "lens") -> torch.Tensor:
    """``[0, l0, l0+l1, ...]``: int32 CPU prefix sums ``[len(lens) + 1]`` of per-request lengths (ints or a tensor;
    a device tensor is copied to the host, a CPU one is read without a sync).

    Raises:
        ValueError: the lengths sum beyond int32 (``2**31 - 1`` tokens, what every kernel's indptr holds); the
            message names ``name``. Summed in int64 first, so nothing wraps silently.
    """
    if isinstance(lens, torch.Tensor):
        lens = lens.detach().cpu().numpy()
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lens, dtype=np.int64), out=out[1:])
    if out[-1] > INT32_MAX:
        raise ValueError(
            f"{name} sum to {int(out[-1])} tokens, beyond what an int32 indptr holds (2**31 - 1 = {INT32_MAX} tokens)"
        )
    return torch.from_numpy(out.astype(np.int32))


def as_host_indptr(name: str, indptr: IndptrLike) -> torch.Tensor:
    """``indptr`` as a contiguous int32 CPU tensor, after checking it (on the host, with numpy: cheap at plan time).

    Raises:
        TypeError: not a tensor/sequence of integers (a bool among the integers of a list named by its index).
        ValueError: not 1-D, empty, not starting at 0, decreasing, or beyond int32.
    """
    if isinstance(indptr, torch.Tensor):
        if indptr.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must hold integers, got dtype {indptr.dtype}")
        arr = indptr.detach().to("cpu").numpy()
    else:
        if isinstance(indptr, (list, tuple)):
            # numpy reads [0, True, 10] as integers: a bool among them is refused as an all-bool list is
            for i, x in enumerate(indptr):
                if isinstance(x, (bool, np.bool_)):
                    raise TypeError(f"{name}[{i}] must be an integer, got {x!r}")
        arr = np.asarray(indptr)
        if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
            raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [batch + 1], got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} must have at least one entry (0), got an empty tensor")
    arr = arr.astype(np.int64, copy=False)
    if arr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(arr[0])}")
    diffs = np.diff(arr)
    if diffs.size and diffs.min() < 0:
        r = int(np.argmax(diffs < 0))
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{r + 1}]={int(arr[r + 1])} < "
            f"{name}[{r}]={int(arr[r])} (a negative length)"
        )
    if arr[-1] > 2**31 - 1:
        raise ValueError(f"{name}[-1]={int(arr[-1])} does not fit in int32")
    return torch.from_numpy(arr.astype(np.int32))


@dataclass(frozen=True)
class RaggedSpec:
    """Everything a kernel is planned on (host data only)."""

    qo_indptr: torch.Tensor  # int32, CPU
    kv_indptr: torch.Tensor  # int32, CPU
    num_heads: int
    head_dim_qk: int
    head_dim_vo: int
    causal: bool
    sm_scale: float
    dtype: torch.dtype
    device: torch.device

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @functools.cached_property  # read per plan and per run: a tensor element read costs microseconds each time
    def num_qo_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @functools.cached_property
    def num_kv_tokens(self) -> int:
        return int(self.kv_indptr[-1])

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of a run's ``(q, k, v, out, lse)``: ``[T, H, head_dim_qk]``, ``[S, H, head_dim_qk]``,
        ``[S, H, head_dim_vo]``, ``[T, H, head_dim_vo]`` and ``[T, H]`` (the lse laid out "NH")."""
        t, n, h = self.num_qo_tokens, self.num_kv_tokens, self.num_heads
        qk, vo = self.head_dim_qk, self.head_dim_vo
        return (t, h, qk), (n, h, qk), (n, h, vo), (t, h, vo), (t, h)


def _check_tensor(name: str, x: Any, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != len(shape) or any(e is not None and s != e for s, e in zip(x.shape, shape)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (the plan's), got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, but the plan's workspace is on {device}")


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` can address intersect those of ``b`` (one storage, intersecting ``[first, last]``
    byte ranges; a conservative test for interleaved views, exact for the others). Strides are non-negative."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return _spans_intersect(a, b)


def _spans_intersect(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the ``[first, last]`` byte ranges of the non-empty ``a`` and ``b`` intersect."""
    spans = []
    for x in (a, b):
        start = x.data_ptr()
        last = start + sum((n - 1) * st for n, st in zip(x.shape, x.stride())) * x.element_size()
        spans.append((start, last + x.element_size()))
    (a0, a1), (b0, b1) = spans
    return a0 < b1 and b0 < a1


def _shared_destination(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor], lse: Optional[torch.Tensor]
) -> Optional[str]:
    """The error for destinations a kernel cannot write while it reads its inputs, or None: an ``out`` that
    overlaps itself (an expanded view), an ``out`` / ``lse`` that shares memory with q, k or v (:func:`shares_memory`;
    every kernel reads them while writing: FlashInfer's tiles run at once, the torch backend reads a later request's
    rows after writing an earlier one's), or an ``lse`` that shares memory with ``out``. Only tensors with memory
    are compared (a non-tensor or a meta tensor is refused by the other checks). Each storage is looked up once and
    byte ranges are compared only within one storage: a few attribute reads per tensor."""
    T = torch.Tensor
    if isinstance(out, T) and 0 in out.stride() and any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        return f"out must not overlap itself (an expanded view: strides {list(out.stride())}); pass a tensor of its own"
    read = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, T) and x.numel():
            ptr = x.untyped_storage().data_ptr()
            if ptr:
                read.append((name, x, ptr))
    for dest_name, dest in (("out", out), ("lse", lse)):
        if not isinstance(dest, T) or not dest.numel():
            continue
        ptr = dest.untyped_storage().data_ptr()
        if not ptr:
            continue
        for name, x, x_ptr in read:
            if x_ptr == ptr and _spans_intersect(dest, x):
                why = "it writes both at once" if name == "out" else f"it reads {name} while it writes {dest_name}"
                return f"{dest_name} shares memory with {name}: {why}; pass an {dest_name} of its own"
        read.append((dest_name, dest, ptr))  # lse against out too
    return None


def _apart(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor], lse: Optional[torch.Tensor]
) -> bool:
    """:meth:`RaggedPlan.validate`'s fast test that :func:`_shared_destination` has nothing to say (tensors only):
    ``out`` has no stride 0 and each given destination lies in a storage of its own. False sends the call to the
    exact test (which takes a destination next to an input in one buffer)."""
    read: tuple[int, ...] = (
        q.untyped_storage().data_ptr(),
        k.untyped_storage().data_ptr(),
        v.untyped_storage().data_ptr(),
    )
    if out is not None:
        ptr = out.untyped_storage().data_ptr()
        if ptr in read or 0 in out.stride():
            return False
        read += (ptr,)
    return lse is None or lse.untyped_storage().data_ptr() not in read


def _within(limit: int, *tensors: torch.Tensor) -> bool:
    """Every tensor reaches below ``limit`` through its strides (a contiguous one: its element count): the common
    case of :func:`offsets_why_not`, cheaply."""
    return all((x.numel() if x.is_contiguous() else strided_extent(x)) < limit for x in tensors)


class _RunShapes:
    """What :meth:`RaggedPlan.validate` compares per call, computed once per plan from its spec (host data that never
    changes: the indptrs' last entries are read once, not per call)."""

    __slots__ = ("q", "k", "v", "out", "lse", "dtype", "device", "flashinfer", "limit", "backend")

    def __init__(self, spec: "RaggedSpec", flashinfer: bool, backend: str = "torch"):
        self.q, self.k, self.v, self.out, (t, h) = spec.shapes
        self.lse = {"NH": (t, h), "HN": (h, t)}
        self.dtype, self.device, self.flashinfer = spec.dtype, spec.device, flashinfer
        self.limit, self.backend = OFFSET_LIMITS.get(backend), backend  # 32-bit element offsets, or None


class RaggedPlan:
    """A planned ragged attention (FlashInfer's ``plan()`` done once): call :meth:`run` once per layer.

    Made by :func:`plan_ragged`. Attributes: ``spec`` (:class:`RaggedSpec`), ``backend`` (:class:`BackendChoice`),
    ``workspace``. Holding the plan holds one pooled FlashInfer wrapper (:attr:`flashinfer_bytes`); drop the plan to
    give it back: the pool reuses it once the GPU has finished the plan's copies and every run queued so far (CUDA
    events, never a wait).
    Threads and streams: a plan may be run from any thread on any CUDA stream; a run on a stream other than the
    plan's waits for the plan's copies first. A run captured into a CUDA graph: see :meth:`retain_for_graph`.
    """

    def __init__(self, spec: RaggedSpec, backend: BackendChoice, workspace: Workspace):
        self.spec = spec
        self.backend = backend
        self.workspace = workspace
        # No kernel when there is nothing to compute: FlashInfer is never handed an empty problem.
        empty = spec.num_qo_tokens == 0 or spec.num_kv_tokens == 0
        self._kernel = None if empty else make_kernel(backend, workspace, spec)

    @property
    def flashinfer_wrapper(self) -> Any:
        """The planned ``BatchPrefillWithRaggedKVCacheWrapper`` this plan holds, or ``None`` (torch backend, or an
        empty batch that runs no kernel). For adapters that hand FlashInfer's compiled run to another runtime (the
        JAX adapter's ``tvm_ffi`` route); calling its ``plan()`` again would invalidate this plan."""
        return getattr(self._kernel, "wrapper", None)

    def external_flashinfer_wrapper(self, key: str) -> Any:
        """:attr:`flashinfer_wrapper` for a runtime that runs FlashInfer's compiled call itself, on a stream torch
        cannot see (the JAX adapter's ``tvm_ffi`` route: ``key`` names that stream, e.g. ``"xla:0"``). fa2's float
        workspace is then the workspace's region for ``key``, so those runs never share split-KV temporaries with
        runs queued through :meth:`run`. The caller keeps this plan alive for as long as such runs may be queued,
        and waits for them (or the device) before dropping it."""
        return (
            None
            if self._kernel is None or not hasattr(self._kernel, "external_wrapper")
            else self._kernel.external_wrapper(key)
        )

    def retain_for_graph(self, graph: Any, *, stream: Any = None) -> Any:
        """Keep this plan's FlashInfer wrapper (schedule buffers, plan info, fa2 float workspace) out of the pool for
        as long as ``graph`` exists, and hand it back afterwards: for the owner of a CUDA graph that captured
        :meth:`run` (``torch.cuda.CUDAGraph``, or any object whose lifetime is the graph's).

        A run captured into a graph retires the wrapper from the pool for good (it is kept alive and never given to
        another plan, even after this plan is dropped), because the pool cannot know when the graph stops
        replaying. Registering the graph here lets it come back: when ``graph`` is garbage collected, an event is
        recorded on ``stream`` (default: the stream current at that moment; pass the stream the graph is replayed
        on if it is another one, or a list of streams, which is read only then, so that the owner can append each
        stream it replays on: an event on each) and the wrapper returns to the pool once those events have
        completed, the plan itself is gone, and no other graph may replay it. Call this once per graph that
        captured the plan (before or after the capture).

        Which graph a capture belongs to: inside :func:`mla_bridge.graphs.capture`, that call's graph (it registers
        its plans itself); elsewhere the ``torch.cuda.CUDAGraph`` torch names for the capturing stream
        (``CUDAGraph.get_currently_capturing_graph``), so ``graph`` must be that object for the wrapper to come
        back. A capture into a graph that is never registered, or where torch names no graph (a torch without that
        function, a capture begun outside torch), keeps the wrapper retired for good: releasing another, registered
        graph of the same plan never hands it back.

        Returns:
            the ``weakref.finalize`` object: calling it hands the wrapper back early (the graph must not be
            replayed afterwards); ``None`` when the plan holds no FlashInfer wrapper (torch backend, empty batch).
        """
        lease = getattr(self._kernel, "lease", None)
        return None if lease is None else self.workspace.retain_for_graph(lease, graph, stream)

    def order_after_plan(self) -> None:
        """Make the current CUDA stream wait for the host-to-device copies queued when this plan was made (a no-op
        on the plan's own stream, on the CPU and for the torch backend). :meth:`run` does this itself; callers
        that read other device data queued at plan time before the first run (PrefillPlan's index tensors) call
        it first."""
        order = getattr(self._kernel, "order_after_plan", None)
        if order is not None:
            order()

    @property
    def flashinfer_bytes(self) -> tuple[int, int]:
        """``(device bytes, page-locked host bytes)`` this plan's FlashInfer plan holds while the plan lives: the
        wrapper's int workspace, sized to what this plan's schedule needs
        (:meth:`mla_bridge.Workspace.fit_int_workspace`), the indptr copies, and for cutlass FlashInfer's work-index
        buffers (about 1.5 MiB per plan). ``(0, 0)`` for the torch backend and an empty batch. The shared float
        workspace is the workspace's, not counted here."""
        held = getattr(self._kernel, "held_bytes", None)
        return (0, 0) if held is None else held()

    @property
    def device_kv_indptr(self) -> Optional[torch.Tensor]:
        """``kv_indptr`` as FlashInfer's ``plan()`` copied it to the device (int32 ``[batch + 1]``), which the runs
        read; None for the torch backend, an empty batch, or a FlashInfer without that copy. Read on the device only
        after :meth:`order_after_plan` on the reading stream (:class:`mla_bridge.PrefillPlan`'s chunk gathers do)."""
        return getattr(self._kernel, "device_kv_indptr", None)

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self.spec.qo_indptr

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self.spec.kv_indptr

    _run_shapes: Optional[_RunShapes] = None

    def _shapes(self) -> _RunShapes:
        shapes = self._run_shapes
        if shapes is None:
            shapes = self._run_shapes = _RunShapes(self.spec, self.backend.is_flashinfer, self.backend.name)
        return shapes

    def validate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        lse_layout: str = "NH",
    ) -> None:
        """Check q/k/v/out/lse against the plan (see the module docstring for shapes).

        Raises:
            TypeError: not a tensor, or a dtype other than the plan's (lse: float32).
            ValueError: a shape that disagrees with the indptrs or dims (the message names the argument and
                what was expected), another device, an unknown ``lse_layout``, an ``out``/``lse`` the kernel
                cannot write in place, an ``out`` that overlaps itself (an expanded view), an ``out``/``lse`` that
                shares memory with q, k or v or an ``lse`` inside ``out`` (:func:`shares_memory`: the kernel reads
                its inputs while it writes), or a q/k/v/out/lse that requires grad while autograd records (there is
                no backward: :func:`mla_bridge.inference.refuse_autograd`); a strided q/k/v that the kernel would read
                in place and that reaches, through its strides, past the 32-bit element offsets of the backend the
                plan was made for (fa2: ``2**32``, cutlass: ``2**31``; :data:`mla_bridge.dispatch.OFFSET_LIMITS`).
                The plan is made before the tensors are seen, so it assumes contiguous ones unless told their
                strides (:func:`plan_ragged`'s ``strides``); a tensor that needs another backend is refused here,
                never run wrongly.
        """
        # One pass of cheap comparisons (shape tuples, dtype, device) for the common case; anything off goes to the
        # checks below, which name what is wrong. Both test the same conditions.
        c = self._shapes()
        lse_shape = c.lse.get(lse_layout) if isinstance(lse_layout, str) else None
        T = torch.Tensor
        dt, dev = c.dtype, c.device
        if (
            lse_shape is not None
            and isinstance(q, T)
            and isinstance(k, T)
            and isinstance(v, T)
            and q.shape == c.q
            and k.shape == c.k
            and v.shape == c.v
            and q.dtype == dt
            and k.dtype == dt
            and v.dtype == dt
            and q.device == dev
            and k.device == dev
            and v.device == dev
            and (
                out is None
                or (
                    isinstance(out, T)
                    and out.shape == c.out
                    and out.dtype == dt
                    and out.device == dev
                    and (not c.flashinfer or kernel_ready(out))
                )
            )
            and (
                lse is None
                or (
                    isinstance(lse, T)
                    and lse.shape == lse_shape
                    and lse.dtype == torch.float32
                    and lse.device == dev
                    and lse.is_contiguous()
                )
            )
            and not (
                (
                    q.requires_grad
                    or k.requires_grad
                    or v.requires_grad
                    or (out is not None and out.requires_grad)
                    or (lse is not None and lse.requires_grad)
                )
                and torch.is_grad_enabled()
            )
            and not forward_ad_active()
            and ((out is None and lse is None) or _apart(q, k, v, out, lse))
            and (c.limit is None or _within(c.limit, q, k, v))
        ):
            return
        self._validate_named(q, k, v, out, lse, lse_layout)

    def _validate_named(self, q, k, v, out, lse, lse_layout) -> None:
        s = self.spec
        t, n, h = s.num_qo_tokens, s.num_kv_tokens, s.num_heads
        if lse_layout not in ("NH", "HN"):
            raise ValueError(f"lse_layout must be 'NH' ([T, H]) or 'HN' ([H, T]), got {lse_layout!r}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] != (t if name == "q" else n):
                indptr = "qo_indptr" if name == "q" else "kv_indptr"
                raise ValueError(f"{name} has {x.shape[0]} tokens but {indptr}[-1] = {t if name == 'q' else n}")
        _check_tensor("q", q, (t, h, s.head_dim_qk), s.dtype, s.device)
        _check_tensor("k", k, (n, h, s.head_dim_qk), s.dtype, s.device)
        _check_tensor("v", v, (n, h, s.head_dim_vo), s.dtype, s.device)
        refuse_autograd((("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)))  # out / lse: written outside
        # autograd, a history recorded for them would be stale
        if out is not None:
            _check_tensor("out", out, (t, h, s.head_dim_vo), s.dtype, s.device)
            if self.backend.is_flashinfer and not kernel_ready(out):
                raise ValueError(
                    f"out must have a unit last stride and 16-byte aligned strides for "
                    f"{self.backend.name}, got strides {out.stride()}"
                )
        if lse is not None:
            _check_tensor("lse", lse, (t, h) if lse_layout == "NH" else (h, t), torch.float32, s.device)
            if not lse.is_contiguous():
                raise ValueError(f"lse must be contiguous, got strides {lse.stride()}")
        shared = _shared_destination(q, k, v, out, lse)
        if shared is not None:
            raise ValueError(shared)
        limit = self._shapes().limit
        if limit is not None:
            for name, x in (("q", q), ("k", k), ("v", v)):
                reason = offsets_why_not(name, x, limit, self.backend.name)
                if reason is not None:
                    raise ValueError(reason)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        lse_layout: str = "NH",
        lse_base: str = "ln",
        return_lse: bool = True,
    ):
        """Attention for this plan's batch: ``(out [T, H, head_dim_vo], lse)``, or ``out`` alone with
        ``return_lse=False``; no re-planning.

        Args:
            q, k, v: see the module docstring; dtype and device must match the plan. Inputs FlashInfer cannot
                read in place (last dim not contiguous, strides or pointer not 16-byte aligned) are copied once.
            out: optional destination ``[T, H, head_dim_vo]``, any strides with a unit last stride and 16-byte
                aligned (fa2 and cutlass ignore out's strides: a non-contiguous ``out`` is written through a
                contiguous temporary and copied into it, one extra device copy); its memory must not overlap
                q, k or v (nor itself).
            lse: optional destination, float32 natural log, ``[T, H]`` or ``[H, T]`` per ``lse_layout``,
                contiguous (a strided view is refused: ValueError); its memory must not overlap q, k, v or ``out``.
            lse_layout: "NH" (``[T, H]``, default) or "HN" (``[H, T]``, as vLLM's merge wants it).
            lse_base: "ln" (natural log, default: every public LSE of mla_bridge) or "log2" (FlashInfer's own base
                2, for a consumer that reads it directly, e.g. ``merge_attn_states_(..., lse_b_base="log2")``:
                FlashInfer then skips its conversion launch; ``ln_lse = log2_lse * ln 2`` in float32, bitwise).
            return_lse: False: no LSE is written (FlashInfer's ``return_lse=False``: neither the LSE buffer nor its
                base conversion); ``lse`` must then be None.

        Raises:
            TypeError, ValueError: see :meth:`validate` (and an unknown ``lse_base``, a non-bool ``return_lse``, an
                ``lse`` with ``return_lse=False``); raised before any kernel runs.
        """
        if lse_base != "ln" and lse_base != "log2":
            raise ValueError(f"lse_base must be 'ln' (natural log) or 'log2', got {lse_base!r}")
        if return_lse is not True:
            if not isinstance(return_lse, bool):
                raise not_a_bool("return_lse", return_lse)
            if lse is not None:
                raise ValueError("lse is given but return_lse=False: pass one or the other")
        self.validate(q, k, v, out, lse, lse_layout)
        c = self._shapes()
        if out is None:
            out = torch.empty(c.out, dtype=c.dtype, device=c.device)
        if lse is None and return_lse:
            lse = torch.empty(c.lse[lse_layout], dtype=torch.float32, device=c.device)
        if self._kernel is None:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        elif c.flashinfer:
            if not kernel_ready(q):
                q = q.contiguous()
            if not kernel_ready(k):
                k = k.contiguous()
            if not kernel_ready(v):
                v = v.contiguous()
            self._kernel.run(q, k, v, out, lse, lse_layout, lse_base)
        else:
            self._kernel.run(q, k, v, out, lse, lse_layout)  # the torch backend writes an LSE of its own if None
            if lse is not None and lse_base == "log2":
                lse.mul_(_LOG2E)
        return (out, lse) if return_lse else out

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"RaggedPlan(backend={self.backend.name!r}, batch={s.batch_size}, q_tokens={s.num_qo_tokens}, "
            f"kv_tokens={s.num_kv_tokens}, heads={s.num_heads}, dims={s.head_dim_qk}/{s.head_dim_vo}, "
            f"causal={s.causal}, dtype={s.dtype})"
        )


def plan_ragged(
    qo_indptr: IndptrLike,
    kv_indptr: IndptrLike,
    *,
    num_heads: int,
    head_dim_qk: int,
    head_dim_vo: int,
    causal: bool,
    sm_scale: float,
    dtype: torch.dtype,
    workspace: Workspace,
    backend: Optional[str] = None,
    strides: Optional[Sequence] = None,
) -> RaggedPlan:
    """Plan a ragged attention batch once (FlashInfer's ``plan`` step); run it per layer with :meth:`RaggedPlan.run`.

    Args:
        qo_indptr, kv_indptr: int32 ``[batch + 1]`` prefix sums (tensors anywhere, or Python sequences); copied to
            the host once here, so :meth:`RaggedPlan.run` never syncs.
        num_heads: q heads (= k/v heads).
        head_dim_qk, head_dim_vo: 192 / 128 for DeepSeek MLA.
        causal: bottom-right aligned causal mask (main pass) or none (context chunks).
        sm_scale: logit scale (see :class:`mla_bridge.MLADims`).
        dtype: q/k/v/out dtype.
        workspace: the device's :class:`Workspace`.
        backend: force a backend (see :func:`mla_bridge.select_backend`); default: the dispatch table decides.
        strides: ``(q, k, v)``, each the ``(stride_n, stride_h)`` in elements of the tensor :meth:`RaggedPlan.run`
            will be handed (``None``, or a ``None`` entry: contiguous). The dispatch bounds the element offsets the
            kernel computes from them (:data:`mla_bridge.dispatch.OFFSET_LIMITS`: fa2 ``2**32``, cutlass ``2**31``),
            so that a pass over views of a wider buffer is routed to a backend that addresses it; a run whose
            tensors reach farther than the plan's backend can is refused (:meth:`RaggedPlan.validate`).

    Raises:
        TypeError / ValueError: bad indptrs (named), sizes, ``sm_scale``, a ``causal`` that is not a bool (None or
            0/1 would be read as a mask choice silently); lengths that disagree between the two indptrs; a forced
            backend that cannot serve; bad ``strides``; a batch whose out and lse alone exceed all the memory of the
            workspace's device (named ``qo_indptr``, :func:`mla_bridge.checks.refuse_beyond_memory`).
        WorkspaceTooSmallError: FlashInfer's plan needs more float workspace than the workspace may grow to.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"causal must be a bool (True: the main pass's bottom-right causal mask; False: none), got {causal!r}"
        )
    qo = as_host_indptr("qo_indptr", qo_indptr)
    kv = as_host_indptr("kv_indptr", kv_indptr)
    if qo.numel() != kv.numel():
        raise ValueError(f"qo_indptr has {qo.numel()} entries but kv_indptr has {kv.numel()}; both are [batch + 1]")
    sizes = checked_plan_sizes(
        num_heads=num_heads,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        sm_scale=sm_scale,
        dtype=dtype,
        workspace=workspace,
    )
    tokens, heads = int(qo[-1]), sizes["num_heads"]
    refuse_beyond_memory(
        "qo_indptr",
        f"out and lse of {tokens} tokens x {heads} heads",
        tokens * heads * (sizes["head_dim_vo"] * sizes["dtype"].itemsize + 4),
        workspace.device,
    )
    return plan_checked(qo, kv, causal=bool(causal), backend=backend, strides=strides, **sizes)


def checked_plan_sizes(
    *, num_heads: int, head_dim_qk: int, head_dim_vo: int, sm_scale: float, dtype: torch.dtype, workspace: Workspace
) -> dict:
    """:func:`plan_ragged`'s checks of everything but the indptrs, as the keyword arguments of :func:`plan_checked`
    (sizes as ints, ``sm_scale`` as a float). A caller that plans several passes of one batch checks once.

    Raises:
        TypeError / ValueError: as :func:`plan_ragged` (the message names the argument).
    """
    num_heads = positive_int("num_heads", num_heads)
    head_dim_qk = positive_int("head_dim_qk", head_dim_qk)
    head_dim_vo = positive_int("head_dim_vo", head_dim_vo)
    sm_scale = as_sm_scale(sm_scale)
    if not isinstance(dtype, torch.dtype) or dtype not in TORCH_DTYPES:
        raise TypeError(
            f"dtype (of q, k, v and out) must be one of bfloat16, float16, float32, float64, got {dtype!r}"
            + (f" (a str: pass the torch.dtype torch.{dtype})" if isinstance(dtype, str) else "")
            + (
                " (an FP8 paged latent cache is PrefillPlan's kv_cache_dtype)"
                if isinstance(dtype, torch.dtype) and dtype.is_floating_point
                else ""
            )
        )
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a mla_bridge.Workspace, got {type(workspace).__name__}")
    return dict(
        num_heads=num_heads,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        sm_scale=sm_scale,
        dtype=dtype,
        workspace=workspace,
    )


def plan_checked(
    qo: torch.Tensor,
    kv: torch.Tensor,
    *,
    causal: bool,
    backend: Optional[str],
    num_heads: int,
    head_dim_qk: int,
    head_dim_vo: int,
    sm_scale: float,
    dtype: torch.dtype,
    workspace: Workspace,
    num_qo_tokens: Optional[int] = None,
    num_kv_tokens: Optional[int] = None,
    host: Optional[tuple] = None,
    capability: Optional[tuple[int, int]] = None,
    strides: Optional[Sequence] = None,
) -> RaggedPlan:
    """:func:`plan_ragged` past its checks: the backend choice and the kernel's plan, nothing re-validated.

    For indptrs that are valid by construction -- int32 CPU tensors of equal length, starting at 0, non-decreasing,
    as :func:`as_host_indptr` returns them or :func:`indptr_from_lens` makes them from checked lengths (what
    :class:`mla_bridge.PrefillPlan` plans every pass with) -- and sizes from :func:`checked_plan_sizes`. The plan
    holds ``qo`` and ``kv`` (do not write to them afterwards). Gives the same :class:`RaggedPlan` as
    :func:`plan_ragged` on the same values. ``num_qo_tokens`` / ``num_kv_tokens``: ``qo[-1]`` / ``kv[-1]`` where the
    caller knows them (the spec's token counts are then not read from the tensors: a lock and an element read each).
    ``host``: ``(qo, kv)`` as the numpy arrays they view, where the caller has them. ``capability``: the CUDA
    workspace device's, read once by a caller that plans several passes of one batch (default: read here by
    :func:`select_backend`). ``strides``: as :func:`plan_ragged`'s (checked by :func:`select_backend`).
    """
    spec = RaggedSpec(qo, kv, num_heads, head_dim_qk, head_dim_vo, causal, sm_scale, dtype, workspace.device)
    if num_qo_tokens is not None:
        spec.__dict__["num_qo_tokens"] = num_qo_tokens  # what the cached property would store on first read
    if num_kv_tokens is not None:
        spec.__dict__["num_kv_tokens"] = num_kv_tokens
    qo_host, kv_host = host if host is not None else (qo.numpy(), kv.numpy())  # lists made only if read
    choice = select_backend(
        workspace.device,
        capability=capability,
        dtype=dtype,
        out_dtype=dtype,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        causal=causal,
        num_heads=num_heads,
        qo_indptr=qo_host,
        kv_indptr=kv_host,
        requested=backend,
        strides=strides,
    )
    return RaggedPlan(spec, choice, workspace)


def qkv_sizes(q: Any, k: Any, v: Any) -> dict[str, int]:
    """The sizes :func:`plan_ragged` takes for a run of q ``[T, H, head_dim_qk]``, k ``[S, H, head_dim_qk]`` and v
    ``[S, H, head_dim_vo]``: ``{"num_heads": H, "head_dim_qk": ..., "head_dim_vo": ...}``, after the checks a plan made
    from the tensors themselves needs (each 3-D, one dtype, one head count: q's make the plan, so all three are named
    rather than k or v blamed); the rest is :meth:`RaggedPlan.validate`'s. Reads only ``shape`` and ``dtype``: the
    one-shot :func:`ragged_prefill` checks torch tensors with it, the JAX adapter its traced arrays.

    Raises:
        ValueError: a tensor that is not 3-D (named); q, k and v of different head counts (all three given).
        TypeError: q, k and v of different dtypes (all three given).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 3:
            raise ValueError(f"{name} must be 3-D [tokens, heads, head_dim], got shape {list(x.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        raise ValueError(
            f"q, k and v must have the same number of heads (dim 1), got q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]}"
        )
    return dict(num_heads=q.shape[1], head_dim_qk=q.shape[2], head_dim_vo=v.shape[2])


def ragged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: IndptrLike,
    kv_indptr: IndptrLike,
    *,
    causal: bool,
    sm_scale: float,
    backend: Optional[str] = None,
    workspace: Optional[Workspace] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot ragged attention: :func:`plan_ragged` + :meth:`RaggedPlan.run` (plan per call: use the two-step form
    in a layer loop). Shapes and conventions as in the module docstring; ``workspace`` defaults to the device's
    shared one (:func:`mla_bridge.workspace.default_workspace`). The tensors are at hand when the pass is planned, so
    their strides go to the dispatch (``plan_ragged(strides=...)``): views of a wider buffer are served by a backend
    whose offsets reach them.

    Returns:
        ``(out [T, H, head_dim_vo] in q's dtype, lse [T, H] float32 natural log)``.

    Raises:
        TypeError / ValueError: as :func:`plan_ragged` and :meth:`RaggedPlan.validate`, before any kernel; inputs
            that require grad and an ``out`` / ``lse`` that shares memory with an input are refused before planning.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    sizes = qkv_sizes(q, k, v)
    refuse_autograd((("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)))  # before planning (on CUDA:
    # FlashInfer's plan, its host-to-device copies, a pooled wrapper), not after it in plan.run; so are
    # destinations that share memory with the inputs
    shared = None if out is None and lse is None else _shared_destination(q, k, v, out, lse)
    if shared is not None:
        raise ValueError(shared)
    if workspace is None:
        workspace = default_workspace(q.device)
    # what the kernel will read: a tensor it reads in place through its strides, another one copied contiguous
    strides = tuple(map(kernel_strides, (q, k, v)))
    plan = plan_ragged(
        qo_indptr,
        kv_indptr,
        **sizes,
        causal=causal,
        sm_scale=sm_scale,
        dtype=q.dtype,
        workspace=workspace,
        backend=backend,
        strides=None if strides == (None, None, None) else strides,
    )
    return plan.run(q, k, v, out=out, lse=lse)
