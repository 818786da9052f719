"""Shared sparse attention cases for the tests: a mixed batch, random valid causal picks, and a float64 sparse
attention written from the indices in the UNABSORBED form (k = [k_nope from the kv_b_proj up-projection, k_pe], v
up-projected, a softmax over the selected keys only), independent of the library's absorption and gather."""

from __future__ import annotations

import torch

from mla_bridge import PrefillPlan, Workspace

ATOL = 3e-5

# A mixed batch: requests without context, one without new tokens, one whose context spans several blocks of 64.
QUERY_LENS = [3, 4, 1, 0, 5, 2]
CONTEXT_LENS = [0, 37, 5, 9, 70, 0]


def own_positions(query_lens, context_lens):
    """Each new token's position in its request's sequence (the last one it may pick)."""
    return [c + j for q, c in zip(query_lens, context_lens) for j in range(q)]


def random_indices(query_lens, context_lens, k, *, seed=0, fill=1.0, allow_empty=False):
    """int32 [T, k]: per new token at most min(k, own + 1) distinct causal picks (``fill``: the share of that maximum,
    at least one unless ``allow_empty``), the rest -1, at shuffled places in the row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for own in own_positions(query_lens, context_lens):
        most = min(k, own + 1)
        lo = 0 if allow_empty else 1
        m = most if fill >= 1.0 else int(torch.randint(lo, max(lo, int(most * fill)) + 1, (1,), generator=g))
        picks = torch.randperm(own + 1, generator=g)[:m]
        row = torch.full((k,), -1, dtype=torch.int32)
        row[torch.randperm(k, generator=g)[:m]] = picks.to(torch.int32)
        rows.append(row)
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int32)


def sparse_reference(batch, indices, cache=None):
    """float64 sparse attention, unabsorbed: each request's sequence latents (context read back from the paged
    ``cache`` through block_table token by token, new tokens from kv_c / k_pe), up-projected with kv_b_proj into
    per-head k = [k_nope, k_pe] and v; row t attends the keys its indices name (-1 skipped; a repeated position
    counts each time). Returns out [T, H, v_head_dim], lse [T, H] (natural log; -inf and out 0 without keys), on
    the CPU; the batch may be on another device (the GPU tests compute it there), the indices on the CPU."""
    d = batch.dims
    h, nope, vdim, rank = d.num_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    w = batch.w.double()
    cache = (batch.cache if cache is None else cache).double()
    t_all = sum(batch.query_lens)
    out = torch.zeros(t_all, h, vdim, dtype=torch.float64)
    lse = torch.full((t_all, h), float("-inf"), dtype=torch.float64)
    row = 0
    for r, (n, c) in enumerate(zip(batch.query_lens, batch.context_lens)):
        bs = batch.block_size
        ctx = [cache[int(batch.block_table[r, p // bs]), p % bs] for p in range(c)]
        ctx_t = torch.stack(ctx) if ctx else torch.zeros(0, d.latent_dim, dtype=torch.float64, device=cache.device)
        new = torch.cat([batch.kv_c[row : row + n].double(), batch.k_pe[row : row + n].double()], 1)
        latent = torch.cat([ctx_t, new])
        kv = (latent[:, :rank] @ w.t()).view(-1, h, nope + vdim)
        k = torch.cat([kv[..., :nope], latent[:, rank:].unsqueeze(1).expand(-1, h, -1)], -1)
        v = kv[..., nope:]
        for j in range(n):
            picks = [int(p) for p in indices[row + j] if p >= 0]
            if picks:
                q = batch.q[row + j].double()  # [H, 192]
                s = torch.einsum("hd,mhd->hm", q, k[picks]) * d.softmax_scale
                lse[row + j] = torch.logsumexp(s, -1)
                out[row + j] = torch.einsum("hm,mhv->hv", torch.softmax(s, -1), v[picks])
        row += n
    return out, lse


def plan_for(dims, query_lens, context_lens, block_size, k, *, dtype=torch.float32, chunk_tokens=None, **kw):
    ws = Workspace("cpu") if chunk_tokens is None else Workspace("cpu", chunk_tokens=chunk_tokens)
    return PrefillPlan.build(
        query_lens, context_lens, dims=dims, workspace=ws, block_size=block_size, dtype=dtype, index_topk=k, **kw
    )
