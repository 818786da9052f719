"""mla_bridge_jax.models: a small DeepSeek-V2 model in JAX whose logits equal transformers' on the same checkpoint.

A random 2-layer DeepSeek-V2 checkpoint (V2-Lite attention dims, YaRN, dense MLPs) written by transformers'
``save_pretrained``; the JAX model reads its safetensors. float32 on the CPU: logits within 1e-4 of transformers'
eager model at every position, with mla_bridge_jax's attention (the torch backend, through the adapter's jit
route) and with ``jax.nn.dot_product_attention`` (XLA), for a prompt and for new tokens over a cached prefix.
"""

from __future__ import annotations

import pytest
import numpy as np
import torch

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from mla_bridge_jax import models  # noqa: E402

from . import hf_deepseek as H  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return H.write_checkpoint("v2-lite", tmp_path_factory.mktemp("v2-jax-model"), seed=4, num_layers=2)


@pytest.fixture(scope="module")
def torch_model(folder):
    return H.load(folder, "eager")


def test_the_noop_model_computes_all_but_the_attention(folder):
    """The ttft bench subtracts the no-op model from each model to get attention's time: XLA must not drop the
    projections whose results only the attention reads (it dropped q_proj and kv_b_proj, 2 matmuls per layer, and
    counted them as attention). Compiled here: the no-op model has exactly XLA attention's two matmuls per layer
    fewer, and its output is zeros."""
    cfg = models.DeepseekConfig.from_hf_config(folder)
    params = models.load_params(folder)
    ids = jnp.asarray(np.arange(26, dtype=np.int32).reshape(2, 13) + 3)
    dots = {}
    for attention in ("xla", "noop"):
        forward = models.make_forward(cfg, batch=2, seq_len=13, attention=attention, logits_to_keep=1)
        dots[attention] = forward.lower(params, ids).compile().as_text().count(" dot(")
    if dots["xla"] < 2 * cfg.num_layers:
        pytest.skip(f"this XLA backend does not show its matmuls as dot ops ({dots})")
    assert dots["noop"] == dots["xla"] - 2 * cfg.num_layers, dots
    attend = models.attention_fn(cfg, "noop", 2, 13, 0, jnp.float32)
    q = jnp.ones((2, 13, cfg.num_heads, models.q_dim(cfg)))
    out = attend(q, q, jnp.ones((2, 13, cfg.num_heads, cfg.v_head_dim)))
    assert out.shape == (2, 13, cfg.num_heads, cfg.v_head_dim) and not bool(out.any())


