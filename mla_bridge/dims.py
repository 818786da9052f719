"""MLA dimensions and the softmax scale: the one place that knows DeepSeek's sizes.

Sources: the DeepSeek-V2 paper (multi-head latent attention), the published ``config.json`` of
DeepSeek-V2-Lite / DeepSeek-Coder-V2-Lite-Instruct and DeepSeek-V3, and DeepSeek's ``modeling_deepseek.py``
(``yarn_get_mscale`` and the ``softmax_scale`` set in ``DeepseekV2Attention.__init__``).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

__all__ = ["MLADims", "yarn_mscale", "softmax_scale_from_rope_scaling", "HF_MLA_MODEL_TYPES", "PLAIN_SCALE_MODEL_TYPES"]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude factor ``0.1 * mscale * ln(factor) + 1`` (1.0 when ``factor <= 1``).

    Source: ``yarn_get_mscale`` in DeepSeek's ``modeling_deepseek.py``.
    """
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale_from_rope_scaling(head_dim_qk: int, rope_scaling: Mapping[str, Any] | None) -> float:
    """DeepSeek's softmax scale: ``head_dim_qk ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2``
    when ``rope_scaling`` is a scaled RoPE (its ``rope_type`` or ``type`` is set and is not ``"default"``), sets
    ``mscale_all_dim`` and has ``factor > 1``.

    ``rope_scaling`` is the ``rope_scaling`` entry of DeepSeek's published config.json or the ``rope_parameters``
    entry that transformers 5 writes (same keys plus ``rope_theta``). The rule is DeepSeek's
    (``DeepseekV2Attention.__init__`` in ``modeling_deepseek.py``) and transformers' (``yarn_apply_mscale`` in
    ``models/deepseek_v2/modeling_deepseek_v2.py``, transformers 5.24): both apply the factor for any scaled RoPE
    with ``mscale_all_dim``, not only YaRN. ``head_dim_qk`` is ``qk_nope_head_dim + qk_rope_head_dim`` (192 for
    DeepSeek), never the latent width 576 (a known bug). DeepSeek-V2-Lite gives 0.114722, DeepSeek-V3 0.135234,
    no scaling 0.0721688.
    """
    scale = head_dim_qk**-0.5
    if not rope_scaling:
        return scale
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    mscale_all_dim = rope_scaling.get("mscale_all_dim", 0) or 0
    factor = rope_scaling.get("factor", 1.0) or 1.0
    for name, value in (("factor", factor), ("mscale_all_dim", mscale_all_dim)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"rope scaling {name} must be a finite number, got {value!r}")
    factor = float(factor)
    if kind not in (None, "default") and mscale_all_dim and factor > 1:
        m = yarn_mscale(factor, float(mscale_all_dim))
        scale = scale * m * m  # transformers' order of the products (yarn_apply_mscale): bitwise its self.scaling
    return scale


