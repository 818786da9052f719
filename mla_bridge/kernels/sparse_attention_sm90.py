"""Gluon kernel for SM90 (Hopper): the sparse attention of :mod:`mla_bridge.kernels.sparse_attention` over the fused
key latents, its warpgroups specialized and laid out by hand.

The math is the Triton kernel's (its module docstring states it): per new token and head, the online softmax of
``q_lat . c + q_pe . k_pe`` (scaled, base 2 inside) over the token's picks, ``o_lat = softmax @ c`` and the natural-log
LSE. This kernel serves the route where every pick is a row of one contiguous buffer (the fused key latents,
:func:`mla_bridge.cache.fused_latent`: row ``new_base + pick``, valid for ``0 <= pick < seq_len``), bf16 or fp16.

The organisation is that of FlashMLA's SM90 sparse prefill kernel (``csrc/sm90/prefill/sparse``): one program per
token and 64 heads, three warpgroups (``gl.warp_specialize``, registers moved to the two that multiply):

* the loader (4 warps, few registers) gathers the picked rows with ``cp.async`` (16-byte copies; a row whose pick
  does not count is zero-filled, never read) into two tile buffers of 64 picks, each split into a left part (latent
  columns ``[0, kv_lora_rank / 2)``) and a right part (the other latent columns and the rope part); every part has a
  ``ready`` mbarrier (the loader's 128 threads arrive as their copies land) and a ``free`` one. It loads the queries
  once, the same way.
* warpgroup 0 scores the even tiles (buffer 0), warpgroup 1 the odd ones (buffer 1): each computes its tile's whole
  score block ``S [64 heads, 64 picks]`` once (``wgmma`` m64n64k16). The output is split by columns: warpgroup 0
  accumulates ``O[:, :kv_lora_rank / 2]``, warpgroup 1 the rest. Each multiplies its own ``P`` from registers and the
  other's from shared memory.
* the row maximum goes warpgroup 0 -> 1 -> 0 through shared memory, so that both tiles of a pair end on one maximum
  (warpgroup 0 rescales its ``P`` to it before handing it over); the row sums stay per warpgroup and are added at the
  end. Warpgroup 0's score product of the next pair overlaps its last ``P @ c`` of this one.

Shared memory at kv_lora_rank 512, rope 64, bf16: the queries 72 KiB, two tiles 144 KiB, one ``P`` 8 KiB (the other
lives in buffer 0's rope part, which only warpgroup 0's score product reads) and the statistics, 230,880 bytes as
Triton 3.6 compiles it for sm_90a (of 232,448). At the end each warpgroup writes its normalised half of ``O`` through
its half of the (no longer read) query buffer. It compiles for other powers of two of ``kv_lora_rank`` (64-512) and
``qk_rope_head_dim`` (16-128, 512 + 128 excepted) whose buffers fit; :func:`mla_bridge.sparse.sm90_kernel_serves`
takes it at 512 + 64 only, the dims it has been checked at on a GPU. Imported on first use only (needs Triton 3.6,
whose Gluon API it is written against, and an SM90 device).
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import cdiv

__all__ = ["sparse_attention_sm90"]

_LOG2E = 1.4426950408889634
BH = gl.constexpr(64)
BK = gl.constexpr(64)

# barrier slots
B_Q = gl.constexpr(0)
B_K0L_READY = gl.constexpr(1)
B_K0R_READY = gl.constexpr(2)
B_K1L_READY = gl.constexpr(3)
B_K1R_READY = gl.constexpr(4)
B_K0L_FREE = gl.constexpr(5)
B_K0R_FREE = gl.constexpr(6)
B_K1L_FREE = gl.constexpr(7)
B_K1R_FREE = gl.constexpr(8)
B_M0 = gl.constexpr(9)
B_M1 = gl.constexpr(10)
B_S0 = gl.constexpr(11)
B_S1 = gl.constexpr(12)
B_L0 = gl.constexpr(13)
B_L1 = gl.constexpr(14)
N_BARS = gl.constexpr(15)

#: Registers per thread of the second multiplying warpgroup and of the loader (``setmaxnreg``); the default partition
#: (warpgroup 0) gets ``504 - both``: 12 warps share the register file at 168 each.
REG_MMA = 232
REG_LOAD = 40


@gluon.constexpr_function
def _ld_layout(cols):
    """8 threads x 16 B per 64-column chunk of a row: a warp covers 4 rows, the 4 warps 16 rows."""
    w = min(int(cols), 64) // 8
    return gl.BlockedLayout([1, 8], [32 // w, w], [4, 1], [1, 0])


@gluon.constexpr_function
def _same_ld(a, b):
    return min(int(a), 64) == min(int(b), 64)


# ----------------------------------------------------------------------------------------------------------------
# producer
# ----------------------------------------------------------------------------------------------------------------
@gluon.jit
def _rows(idx_row, k0, kmax, seq_len, new_base, lat_row, L: gl.constexpr):
    ks = k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, L))
    ix = gl.load(idx_row + ks, mask=ks < kmax, other=-1)
    valid = (ix >= 0) & (ix < seq_len)
    row = (new_base + ix.to(gl.int64)) * lat_row
    return row, valid


@gluon.jit
def _copy_cols(buf, lat_ptr, row, valid, c0, NC: gl.constexpr, L: gl.constexpr):
    dc = gl.arange(0, NC, layout=gl.SliceLayout(0, L))
    ptrs = lat_ptr + row[:, None] + (c0 + dc)[None, :]
    mask = valid[:, None] & (dc < NC)[None, :]
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=mask)


@gluon.jit
def _producer(
    ql_l,
    ql_r,
    qp_s,
    cl_bufs,
    cr_bufs,
    pe_bufs,
    bars,
    ql_ptr,
    ql_st,
    ql_sh,
    qp_ptr,
    qp_st,
    qp_sh,
    idx_row,
    lat_ptr,
    lat_row,
    t,
    h0,
    n_heads,
    kmax,
    seq_len,
    new_base,
    n_pairs,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
):
    """The loader warpgroup: the queries once, then per pair of tiles (even tile a, odd tile b) the picked rows in
    FlashMLA's order (a's left half, b's right part, a's right part, b's left half), each part once the warpgroups
    that read it have freed it, its ``ready`` mbarrier arrived on by every loader thread as its copies land."""
    HALF: gl.constexpr = RANK // 2
    C_LD: gl.constexpr = _ld_layout(HALF)
    PE_LD: gl.constexpr = _ld_layout(ROPE)

    # Q, once
    hq = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, C_LD))
    hmask = hq < n_heads
    qrow = t * ql_st + hq.to(gl.int64) * ql_sh
    _copy_cols(ql_l, ql_ptr, qrow, hmask, 0, HALF, C_LD)
    _copy_cols(ql_r, ql_ptr, qrow, hmask, HALF, HALF, C_LD)
    hp = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, PE_LD))
    prow = t * qp_st + hp.to(gl.int64) * qp_sh
    _copy_cols(qp_s, qp_ptr, prow, hp < n_heads, 0, ROPE, PE_LD)
    async_copy.mbarrier_arrive(bars.index(B_Q), increment_count=False)

    for j in range(n_pairs):
        ph = j & 1
        ka = (2 * j) * BK
        kb = ka + BK
        row_a, val_a = _rows(idx_row, ka, kmax, seq_len, new_base, lat_row, C_LD)
        row_b, val_b = _rows(idx_row, kb, kmax, seq_len, new_base, lat_row, C_LD)
        if _same_ld(HALF, ROPE):
            prow_a = row_a
            pval_a = val_a
            prow_b = row_b
            pval_b = val_b
        else:  # another row distribution for the rope part: its own index loads (no layout conversion)
            prow_a, pval_a = _rows(idx_row, ka, kmax, seq_len, new_base, lat_row, PE_LD)
            prow_b, pval_b = _rows(idx_row, kb, kmax, seq_len, new_base, lat_row, PE_LD)
        # V0 left (tile a)
        mbarrier.wait(bars.index(B_K0L_FREE), ph ^ 1)
        _copy_cols(cl_bufs.index(0), lat_ptr, row_a, val_a, 0, HALF, C_LD)
        async_copy.mbarrier_arrive(bars.index(B_K0L_READY), increment_count=False)
        # V1 right + rope (tile b)
        mbarrier.wait(bars.index(B_K1R_FREE), ph ^ 1)
        _copy_cols(cr_bufs.index(1), lat_ptr, row_b, val_b, HALF, HALF, C_LD)
        _copy_cols(pe_bufs.index(1), lat_ptr, prow_b, pval_b, RANK, ROPE, PE_LD)
        async_copy.mbarrier_arrive(bars.index(B_K1R_READY), increment_count=False)
        # V0 right + rope (tile a)
        mbarrier.wait(bars.index(B_K0R_FREE), ph ^ 1)
        _copy_cols(cr_bufs.index(0), lat_ptr, row_a, val_a, HALF, HALF, C_LD)
        _copy_cols(pe_bufs.index(0), lat_ptr, prow_a, pval_a, RANK, ROPE, PE_LD)
        async_copy.mbarrier_arrive(bars.index(B_K0R_READY), increment_count=False)
        # V1 left (tile b)
        mbarrier.wait(bars.index(B_K1L_FREE), ph ^ 1)
        _copy_cols(cl_bufs.index(1), lat_ptr, row_b, val_b, 0, HALF, C_LD)
        async_copy.mbarrier_arrive(bars.index(B_K1L_READY), increment_count=False)
    async_copy.commit_group()
    async_copy.wait_group(0)


# ----------------------------------------------------------------------------------------------------------------
# consumers
# ----------------------------------------------------------------------------------------------------------------
@gluon.jit
def _masked_scores(s, idx_row, k0, kmax, seq_len, qk_scale, S_L: gl.constexpr):
    ks = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, S_L))
    ix = gl.load(idx_row + ks, mask=ks < kmax, other=-1)
    valid = (ix >= 0) & (ix < seq_len)
    return gl.where(valid[None, :], s * qk_scale, float("-inf"))


@gluon.jit
def _epilogue(
    acc,
    m_i,
    l_tot,
    o_stage,
    o_ptr,
    o_st,
    o_sh,
    lse_ptr,
    lse_st,
    lse_sh,
    t,
    h0,
    n_heads,
    c0,
    WRITE_LSE: gl.constexpr,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    HALF: gl.constexpr,
):
    """O half (normalised) through shared memory (``o_stage``: this warpgroup's half of Q, no longer read by anyone)
    to coalesced 16-byte global stores; the LSE (natural log) from WG0."""
    l_o = gl.convert_layout(l_tot, gl.SliceLayout(1, O_L))
    inv = gl.where(l_o > 0, 1.0 / gl.where(l_o > 0, l_o, 1.0), 0.0)
    o_stage.store((acc * inv[:, None]).to(o_stage.dtype))
    gl.thread_barrier()
    ST_L: gl.constexpr = _ld_layout(HALF)
    o = o_stage.load(ST_L)
    ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ST_L))
    do = gl.arange(0, HALF, layout=gl.SliceLayout(0, ST_L))
    gl.store(
        o_ptr + t * o_st + ho.to(gl.int64)[:, None] * o_sh + (c0 + do)[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=(ho < n_heads)[:, None] & (do < HALF)[None, :],
    )
    if WRITE_LSE:
        hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        has = l_tot > 0
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_tot, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + t * lse_st + hs.to(gl.int64) * lse_sh, lse, mask=hs < n_heads)


@gluon.jit
def _wg0(
    q_bufs,
    qp_bufs,
    cl_bufs,
    cr_bufs,
    pe_bufs,
    p0_s,
    p1_s,
    sm0,
    sm1,
    sl0,
    sl1,
    bars,
    o_ptr,
    o_st,
    o_sh,
    lse_ptr,
    lse_st,
    lse_sh,
    idx_row,
    t,
    h0,
    n_heads,
    kmax,
    seq_len,
    n_pairs,
    qk_scale,
    RANK: gl.constexpr,
    HAS_LSE: gl.constexpr,
):
    """Warpgroup 0 (the default partition): scores the even tiles, accumulates ``O[:, :RANK / 2]``; publishes its row
    maximum, takes the pair's final one from warpgroup 1, rescales its ``P`` to it and hands it over; writes the LSE."""
    HALF: gl.constexpr = RANK // 2
    dt: gl.constexpr = q_bufs.dtype
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)

    m_i = gl.full([BH], -1.0e30, gl.float32, layout=ROW)
    l_i = gl.zeros([BH], gl.float32, layout=ROW)
    acc = gl.zeros([BH, HALF], gl.float32, layout=O_L)
    s = gl.zeros([BH, BK], gl.float32, layout=S_L)
    mbarrier.wait(bars.index(B_Q), 0)
    fence_async_shared()
    if n_pairs > 0:
        # z == 0, opaque to the compiler: keeps the ~50 shared-memory descriptors of a pair from being hoisted out of
        # the loop (or shared with this prologue) and spilled; they are recomputed per pair instead
        z0 = (seq_len < -1073741824).to(gl.int32)
        mbarrier.wait(bars.index(B_K0L_READY), 0)
        fence_async_shared()  # cp.async (generic proxy) data -> wgmma (async proxy)
        s = warpgroup_mma(q_bufs.index(z0), cl_bufs.index(z0).permute((1, 0)), s, use_acc=False, is_async=True)
        mbarrier.wait(bars.index(B_K0R_READY), 0)
        fence_async_shared()  # cp.async (generic proxy) data -> wgmma (async proxy)
        s = warpgroup_mma(q_bufs.index(z0 + 1), cr_bufs.index(z0).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(qp_bufs.index(z0), pe_bufs.index(z0).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    for j in range(n_pairs):
        ph = j & 1
        z = ((j + seq_len) < -1073741824).to(gl.int32)
        s = _masked_scores(s, idx_row, (2 * j) * BK, kmax, seq_len, qk_scale, S_L)
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        sm0.store(m_new)
        gl.thread_barrier()
        mbarrier.arrive(bars.index(B_M0))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dt), P_L), cl_bufs.index(z), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(bars.index(B_K0L_FREE))
        # the pair's final max (WG1 folded its tile in); P0 to it, published for WG1
        mbarrier.wait(bars.index(B_M1), ph)
        m_fin = sm1.load(ROW)
        beta = gl.exp2(m_new - m_fin)
        p0_s.store((p * beta[:, None]).to(dt))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(bars.index(B_S0))
        l_i = l_i * beta
        m_i = m_fin
        mbarrier.wait(bars.index(B_S1), ph)
        acc = acc * gl.convert_layout(beta, gl.SliceLayout(1, O_L))[:, None]
        if j + 1 < n_pairs:
            # P1 @ V1 left overlaps the next pair's score product
            acc = warpgroup_mma(p1_s, cl_bufs.index(z + 1), acc, is_async=True)
            mbarrier.wait(bars.index(B_K0L_READY), ph ^ 1)
            fence_async_shared()  # cp.async (generic proxy) data -> wgmma (async proxy)
            s = warpgroup_mma(q_bufs.index(z), cl_bufs.index(z).permute((1, 0)), s, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(bars.index(B_K1L_FREE))
            mbarrier.wait(bars.index(B_K0R_READY), ph ^ 1)
            fence_async_shared()  # cp.async (generic proxy) data -> wgmma (async proxy)
            s = warpgroup_mma(q_bufs.index(z + 1), cr_bufs.index(z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qp_bufs.index(z), pe_bufs.index(z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        else:
            acc = warpgroup_mma(p1_s, cl_bufs.index(z + 1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(bars.index(B_K1L_FREE))
    # row sums: WG0's + WG1's (same reference max)
    sl0.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(B_L0))
    mbarrier.wait(bars.index(B_L1), 0)
    l_tot = l_i + sl1.load(ROW)
    # both warpgroups are past their last score product (WG1's came before its last B_M1 arrival): Q is free
    _epilogue(
        acc,
        m_i,
        l_tot,
        q_bufs.index(0),
        o_ptr,
        o_st,
        o_sh,
        lse_ptr,
        lse_st,
        lse_sh,
        t,
        h0,
        n_heads,
        0,
        HAS_LSE,
        S_L,
        O_L,
        HALF,
    )


@gluon.jit
def _wg1(
    q_bufs,
    qp_bufs,
    cl_bufs,
    cr_bufs,
    pe_bufs,
    p0_s,
    p1_s,
    sm0,
    sm1,
    sl0,
    sl1,
    bars,
    o_ptr,
    o_st,
    o_sh,
    lse_ptr,
    lse_st,
    lse_sh,
    idx_row,
    t,
    h0,
    n_heads,
    kmax,
    seq_len,
    n_pairs,
    qk_scale,
    RANK: gl.constexpr,
    HAS_LSE: gl.constexpr,
):
    """Warpgroup 1: scores the odd tiles on top of warpgroup 0's row maximum (the pair's final one, published back),
    accumulates ``O[:, RANK / 2:]`` from its own ``P`` and warpgroup 0's."""
    HALF: gl.constexpr = RANK // 2
    dt: gl.constexpr = q_bufs.dtype
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)

    m_i = gl.full([BH], -1.0e30, gl.float32, layout=ROW)
    l_i = gl.zeros([BH], gl.float32, layout=ROW)
    acc = gl.zeros([BH, HALF], gl.float32, layout=O_L)
    s = gl.zeros([BH, BK], gl.float32, layout=S_L)
    mbarrier.wait(bars.index(B_Q), 0)
    fence_async_shared()
    for j in range(n_pairs):
        ph = j & 1
        z = ((j + seq_len) < -1073741824).to(gl.int32)  # 0, opaque (see WG0)
        mbarrier.wait(bars.index(B_K1R_READY), ph)
        fence_async_shared()  # cp.async (generic proxy) data -> wgmma (async proxy)
        s = warpgroup_mma(q_bufs.index(z + 1), cr_bufs.index(z + 1).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_bufs.index(z), pe_bufs.index(z + 1).permute((1, 0)), s, is_async=True)
        mbarrier.wait(bars.index(B_K1L_READY), ph)
        fence_async_shared()  # cp.async (generic proxy) data -> wgmma (async proxy)
        s = warpgroup_mma(q_bufs.index(z), cl_bufs.index(z + 1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = _masked_scores(s, idx_row, (2 * j + 1) * BK, kmax, seq_len, qk_scale, S_L)
        mbarrier.wait(bars.index(B_M0), ph)
        m0 = sm0.load(ROW)
        m_new = gl.maximum(m0, gl.max(s, 1))
        sm1.store(m_new)
        gl.thread_barrier()
        mbarrier.arrive(bars.index(B_M1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        pb = p.to(dt)
        acc = warpgroup_mma(gl.convert_layout(pb, P_L), cr_bufs.index(z + 1), acc, is_async=True)
        p1_s.store(pb)
        fence_async_shared()
        mbarrier.wait(bars.index(B_S0), ph)
        acc = warpgroup_mma(p0_s, cr_bufs.index(z), acc, is_async=True)
        gl.thread_barrier()
        mbarrier.arrive(bars.index(B_S1))
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(bars.index(B_K1R_FREE))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(bars.index(B_K0R_FREE))
    sl1.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(B_L1))
    mbarrier.wait(bars.index(B_L0), 0)
    l_tot = l_i + sl0.load(ROW)
    _epilogue(
        acc,
        m_i,
        l_tot,
        q_bufs.index(1),
        o_ptr,
        o_st,
        o_sh,
        lse_ptr,
        lse_st,
        lse_sh,
        t,
        h0,
        n_heads,
        HALF,
        False,
        S_L,
        O_L,
        HALF,
    )


@gluon.jit(do_not_specialize=["n_heads", "topk", "qk_scale"])
def _sparse_sm90_ws_kernel(
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
    REG_C: gl.constexpr,
    REG_P: gl.constexpr,
):
    HALF: gl.constexpr = RANK // 2
    SCAN: gl.constexpr = 256
    dt: gl.constexpr = ql_ptr.dtype.element_ty
    SCAN_L: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, HALF], dt)
    QP_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, ROPE], dt)
    C_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, HALF], dt)
    PE_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, ROPE], dt)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BK], dt)
    V_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    n_hb = gl.cdiv(n_heads, BH)
    pid = gl.program_id(0)
    t = (pid // n_hb).to(gl.int64)
    h0 = (pid % n_hb) * BH
    seq_len = gl.load(meta_ptr + t * 4 + 2)
    new_base = gl.load(meta_ptr + t * 4 + 3).to(gl.int64)
    idx_row = idx_ptr + t * idx_st

    kmax = pid * 0
    for s0 in range(0, topk, SCAN):
        ks = s0 + gl.arange(0, SCAN, layout=SCAN_L)
        ix = gl.load(idx_row + ks, mask=ks < topk, other=-1)
        kmax = gl.maximum(kmax, gl.max(gl.where(ix >= 0, ks + 1, 0), 0))
    n_pairs = gl.cdiv(kmax, 2 * BK)

    q_bufs = gl.allocate_shared_memory(dt, [2, BH, HALF], Q_SL)  # latent query: left, right half
    qp_bufs = gl.allocate_shared_memory(dt, [1, BH, ROPE], QP_SL)
    cl_bufs = gl.allocate_shared_memory(dt, [2, BK, HALF], C_SL)
    cr_bufs = gl.allocate_shared_memory(dt, [2, BK, HALF], C_SL)
    pe_bufs = gl.allocate_shared_memory(dt, [2, BK, ROPE], PE_SL)
    if ROPE == BK:
        p0_s = pe_bufs.index(0)  # buffer 0's rope part is read only by WG0's score product, before P0 is written
    else:
        p0_s = gl.allocate_shared_memory(dt, [BH, BK], P_SL)
    p1_s = gl.allocate_shared_memory(dt, [BH, BK], P_SL)
    sm0 = gl.allocate_shared_memory(gl.float32, [BH], V_SL)
    sm1 = gl.allocate_shared_memory(gl.float32, [BH], V_SL)
    sl0 = gl.allocate_shared_memory(gl.float32, [BH], V_SL)
    sl1 = gl.allocate_shared_memory(gl.float32, [BH], V_SL)
    bars = gl.allocate_shared_memory(gl.int64, [N_BARS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(N_BARS):
        if b <= B_K1R_READY:
            mbarrier.init(bars.index(b), count=128)  # cp.async.mbarrier.arrive.noinc from the 128 producer threads
        else:
            mbarrier.init(bars.index(b), count=1)  # one elected arrival per warpgroup

    gl.warp_specialize(
        [
            (
                _wg0,
                (
                    q_bufs,
                    qp_bufs,
                    cl_bufs,
                    cr_bufs,
                    pe_bufs,
                    p0_s,
                    p1_s,
                    sm0,
                    sm1,
                    sl0,
                    sl1,
                    bars,
                    o_ptr,
                    o_st,
                    o_sh,
                    lse_ptr,
                    lse_st,
                    lse_sh,
                    idx_row,
                    t,
                    h0,
                    n_heads,
                    kmax,
                    seq_len,
                    n_pairs,
                    qk_scale,
                    RANK,
                    HAS_LSE,
                ),
            ),
            (
                _wg1,
                (
                    q_bufs,
                    qp_bufs,
                    cl_bufs,
                    cr_bufs,
                    pe_bufs,
                    p0_s,
                    p1_s,
                    sm0,
                    sm1,
                    sl0,
                    sl1,
                    bars,
                    o_ptr,
                    o_st,
                    o_sh,
                    lse_ptr,
                    lse_st,
                    lse_sh,
                    idx_row,
                    t,
                    h0,
                    n_heads,
                    kmax,
                    seq_len,
                    n_pairs,
                    qk_scale,
                    RANK,
                    HAS_LSE,
                ),
            ),
            (
                _producer,
                (
                    q_bufs.index(0),
                    q_bufs.index(1),
                    qp_bufs.index(0),
                    cl_bufs,
                    cr_bufs,
                    pe_bufs,
                    bars,
                    ql_ptr,
                    ql_st,
                    ql_sh,
                    qp_ptr,
                    qp_st,
                    qp_sh,
                    idx_row,
                    lat_ptr,
                    lat_row,
                    t,
                    h0,
                    n_heads,
                    kmax,
                    seq_len,
                    new_base,
                    n_pairs,
                    RANK,
                    ROPE,
                ),
            ),
        ],
        [4, 4],
        [REG_C, REG_P],
    )


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
    """One launch over ``n`` tokens whose picks are rows of ``latent`` (module docstring), for the shapes
    :func:`mla_bridge.sparse.sm90_kernel_serves` takes.

    Args:
        o_lat: ``[n, H, kv_lora_rank]`` out in q_lat's dtype (staged in shared memory in it), unit last stride.
        lse: ``[n, H]`` float32 out (natural log; -inf for a row without keys), or None.
        q_lat: ``[n, H, kv_lora_rank]`` latent queries, unit last stride, bf16 or fp16 (the compute dtype), rows
            16-byte aligned.
        q_pe: ``[n, H, qk_rope_head_dim]`` rope queries (a view of q: any strides; copied here where its last
            stride is not 1, which the kernel's copies assume).
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
    grid = (n * cdiv(h, 64),)
    _sparse_sm90_ws_kernel[grid](
        o_lat, o_lat.stride(0), o_lat.stride(1),
        lse if lse is not None else o_lat,
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        q_lat, q_lat.stride(0), q_lat.stride(1),
        q_pe, q_pe.stride(0), q_pe.stride(1),
        topk_indices, topk_indices.stride(0),
        token_meta,
        latent, latent.stride(0),
        h, topk_indices.shape[1], float(sm_scale) * _LOG2E,
        RANK=rank, ROPE=q_pe.shape[-1], HAS_LSE=lse is not None, REG_C=REG_MMA, REG_P=REG_LOAD,
        num_warps=4,
    )  # fmt: skip
