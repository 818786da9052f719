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
from typing import Any, Mapping, Union

__all__ = ["MLADims", "yarn_mscale", "softmax_scale_from_rope_scaling"]


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
    scale = head_dim_qk ** -0.5
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
        scale *= m * m
    return scale


def _config_int(config: Mapping[str, Any], key: str) -> int:
    """``config[key]`` as a positive int: an int (JSON ``16``; ``16.0`` too), never a bool or a fraction."""
    value = config[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"config: {key} must be a positive integer, got {value!r}")
    return int(value)


def _rope_entry(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The RoPE scaling entry of a config: ``rope_parameters`` (transformers 5 writes only this) or ``rope_scaling``
    (DeepSeek's published files, transformers 4). Both present with different scales is an error."""
    params, scaling = config.get("rope_parameters"), config.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"config: {name} must be a mapping or null, got {type(value).__name__}")
    if params and scaling and softmax_scale_from_rope_scaling(1, params) != softmax_scale_from_rope_scaling(1, scaling):
        raise ValueError(f"config: rope_parameters {dict(params)} and rope_scaling {dict(scaling)} disagree on the "
                         f"YaRN softmax factor; keep one of them")
    return params or scaling


@dataclass(frozen=True)
class MLADims:
    """Sizes of one MLA attention layer in its prefill ("MHA") form.

    Attributes (all counts, no units):
        num_heads: query heads H (DeepSeek-V2-Lite 16, DeepSeek-V3 128). Prefill runs MHA: k/v heads == H.
        kv_lora_rank: width of the compressed latent ``kv_c`` (512).
        qk_nope_head_dim: per-head width of the non-RoPE part of q and k (128).
        qk_rope_head_dim: width of the shared RoPE key ``k_pe`` and the RoPE part of q (64).
        v_head_dim: per-head width of v and of the output (128).
        softmax_scale: the attention logit scale; ``None`` means ``head_dim_qk ** -0.5``.

    Derived: ``head_dim_qk = qk_nope_head_dim + qk_rope_head_dim`` (192), ``head_dim_vo = v_head_dim``,
    ``latent_dim = kv_lora_rank + qk_rope_head_dim`` (576, one paged-cache entry per token).

    Raises:
        ValueError: a size that is not a positive int, or a scale that is not a positive finite number.
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
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"MLADims.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integers become ints
        if self.softmax_scale is None:
            object.__setattr__(self, "softmax_scale", self.head_dim_qk ** -0.5)
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
    def from_hf_config(cls, config: Union[str, os.PathLike, Mapping[str, Any], Any]) -> "MLADims":
        """Read a DeepSeek-V2/V3 config: a path to ``config.json`` or its folder, the parsed dict, or a config object
        with ``to_dict()`` (a ``transformers`` ``DeepseekV2Config`` / ``DeepseekV3Config``).

        Uses ``num_attention_heads``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
        ``v_head_dim`` and the RoPE scaling entry: ``rope_parameters`` (what transformers 5 writes) or
        ``rope_scaling`` (DeepSeek's published files), keyed ``rope_type`` or ``type``, ``"default"`` meaning no
        scaling (see :func:`softmax_scale_from_rope_scaling`). The scale equals transformers' own
        ``DeepseekV2Attention.scaling`` / ``DeepseekV3Attention.scaling`` (tests/test_dims.py checks it).

        Raises:
            TypeError: ``config`` is none of the accepted kinds (the message lists them).
            FileNotFoundError: the path does not exist.
            ValueError: a required field is missing (the message names it), or rope_parameters and rope_scaling
                disagree.
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
                raise TypeError("config must be a path to config.json or its folder (str or os.PathLike), the parsed "
                                "config (a mapping), or a config object with to_dict() (e.g. transformers' "
                                f"DeepseekV2Config); got {type(config).__name__}")
        missing = [k for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                               "v_head_dim") if config.get(k) is None]
        if missing:
            raise ValueError(f"config: missing MLA field(s) {missing}; is this a DeepSeek-V2/V3 config.json?")
        ints = {k: _config_int(config, k) for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                                                      "qk_rope_head_dim", "v_head_dim")}
        head_dim_qk = ints["qk_nope_head_dim"] + ints["qk_rope_head_dim"]
        return cls(
            num_heads=ints["num_attention_heads"],
            kv_lora_rank=ints["kv_lora_rank"],
            qk_nope_head_dim=ints["qk_nope_head_dim"],
            qk_rope_head_dim=ints["qk_rope_head_dim"],
            v_head_dim=ints["v_head_dim"],
            softmax_scale=softmax_scale_from_rope_scaling(head_dim_qk, _rope_entry(config)),
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
        """A preset by name: one of :data:`PRESETS` ("deepseek-v2-lite", "deepseek-v3").

        Raises:
            ValueError: unknown name (the message lists the known ones).
        """
        if name not in _PRESET_CONFIGS:
            raise ValueError(f"preset: unknown model {name!r}; known: {sorted(_PRESET_CONFIGS)}")
        return cls.from_hf_config(_PRESET_CONFIGS[name])


_YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}

# The MLA fields of the published config.json files (Hugging Face: deepseek-ai/DeepSeek-V2-Lite,
# deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct, deepseek-ai/DeepSeek-V3).
_PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": {
        "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
    "deepseek-v3": {
        "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
}
PRESETS = tuple(_PRESET_CONFIGS)
