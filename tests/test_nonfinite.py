"""A NaN or inf in one token's input reaches only the rows that attend that token (torch backend, every schedule).

The contract the torch backend keeps (:mod:`mla_bridge.prefill`, "Non-finite inputs"): a non-finite value in the
k / v of one key (kv_c or k_pe of a new token, a context token's latent in the cache) makes ``out`` and ``lse``
non-finite in exactly the rows that can see that key (causal: the request's rows from that token on; a context token:
every row of its request), and a non-finite q makes its own row non-finite; every other row is bitwise what it is
without the bad value. A non-finite value in v alone leaves the LSE finite (it does not enter the softmax). The
FlashInfer backends are measured on the GPU (tests/gpu/test_gpu_nonfinite.py).
"""

from __future__ import annotations

import pytest
import torch

from mla_bridge import PrefillPlan, Workspace, mla_prefill, ragged_prefill
from mla_bridge.backends.torch_ref import ragged_attention_reference

NAN, INF = float("nan"), float("inf")
Q_LENS = [9, 4]


def finite_rows(x: torch.Tensor) -> list[bool]:
    return torch.isfinite(x.reshape(x.shape[0], -1)).all(-1).tolist()


def prefill(batch, c_lens, budget, fuse):
    plan = PrefillPlan.build(
        Q_LENS,
        c_lens,
        dims=batch.dims,
        workspace=Workspace("cpu", chunk_tokens=budget),
        block_size=batch.block_size,
        dtype=torch.float32,
        fuse_context=fuse,
    )
    assert plan.backend.name == "torch"
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    return plan, out, lse


SCHEDULES = [([0, 0], 100, True), ([5, 3], 100, True), ([5, 3], 100, False), ([5, 3], 4, True)]


@pytest.mark.parametrize("c_lens,budget,fuse", SCHEDULES)
@pytest.mark.parametrize("where,value", [("kv_c", NAN), ("kv_c", INF), ("k_pe", NAN)])
def test_bad_new_token_reaches_only_the_rows_that_attend_it(ref, tiny_dims, c_lens, budget, fuse, where, value):
    """Request 0 has 9 new tokens, token 6 carries a NaN / inf in kv_c (k and v of key 6 non-finite; inf times the
    weights' mixed signs gives NaN logits) or a NaN in k_pe (k alone): rows 6-8 are non-finite in out and lse, rows
    0-5 and request 1 bitwise as without it. Before, a NaN in kv_c[6, 0] made out non-finite in rows 0-8 (masked
    probabilities, 0, times the NaN value of key 6), lse in rows 6-8 only. (An infinite k_pe alone gives logits of
    +inf or -inf by the sign of q: -inf is a weight of 0, and such a row stays finite; see mla_bridge.prefill.)"""
    batch = ref.make_mla_batch(tiny_dims, Q_LENS, c_lens, 4, seed=1)
    _, clean_out, clean_lse = prefill(batch, c_lens, budget, fuse)
    getattr(batch, where)[6, 0] = value
    plan, out, lse = prefill(batch, c_lens, budget, fuse)
    assert plan.fused == (fuse and sum(c_lens) > 0 and sum(c_lens) <= budget)
    sees = [i >= 6 for i in range(9)] + [False] * 4
    assert finite_rows(out) == finite_rows(lse) == [not s for s in sees]
    keep = torch.tensor([not s for s in sees])
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.parametrize("c_lens,budget,fuse", SCHEDULES)
def test_nan_query_reaches_only_its_row(ref, tiny_dims, c_lens, budget, fuse):
    batch = ref.make_mla_batch(tiny_dims, Q_LENS, c_lens, 4, seed=2)
    _, clean_out, clean_lse = prefill(batch, c_lens, budget, fuse)
    batch.q[3, 1, 5] = NAN
    _, out, lse = prefill(batch, c_lens, budget, fuse)
    keep = torch.ones(13, dtype=torch.bool)
    keep[3] = False
    assert finite_rows(out) == finite_rows(lse) == keep.tolist()
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.parametrize("budget,fuse", [(100, True), (100, False), (4, True), (2, False)])
def test_nan_context_token_reaches_its_request_only(ref, tiny_dims, budget, fuse):
    """A NaN in request 0's cached context (position 3): every new token of request 0 attends it, request 1's do
    not (in the fused schedule and in every context chunk, also a chunk holding both requests' context)."""
    c_lens = [5, 3]
    batch = ref.make_mla_batch(tiny_dims, Q_LENS, c_lens, 4, seed=3)
    _, clean_out, clean_lse = prefill(batch, c_lens, budget, fuse)
    block, slot = divmod(3, batch.block_size)
    batch.cache[int(batch.block_table[0, block]), slot, 7] = NAN
    _, out, lse = prefill(batch, c_lens, budget, fuse)
    keep = torch.tensor([False] * 9 + [True] * 4)
    assert finite_rows(out) == finite_rows(lse) == keep.tolist()
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_bad_value_in_v_alone_leaves_the_lse_finite(ref, value):
    """v's non-finite value enters out only, in the rows that attend its key; the LSE (q and k alone) stays finite
    everywhere and equal to the clean one."""
    q, k, v, qo, kv = ref.make_ragged([9, 4], [12, 4], 2, 16, 8, seed=4)
    clean_out, clean_lse = ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.25, backend="torch")
    v[7, 1, 2] = value  # request 0, key 7: seen by rows 4-8 (bottom-right causal: row i sees keys <= i + 3)
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.25, backend="torch")
    keep = torch.tensor([i < 4 for i in range(9)] + [True] * 4)
    assert finite_rows(out) == keep.tolist() and finite_rows(lse) == [True] * 13
    assert torch.equal(lse, clean_lse) and torch.equal(out[keep], clean_out[keep])
    bad = out[~keep][:, 1, 2]  # only the channel holding the value, and only in head 1
    assert not torch.isfinite(bad).any() and torch.isfinite(out[~keep][:, 0]).all()
    if value == value:  # an infinity of one sign stays that infinity
        assert (bad == value).all()


