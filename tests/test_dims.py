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
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
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
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "torch_dtype": "bfloat16",
}


def deepseek_scale(mscale_all_dim: float, factor: float = 40.0) -> float:
    """192 ** -0.5 * (0.1 * mscale_all_dim * ln(factor) + 1) ** 2 (DeepSeek's modeling_deepseek.py)."""
    return 192**-0.5 * (0.1 * mscale_all_dim * math.log(factor) + 1) ** 2


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
@pytest.mark.parametrize(
    "name,config,heads,mscale_all_dim",
    [
        ("v2-lite", V2_LITE_CONFIG, 16, 0.707),
        ("v3", V3_CONFIG, 128, 1.0),
    ],
)
def test_from_hf_config(tmp_path, form, key, name, config, heads, mscale_all_dim):
    cfg = config if key == "type" else with_rope_type(config)
    if form == "dict":
        source = cfg
    else:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        source = tmp_path / "config.json" if form == "file" else str(tmp_path)
    d = MLADims.from_hf_config(source)
    assert (d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (
        heads,
        512,
        128,
        64,
        128,
    )
    assert d.head_dim_qk == 192 and d.head_dim_vo == 128 and d.latent_dim == 576
    assert d.kv_b_proj_shape == (heads * 256, 512)
    assert d.softmax_scale == pytest.approx(deepseek_scale(mscale_all_dim), rel=1e-12)
    assert d.softmax_scale == pytest.approx({"v2-lite": 0.114722, "v3": 0.135234}[name], abs=1e-6)
    # Never the latent width 576 (a known bug in the wild).
    assert abs(d.softmax_scale - 576**-0.5 * (0.1 * mscale_all_dim * math.log(40) + 1) ** 2) > 1e-3


def test_presets_match_the_configs():
    assert MLADims.deepseek_v2_lite() == MLADims.from_hf_config(V2_LITE_CONFIG)
    assert MLADims.deepseek_v3() == MLADims.from_hf_config(V3_CONFIG)
    assert MLADims.preset("deepseek-v3").num_heads == 128
    with pytest.raises(ValueError, match="unknown model"):
        MLADims.preset("llama")


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {},
        {"type": "yarn", "factor": 40},  # no mscale_all_dim: DeepSeek multiplies by mscale**2 only when it is set
        {"type": "yarn", "factor": 40, "mscale_all_dim": 0},
        {"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0},  # factor <= 1: yarn_get_mscale returns 1
        {"type": "default", "factor": 40, "mscale_all_dim": 1.0},  # "default" means no scaling, whatever else is set
    ],
)
def test_no_yarn_scale_is_plain_192(rope_scaling):
    cfg = dict(V2_LITE_CONFIG, rope_scaling=rope_scaling)
    assert MLADims.from_hf_config(cfg).softmax_scale == pytest.approx(192**-0.5, rel=1e-12)
    assert 192**-0.5 == pytest.approx(0.0721688, abs=1e-7)


def test_default_scale_uses_qk_head_dim():
    d = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    assert d.softmax_scale == pytest.approx(24**-0.5, rel=1e-12)
    assert (d.head_dim_qk, d.head_dim_vo, d.latent_dim, d.kv_b_proj_shape) == (24, 16, 40, (128, 32))
    assert MLADims(num_heads=2, softmax_scale=0.5).softmax_scale == 0.5