def test_attention_inputs_are_what_transformers_hands_its_first_layer(folder, torch_model, two_torch_threads):
    """The ttft bench times each attention alone on ``attention_inputs``: the q, k and v of the model's first layer,
    equal to those transformers hands its attention function (``[B, H, L, D]`` there, ``[B, L, H, D]`` here), with
    and without a cached prefix."""
    from transformers import DynamicCache

    from mla_bridge.bench import ttft

    cfg = models.DeepseekConfig.from_hf_config(folder)
    params = models.load_params(folder)
    ids = torch.randint(3, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = DynamicCache(config=torch_model.config)
        torch_model(ids[:, :9], past_key_values=cache)
    prefix = [(layer.keys, layer.values) for layer in cache.layers]
    _, latents = models.make_forward(cfg, batch=2, seq_len=9, attention="xla")(
        params, jnp.asarray(ids[:, :9].numpy(), dtype=jnp.int32)
    )
    for new, cached, prefix_len in ((ids, None, 0), (ids[:, 9:], latents, 9)):
        want = ttft._model_attention_inputs(torch_model, new, prefix if prefix_len else None)[:3]
        got = models.attention_inputs(
            cfg, params, jnp.asarray(new.numpy(), dtype=jnp.int32), cached, prefix_len=prefix_len
        )
        for name, g, w in zip("qkv", got, want):
            w = w.transpose(1, 2).numpy()
            assert g.shape == w.shape, (name, g.shape, w.shape)
            assert float(abs(np.asarray(g) - w).max()) < 1e-5, (name, prefix_len)


@pytest.mark.parametrize("attention", ["mla_bridge", "xla"])
def test_logits_equal_transformers(folder, torch_model, attention, two_torch_threads):
    cfg = models.DeepseekConfig.from_hf_config(folder)
    assert cfg.num_layers == 2 and cfg.rope is not None  # YaRN, as V2-Lite
    params = models.load_params(folder)
    ids = torch.randint(3, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch_model(ids).logits.numpy()
    assert want.std() > 0.1
    forward = models.make_forward(cfg, batch=2, seq_len=13, attention=attention)
    got, latents = forward(params, jnp.asarray(ids.numpy(), dtype=jnp.int32))
    assert got.shape == want.shape and len(latents) == 2
    assert float(abs(got - want).max()) < 1e-4, float(abs(got - want).max())


@pytest.mark.parametrize("attention", ["mla_bridge", "xla"])
def test_new_tokens_over_a_cached_prefix_equal_transformers(folder, torch_model, attention, two_torch_threads):
    """The prefix's latents from a first forward, then 5 new tokens over them (bottom-right causal): transformers'
    logits of the new tokens over its DynamicCache."""
    from transformers import DynamicCache

    cfg = models.DeepseekConfig.from_hf_config(folder)
    params = models.load_params(folder)
    ids = torch.randint(3, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = DynamicCache(config=torch_model.config)
        torch_model(ids[:, :9], past_key_values=cache)
        want = torch_model(ids[:, 9:], past_key_values=cache).logits.numpy()
    _, latents = models.make_forward(cfg, batch=2, seq_len=9, attention=attention)(
        params, jnp.asarray(ids[:, :9].numpy(), dtype=jnp.int32)
    )
    forward = models.make_forward(cfg, batch=2, seq_len=5, prefix_len=9, attention=attention)
    got, _ = forward(params, jnp.asarray(ids[:, 9:].numpy(), dtype=jnp.int32), latents)
    assert float(abs(got - want).max()) < 1e-4, float(abs(got - want).max())
    wrong, _ = forward(params, jnp.asarray(ids[:, 9:].numpy(), dtype=jnp.int32), [x * 0 for x in latents])
    assert float(abs(wrong - want).max()) > 1e-2  # the prefix matters


def test_bad_forward_inputs_are_refused_by_name(folder):
    """A forward made for [2, 8] over 4 cached tokens, called wrongly: each mistake is named (it failed deep in JAX's
    reshape or indexing, naming none of the arguments)."""
    cfg = models.DeepseekConfig.from_hf_config(folder)
    params = models.load_params(folder)
    ids = jnp.asarray(np.arange(16, dtype=np.int32).reshape(2, 8) + 3)
    plain = models.make_forward(cfg, batch=2, seq_len=8, attention="xla")
    _, latents = plain(params, ids)
    with pytest.raises(ValueError, match=r"input_ids must be \[batch=2, seq_len=8\].*got \[1, 8\]"):
        plain(params, ids[:1])
    with pytest.raises(ValueError, match=r"input_ids must be \[batch=2, seq_len=8\].*got \[2, 7\]"):
        plain(params, ids[:, :7])
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype float32"):
        plain(params, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="cache must be None: this forward was made with prefix_len=0"):
        plain(params, ids, latents)
    with pytest.raises(ValueError, match=r"params are float32 but this forward was made with dtype=bfloat16"):
        models.make_forward(cfg, batch=2, seq_len=8, attention="xla", dtype=jnp.bfloat16)(params, ids)
    more = models.make_forward(cfg, batch=2, seq_len=8, prefix_len=4, attention="xla")
    prefix = [x[:, :4] for x in latents]
    with pytest.raises(ValueError, match=r"cache must be a list of 2 per-layer latents \(prefix_len=4\), got None"):
        more(params, ids)
    with pytest.raises(ValueError, match=r"cache\[0\] must be \[2, 4, 576\].*got \[2, 8, 576\]"):
        more(params, ids, latents)
    logits, _ = more(params, ids, prefix)  # the right call still runs
    assert logits.shape == (2, 8, cfg.vocab_size)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix", [0, 200])
def test_gpu_bf16_logits_within_transformers_own_spread(folder, prefix):
    """bf16 on the GPU (JAX on the H200): the JAX model's logits with mla_bridge_jax (FlashInfer through the jit
    route), cuDNN (prompt only) and XLA attention are no further from transformers' float32 eager model than 1.5x the furthest of
    transformers' own bf16 eager and sdpa, measured in the same run; prompt (3 x 300) and 100 new tokens over a
    200-token cached prefix."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU")
    from transformers import DynamicCache

    cfg = models.DeepseekConfig.from_hf_config(folder)
    new = 300 if not prefix else 100
    ids = torch.randint(3, cfg.vocab_size, (3, prefix + new), generator=torch.Generator().manual_seed(2))

    def torch_logits(impl, dtype):
        model = H.load(folder, impl, dtype=dtype, device="cuda")
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            if prefix:
                model(ids[:, :prefix].cuda(), past_key_values=cache)
            return model(ids[:, prefix:].cuda(), past_key_values=cache).logits.float().cpu().numpy()

    truth = torch_logits("eager", torch.float32)
    spread = max(abs(torch_logits(i, torch.bfloat16) - truth).max() for i in ("eager", "sdpa"))
    params = models.load_params(folder, dtype=jnp.bfloat16)
    for attention in ("mla_bridge", "xla") if prefix else ("mla_bridge", "cudnn", "xla"):  # cuDNN: causal only
        cache = None
        if prefix:
            cache = models.make_forward(cfg, batch=3, seq_len=prefix, attention=attention, dtype=jnp.bfloat16)(
                params, jnp.asarray(ids[:, :prefix].numpy(), dtype=jnp.int32)
            )[1]
        got, _ = models.make_forward(
            cfg, batch=3, seq_len=new, prefix_len=prefix, attention=attention, dtype=jnp.bfloat16
        )(params, jnp.asarray(ids[:, prefix:].numpy(), dtype=jnp.int32), cache)
        err = float(abs(np.asarray(got) - truth).max())
        assert err <= 1.5 * spread, (attention, err, spread)
