"""Small random transformers models of every MLA model type (transformers 5.25), one MLA decoder layer, and the
tensors its attention hands to mla_bridge.

Each config keeps the model type's attention head dims (``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``
of its default config; dots3_note: its sliding-window layers' 192+64/128 or its first layers' 128+64/128) with few
heads (4; 5 where a count that is not a power of two is tried), ``kv_lora_rank`` 32, ``hidden_size`` 64, dense MLPs,
and the one layer an MLA layer (the hybrid models' linear-attention layers are not MLA). DSA models get an indexer
whose ``index_topk`` (64) covers every sequence of the tests, so that it selects every key.

The tensors are captured from transformers' own modules: q after RoPE and the eager attention output (transformers'
eager function, registered under a capturing name as tests/models/hf_deepseek.py does), and the latents from
transformers' ``DynamicCache`` after the request (``keys`` = kv_c as the layer stores it, longcat's LoRA scale
included; ``values`` = k_pe after RoPE): what an engine's paged cache holds.
"""

from __future__ import annotations

import torch

from mla_bridge.dims import HF_MLA_MODEL_TYPES

from . import hf_deepseek as H

#: Model types whose attention adds per-head sink logits (``module.sinks``) to the softmax.
SINK_MODEL_TYPES = ("hy_v4", "hy_v4_vl")
#: Model types transformers runs with its eager attention only (no sdpa): compared with eager.
EAGER_ONLY = ("hy_v4", "hy_v4_vl")
INDEX_TOPK = 64
#: Heads per model type: 4, or 5 (a count that is not a power of two, as GLM-4.7-Flash's 20 and MiniCPM3's 40).
HEADS = {mt: 5 if mt in ("glm4_moe_lite", "minicpm3") else 4 for mt in HF_MLA_MODEL_TYPES}


def text_config_class(model_type: str):
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    text = config.text_config if getattr(config, "text_config", None) is not None else config
    return type(text), text


def head_dims(model_type: str, variant: str = "") -> tuple[int, int, int]:
    """(qk_nope_head_dim, qk_rope_head_dim, v_head_dim) of ``model_type``'s default config (dots3_note: layer 2, a
    sliding-window layer, with ``variant == "swa"``, else layer 0)."""
    cls, text = text_config_class(model_type)
    src = text.per_layer_config[2 if variant == "swa" else 0] if model_type == "dots3_note" else text
    return src.qk_nope_head_dim, src.qk_rope_head_dim, src.v_head_dim


def make_model(
    model_type: str,
    *,
    variant: str = "",
    seed: int = 0,
    attn_implementation: str = "eager",
    dtype=torch.float32,
    device="cpu",
    index_topk: int = INDEX_TOPK,
):
    """A random model of ``model_type`` with one MLA layer at the model's head dims; returns ``(model, base)`` where
    ``base`` is the decoder stack (``base.layers[0].self_attn`` the MLA attention); a DSA model's indexer keeps
    ``index_topk`` keys per query (default: every key of these tests' sequences). Skips the test under a
    transformers older than the one whose MLA classes these tests read (5.25: several model types, and the config
    fields of others, are newer)."""
    import pytest
    import transformers

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 25):
        pytest.skip(f"transformers {transformers.__version__}: the MLA model classes read here are transformers 5.25's")
    cls, text = text_config_class(model_type)
    nope, rope, v = head_dims(model_type, variant)
    h = HEADS[model_type]
    kw = dict(
        hidden_size=16 * h,
        num_attention_heads=h,
        num_key_value_heads=h,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        intermediate_size=64,
        moe_intermediate_size=16,
        vocab_size=64,
        num_hidden_layers=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        index_head_dim=rope + 16,
        index_n_heads=4,
        index_topk=index_topk,
        initializer_range=0.05,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    layer_types = getattr(text, "layer_types", None) if model_type != "dots3_note" else ["indexed_attention"]
    if layer_types:
        kw["layer_types"] = [next(t for t in layer_types if "linear" not in t)]
    if model_type == "dots3_note":
        kw.update(head_dim=nope + rope, num_hidden_layers=1)
        if variant != "swa":
            kw["per_layer_config"] = {}
        else:  # the sliding-window layer's dims, without its window (sequences here are far shorter)
            kw["layer_types"] = ["sliding_attention"]
            kw.update(
                swa_num_attention_heads=h,
                swa_num_key_value_heads=h,
                swa_q_lora_rank=32,
                swa_kv_lora_rank=48,
                swa_head_dim=nope + rope,
                swa_qk_nope_head_dim=nope,
                swa_v_head_dim=v,
                sliding_window=512,
            )
    if hasattr(text, "mlp_layer_types"):
        kw["mlp_layer_types"] = ["dense"]
    if model_type == "kimi_linear":
        kw["linear_attn_config"] = {
            "full_attn_layers": [1],
            "kda_layers": [],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        }
    if model_type == "longcat_flash":
        kw.update(num_hidden_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=16)  # one layer: two MLA
    config = cls(**kw)
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        base = model.model
    except ValueError:  # a text config without a causal-LM class of its own: the text model
        model = base = transformers.AutoModel.from_config(config, attn_implementation=attn_implementation)
    if model_type in SINK_MODEL_TYPES:  # sinks drawn around 1 (their initial 0 would hide a sign error)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in base.layers:
                layer.self_attn.sinks.copy_(1.0 + torch.randn(layer.self_attn.sinks.shape, generator=g))
    model = model.to(device=device, dtype=dtype).eval()
    return model, base


def mla_attention(base):
    attn = base.layers[0].self_attn
    return attn[0] if isinstance(attn, torch.nn.ModuleList) else attn  # longcat: two MLA per layer


def run_request(model, base, tokens: torch.Tensor, context_len: int):
    """``tokens`` (1-D) through ``base``: the first ``context_len`` into a fresh DynamicCache, then the rest. Returns
    (query ``[n, H, qk]``, out ``[n, H, v]`` (eager), scaling, kv_c ``[c + n, rank]``, k_pe ``[c + n, rope]``,
    layer output ``[n, hidden]``) of layer 0's (first) MLA attention for the second call."""
    import inspect

    from transformers import DynamicCache

    cache = DynamicCache(config=base.config)
    kw = {("cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"): cache}
    attn = mla_attention(base)
    seen = []
    hook = attn.register_forward_hook(lambda mod, args, output: seen.append(output[0].detach().clone()))
    try:
        with torch.no_grad():
            if context_len:
                base(input_ids=tokens[None, :context_len].to(model.device), use_cache=True, **kw)
            with H.recording() as rec:
                base(input_ids=tokens[None, context_len:].to(model.device), use_cache=True, **kw)
    finally:
        hook.remove()
    calls = [c for c in rec.calls if c.layer == attn.layer_idx]  # none unless loaded with H.CAPTURE_IMPL
    layer = cache.layers[attn.layer_idx]
    kv_c, k_pe = layer.keys[0, 0], layer.values[0, 0]
    assert kv_c.shape[0] == tokens.shape[0]
    if not calls:
        return None, None, None, kv_c, k_pe, seen[-1][0]
    call = calls[0]
    return call.query[0].transpose(0, 1).contiguous(), call.out[0], call.scaling, kv_c, k_pe, seen[-1][0]
