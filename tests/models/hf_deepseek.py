"""Small random DeepSeek-V2/V3 checkpoints written by transformers itself, and capture of the tensors its attention
layers hand to their attention function.

Nothing here computes attention: the reference is transformers' own ``DeepseekV2Attention`` / ``DeepseekV3Attention``
(its eager attention function), and the tensors mla_bridge takes are captured from transformers' modules:

* q after RoPE: the ``query`` argument transformers passes to its attention function (a capturing function
  registered in transformers' ``AttentionInterface``, which then calls transformers' own eager function);
* kv_c after ``kv_a_layernorm``: the output of that module (a forward hook), for every call (prefix, then new tokens);
* k_pe after RoPE: the last ``qk_rope_head_dim`` of head 0 of the ``key`` transformers passes to its attention function
  (``expand_kv`` copies the shared k_pe into every head; the key covers the cached prefix too). This holds whether the
  cache keeps latents (transformers 5.24) or expanded keys;
* ``kv_b_proj.weight`` of the layer.

Configs carry the attention fields of DeepSeek's published config.json (V2-Lite: 16 heads, no q LoRA, YaRN mscale_all_dim
0.707; V3: 128 heads, q_lora_rank 1536, mscale_all_dim 1.0, interleaved RoPE) with a small hidden size and dense MLPs.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}
PUBLISHED = {  # the attention fields of deepseek-ai/DeepSeek-V2-Lite and deepseek-ai/DeepSeek-V3 config.json
    "v2-lite": dict(
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_theta=10000,
        rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    "v3": dict(
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_theta=10000,
        rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
}
CAPTURE_IMPL = "mla_bridge_test_capture"


def make_config(name: str, *, num_layers: int = 1, hidden_size: int = 256, vocab_size: int = 64, **overrides):
    """A transformers DeepseekV2Config (v2-lite) / DeepseekV3Config (v3): published attention fields, small body,
    dense MLPs only (``first_k_dense_replace`` = layers)."""
    import transformers

    cls = transformers.DeepseekV2Config if name == "v2-lite" else transformers.DeepseekV3Config
    fields = dict(
        PUBLISHED[name],
        hidden_size=hidden_size,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        first_k_dense_replace=num_layers,
        vocab_size=vocab_size,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        initializer_range=0.05,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if name == "v3":
        fields.update(n_group=1, topk_group=1)
    fields.update(overrides)
    return cls(**fields)


def write_checkpoint(name: str, folder, *, seed: int = 0, dtype=torch.float32, **config_kw):
    """A random model of ``make_config(name, **config_kw)`` saved with ``save_pretrained`` (config.json +
    model.safetensors) into ``folder``; returns the folder."""
    import transformers

    config = make_config(name, **config_kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return folder


def load(folder, attn_implementation: str = "eager", dtype=torch.float32, device: str = "cpu"):
    import transformers

    register_capture()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=attn_implementation, dtype=dtype
    )
    return model.to(device).eval()


@dataclass
class Call:
    """One attention-function call: transformers' q after RoPE ``[B, H, Q, qk_head_dim]``, its softmax scale, the
    attention mask it passed, and transformers' eager output ``[B, Q, H, v_head_dim]``."""

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    scaling: float
    attention_mask: Optional[torch.Tensor]
    out: torch.Tensor


@dataclass
class Recorder:
    calls: list = field(default_factory=list)


_RECORDER: Optional[Recorder] = None


def _capturing_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' own eager attention function of the module's model file, recording its inputs and output."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if _RECORDER is not None:
        _RECORDER.calls.append(
            Call(
                module.layer_idx,
                query.detach().clone(),
                key.detach().clone(),
                float(scaling),
                None if attention_mask is None else attention_mask.detach().clone(),
                out.detach().clone(),
            )
        )
    return out, weights


