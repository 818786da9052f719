"""mla_prefill and the transformers attention function against transformers' own attention module of every MLA
model type (tests/models/hf_mla.py: one MLA layer at the model's head dims, few heads, seeded random weights).

Each request runs through transformers as a user's would (its prefix into transformers' DynamicCache, then the new
tokens). mla_prefill gets transformers' q after RoPE, its cached latents (kv_c, k_pe) in a paged cache with shuffled
blocks and NaN in every unused slot, and the layer's kv_b_proj.weight, the requests packed ragged; it must give
transformers' eager attention output (with no context, and with a prefix cache fused, in one chunk and in chunks).
The sink models (hy_v4, hy_v4_vl) add one partial per head (LSE = the sink logit, output 0) to mla_prefill's output
through its LSE. The transformers function (``attn_implementation="mla_bridge"``) must give the eager layer's output
on the same request, served (never handed back). DSA models: sequences below index_topk (the indexer keeps every key).
"""

from __future__ import annotations

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill
from mla_bridge.dims import HF_MLA_MODEL_TYPES

from . import hf_deepseek as H
from . import hf_mla as M

transformers = pytest.importorskip("transformers")

MODELS = [*HF_MLA_MODEL_TYPES, "dots3_note-swa"]  # dots3_note-swa: its sliding-window layers' dims (256/128)
NO_CONTEXT = [(0, 5), (0, 3), (0, 1)]
PREFIX = [(6, 3), (0, 4), (9, 2)]
SCHEDULES = {"fused": (1024, True, (True, 0)), "chunks": (4, False, (False, 4))}  # 15 context tokens in 4 chunks
#: What the transformers function hands back (to an implementation honouring it) instead of serving, by model.
HANDED_BACK = {"dots3_note-swa": "a sliding window", "glm5_next": "float32 mask"}
#: Every model's calls go through the transformers function (glm5_next passes ``input_ids`` along, which its own
#: attention functions ignore: it folds its top-k into an additive float mask itself, which is handed back to sdpa).
FUNCTION_MODELS = MODELS


def _split(name):
    model_type, _, variant = name.partition("-")
    return model_type, variant


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(name, impl=H.CAPTURE_IMPL):
        if (name, impl) not in made:
            H.register_capture()
            model_type, variant = _split(name)
            made[name, impl] = M.make_model(model_type, variant=variant, attn_implementation=impl, seed=1)
        return made[name, impl]

    return get


