"""Sparse attention in the MHA (unabsorbed) form: each query attends only the key rows its ``topk_indices`` row lists.

This is DeepSeek Sparse Attention (DSA) for callers that hold per-head keys and values (``k = [k_nope, k_pe]`` and
``v`` already up-projected through ``kv_b_proj``) rather than the latent cache: transformers' DSA attention
(``DeepseekV32Attention``, GLM-5's) hands its attention function that form, with the indexer's top-k as ``indices=``.
:func:`mla_bridge.mla_prefill` with ``topk_indices=`` (:mod:`mla_bridge.sparse`) is the absorbed (MQA) pass over the
latent cache, which reads a query's selected rows once for all heads; this pass reads them per head (``H x
(qk_head_dim + v_head_dim)`` values per selected key instead of ``kv_lora_rank + qk_rope_head_dim``), so it is the
slower form of the same function, kept for the callers that have no latents.

**Indices.** ``topk_indices`` int32 or int64 ``[T, K]``: row ``t`` lists key rows of ``key`` / ``value`` (``0 ..
S - 1``) that query ``t`` attends; ``-1`` marks no key. The order within a row does not matter; a row listed twice is
attended twice (as FlashMLA's sparse kernel does; an indexer's top-k never lists one twice). Nothing here knows about
positions or causality: a caller whose indices hold picks its mask drops (transformers' do, for early and padding
queries) turns them into -1 first. On the CPU a row below -1 or past ``S`` is refused by name; on CUDA that is the
caller's contract (checking would synchronize the host), as ``block_table`` ids are for dense prefill.

**Arithmetic**: float32 (the selected rows gathered in the inputs' dtype, then read as float32), ``score = q . k *
sm_scale``, softmax over the selected keys, ``out`` rounded once to the query's dtype; the LSE is the natural log of
the sum of the exponentials of the scaled scores, float32. A query with no key (a row of -1) gets out 0 and lse -inf,
the dense passes' convention for a row without keys.

**The pass.** Queries go in chunks of ``n`` (at most :data:`SPARSE_MHA_CHUNK_QUERIES`): the union of the chunk's
picks (``u`` distinct key rows, at most ``min(n x K, S)``; an indexer's picks of neighbouring queries overlap) is
gathered once per head, head-major from the ``[H, S, D]`` layout transformers' tensors have, the scores of every
query of the chunk against every row of the union are one matrix product per head (``[n, D_qk] x [D_qk, u]``), and
each query's own picks are selected by adding ``log(count)`` (0 for a row listed once, ``log 2`` twice, -inf for a
row it does not list) before the softmax; ``P @ V`` is a matrix product too. That is exact (a row a query does not
list gets probability 0) and runs at matrix-product speed, where gathering ``K`` rows per query and head would run
batched matrix-vector products over ``n x K`` gathered rows.

**Memory** is bounded per chunk: ``n`` is the largest power of two up to :data:`SPARSE_MHA_CHUNK_QUERIES` whose
worst-case union fits one head's budget (``min(n x K, S) x (n + D_qk + D_v) <= SPARSE_MHA_CHUNK_ELEMS``, one query at
least), and heads go ``h`` at a time with ``h x u x (n + D_qk + D_v) <= SPARSE_MHA_CHUNK_ELEMS`` (one head at least):
per chunk the union's keys and values in the inputs' dtype and as float32 and the scores and probabilities,
``[h, n, u]`` float32 (twice), plus the ``[n, u]`` counts. A call never holds the ``[T, K, H, D]`` selected keys of all
queries.

**Speed.** The torch path on every device (no fused kernel: a correct fallback on CUDA, not a fast one; there each
chunk's ``torch.unique`` waits for the device, so a call synchronizes the host once per chunk and is not captured in a
CUDA graph). On the CPU
it is faster than dense attention with the top-k folded into a mask at every ratio of keys to picks measured
(docs/design/sparse.md gives the figures).
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import as_sm_scale

__all__ = ["SPARSE_MHA_CHUNK_ELEMS", "SPARSE_MHA_CHUNK_QUERIES", "sparse_attention_mha"]

#: float32 elements per chunk of queries and heads: ``h x u x (n + qk_head_dim + v_head_dim)`` (the union's keys and
#: values and the scores, module docstring); 1 << 24 are 64 MiB.
SPARSE_MHA_CHUNK_ELEMS = 1 << 24
#: Queries per chunk at most (fewer where the worst-case union of their picks would not fit one head's budget).
SPARSE_MHA_CHUNK_QUERIES = 64


def _check(query, key, value, topk_indices, out, lse) -> None:
    for name, x in (("query", query), ("key", key), ("value", value), ("topk_indices", topk_indices)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D [tokens, heads, dim], got shape {list(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.device != query.device:
            raise ValueError(f"{name} is on {x.device}, but query is on {query.device}")
    t, h, d_qk = query.shape
    if key.shape[1:] != (h, d_qk):
        raise ValueError(f"key must be [S, {h}, {d_qk}] (query's heads and dim), got {list(key.shape)}")
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(f"value must be [{key.shape[0]}, {h}, D_v] (key's rows and heads), got {list(value.shape)}")
    if topk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices must be int32 or int64 (key rows, -1 for none), got {topk_indices.dtype}")
    if topk_indices.dim() != 2 or topk_indices.shape[0] != t:
        raise ValueError(f"topk_indices must be [T={t}, K], got {list(topk_indices.shape)}")
    if topk_indices.device != query.device:
        raise ValueError(f"topk_indices is on {topk_indices.device}, but query is on {query.device}")
    for name, x, shape, dtype in (
        ("out", out, (t, h, value.shape[2]), query.dtype),
        ("lse", lse, (t, h), torch.float32),
    ):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != dtype):
            raise ValueError(
                f"{name} must be a {dtype} tensor of shape {list(shape)}, got "
                f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}"
            )
        if x is not None and x.device != query.device:
            raise ValueError(f"{name} is on {x.device}, but query is on {query.device}")
    if topk_indices.device.type == "cpu" and topk_indices.numel():
        bad = (topk_indices < -1) | (topk_indices >= key.shape[0])
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            p = int(topk_indices[row, col])
            why = "below -1 (-1 marks no key)" if p < -1 else f"past the {key.shape[0]} rows of key / value"
            raise ValueError(f"topk_indices[{row}, {col}] = {p} is {why}")


def sparse_attention_mha(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk_indices: torch.Tensor,
    sm_scale,
    *,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """Sparse attention over per-head keys and values (module docstring), the torch path.

    Args:
        query: ``[T, H, D_qk]`` floating point, any strides.
        key: ``[S, H, D_qk]``, value ``[S, H, D_v]``: the rows ``topk_indices`` names, any strides (a view of
            transformers' ``[B, H, S, D]`` tensors' batch row is read in place), any floating dtype.
        topk_indices: int32 / int64 ``[T, K]``: rows of key / value per query, -1 for none.
        sm_scale: the softmax scale (positive finite float).
        out: ``[T, H, D_v]`` in query's dtype to write into, or None. lse: ``[T, H]`` float32 to write the LSE into,
            or None (then made where ``return_lse``).
        return_lse: also return the LSE.

    Returns:
        ``out [T, H, D_v]`` in query's dtype, or ``(out, lse)`` with ``return_lse`` (``lse [T, H]`` float32, natural
        log; -inf for a row without keys).

    Raises:
        TypeError: a tensor argument not a tensor; query / key / value not floating point; topk_indices not int32 or
            int64. ValueError: shapes other than above, tensors on another device than query, out / lse of another
            shape or dtype; on the CPU a topk_indices entry below -1 or past S (named by row and column). All before
            any work.
    """
    _check(query, key, value, topk_indices, out, lse)
    scale = as_sm_scale(sm_scale)
    t, h, d_qk = query.shape
    d_v, kk = value.shape[2], topk_indices.shape[1]
    if out is None:
        out = torch.empty(t, h, d_v, dtype=query.dtype, device=query.device)
    if lse is None and return_lse:
        lse = torch.empty(t, h, dtype=torch.float32, device=query.device)
    if t == 0:
        return (out, lse) if return_lse else out
    if kk == 0 or key.shape[0] == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out
    s_rows = key.shape[0]
    step = SPARSE_MHA_CHUNK_QUERIES  # queries per chunk: the most whose worst-case union fits one head's budget
    while step > 1 and min(step * kk, s_rows) * (step + d_qk + d_v) > SPARSE_MHA_CHUNK_ELEMS:
        step //= 2
    key_hm, value_hm = key.transpose(0, 1), value.transpose(0, 1)  # [H, S, D]: transformers' own layout
    for a in range(0, t, step):
        b = min(t, a + step)
        n = b - a
        idx = topk_indices[a:b].long()  # [n, K]
        valid = idx >= 0
        # the chunk's picks, each key row once (sorted), and how many times each query lists each of them
        rows, which = torch.unique(idx[valid], return_inverse=True)
        u = rows.numel()
        if u == 0:  # no query of the chunk has a key
            out[a:b] = 0
            if lse is not None:
                lse[a:b] = float("-inf")
            continue
        count = torch.zeros(n, u, dtype=torch.float32, device=query.device)
        query_of = torch.arange(n, device=query.device)[:, None].expand(n, kk)[valid]
        count.index_put_((query_of, which), torch.ones_like(which, dtype=torch.float32), accumulate=True)
        bias = count.log_()  # 0 where listed once, log 2 twice (attended twice), -inf where not listed
        has_keys = valid.any(dim=-1)[:, None]  # [n, 1]
        heads = max(1, min(h, SPARSE_MHA_CHUNK_ELEMS // max(1, u * (n + d_qk + d_v))))
        for h0 in range(0, h, heads):
            h1 = min(h, h0 + heads)
            k_sel = key_hm[h0:h1].index_select(1, rows).float()  # [h, u, D_qk]
            v_sel = value_hm[h0:h1].index_select(1, rows).float()  # [h, u, D_v]
            q_c = query[a:b, h0:h1].transpose(0, 1).float()  # [h, n, D_qk]
            s = torch.matmul(q_c, k_sel.transpose(-1, -2)).mul_(scale).add_(bias)  # [h, n, u]
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # a row without keys: exp(-inf) = 0
            e = torch.exp(s.sub_(m))
            total = e.sum(dim=-1)  # [h, n]
            o = torch.matmul(e, v_sel)  # [h, n, D_v]
            o = o / torch.where(has_keys[:, 0], total, 1.0)[..., None]
            out[a:b, h0:h1] = o.transpose(0, 1).to(out.dtype)
            if lse is not None:
                lse[a:b, h0:h1] = torch.where(
                    has_keys[:, 0], m.squeeze(-1) + torch.log(total), float("-inf")
                ).transpose(0, 1)
    return (out, lse) if return_lse else out
