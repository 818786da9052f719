"""Sparse prefill against transformers' DeepseekV32Attention (eager, float32) on the same random weights and a prompt
longer than index_topk: the layer's q / kv_c / k_pe are computed from the module's own projections, the context's
latents go into a paged cache, and mla_prefill's sparse pass is fed the indices transformers' indexer produced in that
very forward (captured, so that top-k ties cannot make the test flaky; its masked picks of early queries made -1)."""

from __future__ import annotations

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill

m = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config  # noqa: E402

TOPK = 6


def layer(seed):
    cfg = DeepseekV32Config(
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
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = m.DeepseekV32Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
        attn.o_proj.weight.copy_(torch.eye(64))  # the output is the attention's [S, H * v_head_dim] itself
    return cfg, attn


def transformers_forward(cfg, attn, hidden):
    """transformers' output ``[S, H, v]`` and the indices its indexer gave (``[S, TOPK]``), one sequence."""
    s = hidden.shape[0]
    rotary = m.DeepseekV32RotaryEmbedding(cfg)
    pos = torch.arange(s)[None]
    cos_sin = rotary(hidden[None], pos)
    mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
    captured = []
    real = attn.indexer.forward
    attn.indexer.forward = lambda *a, **k: captured.append(real(*a, **k)) or captured[-1]
    try:
        out, _ = attn(hidden[None], cos_sin, mask, position_ids=pos)
    finally:
        del attn.indexer.forward
    return out[0].view(s, cfg.num_attention_heads, cfg.v_head_dim), captured[0][0], cos_sin


def latents(cfg, attn, hidden, cos_sin):
    """The layer's q ``[S, H, 24]`` (RoPE applied), kv_c ``[S, 32]`` and k_pe ``[S, 8]`` from its own projections."""
    s, h = hidden.shape[0], cfg.num_attention_heads
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    q = attn.q_b_proj(q_resid).view(s, h, -1).transpose(0, 1)[None]  # [1, H, S, 24]
    q_pass, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = attn.kv_a_proj_with_mqa(hidden).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv_c = attn.kv_a_layernorm(kv_pass)
    cos, sin = cos_sin
    q_rot, k_rot = m.apply_rotary_pos_emb_interleave(q_rot, k_rot[None, None], cos, sin)
    q = torch.cat([q_pass, q_rot], -1)[0].transpose(0, 1).contiguous()
    return q, kv_c, k_rot[0, 0]


@pytest.mark.parametrize("context_len,block_size", [(0, 4), (9, 4), (17, 1), (5, 16)])
def test_equals_transformers_deepseek_v32_attention(context_len, block_size):
    cfg, attn = layer(seed=context_len)
    s = 24  # longer than index_topk: the selection matters
    hidden = torch.randn(s, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, indices, cos_sin = transformers_forward(cfg, attn, hidden)
        q, kv_c, k_pe = latents(cfg, attn, hidden, cos_sin)
    dims = MLADims(
        num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, softmax_scale=attn.scaling
    )
    c, n = context_len, s - context_len
    blocks = max(1, -(-c // block_size))
    cache = torch.full((blocks + 1, block_size, dims.latent_dim), float("nan"))
    order = torch.randperm(blocks + 1, generator=torch.Generator().manual_seed(2))
    table = order[:blocks].to(torch.int32)[None]
    latent = torch.cat([kv_c, k_pe], -1)
    for p in range(c):
        cache[int(table[0, p // block_size]), p % block_size] = latent[p]
    own = torch.arange(c, s)[:, None]
    picks = indices[c:].to(torch.int32)
    picks = picks.masked_fill(picks.long() > own, -1)  # transformers' mask drops the non-causal picks
    plan = PrefillPlan.build(
        [n], [c], dims=dims, workspace=Workspace("cpu"), block_size=block_size, dtype=torch.float32, index_topk=TOPK
    )
    with torch.no_grad():
        out = mla_prefill(
            q[c:], kv_c[c:], k_pe[c:], attn.kv_b_proj.weight, cache, table, plan, topk_indices=picks.contiguous()
        )
    torch.testing.assert_close(out, expected[c:], atol=2e-5, rtol=1e-4)
    # the selection mattered: dense attention differs
    dense_plan = PrefillPlan.build(
        [n], [c], dims=dims, workspace=Workspace("cpu"), block_size=block_size, dtype=torch.float32
    )
    with torch.no_grad():
        dense = mla_prefill(q[c:], kv_c[c:], k_pe[c:], attn.kv_b_proj.weight, cache, table, dense_plan)
    assert (dense - expected[c:]).abs().max() > 1e-3
