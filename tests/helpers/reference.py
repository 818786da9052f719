"""Independent float64 references (dense attention with an explicit mask, MLA prefill over the whole sequence rebuilt
from the paged cache) and builders of random inputs. Nothing here calls mla_bridge's kernels. Tests reach them
through the ``ref`` fixture (tests/conftest.py) or import them from here."""

from __future__ import annotations

import types
from typing import Sequence

import torch


TINY = dict(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def cumsum0(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


def dense_attention(q, k, v, sm_scale: float, mask=None):
    """One request, float64: q [Lq,H,D], k [Lk,H,D], v [Lk,H,Dv], mask [Lq,Lk] bool (True = visible).

    Returns out [Lq,H,Dv] and natural-log lse [Lq,H]; rows that see no key give out 0 and lse -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    lq, h = q.shape[0], q.shape[1]
    lk = k.shape[0]
    f64 = dict(dtype=torch.float64, device=q.device)
    if lq == 0:
        return torch.zeros(0, h, v.shape[-1], **f64), torch.zeros(0, h, **f64)
    if lk == 0:
        return torch.zeros(lq, h, v.shape[-1], **f64), torch.full((lq, h), float("-inf"), **f64)
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device).unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf where nothing is visible
    finite = torch.isfinite(lse)
    p = torch.where(
        finite.unsqueeze(-1), torch.exp(scores - torch.where(finite, lse, 0.0).unsqueeze(-1)), torch.zeros_like(scores)
    )
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse.t().contiguous()


def bottom_right_mask(lq: int, lk: int) -> torch.Tensor:
    """Query i sees key j iff j <= i + lk - lq (FlashInfer's bottom-right alignment), as a dense bool mask."""
    i = torch.arange(lq).view(-1, 1)
    j = torch.arange(lk).view(1, -1)
    return j <= i + (lk - lq)


def ragged_reference(q, k, v, qo_indptr, kv_indptr, *, causal: bool, sm_scale: float):
    """Loop over requests, float64 dense attention each (on the inputs' device): out [T,H,Dv], lse [T,H]
    (natural log), returned on the CPU."""
    qo = [int(x) for x in qo_indptr]
    kv = [int(x) for x in kv_indptr]
    t, h = q.shape[0], q.shape[1]
    out = torch.zeros(t, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    for r in range(len(qo) - 1):
        qa, qb, ka, kb = qo[r], qo[r + 1], kv[r], kv[r + 1]
        mask = bottom_right_mask(qb - qa, kb - ka) if causal else None
        o, s = dense_attention(q[qa:qb], k[ka:kb], v[ka:kb], sm_scale, mask)
        out[qa:qb], lse[qa:qb] = o.cpu(), s.cpu()
    return out, lse


def make_ragged(q_lens, kv_lens, heads, d_qk, d_vo, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(kv_lens)
    q = (torch.randn(t, heads, d_qk, generator=g) * scale).to(dtype)
    k = (torch.randn(s, heads, d_qk, generator=g) * scale).to(dtype)
    v = torch.randn(s, heads, d_vo, generator=g).to(dtype)
    return q, k, v, cumsum0(q_lens), cumsum0(kv_lens)


class MLABatch(types.SimpleNamespace):
    """Random inputs of one MLA prefill batch with its paged cache (see :func:`make_mla_batch`)."""


def make_mla_batch(
    dims,
    query_lens,
    context_lens,
    block_size,
    *,
    dtype=torch.float32,
    seed=0,
    shuffle=True,
    spare_blocks=3,
    device="cpu",
):
    """New tokens' q / kv_c / k_pe, kv_b_proj weight, and a paged latent cache holding each request's context.

    Blocks are assigned in a random order (``shuffle``); spare blocks, the unused tail of each request's last
    block and block_table padding (-1) are poisoned (NaN / out-of-range ids) so that reading anything but the
    context shows up as a wrong value. The per-request context latents are kept unpaged in ``ctx_latent``.
    """
    g = torch.Generator().manual_seed(seed)
    h, rank, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    t = sum(query_lens)
    q = torch.randn(t, h, dims.head_dim_qk, generator=g)
    kv_c = torch.randn(t, rank, generator=g)
    k_pe = torch.randn(t, rope, generator=g)
    w = torch.randn(dims.kv_b_proj_shape, generator=g) * rank**-0.5
    ctx_latent = [torch.randn(c, dims.latent_dim, generator=g) for c in context_lens]
    blocks_per_req = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist() if shuffle else list(range(num_blocks))
    cache = torch.full((num_blocks, block_size, dims.latent_dim), float("nan"))
    max_blocks = max(blocks_per_req + [1]) + 1
    table = torch.full((len(query_lens), max_blocks), -1, dtype=torch.int32)
    nxt = 0
    for r, c in enumerate(context_lens):
        for b in range(blocks_per_req[r]):
            blk = order[nxt]
            nxt += 1
            table[r, b] = blk
            n = min(block_size, c - b * block_size)
            cache[blk, :n] = ctx_latent[r][b * block_size : b * block_size + n]
    cast = lambda x: x.to(dtype=dtype, device=device)  # noqa: E731
    return MLABatch(
        q=cast(q),
        kv_c=cast(kv_c),
        k_pe=cast(k_pe),
        w=cast(w),
        cache=cast(cache),
        block_table=table.to(device),
        ctx_latent=[cast(x) for x in ctx_latent],
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_size=block_size,
        dims=dims,
    )


def mla_reference(batch: MLABatch, *, use_cache: bool = True):
    """Each request's new tokens over its whole sequence (context + new), float64, unchunked.

    The context is read back from the paged cache through block_table one token at a time (``use_cache``), the
    latent is up-projected with kv_b_proj (k = concat(k_nope, k_pe broadcast over heads), v), and the mask allows
    every context key plus causal among the new tokens. Returns out [T,H,v_head_dim], lse [T,H] (natural log).
    """
    d = batch.dims
    h, nope, vdim, rank = d.num_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    w = batch.w.double().cpu()
    t = sum(batch.query_lens)
    out = torch.zeros(t, h, vdim, dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    qo = cumsum0(batch.query_lens)
    cache = batch.cache.double().cpu()
    table = batch.block_table.cpu()
    for r, (n, c) in enumerate(zip(batch.query_lens, batch.context_lens)):
        if use_cache:
            rows = [cache[int(table[r, p // batch.block_size]), p % batch.block_size] for p in range(c)]
            ctx = torch.stack(rows) if rows else torch.zeros(0, d.latent_dim, dtype=torch.float64)
        else:
            ctx = batch.ctx_latent[r].double().cpu()
        new = torch.cat([batch.kv_c[qo[r] : qo[r + 1]].double().cpu(), batch.k_pe[qo[r] : qo[r + 1]].double().cpu()], 1)
        latent = torch.cat([ctx, new], 0)  # [c + n, rank + rope]
        kv = (latent[:, :rank] @ w.t()).view(-1, h, nope + vdim)
        k = torch.cat([kv[..., :nope], latent[:, rank:].unsqueeze(1).expand(-1, h, -1)], -1)
        v = kv[..., nope:]
        mask = torch.zeros(n, c + n, dtype=torch.bool)
        mask[:, :c] = True
        for i in range(n):
            mask[i, c : c + i + 1] = True
        o, s = dense_attention(batch.q[qo[r] : qo[r + 1]].double().cpu(), k, v, d.softmax_scale, mask)
        out[qo[r] : qo[r + 1]], lse[qo[r] : qo[r + 1]] = o, s
    return out, lse


def assert_lse_close(actual, expected, atol, rtol=0.0):
    """lse equality that also requires -inf exactly where the reference has -inf."""
    actual = actual.double().cpu()
    expected = expected.double().cpu()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not torch.isnan(actual).any(), "lse has NaN"
    inf_exp = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf_exp), "lse is +-inf in different places than the reference"
    assert torch.equal(actual[inf_exp], expected[inf_exp])
    torch.testing.assert_close(actual[~inf_exp], expected[~inf_exp], atol=atol, rtol=rtol)


def assert_out_close(actual, expected, atol, rtol=0.0):
    actual = actual.double().cpu()
    assert not torch.isnan(actual).any(), "out has NaN"
    torch.testing.assert_close(actual, expected.double().cpu(), atol=atol, rtol=rtol)
