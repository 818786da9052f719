"""A small DeepSeek-V2 causal LM in plain JAX over a weight pytree, for prefill: its attention through
:mod:`mla_bridge_jax` or through ``jax.nn.dot_product_attention``.

::

    from mla_bridge_jax import models
    cfg = models.DeepseekConfig.from_hf_config(folder)          # a transformers save_pretrained folder
    params = models.load_params(folder, dtype=jnp.bfloat16)     # safetensors -> pytree of jax.Arrays
    forward = models.make_forward(cfg, batch=4, seq_len=10000, attention="mla_bridge")
    logits, latents = forward(params, input_ids)                # [B, L, vocab] (float32), one jax.jit

The model (transformers 5's ``modeling_deepseek_v2``, dense layers only: ``first_k_dense_replace`` >= layers, and
for glm4_moe_lite ``mlp_layer_types`` all ``"dense"``):
embedding; per layer ``x + attn(rms_norm(x))`` then ``x + mlp(rms_norm(x))`` with ``mlp = down(silu(gate(x)) *
up(x))``; final RMSNorm; ``lm_head`` (the embedding where the config ties them). Attention: q from ``q_proj`` (or
``q_a_proj -> q_a_layernorm -> q_b_proj``) viewed ``[B, L, H, 192]``; the latents from ``kv_a_proj_with_mqa``
(``kv_a_layernorm`` on the first kv_lora_rank, the last 64 are k_pe; the two latent norms at eps 1e-6, the config's
``rms_norm_eps`` for the others, as transformers builds them); RoPE (YaRN as transformers computes it, in the model
type's layout: :func:`apply_rope`) on q's last 64 and on k_pe; k and v from ``kv_b_proj`` (k = k_nope ++ k_pe
broadcast to every head), causal softmax attention with the scale of :meth:`mla_bridge.MLADims.from_hf_config`;
``o_proj``. A cached prefix (``prefix_len`` > 0): the first
``prefix_len`` tokens' latents are given (``cache``: per layer ``[B, P, kv_lora_rank + 64]``, as
:func:`make_forward` returns them) and only the new tokens are computed, bottom-right causal over prefix + new.

Attention implementations (``attention=``):

* ``"mla_bridge"``: :func:`mla_bridge_jax.run_ragged` over the batch packed ``[B * L, H, D]`` (B requests of equal
  length), its plan made outside the trace by :func:`make_forward` and closed over (one plan, every layer).
* ``"cudnn"`` / ``"xla"``: ``jax.nn.dot_product_attention(..., is_causal=True, implementation=...)``, v padded with
  zeros to 192 (the head dims must agree) and the output sliced back to 128; ``"xla"`` materialises float32 scores
  ``[B, H, L, L]``. A cached prefix goes through an explicit bottom-right causal mask (cuDNN and XLA both take one).
* ``"noop"``: zeros of the output's shape: the model's time outside attention.

The MLA dims come from the config (:meth:`DeepseekConfig.from_dict`), none is assumed: the 192 / 128 / 64 above are
DeepSeek's, and a glm4_moe_lite checkpoint (GLM-4.7-Flash: q/k 192+64, v 256, ``rope_interleave``, dense layers)
reads and runs the same way (``tests/jax/test_jax_model_dims.py``); v is padded to the q/k head dim for ``"cudnn"`` /
``"xla"``, so those two need ``v_head_dim <= qk_nope_head_dim + qk_rope_head_dim`` (every MLA model type of
transformers).

float32 logits. Inference only (the mla_bridge path has no derivative).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mla_bridge import MLADims
from mla_bridge.checks import positive_int

__all__ = [
    "DeepseekConfig",
    "load_params",
    "params_from_state_dict",
    "make_forward",
    "attention_inputs",
    "attention_fn",
    "apply_rope",
    "ATTENTIONS",
    "ROPE_LAYOUTS",
    "LATENT_NORM_EPS",
]

ATTENTIONS = ("mla_bridge", "cudnn", "xla", "noop")
#: How RoPE pairs and writes back the rotated dims (:func:`apply_rope`).
ROPE_LAYOUTS = ("interleaved", "interleaved_to_half", "half")
#: The eps of ``q_a_layernorm`` and ``kv_a_layernorm``: transformers builds them with its RMSNorm's default
#: (``modeling_deepseek_v2`` / ``_v3``, ``modeling_glm4_moe_lite``), whatever the config's ``rms_norm_eps``.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DeepseekConfig:
    """The fields of a DeepSeek-V2 ``config.json`` the model reads (as transformers 5 writes it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope: Optional[dict]
    dims: MLADims
    #: :data:`ROPE_LAYOUTS`: how transformers' model type pairs and writes back the RoPE dims.
    rope_layout: str = "interleaved"
    #: ``lm_head`` is the embedding (``save_pretrained`` then writes no ``lm_head.weight``).
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, c: dict) -> "DeepseekConfig":
        """From a config dict (``config.json``, or ``transformers_config.to_dict()``).

        Raises:
            ValueError: MoE layers (``first_k_dense_replace`` < layers, or a ``"sparse"`` entry of
                ``mlp_layer_types``): this model has dense MLPs only.
        """
        layers = int(c["num_hidden_layers"])
        if int(c.get("first_k_dense_replace", layers) or 0) < layers and c.get("n_routed_experts"):
            raise ValueError(
                f"first_k_dense_replace={c.get('first_k_dense_replace')} < num_hidden_layers={layers}: "
                f"MoE layers are not implemented here (dense MLPs only)"
            )
        if "sparse" in (c.get("mlp_layer_types") or ()):
            raise ValueError(
                f"mlp_layer_types={c['mlp_layer_types']}: MoE ('sparse') layers are not implemented here (dense MLPs "
                f"only)"
            )
        if c.get("model_type") == "deepseek_v2":
            layout = "interleaved"  # modeling_deepseek_v2.apply_rotary_emb
        else:  # deepseek_v3 and its kin: apply_rotary_pos_emb_interleave, or rotate_half without rope_interleave
            layout = "interleaved_to_half" if c.get("rope_interleave", True) else "half"
        rope = c.get("rope_parameters") or c.get("rope_scaling")
        kind = None if not rope else rope.get("rope_type", rope.get("type"))
        theta = float((rope or {}).get("rope_theta", c.get("rope_theta", 10000.0)))
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=layers,
            num_heads=c["num_attention_heads"],
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"],
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope=None if kind in (None, "default") else dict(rope),  # type: ignore[arg-type]  # kind: a rope
            dims=MLADims.from_hf_config(c),
            rope_layout=layout,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_hf_config(cls, path: "str | os.PathLike") -> "DeepseekConfig":
        """Read ``config.json`` (a path to the file or its folder)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _nest(flat: dict, dtype: Any) -> dict:
    """``{"model.layers.0.mlp.up_proj.weight": array}`` -> nested dicts ``params["model"]["layers"]["0"]...``."""
    params: dict = {}
    for name, x in flat.items():
        node = params
        *path, leaf = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(x, dtype=dtype)
    return params


def load_params(folder: "str | os.PathLike", dtype: Any = jnp.float32) -> dict:
    """Every tensor of a ``save_pretrained`` folder (``model.safetensors`` or a sharded index) as a nested pytree of
    jax.Arrays in ``dtype``, keyed by the names' dotted parts (linear weights in torch's ``[out, in]`` layout)."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    flat = {}
    for file in files:
        with safe_open(os.path.join(folder, file), framework="flax") as f:
            for k in f.keys():
                flat[k] = f.get_tensor(k)
    return _nest(flat, dtype)


