"""mla_bridge.sparse_mha.sparse_attention_mha (sparse attention over per-head keys and values, the torch path) against
a float64 attention written from the indices key by key: -1 padding, rows without keys, a row listed twice, chunks
over queries (the union of their picks gathered once) and heads, strided inputs (views of transformers' [B, H, S, D]
tensors), bf16, out= / lse=, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from mla_bridge import sparse_mha
from mla_bridge.sparse_mha import sparse_attention_mha


def reference(q, k, v, idx, scale):
    """float64 ``(out [T, H, D_v], lse [T, H])``, one query and head at a time, over the listed rows (-1 skipped)."""
    t, h, _ = q.shape
    out = torch.zeros(t, h, v.shape[2], dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    for i in range(t):
        rows = [int(r) for r in idx[i] if int(r) >= 0]
        if not rows:
            continue
        for j in range(h):
            s = torch.stack([q[i, j].double() @ k[r, j].double() * scale for r in rows])
            lse[i, j] = torch.logsumexp(s, 0)
            p = torch.exp(s - lse[i, j])
            out[i, j] = sum(p[n] * v[r, j].double() for n, r in enumerate(rows))
    return out, lse


def inputs(t=7, s=11, h=3, d_qk=12, d_v=8, kk=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for n, d in ((t, d_qk), (s, d_qk), (s, d_v)))
    idx = torch.stack([torch.randperm(s, generator=g)[:kk] for _ in range(t)]).to(torch.int32)
    idx[1, 2:] = -1  # fewer picks than K
    idx[3] = -1  # no key at all
    idx[5, 1] = idx[5, 0]  # a row listed twice is attended twice
    return q, k, v, idx


@pytest.mark.parametrize(
    "chunk_elems,chunk_queries",
    [(1 << 22, 64), (1, 64), (600, 3)],  # one chunk; one query and one head a chunk; 3 queries, 1 or 2 heads a chunk
)
def test_equals_float64_reference(monkeypatch, chunk_elems, chunk_queries):
    monkeypatch.setattr(sparse_mha, "SPARSE_MHA_CHUNK_ELEMS", chunk_elems)
    monkeypatch.setattr(sparse_mha, "SPARSE_MHA_CHUNK_QUERIES", chunk_queries)
    q, k, v, idx = inputs()
    out, lse = sparse_attention_mha(q, k, v, idx, 0.3, return_lse=True)
    want, want_lse = reference(q, k, v, idx, 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and bool(torch.isneginf(lse[3]).all())
    twice = idx[5].clone()
    twice[1] = -1  # without the repeat the row differs
    assert (reference(q[5:6], k, v, twice[None], 0.3)[0][0] - want[5]).abs().max() > 1e-3


def test_reads_strided_views_and_writes_out():
    """transformers' ``[B, H, S, D]`` batch row viewed as ``[S, H, D]`` (not contiguous), int64 indices, out= / lse=
    slices of bigger tensors."""
    g = torch.Generator().manual_seed(1)
    qb, kb, vb = (
        torch.randn(2, 3, 6, 12, generator=g),
        torch.randn(2, 3, 9, 12, generator=g),
        torch.randn(2, 3, 9, 8, generator=g),
    )
    idx = torch.randint(-1, 9, (6, 4), generator=g)
    q, k, v = qb[1].transpose(0, 1), kb[1].transpose(0, 1), vb[1].transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous()
    full, lse = torch.zeros(2, 6, 3, 8), torch.zeros(2, 6, 3)
    got = sparse_attention_mha(q, k, v, idx, 0.25, out=full[1], lse=lse[1])
    assert got.data_ptr() == full[1].data_ptr()
    want, want_lse = reference(q, k, v, idx, 0.25)
    torch.testing.assert_close(full[1].double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse[1].double(), want_lse, atol=1e-6, rtol=1e-5)
    assert torch.equal(full[0], torch.zeros_like(full[0]))


def test_bf16_is_float32_arithmetic_rounded_once():
    """bf16 inputs: the result within one bf16 rounding (2 ** -8 relative) of the float64 attention of those inputs."""
    q, k, v, idx = inputs(dtype=torch.bfloat16, seed=2)
    out = sparse_attention_mha(q, k, v, idx, 0.3)
    assert out.dtype == torch.bfloat16
    want, _ = reference(q, k, v, idx, 0.3)
    assert ((out.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


def test_no_queries_and_no_picks():
    q, k, v, idx = inputs()
    out = sparse_attention_mha(q[:0], k, v, idx[:0], 0.3)
    assert out.shape == (0, 3, 8)
    out, lse = sparse_attention_mha(q, k, v, idx[:, :0], 0.3, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(idx=lambda x: x.float()), TypeError, "topk_indices must be int32 or int64"),
        (dict(idx=lambda x: x[:, None]), ValueError, r"topk_indices must be \[T=7, K\]"),
        (dict(idx=lambda x: x.index_fill(1, torch.tensor([0]), 11)), ValueError, r"topk_indices\[0, 0\] = 11 is past"),
        (dict(idx=lambda x: x.index_fill(1, torch.tensor([0]), -2)), ValueError, r"topk_indices\[0, 0\] = -2 is below"),
        (dict(k=lambda x: x[:, :2]), ValueError, r"key must be \[S, 3, 12\]"),
        (dict(v=lambda x: x[:5]), ValueError, "value must be"),
        (dict(q=lambda x: x[0]), ValueError, "query must be 3-D"),
        (dict(k=lambda x: x.int()), TypeError, "key must be a floating-point"),
        (dict(out=torch.empty(7, 3, 9)), ValueError, "out must be"),
        (dict(lse=torch.empty(7, 3, dtype=torch.float64)), ValueError, "lse must be"),
        (dict(scale=0.0), ValueError, "sm_scale"),
        (dict(scale=math.nan), ValueError, "sm_scale"),
    ],
)
def test_refusals_name_the_argument(change, error, match):
    q, k, v, idx = inputs()
    q, k, v, idx = (change.get(n, lambda x: x)(x) for n, x in (("q", q), ("k", k), ("v", v), ("idx", idx)))
    with pytest.raises(error, match=match):
        sparse_attention_mha(q, k, v, idx, change.get("scale", 0.3), out=change.get("out"), lse=change.get("lse"))
