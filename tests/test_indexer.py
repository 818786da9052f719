"""The reference lightning indexer (mla_bridge.indexer) against transformers' own DeepseekV32Indexer on seeded random
weights (a small index_topk): the same picks per query, transformers' masked picks (non-causal positions returned by
the top-k of an early query) coming back as -1; and its picks drive mla_prefill's sparse pass."""

from __future__ import annotations

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill
from mla_bridge.indexer import IndexerWeights, indexer_topk

m = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config  # noqa: E402

TOPK = 6


def config(**kw):
    args = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=TOPK,
        num_hidden_layers=1,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
    )
    args.update(kw)
    return DeepseekV32Config(**args)


def indexer_module(cfg, seed=0):
    torch.manual_seed(seed)
    ix = m.DeepseekV32Indexer(cfg, 0)
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_(0, 0.3)
    return ix.eval()


def transformers_picks(ix, rotary, hidden, q_resid):
    """transformers' indices for one sequence ([S, topk]) under a causal bool mask."""
    s = hidden.shape[0]
    pos = torch.arange(s)[None]
    cos_sin = rotary(hidden[None], pos)
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None]
    return ix(hidden[None], q_resid[None], cos_sin, mask, pos)[0], cos_sin


def valid_sets(rows, own):
    return [sorted(int(p) for p in row if 0 <= p <= o) for row, o in zip(rows, own)]


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_same_picks_as_transformers(rope_type):
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    if rope_type == "yarn":
        rope = {
            "rope_theta": 10000.0,
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    cfg = config(rope_parameters=rope)
    ix = indexer_module(cfg, seed=1)
    rotary = m.DeepseekV32RotaryEmbedding(cfg)
    w = IndexerWeights.from_module(ix)
    g = torch.Generator().manual_seed(2)
    seq_lens, context_lens = [13, 4, 9, 20], [5, 0, 9, 3]  # request 2: no new tokens
    hs = [torch.randn(s, cfg.hidden_size, generator=g) for s in seq_lens]
    qr = [torch.randn(s, cfg.q_lora_rank, generator=g) for s in seq_lens]
    expected, embeddings, own = [], [], []
    for h, q, c in zip(hs, qr, context_lens):
        picks, (cos, sin) = transformers_picks(ix, rotary, h, q)
        expected += list(picks[c:])
        embeddings.append((cos[0], sin[0]))
        own += list(range(c, h.shape[0]))
    got = indexer_topk(w, hs, qr, embeddings, context_lens, TOPK)
    assert got.dtype == torch.int32 and got.shape == (sum(seq_lens) - sum(context_lens), TOPK)
    assert valid_sets(got, own) == valid_sets(expected, own)
    # every pick is causal or -1; a query at position p has min(TOPK, p + 1) picks
    assert all(((row == -1) | ((row >= 0) & (row <= o))).all() for row, o in zip(got, own))
    assert [int((row >= 0).sum()) for row in got] == [min(TOPK, o + 1) for o in own]


def test_picks_drive_the_sparse_pass(ref):
    """The indexer's output is mla_prefill's topk_indices format as it is."""
    cfg = config()
    ix = indexer_module(cfg, seed=3)
    rotary = m.DeepseekV32RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(4)
    query_lens, context_lens = [4, 7], [9, 3]
    hs = [torch.randn(q + c, cfg.hidden_size, generator=g) for q, c in zip(query_lens, context_lens)]
    qr = [torch.randn(q + c, cfg.q_lora_rank, generator=g) for q, c in zip(query_lens, context_lens)]
    emb = [tuple(x[0] for x in rotary(h[None], torch.arange(h.shape[0])[None])) for h in hs]
    indices = indexer_topk(IndexerWeights.from_module(ix), hs, qr, emb, context_lens, TOPK)
    dims = MLADims(**ref.TINY)
    batch = ref.make_mla_batch(dims, query_lens, context_lens, 4, seed=5)
    plan = PrefillPlan.build(
        query_lens,
        context_lens,
        dims=dims,
        workspace=Workspace("cpu"),
        block_size=4,
        dtype=torch.float32,
        index_topk=TOPK,
    )
    out = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, topk_indices=indices
    )
    assert out.shape == (sum(query_lens), dims.num_heads, dims.v_head_dim) and torch.isfinite(out).all()


def test_refusals():
    cfg = config()
    w = IndexerWeights.from_module(indexer_module(cfg))
    h, q = torch.randn(5, 64), torch.randn(5, 32)
    cs = (torch.ones(5, 8), torch.zeros(5, 8))
    with pytest.raises(ValueError, match="must list the same requests"):
        indexer_topk(w, [h], [q, q], [cs], [0], 4)
    with pytest.raises(ValueError, match="context_lens\\[0\\] = 6 is longer than its sequence"):
        indexer_topk(w, [h], [q], [cs], [6], 4)
    with pytest.raises(ValueError, match="index_topk must be a positive int"):
        indexer_topk(w, [h], [q], [cs], [0], 0)
    with pytest.raises(ValueError, match="hidden_states\\[0\\] must be"):
        indexer_topk(w, [h[:, :10]], [q], [cs], [0], 4)
    with pytest.raises(TypeError, match="q_resid\\[0\\] must be torch.float32"):
        indexer_topk(w, [h], [q.double()], [cs], [0], 4)
    with pytest.raises(ValueError, match="wq_b must be"):
        IndexerWeights(w.wq_b[:-1], w.wk, w.k_norm_weight, w.k_norm_bias, w.weights_proj, 4, 16, 8)
    with pytest.raises(ValueError, match="rope_dim must be even"):
        IndexerWeights(w.wq_b, w.wk, w.k_norm_weight, w.k_norm_bias, w.weights_proj, 4, 16, 7)
    assert indexer_topk(w, [h], [q], [cs], [5], 4).shape == (0, 4)
