"""``mla-bridge info``: what this machine has (torch, CUDA devices, FlashInfer and its JIT cache, JAX) and which
backend the dispatch table picks for DeepSeek MLA prefill."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Optional

from .args import write_output
from .table import _row


def _package_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def flashinfer_cache_dir() -> Path:
    """FlashInfer's JIT cache folder: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (base default: home)."""
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    return Path(base) / ".cache" / "flashinfer"


def cmd_info(args, console) -> int:
    import torch
    from rich.table import Table
    from rich.text import Text

    from .. import __version__
    from ..dispatch import ENV_VAR, flashinfer_version, select_backend
    from ..dims import MLADims
    from ..prefill import ENV_SWITCHES, kernel_choices

    info: dict[str, Any] = {
        "mla_bridge": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
        "devices": [], "flashinfer": flashinfer_version(), "flashinfer_jit_cache": str(flashinfer_cache_dir()),
        "jax": _package_version("jax"), "jaxlib": _package_version("jaxlib"), ENV_VAR: os.environ.get(ENV_VAR),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            info["devices"].append({"index": i, "name": torch.cuda.get_device_name(i), "capability": list(cap)})

    table = Table(title="mla-bridge info", title_justify="left", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("")
    _row(table, "mla-bridge", __version__)
    _row(table, "python", f"{info['python']} ({sys.executable})")
    _row(table, "torch", info["torch"])
    _row(table, "CUDA", f"available, torch built with CUDA {info['torch_cuda']}" if info["cuda_available"]
                  else f"not available (torch CUDA build: {info['torch_cuda'] or 'none, CPU build'})")
    for d in info["devices"]:
        _row(table, f"device cuda:{d['index']}", f"{d['name']}, capability {d['capability'][0]}.{d['capability'][1]}")
    if not info["devices"]:
        _row(table, "device", f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    _row(table, "FlashInfer", info["flashinfer"] or "not installed (pip install 'mla-bridge[flashinfer]')")
    _row(table, "FlashInfer JIT cache", f"{info['flashinfer_jit_cache']}"
                  + ("" if os.environ.get("FLASHINFER_WORKSPACE_BASE") else " (set FLASHINFER_WORKSPACE_BASE to move it)"))
    _row(table, "JAX", f"{info['jax']} (jaxlib {info['jaxlib']})" if info["jax"] else "not installed")
    _row(table, ENV_VAR, info[ENV_VAR] or "unset (the dispatch table decides)")
    for name in ENV_SWITCHES[1:]:
        info[name] = os.environ.get(name)
        _row(table, name, info[name] or "unset (the default)")
    table.add_section()
    try:
        choice = select_backend(dtype=torch.bfloat16, head_dim_qk=192, head_dim_vo=128, causal=True)
        info["backend"] = {"name": choice.name, "reason": choice.reason, "passed_over": [list(p) for p in choice.passed_over]}
        _row(table, "backend", Text.assemble((choice.name, "green"), f" for bf16, head dims 192/128, causal: {choice.reason}"))
        for name, why in choice.passed_over:
            _row(table, "  passed over", f"{name}: {why}")
    except ValueError as err:
        info["backend"] = {"error": str(err)}
        _row(table, "backend", Text.assemble(("error", "bold red"), f": {err}"))
    from ..dims import PRESETS
    info["presets"] = {}
    for name in PRESETS:  # what `mla-bridge prefill --model NAME` runs, and which backend serves its head dims
        d = MLADims.preset(name)
        try:
            served = select_backend(dtype=torch.bfloat16, head_dim_qk=d.head_dim_qk, head_dim_vo=d.head_dim_vo,
                                    causal=True).name
        except ValueError as err:
            served = f"error: {err}"
        info["presets"][name] = {"num_heads": d.num_heads, "kv_lora_rank": d.kv_lora_rank,
                                 "qk_nope_head_dim": d.qk_nope_head_dim, "qk_rope_head_dim": d.qk_rope_head_dim,
                                 "v_head_dim": d.v_head_dim, "softmax_scale": d.softmax_scale, "backend": served}
        _row(table, f"--model {name}", f"{d.num_heads} heads, q/k {d.qk_nope_head_dim}+{d.qk_rope_head_dim}, "
                                       f"v {d.v_head_dim}, kv_lora_rank {d.kv_lora_rank}, scale "
                                       f"{d.softmax_scale:.6g}: {served}")
    try:  # what mla_prefill would run besides the backend; a switch that cannot serve is named here
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        kernels = kernel_choices(device, torch.bfloat16, MLADims.deepseek_v2_lite())
        info["kernels"] = kernels
        _row(table, "kernels", ", ".join(f"{k}: {v}" for k, v in kernels.items()) + f" (bf16 on {device.type})")
    except (ValueError, TypeError, RuntimeError) as err:
        info["kernels"] = {"error": str(err)}
        _row(table, "kernels", Text.assemble(("error", "bold red"), f": {err}"))
    console.print(table)
    if getattr(args, "json", None) is not None:
        write_output(args.json, json.dumps(info, indent=2) + "\n")
    return 0