def _requests(model, base, requests, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [M.run_request(model, base, torch.randint(3, 64, (c + n,), generator=g), c) + (c,) for c, n in requests]


def mla_bridge_out(
    dims,
    attn,
    caps,
    *,
    chunk_tokens,
    fuse_context,
    block_size=4,
    dtype=torch.float32,
    device="cpu",
    kv_cache_dtype=None,
):
    """mla_prefill over the captured requests (see the module docstring), sinks merged in; returns (out, plan)."""
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    ctx = [torch.cat([kv_c[:c], k_pe[:c]], dim=-1) for _, _, _, kv_c, k_pe, _, c in caps]
    cache, table = H.page(ctx, block_size, latent_dim=dims.latent_dim, dtype=torch.float32, device=device)
    scale = None
    if kv_cache_dtype == "fp8":
        from mla_bridge.cache import quantize_latent_cache

        cache, scale = quantize_latent_cache(cache)
    else:
        cache = cast(cache)
    q = cast(torch.cat([x[0] for x in caps]))
    kv_c = cast(torch.cat([x[3][x[6] :] for x in caps]))
    k_pe = cast(torch.cat([x[4][x[6] :] for x in caps]))
    plan = PrefillPlan.build(
        [x[0].shape[0] for x in caps],
        [x[6] for x in caps],
        dims=dims,
        workspace=Workspace(device, chunk_tokens=chunk_tokens),
        block_size=block_size,
        dtype=dtype,
        fuse_context=fuse_context,
        kv_cache_dtype=kv_cache_dtype,
    )
    out, lse = mla_prefill(
        q, kv_c, k_pe, cast(attn.kv_b_proj.weight.detach()), cache, table, plan, return_lse=True, kv_cache_scale=scale
    )
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:  # one more key per head: logit sinks[h], value 0 (hy_v4's eager softmax over keys + sink)
        out = out.float() * torch.sigmoid(lse.float() - sinks.detach().float().to(lse.device))[..., None]
    return out, plan


@pytest.mark.parametrize("case", ["no-context", *SCHEDULES])
@pytest.mark.parametrize("name", MODELS)
def test_mla_prefill_equals_the_models_attention(models, two_torch_threads, name, case):
    model, base = models(name)
    attn = M.mla_attention(base)
    model_type, _ = _split(name)
    dims = MLADims.from_hf_config(base.config, layer=0)  # the small config, read as a user's would be
    assert (dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim) == (
        attn.num_heads,
        attn.qk_nope_head_dim,
        attn.qk_rope_head_dim,
        attn.v_head_dim,
    )
    assert dims.softmax_scale == attn.scaling
    requests = NO_CONTEXT if case == "no-context" else PREFIX
    caps = _requests(model, base, requests)
    assert all(x[2] == attn.scaling for x in caps)
    chunk_tokens, fuse, expected = SCHEDULES.get(case, (1024, True, (False, 0)))
    out, plan = mla_bridge_out(dims, attn, caps, chunk_tokens=chunk_tokens, fuse_context=fuse)
    assert (plan.fused, len(plan.chunks)) == expected
    want = torch.cat([x[1] for x in caps])
    assert want.abs().max() > 0.05  # a real signal
    torch.testing.assert_close(out, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FUNCTION_MODELS)
def test_transformers_function_equals_eager(models, two_torch_threads, monkeypatch, name):
    """Served (or, for HANDED_BACK, handed back with that reason), equal to eager on a prefix-cached batch."""
    import mla_bridge_transformers as mbt
    from mla_bridge_transformers import attention as mbt_attention

    impl = mbt.register()
    reasons = []
    hand_back = mbt_attention._hand_back

    def record(reason, *args, **kwargs):
        reasons.append(reason)
        if name not in HANDED_BACK:
            raise AssertionError(f"handed back to transformers: {reason}")
        return hand_back(reason, *args, **kwargs)

    monkeypatch.setattr(mbt_attention, "_hand_back", record)
    eager_model, eager_base = models(name)
    ours_model, ours_base = models(name, impl)  # the same seed and config: the same weights
    want = [x[5] for x in _requests(eager_model, eager_base, PREFIX)]
    got = [x[5] for x in _requests(ours_model, ours_base, PREFIX)]
    for w, o in zip(want, got):
        assert w.abs().max() > 1e-3
        torch.testing.assert_close(o, w, atol=1e-4, rtol=1e-4)
    if name in HANDED_BACK:
        assert reasons and all(HANDED_BACK[name] in r for r in reasons), reasons


@pytest.mark.parametrize("name", ["glm5_next", "minicpm3"])
def test_fp8_cache_of_transformers_latents(models, two_torch_threads, name):
    """The same latents through an FP8 cache: within the e4m3 rounding of the context's latents of the eager output
    (a bf16 tolerance), and not bitwise the unquantized cache's result (the quantization is real)."""
    model, base = models(name)
    attn = M.mla_attention(base)
    dims = MLADims.from_hf_config(base.config, layer=0)
    caps = _requests(model, base, PREFIX)
    out8, plan = mla_bridge_out(dims, attn, caps, chunk_tokens=4, fuse_context=False, kv_cache_dtype="fp8")
    out, _ = mla_bridge_out(dims, attn, caps, chunk_tokens=4, fuse_context=False)
    want = torch.cat([x[1] for x in caps])
    assert not torch.equal(out8, out)
    assert (out8 - want).abs().max() <= 5e-2 * want.abs().max()


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["no-context", "fused", "chunks"])
@pytest.mark.parametrize("name", MODELS)
def test_mla_prefill_bf16_gpu_equals_float64(name, case):
    """bf16 on the GPU (FlashInfer where it serves the head dims, else torch): transformers' latents and q captured in
    float32, rounded to bf16 for mla_bridge; within the CLI's bf16 tolerance (|x - ref| <= 2e-2 + 2**-7 |ref|) of
    transformers' float64 eager attention over the same rounded inputs, and of transformers' float32 output within
    the same bound plus the bf16 rounding of the inputs (relative 2e-2 of the largest output)."""
    H.register_capture()
    model, base = M.make_model(
        _split(name)[0], variant=_split(name)[1], attn_implementation=H.CAPTURE_IMPL, seed=1, device="cuda"
    )
    attn = M.mla_attention(base)
    dims = MLADims.from_hf_config(base.config, layer=0)
    requests = NO_CONTEXT if case == "no-context" else PREFIX
    H.register_capture()
    caps = _requests(model, base, requests)
    chunk_tokens, fuse, _ = SCHEDULES.get(case, (1024, True, None))
    torch.cuda._sleep(int(1e8))  # keep the GPU busy so the host runs ahead
    out, plan = mla_bridge_out(
        dims, attn, caps, chunk_tokens=chunk_tokens, fuse_context=fuse, dtype=torch.bfloat16, device="cuda"
    )
    # float64 reference: transformers' eager function on float64 copies of the bf16-rounded inputs
    model64, base64 = M.make_model(
        _split(name)[0],
        variant=_split(name)[1],
        attn_implementation=H.CAPTURE_IMPL,
        seed=1,
        dtype=torch.float64,
        device="cuda",
    )
    attn64 = M.mla_attention(base64)
    rounded = []
    for q, o, s, kv_c, k_pe, y, c in caps:
        r = lambda x: x.to(torch.bfloat16).double()  # noqa: E731
        rounded.append((r(q), None, s, r(kv_c), r(k_pe), None, c))
    ref = []
    w = attn64.kv_b_proj.weight.detach().to(torch.bfloat16).double()
    for q, _, s, kv_c, k_pe, _, c in rounded:
        kv = (kv_c @ w.T).view(kv_c.shape[0], dims.num_heads, -1)
        k = torch.cat([kv[..., : dims.qk_nope_head_dim], k_pe[:, None, :].expand(-1, dims.num_heads, -1)], dim=-1)
        v = kv[..., dims.qk_nope_head_dim :]
        n, L = q.shape[0], kv_c.shape[0]
        logits = torch.einsum("qhd,khd->hqk", q, k) * dims.softmax_scale
        mask = torch.arange(L, device=q.device)[None, :] <= (torch.arange(n, device=q.device)[:, None] + L - n)
        logits = logits.masked_fill(~mask, float("-inf"))
        sinks = getattr(attn64, "sinks", None)
        if sinks is not None:
            logits = torch.cat([logits, sinks.detach().double()[:, None, None].expand(-1, n, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :L]
        ref.append(torch.einsum("hqk,khd->qhd", p, v))
    ref = torch.cat(ref)
    excess = ((out.double() - ref).abs() - (2e-2 + 2.0**-7 * ref.abs())).max().item()
    print(f"{name} {case}: backend {plan.backend.name}, max excess over the bf16 tolerance {excess:.3g}")
    assert excess <= 0, (name, case, excess)
    want = torch.cat([x[1] for x in caps]).double()
    assert (out.double() - want).abs().max() <= 2e-2 * want.abs().max() + 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", FUNCTION_MODELS)
def test_transformers_function_bf16_gpu_within_sdpa_spread(name, monkeypatch):
    """The transformers function in bf16 on the GPU: its layer output's error against the float32 eager model stays
    within 2x the spread of transformers' own bf16 sdpa (eager for the eager-only models) against the same float32
    eager output, plus 1e-2 of the largest output."""
    import mla_bridge_transformers as mbt

    impl = mbt.register()
    mt, var = _split(name)
    ref_impl = "eager" if mt in M.EAGER_ONLY else "sdpa"
    want_model, want_base = M.make_model(mt, variant=var, seed=1, device="cuda")
    ours_model, ours_base = M.make_model(
        mt, variant=var, seed=1, attn_implementation=impl, dtype=torch.bfloat16, device="cuda"
    )
    try:
        spread_model, spread_base = M.make_model(
            mt, variant=var, seed=1, attn_implementation=ref_impl, dtype=torch.bfloat16, device="cuda"
        )
    except ValueError:  # no sdpa for this model type
        spread_model, spread_base = M.make_model(mt, variant=var, seed=1, dtype=torch.bfloat16, device="cuda")
    for requests in (NO_CONTEXT, PREFIX):
        want = torch.cat([x[5] for x in _requests(want_model, want_base, requests)]).float()
        got = torch.cat([x[5] for x in _requests(ours_model, ours_base, requests)]).float()
        spread = torch.cat([x[5] for x in _requests(spread_model, spread_base, requests)]).float()
        err, sp, wmax = (got - want).abs().max().item(), (spread - want).abs().max().item(), want.abs().max().item()
        print(f"{name}: mla_bridge bf16 err {err:.3g}, {ref_impl} bf16 spread {sp:.3g}, max |out| {wmax:.3g}")
        assert err <= 2 * sp + 1e-2 * wmax, (err, sp, wmax)
