"""mla_bridge_jax at the MLA dims of the models people serve, on the CPU (the torch backend): GLM-4.7-Flash (20 heads,
q/k 192+64, v 256), a zero RoPE dim (glm5_next: 256+0 / 256), MiniCPM3 (40 heads, 64+32 / 64) and Mistral 4
(64+64 / 128).

``ragged_prefill`` and ``mla_prefill``, eagerly and under ``jax.jit``, give the core's torch result on the same inputs
bit for bit, and the core's result is within float32 rounding of a float64 attention computed here (numpy) from the
same inputs. The JAX model of :mod:`mla_bridge_jax.models` reads its dims from the config: at GLM-4.7-Flash's
(transformers' glm4_moe_lite, 2 random layers) its logits equal transformers' eager model's. Self-contained: no helper
module of the suite is imported.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402

#: name -> (num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), transformers' default configs
#: of the model type (glm5_next at 8 of its 64 heads: the zero RoPE part is what is tested).
MODEL_DIMS = {
    "glm4_moe_lite": (20, 512, 192, 64, 256),
    "glm5_next": (8, 512, 256, 0, 256),
    "minicpm3": (40, 256, 64, 32, 64),
    "mistral4": (32, 256, 64, 64, 128),
}
# Three requests: context + new tokens, new tokens only, context only; block size 4, a block table out of order.
Q_LENS, C_LENS, BLOCK = [3, 2, 1], [6, 0, 5], 4


def dims_of(name: str) -> MLADims:
    h, r, n, p, v = MODEL_DIMS[name]
    return MLADims(num_heads=h, kv_lora_rank=r, qk_nope_head_dim=n, qk_rope_head_dim=p, v_head_dim=v)


def _equal(jx: jax.Array, tx: torch.Tensor) -> bool:
    return torch.equal(torch.from_dlpack(jx), tx)


def _attention64(q, k, v, qo, kv, sm_scale):
    """float64 bottom-right causal attention over packed requests: ``(out [T, H, Dv], lse [T, H])`` (numpy)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    lse = np.full(q.shape[:2], -np.inf)
    for r in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[r], qo[r + 1], kv[r], kv[r + 1]
        nq, nk = q1 - q0, k1 - k0
        if nq == 0 or nk == 0:
            continue
        s = np.einsum("thd,shd->hts", q[q0:q1], k[k0:k1]) * sm_scale
        visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
        s = np.where(visible[None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        total = p.sum(-1, keepdims=True)
        out[q0:q1] = np.einsum("hts,shd->thd", p / total, v[k0:k1])
        lse[q0:q1] = (m + np.log(total))[..., 0].T
    return out, lse


# --------------------------------------------------------------------------------------------------------------
# ragged_prefill
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_DIMS)
def test_ragged_prefill_at_model_dims(name):
    dims = dims_of(name)
    h, dqk, dvo = dims.num_heads, dims.head_dim_qk, dims.head_dim_vo
    qo = np.cumsum([0] + Q_LENS).tolist()
    kv = np.cumsum([0] + [q + c for q, c in zip(Q_LENS, C_LENS)]).tolist()
    rng = np.random.default_rng(11)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        for shape in ((qo[-1], h, dqk), (kv[-1], h, dqk), (kv[-1], h, dvo))
    )
    sm = dims.softmax_scale
    core_out, core_lse = mla_bridge.ragged_prefill(
        *(torch.from_dlpack(x) for x in (q, k, v)), qo, kv, causal=True, sm_scale=sm
    )
    assert core_out.shape == (qo[-1], h, dvo)
    out, lse = mj.ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=sm)
    assert out.shape == (qo[-1], h, dvo) and out.dtype == jnp.bfloat16 and lse.shape == (qo[-1], h)
    assert _equal(out, core_out) and _equal(lse, core_lse)
    jout, jlse = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, qo, kv, causal=True, sm_scale=sm))(q, k, v)
    assert _equal(jout, core_out) and _equal(jlse, core_lse)
    want_out, want_lse = _attention64(*(np.asarray(x, np.float32) for x in (q, k, v)), qo, kv, sm)
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=2e-2, rtol=2e-2)  # out rounded to bf16
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# mla_prefill over a paged latent cache
# --------------------------------------------------------------------------------------------------------------


