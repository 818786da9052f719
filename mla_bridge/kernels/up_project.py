"""Triton kernel: the keys and values of one attention pass straight from latent rows, in ONE launch.

What the separate path does in two or three launches (the gather of :mod:`mla_bridge.kernels.gather` or
:mod:`mla_bridge.cache`, then the GEMM of :meth:`mla_bridge.PreparedKVBProj.up_project`), this kernel does in one:
a GEMM whose A rows are read where they lie, and whose epilogue writes the layout the attention kernel reads.

* **A rows (gathered A).** Context row ``i`` (request ``req_ids[i]``, position ``positions[i]``, or found in a chunk's
  key indptr: :class:`mla_bridge.cache.ChunkRows`, :func:`mla_bridge.kernels.gather.chunk_rows`) is read through
  ``block_table`` from the paged cache (its strides; an FP8 cache dequantized as ``round_to_dtype(float32(stored) *
  kv_cache_scale)``, bitwise the gather's rounding) and lands in output row ``ctx_dst[i]`` (or ``i``); new-token row
  ``j`` is ``kv_c[j] ++ k_pe[j]`` and lands in row ``new_dst[j]`` (or ``j``). Nothing is staged in memory.
* **GEMM.** Per head ``h``: ``k_nope = kv_c_rows @ W_nope[h].T`` and ``v = kv_c_rows @ W_v[h].T`` (``kv_lora_rank``
  products accumulated in float32, rounded once to the output dtype). The weight is read from a
  :class:`mla_bridge.PreparedKVBProj` of any layout, the raw checkpoint weight too (only the rows and the first
  ``kv_lora_rank`` columns: the identity layout's zero padding and identity block are skipped), so no extra FLOPs and
  no copy of a raw weight.
* **Epilogue.** Output ``[N, H, qk_nope + qk_rope + v_head_dim]`` per head ``[k_nope | k_pe | v]``: ``k = out[...,
  :192]`` and ``v = out[..., 192:]`` are the strided views the attention kernels read (as the identity layout's GEMM
  output). The k_pe columns are the row's own k_pe, copied exactly into every head (the "k_pe broadcast").

Results: k_pe bitwise equal to the separate path; k_nope and v equal within the output dtype's rounding of a float32
sum taken in another order (cuBLAS and this kernel both accumulate in float32; the identity layout also adds 64 exact
zeros). Program ``p`` computes rows tile ``p // (2H)`` and, for ``r = p % (2H)``, head ``r // 2``'s k part (``r``
even, with the k_pe copy) or v part (``r`` odd): the ``2H`` programs that read one A tile run next to each other, so
it is read from HBM once and from L2 after. Two alternatives were measured on the H200 and dropped
(docs/results.md): one program per head with two accumulators (slower), and one program per head with one 256-wide
tile of v and k_nope (no faster, and it failed the FP8-cache equality test on 5% of elements, with 3 stages: see
below).

**The FP8 path runs a software pipeline of at most** :data:`DEQUANT_MAX_STAGES` **(2) stages.** With an FP8 cache the
A tile is loaded as bytes, dequantized in registers and fed to Hopper's asynchronous ``wgmma`` from registers (the
bf16 path feeds it from shared memory). Compiled by Triton 3.6 with 3 stages (:data:`CONFIG`'s), this loop gave wrong
k_nope / v on the H200. With the dequantization rounded on the bits, about 1 launch in 200 was wrong (16
of 3000 on one fixed input), each time in the 128 columns of 8 consecutive rows of one program's tile (the rows one
warp's A-fragment register pair feeds), off by up to 30%, with every output written. With the native rounding (used
here: 25-30% faster), every launch was wrong. With 2 stages or 1: no wrong launch in 3000 to 20000 per case. The
3-stage IR keeps 2 shared-memory buffers of the byte tile with up to 3 ``wgmma`` groups in flight; the 2-stage IR waits
for every copy at the start of each iteration. The fault is in the compiled pipeline, not in this kernel's indexing or
arithmetic (the same source with 2 stages is exact); the compiler step is not identified (the pipeliner's
buffer-lifetime bugs of triton-lang/triton#8139 and #10977 are of that kind). 2 stages cost 0-7% on this path against
3. ``tests/gpu/test_gpu_up_project.py`` launches it 1000 times against the first result (with the cap lifted it
caught 8 and 6 of 1000); ``scripts/gpu/fp8_fused_stress.py`` compares many runs with float64. The 256-wide variant
above probably failed for the same reason.

Imported only by :mod:`mla_bridge.kv`, on first use: Triton is not needed on the CPU.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from . import cdiv, next_power_of_2
from .launch import launch

from .gather import dequant_tile, chunk_row_args, chunk_rows

__all__ = ["up_project_triton", "CONFIG", "DEQUANT_MAX_STAGES"]

#: Tile sizes and launch shape: rows per tile, k (and v) columns per program, K step, warps, pipeline stages.
CONFIG = dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=3)
#: Pipeline stages of the FP8 (dequantizing) specialization at most: 3 gave wrong results with Triton 3.6 on the
#: H200 (module docstring). A caller's explicit ``num_stages`` is capped too.
DEQUANT_MAX_STAGES = 2


@triton.jit
def _gemm(
    a_rows,
    a_elem,
    rmask,
    w_ptr,
    w_first,
    w_row,
    n,
    nmask,
    s,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEQUANT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_N]`` float32: rows ``a_rows`` (pointers to element 0 of each row, stride ``a_elem``) times
    weight rows ``w_first + n`` (row stride ``w_row``), over the first ``RANK`` columns. FP8 rows (``DEQUANT``) are
    dequantized as ``float32(stored) * s`` rounded to the weight's dtype by the native conversion (round to nearest
    even: the gather's bits for every finite value, and 25-30% faster in this loop than the gather's bit arithmetic,
    which exists for the interpreter and for NaN's bit pattern, neither of which a GEMM operand needs)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    w_rows = (w_first + n).to(tl.int64) * w_row
    for k0 in range(0, RANK, BLOCK_K):
        k = k0 + kk
        kmask = k < RANK
        a = tl.load(a_rows[:, None] + k[None, :] * a_elem, mask=rmask[:, None] & kmask[None, :], other=0)
        if DEQUANT:
            a = a.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        a = a.to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + w_rows[None, :] + k[:, None], mask=nmask[None, :] & kmask[:, None], other=0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit(do_not_specialize=["n_req", "req_start", "first_start", "steps"])  # as the gather's
def _up_project_kernel(
    out_ptr,
    o_row,
    o_head,
    w_ptr,
    w_row,
    w_head,
    w_nope,
    w_v,
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
    ctx_tiles,
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
    H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    VD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_CTX_DST: tl.constexpr,
    HAS_NEW_DST: tl.constexpr,
    DEQUANT: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    OUT_BF16: tl.constexpr,
    IEEE: tl.constexpr,
    BY_INDPTR: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid // (2 * H)
    part = pid % (2 * H)
    h = part // 2
    is_v = (part % 2) == 1
    is_k = (part % 2) == 0
    n = tl.arange(0, BLOCK_N)
    nmask = n < tl.where(is_v, VD, NOPE)
    w_first = h * w_head + tl.where(is_v, w_v, w_nope)
    col0 = tl.where(is_v, NOPE + ROPE, 0)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < ROPE
    ty = out_ptr.dtype.element_ty
    s = 1.0
    if DEQUANT:
        if SCALE_IS_PTR:
            s = tl.load(scale_ptr)
        else:
            s = scale_val
    if tile < ctx_tiles:
        rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < n_ctx
        if BY_INDPTR:
            req, pos = chunk_rows(rows, rmask, indptr_ptr, n_req, req_start, first_start, steps)
        else:
            req = tl.load(req_ptr + rows, mask=rmask, other=0).to(tl.int64)
            pos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
        blk = tl.load(table_ptr + req * ts_row + (pos // BLOCK_SIZE) * ts_col, mask=rmask, other=0).to(tl.int64)
        src = cache_ptr + blk * cs_block + (pos % BLOCK_SIZE) * cs_slot
        acc = _gemm(
            src, cs_elem, rmask, w_ptr, w_first, w_row, n, nmask, s, RANK, BLOCK_M, BLOCK_N, BLOCK_K, DEQUANT, IEEE
        )
        if HAS_CTX_DST:
            dst = tl.load(ctx_dst_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            dst = rows
        if is_k:
            m = rmask[:, None] & r_mask[None, :]
            pe = tl.load(src[:, None] + (RANK + r)[None, :] * cs_elem, mask=m, other=0)
            if DEQUANT:
                pe = dequant_tile(pe, s, OUT_BF16)
            tl.store(out_ptr + dst[:, None] * o_row + h * o_head + NOPE + r[None, :], pe.to(ty), mask=m)
    else:
        rows = (tile - ctx_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < n_new
        acc = _gemm(
            kvc_ptr + rows * kvc_row,
            kvc_elem,
            rmask,
            w_ptr,
            w_first,
            w_row,
            n,
            nmask,
            s,
            RANK,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            False,
            IEEE,
        )
        if HAS_NEW_DST:
            dst = tl.load(new_dst_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            dst = rows
        if is_k:
            m = rmask[:, None] & r_mask[None, :]
            pe = tl.load(kpe_ptr + rows[:, None] * kpe_row + r[None, :] * kpe_elem, mask=m, other=0)
            tl.store(out_ptr + dst[:, None] * o_row + h * o_head + NOPE + r[None, :], pe.to(ty), mask=m)
    tl.store(
        out_ptr + dst[:, None] * o_row + h * o_head + col0 + n[None, :],
        acc.to(ty),
        mask=rmask[:, None] & nmask[None, :],
    )


def up_project_triton(
    out: torch.Tensor,
    weight,
    *,
    kv_cache: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    req_ids: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    ctx_dst: Optional[torch.Tensor] = None,
    kv_c: Optional[torch.Tensor] = None,
    k_pe: Optional[torch.Tensor] = None,
    new_dst: Optional[torch.Tensor] = None,
    kv_cache_scale: Union[None, float, torch.Tensor] = None,
    rows=None,
    **config,
) -> None:
    """Fill ``out [N, H, qk_nope + qk_rope + v_head_dim]`` (contiguous, the plan's dtype) with ``[k_nope | k_pe | v]``
    per head for the context rows (``kv_cache`` through ``block_table`` at ``(req_ids[i], positions[i])``, or at the
    rows of ``rows``, a :class:`mla_bridge.cache.ChunkRows`, to rows ``ctx_dst`` or ``0..n_ctx-1``) and the new rows (``kv_c`` ``[n, rank]``, ``k_pe`` ``[n, rope]``, to rows
    ``new_dst`` or ``0..n-1``); either part may be absent. ``weight``: a :class:`mla_bridge.PreparedKVBProj` of any
    layout, the checkpoint one included (the raw weight read in place).
    ``config`` overrides :data:`CONFIG` (the benchmark's tile sweep).

    Raises:
        ValueError: context rows given both as ``rows`` and as ``req_ids`` / ``positions``, or without ``kv_cache``
            and ``block_table``.
    """
    d = weight.dims
    h, rank, nope, rope, vd = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
    cfg = dict(CONFIG, **config)
    dequant = kv_cache_scale is not None
    if dequant:
        cfg["num_stages"] = min(cfg["num_stages"], DEQUANT_MAX_STAGES)
    bm, bk = cfg.pop("BLOCK_M"), min(cfg.pop("BLOCK_K"), max(16, next_power_of_2(rank)))
    w, w_row, w_head, w_nope, w_v = weight.kernel_rows()  # each head's k_nope and v rows, in any layout
    if rows is not None and (req_ids is not None or positions is not None):
        raise ValueError("up_project_triton: give the context rows as rows= or as req_ids / positions, not both")
    if (rows is not None or req_ids is not None) and (kv_cache is None or block_table is None):
        raise ValueError("up_project_triton: context rows need kv_cache and block_table")
    n_ctx = rows.num_tokens if rows is not None else (0 if req_ids is None else req_ids.shape[0])
    n_new = 0 if kv_c is None else kv_c.shape[0]
    ctx_tiles = cdiv(n_ctx, bm)
    grid = ((ctx_tiles + cdiv(n_new, bm)) * 2 * h,)
    if grid[0] == 0:
        return
    if kv_cache is None:  # unused pointers of an absent part: any tensor of the right kind
        kv_cache, block_table, req_ids, positions = out.view(-1, 1, out.shape[-1]), out, out, out
    elif rows is not None:
        req_ids = positions = rows.kv_indptr
    if kv_c is None:
        kv_c = k_pe = out[:, 0]
    cache = kv_cache.view(torch.uint8) if dequant else kv_cache
    scale_is_ptr = isinstance(kv_cache_scale, torch.Tensor)
    launch(
        _up_project_kernel,
        grid,
        (
            out,
            out.stride(0),
            out.stride(1),
            w,
            w_row,
            w_head,
            w_nope,
            w_v,
            cache,
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            # block_table comes with kv_cache and k_pe with kv_c (both set above when absent); kv_cache_scale is a float
            # where not scale_is_ptr
            block_table,
            block_table.stride(0),  # type: ignore[union-attr]
            block_table.stride(-1),  # type: ignore[union-attr]
            req_ids,
            positions,
            ctx_dst if ctx_dst is not None else req_ids,
            n_ctx,
            ctx_tiles,
            *chunk_row_args(rows, req_ids),
            kv_c,
            kv_c.stride(0),
            kv_c.stride(-1),
            k_pe,
            k_pe.stride(0),  # type: ignore[union-attr]
            k_pe.stride(-1),  # type: ignore[union-attr]
            new_dst if new_dst is not None else kv_c,
            n_new,
            kv_cache_scale if scale_is_ptr else out,
            float(kv_cache_scale) if (dequant and not scale_is_ptr) else 1.0,  # type: ignore[arg-type]
        ),
        dict(
            H=h,
            BLOCK_SIZE=kv_cache.shape[1],
            RANK=rank,
            NOPE=nope,
            ROPE=rope,
            VD=vd,
            BLOCK_M=bm,
            BLOCK_N=max(16, next_power_of_2(max(nope, vd))),
            BLOCK_K=bk,
            BLOCK_R=max(16, next_power_of_2(rope)),
            HAS_CTX_DST=ctx_dst is not None,
            HAS_NEW_DST=new_dst is not None,
            DEQUANT=dequant,
            SCALE_IS_PTR=scale_is_ptr,
            OUT_BF16=out.dtype == torch.bfloat16,
            IEEE=out.dtype == torch.float32,
            BY_INDPTR=rows is not None,
        ),
        cfg,
    )  # cfg: the compile options left (num_warps, num_stages)
