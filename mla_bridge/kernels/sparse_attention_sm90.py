"""Gluon kernel for SM90 (Hopper): the sparse attention of :mod:`mla_bridge.kernels.sparse_attention` over the fused
key latents, with the warpgroups' work laid out by hand.

The math is the Triton kernel's (its module docstring states it): per new token and head, the online softmax of
``q_lat . c + q_pe . k_pe`` (scaled, base 2 inside) over the token's picks, ``o_lat = softmax @ c`` and the natural-log
LSE. This kernel serves the route where every pick is a row of one contiguous buffer (the fused key latents,
:func:`mla_bridge.cache.fused_latent`: row ``new_base + pick``, valid for ``0 <= pick < seq_len``), bf16 or fp16.

Why a second kernel: Triton's ``tl.dot`` lays the first product of a chained pair (the scores, which feed ``P @ c``)
out along M only, so with 8 warps and 64 heads both warpgroups compute the same ``[64, 64]`` score tile: the score
product, 576 of the 1088 multiply-adds per (head, pick), is done twice. Here the layouts are explicit:

* the scores ``S [64 heads, 64 picks]``: warps ``[4, 2]``, each warpgroup computes its 32 picks for all 64 heads
  (``wgmma`` m64n32k16, ``q_lat`` / ``q_pe`` and the tile from shared memory); the row max and sum cross the two
  warpgroups through shared memory;
* the output ``O [64 heads, kv_lora_rank]``: warps ``[4, 2]``, each warpgroup accumulates half of the latent
  columns (m64n256k16 at 512), ``P`` (bf16/fp16) handed to both as the register operand;
* tiles of 64 picks gathered by ``cp.async`` (16-byte copies, rows addressed from the picks; a row whose pick does
  not count is zero-filled, never read), double-buffered: the next tile's copies are in flight while this one is
  multiplied.

Shared memory: ``(64 + 2 x 64) x (kv_lora_rank + qk_rope_head_dim)`` elements (216 KiB at 576 bf16) plus the
exchange of ``P`` and the row statistics; :func:`mla_bridge.sparse.sm90_kernel_serves` says which shapes it takes.
Imported on first use only (needs Triton 3.6, whose Gluon API it is written against, and an SM90 device).
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from . import cdiv

__all__ = ["sparse_attention_sm90"]

_LOG2E = 1.4426950408889634
BLOCK_H = 64  #: heads per program (one warpgroup's M)
BLOCK_K = 64  #: picks per tile
NUM_WARPS = 8


@gluon.jit
def _issue_tile(
    c_buf,
    pe_buf,
    lat_ptr,
    lat_row,
    idx_row,
    k0,
    kmax,
    seq_len,
    new_base,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    BK: gl.constexpr,
    C_LD: gl.constexpr,
    PE_LD: gl.constexpr,
):
    """Queue the copies of one tile of picked rows (``k0 .. k0 + BK``) into ``c_buf`` / ``pe_buf``; rows whose pick
    does not count are zero-filled."""
    ks = k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, C_LD))
    ix = gl.load(idx_row + ks, mask=ks < kmax, other=-1)
    valid = (ix >= 0) & (ix < seq_len)
    row = (new_base + ix.to(gl.int64)) * lat_row
    dr = gl.arange(0, RANK, layout=gl.SliceLayout(0, C_LD))
    c_ptrs = lat_ptr + row[:, None] + dr[None, :]
    c_mask = valid[:, None] & (dr[None, :] < RANK)
    async_copy.async_copy_global_to_shared(c_buf, c_ptrs, mask=c_mask)
    ks2 = k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, PE_LD))
    ix2 = gl.load(idx_row + ks2, mask=ks2 < kmax, other=-1)
    valid2 = (ix2 >= 0) & (ix2 < seq_len)
    row2 = (new_base + ix2.to(gl.int64)) * lat_row + RANK
    dp = gl.arange(0, ROPE, layout=gl.SliceLayout(0, PE_LD))
    pe_ptrs = lat_ptr + row2[:, None] + dp[None, :]
    pe_mask = valid2[:, None] & (dp[None, :] < ROPE)
    async_copy.async_copy_global_to_shared(pe_buf, pe_ptrs, mask=pe_mask)


@gluon.jit
def _scores(q_smem, qp_smem, c, pe, BH: gl.constexpr, BK: gl.constexpr, S_L: gl.constexpr):
    """Issue the score product of one tile, ``q_lat . c + q_pe . k_pe`` (asynchronous: wait on the result)."""
    s = warpgroup_mma(q_smem, c.permute((1, 0)), gl.zeros([BH, BK], gl.float32, layout=S_L), is_async=True)
    return warpgroup_mma(qp_smem, pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    idx_row,
    k0,
    kmax,
    seq_len,
    qk_scale,
    BK: gl.constexpr,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    P_L: gl.constexpr,
    dt: gl.constexpr,
):
    """One tile's scores into the online softmax (base 2): the new row max and sum, the factor rescaling the
    accumulator (in its layout) and ``P`` as the register operand of ``P @ c``."""
    ks = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, S_L))
    ix = gl.load(idx_row + ks, mask=ks < kmax, other=-1)
    valid = (ix >= 0) & (ix < seq_len)
    s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2(-inf) = 0, never NaN
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), gl.convert_layout(p.to(dt), P_L)


@gluon.jit(do_not_specialize=["n_heads", "topk", "qk_scale"])
def _sparse_sm90_kernel(
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
    idx_ptr,
    idx_st,
    meta_ptr,
    lat_ptr,
    lat_row,
    n_heads,
    topk,
    qk_scale,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    HAS_LSE: gl.constexpr,
):
    BH: gl.constexpr = 64
    BK: gl.constexpr = 64
    SCAN: gl.constexpr = 256
    dt: gl.constexpr = ql_ptr.dtype.element_ty
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, RANK // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    C_LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    PE_LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // ROPE, ROPE // 8], [8, 1], [1, 0])
    SCAN_L: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, RANK], dt)
    QP_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, ROPE], dt)
    C_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, RANK], dt)
    PE_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, ROPE], dt)

    n_hb = gl.cdiv(n_heads, BH)
    pid = gl.program_id(0)
    t = (pid // n_hb).to(gl.int64)
    h0 = (pid % n_hb) * BH
    seq_len = gl.load(meta_ptr + t * 4 + 2)
    new_base = gl.load(meta_ptr + t * 4 + 3).to(gl.int64)
    idx_row = idx_ptr + t * idx_st

    # the last pick of the row: the loop stops after its tile
    kmax = pid * 0
    for s0 in range(0, topk, SCAN):
        ks = s0 + gl.arange(0, SCAN, layout=SCAN_L)
        ix = gl.load(idx_row + ks, mask=ks < topk, other=-1)
        kmax = gl.maximum(kmax, gl.max(gl.where(ix >= 0, ks + 1, 0), 0))
    n_tiles = gl.cdiv(kmax, BK)

    c_bufs = gl.allocate_shared_memory(dt, [2, BK, RANK], C_SL)
    pe_bufs = gl.allocate_shared_memory(dt, [2, BK, ROPE], PE_SL)
    _issue_tile(
        c_bufs.index(0),
        pe_bufs.index(0),
        lat_ptr,
        lat_row,
        idx_row,
        0,
        kmax,
        seq_len,
        new_base,
        RANK,
        ROPE,
        BK,
        C_LD,
        PE_LD,
    )
    async_copy.commit_group()

    # the program's latent and rope queries, into shared memory once
    hq = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, C_LD))
    dq = gl.arange(0, RANK, layout=gl.SliceLayout(0, C_LD))
    ql = gl.load(
        ql_ptr + t * ql_st + hq.to(gl.int64)[:, None] * ql_sh + dq[None, :],
        mask=(hq < n_heads)[:, None] & (dq < RANK)[None, :],
        other=0.0,
    )
    q_smem = gl.allocate_shared_memory(dt, [BH, RANK], Q_SL, ql)
    hp = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, PE_LD))
    dpq = gl.arange(0, ROPE, layout=gl.SliceLayout(0, PE_LD))
    qp = gl.load(
        qp_ptr + t * qp_st + hp.to(gl.int64)[:, None] * qp_sh + dpq[None, :],
        mask=(hp < n_heads)[:, None] & (dpq < ROPE)[None, :],
        other=0.0,
    )
    qp_smem = gl.allocate_shared_memory(dt, [BH, ROPE], QP_SL, qp.to(dt))

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BH, RANK], gl.float32, layout=O_L)
    for i in range(n_tiles):
        # every warp is done with the buffer the next copies fill (read by the last tile's products)
        gl.thread_barrier()
        if i + 1 < n_tiles:
            _issue_tile(
                c_bufs.index((i + 1) % 2),
                pe_bufs.index((i + 1) % 2),
                lat_ptr,
                lat_row,
                idx_row,
                (i + 1) * BK,
                kmax,
                seq_len,
                new_base,
                RANK,
                ROPE,
                BK,
                C_LD,
                PE_LD,
            )
        async_copy.commit_group()
        async_copy.wait_group(1)  # this tile's copies (the group before the one just committed) have landed
        gl.thread_barrier()
        fence_async_shared()
        s = _scores(q_smem, qp_smem, c_bufs.index(i % 2), pe_bufs.index(i % 2), BH, BK, S_L)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        m_i, l_i, alpha, p_op = _softmax_step(
            s, m_i, l_i, idx_row, i * BK, kmax, seq_len, qk_scale, BK, S_L, O_L, P_L, dt
        )
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_op, c_bufs.index(i % 2), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
    ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    do = gl.arange(0, RANK, layout=gl.SliceLayout(0, O_L))
    gl.store(
        o_ptr + t * o_st + ho.to(gl.int64)[:, None] * o_sh + do[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=(ho < n_heads)[:, None] & (do < RANK)[None, :],
    )
    if HAS_LSE:
        hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        has = l_i > 0
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + t * lse_st + hs.to(gl.int64) * lse_sh, lse, mask=hs < n_heads)


def sparse_attention_sm90(
    o_lat: torch.Tensor,
    lse: Optional[torch.Tensor],
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    topk_indices: torch.Tensor,
    token_meta: torch.Tensor,
    latent: torch.Tensor,
    sm_scale: float,
) -> None:
    """One launch over ``n`` tokens whose picks are rows of ``latent`` (module docstring).

    Args:
        o_lat: ``[n, H, kv_lora_rank]`` out (unit last stride), written in its dtype.
        lse: ``[n, H]`` float32 out (natural log; -inf for a row without keys), or None.
        q_lat: ``[n, H, kv_lora_rank]`` latent queries, unit last stride, bf16 or fp16 (the compute dtype).
        q_pe: ``[n, H, qk_rope_head_dim]`` rope queries (a view of q: any strides; copied here where its last
            stride is not 1, which the kernel's loads assume).
        topk_indices: int32 ``[n, K]`` positions in each token's request sequence, -1 for none (copied here where its
            last stride is not 1).
        token_meta: int32 ``[n, 4]`` contiguous, :attr:`mla_bridge.PrefillPlan.sparse_latent_meta`'s rows: only the
            sequence length (column 2) and the request's first row of ``latent`` (column 3) are read.
        latent: ``[R, kv_lora_rank + qk_rope_head_dim]`` in q_lat's dtype, unit last stride, its row stride a multiple
            of 16 elements and its data 16-byte aligned (the copies are 16 bytes).
        sm_scale: the softmax scale.
    """
    n, h, rank = q_lat.shape
    if n == 0 or h == 0:
        return
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    topk_indices = topk_indices if topk_indices.stride(-1) == 1 else topk_indices.contiguous()
    grid = (n * cdiv(h, BLOCK_H),)
    _sparse_sm90_kernel[grid](
        o_lat,
        o_lat.stride(0),
        o_lat.stride(1),
        lse if lse is not None else o_lat,
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        q_lat,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe,
        q_pe.stride(0),
        q_pe.stride(1),
        topk_indices,
        topk_indices.stride(0),
        token_meta,
        latent,
        latent.stride(0),
        h,
        topk_indices.shape[1],
        float(sm_scale) * _LOG2E,
        RANK=rank,
        ROPE=q_pe.shape[-1],
        HAS_LSE=lse is not None,
        num_warps=NUM_WARPS,
    )