def _mla_inputs(dims: MLADims, seed: int):
    """float32 jax inputs of :func:`mla_bridge_jax.mla_prefill` at ``dims`` (k_pe ``[T, rope]``, ``[T, 0]`` without a
    RoPE part), the cache's blocks in shuffled order, and the per-request unpaged context latents."""
    rng = np.random.default_rng(seed)
    t, width = sum(Q_LENS), dims.latent_dim
    blocks = [-(-c // BLOCK) for c in C_LENS]
    num_blocks = sum(blocks) + 2
    order = rng.permutation(num_blocks)
    cache = np.full((num_blocks, BLOCK, width), np.nan, np.float32)  # unused slots NaN: a wrong read shows
    table = np.full((len(Q_LENS), max(blocks) + 1), -1, np.int32)
    context, nxt = [], 0
    for r, c in enumerate(C_LENS):
        latents = rng.standard_normal((c, width)).astype(np.float32)
        context.append(latents)
        for b in range(blocks[r]):
            table[r, b] = order[nxt]
            nxt += 1
            n = min(BLOCK, c - b * BLOCK)
            cache[table[r, b], :n] = latents[b * BLOCK : b * BLOCK + n]
    w = rng.standard_normal(dims.kv_b_proj_shape) * dims.kv_lora_rank**-0.5
    arrays = [
        rng.standard_normal((t, dims.num_heads, dims.head_dim_qk)),
        rng.standard_normal((t, dims.kv_lora_rank)),
        rng.standard_normal((t, dims.qk_rope_head_dim)),
        w,
        cache,
    ]
    return [jnp.asarray(a, jnp.float32) for a in arrays] + [jnp.asarray(table)], context


def _mla_reference64(dims: MLADims, q, kv_c, k_pe, w, context):
    """float64 MLA prefill: each request's context latents then its new tokens', up-projected by ``w``."""
    rank, nope, h = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.num_heads
    kv_c, k_pe, w = (np.asarray(x, np.float64) for x in (kv_c, k_pe, w))
    latents, start = [], 0
    for n, ctx in zip(Q_LENS, context):
        latents.append(np.asarray(ctx, np.float64))
        latents.append(np.concatenate([kv_c[start : start + n], k_pe[start : start + n]], -1))
        start += n
    latent = np.concatenate(latents)
    up = (latent[:, :rank] @ w.T).reshape(-1, h, nope + dims.v_head_dim)
    rope = np.broadcast_to(latent[:, None, rank:], (latent.shape[0], h, dims.qk_rope_head_dim))
    k = np.concatenate([up[..., :nope], rope], -1)
    qo = np.cumsum([0] + Q_LENS).tolist()
    kv = np.cumsum([0] + [q + c for q, c in zip(Q_LENS, C_LENS)]).tolist()
    return _attention64(np.asarray(q), k, up[..., nope:], qo, kv, dims.softmax_scale)


#: (chunk_tokens, fuse_context): the context fused into the new tokens' pass; one context chunk; three chunks of at
#: most 4 tokens (a request split across two).
SCHEDULES = {"fused": (100, True), "one_chunk": (100, False), "chunks": (4, False)}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", MODEL_DIMS)
def test_mla_prefill_at_model_dims(name, schedule):
    dims = dims_of(name)
    args, context = _mla_inputs(dims, seed=5)
    if dims.qk_rope_head_dim == 0:
        assert args[2].shape == (sum(Q_LENS), 0)  # k_pe of a model without a RoPE part
    chunk_tokens, fuse = SCHEDULES[schedule]
    workspace = mla_bridge.Workspace("cpu", chunk_tokens=chunk_tokens)
    plan = mj.build_plan(
        Q_LENS, C_LENS, dims=dims, block_size=BLOCK, dtype=jnp.float32, fuse_context=fuse, workspace=workspace
    )
    assert plan.fused == fuse and len(plan.chunks) == {"fused": 0, "one_chunk": 1, "chunks": 3}[schedule]
    core_out, core_lse = mla_bridge.mla_prefill(*(torch.from_dlpack(a) for a in args), plan, return_lse=True)
    assert core_out.shape == (sum(Q_LENS), dims.num_heads, dims.v_head_dim)
    out = mj.mla_prefill(*args, plan)
    assert out.shape == (sum(Q_LENS), dims.num_heads, dims.v_head_dim) and _equal(out, core_out)
    jout, jlse = jax.jit(lambda *a: mj.mla_prefill(*a, plan, return_lse=True))(*args)
    assert _equal(jout, core_out) and _equal(jlse, core_lse)
    want_out, want_lse = _mla_reference64(dims, *args[:4], context)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(jlse), want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["glm5_next", "minicpm3"])
def test_mla_prefill_with_prepared_weight_at_model_dims(name):
    """The load-time weight (:func:`mla_bridge_jax.prepare_kv_b_proj`) at these dims: the raw weight's bits."""
    dims = dims_of(name)
    args, _ = _mla_inputs(dims, seed=6)
    q, kv_c, k_pe, w, cache, table = args
    plan = mj.build_plan(Q_LENS, C_LENS, dims=dims, block_size=BLOCK, dtype=jnp.float32)
    want = mj.mla_prefill(*args, plan)
    prepared = mj.prepare_kv_b_proj(w, dims)
    assert _equal(mj.mla_prefill(q, kv_c, k_pe, prepared, cache, table, plan), torch.from_dlpack(want))
    jout = jax.jit(lambda q, c, p, kc, bt: mj.mla_prefill(q, c, p, prepared, kc, bt, plan))(q, kv_c, k_pe, cache, table)
    assert _equal(jout, torch.from_dlpack(want))


# --------------------------------------------------------------------------------------------------------------
# mla_bridge_jax.models at GLM-4.7-Flash dims, against transformers' glm4_moe_lite
# --------------------------------------------------------------------------------------------------------------


#: Config choices of the checkpoint besides GLM-4.7-Flash's defaults: the RoPE of the rotate-half layout, a large
#: ``rms_norm_eps`` (transformers applies it to the input, post-attention and final norms, not to the latent norms,
#: which keep their default 1e-6), embeddings tied to the head (``save_pretrained`` writes no ``lm_head``).
CHECKPOINT_CHOICES = {
    "defaults": {},
    "rotate-half RoPE": dict(rope_interleave=False),
    "rms_norm_eps 1e-2": dict(rms_norm_eps=1e-2),
    "tied embeddings": dict(tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CHECKPOINT_CHOICES))
def glm_checkpoint(tmp_path_factory, request):
    """A random 2-layer glm4_moe_lite (GLM-4.7-Flash's attention: 20 heads, q/k 192+64, v 256, kv_lora_rank 512,
    interleaved RoPE unless the choice says otherwise), dense MLPs and a small body, written by transformers'
    ``save_pretrained``; its eager model."""
    transformers = pytest.importorskip("transformers")
    if "glm4_moe_lite" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no glm4_moe_lite")
    config = transformers.AutoConfig.for_model(
        "glm4_moe_lite",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        mlp_layer_types=["dense", "dense"],
        vocab_size=64,
        num_attention_heads=20,
        num_key_value_heads=20,
        q_lora_rank=48,
        initializer_range=0.05,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    for name, value in CHECKPOINT_CHOICES[request.param].items():
        setattr(config, name, value)
    assert (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (
        512,
        192,
        64,
        256,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    folder = tmp_path_factory.mktemp("glm4-moe-lite-jax-model")
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("attention", ["mla_bridge", "xla"])
def test_jax_model_at_glm_dims_equals_transformers(glm_checkpoint, attention):
    """The JAX model reads GLM-4.7-Flash's dims from the config (no DeepSeek dims assumed): float32 logits within
    1e-4 of transformers' eager glm4_moe_lite, for a prompt and for new tokens over a cached prefix."""
    from transformers import DynamicCache

    from mla_bridge_jax import models

    folder, torch_model = glm_checkpoint
    cfg = models.DeepseekConfig.from_hf_config(folder)
    assert (cfg.num_heads, cfg.dims.head_dim_qk, cfg.dims.head_dim_vo) == (20, 256, 256)
    assert cfg.dims.softmax_scale == 256**-0.5
    params = models.load_params(folder)
    ids = torch.randint(3, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch_model(ids).logits.numpy()
        cache = DynamicCache(config=torch_model.config)
        torch_model(ids[:, :9], past_key_values=cache)
        want_new = torch_model(ids[:, 9:], past_key_values=cache).logits.numpy()
    assert want.std() > 0.1
    got, _ = models.make_forward(cfg, batch=2, seq_len=14, attention=attention)(params, jnp.asarray(ids.numpy()))
    assert float(abs(np.asarray(got) - want).max()) < 1e-4
    _, latents = models.make_forward(cfg, batch=2, seq_len=9, attention=attention)(
        params, jnp.asarray(ids[:, :9].numpy())
    )
    assert latents[0].shape == (2, 9, 512 + 64)
    forward = models.make_forward(cfg, batch=2, seq_len=5, prefix_len=9, attention=attention)
    got_new, _ = forward(params, jnp.asarray(ids[:, 9:].numpy()), latents)
    assert float(abs(np.asarray(got_new) - want_new).max()) < 1e-4


def _tiny_config(rope: int, v_head_dim: int):
    """A 1-layer, 2-head :class:`mla_bridge_jax.models.DeepseekConfig` (q/k nope 16, kv_lora_rank 32), built
    directly."""
    from mla_bridge_jax import models

    dims = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope, v_head_dim=v_head_dim)
    return models.DeepseekConfig(
        vocab_size=8, hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2, q_lora_rank=None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope, v_head_dim=v_head_dim, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope=None, dims=dims,
    )  # fmt: skip


def test_jax_model_refuses_v_wider_than_qk_for_padded_attention():
    """``"xla"`` / ``"cudnn"`` pad v to the q/k head dim; a v wider than q/k is refused by name (mla_bridge takes it)."""
    from mla_bridge_jax import models

    cfg = _tiny_config(rope=0, v_head_dim=32)
    for attention in ("xla", "cudnn"):
        with pytest.raises(ValueError, match="needs v_head_dim <= qk_nope_head_dim"):
            models.make_forward(cfg, batch=1, seq_len=3, attention=attention)
    assert callable(models.make_forward(cfg, batch=1, seq_len=3, attention="mla_bridge"))


@pytest.mark.parametrize(
    "moe",
    [
        dict(first_k_dense_replace=1, n_routed_experts=4),  # DeepSeek's way of naming MoE layers
        dict(mlp_layer_types=["dense", "sparse"]),  # glm4_moe_lite's
    ],
)
def test_jax_model_refuses_moe_layers_by_name(moe):
    """MoE layers, however the config names them, are refused when the config is read (this model has dense MLPs
    only); before, glm4_moe_lite's ``mlp_layer_types`` was not read and loading failed later on a missing weight."""
    from mla_bridge_jax import models

    config = dict(
        model_type="glm4_moe_lite", vocab_size=8, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="MoE"):
        models.DeepseekConfig.from_dict(dict(config, **moe))
    assert models.DeepseekConfig.from_dict(config).num_layers == 2


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(batch=0), "batch"),
        (dict(batch=2.0), "batch"),
        (dict(seq_len=0), "seq_len"),
        (dict(prefix_len=-1), "prefix_len"),
        (dict(logits_to_keep=-1), "logits_to_keep"),
        (dict(logits_to_keep=4), "logits_to_keep"),
    ],
)
def test_make_forward_refuses_bad_sizes_by_name(bad, name):
    """Sizes are checked when the forward is made, each error naming its argument (before: a ZeroDivisionError from
    inside JAX at call time, shape errors, or a logits_to_keep quietly clipped)."""
    from mla_bridge_jax import models

    cfg = _tiny_config(rope=8, v_head_dim=16)
    args = dict(batch=1, seq_len=3, attention="noop") | bad
    with pytest.raises(ValueError, match=name):
        models.make_forward(cfg, **args)
    assert callable(models.make_forward(cfg, batch=1, seq_len=3, attention="noop", logits_to_keep=3))


def test_missing_head_is_named(glm_checkpoint):
    """params without ``lm_head`` where the config does not tie it: a ValueError naming it (a KeyError before)."""
    from mla_bridge_jax import models

    folder, _ = glm_checkpoint
    cfg = models.DeepseekConfig.from_hf_config(folder)
    params = dict(models.load_params(folder))
    params.pop("lm_head", None)
    forward = models.make_forward(cfg, batch=1, seq_len=3, attention="noop")
    ids = jnp.zeros((1, 3), jnp.int32)
    if cfg.tie_word_embeddings:
        assert forward(params, ids)[0].shape == (1, 3, cfg.vocab_size)
    else:
        with pytest.raises(ValueError, match="lm_head"):
            forward(params, ids)
