"""The JAX DeepSeek attention layer of examples/jax_deepseek_attention.py against transformers' own attention layer
on the same checkpoint: transformers (torch) = a JAX model through mla_bridge_jax.

The checkpoint (random weights at DeepSeek's published V2-Lite / V3 attention dims) is written by transformers; the
JAX layer loads its weights from that model.safetensors, computes q / latents / YaRN RoPE itself, writes the new
latents into a paged cache (NaN everywhere else) and prefills through ``mla_bridge_jax.mla_prefill`` inside
``jax.jit``. Step 1 prefills every request's prompt (its prefix); step 2 continues the requests over their cached
prefixes. Outputs after o_proj must equal transformers' within 1e-4 (float32, CPU); the latents written must equal
the ones transformers cached (RoPE layout and YaRN factor included).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch (the GPU test)
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from . import hf_deepseek as H  # noqa: E402

_EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "examples",
    "jax_deepseek_attention.py",
)


def _example():
    spec = importlib.util.spec_from_file_location("jax_deepseek_attention", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# (prefix tokens, continuation tokens) per request
REQUESTS = [(7, 3), (5, 4), (10, 1)]


@pytest.fixture(scope="module")
def example():
    return _example()


def _np(x):
    return np.asarray(jax.device_get(x), dtype=np.float64)


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_jax_layer_equals_transformers_attention(checkpoint, example, one_torch_thread, name):
    import mla_bridge_jax as mj

    folder = checkpoint(name)
    model = H.load(folder, H.CAPTURE_IMPL)
    g = torch.Generator().manual_seed(7)
    caps = [
        H.run_request(model, torch.randint(3, model.config.vocab_size, (c + n,), generator=g), c) for c, n in REQUESTS
    ]

    cfg = example.DeepseekAttentionConfig.from_hf_config(folder)
    assert cfg.rope_layout == {"v2-lite": "interleaved", "v3": "interleaved_to_half"}[name]
    inv_freq, attention_factor = example.rope_inv_freq(cfg)
    rotary = model.model.rotary_emb
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert cfg.dims.softmax_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)

    params = example.load_attention_weights(folder, 0, jnp.float32)
    pages = example.PagedLatentCache(num_blocks=16, block_size=4, max_blocks_per_request=4)
    pages._free = list(np.random.default_rng(0).permutation(16))  # shuffled blocks
    cache = pages.empty(cfg.dims, jnp.float32)
    reqs = list(range(len(REQUESTS)))
    for step_no, (hidden_of, want_of, ctx_of, new_of) in enumerate(
        [
            (lambda c: c.prefix_hidden, lambda c: c.prefix_attn_out, lambda c: 0, lambda c: c.context_len),
            (lambda c: c.hidden, lambda c: c.attn_out, lambda c: c.context_len, lambda c: c.hidden.shape[0]),
        ]
    ):
        c_lens, q_lens = [ctx_of(c) for c in caps], [new_of(c) for c in caps]
        for r, c, n in zip(reqs, c_lens, q_lens):
            pages.reserve(r, c + n)
        plan = mj.build_plan(q_lens, c_lens, dims=cfg.dims, block_size=pages.block_size, dtype=jnp.float32)
        step = example.make_prefill_step(cfg, plan)
        hidden = jnp.asarray(torch.cat([hidden_of(c) for c in caps]).numpy())
        positions = jnp.asarray(np.concatenate([np.arange(c, c + n) for c, n in zip(c_lens, q_lens)]), jnp.int32)
        out, cache = step(
            params,
            hidden,
            positions,
            jnp.asarray(pages.slots(reqs, c_lens, q_lens)),
            cache,
            jnp.asarray(pages.block_table(reqs)),
        )
        want = torch.cat([want_of(c) for c in caps]).double().numpy()
        assert np.abs(want).max() > 0.05
        np.testing.assert_allclose(_np(out), want, atol=1e-4, rtol=0, err_msg=f"step {step_no}")

    # the latents the JAX layer wrote are transformers' cached latents (kv_c after kv_a_layernorm, k_pe after RoPE)
    table, flat = pages.block_table(reqs), _np(cache).reshape(-1, cfg.dims.latent_dim)
    for r, c in enumerate(caps):
        n = c.kv_c.shape[0]
        slots = table[r, np.arange(n) // pages.block_size] * pages.block_size + np.arange(n) % pages.block_size
        np.testing.assert_allclose(flat[slots], torch.cat([c.kv_c, c.k_pe], -1).double().numpy(), atol=1e-5, rtol=0)


def test_rope_layouts_differ(example):
    # Guards the layout test above: the three layouts give different vectors for the same input.
    x = jnp.arange(8.0).reshape(1, 8) + 1
    pos, inv = jnp.array([3]), jnp.asarray(np.array([1.0, 0.1, 0.01, 0.001], np.float32))
    outs = [
        _np(example.apply_rope(x, pos, inv, 1.0, layout)) for layout in ("interleaved", "interleaved_to_half", "half")
    ]
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2])
    np.testing.assert_allclose(np.sort(outs[0].ravel()), np.sort(outs[1].ravel()), rtol=1e-6)  # same values, reordered


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_jax_layer_bf16_gpu(checkpoint, example, name):
    """bf16 on the GPU: the JAX layer (weights and activations bf16, FlashInfer through mla_bridge_jax) within 2e-2 of
    the largest magnitude of transformers' float32 layer output on the same checkpoint, prompt and continuation
    (relative: bf16 rounding through four projections grows with the output, which is larger at V3's 128 heads)."""
    import mla_bridge_jax as mj

    folder = checkpoint(name)
    model = H.load(folder, H.CAPTURE_IMPL)  # float32 reference on the CPU
    g = torch.Generator().manual_seed(7)
    caps = [
        H.run_request(model, torch.randint(3, model.config.vocab_size, (c + n,), generator=g), c)
        for c, n in [(300, 57), (129, 200)]
    ]
    cfg = example.DeepseekAttentionConfig.from_hf_config(folder)
    params = example.load_attention_weights(folder, 0, jnp.bfloat16)
    pages = example.PagedLatentCache(num_blocks=64, block_size=16, max_blocks_per_request=32)
    cache = pages.empty(cfg.dims, jnp.bfloat16)
    reqs = [0, 1]
    for hidden_of, want_of, ctx_of, new_of in [
        (lambda c: c.prefix_hidden, lambda c: c.prefix_attn_out, lambda c: 0, lambda c: c.context_len),
        (lambda c: c.hidden, lambda c: c.attn_out, lambda c: c.context_len, lambda c: c.hidden.shape[0]),
    ]:
        c_lens, q_lens = [ctx_of(c) for c in caps], [new_of(c) for c in caps]
        for r, c, n in zip(reqs, c_lens, q_lens):
            pages.reserve(r, c + n)
        plan = mj.build_plan(q_lens, c_lens, dims=cfg.dims, block_size=pages.block_size, dtype=jnp.bfloat16)
        assert plan.backend.flashinfer_backend is not None
        step = example.make_prefill_step(cfg, plan)
        hidden = jnp.asarray(torch.cat([hidden_of(c) for c in caps]).numpy()).astype(jnp.bfloat16)
        positions = jnp.asarray(np.concatenate([np.arange(c, c + n) for c, n in zip(c_lens, q_lens)]), jnp.int32)
        out, cache = step(
            params,
            hidden,
            positions,
            jnp.asarray(pages.slots(reqs, c_lens, q_lens)),
            cache,
            jnp.asarray(pages.block_table(reqs)),
        )
        want = torch.cat([want_of(c) for c in caps]).double().numpy()
        err, wmax = np.abs(_np(out) - want).max(), np.abs(want).max()
        print(f"{name}: JAX layer bf16 err {err:.3g}, max |out| {wmax:.3g}")
        assert err <= 2e-2 * wmax, (err, wmax)
