"""Triton kernel: merge two attention partials by their natural-log LSE in one launch (in place or into new tensors).

For every (token t, head h) pair the kernel computes, in float32 and in exactly the order of the torch merge
(:func:`mla_bridge.merge._merge_torch`)::

    la = where(lse_a == +inf, -inf, lse_a)          lb likewise     (+inf: "empty" in some kernels)
    m  = maximum(la, lb)                             (NaN propagates, as torch.maximum)
    ms = where(isinf(m), 0, m)
    wa = exp(la - ms); wb = exp(lb - ms); total = wa + wb
    lse = where(total != 0, ms + log(total), -inf)   (a NaN lse stays NaN: NaN != 0)
    out = where(wa/total != 0, out_a * (wa/total), 0) + where(wb/total != 0, out_b * (wb/total), 0)

rounded once to the output dtype (round to nearest even; bf16 on the bits, so that the interpreter, whose float
casts truncate, gives the same bits). An empty partial's out is never read (its load is masked off), so garbage,
NaN included, cannot leak; two empties give (0, -inf). On CUDA ``exp``/``log`` are libdevice's ``expf``/``logf``
(the functions torch's CUDA kernels call), the divisions are IEEE ``div_rn`` and FMA contraction is off, so the
result is meant to equal the torch merge on the same GPU bit for bit (tests/gpu/test_gpu_merge.py checks it). One
known way it can differ: Triton links libdevice with flush-to-zero, so a weight below 2**-126 (LSEs more than about
87 apart) is 0 here and a subnormal in torch; the merged out is the same after rounding unless the other partial's
out is exactly 0 there.
Under ``TRITON_INTERPRET=1`` (CPU tensors) ``exp``/``log`` are numpy's.

Layout: out tensors ``[T, H, D]`` with any strides (passed per tensor; Triton specializes a unit last stride), any
D (the block is the next power of two, masked), each of its own dtype among fp16/bf16/float32 (a float32 running out
merged with a bf16 partial into float32 or bf16: :attr:`mla_bridge.PrefillPlan.merge_steps`; the kernel is compiled
per dtype combination); LSEs ``[T, H]`` float32 contiguous (the caller makes them so).
Offsets are int64: any T. Imported only by :mod:`mla_bridge.merge`, on first use: Triton is not needed on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv, next_power_of_2
from .launch import launch

try:
    from triton.language.extra import libdevice
except ImportError:  # older layouts
    from triton.language.extra.cuda import libdevice

__all__ = ["merge_triton", "LAUNCH_OPTIONS"]

#: elements of out handled by one program (pairs per program = this / the padded head dim)
_ELEMS_PER_PROGRAM = 4096
#: compile options of every launch: no FMA contraction (the torch merge rounds every product and sum on its own)
LAUNCH_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log(x, EXACT: tl.constexpr):
    if EXACT:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _merge_kernel(
    dst_ptr,
    dst_lse_ptr,
    a_ptr,
    a_lse_ptr,
    b_ptr,
    b_lse_ptr,
    n_pairs,
    num_heads,
    a_st,
    a_sh,
    a_sd,
    b_st,
    b_sh,
    b_sd,
    d_st,
    d_sh,
    d_sd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    EXACT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    LSE_B_LOG2: tl.constexpr,
    INF_EMPTY: tl.constexpr,
):
    pid = tl.program_id(0)
    p = pid.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < n_pairs
    t = p // num_heads
    h = p % num_heads
    neg_inf = float("-inf")
    la = tl.load(a_lse_ptr + p, mask=pmask, other=neg_inf)
    lb = tl.load(b_lse_ptr + p, mask=pmask, other=neg_inf)
    if LSE_B_LOG2:
        lb = lb * 0.6931471805599453  # base 2 -> natural log: float32(ln 2) * lb, as FlashInfer's lse.mul_(ln2)
    if INF_EMPTY:
        la = tl.where(la == float("inf"), neg_inf, la)
        lb = tl.where(lb == float("inf"), neg_inf, lb)
    m = tl.where((la >= lb) | (la != la), la, lb)  # torch.maximum: a NaN on either side wins
    ms = tl.where((m == float("inf")) | (m == neg_inf), 0.0, m)
    wa = _exp(la - ms, EXACT)
    wb = _exp(lb - ms, EXACT)
    total = wa + wb
    nonempty = total != 0
    total_safe = tl.where(nonempty, total, 1.0)
    lse = tl.where(nonempty, ms + _log(total_safe, EXACT), neg_inf)
    sa = tl.math.div_rn(wa, total_safe)
    sb = tl.math.div_rn(wb, total_safe)

    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    use_a = pmask & (sa != 0)
    use_b = pmask & (sb != 0)
    oa = tl.load(
        a_ptr + t[:, None] * a_st + h[:, None] * a_sh + d[None, :] * a_sd,
        mask=use_a[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    ob = tl.load(
        b_ptr + t[:, None] * b_st + h[:, None] * b_sh + d[None, :] * b_sd,
        mask=use_b[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    o = tl.where(use_a[:, None], oa * sa[:, None], 0.0) + tl.where(use_b[:, None], ob * sb[:, None], 0.0)
    if OUT_BF16:
        # round to nearest even on the bits (as cvt.rn.bf16.f32 and torch's .to(); NaN -> 0x7FC0 as c10::BFloat16)
        bits = o.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(o != o, 0x7FC0, rounded)
        r = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = o.to(dst_ptr.dtype.element_ty)
    tl.store(
        dst_ptr + t[:, None] * d_st + h[:, None] * d_sh + d[None, :] * d_sd, r, mask=pmask[:, None] & dmask[None, :]
    )
    tl.store(dst_lse_ptr + p, lse, mask=pmask)


def merge_triton(
    dst: torch.Tensor,
    dst_lse: torch.Tensor,
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    lse_b_log2: bool = False,
    inf_empty: bool = True,
) -> None:
    """``(dst, dst_lse) <- merge((out_a, lse_a), (out_b, lse_b))``; ``dst`` may be ``out_a`` (in place).

    All outs ``[T, H, D]`` with any strides, each fp16/bf16/float32 (``out_a`` and ``dst`` may differ from
    ``out_b``: read in float32, rounded once to ``dst``'s dtype); LSEs ``[T, H]`` float32, natural log
    (``dst_lse`` contiguous; ``lse_a`` / ``lse_b`` are made contiguous here when they are not, a copy of T x H
    floats); ``lse_b_log2``: ``lse_b`` is base 2 (FlashInfer's), multiplied by float32(ln 2) as it is read;
    ``inf_empty``: an LSE of +inf marks an empty partial (the default, :func:`mla_bridge.merge_attn_states`'s
    convention), else it is an infinite logit and the merged row comes out non-finite. The caller (:mod:`mla_bridge.merge`) has checked shapes, dtypes and devices."""
    t, h, d = out_a.shape
    n_pairs = t * h
    if n_pairs == 0:
        return
    lse_a = lse_a.contiguous()
    lse_b = lse_b.contiguous()
    block_d = next_power_of_2(d)
    block_p = max(1, _ELEMS_PER_PROGRAM // block_d)
    grid = (cdiv(n_pairs, block_p),)
    sa, sb, sd = out_a.stride(), out_b.stride(), dst.stride()
    launch(
        _merge_kernel,
        grid,
        (
            dst,
            dst_lse,
            out_a,
            lse_a,
            out_b,
            lse_b,
            n_pairs,
            h,
            sa[0],
            sa[1],
            sa[2],
            sb[0],
            sb[1],
            sb[2],
            sd[0],
            sd[1],
            sd[2],
        ),
        dict(
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_P=block_p,
            EXACT=dst.is_cuda,
            OUT_BF16=dst.dtype == torch.bfloat16,
            LSE_B_LOG2=bool(lse_b_log2),
            INF_EMPTY=bool(inf_empty),
        ),
        LAUNCH_OPTIONS,
    )