def register_capture() -> None:
    """Register the capturing eager function (and transformers' eager mask) under :data:`CAPTURE_IMPL`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(CAPTURE_IMPL, _capturing_eager)
    AttentionMaskInterface.register(CAPTURE_IMPL, eager_mask)


class recording:
    """``with recording() as rec:`` collects :class:`Call` s of models loaded with ``attn_implementation=CAPTURE_IMPL``."""

    def __enter__(self) -> Recorder:
        global _RECORDER
        _RECORDER = Recorder()
        return _RECORDER

    def __exit__(self, *exc) -> None:
        global _RECORDER
        _RECORDER = None


@dataclass
class Captured:
    """One request run through transformers, prefix first (into its DynamicCache), then the new tokens.

    ``query`` ``[n, H, qk_head_dim]`` (q after RoPE of the new tokens), ``kv_c`` ``[c + n, kv_lora_rank]`` and
    ``k_pe`` ``[c + n, qk_rope_head_dim]`` (transformers' latents of the whole sequence), ``out``
    ``[n, H, v_head_dim]`` (transformers' eager attention output), ``scaling`` (transformers' softmax scale),
    ``hidden`` ``[n, hidden]`` (the attention layer's input) and ``attn_out`` ``[n, hidden]`` (its output after
    o_proj), ``context_len`` c; ``prefix_hidden`` / ``prefix_attn_out`` ``[c, hidden]`` the same for the prefix call
    (``None`` without a prefix).
    """

    query: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    out: torch.Tensor
    scaling: float
    hidden: torch.Tensor
    attn_out: torch.Tensor
    context_len: int
    prefix_hidden: Optional[torch.Tensor] = None
    prefix_attn_out: Optional[torch.Tensor] = None


def run_request(model, tokens: torch.Tensor, context_len: int, layer: int = 0) -> Captured:
    """Run ``tokens`` (1-D) through ``model.model`` (loaded with :data:`CAPTURE_IMPL`): the first ``context_len``
    into a fresh DynamicCache, then the rest over that cache; capture layer ``layer``'s tensors of the second call."""
    from transformers import DynamicCache

    tokens = tokens.to(model.device)
    cache = DynamicCache(config=model.config)
    # transformers 5.24 names the argument `cache` (`past_key_values` deprecated); earlier 5.x releases `past_key_values`
    cache_kw = {("cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"): cache}
    attn = model.model.layers[layer].self_attn
    seen = {"hidden": [], "attn_out": [], "kv_c": []}

    def pre(mod, args, kwargs):
        seen["hidden"].append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    def post(mod, args, kwargs, output):
        seen["attn_out"].append(output[0].detach().clone())

    def latent(mod, args, output):
        seen["kv_c"].append(output.detach().clone().reshape(-1, output.shape[-1]))

    h1 = attn.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = attn.register_forward_hook(post, with_kwargs=True)
    h3 = attn.kv_a_layernorm.register_forward_hook(latent)
    try:
        with torch.no_grad():
            if context_len:
                model.model(input_ids=tokens[None, :context_len], use_cache=True, **cache_kw)
            with recording() as rec:
                model.model(input_ids=tokens[None, context_len:], use_cache=True, **cache_kw)
    finally:
        h1.remove()
        h2.remove()
        h3.remove()
    call = [c for c in rec.calls if c.layer == layer]
    assert len(call) == 1, f"expected one attention call of layer {layer}, got {len(call)}"
    call = call[0]
    nope = attn.qk_nope_head_dim
    kv_c = torch.cat(seen["kv_c"])
    k_pe = call.key[0, 0, :, nope:].contiguous()
    assert kv_c.shape[0] == k_pe.shape[0] == tokens.shape[0]
    return Captured(
        query=call.query[0].transpose(0, 1).contiguous(),
        kv_c=kv_c,
        k_pe=k_pe,
        out=call.out[0],
        scaling=call.scaling,
        hidden=seen["hidden"][-1][0],
        attn_out=seen["attn_out"][-1][0],
        context_len=context_len,
        prefix_hidden=seen["hidden"][0][0] if context_len else None,
        prefix_attn_out=seen["attn_out"][0][0] if context_len else None,
    )


def page(
    latents: list,
    block_size: int,
    *,
    latent_dim: int,
    seed: int = 0,
    spare_blocks: int = 2,
    dtype=torch.float32,
    device="cpu",
):
    """A paged latent cache ``[num_blocks, block_size, latent_dim]`` holding each request's context latents
    ``latents[r]`` ``[c_r, latent_dim]`` in shuffled blocks; unused slots NaN, block_table padding -1."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-x.shape[0] // block_size) for x in latents]
    num_blocks = sum(per_req) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.full((num_blocks, block_size, latent_dim), float("nan"), dtype=dtype)
    table = torch.full((len(latents), max(per_req + [0]) + 1), -1, dtype=torch.int32)
    nxt = 0
    for r, x in enumerate(latents):
        for b in range(per_req[r]):
            blk = order[nxt]
            nxt += 1
            table[r, b] = blk
            rows = x[b * block_size : (b + 1) * block_size]
            cache[blk, : rows.shape[0]] = rows.to("cpu", dtype)
    return cache.to(device), table.to(device)


#: Small attention dims of the sparse-attention (DSA) models' tests: MLA with an indexer, dense MLPs only.
DSA_SMALL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    index_head_dim=16,
    index_n_heads=4,
    initializer_range=0.05,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def dsa_model(
    model_type: str,
    *,
    index_topk: int,
    num_layers: int = 2,
    seed: int = 0,
    sinks: float = None,
    attn_implementation: str = "eager",
    dtype=torch.float32,
    device: str = "cpu",
    **overrides,
):
    """A random transformers model of ``model_type`` ("deepseek_v32", "glm_moe_dsa", "hy_v4": MLA whose indexer picks
    ``index_topk`` keys per query) at :data:`DSA_SMALL` dims, dense MLPs, in eval mode; ``sinks``: every attention
    layer's ``sinks`` parameter (hy_v4's per-head sink logits) drawn around that value instead of its initial 0.
    Equal ``seed`` and config give equal weights whatever ``attn_implementation``."""
    import transformers

    fields = dict(
        DSA_SMALL,
        num_hidden_layers=num_layers,
        index_topk=index_topk,
        first_k_dense_replace=num_layers,
        mlp_layer_types=["dense"] * num_layers,
    )
    fields.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=attn_implementation
    )
    if sinks is not None:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(sinks + torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model.to(device=device, dtype=dtype).eval()
