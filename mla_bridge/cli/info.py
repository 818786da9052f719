"""``mla-bridge info``: what this machine has (torch, CUDA devices, FlashInfer and its JIT cache, JAX), every
``MLA_BRIDGE_*`` environment variable the library reads with its value, the dtype each path computes in, and which
backend the dispatch table picks for DeepSeek MLA prefill at this machine's default dtype."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Optional

from .. import switches
from .args import write_output
from .table import add_row


def _package_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


#: Every environment variable mla_bridge and its adapters read, as :data:`mla_bridge.switches.SWITCHES` lists them:
#: (name, what it chooses, its default, where it is read). tests/test_cli.py checks the list against the source, so
#: a new variable cannot be left out.
ENV_VARIABLES = tuple((sw.name, sw.doc, sw.default, sw.read_by) for sw in switches.SWITCHES)

#: The dtype each path computes in (what the code does, whatever the input dtype).
COMPUTE_DTYPES = (
    ("FlashInfer backends (fa2, fa3, cutlass)", "q/k/v/out float16 or bfloat16, float32 accumulation; LSE float32"),
    ("torch backend", "float32 whatever the input dtype; out in q's dtype; LSE float32"),
    ("up-projection (kv_b_proj)", "the plan's dtype, float32 accumulation (cuBLAS or the Triton kernel)"),
    (
        "merge of context chunks",
        "float32 arithmetic; rows merged again kept in float32, rounded once into out's dtype; LSE float32",
    ),
    ("FP8 latent cache", "e4m3 values times the scale, dequantized into the plan's dtype in the gather"),
    ("mla-bridge prefill check", "float64 (mla_bridge.reference)"),
)


def default_dtype(device_type: str) -> str:
    """The dtype ``mla-bridge prefill --dtype auto`` and ``mla-bridge bench`` use on a device: bfloat16 on CUDA,
    float32 on the CPU (where only the torch backend runs, and it computes in float32)."""
    return "bfloat16" if device_type == "cuda" else "float32"


def flashinfer_cache_dir() -> Path:
    """FlashInfer's JIT cache folder: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (base default: home)."""
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    return Path(base) / ".cache" / "flashinfer"


