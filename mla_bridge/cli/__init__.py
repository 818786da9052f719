"""The ``mla-bridge`` command: ``prefill`` (the main job), ``info`` and ``bench``.

``mla-bridge prefill`` builds one MLA prefill batch at a model's dims (random weights, or the real
``kv_b_proj.weight`` of one layer of a local safetensors checkpoint), fills a paged latent cache, plans it once
(:class:`mla_bridge.PrefillPlan`), runs :func:`mla_bridge.mla_prefill` for ``--layers`` layers on the backend the
dispatch table picks, and checks a sample of requests against an independent float64 computation
(:mod:`mla_bridge.reference`). ``mla-bridge info`` says what this machine has and which backend it gets.
``mla-bridge bench`` is :mod:`mla_bridge.bench` (imported only when asked for).

Exit codes: 0 success; 1 the check against the float64 reference failed its tolerance; 2 bad arguments or a
request the library refuses (the message names the flag or the reason).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["main", "build_parser", "load_kv_b_proj_weight", "CLIError"]

DEMO_BATCH = 4
DEMO_PROMPT_LEN = 256
DEMO_CONTEXT_LENS = (0, 256, 512, 1024)
DEFAULT_CHECK_REQUESTS = 2
CPU_WARMUP_FLOPS = 50e9  # below this many FLOPs per layer, the CPU also runs an untimed warm-up layer
FP8_DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size
#: Allowed error against the float64 reference, per run dtype: ``|x - ref| <= atol + rtol * |ref|`` elementwise, as
#: ((out atol, out rtol), (lse atol, lse rtol)). Half precision: out is rounded to bf16/fp16 (a relative error of up
#: to 2**-8 / 2**-11, so rtol is two such roundings), and k/v are rounded after the up-projection.
TOLERANCE = {
    "float32": ((1e-4, 0.0), (1e-4, 0.0)),
    "bfloat16": ((2e-2, 2.0 ** -7), (1e-2, 1e-3)),
    "float16": ((1e-2, 2.0 ** -10), (1e-2, 1e-3)),
}


class CLIError(Exception):
    """A bad argument or an input the command refuses; the message names the flag. Exit code 2."""


# --------------------------------------------------------------------------------------------------- arguments

def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 256,512, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


PREFILL_EPILOG = """\
workload:
  default            4 requests x 256 new tokens with 0, 256, 512, 1024 cached context tokens
                     (a few seconds on a 2-core CPU); --context-lens defaults to 0 as soon as you
                     set --batch, --prompt-len or --prompt-lens yourself.
  seed workload      mla-bridge prefill --batch 4 --prompt-len 10000
                     (milliseconds on an H200; minutes on a 2-core CPU: --check-requests 1 saves one
                     float64 check of a 10000-token request, --no-breakdown one extra layer)
  prefix-cache case  mla-bridge prefill --context-lens 8000 --prompt-len 2000
                     (4 requests, each 8000 cached + 2000 new tokens)
  chunked context    add --chunk-tokens 4096 (context above the budget runs in chunks merged by LSE)

dtype: --dtype auto is bfloat16 on CUDA (what FlashInfer runs) and float32 on the CPU (where only the
torch backend runs; it computes in float32 anyway, so bf16 inputs there only add rounding).

timing: the per-layer time is mla_prefill itself (CUDA events on a GPU, time.perf_counter on the CPU),
after one untimed warm-up layer (on the CPU only while a layer is under 50 GFLOP). The split into
gather/up-projection, main pass, context chunks and merge comes from one extra layer that runs the
plan's pieces one by one (--no-breakdown skips it).

check: --check-requests requests (spread over the batch) are recomputed by mla_bridge.reference: float64,
unchunked, straight from the paged cache; cache slots that hold no context are NaN, so reading one shows.
Exit code 1 when an error exceeds atol + rtol x |ref| (float32: 1e-4; bf16: out 2e-2 + 2**-7 x |ref|,
lse 1e-2 + 1e-3 x |ref|; fp16: out 1e-2 + 2**-10 x |ref|, lse as bf16).