def params_from_state_dict(state_dict: dict, dtype: Any = jnp.float32) -> dict:
    """A torch model's ``state_dict()`` as :func:`load_params` gives it (through float32 host copies)."""
    return _nest({k: v.detach().float().cpu().numpy() for k, v in state_dict.items()}, dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: DeepseekConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq [rope_dim / 2] float32, attention_factor)``: plain, linear or YaRN RoPE as transformers 5
    computes it (``modeling_rope_utils._compute_yarn_parameters``)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if cfg.rope is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    r = cfg.rope
    kind = r.get("rope_type", r.get("type"))
    factor = float(r["factor"])
    if kind == "linear":
        return (1.0 / (factor * pos_freqs)).astype(np.float32), 1.0
    if kind != "yarn":
        raise NotImplementedError(f"RoPE type {kind!r}: default, linear and yarn are implemented")
    mscale, mscale_all_dim = r.get("mscale"), r.get("mscale_all_dim")
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else _yarn_mscale(factor)
        )
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1
    original = r["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)
    return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    attention_factor: float,
    layout: str = "interleaved",
    axis: int = 0,
) -> jax.Array:
    """RoPE on ``x [..., rope_dim]`` at ``positions [L]`` (the positions of ``x``'s axis ``axis``), in float32,
    returned in x's dtype; cos and sin are multiplied by ``attention_factor``.

    ``layout`` (:data:`ROPE_LAYOUTS`): "interleaved" / "interleaved_to_half": pairs ``(x[2i], x[2i+1])`` rotated by
    frequency ``i``, written back interleaved (transformers' ``modeling_deepseek_v2.apply_rotary_emb``) or as
    ``[rotated evens | rotated odds]`` (``modeling_deepseek_v3.apply_rotary_pos_emb_interleave``); "half": ``x[i]``
    paired with ``x[i + rope_dim / 2]`` (``rotate_half``, DeepSeek-V3 with ``rope_interleave`` false).

    Raises:
        ValueError: an unknown ``layout``.
    """
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [L, rope/2]
    shape = (1,) * axis + (x.shape[axis],) + (1,) * (x.ndim - axis - 2) + (angle.shape[-1],)
    cos, sin = (jnp.cos(angle) * attention_factor).reshape(shape), (jnp.sin(angle) * attention_factor).reshape(shape)
    xf = x.astype(jnp.float32)
    if layout == "half":
        x1, x2 = xf[..., : xf.shape[-1] // 2], xf[..., xf.shape[-1] // 2 :]
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if layout == "interleaved":
        return jnp.stack([r1, r2], axis=-1).reshape(xf.shape).astype(x.dtype)
    return jnp.concatenate([r1, r2], axis=-1).astype(x.dtype)


def _nonnegative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _linear(p: dict, x: jax.Array) -> jax.Array:
    y = x @ p["weight"].T
    return y + p["bias"] if "bias" in p else y


def _rms_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return p["weight"] * xf.astype(x.dtype)


def attention_fn(
    cfg: DeepseekConfig, attention: str, batch: int, new: int, prefix: int, dtype: Any, backend: Optional[str] = None
) -> Callable:
    """The model's attention alone, as :func:`make_forward` uses it: ``attend(q [B, L, H, Dqk], k [B, P + L, H,
    Dqk], v [B, P + L, H, Dv]) -> [B, L, H, Dv]`` (DeepSeek: Dqk 192, Dv 128), bottom-right causal, with the softmax
    scale of ``cfg.dims``; traceable (call it inside ``jax.jit``).

    Args:
        cfg: the model's config.
        attention: one of :data:`ATTENTIONS` (module docstring).
        batch, new, prefix: rows ``B``, new tokens per row ``L`` and cached tokens per row ``P``.
        dtype: q / k / v's dtype (the mla_bridge plan's).
        backend: the mla_bridge core backend (default: its dispatch).

    Returns:
        ``attend``; for ``"mla_bridge"`` its plan (made here, from the host lengths) is ``attend.plan`` and lives as
        long as the function.

    Raises:
        ValueError: an unknown ``attention``; ``"cudnn"`` / ``"xla"`` with ``v_head_dim`` above the q/k head dim;
            the core's errors when planning (named).
    """
    h, d_v, scale = cfg.num_heads, cfg.v_head_dim, cfg.dims.softmax_scale
    total = prefix + new
    if attention == "mla_bridge":
        import mla_bridge_jax as mj

        qo = np.arange(batch + 1, dtype=np.int32) * new
        kv = np.arange(batch + 1, dtype=np.int32) * total
        plan = mj.plan_ragged(
            qo,
            kv,
            num_heads=h,
            head_dim_qk=q_dim(cfg),
            head_dim_vo=d_v,
            causal=True,
            sm_scale=scale,
            dtype=dtype,
            backend=backend,
        )

        def attend(q, k, v):
            out, _ = mj.run_ragged(
                plan, q.reshape(batch * new, h, -1), k.reshape(batch * total, h, -1), v.reshape(batch * total, h, d_v)
            )
            return out.reshape(batch, new, h, d_v)

        attend.plan = plan  # type: ignore[attr-defined]  # kept alive with the function
        return attend
    if attention in ("cudnn", "xla"):
        if d_v > q_dim(cfg):
            raise ValueError(
                f"attention={attention!r} pads v to the q/k head dim, so it needs v_head_dim <= qk_nope_head_dim + "
                f"qk_rope_head_dim, got {d_v} > {q_dim(cfg)}; use attention='mla_bridge'"
            )
        mask = None
        if prefix:
            mask = jnp.asarray(np.tril(np.ones((new, total), dtype=bool), prefix))[None, None]

        def attend(q, k, v):
            vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - d_v)))
            out = jax.nn.dot_product_attention(
                q, k, vp, scale=scale, is_causal=not prefix, mask=mask, implementation=attention
            )
            return out[..., :d_v]

        return attend
    if attention == "noop":

        def attend(q, k, v):
            # XLA drops work whose result nothing reads: without the barrier the no-op model would skip q_proj and
            # kv_b_proj too, and "the model's time outside attention" would leave them out
            q, k, v = jax.lax.optimization_barrier((q, k, v))
            return jnp.zeros(q.shape[:3] + (d_v,), q.dtype) + 0 * (q[:, :, :, :1] + k[:, :1, :, :1] + v[:, :1, :, :1])

        return attend
    raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")


