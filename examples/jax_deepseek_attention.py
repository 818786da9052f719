"""A DeepSeek-V2/V3 MLA attention layer in JAX whose prefill attention runs through mla_bridge_jax.mla_prefill.

    python examples/jax_deepseek_attention.py path/to/checkpoint [--layer 0]

Plain JAX functions over a weight pytree (a dict of jax.Arrays), loaded from a transformers checkpoint
(``config.json`` + ``model.safetensors``, sharded or not) with ``safetensors.flax``. One call of the layer:

  1. q: ``q_proj`` (DeepSeek-V2-Lite) or ``q_a_proj -> q_a_layernorm -> q_b_proj`` (V2, V3), viewed ``[T, H, 192]``;
  2. latents: ``kv_a_proj_with_mqa`` gives ``[T, 512 + 64]``; ``kv_a_layernorm`` (RMSNorm) on the first 512 gives kv_c,
     the last 64 are k_pe;
  3. YaRN RoPE on q's last 64 dims and on k_pe, in DeepSeek's layout as transformers 5 does it
     (``modeling_deepseek_v2.apply_rotary_emb``: adjacent pairs rotated, output interleaved; ``modeling_deepseek_v3.
     apply_rotary_pos_emb_interleave``: adjacent pairs rotated, output as [evens | odds]; V3 with
     ``rope_interleave=False``: rotate-half), cos/sin multiplied by YaRN's attention factor
     ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (transformers' ``_compute_yarn_parameters``);
  4. the new tokens' latents ``kv_c ++ k_pe`` written into the paged latent cache ``[num_blocks, block_size, 576]``
     at their slots;
  5. ``mla_bridge_jax.mla_prefill`` (causal among the new tokens, all of each request's cached context) with the
     softmax scale of :meth:`mla_bridge.MLADims.from_hf_config` (192**-0.5 times YaRN's mscale_all_dim factor squared);
  6. ``o_proj``.

Steps 1-6 run inside one ``jax.jit``; the plan (host lengths) is made outside the trace with
``mla_bridge_jax.build_plan`` and closed over, as the adapter requires. tests/models/test_jax_layer.py checks the
output after o_proj against transformers' own attention layer on the same checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import mla_bridge_jax as mj
from mla_bridge_jax.models import LATENT_NORM_EPS, apply_rope, rope_inv_freq  # RoPE as transformers computes it
from mla_bridge import MLADims

__all__ = [
    "DeepseekAttentionConfig",
    "load_attention_weights",
    "rope_inv_freq",
    "apply_rope",
    "PagedLatentCache",
    "make_prefill_step",
]


@dataclass(frozen=True)
class DeepseekAttentionConfig:
    """The attention fields of a DeepSeek-V2/V3 ``config.json`` (as transformers 5 writes it, or DeepSeek's own).

    ``rope_layout``: "interleaved" (deepseek_v2), "interleaved_to_half" (deepseek_v3, ``rope_interleave`` true, its
    default) or "half" (deepseek_v3 with ``rope_interleave`` false). ``rope``: the RoPE scaling entry
    (``rope_parameters`` or ``rope_scaling``) or ``None``.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_theta: float
    rope: Optional[dict]
    rope_layout: str
    dims: MLADims

    @classmethod
    def from_hf_config(cls, path: "str | os.PathLike") -> "DeepseekAttentionConfig":
        """Read ``config.json`` (a path to the file or its folder)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
        rope = c.get("rope_parameters") or c.get("rope_scaling")
        kind = None if not rope else rope.get("rope_type", rope.get("type"))
        theta = float((rope or {}).get("rope_theta", c.get("rope_theta", 10000.0)))
        if c.get("model_type") == "deepseek_v2":
            layout = "interleaved"
        else:
            layout = "interleaved_to_half" if c.get("rope_interleave", True) else "half"
        return cls(
            hidden_size=c["hidden_size"],
            num_heads=c["num_attention_heads"],
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"],
            attention_bias=bool(c.get("attention_bias", False)),
            rope_theta=theta,
            rope=None if kind in (None, "default") else dict(rope),
            rope_layout=layout,
            dims=MLADims.from_hf_config(c),
        )


def _safetensors_files(folder: str) -> dict[str, str]:
    """tensor name -> file, for ``model.safetensors`` or a sharded checkpoint's ``model.safetensors.index.json``."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            return {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    return {None: os.path.join(folder, "model.safetensors")}


_PARAMS = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)