checkpoint: --checkpoint DIR --layer N reads DIR/config.json for the dims and only
model.layers.N.self_attn.kv_b_proj.weight (via model.safetensors.index.json when present); an FP8 weight
is dequantized with its weight_scale_inv (128x128 blocks, or quantization_config.weight_block_size).
"""


def build_parser(bench_module: Any = None) -> argparse.ArgumentParser:
    """The argument parser. ``bench_module`` (``mla_bridge.bench``) adds the ``bench`` options when given; it is
    only imported when ``bench`` is the command, so other commands never pay for it."""
    from .. import __version__
    from ..dims import PRESETS
    from ..dispatch import BACKEND_NAMES

    parser = argparse.ArgumentParser(
        prog="mla-bridge",
        description="MLA (DeepSeek-V2/V3) ragged prefill: FlashInfer on NVIDIA GPUs, a torch reference on the CPU.")
    parser.add_argument("--version", action="version", version=f"mla-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "prefill", help="run MLA prefill on a batch at a model's dims and check it against float64",
        description="Plan one MLA prefill batch once, run it per layer with mla_prefill, time it, and check a sample "
                    "of requests against an independent float64 reference.",
        epilog=PREFILL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=PRESETS, default=None,
                   help="dims preset (default deepseek-v2-lite: DeepSeek-Coder-V2-Lite-Instruct, 16 heads)")
    g.add_argument("--checkpoint", metavar="DIR", type=Path,
                   help="local safetensors checkpoint: dims from DIR/config.json, kv_b_proj weight of --layer")
    g.add_argument("--layer", type=_nonnegative_int, metavar="N",
                   help="which layer's kv_b_proj.weight to load from --checkpoint")
    g = p.add_argument_group("batch")
    g.add_argument("--prompt-lens", type=_int_list, metavar="L1,L2,...", help="new tokens per request")
    g.add_argument("--batch", type=_positive_int, metavar="N", help=f"requests (default {DEMO_BATCH})")
    g.add_argument("--prompt-len", type=_nonnegative_int, metavar="L",
                   help=f"new tokens of every request (default {DEMO_PROMPT_LEN})")
    g.add_argument("--context-lens", type=_int_list, metavar="C1,C2,...",
                   help="cached context tokens per request, or one value for all (default: see below)")
    g.add_argument("--block-size", type=_positive_int, default=64, metavar="B",
                   help="tokens per block of the paged latent cache (default 64)")
    g.add_argument("--chunk-tokens", type=_positive_int, metavar="N",
                   help="Workspace chunk budget: context tokens gathered per chunk (default 65536)")
    g.add_argument("--no-fuse", action="store_true",
                   help="never fuse context into the main pass (always a main pass + context chunks + merge)")
    g = p.add_argument_group("run")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="q / cache / weight dtype (default auto: bfloat16 on CUDA, float32 on the CPU)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default cuda when available, else cpu)")
    g.add_argument("--backend", choices=BACKEND_NAMES + ("auto",), default=None,
                   help="force a backend (default: the dispatch table, or $MLA_BRIDGE_BACKEND)")
    g.add_argument("--layers", type=_positive_int, default=1, metavar="N",
                   help="run the one plan N times, as a model does per layer (default 1)")
    g.add_argument("--seed", type=int, default=0, help="random seed for inputs and block table (default 0)")
    g.add_argument("--check-requests", type=_nonnegative_int, default=DEFAULT_CHECK_REQUESTS, metavar="K",
                   help=f"requests checked against the float64 reference, 0 for none (default {DEFAULT_CHECK_REQUESTS})")
    g.add_argument("--no-breakdown", action="store_true", help="skip the extra layer that times each pass")
    g.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser("info", help="torch, CUDA, device, FlashInfer, JAX, and the backend this machine gets",
                       description="What this machine has, and which backend select_backend picks for DeepSeek MLA "
                                   "prefill (bf16, head dims 192/128, causal).")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bench", help="benchmarks (mla_bridge.bench)",
                       description="Benchmarks, from mla_bridge.bench.")
    if bench_module is not None:
        bench_module.add_arguments(p)
    p.set_defaults(func=lambda args, console: _run_bench(bench_module, args))
    return parser


# --------------------------------------------------------------------------------------------------- main

def _console(file=None):
    from rich.console import Console

    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, highlight=False, width=max(console.width, 120))
    return console


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``mla-bridge`` console script; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    bench_module = None
    if command == "bench":
        try:
            import importlib

            bench_module = importlib.import_module("mla_bridge.bench")
        except Exception as err:  # ImportError, or an error inside it
            print(f"mla-bridge bench: the benchmark module mla_bridge.bench is not available "
                  f"({type(err).__name__}: {err})", file=sys.stderr)
            return 2
    parser = build_parser(bench_module)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version (0) or a usage error (2, message printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    console = _console()
    try:
        return int(args.func(args, console) or 0)
    except CLIError as err:
        print(f"mla-bridge {args.command}: error: {err}", file=sys.stderr)
        return 2


def _run_bench(bench_module: Any, args: argparse.Namespace) -> int:
    return int(bench_module.run(args) or 0)


# --------------------------------------------------------------------------------------------------- checkpoint

def _is_fp8(dtype) -> bool:
    import torch

    return dtype.is_floating_point and torch.empty((), dtype=dtype).element_size() == 1


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
            or weight of the wrong shape.
    """
    from safetensors import safe_open

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
            raise CLIError(f"--checkpoint: {name} is not in {index_path.name} (--layer {layer}; is this a "
                           f"DeepSeek-V2/V3 checkpoint?)")
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
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                keys = set(handle.keys())
            if name in keys and shard is None:
                shard = f
            if scale_name in keys and scale_shard is None:
                scale_shard = f
        if shard is None:
            raise CLIError(f"--checkpoint: no tensor {name} in {', '.join(f.name for f in files)} (--layer {layer})")

    with safe_open(str(shard), framework="pt", device="cpu") as handle:
        weight = handle.get_tensor(name)
    where = f"{shard.name}: {name} [{weight.shape[0]}, {weight.shape[1]}] {str(weight.dtype).replace('torch.', '')}"
    if weight.dim() != 2:
        raise CLIError(f"--checkpoint: {name} must be 2-D, got shape {list(weight.shape)}")
    if _is_fp8(weight.dtype):
        if scale_shard is None:
            raise CLIError(f"--checkpoint: {name} is {weight.dtype} (FP8) but {scale_name} is missing, so it cannot "
                           f"be dequantized; a block-quantized FP8 checkpoint (DeepSeek-V3 style) stores it next to "
                           f"the weight")
        with safe_open(str(scale_shard), framework="pt", device="cpu") as handle:
            scale = handle.get_tensor(scale_name)
        block = (config.get("quantization_config") or {}).get("weight_block_size") or FP8_DEFAULT_BLOCK
        bo, bi = int(block[0]), int(block[1])
        rows, cols = weight.shape
        want = (-(-rows // bo), -(-cols // bi))
        if tuple(scale.shape) != want:
            raise CLIError(f"--checkpoint: {scale_name} has shape {list(scale.shape)}, expected {list(want)} for a "
                           f"[{rows}, {cols}] weight in {bo}x{bi} blocks")
        full = scale.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
        weight = weight.float() * full
        where += f", dequantized with {scale_name} ({bo}x{bi} blocks)"
    if dims is not None and tuple(weight.shape) != tuple(dims.kv_b_proj_shape):
        raise CLIError(f"--checkpoint: {name} has shape {list(weight.shape)}, but config.json's dims need "
                       f"{list(dims.kv_b_proj_shape)} ([heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank])")
    return weight, where


# --------------------------------------------------------------------------------------------------- prefill

@dataclass
class Workload:
    query_lens: list[int]
    context_lens: list[int]
    demo: bool


def _resolve_workload(args) -> Workload:
    explicit = args.prompt_lens is not None or args.batch is not None or args.prompt_len is not None
    if args.prompt_lens is not None:
        if args.batch is not None or args.prompt_len is not None:
            raise CLIError("--prompt-lens cannot be combined with --batch / --prompt-len (give one or the other)")
        query_lens = list(args.prompt_lens)
    else:
        batch = DEMO_BATCH if args.batch is None else args.batch
        query_lens = [DEMO_PROMPT_LEN if args.prompt_len is None else args.prompt_len] * batch
    if args.context_lens is None:
        context_lens = [0] * len(query_lens) if explicit else list(DEMO_CONTEXT_LENS)
    elif len(args.context_lens) == 1:
        context_lens = args.context_lens * len(query_lens)
    elif len(args.context_lens) == len(query_lens):
        context_lens = list(args.context_lens)
    else:
        raise CLIError(f"--context-lens has {len(args.context_lens)} values but the batch has {len(query_lens)} "
                       f"requests (give one value per request, or one for all)")
    if sum(query_lens) == 0:
        raise CLIError("--prompt-lens / --prompt-len: every request has 0 new tokens, nothing to compute")
    return Workload(query_lens, context_lens, demo=not explicit)


@dataclass
class Timer:
    """Phase timer: CUDA events on a GPU (no sync between phases), time.perf_counter on the CPU."""

    device: Any
    spans: dict = field(default_factory=dict)

    def start(self):
        import torch

        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, name: str, start) -> None:
        import torch

        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.spans.setdefault(name, []).append((start, ev))
        else:
            self.spans.setdefault(name, []).append(time.perf_counter() - start)

    def totals_ms(self) -> dict:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {k: sum(a.elapsed_time(b) for a, b in v) for k, v in self.spans.items()}
        return {k: 1e3 * sum(v) for k, v in self.spans.items()}

    def each_ms(self, name: str) -> list:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) for a, b in self.spans.get(name, [])]
        return [1e3 * x for x in self.spans.get(name, [])]


