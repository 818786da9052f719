"""``mla-bridge bench``: mla_bridge side by side with the kernels and peers a user would pick.

Sections (``--sections``, default all):
  1 ``main``    causal main pass: ``RaggedPlan.run`` vs the raw FlashInfer wrapper vs torch SDPA vs flex_attention
                vs the torch backend; 16 heads 1/4/16 x 10000 tokens, 128 heads 1/4 x 10000, 24 mixed requests;
                GLM-5's dims (64 heads, 256/256) at 1/4 x 10000.
  2 ``context`` full ``mla_prefill`` with prefix-cached context, split into gather / up-projection / attention /
                merge, beside the hand-written pipeline; ratio to (attention + GEMM alone); the first long case
                also at GLM-5's dims. Then DeepSeek Sparse
                Attention beside dense ``mla_prefill`` on the same batch (context longer than ``index_topk``;
                :mod:`mla_bridge.bench.sparse_rows`), checked against a float64 sparse attention.
  3 ``merge``   ``merge_attn_states`` GB/s at 16 and 128 heads.
  4 ``plan``    host time of ``PrefillPlan.build`` at batch 1/16/128; FlashInfer plans in a 61-layer loop.
  5 ``memory``  peak extra device memory of ``mla_prefill`` against the workspace budget plus the output.
  6 ``jax``     the JAX adapter against the torch core (:mod:`mla_bridge.bench.jax_rows`), when JAX and
                ``mla_bridge_jax`` import.
  7 ``ttft``    time to first token of a small DeepSeek-V2 model (V2-Lite attention dims, 4 dense layers):
                transformers sdpa vs mla_bridge, the JAX model's cuDNN / XLA attention vs mla_bridge_jax, each with
                attention's share of the forward (:mod:`mla_bridge.bench.ttft`). Not in the default set: asked for
                with ``--sections ttft`` (or ``all``).

Each row: ms (median over ``--repeats`` after ``--warmup``; on a GPU each sample the larger of a call's CUDA-event
time and its host time, :mod:`mla_bridge.bench.common`), TFLOP/s or GB/s, and the
fraction of the bf16 matmul peak or copy bandwidth measured in the same run. FLOPs: 2 x q·k pairs x heads x
(head_dim_qk + head_dim_vo: 192 + 128 for DeepSeek, 256 + 256 for GLM-5), causal pairs counted exactly per request,
plus the up-projection GEMM where it runs.

Without CUDA (or with ``--quick``) it runs tiny shapes in a few seconds (the torch backend on the CPU), so the
command itself is tested in CI; rows of paths the machine cannot run and targets that do not apply there (they are
goals for a GPU in full mode) are kept in the JSON but not printed. Exit code 0, or 1 with ``--strict`` when a target
that applies was missed (2 for a refused argument; through ``mla-bridge bench``, 3 for an unexpected error:
:data:`mla_bridge.cli.EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Optional, Sequence

__all__ = ["add_arguments", "run", "main", "SECTIONS"]

from ..argtypes import nonnegative_float, nonnegative_int, output_file, positive_int  # noqa: E402
from ..argtypes import seed as seed_type  # noqa: E402
from .common import DEFAULT_SECTIONS, SECTIONS  # noqa: E402  (light: imports torch only)

_ALIASES = {str(i + 1): name for i, name in enumerate(SECTIONS)}
#: GPU full mode: optional rows stop here, so that the whole run (FlashInfer's JIT compile included) ends within
#: about 8 minutes on an H200; every other job stops HARD_MARGIN_S later.
DEFAULT_BUDGET_S = 360.0
HARD_MARGIN_S = 120.0
#: Added to the default budget when the ttft section runs: its forwards each follow a rest of the GPU
#: (:data:`.ttft.REST_S`), so its five cases take minutes (the results page gives a measured run's time).
TTFT_BUDGET_S = 600.0
SKIPPABLE = ("raw", "sdpa", "flex", "torch", "handwritten")


def default_budget_s(sections: Sequence[str], *, cuda: bool, quick: bool) -> Optional[float]:
    """The ``--budget-s`` a run takes when none is given, in seconds: :data:`DEFAULT_BUDGET_S` on a GPU in full mode,
    plus :data:`TTFT_BUDGET_S` when the ttft section runs (its rows are not optional: its last case's are skipped
    once the budget is spent); None (no budget) otherwise."""
    if not cuda or quick:
        return None
    return DEFAULT_BUDGET_S + (TTFT_BUDGET_S if "ttft" in sections else 0.0)


def _sections(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part == "all":
            return list(SECTIONS)
        name = _ALIASES.get(part, part)
        if name not in SECTIONS:
            raise argparse.ArgumentTypeError(
                f"unknown section {part!r}; choose from {', '.join(SECTIONS)} (or 1-{len(SECTIONS)}, or all)"
            )
        if name not in out:
            out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("--sections needs at least one section")
    return out


def _skip(text: str) -> set:
    names = {p.strip().lower() for p in text.split(",") if p.strip()}
    bad = names - set(SKIPPABLE)
    if bad:
        raise argparse.ArgumentTypeError(f"unknown path(s) {sorted(bad)}; choose from {', '.join(SKIPPABLE)}")
    return names


def plot_file(text: str):
    """``--plot``: a file path :func:`mla_bridge.argtypes.output_file` accepts, whose suffix (if any) names an image
    format matplotlib writes (none: PNG, matplotlib's default), checked when the flags are parsed, before any work.

    Raises:
        argparse.ArgumentTypeError: what ``output_file`` refuses; a suffix matplotlib cannot write (the message lists
            those it can).
    """
    path = output_file(text)
    suffix = path.suffix.lower().lstrip(".")
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise argparse.ArgumentTypeError(
                f"{text!r}: matplotlib cannot write '.{suffix}' images; use one of "
                f"{', '.join('.' + f for f in sorted(formats))} (no suffix: PNG)"
            )
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench's options to ``parser`` (the ``mla-bridge bench`` subcommand)."""
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(DEFAULT_SECTIONS),
        metavar="LIST",
        help=f"comma-separated sections to run: {','.join(SECTIONS)} (or 1-{len(SECTIONS)}, or all; "
        f"default all but ttft)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, a few seconds (automatic on a machine without CUDA)"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="where to run (default: cuda when available, else cpu in quick mode)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed calls per row, median reported (default 15 on a GPU, 3 in quick mode)",
    )
    parser.add_argument(
        "--warmup",
        type=nonnegative_int,
        default=None,
        help="untimed calls before timing (default 3 on a GPU, 1 in quick mode; on CUDA at least 1, "
        "which absorbs FlashInfer's JIT compile)",
    )
    parser.add_argument(
        "--json", type=output_file, metavar="PATH", default=None, help="write every figure and the environment here"
    )
    parser.add_argument(
        "--plot",
        type=plot_file,
        metavar="PATH",
        default=None,
        help="write an image (PNG; another format by the suffix, e.g. .svg or .pdf): one panel per "
        "section, bars by case (main pass TFLOP/s; mla_prefill / (attention + GEMM), eager "
        "and graphed; ms against the hand-written pipeline; JAX)",
    )
    from ..dispatch import BACKEND_NAMES

    parser.add_argument(
        "--backend",
        default=None,
        choices=BACKEND_NAMES + ("auto",),
        metavar="NAME",
        help=f"force mla_bridge's backend ({', '.join(BACKEND_NAMES)}; default and auto: the dispatch "
        "table, as for mla-bridge prefill); "
        "the raw FlashInfer rows follow it",
    )
    parser.add_argument(
        "--skip",
        type=_skip,
        default=set(),
        metavar="PATHS",
        help=f"comparison paths to leave out: {','.join(SKIPPABLE)}",
    )
    parser.add_argument(
        "--budget-s",
        type=nonnegative_float,
        default=None,
        metavar="S",
        help="seconds after which the slow optional rows (flex_attention, torch backend) are skipped; "
        f"any job still waiting {HARD_MARGIN_S:.0f} s later is skipped too (default "
        f"{DEFAULT_BUDGET_S:.0f} on a GPU in full mode, {TTFT_BUDGET_S:.0f} more with the ttft section, none "
        f"otherwise)",
    )
    parser.add_argument("--layers", type=positive_int, default=61, help="layers in the planning loop (default 61)")
    parser.add_argument("--seed", type=seed_type, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target that applies was missed")


def _jobs_for(ctx: Any, sections: Sequence[str]) -> list:
    from . import context, jax_rows, main_pass, sections as other, sparse_rows, ttft

    makers = {
        "main": main_pass.jobs,
        "context": lambda c: context.jobs(c) + sparse_rows.jobs(c),
        "merge": other.merge_jobs,
        "plan": other.plan_jobs,
        "memory": other.memory_jobs,
        "jax": jax_rows.jobs,
        "ttft": ttft.jobs,
    }
    jobs = []
    for name in SECTIONS:  # report order, whatever order they were asked in
        if name in sections:
            jobs.extend(makers[name](ctx))
    # Slow optional peers run last, so that a spent time budget only ever drops them.
    return [j for j in jobs if not j.optional] + [j for j in jobs if j.optional]


def _clean(x: Any) -> Any:
    """JSON-safe: NaN and infinities become None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _payload(env: dict, ctx: Any, sections: Sequence[str], rows: list, job_times: list, *, complete: bool) -> dict:
    """Everything the JSON holds (NaN and infinities as null)."""
    from .report import sort_rows

    config = {
        "sections": list(sections),
        "quick": ctx.quick,
        "device": str(ctx.device),
        "repeats": ctx.repeats,
        "warmup": ctx.warmup,
        "seed": ctx.seed,
        "backend": ctx.backend,
        "skip": sorted(ctx.skip),
        "budget_s": ctx.budget_s,
        "layers": ctx.layers,
        "timer": (
            "max(cuda events with the gpu spinning first, host time) per call" if ctx.cuda else "time.perf_counter"
        ),
        "statistic": "median",
        "interleaved": "rotating rounds",
        "l2_flush": False,
    }
    return _clean(
        {
            "complete": complete,
            "environment": env,
            "config": config,
            "peaks": ctx.peaks,
            "sections": list(sections),
            "elapsed_s": round(ctx.elapsed(), 3),
            "rows": [r.to_dict() for r in sort_rows(rows)],
            "checks": [c.to_dict() for c in ctx.checks],
            "jobs": list(job_times),
        }
    )


def run(args: argparse.Namespace, console: Optional[Any] = None) -> int:
    """Run the bench described by ``args`` (from a parser given :func:`add_arguments`). Returns the exit code."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .common import Ctx, Row, fmt_err
    from .report import environment, measure_peaks, render, sort_rows, write_json, write_plot

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or a pipe: wide enough that the tables stay readable
            console = Console(width=200)
    sections = list(getattr(args, "sections", None) or DEFAULT_SECTIONS)
    has_cuda = torch.cuda.is_available()
    device_arg = getattr(args, "device", "auto") or "auto"
    if device_arg == "cuda" and not has_cuda:
        console.print("[red]mla-bridge bench: --device cuda, but CUDA is not available[/]")
        return 2
    use_cuda = has_cuda and device_arg != "cpu"
    if getattr(args, "backend", None) == "auto":  # the dispatch table decides, as with no --backend
        args.backend = None
    from ..dispatch import select_backend

    try:  # refuse a --backend or MLA_BRIDGE_BACKEND (read when --backend is not given) this machine cannot run, before
        # any work (an env value was not checked: every mla_bridge row was skipped and the bench exited 0)
        select_backend(
            torch.device("cuda") if use_cuda else torch.device("cpu"),
            requested=getattr(args, "backend", None),
            dtype=torch.bfloat16 if use_cuda else torch.float32,
            head_dim_qk=192,
            head_dim_vo=128,
        )
    except ValueError as err:
        flag = f"--backend {args.backend}: " if getattr(args, "backend", None) else ""
        console.print(f"mla-bridge bench: {flag}{err}", style="red", markup=False)
        return 2
    from ..dims import MLADims
    from ..prefill import kernel_choices

    try:  # an MLA_BRIDGE_KV / _GATHER / _MERGE that cannot serve here: refused before any work, as --backend
        kernels = kernel_choices(
            torch.device("cuda") if use_cuda else torch.device("cpu"),
            torch.bfloat16 if use_cuda else torch.float32,
            MLADims.deepseek_v2_lite(),
        )
    except (ValueError, TypeError, RuntimeError) as err:
        console.print(f"mla-bridge bench: {err}", style="red", markup=False)
        return 2
    quick = bool(getattr(args, "quick", False)) or not use_cuda
    if not use_cuda and not getattr(args, "quick", False):
        console.print("No CUDA device: running the quick CPU version (torch backend, tiny shapes, CPU timers).")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    repeats = max(1, args.repeats) if getattr(args, "repeats", None) is not None else (3 if quick else 15)
    warmup = args.warmup if getattr(args, "warmup", None) is not None else (1 if quick else 3)
    budget = getattr(args, "budget_s", None)
    if budget is None:
        budget = default_budget_s(sections, cuda=use_cuda, quick=quick)
    ctx = Ctx(
        device=device,
        quick=quick,
        repeats=repeats,
        warmup=warmup,
        seed=getattr(args, "seed", 0),
        backend=getattr(args, "backend", None),
        skip=set(getattr(args, "skip", set()) or ()),
        budget_s=budget,
        console=console,
        layers=max(1, getattr(args, "layers", 61)),
    )
    env = environment(ctx)
    env["kernels"] = kernels  # what the rows without a named path ran (the environment switches included)
    rows: list[Row] = []
    job_times: list[dict] = []
    threads = torch.get_num_threads()
    if not use_cuda:
        # CPU quick mode checks the command, it does not measure the CPU: one thread is steady on shared CI cores
        # (OpenMP barriers on an oversubscribed machine cost 10x). Set back when done.
        torch.set_num_threads(1)
    try:
        jobs = _jobs_for(ctx, sections)
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        with progress:
            task = progress.add_task("machine peaks", total=len(jobs) + 1)
            rows.extend(measure_peaks(ctx))
            progress.advance(task)
            for job in jobs:
                progress.update(task, description=job.label)
                started, n_before = time.perf_counter(), len(rows)
                whole = dict(section=job.section, case=job.label, path="(whole job)", status="skipped", order=(9, 0, 0))
                try:
                    if budget is not None and ctx.elapsed() > budget + HARD_MARGIN_S:
                        rows.append(Row(**whole, note=f"time budget spent ({budget:.0f} + {HARD_MARGIN_S:.0f} s)"))  # type: ignore[arg-type]
                    else:
                        rows.extend(job.fn(ctx))
                except Exception as err:  # noqa: BLE001 - one broken job never ends the run
                    ctx.recover()
                    rows.append(Row(**whole, note="failed: " + fmt_err(err, 160), error=fmt_err(err)))  # type: ignore[arg-type]
                seconds = time.perf_counter() - started
                job_times.append({"section": job.section, "job": job.label, "seconds": round(seconds, 3)})
                done = rows[n_before:]
                n_ok = sum(r.status == "ok" for r in done)
                progress.console.print(
                    f"[dim]{job.label}: {n_ok} measured, {len(done) - n_ok} skipped, "
                    f"{seconds:.1f} s (total {ctx.elapsed():.0f} s)[/]",
                    highlight=False,
                )
                if getattr(args, "json", None):  # a run killed at a time limit still leaves every figure so far
                    write_json(args.json, _payload(env, ctx, sections, rows, job_times, complete=False))
                progress.advance(task)
    finally:
        ctx.close()
        torch.set_num_threads(threads)
    rows = sort_rows(rows)
    render(console, rows, ctx.checks, env, ctx.peaks)
    if getattr(args, "json", None):
        write_json(args.json, _payload(env, ctx, sections, rows, job_times, complete=True))
        console.print(f"JSON: {args.json}")
    if getattr(args, "plot", None):
        try:
            write_plot(args.plot, rows, ctx.peaks, env)
            console.print(f"plot: {args.plot}")
        except Exception as err:  # noqa: BLE001
            console.print(f"[red]plot failed[/]: {fmt_err(err)}")
            return 1
    console.print(f"bench finished in {ctx.elapsed():.1f} s")
    missed = [c for c in ctx.checks if c.applies and c.passed is False]
    return 1 if getattr(args, "strict", False) and missed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mla_bridge.bench [options]``."""
    parser = argparse.ArgumentParser(
        prog="mla-bridge bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
