"""mla_bridge.mla_prefill against transformers' own DeepseekV2Attention / DeepseekV3Attention.

The checkpoint is a random 1-layer model at DeepSeek's published attention dims (V2-Lite, V3) written by transformers'
``save_pretrained``; :class:`MLADims` is read from the config.json transformers wrote. Each request runs through
transformers as a real user's would: its prefix into transformers' DynamicCache, then the new tokens over it. mla_bridge
gets the tensors transformers computed (q after RoPE, kv_c after kv_a_layernorm, k_pe after RoPE, kv_b_proj.weight;
see tests/models/hf_deepseek.py), the requests packed ragged into one batch, each prefix in a paged latent cache with
shuffled blocks and NaN in every unused slot, and must give transformers' eager attention output.
"""

from __future__ import annotations

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill

from . import hf_deepseek as H

# (context_len, new tokens) per request; prompts are seeded token ids
NO_CONTEXT = [(0, 5), (0, 3), (0, 1)]
PREFIX = [(6, 3), (0, 4), (9, 2)]
SCHEDULES = {  # name: (Workspace.chunk_tokens, fuse_context, expected (fused, context chunks))
    "fused": (1024, True, (True, 0)),
    "one-chunk": (1024, False, (False, 1)),
    "chunks": (4, False, (False, 4)),  # 15 context tokens in chunks of 4: requests split across chunks
}


def _captured(model, requests, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return [H.run_request(model, torch.randint(3, vocab, (c + n,), generator=g), c) for c, n in requests]


def _run_mla_bridge(
    dims, weight, caps, *, chunk_tokens, fuse_context, block_size=4, dtype=torch.float32, device="cpu", ws=None
):
    """Pack the captured requests into one ragged batch and run mla_prefill; returns (out [T, H, v], plan)."""
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    ctx = [torch.cat([c.kv_c[: c.context_len], c.k_pe[: c.context_len]], dim=-1) for c in caps]
    cache, table = H.page(ctx, block_size, latent_dim=dims.latent_dim, dtype=dtype, device=device)
    q = cast(torch.cat([c.query for c in caps]))
    kv_c = cast(torch.cat([c.kv_c[c.context_len :] for c in caps]))
    k_pe = cast(torch.cat([c.k_pe[c.context_len :] for c in caps]))
    ws = ws or Workspace(device, chunk_tokens=chunk_tokens)
    plan = PrefillPlan.build(
        [c.query.shape[0] for c in caps],
        [c.context_len for c in caps],
        dims=dims,
        workspace=ws,
        block_size=block_size,
        dtype=dtype,
        fuse_context=fuse_context,
    )
    return mla_prefill(q, kv_c, k_pe, cast(weight), cache, table, plan), plan


@pytest.fixture(scope="module")
def models(checkpoint):
    loaded = {}

    def get(name):
        if name not in loaded:
            folder = checkpoint(name)
            loaded[name] = (H.load(folder, H.CAPTURE_IMPL), MLADims.from_hf_config(folder))
        return loaded[name]

    return get


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
@pytest.mark.parametrize("case", ["no-context", *SCHEDULES])
def test_mla_prefill_equals_transformers_attention(models, two_torch_threads, name, case):
    model, dims = models(name)
    attn = model.model.layers[0].self_attn
    assert type(attn).__name__ == {"v2-lite": "DeepseekV2Attention", "v3": "DeepseekV3Attention"}[name]
    assert dims.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)  # read from the config.json transformers wrote
    requests = NO_CONTEXT if case == "no-context" else PREFIX
    chunk_tokens, fuse, expected = SCHEDULES.get(case, (1024, True, (False, 0)))
    caps = _captured(model, requests)
    assert all(c.scaling == attn.scaling for c in caps)
    out, plan = _run_mla_bridge(
        dims, attn.kv_b_proj.weight.detach(), caps, chunk_tokens=chunk_tokens, fuse_context=fuse
    )
    assert (plan.fused, len(plan.chunks)) == expected
    want = torch.cat([c.out for c in caps])
    assert want.abs().max() > 0.1  # a real signal, not near-zero outputs
    torch.testing.assert_close(out, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_wrong_scale_would_show(models, two_torch_threads, name):
    # Guards the tolerance: the plain 192**-0.5 scale (YaRN's mscale left out) is far outside 1e-4 on these layers.
    model, dims = models(name)
    attn = model.model.layers[0].self_attn
    caps = _captured(model, PREFIX)
    wrong = MLADims(num_heads=dims.num_heads, softmax_scale=192**-0.5)
    out, _ = _run_mla_bridge(wrong, attn.kv_b_proj.weight.detach(), caps, chunk_tokens=1024, fuse_context=True)
    assert (out - torch.cat([c.out for c in caps])).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["v2-lite", "v3"])
@pytest.mark.parametrize("case", ["no-context", *SCHEDULES])
def test_mla_prefill_equals_transformers_attention_bf16_gpu(checkpoint, name, case):
    """bf16 on the GPU (FlashInfer): transformers' tensors captured in float32 on the GPU, rounded to bf16 for
    mla_bridge. The error against transformers' float32 eager output must stay within 2e-2 of the output's largest
    magnitude (the parity suite's bf16 tolerance, made relative for V3's larger outputs) and within 2x the error of
    transformers' own model run in bf16 (eager) on the same prompts: the bf16 rounding of q/k/v is the error both
    share."""
    folder = checkpoint(name)
    model = H.load(folder, H.CAPTURE_IMPL, device="cuda")
    dims = MLADims.from_hf_config(folder)
    attn = model.model.layers[0].self_attn
    requests = NO_CONTEXT if case == "no-context" else PREFIX
    chunk_tokens, fuse, _ = SCHEDULES.get(case, (1024, True, None))
    caps = _captured(model, requests)
    torch.cuda._sleep(int(1e8))  # keep the GPU busy so the host runs ahead
    out, plan = _run_mla_bridge(
        dims,
        attn.kv_b_proj.weight.detach(),
        caps,
        chunk_tokens=chunk_tokens,
        fuse_context=fuse,
        dtype=torch.bfloat16,
        device="cuda",
    )
    assert plan.backend.flashinfer_backend is not None  # FlashInfer ran, not the torch fallback
    want = torch.cat([c.out for c in caps]).float()
    err, wmax = (out.float() - want).abs().max().item(), want.abs().max().item()
    bf16_model = H.load(folder, H.CAPTURE_IMPL, dtype=torch.bfloat16, device="cuda")
    spread = (torch.cat([c.out for c in _captured(bf16_model, requests)]).float() - want).abs().max().item()
    print(
        f"{name} {case}: mla_bridge bf16 err {err:.3g}, transformers bf16 eager err {spread:.3g}, max |out| {wmax:.3g}"
    )
    assert err <= 2e-2 * wmax, (err, spread, wmax)
    assert err <= max(2 * spread, 1e-2 * wmax), (err, spread, wmax)
