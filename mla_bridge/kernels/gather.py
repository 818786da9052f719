"""Triton kernel: gather latent rows through ``block_table`` (+ FP8 dequantization) and place new tokens' kv_c / k_pe.

One launch writes the latent buffer the up-projection GEMM reads, in the plan's dtype:

* context rows: for each gathered token ``i`` (request ``req_ids[i]``, context position ``positions[i]``, or found in
  a chunk's key indptr by :func:`chunk_rows`: :class:`mla_bridge.cache.ChunkRows`) the row
  ``kv_cache[block_table[req, pos // block_size], pos % block_size, :]`` (read through the cache's strides), for an
  FP8 cache ``float32(stored) * scale`` rounded once to the output dtype (as vLLM's ``gather_and_maybe_dequant_cache``),
  written to row ``ctx_dst[i]`` (or row ``i`` for a chunk's gather);
* new rows (fused schedule): ``kv_c[j] ++ k_pe[j]`` written to row ``new_dst[j]``;
* with ``k_pe_out`` (``[N, H, qk_rope_head_dim]``, the k_pe columns of the split up-projection layout's key buffer):
  each row's k_pe written into every head there (the k_pe broadcast, otherwise a launch of its own) and only its
  ``kv_lora_rank`` kv_c columns into ``out``.

The result is bitwise equal to the torch path of :mod:`mla_bridge.cache` (same float32 product, same round to
nearest even). Imported only by :mod:`mla_bridge.cache`, and only on first use: Triton is not needed on the CPU.
Programs ``[0, ctx_programs)`` take ``BLOCK_M`` context rows each, the rest ``BLOCK_M`` new rows each; every program
covers a whole 576-wide row (``BLOCK_D`` = next power of two, masked).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from . import cdiv, next_power_of_2
from .launch import launch

__all__ = ["gather_latent_triton", "fused_latent_triton", "chunk_rows", "chunk_row_args"]

_BLOCK_M = 4
_OPTIONS = dict(num_warps=4)


@triton.jit
def dequant_tile(x, s, OUT_BF16: tl.constexpr):
    """FP8 e4m3 bytes ``x`` (uint8) -> ``float32(x) * s``, for a bf16 output already rounded to bf16 (the one rounding
    of vLLM's ``gather_and_maybe_dequant_cache``); other outputs are rounded by the caller's cast."""
    x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
    if OUT_BF16:
        # round the float32 product to nearest even on the bits (as cvt.rn.bf16.f32 and torch's .to();
        # NaN -> 0x7FC0 as c10::BFloat16): the interpreter, whose float casts truncate, gives the same bits
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        x = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x


@triton.jit
def chunk_rows(rows, rmask, indptr_ptr, n_req, req_start, first_start, steps):
    """(request, context position) of each chunk row ``rows`` (int64) from the chunk's key indptr (int32 ``[n_req +
    1]``, :class:`mla_bridge.cache.ChunkRows`): ``j``, the last request whose keys start at or before the row, by a
    binary search of ``steps = (n_req - 1).bit_length()`` halvings of ``[lo, hi)`` (``indptr[lo] <= row`` holds
    throughout; once ``hi - lo == 1`` a step changes nothing), then ``req_start + j`` and ``row - indptr[j]`` (plus
    ``first_start`` for ``j = 0``). The loads of the small indptr hit L1/L2; integer arithmetic only, so the rows are
    exactly those of the per-token indices."""
    lo = tl.zeros_like(rows)
    hi = lo + n_req
    for _ in range(steps):
        active = hi - lo > 1
        mid = (lo + hi) // 2
        start = tl.load(indptr_ptr + mid, mask=rmask & active, other=0).to(tl.int64)
        right = start <= rows
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & ~right, mid, hi)
    pos = rows - tl.load(indptr_ptr + lo, mask=rmask, other=0).to(tl.int64) + tl.where(lo == 0, first_start, 0)
    return req_start + lo, pos


def chunk_row_args(rows, stand_in: Optional[torch.Tensor]) -> tuple:
    """The kernels' five chunk-row arguments (indptr, requests, first request, its first position, search steps) of
    a :class:`mla_bridge.cache.ChunkRows` (``stand_in`` and zeros for None: a launch naming rows token by token)."""
    if rows is None:
        return stand_in, 1, 0, 0, 0
    n_req = rows.kv_indptr.shape[0] - 1
    # the kernels read indptr[j] at indptr_ptr + j: a strided view would name other rows (contiguous: a no-op else)
    return rows.kv_indptr.contiguous(), n_req, rows.req_start, rows.first_start, (n_req - 1).bit_length()


# The chunk-row ints are not specialized by Triton (on being 1 or divisible by 16): a new batch shape compiles nothing.
@triton.jit(do_not_specialize=["n_req", "req_start", "first_start", "steps"])
def _gather_kernel(
    out_ptr,
    out_stride,
    cache_ptr,
    cs_block,
    cs_slot,
    cs_elem,
    table_ptr,
    ts_row,
    ts_col,
    req_ptr,
    pos_ptr,
    ctx_dst_ptr,
    n_ctx,
    ctx_programs,
    indptr_ptr,
    n_req,
    req_start,
    first_start,
    steps,
    kvc_ptr,
    kvc_row,
    kvc_elem,
    kpe_ptr,
    kpe_row,
    kpe_elem,
    new_dst_ptr,
    n_new,
    scale_ptr,
    scale_val,
    kpe_out_ptr,
    ko_row,
    ko_head,
    n_heads,
    BLOCK_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    LAT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_CTX_DST: tl.constexpr,
    DEQUANT: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    OUT_BF16: tl.constexpr,
    HAS_KPE_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BY_INDPTR: tl.constexpr,
):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < LAT
    # with k_pe_out: out holds the kv_c columns only, and the k_pe columns go to every head of k_pe_out
    omask = (d < RANK) if HAS_KPE_OUT else dmask
    r = tl.arange(0, BLOCK_R)
    ko_ty = kpe_out_ptr.dtype.element_ty
    if pid < ctx_programs:
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < n_ctx
        if BY_INDPTR:
            req, pos = chunk_rows(rows, rmask, indptr_ptr, n_req, req_start, first_start, steps)
        else:
            req = tl.load(req_ptr + rows, mask=rmask, other=0).to(tl.int64)
            pos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
        blk = tl.load(table_ptr + req * ts_row + (pos // BLOCK_SIZE) * ts_col, mask=rmask, other=0).to(tl.int64)
        src = cache_ptr + blk[:, None] * cs_block + (pos % BLOCK_SIZE)[:, None] * cs_slot + d[None, :] * cs_elem
        m = rmask[:, None] & dmask[None, :]
        x = tl.load(src, mask=m, other=0)
        s = 1.0
        if DEQUANT:
            if SCALE_IS_PTR:
                s = tl.load(scale_ptr)
            else:
                s = scale_val
            x = dequant_tile(x, s, OUT_BF16)
        x = x.to(out_ptr.dtype.element_ty)
        if HAS_CTX_DST:
            dst = tl.load(ctx_dst_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            dst = rows
        tl.store(out_ptr + dst[:, None] * out_stride + d[None, :], x, mask=rmask[:, None] & omask[None, :])
        if HAS_KPE_OUT:
            pm = rmask[:, None] & (r < LAT - RANK)[None, :]
            row0 = cache_ptr + blk * cs_block + (pos % BLOCK_SIZE) * cs_slot
            pe = tl.load(row0[:, None] + (RANK + r)[None, :] * cs_elem, mask=pm, other=0)
            if DEQUANT:
                pe = dequant_tile(pe, s, OUT_BF16)
            pe = pe.to(ko_ty)
            for h in range(0, n_heads):
                tl.store(kpe_out_ptr + dst[:, None] * ko_row + h * ko_head + r[None, :], pe, mask=pm)
    else:
        rows = (pid - ctx_programs).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < n_new
        dst = tl.load(new_dst_ptr + rows, mask=rmask, other=0).to(tl.int64)
        is_c = d < RANK
        a = tl.load(
            kvc_ptr + rows[:, None] * kvc_row + d[None, :] * kvc_elem, mask=rmask[:, None] & is_c[None, :], other=0
        )
        b = tl.load(
            kpe_ptr + rows[:, None] * kpe_row + (d - RANK)[None, :] * kpe_elem,
            mask=rmask[:, None] & (~is_c & dmask)[None, :],
            other=0,
        )
        x = tl.where(is_c[None, :], a, b).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + dst[:, None] * out_stride + d[None, :], x, mask=rmask[:, None] & omask[None, :])
        if HAS_KPE_OUT:
            pm = rmask[:, None] & (r < LAT - RANK)[None, :]
            pe = tl.load(kpe_ptr + rows[:, None] * kpe_row + r[None, :] * kpe_elem, mask=pm, other=0).to(ko_ty)
            for h in range(0, n_heads):
                tl.store(kpe_out_ptr + dst[:, None] * ko_row + h * ko_head + r[None, :], pe, mask=pm)


def _launch(
    out: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    ctx_dst: Optional[torch.Tensor],
    kv_c: Optional[torch.Tensor],
    k_pe: Optional[torch.Tensor],
    new_dst: Optional[torch.Tensor],
    scale: Union[None, float, torch.Tensor],
    rank: int,
    k_pe_out: Optional[torch.Tensor] = None,
    rows=None,
) -> None:
    if rows is not None and (req_ids is not None or positions is not None):
        raise ValueError("gather: give the context rows as rows= or as req_ids / positions, not both")
    lat = cache.shape[-1]
    dequant = scale is not None
    cache_arg = cache.view(torch.uint8) if dequant else cache  # FP8 bytes, reinterpreted in the kernel
    n_ctx = rows.num_tokens if rows is not None else req_ids.shape[0]  # type: ignore[union-attr]  # no rows: req_ids
    n_new = 0 if new_dst is None else new_dst.shape[0]
    ctx_programs = cdiv(n_ctx, _BLOCK_M)
    grid = (ctx_programs + cdiv(n_new, _BLOCK_M),)
    if grid[0] == 0:
        return
    if rows is not None:  # unused per-token pointers: any integer tensor
        req_ids = positions = rows.kv_indptr
    if kv_c is None:  # unused pointers of the gather-only launch: any tensor of the right kind
        kv_c = k_pe = out
        new_dst = req_ids
    scale_is_ptr = isinstance(scale, torch.Tensor)
    ko = k_pe_out if k_pe_out is not None else out.view(out.shape[0], 1, out.shape[-1])  # unused stand-in
    launch(
        _gather_kernel,
        grid,
        (
            out,
            out.stride(0),
            cache_arg,
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            block_table,
            block_table.stride(0),
            block_table.stride(1),
            req_ids,
            positions,
            ctx_dst if ctx_dst is not None else req_ids,
            n_ctx,
            ctx_programs,
            *chunk_row_args(rows, req_ids),
            # k_pe comes with kv_c (set above when absent); scale is a float where not scale_is_ptr
            kv_c,
            kv_c.stride(0),
            kv_c.stride(-1),
            k_pe,
            k_pe.stride(0),  # type: ignore[union-attr]
            k_pe.stride(-1),  # type: ignore[union-attr]
            new_dst,
            n_new,
            scale if scale_is_ptr else out,
            float(scale) if (dequant and not scale_is_ptr) else 1.0,  # type: ignore[arg-type]
            ko,
            ko.stride(0),
            ko.stride(1),
            ko.shape[1],
        ),
        dict(
            BLOCK_SIZE=cache.shape[1],
            RANK=rank,
            LAT=lat,
            BLOCK_D=next_power_of_2(lat),
            BLOCK_M=_BLOCK_M,
            HAS_CTX_DST=ctx_dst is not None,
            DEQUANT=dequant,
            SCALE_IS_PTR=scale_is_ptr,
            OUT_BF16=out.dtype == torch.bfloat16,
            HAS_KPE_OUT=k_pe_out is not None,
            BLOCK_R=next_power_of_2(max(lat - rank, 1)),
            BY_INDPTR=rows is not None,
        ),
        _OPTIONS,
    )


def gather_latent_triton(
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    kv_cache_scale=None,
    k_pe_out: Optional[torch.Tensor] = None,
    rank: Optional[int] = None,
    *,
    rows=None,
) -> None:
    """``out[i] = dequant(kv_cache[block_table[req_ids[i], positions[i] // bs], positions[i] % bs])``; with ``rows``
    (a :class:`mla_bridge.cache.ChunkRows`, ``req_ids`` / ``positions`` None) the pairs are the chunk's rows.

    ``out`` ``[N, L]`` rows (unit last stride) in the output dtype; ``kv_cache`` ``[num_blocks, bs, L]`` (any
    strides) in ``out``'s dtype, or float8_e4m3fn with ``kv_cache_scale`` (a float or a 0-d float32 device tensor).
    With ``k_pe_out`` ``[N, H, L - rank]`` (unit last stride): ``out`` ``[N, rank]`` gets the first ``rank`` columns
    and every head of ``k_pe_out`` the rest."""
    _launch(
        out,
        kv_cache,
        block_table,
        req_ids,
        positions,
        None,
        None,
        None,
        None,
        kv_cache_scale,
        kv_cache.shape[-1] if rank is None else rank,
        k_pe_out,
        rows,
    )


def fused_latent_triton(
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    ctx_dst: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    new_dst: torch.Tensor,
    kv_cache_scale=None,
    k_pe_out: Optional[torch.Tensor] = None,
) -> None:
    """The fused schedule's key latents in one launch: context rows (as :func:`gather_latent_triton`) to rows
    ``ctx_dst``, ``kv_c[j] ++ k_pe[j]`` (``[T, rank]``, ``[T, rope]``) to rows ``new_dst[j]``; with ``k_pe_out``
    as :func:`gather_latent_triton`."""
    _launch(
        out,
        kv_cache,
        block_table,
        req_ids,
        positions,
        ctx_dst,
        kv_c,
        k_pe,
        new_dst,
        kv_cache_scale,
        kv_c.shape[-1],
        k_pe_out,
    )
