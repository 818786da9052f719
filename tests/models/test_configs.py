"""MLADims.from_hf_config on every MLA model type of transformers: its dims and softmax scale equal those of the
attention module transformers builds from the same config (``self.scaling``, each model's RoPE scaling rule), read
from the config object, its ``to_dict()`` and the config.json ``save_pretrained`` writes.

The attention modules are built on the meta device (no weights), from transformers' default config of each model type
(the dims the table of the docs lists), with the RoPE entry replaced by a YaRN or a linear scaling. Multimodal
wrappers keep the MLA fields in their text config; dots3_note's text config is heterogeneous (per-layer dims).
"""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

from mla_bridge import MLADims
from mla_bridge.dims import HF_MLA_MODEL_TYPES

transformers = pytest.importorskip("transformers")

#: model_type -> (modeling module, attention class) of transformers 5.25
ATTENTION = {
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Attention"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Attention"),
    "kimi_k25": ("deepseek_v3", "DeepseekV3Attention"),
    "sarvam_mla": ("deepseek_v3", "DeepseekV3Attention"),
    "youtu": ("youtu", "YoutuAttention"),
    "axk1": ("axk1", "AXK1Attention"),
    "axk2": ("axk2", "AXK2Attention"),
    "bailing_hybrid": ("bailing_hybrid", "BailingHybridAttention"),
    "kimi_linear": ("kimi_linear", "KimiLinearAttention"),
    "longcat_flash": ("longcat_flash", "LongcatFlashMLA"),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32Attention"),
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteAttention"),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaAttention"),
    "hy_v4": ("hy_v4", "HYV4Attention"),
    "hy_v4_vl": ("hy_v4_vl", "HYV4VLAttention"),
    "glm5_next": ("glm5_next", "Glm5NextTextAttention"),
    "mistral4": ("mistral4", "Mistral4Attention"),
    "mistral_large4": ("mistral_large4", "MistralLarge4TextAttention"),
    "minicpm3": ("minicpm3", "MiniCPM3Attention"),
    "dots3_note": ("dots3_note", "Dots3NoteTextAttention"),
}
#: (num_heads, kv_lora_rank, qk_nope, qk_rope, v) of transformers' default config (dots3_note: layer 0, layer 2)
DEFAULT_DIMS = {
    "deepseek_v2": (32, 512, 128, 64, 128),
    "deepseek_v3": (128, 512, 128, 64, 128),
    "kimi_k25": (128, 512, 128, 64, 128),
    "youtu": (16, 512, 128, 64, 128),
    "sarvam_mla": (64, 512, 128, 64, 128),
    "axk1": (64, 512, 128, 64, 128),
    "bailing_hybrid": (32, 512, 128, 64, 128),
    "kimi_linear": (32, 512, 128, 64, 128),
    "longcat_flash": (64, 512, 128, 64, 128),
    "deepseek_v32": (128, 512, 128, 64, 128),
    "glm4_moe_lite": (20, 512, 192, 64, 256),
    "glm_moe_dsa": (64, 512, 192, 64, 256),
    "hy_v4": (32, 512, 192, 64, 256),
    "hy_v4_vl": (64, 512, 192, 64, 256),
    "glm5_next": (64, 512, 256, 0, 256),
    "mistral4": (32, 256, 64, 64, 128),
    "mistral_large4": (64, 512, 64, 64, 128),
    "minicpm3": (40, 256, 64, 32, 64),
    "axk2": (32, 128, 64, 32, 64),
    "dots3_note": (128, 512, 128, 64, 128),
    ("dots3_note", 2): (64, 1024, 192, 64, 128),
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
NESTED = ("kimi_k25", "mistral_large4", "glm5_next", "hy_v4_vl", "dots3_note")


def _text(config):
    return config.text_config if getattr(config, "text_config", None) is not None else config


def make_config(model_type: str, rope=None):
    """transformers' default config of ``model_type``, its (text) config's RoPE entry replaced by ``rope``."""
    config = transformers.AutoConfig.for_model(model_type)
    if rope is None:
        return config
    text = _text(config)
    layer_types = getattr(text, "layer_types", None) or []
    kw = text.to_dict()
    if (
        isinstance(kw.get("rope_parameters"), dict)
        and set(kw["rope_parameters"]) <= set(layer_types)
        and kw["rope_parameters"]
    ):
        kw["rope_parameters"] = {lt: dict(rope) for lt in kw["rope_parameters"]}  # per layer type (dots3_note)
    else:
        kw["rope_parameters"] = dict(rope)
    new_text = type(text)(**kw)
    if text is config:
        return new_text
    return type(config)(text_config=new_text.to_dict())


def attention(model_type: str, config, layer: int = 0):
    module, name = ATTENTION[model_type]
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    with torch.device("meta"):
        return cls(_text(config), layer)


def _forms(config, tmp_path):
    config.save_pretrained(tmp_path)
    return {"object": config, "dict": config.to_dict(), "file": tmp_path / "config.json", "folder": str(tmp_path)}


def _dims_of(attn):
    return (attn.num_heads, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim)


def test_every_mla_model_type_is_listed():
    assert sorted(ATTENTION) == sorted(HF_MLA_MODEL_TYPES) and len(HF_MLA_MODEL_TYPES) == 20


@pytest.mark.parametrize("rope", ["default", "yarn", "linear"])
@pytest.mark.parametrize("model_type", HF_MLA_MODEL_TYPES)
def test_from_hf_config_equals_the_attention_module(tmp_path, model_type, rope):
    config = make_config(model_type, {"default": None, "yarn": YARN, "linear": LINEAR}[rope])
    layers = [0, 2] if model_type == "dots3_note" else [None]
    for layer in layers:
        attn = attention(model_type, config, layer or 0)
        key = (model_type, layer) if layer else model_type
        assert _dims_of(attn) == DEFAULT_DIMS[key]
        for form, source in _forms(config, tmp_path).items():
            d = MLADims.from_hf_config(source, layer=layer)
            assert (d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == DEFAULT_DIMS[
                key
            ], form
            assert d.softmax_scale == attn.scaling, (form, d.softmax_scale, attn.scaling)  # exactly
            assert d.latent_dim == d.kv_lora_rank + d.qk_rope_head_dim


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite", "minicpm3", "kimi_linear", "glm5_next"])
def test_yarn_rule_per_model(model_type):
    # Guards the comparison above against a rule that happens to agree: YaRN's mscale_all_dim changes the scale of
    # the models whose attention applies yarn_apply_mscale and leaves the others' (kimi_linear, glm5_next) alone.
    plain = MLADims.from_hf_config(make_config(model_type))
    yarn = MLADims.from_hf_config(make_config(model_type, YARN))
    factor = (0.1 * 0.707 * math.log(40) + 1) ** 2
    want = plain.softmax_scale * (1 if model_type in ("kimi_linear", "glm5_next") else factor)
    assert yarn.softmax_scale == pytest.approx(want, rel=1e-12)
    assert plain.softmax_scale == pytest.approx(plain.head_dim_qk**-0.5, rel=1e-15)


def test_mistral4_default_is_yarn_scaled():
    # transformers' Mistral4Config defaults to YaRN factor 128, mscale_all_dim 1: 128 ** -0.5 * (0.1 ln 128 + 1) ** 2
    d = MLADims.from_hf_config(transformers.AutoConfig.for_model("mistral4"))
    assert d.softmax_scale == pytest.approx(128**-0.5 * (0.1 * math.log(128) + 1) ** 2, rel=1e-12)


@pytest.mark.parametrize("model_type", NESTED)
def test_nested_text_config_is_read(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    assert getattr(config, "kv_lora_rank", None) is None or model_type == "kimi_k25"
    layer = 0 if model_type == "dots3_note" else None
    assert MLADims.from_hf_config(config, layer=layer) == MLADims.from_hf_config(config.text_config, layer=layer)


def test_heterogeneous_config_needs_layer(tmp_path):
    config = transformers.AutoConfig.for_model("dots3_note")
    for source in _forms(config, tmp_path).values():
        with pytest.raises(ValueError, match="layer"):
            MLADims.from_hf_config(source)
    with pytest.raises(ValueError, match="layer 46 is out of range"):
        MLADims.from_hf_config(config, layer=46)
    with pytest.raises(ValueError, match="layer must be"):
        MLADims.from_hf_config(config, layer=-1)
    text = config.text_config
    for i in range(text.num_hidden_layers):  # every layer: its own attention's dims and scale
        d = MLADims.from_hf_config(config, layer=i)
        attn = attention("dots3_note", config, i)
        assert (d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == _dims_of(attn)
        assert d.softmax_scale == attn.scaling


def test_linear_attention_layer_is_refused_by_layer():
    config = transformers.AutoConfig.for_model("glm5_next")
    types = config.text_config.layer_types
    mla = types.index("indexed_attention")
    assert MLADims.from_hf_config(config, layer=mla).qk_rope_head_dim == 0
    with pytest.raises(ValueError, match=f"layer {types.index('linear_attention')} is a 'linear_attention' layer"):
        MLADims.from_hf_config(config, layer=types.index("linear_attention"))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt_oss"])
def test_non_mla_config_is_refused(model_type):
    with pytest.raises(ValueError, match="missing MLA field.*kv_lora_rank"):
        MLADims.from_hf_config(transformers.AutoConfig.for_model(model_type))


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(qk_head_dim=200), "qk_head_dim"),
        (dict(num_key_value_heads=1), "num_key_value_heads"),
        (dict(qk_rope_head_dim=-1), "qk_rope_head_dim"),
        (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
        (dict(rope_scaling={"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}), "rope_parameters"),
    ],
)
def test_contradicting_fields_are_refused_by_name(change, field):
    d = transformers.AutoConfig.for_model("glm4_moe_lite").to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=field):
        MLADims.from_hf_config(d)


def test_zero_rope_dims():
    d = MLADims.from_hf_config(transformers.AutoConfig.for_model("glm5_next"), layer=3)
    assert (d.head_dim_qk, d.head_dim_vo, d.latent_dim, d.kv_b_proj_shape) == (256, 256, 512, (64 * 512, 512))
    assert d.softmax_scale == 256**-0.5
    assert json.loads(json.dumps(d.__dict__))["qk_rope_head_dim"] == 0
