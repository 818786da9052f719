"""Triton kernel: DeepSeek Sparse Attention in the absorbed (MQA) form, the selected latent rows gathered in the kernel.

For each new token ``t`` and head ``h`` (:mod:`mla_bridge.sparse` states the contract)::

    score[i] = (q_lat[t, h] . c[sel_i] + q_pe[t, h] . k_pe[sel_i]) * sm_scale      (float32 accumulation)
    o_lat[t, h] = softmax(score) @ c[sel]          lse[t, h] = log(sum_i exp(score[i]))   (natural log)

over the picks ``sel`` of row ``t`` of ``topk_indices`` (positions in the token's request sequence; -1: no key). A
pick below the request's ``context_lens[r]`` is read from the paged cache through ``block_table``, a later one from
the new tokens' ``kv_c`` / ``k_pe``. No selected row is ever written to memory: each program loads its tiles of
selected rows straight from the cache or ``kv_c`` / ``k_pe``, one load per tile: where both have the rows' dtype the
rows are addressed from the cache's pointer; otherwise (an FP8 cache) each row's picks are partitioned first
(:func:`mla_bridge.kernels.sparse_picks.partition_picks`: context picks, then new ones) and the kernel's ``SPLIT``
loops read context tiles from the cache and new tiles from ``kv_c`` / ``k_pe``.

FP8 caches (e4m3, one scalar ``kv_cache_scale``): the stored values are converted to the compute dtype in the kernel
(exact: every e4m3 value is a bf16/fp16 value) and the scale, being one number, is applied to what they produce: a
context row's score is multiplied by it, and so is its probability before ``P @ c``. This is the attention over
``stored * scale`` without rounding that product (the torch path rounds it to the plan's dtype, as the dense gather
does), at the cost of one conversion per loaded value.

The design follows FlashMLA's sparse prefill: one program per (token, block of ``BLOCK_H`` heads). Every head of a
token reads the same selected rows, so the program loads a tile of ``BLOCK_K`` selected rows (``kv_lora_rank +
qk_rope_head_dim`` values each) once and multiplies it with the ``[BLOCK_H, kv_lora_rank]`` latent queries (heads as
the M dimension of the tensor-core tile), then the probabilities with the same tile for ``o_lat``: an online softmax
in float32 (scores in base 2 with ``sm_scale * log2(e)`` folded in), the output accumulator ``[BLOCK_H,
kv_lora_rank]`` float32 held by the program. The programs of one token are adjacent in the grid, so a token's rows
are read from memory once and from L2 by its other head blocks. The probabilities enter the second product in the
dtype of the rows (bf16/fp16, as in FlashAttention), float32 with ``ieee`` dots for a float32 compute dtype.

Before the main loop a program scans its row of indices for the last pick (``kmax``): the loop runs over the
``ceil(kmax / BLOCK_K)`` first tiles only, so a row whose -1 padding comes last (an indexer's top-k for an early
query) costs what its picks cost. A pick past its request's sequence is skipped (never read): on CUDA the indices
are not checked on the host (:mod:`mla_bridge.sparse`), and this keeps a bad index from reading outside the
request's rows; a non-causal pick inside the sequence is attended, as the contract leaves it to the caller.

Dims: ``kv_lora_rank`` and ``qk_rope_head_dim`` are padded to powers of two (masked; at least 16, the tensor-core
minimum), ``qk_rope_head_dim`` may be 0; :func:`mla_bridge.sparse.select_sparse` sends shapes the kernel does not take
(a ``kv_lora_rank`` above :data:`mla_bridge.sparse.SPARSE_KERNEL_MAX_RANK`: the float32 accumulator would not fit a
program's registers) to the torch path, with the reason. Offsets are int64. Imported only by :mod:`mla_bridge.sparse`,
on first use: Triton is not needed on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl

from . import cdiv, next_power_of_2, triton_interpreting
from .sparse_picks import partition_picks
from .launch import launch

__all__ = ["SparseConfig", "default_config", "sparse_attention_triton"]

_LOG2E = 1.4426950408889634
#: indices read per step of the scan for a row's last pick
_SCAN = 256


class SparseConfig(NamedTuple):
    """The tile sizes and compile options of a launch (:func:`default_config`)."""

    block_h: int  #: heads per program (the M dimension of the tiles; at least 16)
    block_k: int  #: selected rows per tile (the N / K dimension; at least 16)
    num_warps: int
    num_stages: int


def default_config(num_heads: int, kv_lora_rank: int, topk: int, dtype: torch.dtype) -> SparseConfig:
    """Tiles for ``num_heads`` heads, ``kv_lora_rank``, ``topk`` picks per row, compute dtype ``dtype``: up to 64 heads
    per program (FlashMLA's sparse prefill takes 64 too), 8 warps for the ``[64, 512]`` float32 accumulator, tiles of
    64 selected rows (each tile is read in one load, so 64 rows of 576 values fit an SM90 block's shared memory in two
    stages, FP8 caches included). float32 (ieee dots, the interpreter and tests): 16 heads and 16 rows.
    scripts/gpu/sparse_tune.py times the candidates."""
    rank = max(16, next_power_of_2(kv_lora_rank))
    block_k_cap = max(16, next_power_of_2(topk))
    if dtype == torch.float32:
        return SparseConfig(16, min(16, block_k_cap), 4, 1)
    block_h = min(64, max(16, next_power_of_2(num_heads)))
    warps = 8 if block_h * rank >= 64 * 512 else 4
    return SparseConfig(block_h, min(64, block_k_cap), warps, 2)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter (Triton 3.9) multiplies bf16 tiles wrongly: the same exact products in float32
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        r = tl.dot(a, b, acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def _attend_tile(
    ql,
    qp,
    c,
    pe,
    valid,
    col,
    m_i,
    l_i,
    acc,
    qk_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROPE: tl.constexpr,
    DEQUANT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One tile of selected rows (``c [BLOCK_K, BLOCK_R]``, ``pe [BLOCK_K, BLOCK_P]`` in the compute dtype) into the
    online softmax of the program's heads: scores in base 2, ``col`` the per-row factor of an FP8 cache's scale
    (context rows) or 1, ``valid`` the rows that count."""
    sc = _dot(ql, tl.trans(c), tl.zeros([BLOCK_H, BLOCK_K], tl.float32), IEEE, UPCAST)
    if ROPE > 0:
        sc = _dot(qp, tl.trans(pe), sc, IEEE, UPCAST)
    if DEQUANT:  # a context row's values are scale * stored: the scale multiplies its score and probability
        sc = tl.where(valid[None, :], sc * (col * qk_scale)[None, :], float("-inf"))
    else:
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2(-inf) = 0, never NaN
    alpha = tl.exp2(m_i - m_use)
    pr = tl.exp2(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    if DEQUANT:
        acc = _dot((pr * col[None, :]).to(c.dtype), c, acc * alpha[:, None], IEEE, UPCAST)
    else:
        acc = _dot(pr.to(c.dtype), c, acc * alpha[:, None], IEEE, UPCAST)
    return m_new, l_i, acc


# topk, the heads and the scale are not specialized on (1 / divisible by 16): a new batch compiles nothing.
@triton.jit(do_not_specialize=["n_heads", "topk", "qk_scale", "scale_val", "kvc_delta16", "kpe_delta16"])
def _sparse_kernel(
    o_ptr,
    o_st,
    o_sh,
    lse_ptr,
    lse_st,
    lse_sh,
    ql_ptr,
    ql_st,
    ql_sh,
    qp_ptr,
    qp_st,
    qp_sh,
    qp_elem,
    idx_ptr,
    idx_st,
    idx_elem,
    nctx_ptr,
    meta_ptr,
    cache_ptr,
    cs_block,
    cs_slot,
    cs_elem,
    table_ptr,
    ts_row,
    ts_col,
    kvc_ptr,
    kvc_row,
    kvc_elem,
    kpe_ptr,
    kpe_row,
    kpe_elem,
    kvc_delta16,
    kpe_delta16,
    scale_ptr,
    scale_val,
    n_heads,
    topk,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCAN: tl.constexpr,
    DEQUANT: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    HAS_LSE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    n_hb = tl.cdiv(n_heads, BLOCK_H)
    pid = tl.program_id(0)
    t = (pid // n_hb).to(tl.int64)
    heads = (pid % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    heads = heads.to(tl.int64)
    dr = tl.arange(0, BLOCK_R)
    rmask = dr < RANK
    dp = tl.arange(0, BLOCK_P)
    pmask = dp < ROPE
    dt = ql_ptr.dtype.element_ty

    # the token's request, context length, sequence length and the kv_c row of its request's position 0
    req = tl.load(meta_ptr + t * 4).to(tl.int64)
    ctx_len = tl.load(meta_ptr + t * 4 + 1)
    seq_len = tl.load(meta_ptr + t * 4 + 2)
    new_base = tl.load(meta_ptr + t * 4 + 3).to(tl.int64)
    idx_row = idx_ptr + t * idx_st
    table_row = table_ptr + req * ts_row

    # the last pick of the row: the loop below stops after its tile
    kmax = tl.program_id(0) * 0
    for s0 in range(0, topk, SCAN):
        ks = s0 + tl.arange(0, SCAN)
        ix = tl.load(idx_row + ks * idx_elem, mask=ks < topk, other=-1)
        kmax = tl.maximum(kmax, tl.max(tl.where(ix >= 0, ks + 1, 0), 0))

    ql = tl.load(
        ql_ptr + t * ql_st + heads[:, None] * ql_sh + dr[None, :], mask=hmask[:, None] & rmask[None, :], other=0
    )
    qp = ql  # no RoPE part: unused
    if ROPE > 0:
        qp = tl.load(
            qp_ptr + t * qp_st + heads[:, None] * qp_sh + dp[None, :] * qp_elem,
            mask=hmask[:, None] & pmask[None, :],
            other=0,
        ).to(dt)
    s = 1.0
    if DEQUANT:
        if SCALE_IS_PTR:
            s = tl.load(scale_ptr)
        else:
            s = scale_val

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    if SPLIT:
        # the picks come partitioned (sparse_attention_triton): the row's n_ctx context picks first, then its new
        # tokens' picks, then -1. Each loop's tiles come from one source in one load (FP8 bytes from the cache, the
        # new rows from kv_c / k_pe), with no select between two loads of every tile
        n_ctx = tl.load(nctx_ptr + t)
        for k0 in range(0, n_ctx, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ix = tl.load(idx_row + ks * idx_elem, mask=ks < n_ctx, other=-1)
            valid = (ix >= 0) & (ix < ctx_len)
            p = ix.to(tl.int64)
            blk = tl.load(table_row + (p // BLOCK_SIZE) * ts_col, mask=valid, other=0).to(tl.int64)
            crow = cache_ptr + blk * cs_block + (p % BLOCK_SIZE) * cs_slot
            c = tl.load(crow[:, None] + dr[None, :] * cs_elem, mask=valid[:, None] & rmask[None, :], other=0)
            if DEQUANT:
                c = c.to(tl.float8e4nv, bitcast=True)  # exact in bf16/fp16/float32: scaled in _attend_tile
            c = c.to(dt)
            pe = c
            if ROPE > 0:
                pe = tl.load(
                    crow[:, None] + (RANK + dp)[None, :] * cs_elem, mask=valid[:, None] & pmask[None, :], other=0
                )
                if DEQUANT:
                    pe = pe.to(tl.float8e4nv, bitcast=True)
                pe = pe.to(dt)
            col = tl.full([BLOCK_K], 1.0, tl.float32) * s
            m_i, l_i, acc = _attend_tile(
                ql, qp, c, pe, valid, col, m_i, l_i, acc, qk_scale, BLOCK_H, BLOCK_K, ROPE, DEQUANT, IEEE, UPCAST
            )
        for k0 in range(n_ctx, kmax, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ix = tl.load(idx_row + ks * idx_elem, mask=ks < kmax, other=-1)
            valid = (ix >= ctx_len) & (ix < seq_len)
            nrow = new_base + ix.to(tl.int64)
            c = tl.load(
                kvc_ptr + nrow[:, None] * kvc_row + dr[None, :] * kvc_elem,
                mask=valid[:, None] & rmask[None, :],
                other=0,
            ).to(dt)
            pe = c
            if ROPE > 0:
                pe = tl.load(
                    kpe_ptr + nrow[:, None] * kpe_row + dp[None, :] * kpe_elem,
                    mask=valid[:, None] & pmask[None, :],
                    other=0,
                ).to(dt)
            col = tl.full([BLOCK_K], 1.0, tl.float32)
            m_i, l_i, acc = _attend_tile(
                ql, qp, c, pe, valid, col, m_i, l_i, acc, qk_scale, BLOCK_H, BLOCK_K, ROPE, DEQUANT, IEEE, UPCAST
            )
    else:
        for k0 in range(0, kmax, BLOCK_K):
            # the tile's picks and block ids: Triton's pipeliner prefetches this chain (index -> block id -> row) itself
            # (a hand-written prefetch carried across iterations cost registers: more spills, compiled for sm_90a)
            ks = k0 + tl.arange(0, BLOCK_K)
            ix = tl.load(idx_row + ks * idx_elem, mask=ks < topk, other=-1)
            blk = tl.load(
                table_row + (ix.to(tl.int64) // BLOCK_SIZE) * ts_col, mask=(ix >= 0) & (ix < ctx_len), other=0
            ).to(tl.int64)
            valid = (ix >= 0) & (ix < seq_len)
            in_ctx = valid & (ix < ctx_len)
            p = ix.to(tl.int64)
            nrow = new_base + p
            # one load per tile, every row addressed from the cache's pointer: a new token's row lies kvc_delta
            # elements away (same dtype). Blended by arithmetic, not tl.where: Triton keeps the offsets' divisibility
            # through a product, not through a select, and without it the tile is not pipelined (no cp.async)
            # (the deltas are 32-bit arguments where they fit: 64-bit before the product, which a buffer more than
            # 2**31 elements from the cache overflows)
            w = in_ctx.to(tl.int64)
            ctx_off = blk * cs_block + (p % BLOCK_SIZE) * cs_slot
            row_off = ctx_off * w + (kvc_delta16.to(tl.int64) * 16 + nrow * kvc_row) * (1 - w)
            c = tl.load(cache_ptr + row_off[:, None] + dr[None, :], mask=valid[:, None] & rmask[None, :], other=0).to(
                dt
            )
            pe = c
            if ROPE > 0:
                pe_off = (ctx_off + RANK) * w + (kpe_delta16.to(tl.int64) * 16 + nrow * kpe_row) * (1 - w)
                pe = tl.load(
                    cache_ptr + pe_off[:, None] + dp[None, :], mask=valid[:, None] & pmask[None, :], other=0
                ).to(dt)
            col = tl.full([BLOCK_K], 1.0, tl.float32)  # no FP8 cache here: no scale
            m_i, l_i, acc = _attend_tile(
                ql, qp, c, pe, valid, col, m_i, l_i, acc, qk_scale, BLOCK_H, BLOCK_K, ROPE, DEQUANT, IEEE, UPCAST
            )

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + t * o_st + heads[:, None] * o_sh + dr[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=hmask[:, None] & rmask[None, :],
    )
    if HAS_LSE:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + t * lse_st + heads * lse_sh, lse, mask=hmask)


def sparse_attention_triton(
    o_lat: torch.Tensor,
    lse: Optional[torch.Tensor],
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    topk_indices: torch.Tensor,
    token_meta: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache_scale: Union[None, float, torch.Tensor],
    sm_scale: float,
    config: Optional[SparseConfig] = None,
) -> None:
    """One launch of the sparse attention over ``n`` tokens (module docstring).

    Args:
        o_lat: ``[n, H, kv_lora_rank]`` out (any strides of the first two dims, unit last stride), written in its
            dtype.
        lse: ``[n, H]`` float32 out (natural log; -inf for a row without keys), or None (not computed).
        q_lat: ``[n, H, kv_lora_rank]`` latent queries (``W_UK^T q_nope``), unit last stride; their dtype is the
            compute dtype of the dots (fp16/bf16, or float32 with ieee dots).
        q_pe: ``[n, H, qk_rope_head_dim]`` rope queries (any strides; a view of q).
        topk_indices: int32 ``[n, K]`` positions in each token's request sequence, -1 for none (any strides).
        token_meta: int32 ``[n, 4]`` contiguous: per token its request, context length, sequence length (context +
            new) and the row of ``kv_c`` / ``k_pe`` holding its request's sequence position 0 (the first new token's
            row minus the context length).
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (any strides) in any float dtype, or
            float8_e4m3fn with ``kv_cache_scale`` (a float or a 0-d float32 tensor on the cache's device).
        block_table: ``[batch, max_blocks]`` integer block ids (any strides).
        kv_c, k_pe: ``[T, kv_lora_rank]``, ``[T, qk_rope_head_dim]`` the new tokens' latents (any strides).
        sm_scale: the softmax scale.
        config: tiles and options (None: :func:`default_config`).
    """
    n, h, rank = q_lat.shape
    if n == 0 or h == 0:
        return
    rope = q_pe.shape[-1]
    topk = topk_indices.shape[1]
    dequant = kv_cache_scale is not None
    cache_arg = kv_cache.view(torch.uint8) if dequant else kv_cache
    scale_is_ptr = isinstance(kv_cache_scale, torch.Tensor)
    lse_arg = lse if lse is not None else o_lat  # unused stand-in
    # context and new rows in one load per tile, addressed from the cache's pointer (the kernel without SPLIT): same
    # dtype (no FP8 bytes), unit last strides, kv_c / k_pe a multiple of 16 elements away from the cache
    elem = kv_cache.element_size()
    kvc_delta = (kv_c.data_ptr() - kv_cache.data_ptr()) // elem
    kpe_delta = (k_pe.data_ptr() - kv_cache.data_ptr()) // elem if rope else 0
    one_load = (
        not dequant
        and kv_cache.dtype == kv_c.dtype
        and kv_cache.stride(2) == 1
        and kv_c.stride(-1) == 1
        and (kv_c.data_ptr() - kv_cache.data_ptr()) % (16 * elem) == 0
        and (not rope or (k_pe.dtype == kv_c.dtype and k_pe.stride(-1) == 1))
        and (not rope or (k_pe.data_ptr() - kv_cache.data_ptr()) % (16 * elem) == 0)
    )
    # otherwise each row's picks are partitioned first (context, then new tokens, then none; the kernel's SPLIT), so
    # that every tile is read from one source in one load: FP8 bytes from the cache, or the new rows from kv_c / k_pe
    split = not one_load
    n_ctx = token_meta
    if split:
        topk_indices, n_ctx = partition_picks(topk_indices, token_meta)
    cfg = config or default_config(h, rank, topk, q_lat.dtype)
    grid = (n * cdiv(h, cfg.block_h),)
    launch(
        _sparse_kernel,
        grid,
        (
            o_lat,
            o_lat.stride(0),
            o_lat.stride(1),
            lse_arg,
            lse.stride(0) if lse is not None else 0,
            lse.stride(1) if lse is not None else 0,
            q_lat,
            q_lat.stride(0),
            q_lat.stride(1),
            q_pe if rope else q_lat,
            q_pe.stride(0) if rope else 0,
            q_pe.stride(1) if rope else 0,
            q_pe.stride(2) if rope else 0,
            topk_indices,
            topk_indices.stride(0),
            topk_indices.stride(1),
            n_ctx,
            token_meta,
            cache_arg,
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            block_table,
            block_table.stride(0),
            block_table.stride(1),
            kv_c,
            kv_c.stride(0),
            kv_c.stride(-1),
            k_pe if rope else kv_c,
            k_pe.stride(0) if rope else 0,
            k_pe.stride(-1) if rope else 0,
            kvc_delta // 16 if one_load else 0,
            kpe_delta // 16 if one_load else 0,
            kv_cache_scale if scale_is_ptr else o_lat,
            float(kv_cache_scale) if (dequant and not scale_is_ptr) else 1.0,  # type: ignore[arg-type]
            h,
            topk,
            float(sm_scale) * _LOG2E,
        ),
        dict(
            BLOCK_SIZE=kv_cache.shape[1],
            RANK=rank,
            ROPE=rope,
            BLOCK_R=max(16, next_power_of_2(rank)),
            BLOCK_P=max(16, next_power_of_2(rope)),
            BLOCK_H=cfg.block_h,
            BLOCK_K=cfg.block_k,
            SCAN=_SCAN,
            DEQUANT=dequant,
            SCALE_IS_PTR=scale_is_ptr,
            HAS_LSE=lse is not None,
            IEEE=q_lat.dtype == torch.float32,
            UPCAST=q_lat.dtype == torch.bfloat16 and triton_interpreting(),
            SPLIT=split,
        ),
        dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )
