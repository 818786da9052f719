"""An independent float64 check of MLA prefill: one request, unchunked, straight from the paged latent cache.

This shares no code with :mod:`mla_bridge.prefill`, :mod:`mla_bridge.plan` or the torch backend
(:mod:`mla_bridge.backends.torch_ref`), which may be the very backend under test. It follows the math of the
DeepSeek-V2 paper's MLA in its "MHA form" step by step, in float64, with an ordinary (not online) softmax:

1. gather the request's ``context_len`` cached latent tokens through its ``block_table`` row
   (position ``p`` lives in block ``block_table[p // block_size]``, slot ``p % block_size``); an FP8 e4m3 cache
   (``float8_e4m3fn`` or its uint8 view) is dequantized from the same bytes as ``float64(stored) * scale`` (exact:
   the product of an e4m3 value and a float32 scale fits a float64), so the check measures the kernels, not the
   quantization; the kernels' gather rounds that same product once to the plan's dtype;
2. append the request's new tokens (``kv_c`` ++ ``k_pe``): the whole sequence, context first;
3. up-project with ``kv_b_proj_weight`` (``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``):
   ``kv_c @ W.T`` viewed ``[S, H, qk_nope_head_dim + v_head_dim]`` splits into k_nope and v;
   k = concat(k_nope, k_pe broadcast over heads);
4. scores ``q . k * softmax_scale``; new token ``i`` sees every context token and new tokens ``<= i``;
5. a plain softmax over each full key row: ``m = max(scores)``, ``p = exp(scores - m)``,
   ``lse = m + log(sum p)`` (natural log), ``out = (p @ v) / sum p``.

Queries are processed in blocks only to bound memory (each block's softmax still spans the full key row), so a
10000-token prompt never holds ``T x S x H`` float64 scores at once.

:func:`reference_sparse_request` is the same computation for DeepSeek Sparse Attention (``mla_prefill(...,
topk_indices=)``, :mod:`mla_bridge.sparse`): steps 1 to 4 as above (the MHA form, NOT the absorbed one the library
runs), then each query's softmax spans only the keys its row of indices names.
"""

from __future__ import annotations


import torch

from .dims import MLADims

__all__ = [
    "gather_context_latent",
    "reference_request",
    "reference_sparse_request",
    "max_abs_error",
    "max_excess_error",
    "TOLERANCE",
]

#: Allowed error of a prefill against this float64 reference, per run dtype (the CLI's check and the bench's):
#: ``|x - ref| <= atol + rtol * |ref|`` elementwise, as ((out atol, out rtol), (lse atol, lse rtol)). Half precision: out is rounded to bf16/fp16 (a relative error of up
#: to 2**-8 / 2**-11, so rtol is two such roundings), and k/v are rounded after the up-projection. float32: the
#: blockwise float32 attention differs from float64 by about 1e-6 relative, so rtol 1e-5 keeps the check
#: scale-free (a checkpoint whose outputs are about 50 failed the absolute 1e-4 alone while 2.6e-6 relative off).
TOLERANCE = {
    "float32": ((1e-4, 1e-5), (1e-4, 1e-5)),
    "bfloat16": ((2e-2, 2.0**-7), (1e-2, 1e-3)),
    "float16": ((1e-2, 2.0**-10), (1e-2, 1e-3)),
}
#: float64 scores held at once per query block (256 MiB).
_SCORE_ELEMS = 1 << 25


def gather_context_latent(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int, kv_cache_scale=None
) -> torch.Tensor:
    """The first ``context_len`` latent tokens of one request, ``[context_len, latent_dim]``: in the cache's dtype,
    or for an FP8 cache (``float8_e4m3fn`` / uint8 view, ``kv_cache_scale`` required) float64 ``stored * scale``.

    Args:
        kv_cache: ``[num_blocks, block_size, latent_dim]``.
        block_table_row: ``[max_blocks]`` integer block ids of this request.
        context_len: cached tokens of this request (>= 0).
        kv_cache_scale: the FP8 cache's per-tensor scale (float or 1-element tensor); None for other caches.

    Raises:
        ValueError: an FP8 cache without a scale, or a scale with another cache; a negative ``context_len``, or one
            beyond what the row's blocks hold.
    """
    held = block_table_row.shape[0] * kv_cache.shape[1]
    if not 0 <= context_len <= held:
        raise ValueError(
            f"context_len must be in [0, {held}] (block_table_row's {block_table_row.shape[0]} blocks of "
            f"{kv_cache.shape[1]} tokens), got {context_len}"
        )
    if kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        if kv_cache_scale is None:
            raise ValueError("kv_cache_scale is required for an FP8 kv_cache")
        scale = float(torch.as_tensor(kv_cache_scale, dtype=torch.float32).reshape(()).cpu())
        rows = _gather_rows(kv_cache.view(torch.uint8), block_table_row, context_len)  # the bytes
        return rows.view(torch.float8_e4m3fn).to(torch.float64) * scale
    if kv_cache_scale is not None:
        raise ValueError(f"kv_cache_scale was given for a {kv_cache.dtype} kv_cache (only FP8 caches take one)")
    return _gather_rows(kv_cache, block_table_row, context_len)