def _resolve_device_dtype(args):
    import torch

    if args.device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError) as err:
            raise CLIError(f"--device {args.device!r} is not a device ({err})") from None
        if device.type not in ("cpu", "cuda"):
            raise CLIError(f"--device {args.device!r}: only cpu and cuda are supported")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CLIError(f"--device {args.device!r}: CUDA is not available here (torch {torch.__version__})")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {args.device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, name), name


def _make_inputs(dims, workload: Workload, block_size: int, dtype, device, seed: int, weight=None):
    """Random q / kv_c / k_pe / kv_b_proj weight at the model's dims, and a shuffled paged latent cache.

    Scales keep attention away from degenerate (one-hot or uniform) softmax: q, kv_c, k_pe ~ N(0, 1) (kv_c is
    RMS-normalised in the model), weight ~ N(0, 1/kv_lora_rank) so k_nope and v have unit variance too.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    t = sum(workload.query_lens)
    h, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

    q = randn(t, h, dims.head_dim_qk)
    kv_c = randn(t, r)
    k_pe = randn(t, rope)
    if weight is None:
        weight = randn(*dims.kv_b_proj_shape, std=r ** -0.5)
    else:
        weight = weight.to(device=device, dtype=dtype)
    blocks_per_req = [-(-c // block_size) for c in workload.context_lens]
    num_blocks = sum(blocks_per_req) + 1  # one spare block that no request uses
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(workload.query_lens), max(1, max(blocks_per_req)), dtype=torch.int32)
    # Every slot that holds no context is NaN: reading one would show up in the check.
    cache = torch.full((num_blocks, block_size, dims.latent_dim), float("nan"))
    nxt = 0
    for req, (c, nb) in enumerate(zip(workload.context_lens, blocks_per_req)):
        ids = perm[nxt:nxt + nb]
        nxt += nb
        block_table[req, :nb] = ids.to(torch.int32)
        for j, b in enumerate(ids.tolist()):
            n = min(block_size, c - j * block_size)
            cache[b, :n] = torch.randn(n, dims.latent_dim, generator=g)
    return q, kv_c, k_pe, weight, cache.to(device=device, dtype=dtype), block_table.to(device)


def _instrumented_layer(plan, q, kv_c, k_pe, weight, cache, block_table, timer: Timer):
    """One layer of mla_prefill with each phase timed through its ``phase_hook`` (the same code path, so the phases
    add up to a real layer). Gather and up-projection are reported together, as are the context chunks."""
    from ..prefill import mla_prefill

    label = {"gather": "gather + up-projection", "up-projection": "gather + up-projection",
             "context chunk": "context chunks"}
    current: list = []

    def hook(name: str) -> None:
        if current:
            timer.stop(*current.pop())
        if name != "end":
            current.append((label.get(name, name), timer.start()))

    return mla_prefill(q, kv_c, k_pe, weight, cache, block_table, plan, return_lse=True, phase_hook=hook)


def _flops(dims, workload: Workload) -> tuple[int, int]:
    """(attention FLOPs, up-projection FLOPs) of one layer.

    Attention: 2 x (q.k pairs) x heads x (head_dim_qk + head_dim_vo), pairs counted exactly per request:
    ``q_len * context_len + q_len * (q_len + 1) / 2``. Up-projection: ``2 * N * kv_lora_rank * H * (nope + v)``
    for the N = context + new tokens that are up-projected.
    """
    pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(workload.query_lens, workload.context_lens))
    attn = 2 * pairs * dims.num_heads * (dims.head_dim_qk + dims.head_dim_vo)
    n = sum(workload.query_lens) + sum(workload.context_lens)
    up = 2 * n * dims.kv_lora_rank * dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    return attn, up


def _sample_requests(query_lens: Sequence[int], k: int) -> list[int]:
    """Up to k request ids spread evenly over those with new tokens (first and last included)."""
    ids = [i for i, q in enumerate(query_lens) if q > 0]
    if k <= 0 or not ids:
        return []
    if k >= len(ids):
        return ids
    if k == 1:
        return [ids[-1]]
    picks = sorted({ids[round(j * (len(ids) - 1) / (k - 1))] for j in range(k)})
    return picks


def _lens_text(lens: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(x) for x in lens[:limit])
    return shown + (f", ... ({len(lens)} requests)" if len(lens) > limit else "")


def _row(table, key: str, value) -> None:
    """A table row; plain strings are shown literally (no rich markup: values hold brackets such as [flashinfer])."""
    from rich.text import Text

    table.add_row(Text(key), value if isinstance(value, Text) else Text(str(value)))


def _tol_text(tol: tuple[float, float]) -> str:
    atol, rtol = tol
    return f"{atol:g}" if rtol == 0 else f"{atol:g} + {rtol:.2g} x |ref|"


def _ms(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    return f"{x / 1e3:.3f} s" if x >= 10_000 else f"{x:.3f} ms"


def cmd_prefill(args, console) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from rich.text import Text

    from .. import MLADims, PrefillPlan, Workspace, mla_prefill
    from ..dims import PRESETS
    from ..reference import max_abs_error, max_excess_error, reference_request
    from ..workspace import DEFAULT_CHUNK_TOKENS

    # ---- arguments -> dims, weight, workload
    if args.layer is not None and args.checkpoint is None:
        raise CLIError("--layer needs --checkpoint DIR (it picks which layer's kv_b_proj.weight to load)")
    if args.checkpoint is not None and args.model is not None:
        raise CLIError("--model and --checkpoint are exclusive: the checkpoint's config.json gives the dims")
    if args.checkpoint is not None and args.layer is None:
        raise CLIError("--checkpoint needs --layer N (which layer's kv_b_proj.weight to load)")
    workload = _resolve_workload(args)
    device, dtype, dtype_name = _resolve_device_dtype(args)
    loaded_weight, weight_text = None, None
    if args.checkpoint is not None:
        cfg_path = Path(args.checkpoint) / "config.json"
        if not cfg_path.is_file():
            raise CLIError(f"--checkpoint: {cfg_path} not found (the dims come from it)")
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
            dims = MLADims.from_hf_config(config)
        except ValueError as err:
            raise CLIError(f"--checkpoint: {cfg_path}: {err}") from None
        loaded_weight, weight_text = load_kv_b_proj_weight(args.checkpoint, args.layer, dims, config)
        model_name = f"{args.checkpoint} (config.json)"
    else:
        model_name = args.model or PRESETS[0]
        dims = MLADims.preset(model_name)
    chunk_tokens = args.chunk_tokens or DEFAULT_CHUNK_TOKENS

    q, kv_c, k_pe, weight, cache, block_table = _make_inputs(dims, workload, args.block_size, dtype, device,
                                                             args.seed, loaded_weight)
    if weight_text is None:
        weight_text = f"random N(0, 1/{dims.kv_lora_rank}), seed {args.seed}"

    # ---- plan once
    try:
        workspace = Workspace(device, chunk_tokens=chunk_tokens)
        build = lambda: PrefillPlan.build(  # noqa: E731
            workload.query_lens, workload.context_lens, dims=dims, workspace=workspace, block_size=args.block_size,
            device=device, dtype=dtype, backend=args.backend, fuse_context=not args.no_fuse)
        t0 = time.perf_counter()
        plan = build()
        plan_ms = 1e3 * (time.perf_counter() - t0)  # the first build also loads FlashInfer's kernels
        t0 = time.perf_counter()
        build()  # what planning costs once everything is loaded (dropped at once: its wrapper goes back to the pool)
        plan_again_ms = 1e3 * (time.perf_counter() - t0)
    except (ValueError, TypeError) as err:
        if args.backend:
            raise CLIError(f"--backend {args.backend}: {err}") from None
        raise CLIError(str(err)) from None
    backend = plan.backend
    if plan.fused:
        schedule = "fused: context + new tokens in one causal pass"
    elif plan.chunks:
        schedule = f"chunked: main pass + {len(plan.chunks)} context chunk(s) of <= {chunk_tokens} tokens, merged by LSE"
    else:
        schedule = "main pass only (no cached context)"

    sample = _sample_requests(workload.query_lens, args.check_requests)
    attn_flops, up_flops = _flops(dims, workload)
    # One untimed warm-up layer (lazy CUDA / FlashInfer / allocator set-up) on a GPU always, and on the CPU while a
    # layer is cheap (below CPU_WARMUP_FLOPS), so that the seed workload is not run twice on a CPU for it.
    warmup = device.type == "cuda" or attn_flops + up_flops < CPU_WARMUP_FLOPS
    steps = args.layers + int(warmup) + (0 if args.no_breakdown else 1) + len(sample)
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    timer = Timer(device)
    peak_extra = None
    with progress:
        task = progress.add_task("prefill", total=steps)
        inputs = (q, kv_c, k_pe, weight, cache, block_table)
        if warmup:
            progress.update(task, description="warm-up layer")
            mla_prefill(*inputs, plan, return_lse=True)
            progress.advance(task)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        result = None
        for layer in range(args.layers):
            progress.update(task, description=f"layer {layer + 1}/{args.layers}")
            result = None  # let the previous layer's output go before the next one allocates
            s = timer.start()
            result = mla_prefill(*inputs, plan, return_lse=True)
            timer.stop("layer", s)
            if device.type == "cpu":
                progress.advance(task)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak_extra = torch.cuda.max_memory_allocated(device) - base
            progress.advance(task, args.layers)
        out, lse = result
        layer_ms = timer.each_ms("layer")

        phases, breakdown_diff = None, None
        if not args.no_breakdown:
            progress.update(task, description="instrumented layer (phase times)")
            phase_timer = Timer(device)
            out_i, lse_i = _instrumented_layer(plan, *inputs, phase_timer)
            phases = phase_timer.totals_ms()
            breakdown_diff = max(max_abs_error(out_i, out.float()), max_abs_error(lse_i, lse))
            progress.advance(task)

        checked = []
        tol_out, tol_lse = TOLERANCE[dtype_name]
        qo = plan.qo_indptr.tolist()
        for r in sample:
            progress.update(task, description=f"float64 check, request {r}")
            a, b = qo[r], qo[r + 1]
            ref_out, ref_lse = reference_request(q[a:b], kv_c[a:b], k_pe[a:b], weight, cache, block_table[r],
                                                 workload.context_lens[r], dims)
            checked.append({"request": r, "new_tokens": b - a, "context_tokens": workload.context_lens[r],
                            "max_abs_err_out": max_abs_error(out[a:b], ref_out),
                            "max_abs_err_lse": max_abs_error(lse[a:b], ref_lse),
                            "max_abs_ref_out": float(ref_out.abs().max()),
                            "max_excess_out": max_excess_error(out[a:b], ref_out, tol_out[1]),
                            "max_excess_lse": max_excess_error(lse[a:b], ref_lse, tol_lse[1])})
            progress.advance(task)

    # ---- numbers
    mean_ms = sum(layer_ms) / len(layer_ms)
    tflops = (attn_flops + up_flops) / (mean_ms * 1e-3) / 1e12 if mean_ms > 0 else None
    err_out = max((c["max_abs_err_out"] for c in checked), default=None)
    err_lse = max((c["max_abs_err_lse"] for c in checked), default=None)
    passed = None
    if checked:
        passed = all(math.isfinite(c["max_abs_err_out"]) and math.isfinite(c["max_abs_err_lse"])
                     and c["max_excess_out"] <= tol_out[0] and c["max_excess_lse"] <= tol_lse[0] for c in checked)
    if device.type == "cuda":
        device_text = f"{device} {torch.cuda.get_device_name(device)} (SM {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
    else:
        device_text = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    # ---- table
    table = Table(title=f"mla-bridge prefill: {model_name}", show_header=False,
                  title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("")
    _row(table, "model dims", f"{dims.num_heads} heads, kv_lora_rank {dims.kv_lora_rank}, q/k {dims.qk_nope_head_dim}"
                  f"+{dims.qk_rope_head_dim}, v {dims.v_head_dim}, softmax_scale {dims.softmax_scale:.6f}")
    _row(table, "kv_b_proj weight", weight_text)
    _row(table, "device", device_text)
    _row(table, "dtype", dtype_name)
    _row(table, "backend", Text.assemble((backend.name, "green"), f": {backend.reason}"))
    for name, why in backend.passed_over:
        _row(table, "  passed over", f"{name}: {why}")
    table.add_section()
    _row(table, "requests", str(len(workload.query_lens)))
    _row(table, "new tokens", f"{sum(workload.query_lens)} ({_lens_text(workload.query_lens)})")
    _row(table, "context tokens", f"{sum(workload.context_lens)} ({_lens_text(workload.context_lens)})")
    _row(table, "paged cache", f"{cache.shape[0]} blocks x {args.block_size} tokens x {dims.latent_dim}, "
                  f"shuffled block_table")
    _row(table, "schedule", schedule)
    loads = ", loads FlashInfer's kernels" if backend.is_flashinfer else ""
    _row(table, "plan", f"{plan.num_plans} ragged plan(s), built once, {args.layers} layer(s) reuse it; host time "
         f"{_ms(plan_ms)} (first build{loads}), {_ms(plan_again_ms)} (built again)")
    table.add_section()
    timing = "CUDA events" if device.type == "cuda" else "time.perf_counter"
    timing += ", after 1 untimed warm-up layer" if warmup else ", no warm-up layer"
    if len(layer_ms) > 1:
        _row(table, "time per layer", f"{_ms(mean_ms)} mean, {_ms(min(layer_ms))} min, {_ms(max(layer_ms))} max "
                      f"over {len(layer_ms)} layers ({timing})")
    else:
        _row(table, "time per layer", f"{_ms(mean_ms)} ({timing})")
    if phases is not None:
        for name in ("gather + up-projection", "main pass", "context chunks", "merge"):
            if name in phases:
                count = len(phase_timer.spans[name])
                extra = f" ({count} passes)" if name in ("context chunks", "merge") else ""
                _row(table, f"  {name}", f"{_ms(phases[name])}{extra}")
        _row(table, "  sum of phases", f"{_ms(sum(phases.values()))} (one extra instrumented layer; output "
                      f"{'identical' if breakdown_diff == 0 else f'within {breakdown_diff:.1e}'} to mla_prefill's)")
    _row(table, "total", f"{_ms(sum(layer_ms))} for {len(layer_ms)} layer(s)")
    _row(table, "FLOPs per layer", f"{(attn_flops + up_flops) / 1e9:.2f} GFLOP (attention {attn_flops / 1e9:.2f}, "
                  f"up-projection {up_flops / 1e9:.2f})")
    _row(table, "throughput", "n/a" if tflops is None else f"{tflops:.3f} TFLOP/s")
    _row(table, "peak extra memory", "n/a on CPU" if peak_extra is None
                  else f"{peak_extra / 2**20:.1f} MiB (torch.cuda.max_memory_allocated over the inputs)")
    table.add_section()
    if checked:
        verdict = ("PASS", "green") if passed else ("FAIL", "bold red")
        _row(table, "check", f"requests {[c['request'] for c in checked]} against unchunked float64 attention "
                      f"from the paged cache (mla_bridge.reference)")
        _row(table, "  max abs error out", f"{err_out:.3e} (tolerance {_tol_text(tol_out)})")
        _row(table, "  max abs error lse", Text.assemble(f"{err_lse:.3e} (tolerance {_tol_text(tol_lse)}) ", verdict))
    else:
        _row(table, "check", "skipped (--check-requests 0)")
    console.print(table)

    results = {
        "model": model_name,
        "dims": {"num_heads": dims.num_heads, "kv_lora_rank": dims.kv_lora_rank,
                 "qk_nope_head_dim": dims.qk_nope_head_dim, "qk_rope_head_dim": dims.qk_rope_head_dim,
                 "v_head_dim": dims.v_head_dim, "softmax_scale": dims.softmax_scale},
        "weight": weight_text,
        "device": str(device),
        "device_name": device_text,
        "dtype": dtype_name,
        "backend": backend.name,
        "backend_reason": backend.reason,
        "passed_over": [list(p) for p in backend.passed_over],
        "query_lens": workload.query_lens,
        "context_lens": workload.context_lens,
        "block_size": args.block_size,
        "chunk_tokens": chunk_tokens,
        "schedule": "fused" if plan.fused else ("chunked" if plan.chunks else "main-only"),
        "num_chunks": len(plan.chunks),
        "num_plans": plan.num_plans,
        "layers": args.layers,
        "timing_method": timing,
        "timings_ms": {"plan": plan_ms, "plan_again": plan_again_ms, "per_layer": layer_ms, "layer_mean": mean_ms, "total": sum(layer_ms),
                       "phases": phases},
        "flops": {"attention": attn_flops, "up_projection": up_flops, "total": attn_flops + up_flops},
        "tflops": tflops,
        "peak_extra_memory_bytes": peak_extra,
        "check": {"reference": "mla_bridge.reference: unchunked float64 from the paged cache",
                  "requests": checked, "max_abs_err_out": err_out, "max_abs_err_lse": err_lse,
                  "tolerance_out": {"atol": tol_out[0], "rtol": tol_out[1]},
                  "tolerance_lse": {"atol": tol_lse[0], "rtol": tol_lse[1]}, "passed": passed},
        "seed": args.seed,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        console.print(f"results written to {args.json}")
    if passed is False:
        print(f"mla-bridge prefill: check FAILED: max abs error out {err_out:.3e} (tolerance {_tol_text(tol_out)}), "
              f"lse {err_lse:.3e} (tolerance {_tol_text(tol_lse)})", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------------- info

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
    console.print(table)
    if getattr(args, "json", None) is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return 0