def q_dim(cfg: DeepseekConfig) -> int:
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def _attention_inputs_fn(cfg: DeepseekConfig) -> Callable:
    """``qkv(attn_params, hs [B, L, hidden], positions [L], cached) -> (q [B, L, H, Dqk], k [B, P + L, H, Dqk],
    kv [B, P + L, H, nope + Dv], latent [B, P + L, kv_lora_rank + rope])``: what one layer hands its attention (v is
    ``kv[..., nope:]``), from the normed hidden states."""
    inv_freq_np, attention_factor = rope_inv_freq(cfg)
    h, nope, rope, rank, d_v = (
        cfg.num_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.kv_lora_rank,
        cfg.v_head_dim,
    )

    inv_freq = jnp.asarray(inv_freq_np)

    def rope_of(x, positions):  # x [B, L, ..., rope_dim]
        return apply_rope(x, positions, inv_freq, attention_factor, cfg.rope_layout, axis=1)

    def qkv(a, hs, positions, cached):
        b, length = hs.shape[:2]
        if "q_proj" in a:
            q = _linear(a["q_proj"], hs)
        else:
            q = _linear(a["q_b_proj"], _rms_norm(a["q_a_layernorm"], _linear(a["q_a_proj"], hs), LATENT_NORM_EPS))
        q = q.reshape(b, length, h, nope + rope)
        q = jnp.concatenate([q[..., :nope], rope_of(q[..., nope:], positions)], axis=-1)
        ckv = _linear(a["kv_a_proj_with_mqa"], hs)
        latent = jnp.concatenate(
            [
                _rms_norm(a["kv_a_layernorm"], ckv[..., :rank], LATENT_NORM_EPS),
                rope_of(ckv[..., rank:], positions),
            ],
            axis=-1,
        )
        if cached is not None:
            latent = jnp.concatenate([cached.astype(latent.dtype), latent], axis=1)
        total = latent.shape[1]
        kv = _linear(a["kv_b_proj"], latent[..., :rank]).reshape(b, total, h, nope + d_v)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(latent[:, :, None, rank:], (b, total, h, rope))], axis=-1)
        return q, k, kv, latent

    return qkv


