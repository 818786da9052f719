"""Each row of sparse picks partitioned by where its rows live, for the sparse kernel's split loops
(:mod:`mla_bridge.kernels.sparse_attention`). Torch only: runs (and is tested) without Triton."""

from __future__ import annotations

import torch

__all__ = ["partition_picks"]


def partition_picks(topk_indices: torch.Tensor, token_meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's picks reordered for the kernel's split loops: the picks of the token's cached context first, then
    those of its request's new tokens, each in their given order, then -1 for the rest (no pick, or one past the
    request's sequence, which the kernel never reads); and the count of context picks per row.

    Args:
        topk_indices: int32 ``[n, K]`` positions in each token's request sequence, -1 for none.
        token_meta: int32 ``[n, 4]`` per token (:func:`mla_bridge.kernels.sparse_attention.sparse_attention_triton`):
            its context and sequence lengths in columns 1 and 2.

    Returns:
        ``(picks int32 [n, K] contiguous, n_ctx int32 [n])``, on the indices' device, made without a host sync.
    """
    ctx, seq = token_meta[:, 1:2], token_meta[:, 2:3]
    in_ctx = (topk_indices >= 0) & (topk_indices < ctx)
    in_new = (topk_indices >= ctx) & (topk_indices < seq)
    kind = (2 - 2 * in_ctx.to(torch.uint8) - in_new.to(torch.uint8)).to(torch.uint8)  # 0 context, 1 new, 2 none
    kind, order = torch.sort(kind, dim=1, stable=True)
    picks = torch.gather(topk_indices, 1, order).masked_fill_(kind == 2, -1)
    return picks, in_ctx.sum(1, dtype=torch.int32)
