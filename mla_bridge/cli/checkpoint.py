"""``mla-bridge prefill --checkpoint DIR --layer N``: one layer's ``kv_b_proj.weight`` from a local safetensors
checkpoint, FP8 block-quantized weights dequantized with their ``weight_scale_inv``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from .errors import CLIError

FP8_DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size


def _is_fp8(dtype) -> bool:
    import torch

    return dtype.is_floating_point and torch.empty((), dtype=dtype).element_size() == 1


def _safe_open(path):
    """safetensors' ``safe_open``, with an unreadable file (corrupt header, not safetensors) as a CLIError."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise CLIError(f"--checkpoint: {path} is not a readable safetensors file: {err}") from None


def load_kv_b_proj_weight(checkpoint: "str | os.PathLike", layer: int, dims=None, config: Optional[dict] = None):
    """Load ``model.layers.{layer}.self_attn.kv_b_proj.weight`` alone from a local safetensors checkpoint.

    The tensor is read lazily with safetensors' ``safe_open`` (only that tensor, and its scale); the shard comes
    from ``model.safetensors.index.json`` when present, else from the ``*.safetensors`` file that holds it.
    bf16/fp16/fp32 weights are returned as stored; an FP8 weight (``float8_e4m3fn``) is dequantized to float32
    with its ``weight_scale_inv`` (block-quantized, DeepSeek-V3: ``weight = fp8.float() * scale_inv`` repeated over
    ``weight_block_size`` blocks, 128x128 unless ``config["quantization_config"]["weight_block_size"]`` says).

    Args:
        checkpoint: the checkpoint folder.
        layer: layer index.
        dims: an :class:`mla_bridge.MLADims` whose ``kv_b_proj_shape`` the tensor must have (optional).
        config: the parsed ``config.json`` (optional; for ``weight_block_size`` and ``num_hidden_layers``).

    Returns:
        ``(weight, description)``: the tensor on the CPU and a short account of where it came from.

    Raises:
        CLIError: no such folder, index entry, tensor or shard; an FP8 weight without ``weight_scale_inv``; a scale
            or weight of the wrong shape; a file that is not readable safetensors.
    """
    root = Path(checkpoint)
    if not root.is_dir():
        raise CLIError(f"--checkpoint: {root} is not a folder")
    config = config or {}
    n_layers = config.get("num_hidden_layers")
    if isinstance(n_layers, int) and not 0 <= layer < n_layers:
        raise CLIError(f"--layer {layer} is out of range: config.json has num_hidden_layers = {n_layers}")
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    scale_name = name + "_scale_inv"
    index_path = root / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as err:
            raise CLIError(f"--checkpoint: {index_path} is not a safetensors index (no weight_map): {err}") from None
        if name not in weight_map:
            raise CLIError(
                f"--checkpoint: {name} is not in {index_path.name} (--layer {layer}; is this a "
                f"DeepSeek-V2/V3 checkpoint?)"
            )
        shard = root / weight_map[name]
        scale_shard = root / weight_map[scale_name] if scale_name in weight_map else None
        if not shard.is_file():
            raise CLIError(f"--checkpoint: {name} is in shard {weight_map[name]}, which is missing from {root}")
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CLIError(f"--checkpoint: no *.safetensors files and no model.safetensors.index.json in {root}")
        shard = scale_shard = None
        for f in files:
            with _safe_open(f) as handle:
                keys = set(handle.keys())
            if name in keys and shard is None:
                shard = f
            if scale_name in keys and scale_shard is None:
                scale_shard = f
        if shard is None:
            raise CLIError(f"--checkpoint: no tensor {name} in {', '.join(f.name for f in files)} (--layer {layer})")

    with _safe_open(shard) as handle:
        weight = handle.get_tensor(name)
    where = f"{shard.name}: {name} [{weight.shape[0]}, {weight.shape[1]}] {str(weight.dtype).replace('torch.', '')}"
    if weight.dim() != 2:
        raise CLIError(f"--checkpoint: {name} must be 2-D, got shape {list(weight.shape)}")
    if _is_fp8(weight.dtype):
        if scale_shard is None:
            raise CLIError(
                f"--checkpoint: {name} is {weight.dtype} (FP8) but {scale_name} is missing, so it cannot "
                f"be dequantized; a block-quantized FP8 checkpoint (DeepSeek-V3 style) stores it next to "
                f"the weight"
            )
        with _safe_open(scale_shard) as handle:
            scale = handle.get_tensor(scale_name)
        block = (config.get("quantization_config") or {}).get("weight_block_size") or FP8_DEFAULT_BLOCK
        bo, bi = int(block[0]), int(block[1])
        rows, cols = weight.shape
        want = (-(-rows // bo), -(-cols // bi))
        if tuple(scale.shape) != want:
            raise CLIError(
                f"--checkpoint: {scale_name} has shape {list(scale.shape)}, expected {list(want)} for a "
                f"[{rows}, {cols}] weight in {bo}x{bi} blocks"
            )
        full = scale.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
        weight = weight.float() * full
        where += f", dequantized with {scale_name} ({bo}x{bi} blocks)"
    if dims is not None and tuple(weight.shape) != tuple(dims.kv_b_proj_shape):
        raise CLIError(
            f"--checkpoint: {name} has shape {list(weight.shape)}, but config.json's dims need "
            f"{list(dims.kv_b_proj_shape)} ([heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank])"
        )
    return weight, where
