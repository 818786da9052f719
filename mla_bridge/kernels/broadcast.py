"""Triton kernel: the k_pe broadcast of the split up-projection layout, one launch.

Every head's key reads the token's one shared RoPE key: ``dst[i, h, :] = src[i, :]`` for ``dst [N, H, rope]`` (a
strided view into the ``[N, H, 320]`` key/value buffer) and ``src [N, rope]`` (the k_pe columns of the latent rows,
or the new tokens' own ``k_pe``, any strides: a caller's k_pe may be a view with a last stride other than 1). An
exact copy: no arithmetic, bitwise the torch ``copy_`` of an expanded view, which is the CPU's and the fallback
path. Why a kernel: torch's ``copy_`` of the expanded view reached about a fifth of write bandwidth on the
H200 (docs/results.md). Program ``(p, g)`` reads
rows ``[p * BLOCK_M, (p + 1) * BLOCK_M)`` once and writes them into heads ``[g * HEADS, (g + 1) * HEADS)``.

Imported only by :mod:`mla_bridge.weights`, on first use: Triton is not needed on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv, next_power_of_2
from .launch import launch

__all__ = ["broadcast_heads_triton"]

_BLOCK_M = 32
_HEADS = 16
_OPTIONS = dict(num_warps=4)


@triton.jit
def _broadcast_kernel(
    dst_ptr,
    d_row,
    d_head,
    d_elem,
    src_ptr,
    s_row,
    s_elem,
    n_rows,
    n_heads,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEADS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    m = (rows < n_rows)[:, None] & (r < ROPE)[None, :]
    x = tl.load(src_ptr + rows[:, None] * s_row + r[None, :] * s_elem, mask=m, other=0)
    dst = dst_ptr + rows[:, None] * d_row + r[None, :] * d_elem
    h0 = tl.program_id(1) * HEADS
    for j in tl.static_range(HEADS):
        h = h0 + j
        if h < n_heads:
            tl.store(dst + h * d_head, x, mask=m)


def broadcast_heads_triton(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[i, h, :] = src[i, :]`` for ``dst [N, H, R]`` and ``src [N, R]`` of one dtype on one CUDA device, any
    strides (a unit last stride, the common case, is specialized by Triton; nothing else is checked here)."""
    n, heads, rope = dst.shape
    if n == 0 or heads == 0 or rope == 0:  # qk_rope_head_dim 0: nothing to place (Triton has no empty arange)
        return
    grid = (cdiv(n, _BLOCK_M), cdiv(heads, _HEADS))
    launch(
        _broadcast_kernel,
        grid,
        (dst, dst.stride(0), dst.stride(1), dst.stride(2), src, src.stride(0), src.stride(1), n, heads),
        dict(ROPE=rope, BLOCK_R=next_power_of_2(rope), BLOCK_M=_BLOCK_M, HEADS=_HEADS),
        _OPTIONS,
    )
