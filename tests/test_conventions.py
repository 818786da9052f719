"""Conventions the documentation states (docs/guide/conventions.md, README), checked on the CPU.

- ``block_table``: only the first ``ceil(context_lens[r] / block_size)`` entries of row ``r`` are read; the entries
  past them may hold anything (vLLM pads with -1), in the fused and the chunked schedule alike.
- ``kv_b_proj.weight`` rows: per head, the ``qk_nope_head_dim`` k_nope rows, then the ``v_head_dim`` v rows.
"""

from __future__ import annotations

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill

DIMS = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, softmax_scale=0.2)


def _inputs(q_lens, c_lens, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, d = sum(q_lens), DIMS
    blocks = [-(-c // block_size) for c in c_lens]
    q = torch.randn(t, d.num_heads, d.qk_nope_head_dim + d.qk_rope_head_dim, generator=g)
    kv_c = torch.randn(t, d.kv_lora_rank, generator=g)
    k_pe = torch.randn(t, d.qk_rope_head_dim, generator=g)
    w = torch.randn(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g) / 6
    cache = torch.randn(sum(blocks) + 3, block_size, d.kv_lora_rank + d.qk_rope_head_dim, generator=g)
    width = max(blocks) + 4  # room past every request's used blocks
    table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.arange(start, start + n, dtype=torch.int32).flip(0)  # any order
        start += n
    return q, kv_c, k_pe, w, cache, table, blocks


@pytest.mark.parametrize("fuse", [True, False])
def test_block_table_entries_past_the_used_blocks_are_never_read(fuse):
    q_lens, c_lens, bs = [5, 3, 4], [9, 0, 16], 4
    q, kv_c, k_pe, w, cache, table, blocks = _inputs(q_lens, c_lens, bs)
    ws = Workspace("cpu", chunk_tokens=64 if fuse else 8)  # fused: one pass; else 25 context tokens in 4 chunks
    plan = PrefillPlan.build(
        q_lens, c_lens, dims=DIMS, workspace=ws, block_size=bs, dtype=torch.float32, fuse_context=fuse
    )
    assert plan.fused == fuse and (fuse or len(plan.chunks) >= 3)
    out, lse = mla_prefill(q, kv_c, k_pe, w, cache, table, plan, return_lse=True)
    garbage = table.clone()
    for r, n in enumerate(blocks):
        garbage[r, n:] = torch.tensor([-1, 2**31 - 1, -(2**31), cache.shape[0]] * 4, dtype=torch.int32)[
            : garbage.shape[1] - n
        ]
    out2, lse2 = mla_prefill(q, kv_c, k_pe, w, cache, garbage, plan, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert bool(torch.isfinite(out).all())


def test_a_used_block_id_out_of_range_is_refused_on_the_cpu():
    q_lens, c_lens, bs = [2], [5], 4
    q, kv_c, k_pe, w, cache, table, _ = _inputs(q_lens, c_lens, bs)
    plan = PrefillPlan.build(q_lens, c_lens, dims=DIMS, workspace=Workspace("cpu"), block_size=bs, dtype=torch.float32)
    table[0, 1] = -1  # the second of the two used blocks
    with pytest.raises(ValueError, match="block_table row 0"):
        mla_prefill(q, kv_c, k_pe, w, cache, table, plan)


def test_kv_b_proj_rows_are_k_nope_then_v_per_head():
    """A request without context attends to its own tokens only: k = [kv_c @ W_k_nope(h).T | k_pe] and
    v = kv_c @ W_v(h).T with W_k_nope(h) = rows h*(n+v) .. h*(n+v)+n-1 and W_v(h) the next v_head_dim rows."""
    q_lens = [6]
    q, kv_c, k_pe, w, cache, table, _ = _inputs(q_lens, [0], 4)
    plan = PrefillPlan.build(q_lens, [0], dims=DIMS, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32)
    out = mla_prefill(q, kv_c, k_pe, w, cache, table, plan)
    d = DIMS
    per_head = w.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    w_k, w_v = per_head[:, : d.qk_nope_head_dim], per_head[:, d.qk_nope_head_dim :]
    k_nope = torch.einsum("tc,hnc->thn", kv_c, w_k)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, d.num_heads, -1)], dim=-1)
    v = torch.einsum("tc,hvc->thv", kv_c, w_v)
    s = torch.einsum("thd,shd->hts", q.double(), k.double()) * d.softmax_scale
    s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hts,shv->thv", s.softmax(-1), v.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
