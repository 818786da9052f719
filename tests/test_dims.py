"""MLADims: sizes, derived widths, and the softmax scale read from DeepSeek's published config.json fields."""

from __future__ import annotations

import copy
import json
import math

import pytest

from mla_bridge import MLADims

# The MLA fields of the published config.json files, copied from Hugging Face
# (deepseek-ai/DeepSeek-V2-Lite == deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct for these fields, deepseek-ai/DeepSeek-V3),
# with a few unrelated fields kept so that the reader must ignore them.
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "torch_dtype": "bfloat16",
}
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "torch_dtype": "bfloat16",
}


def deepseek_scale(mscale_all_dim: float, factor: float = 40.0) -> float:
    """192 ** -0.5 * (0.1 * mscale_all_dim * ln(factor) + 1) ** 2 (DeepSeek's modeling_deepseek.py)."""
    return 192 ** -0.5 * (0.1 * mscale_all_dim * math.log(factor) + 1) ** 2


def with_rope_type(config):
    """The same config with rope scaling keyed by 'rope_type' (newer transformers) instead of 'type'."""
    c = copy.deepcopy(config)
    rs = c["rope_scaling"]
    rs["rope_type"] = rs.pop("type")
    return c


def test_expected_scales_are_the_published_numbers():
    # Guards the formula used below against a typo: the figures DeepSeek users quote.
    assert deepseek_scale(0.707) == pytest.approx(0.114722, abs=1e-6)
    assert deepseek_scale(1.0) == pytest.approx(0.135234, abs=1e-6)


@pytest.mark.parametrize("form", ["dict", "file", "folder"])
@pytest.mark.parametrize("key", ["type", "rope_type"])
@pytest.mark.parametrize("name,config,heads,mscale_all_dim", [
    ("v2-lite", V2_LITE_CONFIG, 16, 0.707),
    ("v3", V3_CONFIG, 128, 1.0),
])
def test_from_hf_config(tmp_path, form, key, name, config, heads, mscale_all_dim):
    cfg = config if key == "type" else with_rope_type(config)
    if form == "dict":
        source = cfg
    else:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        source = tmp_path / "config.json" if form == "file" else str(tmp_path)
    d = MLADims.from_hf_config(source)
    assert (d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (heads, 512, 128, 64, 128)
    assert d.head_dim_qk == 192 and d.head_dim_vo == 128 and d.latent_dim == 576
    assert d.kv_b_proj_shape == (heads * 256, 512)
    assert d.softmax_scale == pytest.approx(deepseek_scale(mscale_all_dim), rel=1e-12)
    assert d.softmax_scale == pytest.approx({"v2-lite": 0.114722, "v3": 0.135234}[name], abs=1e-6)
    # Never the latent width 576 (a known bug in the wild).
    assert abs(d.softmax_scale - 576 ** -0.5 * (0.1 * mscale_all_dim * math.log(40) + 1) ** 2) > 1e-3


def test_presets_match_the_configs():
    assert MLADims.deepseek_v2_lite() == MLADims.from_hf_config(V2_LITE_CONFIG)
    assert MLADims.deepseek_v3() == MLADims.from_hf_config(V3_CONFIG)
    assert MLADims.preset("deepseek-v3").num_heads == 128
    with pytest.raises(ValueError, match="unknown model"):
        MLADims.preset("llama")


@pytest.mark.parametrize("rope_scaling", [
    None,
    {},
    {"type": "yarn", "factor": 40},  # no mscale_all_dim: DeepSeek multiplies by mscale**2 only when it is set
    {"type": "yarn", "factor": 40, "mscale_all_dim": 0},
    {"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0},  # factor <= 1: yarn_get_mscale returns 1
    {"type": "linear", "factor": 40, "mscale_all_dim": 1.0},
])
def test_no_yarn_scale_is_plain_192(rope_scaling):
    cfg = dict(V2_LITE_CONFIG, rope_scaling=rope_scaling)
    assert MLADims.from_hf_config(cfg).softmax_scale == pytest.approx(192 ** -0.5, rel=1e-12)
    assert 192 ** -0.5 == pytest.approx(0.0721688, abs=1e-7)


def test_default_scale_uses_qk_head_dim():
    d = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    assert d.softmax_scale == pytest.approx(24 ** -0.5, rel=1e-12)
    assert (d.head_dim_qk, d.head_dim_vo, d.latent_dim, d.kv_b_proj_shape) == (24, 16, 40, (128, 32))
    assert MLADims(num_heads=2, softmax_scale=0.5).softmax_scale == 0.5


@pytest.mark.parametrize("field", ["num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim"])
def test_missing_field_is_named(field):
    cfg = dict(V3_CONFIG)
    del cfg[field]
    with pytest.raises(ValueError, match=field):
        MLADims.from_hf_config(cfg)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        MLADims.from_hf_config(tmp_path / "nope.json")


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_heads=0), "num_heads"),
    (dict(num_heads=-2), "num_heads"),
    (dict(num_heads=4.0), "num_heads"),
    (dict(num_heads=True), "num_heads"),
    (dict(num_heads=4, kv_lora_rank=0), "kv_lora_rank"),
    (dict(num_heads=4, v_head_dim=None), "v_head_dim"),
    (dict(num_heads=4, softmax_scale=0.0), "softmax_scale"),
    (dict(num_heads=4, softmax_scale=float("nan")), "softmax_scale"),
    (dict(num_heads=4, softmax_scale=float("inf")), "softmax_scale"),
])
def test_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MLADims(**kwargs)
