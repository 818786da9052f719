"""Merging attention partials over disjoint key sets by their log-sum-exp.

For partials ``(out_a, lse_a)`` and ``(out_b, lse_b)`` (natural-log LSE):
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``
(FlashInfer's "recursive attention" tutorial; vLLM's ``merge_attn_states``). An empty partial has lse -inf and
contributes nothing, whatever its out holds; +inf (what the FlashAttention-2 library's varlen forward reports for
empty rows) is read as empty too. Two empties merge to out 0, lse -inf, never NaN. A NaN LSE is never read as
empty: it stays NaN in the merged row (out and lse).

Which merge a shape gets is decided in one place, :func:`select_merge` (cached per shape), in this order:

1. ``"triton"``, mla_bridge's own kernel (:mod:`mla_bridge.kernels.merge`): on CUDA when Triton imports, for
   fp16/bf16/float32 and any head count, head dim, size (int64 offsets) and strides. ONE launch per merge: it
   reads and writes the natural-log float32 LSE directly and computes exactly the float32 operations of the torch
   merge below, in the same order, rounding once to the output dtype; so it keeps every rule above (empty
   partials' outs are not even read, a NaN LSE stays NaN).
2. ``"flashinfer"``, FlashInfer's ``merge_state`` / ``merge_state_in_place``: where Triton is missing, and only
   where it is known right (below). Its base-2 LSE is converted at this edge (two conversions and a conversion
   back: six launches in place). Its kernel takes ``max()`` of the two LSEs, which drops a NaN, so it merges a NaN
   partial as if it were empty (the only merge here that does).
3. ``"torch"``, float32 torch operations (:func:`_merge_torch`): everywhere else (the CPU, other dtypes or head
   dims), in bounded row pieces on CUDA.

``MLA_BRIDGE_MERGE=torch|flashinfer|triton`` forces one (for comparison and as an escape hatch, like
``MLA_BRIDGE_GATHER`` for the gather): ``flashinfer`` is refused off CUDA and where flashinfer-python is not
installed, and falls back to torch for the shapes and dtypes FlashInfer's merge cannot serve (below); ``triton`` is
taken on any device (on the CPU only meaningful with ``TRITON_INTERPRET=1``, for development).

FlashInfer 0.7.4's merge (``include/flashinfer/attention/cascade.cuh``, ``MergeState`` / ``MergeStateInPlace``):

* dispatches ``head_dim`` through ``DISPATCH_HEAD_DIM`` (``include/flashinfer/utils.cuh``): 64, 128, 256, 512
  only; anything else raises "Unsupported head_dim" (:data:`FLASHINFER_MERGE_HEAD_DIMS`);
* takes fp16/bf16 only (``DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16`` in ``csrc/cascade.cu``);
* indexes ``(pos * num_heads + head) * head_dim`` in ``uint32_t``: a tensor of ``2**32`` elements or more wraps
  and its last rows come back wrong (seen on the H200 just over 2**32 elements: docs/results.md), so rows are
  merged in pieces below :data:`FLASHINFER_MERGE_ELEMENT_LIMIT`;
* launches ``head_dim / vec`` x ``num_heads`` threads per block (``vec = max(16 / sizeof(dtype), head_dim / 32)``):
  above 1024 the launch fails (64 heads at bf16, d 128), so heads are folded into rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, cast

import torch

from . import switches
from .dispatch import flashinfer_version
from .inference import refuse_autograd
from .kernels import triton_available, triton_interpreting

__all__ = [
    "merge_attn_states",
    "merge_attn_states_",
    "merge_sinks_",
    "select_merge",
    "MergeChoice",
    "FLASHINFER_MERGE_HEAD_DIMS",
    "FLASHINFER_MERGE_ELEMENT_LIMIT",
    "TORCH_MERGE_PIECE_ELEMENTS",
    "MERGE_ENV",
    "MERGE_IMPLS",
]

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
_HALF = (torch.float16, torch.bfloat16)
#: dtypes of ``out`` the Triton merge takes (it computes in float32 and rounds once to this dtype)
TRITON_MERGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Head dims FlashInfer 0.7.4's merge dispatches (``DISPATCH_HEAD_DIM`` in ``include/flashinfer/utils.cuh``).
FLASHINFER_MERGE_HEAD_DIMS = (64, 128, 256, 512)
#: FlashInfer's merge computes element offsets in 32 bits: every piece it is handed holds fewer elements than this.
FLASHINFER_MERGE_ELEMENT_LIMIT = 2**32
#: The torch merge works in float32 temporaries (about 4 copies of the piece): on CUDA it runs in row pieces of at
#: most this many elements, so that a merge of any size needs bounded extra memory (2 GiB of float32 per copy).
TORCH_MERGE_PIECE_ELEMENTS = 2**29
#: The environment variable forcing a merge implementation (one of :data:`MERGE_IMPLS`, or "auto"/unset).
MERGE_ENV = switches.MERGE
MERGE_IMPLS = switches.MERGE_IMPLS  # ("triton", "flashinfer", "torch")


@dataclass(frozen=True)
class MergeChoice:
    """The merge :func:`select_merge` picked for a shape.

    Attributes:
        name: ``"triton"`` (mla_bridge's kernel, one launch), ``"flashinfer"`` (``merge_state`` /
            ``merge_state_in_place``) or ``"torch"`` (float32 torch).
        reason: why (for the torch merge: why neither kernel is used).
        rows_per_piece: rows handed to one kernel call (all rows when they fit in one piece; always all for triton).
        heads_per_row: heads folded into one FlashInfer row (``num_heads`` when no folding is needed; 0 otherwise).
    """

    name: str
    reason: str
    rows_per_piece: int
    heads_per_row: int = 0


def _heads_per_row(num_heads: int, head_dim: int, elem_size: int) -> int:
    """Largest divisor g of num_heads whose FlashInfer merge block, (head_dim / vec) x g threads, fits 1024."""
    vec = max(16 // elem_size, head_dim // 32)
    threads_per_head = max(1, head_dim // vec)
    g = num_heads
    while g > 1 and (num_heads % g or g * threads_per_head > 1024):
        g -= 1
    return g


def select_merge(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device_type: str,
    *,
    contiguous: bool = True,
    flashinfer: Optional[bool] = None,
    triton: Optional[bool] = None,
) -> MergeChoice:
    """Which merge serves partials of ``shape = (T, H, D)`` (the one routing rule; see the module docstring).

    Args:
        shape: ``(rows T, heads H, head_dim D)`` of ``out``.
        dtype: ``out``'s dtype; device_type: ``"cuda"`` or ``"cpu"``.
        contiguous: whether both outs are contiguous (FlashInfer's merge reads them densely; Triton's takes strides).
        flashinfer: whether flashinfer-python is installed (default: :func:`~mla_bridge.dispatch.flashinfer_version`).
        triton: whether Triton imports (default: :func:`mla_bridge.kernels.triton_available`, asked only on CUDA or
            when ``$MLA_BRIDGE_MERGE`` forces triton).

    Returns:
        a :class:`MergeChoice`: Triton's on CUDA for fp16/bf16/float32 (all rows in one launch); else FlashInfer's
        only for CUDA, fp16/bf16, contiguous, D in :data:`FLASHINFER_MERGE_HEAD_DIMS`, in pieces of fewer than
        :data:`FLASHINFER_MERGE_ELEMENT_LIMIT` elements; else torch. ``$MLA_BRIDGE_MERGE`` forces one.

    Raises:
        ValueError: ``$MLA_BRIDGE_MERGE`` is not torch/flashinfer/triton/auto, forces triton for a dtype it does
            not take or off CUDA without ``TRITON_INTERPRET=1``, or forces flashinfer off CUDA or where
            flashinfer-python is not installed. RuntimeError: it forces triton where Triton does not
            import.
    """
    forced = switches.merge()  # one of MERGE_IMPLS, or None (another value is refused there)
    if forced == "triton" and device_type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"{MERGE_ENV}=triton runs a Triton kernel: it needs a CUDA device, got {device_type} "
            f"(TRITON_INTERPRET=1 runs it on the CPU, for development)"
        )
    if flashinfer is None:
        flashinfer = flashinfer_version() is not None
    if forced == "flashinfer" and (device_type != "cuda" or not flashinfer):
        raise ValueError(
            f"{MERGE_ENV}=flashinfer runs FlashInfer's merge: it needs a CUDA device"
            + (f", got {device_type}" if device_type != "cuda" else " and flashinfer-python is not installed")
        )
    if triton is None:
        triton = (
            (device_type == "cuda" or forced == "triton")
            and forced not in ("torch", "flashinfer")
            and triton_available()
        )
    return _select(tuple(map(int, shape)), dtype, device_type, bool(contiguous), bool(flashinfer), bool(triton), forced)


@functools.lru_cache(maxsize=1024)
def _select(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device_type: str,
    contiguous: bool,
    flashinfer: bool,
    triton: bool,
    forced: Optional[str],
) -> MergeChoice:
    t, h, d = shape
    row = max(1, h * d)
    torch_rows = _torch_rows(t, h, d, device_type)

    def use_torch(reason: str) -> MergeChoice:
        return MergeChoice("torch", reason, min(max(1, t), torch_rows))

    if forced == "torch":
        return use_torch(f"forced by {MERGE_ENV}=torch")
    if t * h * d == 0:
        return use_torch("nothing to merge")
    if forced == "triton":
        if not triton:
            raise RuntimeError(f"{MERGE_ENV}=triton, but Triton does not import here")
        if dtype not in TRITON_MERGE_DTYPES:
            raise ValueError(f"{MERGE_ENV}=triton: the Triton merge takes float16/bfloat16/float32, got {dtype}")
        return MergeChoice("triton", f"forced by {MERGE_ENV}=triton", max(1, t))
    if forced is None and device_type == "cuda" and triton and dtype in TRITON_MERGE_DTYPES:
        return MergeChoice(
            "triton", "mla_bridge's Triton merge (one launch, natural-log LSE, int64 offsets)", max(1, t)
        )
    why_not_triton = (
        ""
        if forced is not None or device_type != "cuda" or dtype not in TRITON_MERGE_DTYPES
        else "Triton does not import; "
    )
    if device_type != "cuda":
        return use_torch(f"FlashInfer's merge needs CUDA, got {device_type}")
    if not flashinfer:
        return use_torch(why_not_triton + "flashinfer-python is not installed")
    if dtype not in _HALF:
        return use_torch(f"FlashInfer's merge takes float16/bfloat16, got {dtype}")
    if d not in FLASHINFER_MERGE_HEAD_DIMS:
        return use_torch(
            why_not_triton + f"head_dim {d} not in FlashInfer's merge head dims {list(FLASHINFER_MERGE_HEAD_DIMS)}"
        )
    if not contiguous:
        return use_torch(why_not_triton + "out_a / out_b not contiguous")
    rows = (FLASHINFER_MERGE_ELEMENT_LIMIT - 1) // row  # each piece: rows * h * d < 2**32
    g = _heads_per_row(h, d, dtype.itemsize)
    why = "head dim and dtype served by FlashInfer's merge_state"
    if forced == "flashinfer":
        why = f"forced by {MERGE_ENV}=flashinfer; " + why
    elif why_not_triton:
        why = why_not_triton + why
    if rows < t:
        why += f"; {-(-t // rows)} pieces of <= {rows} rows (32-bit element offsets)"
    return MergeChoice("flashinfer", why, min(t, rows), g)


def _torch_rows(t: int, h: int, d: int, device_type: str) -> int:
    """Rows of one piece of the torch merge: all of them off CUDA, else :data:`TORCH_MERGE_PIECE_ELEMENTS` worth."""
    return max(1, TORCH_MERGE_PIECE_ELEMENTS // max(1, h * d)) if device_type == "cuda" else max(1, t)


def _check(out_a, lse_a, out_b, lse_b) -> None:
    """Cheap checks of user input (shape tuples, dtypes, devices), raising the named errors below on failure."""
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    shape = out_a.shape
    if len(shape) != 3:
        raise ValueError(f"out_a must be [T, H, D], got shape {list(shape)}")
    if out_b.shape != shape:
        raise ValueError(f"out_b must have out_a's shape {list(shape)}, got {list(out_b.shape)}")
    dtype = out_a.dtype
    if out_b.dtype != dtype:
        raise TypeError(f"out_b must have out_a's dtype {dtype}, got {out_b.dtype}")
    th = shape[:2]
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != th:
            raise ValueError(f"{name} must be [T, H] = {list(th)} (natural log), got {list(lse.shape)}")
        if lse.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {lse.dtype}")
    device = out_a.device
    for name, x in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, but out_a is on {device}")


def _choice(out_a: torch.Tensor, out_b: torch.Tensor) -> MergeChoice:
    return select_merge(
        cast("tuple[int, int, int]", tuple(out_a.shape)),
        out_a.dtype,
        out_a.device.type,
        contiguous=out_a.is_contiguous() and out_b.is_contiguous(),
    )


def _as_base2(lse: torch.Tensor) -> torch.Tensor:
    # +inf ("empty" in some kernels) -> -inf, then natural log -> log2.
    return torch.where(lse == float("inf"), float("-inf"), lse).mul_(_LOG2E).contiguous()


def merge_attn_states_(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *, lse_b_base: str = "ln"
) -> None:
    """In-place merge: ``(out, lse) <- merge((out, lse), (out_b, lse_b))``. Same conventions as
    :func:`merge_attn_states`; ``out`` and ``lse`` must be writable (``lse`` contiguous). On CUDA with Triton this is
    one kernel launch (:mod:`mla_bridge.kernels.merge`); ``out`` / ``out_b`` may have any strides.

    Args:
        lse_b_base: "ln" (natural log, default) or "log2": ``lse_b`` in base 2 as FlashInfer's kernels write it
            (:meth:`mla_bridge.RaggedPlan.run` with ``lse_base="log2"``), converted as it is read (float32
            ``lse_b * ln 2``, bitwise FlashInfer's own conversion), which saves the attention run its conversion
            launch. ``lse`` (in and out) is natural log either way.

    Raises:
        TypeError / ValueError: as :func:`merge_attn_states`; ValueError: ``lse`` not contiguous, ``out`` an
            expanded view (a stride 0 over several elements: its rows would overwrite each other), an unknown
            ``lse_b_base``.
    """
    _check(out, lse, out_b, lse_b)
    refuse_autograd((("out", out), ("lse", lse), ("out_b", out_b), ("lse_b", lse_b)))  # as merge_attn_states
    if not lse.is_contiguous():
        raise ValueError("lse must be contiguous to be merged in place")
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        raise ValueError(
            f"out must not overlap itself to be merged in place (an expanded view: shape "
            f"{list(out.shape)}, strides {list(out.stride())}); pass a tensor of its own"
        )
    if lse_b_base != "ln" and lse_b_base != "log2":
        raise ValueError(f"lse_b_base must be 'ln' (natural log) or 'log2', got {lse_b_base!r}")
    log2 = lse_b_base == "log2"
    choice = _choice(out, out_b)
    if choice.name == "triton":
        from .kernels.merge import merge_triton

        merge_triton(out, lse, out, lse, out_b, lse_b, log2)
        return
    if log2 and choice.name == "torch":
        lse_b = lse_b * _LN2  # the float32 multiply FlashInfer's conversion does
    t, h, d = out.shape
    for a in range(0, t, choice.rows_per_piece):
        r = slice(a, min(t, a + choice.rows_per_piece))
        if choice.name == "flashinfer":
            from flashinfer.cascade import merge_state_in_place

            g = choice.heads_per_row
            s = _as_base2(lse[r])
            s_b = (
                torch.where(lse_b[r] == float("inf"), float("-inf"), lse_b[r]).contiguous()
                if log2
                else _as_base2(lse_b[r])
            )
            merge_state_in_place(out[r].view(-1, g, d), s.view(-1, g), out_b[r].view(-1, g, d), s_b.view(-1, g))
            torch.mul(s, _LN2, out=lse[r])
        else:
            new_out, new_lse = _merge_torch(out[r], lse[r], out_b[r], lse_b[r])
            out[r].copy_(new_out)
            lse[r].copy_(new_lse)


def merge_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Merge attention sinks into ``(out [N, H, D], lse [N, H])`` in place (:func:`merge_attn_states_`): per head one
    more key of logit ``sinks [H]`` (any float dtype or device; in the units of the scaled logits, natural log) and
    value vector 0, i.e. a partial of out 0 and LSE ``sinks``: ``out * exp(lse) / (exp(lse) + exp(sinks))``.

    Raises:
        TypeError / ValueError: as :func:`merge_attn_states_` (``lse`` not float32 or not contiguous, ...).
    """
    sink_lse = sinks.to(device=lse.device, dtype=torch.float32).expand(lse.shape)
    merge_attn_states_(out, lse, out.new_zeros(()).expand(out.shape), sink_lse)


def merge_planned_(
    choice: MergeChoice,
    out: torch.Tensor,
    lse: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    lse_b_base: str = "ln",
    dst: Optional[torch.Tensor] = None,
) -> None:
    """:func:`merge_attn_states_` for partials whose shapes, dtypes, devices and layout the caller guarantees
    (:func:`mla_bridge.mla_prefill`: the plan fixes every one of them, and ``out`` / ``lse`` are its own contiguous
    row slices), with ``choice`` = :func:`select_merge` of ``(1, H, D)`` in ``out_b``'s dtype made once per call.
    Triton's choice (which serves any row count and any strides) launches the kernel with no checks, saving their
    host time (tens of microseconds per merge on the H200's host: docs/results.md); any other choice goes through
    :func:`merge_attn_states_`, which checks and picks the pieces for the real row count.

    ``dst``: where the merged out goes (default ``out``: in place; ``lse`` is always merged in place), of ``out``'s
    shape; ``out`` and ``dst`` may each be float32 while ``out_b`` is fp16/bf16 (a float32 running out between the
    merges of a row: :attr:`mla_bridge.PrefillPlan.merge_steps`). The result is computed in float32 and rounded once
    to ``dst``'s dtype by every merge (Triton's kernel; where the dtypes differ and Triton's is not the choice, the
    float32 torch merge, in bounded row pieces on CUDA, since FlashInfer's merge takes one dtype).

    Unlike :func:`merge_attn_states`, an LSE of +inf is NOT read as an empty partial: the passes of
    :func:`mla_bridge.mla_prefill` mark an empty row with -inf, so a +inf comes from an infinite logit (an inf in q
    or k), whose softmax is undefined, and the merged row comes out non-finite instead of silently dropping that
    pass. Only a merge forced to FlashInfer's kernel (``MLA_BRIDGE_MERGE=flashinfer``) keeps its own rules there."""
    log2 = lse_b_base == "log2"
    if choice.name == "triton":
        from .kernels.merge import merge_triton

        merge_triton(out if dst is None else dst, lse, out, lse, out_b, lse_b, log2, inf_empty=False)
        return
    if choice.name == "flashinfer" and (dst is None or (dst is out and out.dtype == out_b.dtype)):
        merge_attn_states_(out, lse, out_b, lse_b, lse_b_base=lse_b_base)
        return
    dst = out if dst is None else dst
    if log2:
        lse_b = lse_b * _LN2  # the float32 multiply FlashInfer's conversion does
    t, h, d = out.shape
    rows = _torch_rows(t, h, d, out.device.type)
    for a in range(0, t, rows):
        r = slice(a, min(t, a + rows))
        new_out, new_lse = _merge_torch(out[r], lse[r], out_b[r], lse_b[r], dtype=torch.float32, inf_empty=False)
        dst[r].copy_(new_out)  # rounded once, to nearest even, into dst's dtype
        lse[r].copy_(new_lse)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention partials over disjoint key sets (the kernel: :func:`select_merge`).

    Args:
        out_a, out_b: ``[T, H, D]``, same dtype and device; any T, H and D.
        lse_a, lse_b: ``[T, H]`` float32, natural log; -inf or +inf marks an empty partial; NaN stays NaN (except
            in FlashInfer's merge, see the module docstring).

    Returns:
        ``(out [T, H, D] in out_a's dtype, contiguous; lse [T, H] float32 natural log)``; rows where both partials
        are empty give ``(0, -inf)``.

    Raises:
        TypeError: a non-tensor, a dtype mismatch, an lse that is not float32.
        ValueError: shapes that disagree (the message names the argument), different devices, an input that
            requires grad while autograd records (no backward: run under ``torch.no_grad()``).
    """
    _check(out_a, lse_a, out_b, lse_b)
    # no backward on CUDA (the Triton / FlashInfer merges write outside autograd): refused everywhere, as in attention
    refuse_autograd((("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)))
    choice = _choice(out_a, out_b)
    t, h, d = out_a.shape
    if choice.name == "triton":
        from .kernels.merge import merge_triton

        out = torch.empty((t, h, d), dtype=out_a.dtype, device=out_a.device)
        lse = torch.empty((t, h), dtype=torch.float32, device=out_a.device)
        merge_triton(out, lse, out_a, lse_a, out_b, lse_b)
        return out, lse
    if choice.rows_per_piece >= t:
        return _merge_piece(choice, out_a, lse_a, out_b, lse_b)
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty(t, h, dtype=torch.float32, device=out_a.device)
    for a in range(0, t, choice.rows_per_piece):
        r = slice(a, min(t, a + choice.rows_per_piece))
        out[r], lse[r] = _merge_piece(choice, out_a[r], lse_a[r], out_b[r], lse_b[r])
    return out, lse


def _merge_piece(choice: MergeChoice, out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    if choice.name == "flashinfer":
        from flashinfer.cascade import merge_state

        t, h, d = out_a.shape
        g = choice.heads_per_row
        v, s = merge_state(
            out_a.view(-1, g, d), _as_base2(lse_a).view(-1, g), out_b.view(-1, g, d), _as_base2(lse_b).view(-1, g)
        )
        return v.view(t, h, d), s.view(t, h).mul_(_LN2)
    return _merge_torch(out_a, lse_a, out_b, lse_b)


def _merge_torch(
    out_a, lse_a, out_b, lse_b, dtype: Optional[torch.dtype] = None, inf_empty: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 merge; out returned in ``dtype`` (default out_a's), lse float32. ``inf_empty``: an LSE of +inf
    marks an empty partial (else it is an infinite logit: the merged row comes out non-finite)."""
    neg_inf = torch.tensor(float("-inf"), device=lse_a.device)
    la = torch.where(lse_a == float("inf"), neg_inf, lse_a) if inf_empty else lse_a
    lb = torch.where(lse_b == float("inf"), neg_inf, lse_b) if inf_empty else lse_b
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa = torch.exp(la - m_safe)
    wb = torch.exp(lb - m_safe)
    total = wa + wb
    nonempty = total != 0  # a NaN lse stays NaN: it is never read as an empty partial
    total_safe = torch.where(nonempty, total, torch.ones_like(total))
    lse = torch.where(nonempty, m_safe + torch.log(total_safe), neg_inf)
    sa = (wa / total_safe).unsqueeze(-1)
    sb = (wb / total_safe).unsqueeze(-1)
    # where(), not a product, so that an empty partial's out (possibly garbage, even NaN) never leaks.
    zero = torch.zeros((), dtype=torch.float32, device=out_a.device)
    out = torch.where(sa != 0, out_a.float() * sa, zero) + torch.where(sb != 0, out_b.float() * sb, zero)
    return out.to(out_a.dtype if dtype is None else dtype), lse
