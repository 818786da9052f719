"""Merging attention partials over disjoint key sets by their log-sum-exp.

For partials ``(out_a, lse_a)`` and ``(out_b, lse_b)`` (natural-log LSE):
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``
(FlashInfer's "recursive attention" tutorial; vLLM's ``merge_attn_states``). An empty partial has lse -inf and
contributes nothing, whatever its out holds; +inf (what the FlashAttention-2 library's varlen forward reports for
empty rows) is read as empty too. Two empties merge to out 0, lse -inf, never NaN.

On CUDA with fp16/bf16 and FlashInfer installed the merge runs FlashInfer's ``merge_state`` kernel, with the heads
folded into rows so that a block never needs more than 1024 threads (FlashInfer's kernel launches
``head_dim / vec`` x ``num_heads`` threads per block and fails above 64 heads at bf16, d=128), and its base-2 LSE
converted at this edge. Elsewhere it runs in float32 torch. A NaN LSE propagates to the merged row in the torch
merge; FlashInfer's kernel takes ``max()`` of the two LSEs, which drops a NaN, so on CUDA a NaN partial is merged as
if it were empty (FlashInfer 0.7.4 ``MergeStateKernel``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .dispatch import flashinfer_version

__all__ = ["merge_attn_states", "merge_attn_states_"]

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


def _check(out_a, lse_a, out_b, lse_b) -> None:
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if out_a.dim() != 3:
        raise ValueError(f"out_a must be [T, H, D], got shape {list(out_a.shape)}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b must have out_a's shape {list(out_a.shape)}, got {list(out_b.shape)}")
    if out_b.dtype != out_a.dtype:
        raise TypeError(f"out_b must have out_a's dtype {out_a.dtype}, got {out_b.dtype}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != out_a.shape[:2]:
            raise ValueError(f"{name} must be [T, H] = {list(out_a.shape[:2])} (natural log), got {list(lse.shape)}")
        if lse.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {lse.dtype}")
    for name, x in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if x.device != out_a.device:
            raise ValueError(f"{name} is on {x.device}, but out_a is on {out_a.device}")


def _heads_per_row(num_heads: int, head_dim: int, elem_size: int) -> int:
    """Largest divisor g of num_heads whose FlashInfer merge block, (head_dim / vec) x g threads, fits 1024."""
    vec = max(16 // elem_size, head_dim // 32)
    threads_per_head = max(1, head_dim // vec)
    g = num_heads
    while g > 1 and (num_heads % g or g * threads_per_head > 1024):
        g -= 1
    return g


def _flashinfer_ok(out_a: torch.Tensor, out_b: torch.Tensor) -> bool:
    if out_a.device.type != "cuda" or out_a.dtype not in (torch.float16, torch.bfloat16):
        return False
    d = out_a.shape[-1]
    return (flashinfer_version() is not None and d % 8 == 0 and d <= 512 and out_a.is_contiguous()
            and out_b.is_contiguous() and out_a.numel() > 0)


def _as_base2(lse: torch.Tensor) -> torch.Tensor:
    # +inf ("empty" in some kernels) -> -inf, then natural log -> log2.
    return torch.where(lse == float("inf"), float("-inf"), lse).mul_(_LOG2E).contiguous()


def merge_attn_states_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In-place merge: ``(out, lse) <- merge((out, lse), (out_b, lse_b))``. Same conventions as
    :func:`merge_attn_states`; ``out`` and ``lse`` must be writable (``lse`` contiguous).

    Raises:
        TypeError / ValueError: as :func:`merge_attn_states`.
    """
    _check(out, lse, out_b, lse_b)
    if not lse.is_contiguous():
        raise ValueError("lse must be contiguous to be merged in place")
    if _flashinfer_ok(out, out_b):
        from flashinfer.cascade import merge_state_in_place

        t, h, d = out.shape
        g = _heads_per_row(h, d, out.element_size())
        s = _as_base2(lse)
        merge_state_in_place(out.view(-1, g, d), s.view(-1, g), out_b.view(-1, g, d), _as_base2(lse_b).view(-1, g))
        torch.mul(s, _LN2, out=lse)
        return
    new_out, new_lse = _merge_torch(out, lse, out_b, lse_b)
    out.copy_(new_out)
    lse.copy_(new_lse)


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention partials over disjoint key sets.

    Args:
        out_a, out_b: ``[T, H, D]``, same dtype and device.
        lse_a, lse_b: ``[T, H]`` float32, natural log; -inf or +inf marks an empty partial.

    Returns:
        ``(out [T, H, D] in out_a's dtype, lse [T, H] float32 natural log)``; rows where both partials are
        empty give ``(0, -inf)``.

    Raises:
        TypeError: a non-tensor, a dtype mismatch, an lse that is not float32.
        ValueError: shapes that disagree (the message names the argument), different devices.
    """
    _check(out_a, lse_a, out_b, lse_b)
    if _flashinfer_ok(out_a, out_b):
        from flashinfer.cascade import merge_state

        t, h, d = out_a.shape
        g = _heads_per_row(h, d, out_a.element_size())
        v, s = merge_state(out_a.view(-1, g, d), _as_base2(lse_a).view(-1, g), out_b.view(-1, g, d),
                           _as_base2(lse_b).view(-1, g))
        return v.view(t, h, d), s.view(t, h).mul_(_LN2)
    return _merge_torch(out_a, lse_a, out_b, lse_b)


def _merge_torch(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    neg_inf = torch.tensor(float("-inf"), device=lse_a.device)
    la = torch.where(lse_a == float("inf"), neg_inf, lse_a)
    lb = torch.where(lse_b == float("inf"), neg_inf, lse_b)
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
    return out.to(out_a.dtype), lse