def load_attention_weights(folder: "str | os.PathLike", layer: int = 0, dtype: Any = jnp.float32) -> dict:
    """The attention weights of decoder layer ``layer`` as a pytree ``{"q_proj": {"weight": ...}, ...}`` of
    jax.Arrays in ``dtype`` (the modules the checkpoint has: q_proj, or q_a_proj / q_a_layernorm / q_b_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; biases when ``attention_bias``). Linear weights keep
    torch's ``[out, in]`` layout."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    prefix = f"model.layers.{layer}.self_attn."
    files = _safetensors_files(folder)
    wanted: dict[str, list[str]] = {}
    if None in files:
        with safe_open(files[None], framework="flax") as f:
            names = [k for k in f.keys() if k.startswith(prefix)]
        wanted[files[None]] = names
    else:
        for k, file in files.items():
            if k.startswith(prefix):
                wanted.setdefault(file, []).append(k)
    params: dict = {}
    for file, names in wanted.items():
        with safe_open(file, framework="flax") as f:
            for k in names:
                module, leaf = k[len(prefix) :].rsplit(".", 1)
                if module in _PARAMS:
                    params.setdefault(module, {})[leaf] = jnp.asarray(f.get_tensor(k), dtype=dtype)
    if not params:
        raise ValueError(f"{folder}: no tensors named {prefix}* (is this a DeepSeek-V2/V3 checkpoint with that layer?)")
    return params


def _linear(p: dict, x: jax.Array) -> jax.Array:
    y = x @ p["weight"].T
    return y + p["bias"] if "bias" in p else y


def _rms_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """DeepseekV2RMSNorm: variance in float32, ``weight * (x / sqrt(mean(x^2) + eps))`` cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return p["weight"] * xf.astype(x.dtype)


