"""The paged latent cache: its dtypes and FP8 scale rules, quantization, and the gather by ``block_table``.

A cache is ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (576 for DeepSeek): each token's kv_c
(after the KV RMSNorm) followed by its k_pe (after RoPE). Two kinds are supported:

* **unquantized**: the compute dtype of the plan (bfloat16 / float16 on CUDA, float32 on the CPU); no scale.
* **FP8 e4m3** (vLLM's ``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"`` MLA cache): dtype ``torch.float8_e4m3fn``, or a
  ``torch.uint8`` view of the same bytes (as vLLM allocates it), with ONE per-tensor ``kv_cache_scale`` for the whole
  latent (kv_c and k_pe alike). Stored value ``= e4m3(float32(latent) / scale)`` rounded to nearest even and
  saturated to +-448 (vLLM's ``concat_and_cache_mla``: ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE,
  __NV_E4M3)``); dequantized value ``= round_to_dtype(float32(stored) * scale)`` (vLLM's
  ``gather_and_maybe_dequant_cache``: ``scaled_convert``, a float32 product rounded once to the output dtype).

Refused with a :class:`ValueError` / :class:`TypeError` that says what is supported: ``float8_e5m2`` caches (vLLM's
``fp8_e5m2``), vLLM's ``fp8_ds_mla`` (656-byte rows holding tile scales, for sparse attention), a missing scale for an
FP8 cache, a scale given for an unquantized cache (it would silently scale the logits), a scale that is not a Python
number or a 0-d / 1-element float32 tensor on the cache's device, and a non-finite or non-positive scale (checked on
the host for Python numbers and CPU tensors; a CUDA tensor is read on the device only, never with a host sync).
Under CUDA-graph capture a Python-float scale is baked into the captured kernels; a tensor scale is read at every
replay (update it in place to change it).

The gather (context rows through ``block_table``, dequantized into the plan's dtype, and for the fused schedule the new
tokens' kv_c / k_pe placed after each request's context) has two implementations chosen in ONE place,
:func:`gather_impl`: a Triton kernel (:mod:`mla_bridge.kernels.gather`, CUDA only, imported lazily) and the torch
path (the CPU and fallback). They give bitwise identical results. The cache is indexed as
``[num_blocks, block_size, L]`` through its strides, so a non-contiguous cache is never copied. A context chunk's rows
are named either token by token (``req_ids`` / ``positions``) or by the chunk's key indptr (:class:`ChunkRows`,
:func:`gather_rows`: what a plan on CUDA hands the gather, so that planning makes no per-token index tensor).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

from . import switches
from .weights import broadcast_heads

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "SUPPORTED_CACHE_DTYPES",
    "resolve_kv_cache_dtype",
    "is_fp8",
    "as_cache_view",
    "check_kv_cache",
    "quantize_latent_cache",
    "dequantize_latent",
    "gather_impl",
    "gather_latent",
    "gather_rows",
    "ChunkRows",
    "fused_latent",
    "cache_dtype_name",
]

#: The FP8 cache dtype (e4m3, finite-only "fn" variant, as vLLM's ``fp8`` / ``fp8_e4m3`` cache).
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3fn value; the computed scale is ``amax / FP8_MAX`` (vLLM's ``kFp8ScaleDivisor`` on NVIDIA).
FP8_MAX = 448.0
#: What a cache may hold, for error messages.
SUPPORTED_CACHE_DTYPES = (
    "the plan's compute dtype (bfloat16, float16, float32)",
    "float8_e4m3fn (vLLM 'fp8' / 'fp8_e4m3') or its uint8 view, with one per-tensor kv_cache_scale",
)
_SUPPORTED = "supported: " + "; ".join(SUPPORTED_CACHE_DTYPES)
#: vLLM's fp8_ds_mla entry: 512 fp8 values + 4 float32 tile scales + 64 bf16 rope values.
_DS_MLA_ENTRY_BYTES = 656

Scale = Union[float, int, torch.Tensor]


def _refuse_fp8_variant(name: str) -> None:
    raise ValueError(f"kv_cache dtype {name} is not supported ({_SUPPORTED})")


def resolve_kv_cache_dtype(kv_cache_dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype a plan records: ``None`` / ``"auto"`` -> ``compute_dtype``; ``"fp8"`` / ``"fp8_e4m3"`` /
    ``torch.float8_e4m3fn`` / ``torch.uint8`` (a view of FP8 bytes) -> ``torch.float8_e4m3fn``; ``compute_dtype``
    itself (or its name) -> ``compute_dtype``.

    Raises:
        ValueError: ``fp8_e5m2`` / ``torch.float8_e5m2``, ``fp8_ds_mla``, or an unquantized dtype other than
            ``compute_dtype`` (the message lists what is supported).
        TypeError: neither a string nor a ``torch.dtype``.
    """
    if kv_cache_dtype is None:
        return compute_dtype
    if isinstance(kv_cache_dtype, str):
        name = kv_cache_dtype.strip().lower()
        if name == "auto":
            return compute_dtype
        if name in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
            return FP8_DTYPE
        if name in ("fp8_e5m2", "float8_e5m2", "fp8_ds_mla", "fp8_inc"):
            _refuse_fp8_variant(repr(kv_cache_dtype))
        dt = getattr(torch, name, None) if name in ("bfloat16", "float16", "float32", "half", "float") else None
        if dt is None:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is unknown ({_SUPPORTED}; strings: 'auto', 'fp8')")
        kv_cache_dtype = dt
    if not isinstance(kv_cache_dtype, torch.dtype):
        raise TypeError(
            f"kv_cache_dtype must be a torch.dtype or a string ('auto', 'fp8'), got {type(kv_cache_dtype).__name__}"
        )
    if kv_cache_dtype in (FP8_DTYPE, torch.uint8):
        return FP8_DTYPE
    if kv_cache_dtype.is_floating_point and kv_cache_dtype.itemsize == 1:
        _refuse_fp8_variant(str(kv_cache_dtype))
    if kv_cache_dtype != compute_dtype:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} differs from the compute dtype {compute_dtype}: an "
            f"unquantized cache must hold the compute dtype ({_SUPPORTED})"
        )
    return kv_cache_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the FP8 cache dtype (and its uint8 view)."""
    return dtype in (FP8_DTYPE, torch.uint8)


def cache_dtype_name(dtype: torch.dtype) -> str:
    """``"fp8_e4m3"`` for an FP8 cache, else the torch dtype's name (``"bfloat16"``): for tables and JSON."""
    return "fp8_e4m3" if is_fp8(dtype) else str(dtype).replace("torch.", "")