def _config_int(config: Mapping[str, Any], key: str, allow_zero: bool = False) -> int:
    """``config[key]`` as a positive int (``>= 0`` with ``allow_zero``): an int (JSON ``16``; ``16.0`` too), never a
    bool or a fraction."""
    value = config[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < (0 if allow_zero else 1):
        raise ValueError(
            f"config: {key} must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}"
        )
    return int(value)


def _rope_entry(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The RoPE scaling entry of a config: ``rope_parameters`` (transformers 5 writes only this) or ``rope_scaling``
    (DeepSeek's published files, transformers 4). Both present with different scales is an error."""
    params, scaling = config.get("rope_parameters"), config.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"config: {name} must be a mapping or null, got {type(value).__name__}")
    if params and scaling and softmax_scale_from_rope_scaling(1, params) != softmax_scale_from_rope_scaling(1, scaling):
        raise ValueError(
            f"config: rope_parameters {dict(params)} and rope_scaling {dict(scaling)} disagree on the "
            f"YaRN softmax factor; keep one of them"
        )
    return params or scaling


_FIELDS = ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

#: The model types of transformers 5.25 whose attention is MLA (a ``kv_lora_rank`` latent up-projected by
#: ``kv_b_proj``), each read by :meth:`MLADims.from_hf_config` (its text config for the multimodal ones).
HF_MLA_MODEL_TYPES = (
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k25",
    "youtu",
    "sarvam_mla",
    "axk1",
    "bailing_hybrid",
    "kimi_linear",
    "longcat_flash",
    "deepseek_v32",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "hy_v4",
    "hy_v4_vl",
    "glm5_next",
    "mistral4",
    "mistral_large4",
    "minicpm3",
    "axk2",
    "dots3_note",
)

#: Model types (and their text configs) whose MLA attention sets ``self.scaling = qk_head_dim ** -0.5`` without
#: ``yarn_apply_mscale`` (transformers 5.25: ``KimiLinearAttention``, ``Glm5NextTextAttention``,
#: ``Dots3NoteTextAttention``): a YaRN ``mscale_all_dim`` in their RoPE entry does not change their softmax scale.
PLAIN_SCALE_MODEL_TYPES = ("kimi_linear", "glm5_next", "glm5_next_text", "dots3_note", "dots3_note_text")


def _layer_config(config: Mapping[str, Any], layer: Optional[int]) -> Mapping[str, Any]:
    """The fields of decoder layer ``layer``: the config itself, overridden by its ``per_layer_config`` entry (keys
    are layer indices, ``"02"`` or ``2``: transformers' heterogeneous configs), with ``rope_parameters`` picked by the
    layer's type when keyed by layer type. A heterogeneous config needs ``layer``."""
    per_layer = config.get("per_layer_config") or {}
    layer_types = config.get("layer_types")
    rope = config.get("rope_parameters")
    rope_by_type = (
        isinstance(rope, Mapping)
        and bool(rope)
        and isinstance(layer_types, (list, tuple))
        and all(isinstance(v, Mapping) for v in rope.values())
        and set(rope) <= set(layer_types)
    )
    if layer is None:
        if per_layer or rope_by_type:
            raise ValueError(
                "layer: this config is heterogeneous (per_layer_config / rope_parameters per layer "
                "type: attention dims differ by layer); pass layer=i, the decoder layer to read"
            )
        return config
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 0:
        raise ValueError(f"layer must be an int >= 0, got {layer!r}")
    layer = int(layer)
    num_layers = config.get("num_hidden_layers")
    if isinstance(num_layers, numbers.Integral) and layer >= num_layers:
        raise ValueError(f"layer {layer} is out of range: the config has num_hidden_layers {num_layers}")
    if isinstance(layer_types, (list, tuple)) and layer < len(layer_types) and "linear" in str(layer_types[layer]):
        raise ValueError(f"layer {layer} is a {layer_types[layer]!r} layer, not MLA attention")
    out = dict(config)
    if isinstance(per_layer, Mapping):
        for key, values in per_layer.items():
            if int(key) == layer and isinstance(values, Mapping):
                out.update(values)
    if rope_by_type:
        out["rope_parameters"] = rope[layer_types[layer]]
    return out


@dataclass(frozen=True)
class MLADims:
    """Sizes of one MLA attention layer in its prefill ("MHA") form.

    Attributes (all counts, no units):
        num_heads: query heads H (DeepSeek-V2-Lite 16, DeepSeek-V3 128). Prefill runs MHA: k/v heads == H.
        kv_lora_rank: width of the compressed latent ``kv_c`` (512).
        qk_nope_head_dim: per-head width of the non-RoPE part of q and k (128).
        qk_rope_head_dim: width of the shared RoPE key ``k_pe`` and the RoPE part of q (64; 0 for a model without
            a RoPE part, glm5_next: its cache rows are ``kv_c`` alone and ``k_pe`` is ``[T, 0]``).
        v_head_dim: per-head width of v and of the output (128).
        softmax_scale: the attention logit scale; ``None`` means ``head_dim_qk ** -0.5``.

    Derived: ``head_dim_qk = qk_nope_head_dim + qk_rope_head_dim`` (192), ``head_dim_vo = v_head_dim``,
    ``latent_dim = kv_lora_rank + qk_rope_head_dim`` (576, one paged-cache entry per token).

    Raises:
        ValueError: a size that is not a positive int (``qk_rope_head_dim``: not an int >= 0), or a scale that is not
            a positive finite number.
    """

    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    softmax_scale: float = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            low = 0 if name == "qk_rope_head_dim" else 1  # a zero RoPE part (glm5_next) is MLA without k_pe
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(
                    f"MLADims.{name} must be a {'non-negative' if low == 0 else 'positive'} int, got {value!r}"
                )
            object.__setattr__(self, name, int(value))  # numpy integers become ints
        if self.softmax_scale is None:
            object.__setattr__(self, "softmax_scale", self.head_dim_qk**-0.5)
        scale = self.softmax_scale
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"MLADims.softmax_scale must be a positive finite float, got {scale!r}")
        object.__setattr__(self, "softmax_scale", float(scale))

    @property
    def head_dim_qk(self) -> int:
        """q/k head width: ``qk_nope_head_dim + qk_rope_head_dim`` (192 for DeepSeek)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim_vo(self) -> int:
        """v/out head width: ``v_head_dim`` (128 for DeepSeek)."""
        return self.v_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token in the paged latent cache: ``kv_lora_rank + qk_rope_head_dim`` (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_proj_shape(self) -> tuple[int, int]:
        """Shape of ``kv_b_proj.weight`` as stored in DeepSeek checkpoints:
        ``[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``."""
        return (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)

    @classmethod
    def from_hf_config(
        cls, config: Union[str, os.PathLike, Mapping[str, Any], Any], layer: Optional[int] = None
    ) -> "MLADims":
        """Read the MLA attention dims of a transformers / Hugging Face config: a path to ``config.json`` or its
        folder, the parsed dict, or a config object with ``to_dict()`` (``DeepseekV3Config``, ``Glm5NextConfig``...).

        Every MLA model type of transformers 5.25 is read (:data:`HF_MLA_MODEL_TYPES`): the fields
        ``num_attention_heads``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` (0 allowed:
        ``glm5_next``) and ``v_head_dim`` at the top level or, for the multimodal wrappers (``kimi_k25``,
        ``mistral_large4``, ``glm5_next``, ``hy_v4_vl``, ``dots3_note``), in their ``text_config``. A heterogeneous
        text config (``dots3_note``: ``per_layer_config`` overrides keyed by layer index, ``rope_parameters`` keyed by
        layer type) needs ``layer``; its dims are the global fields overridden by that layer's entry.

        The softmax scale is the attention module's ``self.scaling``: ``(qk_nope_head_dim + qk_rope_head_dim) **
        -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` for a scaled RoPE (transformers'
        ``yarn_apply_mscale``, :func:`softmax_scale_from_rope_scaling`) except in the model types whose attention does
        not apply it (:data:`PLAIN_SCALE_MODEL_TYPES`: ``kimi_linear``, ``glm5_next``, ``dots3_note``). The RoPE entry
        is ``rope_parameters`` (what transformers 5 writes) or ``rope_scaling`` (DeepSeek's published files).

        Args:
            config: see above.
            layer: the decoder layer (0-based) whose attention to read; required for a heterogeneous config, checked
                against ``num_hidden_layers`` and ``layer_types`` (a linear-attention layer is not MLA) when given.

        Raises:
            TypeError: ``config`` is none of the accepted kinds (the message lists them).
            FileNotFoundError: the path does not exist.
            ValueError: a required field is missing (the message names it: a config that is not MLA), a field
                contradicts another (``qk_head_dim``, ``num_key_value_heads``, rope_parameters vs rope_scaling),
                ``layer`` is missing for a heterogeneous config, out of range, or names a layer that is not MLA.
        """
        if not isinstance(config, Mapping):
            if callable(getattr(config, "to_dict", None)) and not isinstance(config, (str, os.PathLike)):
                config = config.to_dict()
                if not isinstance(config, Mapping):
                    raise TypeError(f"config.to_dict() must return a mapping, got {type(config).__name__}")
            elif isinstance(config, (str, os.PathLike)):
                path = os.fspath(config)
                if os.path.isdir(path):
                    path = os.path.join(path, "config.json")
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
                if not isinstance(config, Mapping):
                    raise ValueError(f"config: {path} holds a JSON {type(config).__name__}, not an object")
            else:
                raise TypeError(
                    "config must be a path to config.json or its folder (str or os.PathLike), the parsed "
                    "config (a mapping), or a config object with to_dict() (e.g. transformers' "
                    f"DeepseekV2Config); got {type(config).__name__}"
                )
        outer_type = config.get("model_type")
        text = config.get("text_config")
        if config.get("kv_lora_rank") is None and isinstance(text, Mapping):
            config = text  # a multimodal wrapper: the MLA fields live in its text config
        config = _layer_config(config, layer)
        missing = [k for k in _FIELDS if config.get(k) is None]
        if missing:
            raise ValueError(
                f"config: missing MLA field(s) {missing}; not an MLA attention config (known MLA model "
                f"types: {', '.join(HF_MLA_MODEL_TYPES)})"
            )
        ints = {k: _config_int(config, k, allow_zero=k == "qk_rope_head_dim") for k in _FIELDS}
        head_dim_qk = ints["qk_nope_head_dim"] + ints["qk_rope_head_dim"]
        if config.get("qk_head_dim") is not None and config["qk_head_dim"] != head_dim_qk:
            raise ValueError(
                f"config: qk_head_dim {config['qk_head_dim']!r} contradicts qk_nope_head_dim "
                f"{ints['qk_nope_head_dim']} + qk_rope_head_dim {ints['qk_rope_head_dim']}"
            )
        kv_heads = config.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != ints["num_attention_heads"]:
            raise ValueError(
                f"config: num_key_value_heads {kv_heads!r} differs from num_attention_heads "
                f"{ints['num_attention_heads']}; MLA up-projects one latent to every head"
            )
        rope = _rope_entry(config)
        plain = bool({outer_type, config.get("model_type")} & set(PLAIN_SCALE_MODEL_TYPES))
        return cls(
            num_heads=ints["num_attention_heads"],
            kv_lora_rank=ints["kv_lora_rank"],
            qk_nope_head_dim=ints["qk_nope_head_dim"],
            qk_rope_head_dim=ints["qk_rope_head_dim"],
            v_head_dim=ints["v_head_dim"],
            softmax_scale=head_dim_qk**-0.5 if plain else softmax_scale_from_rope_scaling(head_dim_qk, rope),
        )

    @classmethod
    def deepseek_v2_lite(cls) -> "MLADims":
        """DeepSeek-V2-Lite / DeepSeek-Coder-V2-Lite-Instruct: 16 heads, YaRN factor 40, mscale_all_dim 0.707."""
        return cls.from_hf_config(_PRESET_CONFIGS["deepseek-v2-lite"])

    @classmethod
    def deepseek_v3(cls) -> "MLADims":
        """DeepSeek-V3 / R1: 128 heads, YaRN factor 40, mscale_all_dim 1.0."""
        return cls.from_hf_config(_PRESET_CONFIGS["deepseek-v3"])

    @classmethod
    def preset(cls, name: str) -> "MLADims":
        """A preset by name: one of :data:`PRESETS` ("deepseek-v2-lite", "deepseek-v3", "deepseek-v3.2", "kimi-k2",
        "glm-4.7-flash", "glm-5", "mistral-large-3"): the attention dims of the published model's config.json.

        Raises:
            ValueError: unknown name (the message lists the known ones).
        """
        if name not in _PRESET_CONFIGS:
            raise ValueError(f"preset: unknown model {name!r}; known: {sorted(_PRESET_CONFIGS)}")
        return cls.from_hf_config(_PRESET_CONFIGS[name])


_YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}

# The MLA fields of the published config.json files. DeepSeek's were copied from Hugging Face
# (deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct, deepseek-ai/DeepSeek-V3; DeepSeek-V3.2
# keeps V3's attention fields and YaRN). The others could not be downloaded here: their dims are transformers 5.25's
# defaults of the model type (glm4_moe_lite: GLM-4.7-Flash, glm_moe_dsa: GLM-5, mistral_large4: Mistral Large 3,
# deepseek_v3 at 64 heads: Kimi-K2), and their RoPE entries: Kimi-K2-Instruct-0905's YaRN (factor 64, mscale_all_dim
# 1.0), GLM's and Mistral Large 3's without mscale_all_dim (the plain head_dim_qk ** -0.5). A checkpoint's own
# config.json (``mla-bridge prefill --checkpoint``, :meth:`MLADims.from_hf_config`) always wins.
_PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": {
        "num_attention_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
    "deepseek-v3": {
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "deepseek-v3.2": {
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "kimi-k2": {
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    },
    "glm-4.7-flash": {
        "num_attention_heads": 20,
        "kv_lora_rank": 512,
        "q_lora_rank": 768,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rope_scaling": None,
    },
    "glm-5": {
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 2048,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rope_scaling": None,
    },
    "mistral-large-3": {
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling": None,
    },
}
PRESETS = tuple(_PRESET_CONFIGS)