class PagedLatentCache:
    """Host bookkeeping of a paged latent cache: a free list of blocks and each request's block_table row.

    The cache itself is a jax.Array ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (:meth:`empty`),
    owned by the caller and returned updated by each prefill step.
    """

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_request: int):
        self.num_blocks, self.block_size, self.max_blocks = num_blocks, block_size, max_blocks_per_request
        self._free = list(range(num_blocks))
        self.tables: dict[Any, list[int]] = {}

    def empty(self, dims: MLADims, dtype: Any = jnp.float32, fill: float = float("nan")) -> jax.Array:
        """A cache with every slot ``fill`` (NaN by default: reading a slot never written shows up)."""
        return jnp.full((self.num_blocks, self.block_size, dims.latent_dim), fill, dtype=dtype)

    def reserve(self, request: Any, num_tokens: int) -> None:
        """Give ``request`` enough blocks for ``num_tokens`` tokens in all (raises MemoryError when full)."""
        row = self.tables.setdefault(request, [])
        need = -(-num_tokens // self.block_size) - len(row)
        if need > len(self._free) or len(row) + need > self.max_blocks:
            raise MemoryError(f"PagedLatentCache: no room for {num_tokens} tokens of request {request!r}")
        row.extend(self._free.pop(0) for _ in range(max(need, 0)))

    def block_table(self, requests: Sequence[Any]) -> np.ndarray:
        """int32 ``[len(requests), max_blocks]``, padded with -1."""
        table = np.full((len(requests), self.max_blocks), -1, dtype=np.int32)
        for i, r in enumerate(requests):
            row = self.tables.get(r, [])
            table[i, : len(row)] = row
        return table

    def slots(self, requests: Sequence[Any], starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
        """int32 flat slot ``block * block_size + offset`` of tokens ``starts[i] .. starts[i] + counts[i]`` of each
        request, packed in order (where a prefill step writes its new latents)."""
        out = []
        for r, s, n in zip(requests, starts, counts):
            pos = np.arange(s, s + n)
            row = np.asarray(self.tables[r], dtype=np.int64)
            out.append(row[pos // self.block_size] * self.block_size + pos % self.block_size)
        return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)


def make_prefill_step(cfg: DeepseekAttentionConfig, plan, *, donate_cache: bool = True):
    """A jitted prefill step of one attention layer for one planned batch.

    Args:
        cfg: the layer's :class:`DeepseekAttentionConfig`.
        plan: ``mla_bridge_jax.build_plan(query_lens, context_lens, dims=cfg.dims, block_size=..., dtype=...)``,
            made outside the trace (host lengths) and closed over.

    Returns:
        ``step(params, hidden [T, hidden_size], positions [T] int32, slots [T] int32, kv_cache, block_table)
        -> (out [T, hidden_size], kv_cache with the new latents written)``, requests packed in the plan's order;
        ``positions`` are each token's position in its request (context_len + i), ``slots`` from
        :meth:`PagedLatentCache.slots`. The cache argument is donated unless ``donate_cache=False``.
    """
    inv_freq_np, attention_factor = rope_inv_freq(cfg)
    h, nope, rope, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank

    def step(params, hidden, positions, slots, kv_cache, block_table):
        t = hidden.shape[0]
        inv_freq = jnp.asarray(inv_freq_np)
        if "q_proj" in params:
            q = _linear(params["q_proj"], hidden)
        else:
            q = _linear(
                params["q_b_proj"],
                _rms_norm(params["q_a_layernorm"], _linear(params["q_a_proj"], hidden), LATENT_NORM_EPS),
            )
        q = q.reshape(t, h, nope + rope)
        q_pe = apply_rope(q[..., nope:], positions, inv_freq, attention_factor, cfg.rope_layout)
        q = jnp.concatenate([q[..., :nope], q_pe], axis=-1)
        ckv = _linear(params["kv_a_proj_with_mqa"], hidden)
        kv_c = _rms_norm(params["kv_a_layernorm"], ckv[:, :rank], LATENT_NORM_EPS)
        k_pe = apply_rope(ckv[:, rank:], positions, inv_freq, attention_factor, cfg.rope_layout)
        flat = kv_cache.reshape(-1, kv_cache.shape[-1])
        kv_cache = flat.at[slots].set(jnp.concatenate([kv_c, k_pe], axis=-1).astype(flat.dtype)).reshape(kv_cache.shape)
        attn = mj.mla_prefill(q, kv_c, k_pe, params["kv_b_proj"]["weight"], kv_cache, block_table, plan)
        return _linear(params["o_proj"], attn.reshape(t, h * cfg.v_head_dim)), kv_cache

    return jax.jit(step, donate_argnums=(4,) if donate_cache else ())


def _demo(folder: str, layer: int) -> None:
    """Prefill two requests, then continue one of them over its cached prefix, printing output norms."""
    cfg = DeepseekAttentionConfig.from_hf_config(folder)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    params = load_attention_weights(folder, layer, dtype)
    pages = PagedLatentCache(num_blocks=64, block_size=16, max_blocks_per_request=16)
    cache = pages.empty(cfg.dims, dtype)
    key = jax.random.PRNGKey(0)
    for step_no, (lens, ctx) in enumerate([((40, 23), (0, 0)), ((9, 0), (40, 23))]):
        reqs = [r for r, n in zip(("a", "b"), lens) if n]
        q_lens = [n for n in lens if n]
        c_lens = [c for c, n in zip(ctx, lens) if n]
        for r, c, n in zip(reqs, c_lens, q_lens):
            pages.reserve(r, c + n)
        plan = mj.build_plan(q_lens, c_lens, dims=cfg.dims, block_size=pages.block_size, dtype=dtype)
        step = make_prefill_step(cfg, plan)
        key, sub = jax.random.split(key)
        hidden = jax.random.normal(sub, (sum(q_lens), cfg.hidden_size), dtype)
        positions = jnp.asarray(np.concatenate([np.arange(c, c + n) for c, n in zip(c_lens, q_lens)]), jnp.int32)
        out, cache = step(
            params,
            hidden,
            positions,
            jnp.asarray(pages.slots(reqs, c_lens, q_lens)),
            cache,
            jnp.asarray(pages.block_table(reqs)),
        )
        print(
            f"step {step_no}: requests {reqs} new {q_lens} context {c_lens} -> out {out.shape}, "
            f"norm {float(jnp.linalg.norm(out.astype(jnp.float32))):.4f}, backend {plan.backend.name}"
        )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="folder with config.json and model.safetensors (a DeepSeek-V2/V3 model)")
    parser.add_argument("--layer", type=int, default=0)
    args = parser.parse_args()
    _demo(args.checkpoint, args.layer)