def cmd_info(args, console) -> int:
    import torch
    from rich.table import Table
    from rich.text import Text

    from .. import __version__
    from ..dims import MLADims
    from ..dispatch import flashinfer_version, select_backend
    from ..prefill import kernel_choices

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype_name = default_dtype(device.type)
    dtype = getattr(torch, dtype_name)
    info: dict[str, Any] = {
        "mla_bridge": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "devices": [],
        "flashinfer": flashinfer_version(),
        "flashinfer_jit_cache": str(flashinfer_cache_dir()),
        "jax": _package_version("jax"),
        "jaxlib": _package_version("jaxlib"),
        "dtype": dtype_name,
        "compute_dtypes": dict(COMPUTE_DTYPES),
        "environment": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            info["devices"].append({"index": i, "name": torch.cuda.get_device_name(i), "capability": list(cap)})

    table = Table(title="mla-bridge info", title_justify="left", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("")
    add_row(table, "mla-bridge", __version__)
    add_row(table, "python", f"{info['python']} ({sys.executable})")
    add_row(table, "torch", info["torch"])
    add_row(
        table,
        "CUDA",
        f"available, torch built with CUDA {info['torch_cuda']}"
        if info["cuda_available"]
        else f"not available (torch CUDA build: {info['torch_cuda'] or 'none, CPU build'})",
    )
    for d in info["devices"]:
        add_row(
            table, f"device cuda:{d['index']}", f"{d['name']}, capability {d['capability'][0]}.{d['capability'][1]}"
        )
    if not info["devices"]:
        add_row(table, "device", f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    add_row(table, "FlashInfer", info["flashinfer"] or "not installed (pip install 'mla-bridge[flashinfer]')")
    add_row(
        table,
        "FlashInfer JIT cache",
        f"{info['flashinfer_jit_cache']}"
        + ("" if os.environ.get("FLASHINFER_WORKSPACE_BASE") else " (set FLASHINFER_WORKSPACE_BASE to move it)"),
    )
    add_row(table, "JAX", f"{info['jax']} (jaxlib {info['jaxlib']})" if info["jax"] else "not installed")
    table.add_section()
    add_row(table, "environment", f"the {len(ENV_VARIABLES)} variables mla_bridge reads")
    for sw in switches.SWITCHES:
        value = switches.raw(sw.name)  # as set: info reports (flagging a value the reader refuses), never raises
        invalid = switches.problem(sw.name)
        info[sw.name] = value
        info["environment"].append(
            {
                "name": sw.name,
                "value": value,
                "default": sw.default,
                "values": sw.values,
                "meaning": sw.doc,
                "read_by": sw.read_by,
                "invalid": invalid,
            }
        )
        add_row(
            table,
            f"  {sw.name}",
            (f"{value!r}" if value is not None else f"unset (default: {sw.default})")
            + (f" INVALID: {invalid}" if invalid else "")
            + f"; {sw.doc}; values: {sw.values}",
        )
    table.add_section()
    add_row(
        table,
        "dtype",
        f"{dtype_name}: what mla-bridge prefill (--dtype auto) and bench use on {device.type}"
        + ("" if device.type == "cuda" else "; the API takes bfloat16, float16 and float32 here too"),
    )
    for path, what in COMPUTE_DTYPES:
        add_row(table, f"  {path}", what)
    table.add_section()
    try:
        choice = select_backend(dtype=dtype, head_dim_qk=192, head_dim_vo=128, causal=True)
        info["backend"] = {
            "name": choice.name,
            "reason": choice.reason,
            "dtype": dtype_name,
            "passed_over": [list(p) for p in choice.passed_over],
        }
        add_row(
            table,
            "backend",
            Text.assemble((choice.name, "green"), f" for {dtype_name}, head dims 192/128, causal: {choice.reason}"),
        )
        for name, why in choice.passed_over:
            add_row(table, "  passed over", f"{name}: {why}")
    except ValueError as err:
        info["backend"] = {"error": str(err), "dtype": dtype_name}
        add_row(table, "backend", Text.assemble(("error", "bold red"), f": {err}"))
    from ..dims import PRESETS

    info["presets"] = {}
    for name in PRESETS:  # what `mla-bridge prefill --model NAME` runs, and which backend serves its head dims
        d = MLADims.preset(name)
        try:
            served = select_backend(
                dtype=torch.bfloat16, head_dim_qk=d.head_dim_qk, head_dim_vo=d.head_dim_vo, causal=True
            ).name
        except ValueError as err:
            served = f"error: {err}"
        info["presets"][name] = {
            "num_heads": d.num_heads,
            "kv_lora_rank": d.kv_lora_rank,
            "qk_nope_head_dim": d.qk_nope_head_dim,
            "qk_rope_head_dim": d.qk_rope_head_dim,
            "v_head_dim": d.v_head_dim,
            "softmax_scale": d.softmax_scale,
            "backend": served,
        }
        add_row(
            table,
            f"--model {name}",
            f"{d.num_heads} heads, q/k {d.qk_nope_head_dim}+{d.qk_rope_head_dim}, "
            f"v {d.v_head_dim}, kv_lora_rank {d.kv_lora_rank}, scale "
            f"{d.softmax_scale:.6g}: {served}",
        )
    try:  # what mla_prefill would run besides the backend; a switch that cannot serve is named here
        kernels = kernel_choices(device, dtype, MLADims.deepseek_v2_lite())
        info["kernels"] = kernels
        add_row(
            table, "kernels", ", ".join(f"{k}: {v}" for k, v in kernels.items()) + f" ({dtype_name} on {device.type})"
        )
    except (ValueError, TypeError, RuntimeError) as err:
        info["kernels"] = {"error": str(err)}
        add_row(table, "kernels", Text.assemble(("error", "bold red"), f": {err}"))
    console.print(table)
    if getattr(args, "json", None) is not None:
        write_output(args.json, json.dumps(info, indent=2) + "\n")
    return 0