@pytest.mark.parametrize(
    "field", ["num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
)
def test_missing_field_is_named(field):
    cfg = dict(V3_CONFIG)
    del cfg[field]
    with pytest.raises(ValueError, match=field):
        MLADims.from_hf_config(cfg)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        MLADims.from_hf_config(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(num_heads=0), "num_heads"),
        (dict(num_heads=-2), "num_heads"),
        (dict(num_heads=4.0), "num_heads"),
        (dict(num_heads=True), "num_heads"),
        (dict(num_heads=4, kv_lora_rank=0), "kv_lora_rank"),
        (dict(num_heads=4, v_head_dim=None), "v_head_dim"),
        (dict(num_heads=4, softmax_scale=0.0), "softmax_scale"),
        (dict(num_heads=4, softmax_scale=float("nan")), "softmax_scale"),
        (dict(num_heads=4, softmax_scale=float("inf")), "softmax_scale"),
    ],
)
def test_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MLADims(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Configs written by transformers 5 (rope_parameters, no rope_scaling) and config objects; the scale checked against
# transformers' own attention module (its `scaling` attribute, set by yarn_apply_mscale in modeling_deepseek_v2.py).
# ----------------------------------------------------------------------------------------------------------------


def _hf_config(version: str, published: dict, **overrides):
    """A transformers DeepseekV2Config / DeepseekV3Config with the published attention fields and a tiny body."""
    import transformers

    cls = {"v2": transformers.DeepseekV2Config, "v3": transformers.DeepseekV3Config}[version]
    fields = {
        k: published[k]
        for k in (
            "num_attention_heads",
            "num_key_value_heads",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
            "rope_scaling",
        )
    }
    fields.update(hidden_size=256, intermediate_size=64, num_hidden_layers=1, vocab_size=32)
    fields.update(overrides)
    return cls(**fields)


def _transformers_scaling(config) -> float:
    """transformers' own softmax scale: the `scaling` attribute of its attention module built from `config`."""
    import transformers

    attn = {
        "deepseek_v2": transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention,
        "deepseek_v3": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention,
    }[config.model_type]
    return float(attn(config, layer_idx=0).scaling)


HF_CASES = [
    ("v2", V2_LITE_CONFIG, 0.707),
    ("v3", V3_CONFIG, 1.0),
    ("v2", V3_CONFIG, 1.0),
    ("v3", V2_LITE_CONFIG, 0.707),
]


@pytest.mark.parametrize("version,published,mscale_all_dim", HF_CASES)
@pytest.mark.parametrize("form", ["folder", "file", "dict", "object"])
def test_config_written_by_transformers(tmp_path, version, published, mscale_all_dim, form):
    config = _hf_config(version, published)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written  # what transformers 5 writes (the form that gave 192**-0.5 before)
    source = {"folder": tmp_path, "file": str(tmp_path / "config.json"), "dict": written, "object": config}[form]
    d = MLADims.from_hf_config(source)
    assert d.num_heads == published["num_attention_heads"]
    assert d.softmax_scale == pytest.approx(_transformers_scaling(config), rel=1e-12)
    assert d.softmax_scale == pytest.approx(deepseek_scale(mscale_all_dim), rel=1e-12)


@pytest.mark.parametrize("version,published,mscale_all_dim", HF_CASES[:2])
def test_published_config_json_matches_transformers(tmp_path, version, published, mscale_all_dim):
    # DeepSeek's published config.json (rope_scaling, "type": "yarn"), loaded by transformers itself.
    import transformers

    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                published,
                model_type=f"deepseek_{version}",
                hidden_size=256,
                intermediate_size=64,
                vocab_size=32,
                num_hidden_layers=1,
            )
        )
    )
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    scale = MLADims.from_hf_config(tmp_path).softmax_scale
    assert scale == pytest.approx(_transformers_scaling(config), rel=1e-12)
    assert scale == pytest.approx(deepseek_scale(mscale_all_dim), rel=1e-12)
    assert MLADims.from_hf_config(config).softmax_scale == scale


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "default"},
        {"rope_type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096},
        {
            "rope_type": "yarn",
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        {
            "rope_type": "yarn",
            "factor": 8,
            "mscale": 0.5,
            "mscale_all_dim": 0.3,
            "original_max_position_embeddings": 4096,
        },
        {"rope_type": "linear", "factor": 4.0},
        # DeepSeek's modeling_deepseek.py and transformers both apply mscale_all_dim for any scaled RoPE, not only YaRN
        {"rope_type": "linear", "factor": 4.0, "mscale_all_dim": 1.0},
    ],
)
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_scale_equals_transformers_for_rope_kinds(tmp_path, version, rope_scaling):
    config = _hf_config(version, V2_LITE_CONFIG, rope_scaling=rope_scaling)
    config.save_pretrained(tmp_path)
    expected = _transformers_scaling(config)
    assert MLADims.from_hf_config(tmp_path).softmax_scale == pytest.approx(expected, rel=1e-12)
    assert MLADims.from_hf_config(config).softmax_scale == pytest.approx(expected, rel=1e-12)


