"""The keys and values of each attention pass of :func:`mla_bridge.mla_prefill`, built from latent rows.

A pass reads ``k = [k_nope | k_pe]`` ``[N, H, qk_nope_head_dim + qk_rope_head_dim]`` and ``v`` ``[N, H, v_head_dim]``
for its N key tokens: context rows read from the paged cache through ``block_table`` (dequantized when the cache is
FP8), and, in the fused schedule or the chunked schedule's main pass, the new tokens' own ``kv_c`` / ``k_pe``. Two
implementations, chosen in ONE place (:func:`kv_impl` per call, :func:`pass_impl` per pass):

* ``"separate"``: the latent rows are gathered into a buffer (:mod:`mla_bridge.cache`; Triton or torch, chosen by
  :func:`mla_bridge.cache.gather_impl`), then up-projected by the prepared weight's GEMM
  (:meth:`mla_bridge.PreparedKVBProj.up_project`, cuBLAS on CUDA); with a split-layout weight the gather also
  writes each row's k_pe into every head of the key buffer (no k_pe broadcast launch of its own: two launches per
  pass that gathers). The CPU's, and on CUDA that of the large passes (new tokens alone, or gathered with a
  split-layout weight or from an FP8 cache).
* ``"fused"`` (CUDA): one Triton launch per pass (:mod:`mla_bridge.kernels.up_project`): a GEMM whose A rows are
  gathered (and dequantized) as they are loaded and whose epilogue writes k (with the k_pe broadcast) and v in
  place; no latent rows staged in memory and no GEMM FLOPs on the identity layout's padding. On CUDA the default
  for the smaller passes of an eager call (one launch where the host is the bound); in a CUDA graph of
  :mod:`mla_bridge.graphs` (:func:`capture_rule`), whose replays pay no host time per launch, the default takes the
  GPU-faster implementation of each pass (the separate path, except for an identity-layout weight); why:
  :func:`pass_impl`.

A raw weight (:data:`mla_bridge.weights.CHECKPOINT_LAYOUT`) is read in place by the fused kernel; a separate pass
takes its split form (:meth:`mla_bridge.PreparedKVBProj.gemm_form`, made once per call) and "auto" chooses for it as
for the split layout.

Each pass's builder (:func:`fused_schedule_kv`, :func:`new_tokens_kv`, :func:`chunk_kv`) reads the call's inputs
from one :class:`KVInputs`, and meets the prepared weight only through its up-projection methods
(:meth:`~mla_bridge.PreparedKVBProj.gemm_buffer`, :meth:`~mla_bridge.PreparedKVBProj.up_project_unchecked`, and
in the fused kernel :meth:`~mla_bridge.PreparedKVBProj.kernel_rows`).

Both give k and v as strided views of one ``[N, H, 320]`` buffer. The k_pe columns are equal between them (the
identity layout's GEMM writes +0.0 where the kernel copies a -0.0);
k_nope and v are equal within the dtype's rounding of a float32 sum taken in another order (both sum the same
``kv_lora_rank`` products in float32; :mod:`mla_bridge.kernels.up_project`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch

from . import switches
from .cache import fused_latent, gather_rows
from .dims import MLADims
from .weights import CHECKPOINT_LAYOUT, DEFAULT_LAYOUT, LAYOUTS, PreparedKVBProj

__all__ = [
    "kv_impl",
    "auto_bounds",
    "pass_impl",
    "KV_IMPLS",
    "KV_MODES",
    "FUSED_DTYPES",
    "AUTO_FUSED_DTYPES",
    "SEPARATE_FROM_ROWS",
    "SEPARATE_FROM_ROWS_NEW",
    "SEPARATE_FROM_ROWS_FP8",
    "capture_rule",
    "KVInputs",
    "fused_schedule_kv",
    "new_tokens_kv",
    "chunk_kv",
]

#: The implementations a pass can use (module docstring).
KV_IMPLS = switches.KV_IMPLS  # ("fused", "separate")
#: Output dtypes the fused kernel computes (float32 accumulation, one rounding); float64 is not among them.
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The dtypes "auto" gives the fused kernel: those measured (on the H200: bf16; fp16 takes the same code).
AUTO_FUSED_DTYPES = (torch.bfloat16, torch.float16)
#: "auto" builds a gathered pass of at least this many key rows by the separate path when the weight's layout is
#: "split" (:func:`pass_impl`).
SEPARATE_FROM_ROWS = 12288
#: "auto" builds a pass of new tokens alone (nothing gathered) by the separate path from this many rows on.
SEPARATE_FROM_ROWS_NEW = 16384
#: "auto" builds a pass gathering from an FP8 cache by the separate path from this many rows on, with either weight
#: layout (:func:`pass_impl`).
SEPARATE_FROM_ROWS_FP8 = 6144
#: The dims the row bounds above were measured at (DeepSeek-V2-Lite: 16 heads x (128 + 128) columns of rank 512 per
#: row); for other dims a pass's rows count in proportion to its up-projection GEMM's work per row
#: (:func:`pass_impl`).
AUTO_MEASURED_DIMS = MLADims(num_heads=16)
#: What :func:`kv_impl` may answer: one of :data:`KV_IMPLS` for every pass, or "auto" (chosen per pass by
#: :func:`pass_impl`).
KV_MODES = ("auto",) + KV_IMPLS

Hook = Callable[[str], None]

#: True inside :func:`capture_rule`: "auto" chooses as for a pass that a CUDA graph will replay.
_CAPTURE_RULE: contextvars.ContextVar = contextvars.ContextVar("mla_bridge_kv_capture_rule", default=False)


@contextlib.contextmanager
def capture_rule() -> Iterator[None]:
    """Within this context "auto" builds each pass as for a CUDA graph (:func:`pass_impl` with ``capturing=True``).

    :func:`mla_bridge.graphs.capture` runs both its warm-up calls and the capture in it, so that the warm-up launches
    (and compiles, and allocates for) the kernels the capture records. A capture of one's own (``torch.cuda.graph``,
    ``torch.compile``'s CUDA graphs) keeps the eager rule unless its warm-up and capture both run in this context:
    choosing by ``torch.cuda.is_current_stream_capturing()`` alone would launch kernels inside the capture that its
    warm-up never ran (on the H200 a capture in a fresh process then failed: cuBLAS's first handle was created inside
    the capture, ``CUBLAS_STATUS_NOT_INITIALIZED``). A context variable: it covers the calls of this thread (and of
    asyncio tasks started inside it), not work handed to other threads. On the CPU it changes nothing ("auto" is
    "separate" there)."""
    token = _CAPTURE_RULE.set(True)
    try:
        yield
    finally:
        _CAPTURE_RULE.reset(token)


def kv_impl(device: torch.device, requested: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> str:
    """The ONE place choosing how a call's passes build their k and v: "fused", "separate", or "auto" (each pass by
    :func:`pass_impl`).

    ``requested`` (``mla_prefill(kv_impl=)``), else ``MLA_BRIDGE_KV``, else the default (read case-insensitively).
    The default ("auto", or unset) is ``"auto"`` on CUDA where Triton imports and ``dtype`` is bf16/fp16 (or not
    given), else ``"separate"``: there :func:`pass_impl` picks per pass, the fused kernel for the smaller passes
    that gather from the cache and the separate path for the others, and inside :func:`capture_rule` (the graphs of
    :mod:`mla_bridge.graphs`) the GPU-faster one (the measurements are :func:`pass_impl`'s).
    ``"fused"`` off CUDA runs only under ``TRITON_INTERPRET=1``, for development, and not in bfloat16 (``dtype``):
    the interpreter's bfloat16 ``tl.dot`` is wrong (Triton 3.9), so it is refused there. It computes bf16, fp16 and
    float32 (:data:`FUSED_DTYPES`); float64 is refused (the kernel's float32 accumulation is no float64 result).

    Raises:
        ValueError: ``requested`` or ``MLA_BRIDGE_KV`` other than :data:`KV_IMPLS` or "auto" (the message lists
            them); "fused" where Triton does not import, off CUDA without ``TRITON_INTERPRET=1``, interpreted in
            bfloat16, or for a dtype outside :data:`FUSED_DTYPES`.
        TypeError: ``requested`` not a string.
    """
    if requested is not None and not isinstance(requested, str):
        raise TypeError(
            f"kv_impl must be a string ({', '.join(KV_IMPLS)} or 'auto') or None, got {type(requested).__name__}"
        )
    where = "kv_impl" if requested is not None else switches.KV
    choice = requested.strip().lower() if requested is not None else switches.kv()  # the variable: checked there
    if (requested is None and choice == "") or choice == "auto":
        from .kernels import triton_available

        usable = dtype is None or dtype in AUTO_FUSED_DTYPES
        return "auto" if usable and torch.device(device).type == "cuda" and triton_available() else "separate"
    if choice not in KV_IMPLS:
        raise ValueError(f"{where} must be one of {KV_IMPLS} or 'auto', got {requested!r}")
    if choice == "fused":
        from .kernels import triton_available, triton_interpreting

        if dtype is not None and dtype not in FUSED_DTYPES:
            raise ValueError(f"{where} 'fused' computes bfloat16, float16 or float32, got {dtype}; use 'separate'")
        on_cpu = torch.device(device).type != "cuda"
        if on_cpu and not triton_interpreting():
            raise ValueError(
                f"{where} 'fused' runs a Triton kernel: it needs a CUDA device, got {device} "
                f"(TRITON_INTERPRET=1 runs it on the CPU, for development)"
            )
        if not triton_available():
            raise ValueError(f"{where} 'fused' needs Triton, which does not import here; use 'separate'")
        if on_cpu and dtype == torch.bfloat16:
            raise ValueError(
                f"{where} 'fused' under TRITON_INTERPRET=1 cannot run bfloat16 (the interpreter's "
                f"bfloat16 tl.dot is wrong); use float16 or float32 on the CPU"
            )
    return choice


def _gemm_work(dims: MLADims) -> int:
    """Multiply-adds per row of the up-projection: ``num_heads x (qk_nope_head_dim + v_head_dim) x kv_lora_rank``."""
    return dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim) * dims.kv_lora_rank


def auto_bounds(dims: Optional[MLADims] = None) -> tuple[int, int, int]:
    """The row bounds of "auto" at ``dims`` (None: :data:`AUTO_MEASURED_DIMS`), as :func:`pass_impl` applies them:
    ``(gathered from a bf16/fp16 cache, gathered from an FP8 cache, new tokens alone)``, each the fewest rows that
    take the separate path."""
    work, measured = _gemm_work(dims or AUTO_MEASURED_DIMS), _gemm_work(AUTO_MEASURED_DIMS)
    return tuple(
        -(-bound * measured // work) for bound in (SEPARATE_FROM_ROWS, SEPARATE_FROM_ROWS_FP8, SEPARATE_FROM_ROWS_NEW)
    )  # type: ignore[return-value]


def pass_impl(
    mode: str,
    gathered: bool,
    kv_cache_fp8: bool,
    rows: int = 0,
    layout: str = DEFAULT_LAYOUT,
    capturing: bool = False,
    dims: Optional[MLADims] = None,
) -> str:
    """The implementation of one pass of ``rows`` key rows for the call's ``mode`` (:func:`kv_impl`) and the prepared
    weight's ``layout``: "fused" or "separate" as ``mode`` says; "auto" for a pass a CUDA graph will replay
    (``capturing``, inside :func:`capture_rule`: a replay pays no host time per launch), the implementation that is
    faster on the GPU, one for every pass of the graph: "fused" for an identity-layout weight (the identity GEMM's
    padding costs more than the fused kernel's slower GEMM), "separate" for the split layout and a raw weight
    (gather + cuBLAS: faster on the GPU from 4096 rows on and within a few microseconds below, FP8
    included; the identity layout's FP8 and new-token passes were not measured); "auto" for an eager call:

    * a pass that gathers nothing (new tokens alone): "separate" from :data:`SEPARATE_FROM_ROWS_NEW` rows on,
      "fused" below;
    * a pass that gathers from a bf16/fp16 cache: with a split-layout weight "separate" from
      :data:`SEPARATE_FROM_ROWS` rows on and "fused" below; with an identity-layout weight "fused";
    * a pass that gathers from an FP8 cache: "separate" from :data:`SEPARATE_FROM_ROWS_FP8` rows on, "fused" below,
      with either layout.

    Why (measured on the H200 with DeepSeek-V2-Lite dims; the figures are in docs/results.md): on a gathered pass from
    a bf16 cache the split layout's separate path is faster on the GPU from 8192 rows on (cuBLAS's GEMM is faster than
    the fused kernel's) and even with the fused kernel at 2048-4096 rows, where the fused kernel's single launch saves
    host time, the bound of small passes; :data:`SEPARATE_FROM_ROWS` lies between the bench's two chunk sizes, where
    eager runs of its context cases showed the change. Against the identity layout's one GEMM (40% more FLOPs) the
    fused kernel is faster at every size. New tokens alone gather nothing: the two are even on the GPU up to 4096 rows
    and cuBLAS is ahead from there, while the fused kernel's one launch saves more host time than its GPU cost below
    :data:`SEPARATE_FROM_ROWS_NEW` rows.

    The bounds are rows at :data:`AUTO_MEASURED_DIMS`; a pass at other ``dims`` (None: those) counts its rows times
    its GEMM work per row over theirs (``num_heads x (qk_nope_head_dim + v_head_dim) x kv_lora_rank``): what the
    fused kernel saves is host time per launch, the same at any dims, and what it costs is GPU time in proportion to
    the GEMM. At GLM-5's dims (64 heads, 192 + 256: 7x the work per row) a 4-chunk context pass of 8000 rows ran the
    fused kernel at 1.21x the attention + GEMM time and gather + cuBLAS at 1.02x (H100, docs/results.md).

    From an FP8 cache the fused kernel dequantizes each row once per head part (2H times), the gather once: slower on
    the GPU, but below :data:`SEPARATE_FROM_ROWS_FP8` rows the host time it saves is at least 3x the GPU time it adds.
    (Its FP8 path runs a pipeline of at most 2 stages: with 3 it gave wrong results,
    :mod:`mla_bridge.kernels.up_project`.)

    Captured, a replay pays no host time per launch, so the GPU-faster choice for every pass made the default graph of
    the bench's context cases faster than the eager rule's mix (docs/results.md). So a graph of the default call
    is bitwise the eager call with ``kv_impl="separate"`` (``"fused"`` for an identity-layout weight), and the default
    eager call within one rounding of k_nope / v (the module docstring).

    Raises:
        ValueError: ``mode`` not in :data:`KV_MODES`, ``layout`` neither in :data:`mla_bridge.weights.LAYOUTS` nor
            :data:`mla_bridge.weights.CHECKPOINT_LAYOUT` (a raw weight, chosen for as the split layout), ``rows``
            not an int >= 0.
        TypeError: ``gathered``, ``kv_cache_fp8`` or ``capturing`` not a bool; ``dims`` not an :class:`MLADims`.
    """
    if mode not in KV_MODES:
        raise ValueError(f"mode must be one of {KV_MODES} (what kv_impl answers), got {mode!r}")
    if layout == CHECKPOINT_LAYOUT:  # a raw weight read in place: its separate passes take the split form
        layout = "split"
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {LAYOUTS} (or {CHECKPOINT_LAYOUT!r}, taken as 'split'), got {layout!r}"
        )
    for name, flag in (("gathered", gathered), ("kv_cache_fp8", kv_cache_fp8), ("capturing", capturing)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r} ({type(flag).__module__}.{type(flag).__qualname__})")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be an int >= 0 (key rows of the pass), got {rows!r}")
    if dims is not None and not isinstance(dims, MLADims):
        raise TypeError(f"dims must be an MLADims or None, got {type(dims).__name__}")
    if mode != "auto":
        return mode
    if capturing:  # one implementation for every pass of the graph (a new-token pass is never told of FP8)
        return "fused" if layout == "identity" else "separate"
    # rows x work >= bound x measured work, in integers (exact at the bounds)
    work, measured = rows * _gemm_work(dims or AUTO_MEASURED_DIMS), _gemm_work(AUTO_MEASURED_DIMS)
    if not gathered:
        return "separate" if work >= SEPARATE_FROM_ROWS_NEW * measured else "fused"
    if kv_cache_fp8:
        return "separate" if work >= SEPARATE_FROM_ROWS_FP8 * measured else "fused"
    return "separate" if layout == "split" and work >= SEPARATE_FROM_ROWS * measured else "fused"


def _pass_impl(
    impl: Optional[str],
    device: torch.device,
    dtype: torch.dtype,
    gathered: bool,
    kv_cache_fp8: bool,
    rows: int,
    layout: str,
    dims: Optional[MLADims] = None,
) -> str:
    """:func:`pass_impl` of the caller's choice ``impl`` (:func:`kv_impl`'s answer; None: asked here), told whether the
    call runs inside :func:`capture_rule` (read only when the answer depends on it: "auto", on CUDA)."""
    mode = impl or kv_impl(device, None, dtype)
    capturing = mode == "auto" and device.type == "cuda" and _CAPTURE_RULE.get()
    return pass_impl(mode, gathered, kv_cache_fp8, rows, layout, capturing, dims)


def _no_phase(name: str) -> None:
    """The phase hook of a call that times nothing."""


@dataclass(frozen=True, eq=False, slots=True)
class KVInputs:
    """What every pass of one ``mla_prefill`` call builds its k and v from (made once per call, after its checks).

    Attributes:
        weight: the call's :class:`mla_bridge.PreparedKVBProj` (:func:`mla_bridge.weights.as_prepared`).
        kv_c: the new tokens' latent ``[T, kv_lora_rank]``; k_pe: their RoPE key ``[T, qk_rope_head_dim]``; both in
            the plan's dtype, on its device (which :attr:`dtype` and :attr:`device` read).
        kv_cache: the paged latent cache ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, and
            kv_cache_scale its FP8 scale (a float or a float32 tensor; None for an unquantized cache), both as
            :func:`mla_bridge.cache.check_kv_cache` gives them.
        block_table: ``[num_requests, max_blocks]`` integer block ids.
        hook: called with ``"gather"`` before a separate pass's gather and ``"up-projection"`` before its GEMM (the
            fused kernel is one "up-projection" phase); default: nothing.
        impl / gather: the call's choices of :func:`kv_impl` / :func:`mla_bridge.cache.gather_impl` (None: asked
            per pass).
    """

    weight: PreparedKVBProj
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    kv_cache_scale: Union[None, float, torch.Tensor] = None
    hook: Hook = _no_phase
    impl: Optional[str] = None
    gather: Optional[str] = None

    @property
    def dtype(self) -> torch.dtype:
        """The plan's dtype (``kv_c``'s)."""
        return self.kv_c.dtype

    @property
    def device(self) -> torch.device:
        """The plan's device (``kv_c``'s)."""
        return self.kv_c.device


def _kv_buffer(n: int, weight: PreparedKVBProj, dtype: torch.dtype, device: torch.device):
    d = weight.dims
    out = torch.empty(n, d.num_heads, d.head_dim_qk + d.v_head_dim, dtype=dtype, device=device)
    return out, out[..., : d.head_dim_qk], out[..., d.head_dim_qk :]


def fused_schedule_kv(plan, inputs: KVInputs):
    """k, v of the fused schedule's one pass: ``main_kv_indptr[-1]`` keys, each request's context rows (placed by
    ``plan.ctx_dst``) followed by its new tokens (``plan.new_dst``), from ``inputs`` (:class:`KVInputs`). Calls
    ``inputs.hook`` as :class:`KVInputs` says. The pass's own implementation is :func:`pass_impl` of
    ``inputs.impl``: this pass gathers, from an FP8 cache when ``inputs.kv_cache_scale`` is given."""
    x, weight, scale = inputs, inputs.weight, inputs.kv_cache_scale
    keys = int(plan.main_kv_indptr[-1])
    if (
        _pass_impl(x.impl, plan.device, plan.dtype, True, scale is not None, keys, weight.gemm_layout, weight.dims)
        == "fused"
    ):
        x.hook("up-projection")
        from .kernels.up_project import up_project_triton

        out, k, v = _kv_buffer(keys, weight, plan.dtype, plan.device)
        up_project_triton(
            out,
            weight,
            kv_cache=x.kv_cache,
            block_table=x.block_table,
            req_ids=plan.ctx_req_ids,
            positions=plan.ctx_positions,
            ctx_dst=plan.ctx_dst,
            kv_c=x.kv_c,
            k_pe=x.k_pe,
            new_dst=plan.new_dst,
            kv_cache_scale=scale,
        )
        return k, v
    x.hook("gather")
    buf, k_pe_out = weight.gemm_buffer(keys, plan.device)
    latent = fused_latent(plan, x.kv_c, x.k_pe, x.kv_cache, x.block_table, scale, impl=x.gather, k_pe_out=k_pe_out)
    x.hook("up-projection")
    return weight.up_project_unchecked(latent, buf=buf)


def new_tokens_kv(inputs: KVInputs):
    """k, v of the new tokens alone (the chunked schedule's main pass), ``inputs.kv_c`` and ``inputs.k_pe``. Hooks as
    :func:`fused_schedule_kv` (the separate path gathers nothing: the GEMM reads kv_c and k_pe where they are, the
    identity layout after concatenating them)."""
    x, weight, kv_c = inputs, inputs.weight, inputs.kv_c
    if (
        _pass_impl(x.impl, kv_c.device, kv_c.dtype, False, False, kv_c.shape[0], weight.gemm_layout, weight.dims)
        == "fused"
    ):
        x.hook("up-projection")
        from .kernels.up_project import up_project_triton

        out, k, v = _kv_buffer(kv_c.shape[0], weight, kv_c.dtype, kv_c.device)
        up_project_triton(out, weight, kv_c=kv_c, k_pe=x.k_pe)
        return k, v
    x.hook("up-projection")
    return weight.up_project_unchecked(kv_c, x.k_pe)


def chunk_kv(chunk, inputs: KVInputs):
    """k, v of one context chunk (:class:`mla_bridge.plan.ContextChunk`): its ``chunk.num_tokens`` context rows in
    order, named by ``chunk.rows`` (:class:`mla_bridge.cache.ChunkRows`), read from ``inputs.kv_cache``. Hooks as
    :func:`fused_schedule_kv`."""
    x, weight, scale, dtype = inputs, inputs.weight, inputs.kv_cache_scale, inputs.dtype
    device, rows = x.kv_cache.device, chunk.num_tokens
    if _pass_impl(x.impl, device, dtype, True, scale is not None, rows, weight.gemm_layout, weight.dims) == "fused":
        x.hook("up-projection")
        from .kernels.up_project import up_project_triton

        out, k, v = _kv_buffer(rows, weight, dtype, device)
        up_project_triton(
            out, weight, kv_cache=x.kv_cache, block_table=x.block_table, rows=chunk.rows, kv_cache_scale=scale
        )
        return k, v
    x.hook("gather")
    buf, k_pe_out = weight.gemm_buffer(rows, device)
    latent = gather_rows(
        x.kv_cache, x.block_table, chunk.rows, dtype=dtype, kv_cache_scale=scale, impl=x.gather, k_pe_out=k_pe_out
    )
    x.hook("up-projection")
    return weight.up_project_unchecked(latent, buf=buf)