def test_tiles_of_a_long_request(ref):
    """Several query blocks and key tiles (small score blocks): a NaN key at 200 of a 300-token causal request
    leaves rows 0-199 bitwise as without it, whichever tile they and the key fall in."""
    q, k, v, qo, kv = ref.make_ragged([300], [300], 2, 16, 8, seed=5)
    kw = dict(causal=True, sm_scale=0.25, block_elems=256 * 2 * 16)  # 16 keys per tile, 256 rows per block
    clean_out, clean_lse = ragged_attention_reference(q, k, v, qo, kv, **kw)
    k[200, 0, 0] = NAN
    v[200, 1, 0] = NAN
    out, lse = ragged_attention_reference(q, k, v, qo, kv, **kw)
    keep = torch.arange(300) < 200
    assert finite_rows(out) == finite_rows(lse) == keep.tolist()
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


def test_the_cuda_form_on_the_cpu(ref, tiny_dims, monkeypatch):
    """The branch-free form (what CUDA runs: no host check of the values) keeps the same contract, and on finite
    values gives the plain product's bits."""
    from mla_bridge.backends import torch_ref

    q, k, v, qo, kv = ref.make_ragged([300], [300], 2, 16, 8, seed=6)
    kw = dict(causal=True, sm_scale=0.25, block_elems=256 * 2 * 16)
    plain = ragged_attention_reference(q, k, v, qo, kv, **kw)
    monkeypatch.setattr(torch_ref, "_all_finite_on_host", lambda finite: False)
    branch_free = ragged_attention_reference(q, k, v, qo, kv, **kw)
    assert all(torch.equal(a, b) for a, b in zip(plain, branch_free))
    v[150, 0, 3] = INF
    v[150, 1, 4] = NAN
    v[151, 1, 4] = -INF
    v[152, 0, 3] = -INF
    out, lse = ragged_attention_reference(q, k, v, qo, kv, **kw)
    assert torch.equal(lse, plain[1]) and torch.equal(out[:150], plain[0][:150])
    assert (out[150:151, 0, 3] == INF).all() and out[152:, 0, 3].isnan().all() and out[150:, 1, 4].isnan().all()
    assert torch.isfinite(out[150:, 0, :3]).all() and torch.isfinite(out[150:, 1, 5:]).all()
    batch = ref.make_mla_batch(tiny_dims, Q_LENS, [5, 3], 4, seed=1)
    _, clean_out, clean_lse = prefill(batch, [5, 3], 100, True)
    batch.kv_c[6, 0] = NAN
    _, out, lse = prefill(batch, [5, 3], 100, True)
    keep = torch.tensor([i < 6 for i in range(9)] + [True] * 4)
    assert finite_rows(out) == finite_rows(lse) == keep.tolist()
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.parametrize("budget,fuse", [(100, True), (100, False), (4, True), (2, False)])
def test_a_positive_infinite_logit_is_not_merged_as_an_empty_partial(ref, tiny_dims, budget, fuse):
    """A +inf in the k_pe of request 0's cached context token 3, and request 0's q RoPE part positive: every row of
    request 0 has a +inf logit, so its softmax is undefined (inf - inf) and its out must come back non-finite in
    every schedule. The chunked schedule merges the context pass's partial, whose LSE is then +inf: a merge that read
    +inf as an empty partial (the FlashAttention-2 library's mark) dropped that pass and returned a finite out for
    rows that attend the bad key. Request 1 is bitwise as without it."""
    c_lens = [5, 3]
    batch = ref.make_mla_batch(tiny_dims, Q_LENS, c_lens, 4, seed=7)
    rope = tiny_dims.qk_rope_head_dim
    batch.q[:, :, -rope:] = batch.q[:, :, -rope:].abs() + 0.1
    _, clean_out, clean_lse = prefill(batch, c_lens, budget, fuse)
    block, slot = divmod(3, batch.block_size)
    batch.cache[int(batch.block_table[0, block]), slot, tiny_dims.kv_lora_rank] = INF  # k_pe[0] of context token 3
    _, out, lse = prefill(batch, c_lens, budget, fuse)
    bad = [True] * 9 + [False] * 4
    assert finite_rows(out) == [not b for b in bad]
    keep = torch.tensor([not b for b in bad])
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])