def as_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_cache`` with a uint8 view reinterpreted as ``float8_e4m3fn`` (the same bytes, no copy); others unchanged.

    Raises:
        ValueError: a uint8 cache whose rows are 656 bytes (vLLM's ``fp8_ds_mla``), an ``float8_e5m2`` cache.
    """
    if kv_cache.dtype == torch.uint8:
        if kv_cache.dim() >= 1 and kv_cache.shape[-1] == _DS_MLA_ENTRY_BYTES:
            _refuse_fp8_variant(f"fp8_ds_mla (uint8 rows of {_DS_MLA_ENTRY_BYTES} bytes with tile scales)")
        return kv_cache.view(FP8_DTYPE)
    if kv_cache.dtype == torch.float8_e5m2 or (
        kv_cache.dtype.is_floating_point and kv_cache.dtype.itemsize == 1 and kv_cache.dtype != FP8_DTYPE
    ):
        _refuse_fp8_variant(str(kv_cache.dtype))
    return kv_cache


def _scale_value(kv_cache_scale: Scale, device: torch.device) -> Union[float, torch.Tensor]:
    """A checked scale: a Python float (rounded to float32, the precision every kernel multiplies in) or a 0-d
    float32 tensor on ``device``."""
    if isinstance(kv_cache_scale, torch.Tensor):
        s = kv_cache_scale
        if s.dtype != torch.float32:
            raise TypeError(f"kv_cache_scale must be a float32 tensor (vLLM's layer._k_scale), got {s.dtype}")
        if s.numel() != 1:
            raise ValueError(
                f"kv_cache_scale must be 0-d or hold 1 element (one per-tensor scale), got shape {list(s.shape)}"
            )
        if s.device != device:
            raise ValueError(f"kv_cache_scale is on {s.device}, but kv_cache is on {device}")
        s = s.reshape(())
        if s.device.type == "cpu":
            v = float(s)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"kv_cache_scale must be finite and > 0, got {v}")
        return s
    if isinstance(kv_cache_scale, bool) or not isinstance(kv_cache_scale, (int, float)):
        try:
            import numpy as np

            if not isinstance(kv_cache_scale, (np.floating, np.integer)):
                raise TypeError
        except TypeError:
            raise TypeError(
                f"kv_cache_scale must be a Python float or a 0-d/1-element float32 tensor, got "
                f"{type(kv_cache_scale).__name__}"
            ) from None
    v = float(kv_cache_scale)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"kv_cache_scale must be finite and > 0, got {v}")
    v32 = float(torch.tensor(v, dtype=torch.float32))
    if not (math.isfinite(v32) and v32 > 0):
        raise ValueError(f"kv_cache_scale {v} is not a positive finite float32")
    return v32


def check_kv_cache(
    kv_cache: torch.Tensor, kv_cache_scale: Optional[Scale], cache_dtype: torch.dtype
) -> tuple[torch.Tensor, Optional[Union[float, torch.Tensor]]]:
    """Check a cache and its scale against the cache dtype a plan expects, on the host, before any kernel.

    Args:
        kv_cache: ``[num_blocks, block_size, L]`` (shape checked by the caller).
        kv_cache_scale: ``None`` for an unquantized cache; for FP8 a Python float or a 0-d/1-element float32
            tensor on the cache's device.
        cache_dtype: what the plan expects (:func:`resolve_kv_cache_dtype`).

    Returns:
        ``(cache, scale)``: the cache as ``float8_e4m3fn`` if it was a uint8 view (same bytes), and the scale as a
        float (float32-rounded) or a 0-d float32 device tensor; ``scale`` is None for an unquantized cache.

    Raises:
        TypeError: a cache dtype other than the plan's, a scale of the wrong type or dtype.
        ValueError: an FP8 variant that is not supported, a missing scale for FP8, a scale for an unquantized
            cache, a scale on another device, not finite or not > 0.
    """
    cache = as_cache_view(kv_cache)
    if cache.dtype != cache_dtype:
        hint = (
            " (build the plan with kv_cache_dtype='fp8')"
            if is_fp8(cache.dtype)
            else " (build the plan with kv_cache_dtype=None for an unquantized cache)"
            if is_fp8(cache_dtype)
            else ""
        )
        raise TypeError(
            f"kv_cache must have dtype {cache_dtype} (the plan's kv_cache_dtype), got {kv_cache.dtype}" + hint
        )
    if is_fp8(cache.dtype):
        if kv_cache_scale is None:
            raise ValueError(
                "kv_cache_scale is required for an FP8 (float8_e4m3fn) kv_cache: the per-tensor scale "
                "its values were quantized with (vLLM's layer._k_scale)"
            )
        return cache, _scale_value(kv_cache_scale, cache.device)
    if kv_cache_scale is not None:
        raise ValueError(
            f"kv_cache_scale was given for a {cache.dtype} kv_cache: only an FP8 cache takes a scale "
            f"(applying one to an unquantized cache would scale every logit)"
        )
    return cache, None


def quantize_latent_cache(
    latent: torch.Tensor, scale: Optional[Scale] = None
) -> tuple[torch.Tensor, Union[float, torch.Tensor]]:
    """Quantize latent values (any shape, e.g. a whole ``[num_blocks, block_size, 576]`` cache) to FP8 e4m3.

    The rounding of vLLM's cache write (``concat_and_cache_mla`` with ``kv_cache_dtype="fp8"``):
    ``e4m3(float32(x) / float32(scale))``, round to nearest even, saturated to +-448 (``__NV_SATFINITE``; +-inf
    saturates too, NaN stays NaN).

    Args:
        latent: floating tensor (bf16 / fp16 / float32 / float64; read as float32).
        scale: the per-tensor scale (float or 0-d/1-element float32 tensor on ``latent``'s device); default
            ``amax / 448`` over the finite values of ``latent`` (1.0 when there are none or all are 0; at least
            float32's smallest normal, 1.18e-38, when the quotient underflows), computed on ``latent``'s device
            without a host sync.

    Returns:
        ``(cache float8_e4m3fn of latent's shape, scale)``: ``scale`` as given, or the computed one as a 0-d float32
        tensor on ``latent``'s device.

    Raises:
        TypeError: ``latent`` not a floating tensor; ValueError / TypeError: a bad scale (see :func:`check_kv_cache`).
    """
    if not isinstance(latent, torch.Tensor) or not latent.dtype.is_floating_point or latent.dtype.itemsize == 1:
        raise TypeError(
            f"latent must be a floating tensor (bf16/fp16/float32/float64), got "
            f"{latent.dtype if isinstance(latent, torch.Tensor) else type(latent).__name__}"
        )
    x = latent.float()
    s: Union[float, torch.Tensor]
    scale_out: Union[float, torch.Tensor]
    if scale is None:
        a = x.abs()
        amax = torch.where(torch.isfinite(a), a, 0.0).amax() if a.numel() else a.new_zeros(())
        # amax / 448 underflows float32 below about 6e-43: at least the smallest normal float32 then (a scale of 0
        # is refused everywhere), which quantizes those values to 0
        scale_out = torch.where(
            amax > 0, (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax)
        )
        s = scale_out
    else:
        s = _scale_value(scale, latent.device)
        scale_out = scale
    q = (x / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # clamp keeps NaN; torch's cast rounds to nearest even
    return q, scale_out


def dequantize_latent(stored: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """``round_to_dtype(float32(stored) * scale)``: FP8 (or uint8-view) values back to ``dtype``, as the gather does."""
    return (as_cache_view(stored).float() * _scale_value(scale, stored.device)).to(dtype)


# ---------------------------------------------------------------------------------------------------- the gather
def gather_impl(device: torch.device) -> str:
    """The ONE place choosing the gather implementation: ``"triton"`` on CUDA when Triton imports, else ``"torch"``.

    ``MLA_BRIDGE_GATHER=torch`` forces the torch path (for comparison and as an escape hatch); ``=triton`` forces
    Triton even on the CPU (only with ``TRITON_INTERPRET=1``, for development); ``auto`` or unset: the default.

    Raises:
        ValueError: another ``MLA_BRIDGE_GATHER`` value; ``=triton`` where Triton does not import, or off CUDA
            without ``TRITON_INTERPRET=1``.
    """
    from .kernels import triton_available, triton_interpreting

    forced = switches.gather()  # "auto", "torch" or "triton" (another value is refused there)
    if forced == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    if forced == "torch":
        return "torch"
    if not triton_available():
        raise ValueError("MLA_BRIDGE_GATHER=triton, but Triton does not import here")
    if torch.device(device).type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"MLA_BRIDGE_GATHER=triton runs a Triton kernel: it needs a CUDA device, got {device} "
            f"(TRITON_INTERPRET=1 runs it on the CPU, for development)"
        )
    return "triton"


def _torch_rows(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    scale,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Cache rows ``[N, L]`` of (request, position) pairs, dequantized into ``dtype``; indexes the 3-D cache
    directly (advanced indexing through strides: no reshape, so a strided cache is not copied)."""
    bs = cache.shape[1]
    block_ids = block_table[req_ids, torch.div(positions, bs, rounding_mode="floor")].long()
    if scale is None:
        return cache[block_ids, positions % bs]
    rows = cache.view(torch.uint8)[block_ids, positions % bs].view(FP8_DTYPE)  # bytes: indexing any build supports
    return rows.float().mul_(scale).to(dtype)


def _split_off_k_pe(latent: torch.Tensor, k_pe_out: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch path's k_pe broadcast (:func:`mla_bridge.weights.broadcast_heads`, the one place choosing how):
    ``k_pe_out[i, h] = latent[i, rank:]`` (``rank`` = latent width minus ``k_pe_out``'s), and the kv_c columns
    ``latent[:, :rank]`` (a view) returned; ``latent`` itself without ``k_pe_out``."""
    if k_pe_out is None:
        return latent
    rank = latent.shape[1] - k_pe_out.shape[2]
    broadcast_heads(k_pe_out, latent[:, rank:])
    return latent[:, :rank]


def gather_latent(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    dtype: torch.dtype,
    kv_cache_scale=None,
    impl: Optional[str] = None,
    k_pe_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Latent rows ``[N, L]`` in ``dtype`` of the context tokens ``(req_ids[i], positions[i])`` (int64 device
    tensors), read through ``block_table`` and dequantized (FP8 caches) in the same pass.

    ``kv_cache`` and ``kv_cache_scale`` must have been checked by :func:`check_kv_cache` (the cache as
    float8_e4m3fn, the scale as a float or 0-d tensor). ``impl`` overrides :func:`gather_impl` (tests).
    ``k_pe_out`` (``[N, H, qk_rope_head_dim]`` in ``dtype``, unit last stride: the k_pe columns of the split
    up-projection layout's key buffer): each row's k_pe is written into every head there (in the gather's one
    launch on the Triton path, by a copy on the torch path), and the rows returned are ``[N, kv_lora_rank]``
    (kv_c only).
    """
    impl = impl or gather_impl(kv_cache.device)
    if impl == "triton":
        from .kernels.gather import gather_latent_triton

        lat = kv_cache.shape[-1]
        width = lat if k_pe_out is None else lat - k_pe_out.shape[2]
        out = torch.empty(req_ids.shape[0], width, dtype=dtype, device=kv_cache.device)
        gather_latent_triton(out, kv_cache, block_table, req_ids, positions, kv_cache_scale, k_pe_out, width)
        return out
    return _split_off_k_pe(_torch_rows(kv_cache, block_table, req_ids, positions, kv_cache_scale, dtype), k_pe_out)


def fused_latent(
    plan,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_cache_scale=None,
    *,
    impl: Optional[str] = None,
    k_pe_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The key latents of the plan's fused placements (``ctx_dst``, ``new_dst``: the fused schedule's keys,
    ``main_kv_indptr[-1]`` rows; a sparse plan over an FP8 cache has them too), ``[rows, L]`` in the plan's dtype:
    each request's context rows (gathered, dequantized) followed by its new tokens' ``kv_c ++ k_pe`` (``k_pe`` as
    ``[T, rope]``).
    The new tokens come from the caller's full-precision ``kv_c`` / ``k_pe``, never re-read from the cache.
    ``k_pe_out``: as :func:`gather_latent` (then ``[rows, kv_lora_rank]`` is returned)."""
    dims = plan.dims
    impl = impl or gather_impl(plan.device)
    if impl == "triton":
        from .kernels.gather import fused_latent_triton

        width = dims.latent_dim if k_pe_out is None else dims.kv_lora_rank
        latent = torch.empty(plan.ctx_dst.numel() + plan.new_dst.numel(), width, dtype=plan.dtype, device=plan.device)
        fused_latent_triton(
            latent,
            kv_cache,
            block_table,
            plan.ctx_req_ids,
            plan.ctx_positions,
            plan.ctx_dst,
            kv_c,
            k_pe,
            plan.new_dst,
            kv_cache_scale,
            k_pe_out,
        )
        return latent
    latent = torch.empty(
        plan.ctx_dst.numel() + plan.new_dst.numel(), dims.latent_dim, dtype=plan.dtype, device=plan.device
    )
    latent.index_copy_(
        0,
        plan.ctx_dst,
        _torch_rows(kv_cache, block_table, plan.ctx_req_ids, plan.ctx_positions, kv_cache_scale, plan.dtype),
    )
    latent[:, : dims.kv_lora_rank].index_copy_(0, plan.new_dst, kv_c)
    latent[:, dims.kv_lora_rank :].index_copy_(0, plan.new_dst, k_pe)
    return _split_off_k_pe(latent, k_pe_out)


class ChunkRows(NamedTuple):
    """The context rows of one chunk named by its key indptr instead of token by token: the chunk's requests are
    ``req_start, req_start + 1, ...`` and its tokens ``kv_indptr[j]:kv_indptr[j + 1]`` are request ``req_start + j``'s
    context positions ``first_start + (t - kv_indptr[0])`` for ``j = 0`` (the first request may begin inside its
    context) and ``t - kv_indptr[j]`` for the others, in order (vLLM's context-chunk layout).

    Fields: ``kv_indptr`` (int32 ``[n + 1]``, ``kv_indptr[0] = 0``, non-decreasing, ``kv_indptr[n] = num_tokens``, on
    the cache's device: on CUDA the copy FlashInfer's ``plan()`` made of the chunk pass's kv_indptr), ``req_start``,
    ``first_start`` and ``num_tokens`` (ints), and ``indices``: the per-token ``(req_ids, positions)`` where they were
    made already (a CPU plan makes them at plan time, as host memory), else None. The Triton kernels find each
    token's request by a binary search of ``kv_indptr`` (:func:`mla_bridge.kernels.gather.chunk_rows`); the torch
    path reads :meth:`token_indices`.
    Made by :class:`mla_bridge.PrefillPlan` (``ContextChunk.rows``) from lengths it checked; the fields are not
    checked again here or in the kernels.
    """

    kv_indptr: torch.Tensor
    req_start: int
    first_start: int
    num_tokens: int
    indices: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    #: device bytes per row that :meth:`token_indices` holds at its peak (without ``indices``), an upper bound (three int64 vectors and a
    #: bool one: the positions, the requests, the gathered indptr values, the first-request mask)
    INDEX_BYTES = 32  # type: ignore[misc]  # a class constant, not a field (typing.NamedTuple keeps it so)

    def token_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(req_ids, positions)``: int64 ``[num_tokens]`` each, on ``kv_indptr``'s device: ``indices`` where given,
        else made at every call (torch ops: a search and three elementwise kernels)."""
        if self.indices is not None:
            return self.indices
        kv = self.kv_indptr.long()
        t = torch.arange(self.num_tokens, dtype=torch.int64, device=kv.device)
        j = torch.searchsorted(kv, t, right=True).sub_(1)  # the last request whose keys start at or before t
        positions = t.sub_(kv[j])
        if self.first_start:
            positions.add_(j == 0, alpha=self.first_start)
        return j.add_(self.req_start), positions


def gather_rows(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: ChunkRows,
    *,
    dtype: torch.dtype,
    kv_cache_scale=None,
    impl: Optional[str] = None,
    k_pe_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`gather_latent` of the rows of ``rows`` (a :class:`ChunkRows`): latent rows ``[rows.num_tokens, L]`` in
    ``dtype`` (``[rows.num_tokens, kv_lora_rank]`` with ``k_pe_out``). The Triton kernel reads the rows from
    ``rows.kv_indptr``, the torch path from :meth:`ChunkRows.token_indices`; bitwise equal results. ``kv_cache``,
    ``kv_cache_scale``, ``impl`` and ``k_pe_out`` as :func:`gather_latent`."""
    impl = impl or gather_impl(kv_cache.device)
    if impl == "triton":
        from .kernels.gather import gather_latent_triton

        width = kv_cache.shape[-1] if k_pe_out is None else kv_cache.shape[-1] - k_pe_out.shape[2]
        out = torch.empty(rows.num_tokens, width, dtype=dtype, device=kv_cache.device)
        gather_latent_triton(out, kv_cache, block_table, None, None, kv_cache_scale, k_pe_out, width, rows=rows)
        return out
    return gather_latent(
        kv_cache,
        block_table,
        *rows.token_indices(),
        dtype=dtype,
        kv_cache_scale=kv_cache_scale,
        impl="torch",
        k_pe_out=k_pe_out,
    )


def gather_row_bytes(cache_dtype: torch.dtype, dtype: torch.dtype, latent_dim: int) -> int:
    """Temporary bytes per gathered context row, for :func:`mla_bridge.prefill.prefill_memory_bytes` (an upper bound).

    The torch path allocates the gathered rows in the cache's dtype (``L x e``) and three int64 index tensors (24
    bytes); for an FP8 cache the rows in bytes (``L x 1``), their float32 product (``L x 4``) and the rounded rows
    (``L x e``). The Triton gather writes the destination directly and allocates none of these: the bound is the
    torch path's, so that the budget holds whichever implementation :func:`gather_impl` picks.
    """
    e = torch.empty((), dtype=dtype).element_size()
    if is_fp8(cache_dtype):
        return latent_dim * (1 + 4 + e) + 24
    return latent_dim * e + 24