def test_rope_parameters_default_means_no_yarn():
    cfg = dict(V3_CONFIG, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert MLADims.from_hf_config(cfg).softmax_scale == pytest.approx(192**-0.5, rel=1e-12)
    both = dict(V3_CONFIG, rope_parameters={**V3_CONFIG["rope_scaling"], "rope_theta": 10000.0})
    assert MLADims.from_hf_config(both).softmax_scale == pytest.approx(deepseek_scale(1.0), rel=1e-12)


def test_rope_parameters_and_rope_scaling_that_disagree_are_refused():
    cfg = dict(V3_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope_parameters .* rope_scaling"):
        MLADims.from_hf_config(cfg)


class _ToDict:
    def __init__(self, d):
        self._d = d

    def to_dict(self):
        return dict(self._d)


def test_any_object_with_to_dict_is_read():
    cfg = dict(V2_LITE_CONFIG)
    cfg["rope_parameters"] = cfg.pop("rope_scaling")
    assert MLADims.from_hf_config(_ToDict(cfg)) == MLADims.deepseek_v2_lite()


@pytest.mark.parametrize("bad", [42, 1.5, None, ["config.json"], b"config.json", object()])
def test_other_kinds_get_a_type_error_naming_what_is_accepted(bad):
    with pytest.raises(TypeError, match=r"path to config.json .*mapping.*to_dict\(\)"):
        MLADims.from_hf_config(bad)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_rope_entry_that_is_not_a_mapping_is_named(key):
    cfg = dict(V3_CONFIG, rope_scaling=None)
    cfg[key] = "yarn"
    with pytest.raises(ValueError, match=key):
        MLADims.from_hf_config(cfg)


# ------------------------------------------------------------------------ config values of the wrong type or range


@pytest.mark.parametrize(
    "key,value",
    [("num_attention_heads", 16.7), ("num_attention_heads", True), ("kv_lora_rank", "x"), ("v_head_dim", 0)],
)
def test_from_hf_config_refuses_non_integer_fields_by_name(key, value):
    """16.7 heads became 16, True became 1 head, and "x" gave a bare int() error naming no field."""
    cfg = {
        "num_attention_heads": 16,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        key: value,
    }
    with pytest.raises(ValueError, match=key):
        MLADims.from_hf_config(cfg)


def test_from_hf_config_integral_floats_and_numpy_ints_are_fine():
    import numpy as np

    cfg = {
        "num_attention_heads": 16.0,
        "kv_lora_rank": np.int64(512),
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    }
    d = MLADims.from_hf_config(cfg)
    assert d.num_heads == 16 and type(d.kv_lora_rank) is int
    assert MLADims(np.int64(16)).num_heads == 16


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_yarn_factor_is_refused(bad):
    """A NaN factor silently gave the unscaled 192**-0.5."""
    cfg = {
        "num_attention_heads": 16,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling": {"type": "yarn", "factor": bad, "mscale_all_dim": 0.707},
    }
    with pytest.raises(ValueError, match="factor"):
        MLADims.from_hf_config(cfg)


def test_bool_softmax_scale_is_refused():
    with pytest.raises(ValueError, match="softmax_scale"):
        MLADims(16, softmax_scale=True)


def test_numpy_ints_for_sizes():
    """block_size=np.int64(16) and Workspace(chunk_tokens=np.int64(100)) were refused as 'not a positive int'."""
    import numpy as np
    import torch

    from mla_bridge import PrefillPlan, Workspace

    ws = Workspace("cpu", chunk_tokens=np.int64(100))
    plan = PrefillPlan.build(
        [4], [40], dims=MLADims.deepseek_v2_lite(), workspace=ws, block_size=np.int64(16), dtype=torch.float32
    )
    assert ws.chunk_tokens == 100 and type(ws.chunk_tokens) is int and plan.block_size == 16