def attention_inputs(
    cfg: DeepseekConfig, params: dict, input_ids: jax.Array, cache: Optional[list] = None, *, prefix_len: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The q, k and v the model hands its first layer's attention, as :func:`make_forward`'s model computes them:
    ``q [B, L, H, Dqk]``, ``k [B, P + L, H, Dqk]``, ``v [B, P + L, H, Dv]`` (``P = prefix_len``; ``cache`` as for
    :func:`make_forward`), contiguous, in the params' dtype. The bench times each attention alone on these."""
    qkv = _attention_inputs_fn(cfg)
    nope = cfg.qk_nope_head_dim

    @jax.jit
    def first(params, input_ids, cached):
        layer = params["model"]["layers"]["0"]
        x = params["model"]["embed_tokens"]["weight"][input_ids]
        positions = jnp.arange(prefix_len, prefix_len + input_ids.shape[1], dtype=jnp.int32)
        q, k, kv, _ = qkv(
            layer["self_attn"], _rms_norm(layer["input_layernorm"], x, cfg.rms_norm_eps), positions, cached
        )
        return q, k, kv[..., nope:]

    return first(params, input_ids, None if cache is None else cache[0])


def _check_forward_inputs(
    cfg: DeepseekConfig,
    model: dict,
    input_ids: Any,
    cache: Optional[list],
    batch: int,
    seq_len: int,
    prefix_len: int,
    dtype: Any,
) -> None:
    """:func:`make_forward`'s argument checks, on the static shapes and dtypes at trace time."""
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if tuple(input_ids.shape) != (batch, seq_len):
        raise ValueError(
            f"input_ids must be [batch={batch}, seq_len={seq_len}] (the shape this forward was made for), "
            f"got {list(input_ids.shape)}"
        )
    embed = model["embed_tokens"]["weight"]
    if embed.dtype != jnp.dtype(dtype):
        raise ValueError(
            f"params are {embed.dtype} but this forward was made with dtype={jnp.dtype(dtype)}: load them with "
            f"load_params(..., dtype) / params_from_state_dict(..., dtype) of the same dtype"
        )
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if prefix_len == 0:
        if cache is not None:
            raise ValueError("cache must be None: this forward was made with prefix_len=0 (no cached tokens)")
        return
    if cache is None or len(cache) != cfg.num_layers:
        got = "None" if cache is None else f"{len(cache)} entries"
        raise ValueError(
            f"cache must be a list of {cfg.num_layers} per-layer latents (prefix_len={prefix_len}), got {got}"
        )
    want = (batch, prefix_len, width)
    for i, c in enumerate(cache):
        if tuple(c.shape) != want:
            raise ValueError(
                f"cache[{i}] must be {list(want)} [batch, prefix_len, kv_lora_rank + rope], got {list(c.shape)}"
            )


def make_forward(
    cfg: DeepseekConfig,
    *,
    batch: int,
    seq_len: int,
    attention: str = "mla_bridge",
    prefix_len: int = 0,
    dtype: Any = jnp.float32,
    backend: Optional[str] = None,
    logits_to_keep: int = 0,
) -> Callable:
    """A jitted prefill ``forward(params, input_ids [B, L] int32, cache=None) -> (logits, new_cache)`` for batches of
    ``batch`` rows of ``seq_len`` new tokens over ``prefix_len`` cached ones.

    Args:
        attention: one of :data:`ATTENTIONS` (module docstring).
        prefix_len: tokens per row already cached: ``cache`` is then a list (per layer) of ``[B, prefix_len,
            kv_lora_rank + qk_rope_head_dim]`` latents (RoPE applied to the last part), as ``new_cache`` returns them.
        dtype: the activations' and q/k/v's dtype (the params' dtype).
        backend: the mla_bridge core backend (default: its dispatch).
        logits_to_keep: 0: logits of every position; n: of the last n only.

    Returns:
        ``forward``: logits float32 ``[B, L or logits_to_keep, vocab]`` and the per-layer latents of prefix + new
        tokens. The mla_bridge plan is made here (host lengths), outside the trace.

    Token ids are not range-checked under ``jax.jit``: JAX's indexing clamps one outside ``[0, vocab_size)``.

    Raises:
        ValueError: ``batch`` or ``seq_len`` not a positive int, ``prefix_len`` not a non-negative int,
            ``logits_to_keep`` not an int in ``[0, seq_len]`` (named); an unknown ``attention``; ``"cudnn"`` /
            ``"xla"`` with ``v_head_dim`` above the q/k head dim; the core's errors when planning (named). When
            ``forward`` is traced (before any work): ``input_ids`` not ``[batch, seq_len]``, ``cache`` missing,
            given or of the wrong shape for ``prefix_len``, params of another dtype than ``dtype``, no
            ``lm_head`` where the config does not tie it (ValueError); ``input_ids`` not integers (TypeError).
    """
    batch, seq_len = positive_int("batch", batch), positive_int("seq_len", seq_len)
    prefix_len, logits_to_keep = (
        _nonnegative_int("prefix_len", prefix_len),
        _nonnegative_int("logits_to_keep", logits_to_keep),
    )
    if logits_to_keep > seq_len:
        raise ValueError(f"logits_to_keep must be at most seq_len={seq_len}, got {logits_to_keep}")
    attend = attention_fn(cfg, attention, batch, seq_len, prefix_len, dtype, backend)
    h, nope, d_v, eps = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.rms_norm_eps
    qkv = _attention_inputs_fn(cfg)

    def layer(p, x, positions, cached):
        b, length = x.shape[:2]
        a = p["self_attn"]
        q, k, kv, latent = qkv(a, _rms_norm(p["input_layernorm"], x, eps), positions, cached)
        out = attend(q, k, kv[..., nope:])
        x = x + _linear(a["o_proj"], out.reshape(b, length, h * d_v))
        m = p["mlp"]
        hs = _rms_norm(p["post_attention_layernorm"], x, eps)
        x = x + _linear(m["down_proj"], jax.nn.silu(_linear(m["gate_proj"], hs)) * _linear(m["up_proj"], hs))
        return x, latent

    def forward(params, input_ids, cache=None):
        model = params["model"]
        _check_forward_inputs(cfg, model, input_ids, cache, batch, seq_len, prefix_len, dtype)
        if not cfg.tie_word_embeddings and "lm_head" not in params:
            raise ValueError("params have no 'lm_head' and the config does not tie it to the embedding")
        x = model["embed_tokens"]["weight"][input_ids]
        positions = jnp.arange(prefix_len, prefix_len + input_ids.shape[1], dtype=jnp.int32)
        latents = []
        for i in range(cfg.num_layers):
            x, latent = layer(model["layers"][str(i)], x, positions, None if cache is None else cache[i])
            latents.append(latent)
        x = _rms_norm(model["norm"], x, eps)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        head = model["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
        return _linear(head, x).astype(jnp.float32), latents

    jitted = jax.jit(forward)
    jitted.attend = attend  # type: ignore[attr-defined]  # the plan lives as long as the function
    return jitted