def _gather_rows(kv_cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int) -> torch.Tensor:
    block_size = kv_cache.shape[1]
    rows = []
    for p0 in range(0, context_len, block_size):
        n = min(block_size, context_len - p0)
        rows.append(kv_cache[int(block_table_row[p0 // block_size])][:n])
    if not rows:
        return kv_cache.new_zeros(0, kv_cache.shape[2])
    return torch.cat(rows, dim=0)


def reference_request(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    context_len: int,
    dims: MLADims,
    *,
    score_elems: int = _SCORE_ELEMS,
    device: "torch.device | str | None" = None,
    kv_cache_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA prefill of ONE request over its whole sequence, in float64.

    Args:
        q: ``[L, H, qk_nope_head_dim + qk_rope_head_dim]`` the request's queries (RoPE already applied).
        kv_c: ``[L, kv_lora_rank]`` and k_pe: ``[L, qk_rope_head_dim]`` (or ``[L, 1, rope]``): its new tokens.
        kv_b_proj_weight: ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` paged latent cache.
        block_table_row: ``[max_blocks]`` this request's block ids.
        context_len: cached tokens before the new ones.
        dims: the layer's :class:`MLADims` (head split and ``softmax_scale``).
        score_elems: float64 scores held at once (sets the query block size; the result does not depend on it).
        device: where to compute (default: q's device; a GPU's float64 is much faster than a CPU's).
        kv_cache_scale: an FP8 cache's per-tensor scale (see :func:`gather_context_latent`).

    Returns:
        ``(out [L, H, v_head_dim] float64, lse [L, H] float64 natural log)``, on the CPU. With no new tokens
        (``L == 0``) the tensors are empty.
    """
    dev = torch.device(q.device if device is None else device)
    f64 = torch.float64
    r, rope, nope, dv, h = (
        dims.kv_lora_rank,
        dims.qk_rope_head_dim,
        dims.qk_nope_head_dim,
        dims.v_head_dim,
        dims.num_heads,
    )
    q = q.to(dev, f64)
    new_latent = torch.cat([kv_c.to(dev, f64), k_pe.reshape(k_pe.shape[0], rope).to(dev, f64)], dim=1)
    ctx_latent = gather_context_latent(kv_cache, block_table_row.to("cpu"), context_len, kv_cache_scale).to(dev, f64)
    latent = torch.cat([ctx_latent, new_latent], dim=0)  # [S, kv_lora_rank + rope], context first
    s_len, l_len = latent.shape[0], q.shape[0]

    w = kv_b_proj_weight.to(dev, f64)
    kv = (latent[:, :r] @ w.t()).view(s_len, h, nope + dv)
    k = torch.cat([kv[..., :nope], latent[:, None, r:].expand(s_len, h, rope)], dim=-1)  # [S, H, nope + rope]
    v = kv[..., nope:]  # [S, H, dv]
    kh = k.permute(1, 2, 0)  # [H, Dqk, S]
    vh = v.permute(1, 0, 2)  # [H, S, Dv]

    out = torch.zeros(l_len, h, dv, dtype=f64, device=dev)
    lse = torch.full((l_len, h), float("-inf"), dtype=f64, device=dev)
    block = max(1, score_elems // max(1, h * s_len))
    for i0 in range(0, l_len, block):
        i1 = min(l_len, i0 + block)
        kv_end = context_len + i1  # keys the last query of this block may see
        scores = torch.matmul(q[i0:i1].permute(1, 0, 2), kh[:, :, :kv_end])  # [H, b, kv_end]
        scores.mul_(dims.softmax_scale)
        # Query i sees keys j <= context_len + i: only the block's last (i1 - i0) key columns hold masked pairs.
        hidden = torch.ones(i1 - i0, i1 - i0, dtype=torch.bool, device=dev).triu_(1)
        scores[:, :, context_len + i0 :].masked_fill_(hidden, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)  # finite: every query sees at least itself
        p = scores.sub_(row_max).exp_()  # softmax numerator, over the full key row
        denom = p.sum(dim=-1)  # [H, b]
        out[i0:i1] = (torch.matmul(p, vh[:, :kv_end]) / denom.unsqueeze(-1)).permute(1, 0, 2)
        lse[i0:i1] = (row_max.squeeze(-1) + torch.log(denom)).t()
    return out.cpu(), lse.cpu()


def reference_sparse_request(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    context_len: int,
    dims: MLADims,
    topk_indices: torch.Tensor,
    *,
    score_elems: int = _SCORE_ELEMS,
    device: "torch.device | str | None" = None,
    kv_cache_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill (DeepSeek Sparse Attention) of ONE request, in float64: new token ``i`` attends only the
    keys its row of ``topk_indices`` names.

    The sequence is rebuilt and up-projected as :func:`reference_request` does (context from the paged cache, FP8
    dequantized exactly; then the new tokens; ``kv_b_proj`` into per-head ``k = [k_nope, k_pe]`` and ``v``: the MHA
    form, not the absorbed one the library computes). The scores ``q . k * softmax_scale`` of the picked keys enter
    a plain softmax over the picks alone: ``m = max``, ``p = exp(s - m)``, ``lse = m + log(sum p)`` (natural log),
    ``out = sum p * v[pick] / sum p``. A position listed twice counts twice (as :mod:`mla_bridge.sparse` says); -1
    marks no key; a row without keys gets out 0 and lse -inf. Queries go in blocks of at most ``score_elems`` float64
    scores (with two more buffers of that size: the picked scores and the weights scattered back onto the sequence).

    Args:
        q, kv_c, k_pe, kv_b_proj_weight, kv_cache, block_table_row, context_len, dims, score_elems, device,
            kv_cache_scale: as :func:`reference_request`.
        topk_indices: ``[L, K]`` integer, the picks of each new token as positions in the request's sequence
            (``0 .. context_len + i`` for new token ``i``), -1 for none.

    Returns:
        ``(out [L, H, v_head_dim] float64, lse [L, H] float64 natural log)``, on the CPU.

    Raises:
        ValueError: ``topk_indices`` not ``[L, K]``, or a pick below -1 or after its query's own position (the
            message names the row and the pick).
    """
    l_len = q.shape[0]
    if topk_indices.dim() != 2 or topk_indices.shape[0] != l_len:
        raise ValueError(f"topk_indices must be [L={l_len}, K], got {list(topk_indices.shape)}")
    dev = torch.device(q.device if device is None else device)
    idx_all = topk_indices.to(dev, torch.int64)
    own = context_len + torch.arange(l_len, device=dev)[:, None]
    bad = (idx_all < -1) | (idx_all > own)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"topk_indices[{row}, {col}] = {int(idx_all[row, col])} is outside [-1, {int(own[row, 0])}] (-1, or a "
            f"position up to the query's own)"
        )
    f64 = torch.float64
    r, rope, nope, dv, h = (
        dims.kv_lora_rank,
        dims.qk_rope_head_dim,
        dims.qk_nope_head_dim,
        dims.v_head_dim,
        dims.num_heads,
    )
    q = q.to(dev, f64)
    new_latent = torch.cat([kv_c.to(dev, f64), k_pe.reshape(k_pe.shape[0], rope).to(dev, f64)], dim=1)
    ctx_latent = gather_context_latent(kv_cache, block_table_row.to("cpu"), context_len, kv_cache_scale).to(dev, f64)
    latent = torch.cat([ctx_latent, new_latent], dim=0)  # [S, kv_lora_rank + rope], context first
    s_len = latent.shape[0]
    w = kv_b_proj_weight.to(dev, f64)
    kv = (latent[:, :r] @ w.t()).view(s_len, h, nope + dv)
    kh = torch.cat([kv[..., :nope], latent[:, None, r:].expand(s_len, h, rope)], dim=-1).permute(1, 2, 0)
    vh = kv[..., nope:].permute(1, 0, 2)  # [H, S, Dv]

    out = torch.zeros(l_len, h, dv, dtype=f64, device=dev)
    lse = torch.full((l_len, h), float("-inf"), dtype=f64, device=dev)
    k_top = idx_all.shape[1]
    block = max(1, score_elems // max(1, h * max(s_len, k_top)))
    for i0 in range(0, l_len, block):
        i1 = min(l_len, i0 + block)
        kv_end = context_len + i1  # no pick of this block lies beyond
        scores = torch.matmul(q[i0:i1].permute(1, 0, 2), kh[:, :, :kv_end]).mul_(dims.softmax_scale)  # [H, b, S]
        idx = idx_all[i0:i1]
        valid = (idx >= 0)[None].expand(h, -1, -1)
        safe = idx.clamp(min=0)[None].expand(h, -1, -1)  # [H, b, K]
        picked = scores.gather(-1, safe).masked_fill_(~valid, float("-inf"))
        row_max = picked.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)  # a row without keys
        p = picked.sub_(row_max).exp_()  # 0 at the -1 picks
        denom = p.sum(dim=-1)  # [H, b]
        weights = torch.zeros_like(scores).scatter_add_(-1, safe, p)  # a repeated pick adds up
        o = torch.matmul(weights, vh[:, :kv_end]) / torch.where(denom > 0, denom, 1.0).unsqueeze(-1)
        out[i0:i1] = o.permute(1, 0, 2)
        lse[i0:i1] = torch.where(denom > 0, row_max.squeeze(-1) + torch.log(denom), float("-inf")).t()
    return out.cpu(), lse.cpu()


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected|`` in float64 on the CPU (0.0 for empty tensors); NaN anywhere gives ``nan``."""
    if actual.numel() == 0:
        return 0.0
    diff = (actual.detach().to("cpu", torch.float64) - expected.detach().to("cpu", torch.float64)).abs()
    if torch.isnan(diff).any():
        return float("nan")
    return float(diff.max())


def max_excess_error(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> float:
    """``max(|actual - expected| - rtol * |expected|)`` in float64 on the CPU: a result is within
    ``atol + rtol * |expected|`` everywhere iff this is ``<= atol`` (``nan`` if NaN appears; -inf when empty)."""
    if actual.numel() == 0:
        return float("-inf")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    excess = (a - e).abs() - rtol * e.abs()
    if torch.isnan(excess).any():
        return float("nan")
    return float(excess.max())
