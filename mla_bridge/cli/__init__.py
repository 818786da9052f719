"""The ``mla-bridge`` command: ``prefill`` (the main job), ``info`` and ``bench``.

``mla-bridge prefill`` builds one MLA prefill batch at a model's dims (random weights, or the real
``kv_b_proj.weight`` of one layer of a local safetensors checkpoint), fills a paged latent cache, plans it once
(:class:`mla_bridge.PrefillPlan`), runs :func:`mla_bridge.mla_prefill` for ``--layers`` layers on the backend the
dispatch table picks (with ``--index-topk K``: the sparse pass over each token's K picks), and checks a sample of
requests against an independent float64 computation (:mod:`mla_bridge.reference`). ``mla-bridge info`` says what this machine has and which backend it gets.
``mla-bridge bench`` is :mod:`mla_bridge.bench` (imported only when asked for).

Exit codes (:data:`EXIT_CODES`, printed by ``--help``): 0 success; 1 the check against the float64 reference failed
its tolerance (``bench --strict``: a target that applies was missed); 2 bad arguments or a request the library refuses
(the message names the flag or the reason), including a run whose memory estimate exceeds what is available; 3 an
unexpected error (a bug or a failure of the environment: one line on stderr, ``mla-bridge COMMAND: unexpected error:
TYPE: MESSAGE``; the traceback too with ``--debug`` or ``MLA_BRIDGE_DEBUG=1``); 130 interrupted (Ctrl-C).

This module holds the argument parser, :func:`main` and the dispatch to the commands. The rest: ``prefill``
(the prefill command: plan, run, check, table, JSON), ``batch`` (workload, device/dtype, random inputs, FLOPs),
``timing`` (phase timer, instrumented layer), ``memory`` (the run's memory estimate against what is free),
``indices`` (``--index-topk``: the sparse pass's picks, its FLOPs and memory), ``checkpoint`` (safetensors
``kv_b_proj.weight``, FP8 dequantization), ``info`` (the info command), ``table``
(table rows and cell text), ``errors`` (:class:`CLIError`), ``extras`` (what the command needs from the ``cli``
extra: rich, matplotlib, safetensors; a missing one exits 2 naming the extra).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

# DEMO_CONTEXT_LENS and resolve_workload are imported from here by the tests.
from .. import switches
from .batch import DEMO_BATCH, DEMO_CONTEXT_LENS, DEMO_PROMPT_LEN, resolve_workload  # noqa: F401
from .checkpoint import load_kv_b_proj_weight
from ..argtypes import int_list, nonnegative_int, output_file, positive_int
from ..argtypes import seed as seed_type
from .errors import CLIError
from .indices import INDICES_CHOICES
from .info import cmd_info
from .prefill import cmd_prefill

__all__ = ["main", "build_parser", "load_kv_b_proj_weight", "CLIError", "EXIT_CODES", "DEBUG_ENV"]

DEFAULT_CHECK_REQUESTS = 2

#: Exit status of every command (the help's "exit codes" paragraph is made from it).
EXIT_CODES = {
    0: "success",
    1: "the float64 check failed its tolerance (bench --strict: a target that applies was missed)",
    2: "bad arguments or a request the library refuses (the message names the flag or the reason; a run whose memory "
    "estimate exceeds what is available included)",
    3: "an unexpected error (a bug or a failure of the environment: one line; the traceback with --debug or "
    "MLA_BRIDGE_DEBUG=1)",
    130: "interrupted (Ctrl-C)",
}
#: The environment variable that, set to anything but "" or "0", prints an unexpected error's traceback (as --debug).
DEBUG_ENV = switches.DEBUG
EXIT_UNEXPECTED = 3


def _exit_codes_text() -> str:
    import textwrap

    text = "exit codes: " + "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items()) + "."
    return "\n".join(textwrap.wrap(text, 100, subsequent_indent="  "))


# --------------------------------------------------------------------------------------------------- arguments

_int_list, _positive_int, _nonnegative_int = int_list, positive_int, nonnegative_int


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
gather/up-projection, main pass, context chunks and merge comes from one extra layer timed at
mla_prefill's phase boundaries (its phase_hook; --no-breakdown skips it).

check: --check-requests requests (spread over the batch) are recomputed by mla_bridge.reference: float64,
unchunked, straight from the paged cache; cache slots that hold no context are NaN, so reading one shows.
Exit code 1 when an error exceeds atol + rtol x |ref| (float32: 1e-4; bf16: out 2e-2 + 2**-7 x |ref|,
lse 1e-2 + 1e-3 x |ref|; fp16: out 1e-2 + 2**-10 x |ref|, lse as bf16).

sparse attention: --index-topk K (e.g. mla-bridge prefill --model deepseek-v3.2 --context-lens 8000
--prompt-len 2000 --index-topk 2048) plans with index_topk=K and passes each new token's K picks to
mla_prefill as topk_indices, from the reference indexer or (--indices random) random causal positions;
the check is a float64 sparse attention over the same picks (mla_bridge.reference, MHA form), the
FLOPs 2 x selected pairs x heads x (2 x kv_lora_rank + qk_rope_head_dim). --no-fuse, --chunk-tokens
and --backend set the dense passes, which a sparse plan does not run: they are refused with it.

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
        description="MLA (DeepSeek-V2/V3) ragged prefill: FlashInfer on NVIDIA GPUs, a torch reference on the CPU.",
        epilog=_exit_codes_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mla-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "prefill",
        help="run MLA prefill on a batch at a model's dims and check it against float64",
        description="Plan one MLA prefill batch once, run it per layer with mla_prefill, time it, and check a sample "
        "of requests against an independent float64 reference.",
        epilog=PREFILL_EPILOG + "\n" + _exit_codes_text() + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        choices=PRESETS,
        default=None,
        help="dims preset: the attention dims of a published model's config.json (default deepseek-v2-lite: "
        "DeepSeek-Coder-V2-Lite-Instruct, 16 heads; `mla-bridge info` lists each with its dims)",
    )
    g.add_argument(
        "--checkpoint",
        metavar="DIR",
        type=Path,
        help="local safetensors checkpoint: dims from DIR/config.json, kv_b_proj weight of --layer",
    )
    g.add_argument(
        "--layer", type=_nonnegative_int, metavar="N", help="which layer's kv_b_proj.weight to load from --checkpoint"
    )
    g = p.add_argument_group("batch")
    g.add_argument("--prompt-lens", type=_int_list, metavar="L1,L2,...", help="new tokens per request")
    g.add_argument("--batch", type=_positive_int, metavar="N", help=f"requests (default {DEMO_BATCH})")
    g.add_argument(
        "--prompt-len",
        type=_nonnegative_int,
        metavar="L",
        help=f"new tokens of every request (default {DEMO_PROMPT_LEN})",
    )
    g.add_argument(
        "--context-lens",
        type=_int_list,
        metavar="C1,C2,...",
        help="cached context tokens per request, or one value for all (default: see below)",
    )
    g.add_argument(
        "--block-size",
        type=_positive_int,
        default=64,
        metavar="B",
        help="tokens per block of the paged latent cache (default 64)",
    )
    g.add_argument(
        "--chunk-tokens",
        type=_positive_int,
        metavar="N",
        help="Workspace chunk budget: context tokens gathered per chunk (default 65536)",
    )
    g.add_argument(
        "--no-fuse",
        action="store_true",
        help="never fuse context into the main pass (always a main pass + context chunks + merge)",
    )
    g = p.add_argument_group("sparse attention (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5)")
    g.add_argument(
        "--index-topk",
        type=_positive_int,
        metavar="K",
        help="plan with index_topk=K and run mla_prefill(..., topk_indices=): each new token attends only its K "
        "picked keys (default: dense prefill)",
    )
    g.add_argument(
        "--indices",
        choices=INDICES_CHOICES,
        default=None,
        help="where the picks come from (with --index-topk): indexer = the reference lightning indexer "
        "(mla_bridge.indexer, DeepSeek-V3.2's shape, random weights from --seed; the default); random = random "
        "valid causal positions, -1 where fewer than K exist",
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="q / cache / weight dtype (default auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="paged latent cache dtype: auto = --dtype; fp8 = float8_e4m3fn with one per-tensor scale "
        "(amax/448, vLLM's kv_cache_dtype='fp8'), dequantized in the gather",
    )
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default cuda when available, else cpu)")
    g.add_argument(
        "--backend",
        choices=BACKEND_NAMES + ("auto",),
        default=None,
        help="force a backend (default: the dispatch table, or $MLA_BRIDGE_BACKEND)",
    )
    g.add_argument(
        "--layers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="run the one plan N times, as a model does per layer (default 1)",
    )
    g.add_argument("--seed", type=seed_type, default=0, help="random seed for inputs and block table (default 0)")
    g.add_argument(
        "--check-requests",
        type=_nonnegative_int,
        default=DEFAULT_CHECK_REQUESTS,
        metavar="K",
        help=f"requests with new tokens checked against the float64 reference, spread over the batch; 0 for none "
        f"(default {DEFAULT_CHECK_REQUESTS})",
    )
    g.add_argument("--no-breakdown", action="store_true", help="skip the extra layer that times each pass")
    g.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run even when the memory estimate (inputs, cache, plan, prefill peak, float64 check) "
        "exceeds what is available (default: refuse with exit 2)",
    )
    g.add_argument("--json", type=output_file, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=cmd_prefill)
    _add_debug(p)

    p = sub.add_parser(
        "info",
        help="torch, CUDA, device, FlashInfer, JAX, and the backend this machine gets",
        description="What this machine has, and which backend select_backend picks for DeepSeek MLA "
        "prefill (bf16, head dims 192/128, causal).",
    )
    p.add_argument("--json", type=output_file, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=cmd_info)
    _add_debug(p)

    p = sub.add_parser("bench", help="benchmarks (mla_bridge.bench)", description="Benchmarks, from mla_bridge.bench.")
    if bench_module is not None:
        bench_module.add_arguments(p)
    p.set_defaults(func=lambda args, console: _run_bench(bench_module, args))
    _add_debug(p)
    return parser


def _add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--debug",
        action="store_true",
        help=f"on an unexpected error (exit {EXIT_UNEXPECTED}), print its traceback too (or set {DEBUG_ENV}=1)",
    )


# --------------------------------------------------------------------------------------------------- main


def _console(file=None):
    from rich.console import Console

    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, highlight=False, width=max(console.width, 120))
    return console


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``mla-bridge`` console script; returns the exit code (see the module docstring).

    Ctrl-C (KeyboardInterrupt) anywhere prints one line, ``mla-bridge COMMAND: interrupted``, and returns 130 (the
    shell's 128 + SIGINT); output files are only written whole at the end, so none is left half-written. Any other
    exception that is not a refusal (:class:`CLIError`, exit 2) prints one line, ``mla-bridge COMMAND: unexpected
    error: TYPE: first line of its message``, with the traceback before it under ``--debug`` or
    ``MLA_BRIDGE_DEBUG=1`` (:data:`DEBUG_ENV`), and returns 3.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"mla-bridge{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - outside a command's run (the parser, the console): still one line
        return _unexpected(command, err, "--debug" in argv)


def _unexpected(command: Optional[str], err: Exception, debug: bool) -> int:
    """Report an unexpected error on stderr (one line; the traceback first when ``debug`` or :data:`DEBUG_ENV` is
    set) and return its exit code, 3."""
    debug = debug or switches.debug()
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    lines = str(err).strip().splitlines()
    message = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    hint = "" if debug else f" (run again with --debug, or {DEBUG_ENV}=1, for the traceback)"
    print(f"mla-bridge{' ' + command if command else ''}: unexpected error: {message}{hint}", file=sys.stderr)
    return EXIT_UNEXPECTED


def _main(argv: list) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)
    if not {"-h", "--help", "--version"} & set(argv):
        from .extras import CLI_EXTRA, missing, needed_for

        absent = missing(needed_for(argv))
        if absent:
            print(
                f"mla-bridge{' ' + command if command else ''}: needs {', '.join(absent)}, which the "
                f"'cli' extra brings: pip install '{CLI_EXTRA}'",
                file=sys.stderr,
            )
            return 2
    bench_module = None
    if command == "bench":
        try:
            import importlib

            bench_module = importlib.import_module("mla_bridge.bench")
        except Exception as err:  # ImportError, or an error inside it
            print(
                f"mla-bridge bench: the benchmark module mla_bridge.bench is not available "
                f"({type(err).__name__}: {err})",
                file=sys.stderr,
            )
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
    except Exception as err:  # noqa: BLE001 - a bug or a failure of the environment: its own exit code
        return _unexpected(args.command, err, args.debug)


def _run_bench(bench_module: Any, args: argparse.Namespace) -> int:
    return int(bench_module.run(args) or 0)
