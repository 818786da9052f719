"""``mla-bridge prefill``: plan one batch once, run it per layer, time it, check a sample against float64, and
report a table (and JSON). With ``--index-topk K`` the plan is a sparse one (``index_topk=K``), every layer passes
each new token's K picks as ``topk_indices`` (:mod:`mla_bridge.cli.indices`: the reference indexer or random causal
picks), and the check is a float64 sparse attention over the same picks
(:func:`mla_bridge.reference.reference_sparse_request`)."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .batch import batch_flops, make_inputs, resolve_device_dtype, resolve_workload, sample_requests
from .checkpoint import load_kv_b_proj_weight
from .args import write_output
from .indices import indexer_shape, make_topk_indices, sparse_flops
from .errors import CLIError
from .memory import check_fits, estimate_run_memory
from .table import lens_text, ms_text, add_row, tol_text
from .timing import Timer, phase_breakdown
from ..reference import TOLERANCE  # the allowed error against the float64 reference, per run dtype
from ..sparse import select_sparse, triton_kernel_for

CPU_WARMUP_FLOPS = 50e9  # below this many FLOPs per layer, the CPU also runs an untimed warm-up layer


def _unchecked_note(query_lens: Sequence[int], asked: int, checked: int) -> str:
    """Why fewer requests were checked than ``--check-requests`` asked, where that is so: requests without new tokens
    have no output to check."""
    empty = sum(1 for q in query_lens if q == 0)
    if checked >= asked or not empty:
        return ""
    return f" ({empty} request{'s' if empty != 1 else ''} without new tokens: nothing to check)"


@contextlib.contextmanager
def _gc_paused():
    """Python's garbage collector off for a timed block (on again after, as it was)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Log:
    """Where the run is, when stdout is not a terminal (a pipe, a log file), where rich's progress bar shows
    nothing: one plain line per phase, and per group of layers (at most about ten lines for them), with the
    seconds since the command started. On a terminal the progress bar says it and this prints nothing."""

    def __init__(self, console) -> None:
        self.console, self.plain, self.t0 = console, not console.is_terminal, time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.plain:
            self.console.print(
                f"mla-bridge prefill: {text} ({time.perf_counter() - self.t0:.1f} s)", markup=False, highlight=False
            )

    def layer(self, i: int, n: int) -> None:
        group = max(1, -(-n // 10))
        if i == 0 or i == n - 1 or (i + 1) % group == 0:
            self(f"layer {i + 1}/{n}")


def cmd_prefill(args, console) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from rich.text import Text

    from .. import MLADims, PrefillPlan, Workspace, mla_prefill, prepare_kv_b_proj
    from ..cache import cache_dtype_name, quantize_latent_cache
    from ..kv import auto_bounds
    from ..dims import PRESETS
    from ..dispatch import select_backend
    from ..prefill import kernel_choices
    from ..reference import max_abs_error, max_excess_error, reference_request, reference_sparse_request
    from ..workspace import DEFAULT_CHUNK_TOKENS

    # ---- arguments -> dims, weight, workload
    if args.layer is not None and args.checkpoint is None:
        raise CLIError("--layer needs --checkpoint DIR (it picks which layer's kv_b_proj.weight to load)")
    if args.checkpoint is not None and args.model is not None:
        raise CLIError("--model and --checkpoint are exclusive: the checkpoint's config.json gives the dims")
    if args.checkpoint is not None and args.layer is None:
        raise CLIError("--checkpoint needs --layer N (which layer's kv_b_proj.weight to load)")
    index_topk = args.index_topk
    if args.indices is not None and index_topk is None:
        raise CLIError("--indices needs --index-topk K (it says where the sparse pass's picks come from)")
    if index_topk is not None:  # options of the dense passes, which a sparse plan does not run
        dense_only = (
            ("--no-fuse", args.no_fuse),
            ("--chunk-tokens", args.chunk_tokens is not None),
            ("--backend", args.backend not in (None, "auto")),
        )
        for flag, given in dense_only:
            if given:
                raise CLIError(
                    f"{flag} sets the dense passes (their schedule or FlashInfer backend); with --index-topk every "
                    f"layer runs the sparse pass (mla_bridge.sparse), which has neither: drop {flag}"
                )
    indices_source = args.indices or "indexer"
    config = None
    workload = resolve_workload(args)
    device, dtype, dtype_name = resolve_device_dtype(args)
    loaded_weight, weight_text = None, None
    if args.checkpoint is not None:
        cfg_path = Path(args.checkpoint) / "config.json"
        if not cfg_path.is_file():
            raise CLIError(f"--checkpoint: {cfg_path} not found (the dims come from it)")
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
            dims = MLADims.from_hf_config(config, layer=args.layer)  # per-layer dims of a heterogeneous config
        except ValueError as err:  # a message about the layer names the flag that gave it
            msg = str(err)
            raise CLIError(f"--checkpoint: {cfg_path}: {'--' + msg if msg.startswith('layer') else msg}") from None
        loaded_weight, weight_text = load_kv_b_proj_weight(args.checkpoint, args.layer, dims, config)
        model_name = f"{args.checkpoint} (config.json)"
    else:
        model_name = args.model or PRESETS[0]
        dims = MLADims.preset(model_name)
    chunk_tokens = args.chunk_tokens or DEFAULT_CHUNK_TOKENS
    sample = sample_requests(workload.query_lens, args.check_requests)
    try:
        kernels = kernel_choices(device, dtype, dims)  # a bad MLA_BRIDGE_KV / _GATHER / _MERGE: exit 2, before work
        if args.index_topk is not None:  # likewise a bad or unusable MLA_BRIDGE_SPARSE
            select_sparse(dims, dtype, torch.device(device).type)
    except (ValueError, TypeError, RuntimeError) as err:
        raise CLIError(str(err)) from None
    try:  # a --backend or MLA_BRIDGE_BACKEND that cannot serve at all: exit 2 before planning (the plan asks again)
        select_backend(
            device,
            dtype=dtype,
            out_dtype=dtype,
            head_dim_qk=dims.head_dim_qk,
            head_dim_vo=dims.head_dim_vo,
            requested=args.backend,
        )
    except ValueError as err:
        raise CLIError(f"--backend {args.backend}: {err}" if args.backend else str(err)) from None

    shape = indexer_shape(config) if index_topk is not None and indices_source == "indexer" else None
    sparse_mem = None if index_topk is None else dict(index_topk=index_topk, source=indices_source, shape=shape)

    # ---- memory: refuse what cannot fit before the plan (whose index tensors are allocations) and the inputs
    def fits(plan=None):
        est = estimate_run_memory(
            dims,
            workload.query_lens,
            workload.context_lens,
            args.block_size,
            dtype,
            device,
            sample,
            plan=plan,
            sparse=sparse_mem,
        )
        check_fits(est, device, skip=args.no_memory_check)

    try:
        from ..checks import check_length_sums

        check_length_sums(workload.query_lens, workload.context_lens)
    except ValueError as err:
        raise CLIError(f"--prompt-len / --prompt-lens / --context-lens: {err}") from None
    fits()

    # ---- plan once
    log = _Log(console)
    log(
        f"planning {len(workload.query_lens)} request(s), {sum(workload.query_lens)} new + "
        f"{sum(workload.context_lens)} context tokens"
    )
    try:
        workspace = Workspace(device, chunk_tokens=chunk_tokens)
        build = lambda: PrefillPlan.build(  # noqa: E731
            workload.query_lens,
            workload.context_lens,
            dims=dims,
            workspace=workspace,
            block_size=args.block_size,
            device=device,
            dtype=dtype,
            backend=args.backend,
            fuse_context=not args.no_fuse,
            kv_cache_dtype=args.kv_cache_dtype,
            index_topk=index_topk,
        )
        gc.collect()  # a full collection (tens of ms) inside a timed build would be reported as planning time
        with _gc_paused():
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
    fits(plan)
    log("making the inputs and the paged cache")
    q, kv_c, k_pe, weight, cache, block_table = make_inputs(
        dims, workload, args.block_size, dtype, device, args.seed, loaded_weight
    )
    if weight_text is None:
        weight_text = f"random N(0, 1/{dims.kv_lora_rank}), seed {args.seed}"
    kv_scale = None
    unquantized_cache = None
    if args.kv_cache_dtype == "fp8":  # quantized as vLLM's cache write; the check reads the same bytes back
        unquantized_cache = cache
        cache, kv_scale = quantize_latent_cache(cache)
        kv_scale = float(kv_scale)
    cache_bytes = cache.numel() * cache.element_size()
    timer = Timer(device)
    indices = None
    if index_topk is not None:
        what = "the reference indexer" if indices_source == "indexer" else "random causal picks"
        log(f"topk_indices from {what} (index_topk {index_topk})")
        s = timer.start()
        try:
            indices = make_topk_indices(
                indices_source,
                dims,
                workload.query_lens,
                workload.context_lens,
                index_topk,
                device=device,
                dtype=dtype,
                seed=args.seed,
                shape=shape,
            )
        except ValueError as err:  # a model the indexer cannot take (its RoPE part)
            raise CLIError(f"--indices {indices_source}: {err}") from None
        timer.stop("indices", s)
    backend = plan.backend
    skipped = sum(c.plan is None for c in plan.chunks)  # chunks without new tokens: no pass runs them
    run_chunks = len(plan.chunks) - skipped
    if indices is not None:
        schedule = (
            f"sparse: each new token attends its index_topk={index_topk} picks (mla_bridge.sparse, absorbed form); "
            f"the plan's dense passes are not run"
        )
    elif plan.fused:
        schedule = "fused: context + new tokens in one causal pass"
    elif run_chunks:
        skip_text = f", {skipped} more skipped (no new tokens among their requests)" if skipped else ""
        schedule = (
            f"chunked: main pass + {run_chunks} context chunk(s) of <= {chunk_tokens} tokens"
            f"{skip_text}, merged by LSE in {plan.num_merges} merge round(s) (partial: {plan.partial_rows} rows)"
        )
    else:
        schedule = (
            "main pass only (no cached context)"
            if not plan.num_context_tokens
            else "main pass only (no request with cached context has new tokens: its context is not read)"
        )

    attn_flops, up_flops = batch_flops(dims, workload, plan.num_gathered_context_tokens)
    causal_pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(workload.query_lens, workload.context_lens))
    selected_pairs = None
    if indices is not None:  # the FLOPs of the work the sparse pass does: its picks, and the absorption GEMMs
        selected_pairs = int((indices >= 0).sum())
        attn_flops, up_flops = sparse_flops(dims, selected_pairs, sum(workload.query_lens))
    # One untimed warm-up layer (lazy CUDA / FlashInfer / allocator set-up) on a GPU always, and on the CPU while a
    # layer is cheap (below CPU_WARMUP_FLOPS), so that the seed workload is not run twice on a CPU for it.
    warmup = device.type == "cuda" or attn_flops + up_flops < CPU_WARMUP_FLOPS
    steps = args.layers + int(warmup) + (0 if args.no_breakdown else 1) + len(sample)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    peak_extra = None
    with progress:
        task = progress.add_task("prefill", total=steps)
        # kv_b_proj prepared once, as at load time; the float64 check below reads the raw weight
        inputs = (q, kv_c, k_pe, prepare_kv_b_proj(weight, dims), cache, block_table)
        if warmup:
            progress.update(task, description="warm-up layer")
            log("warm-up layer")
            mla_prefill(*inputs, plan, return_lse=True, kv_cache_scale=kv_scale, topk_indices=indices)
            progress.advance(task)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        result: Any = None  # (out, lse) of the last layer once one ran
        for layer in range(args.layers):
            progress.update(task, description=f"layer {layer + 1}/{args.layers}")
            log.layer(layer, args.layers)
            result = None  # let the previous layer's output go before the next one allocates
            s = timer.start()
            result = mla_prefill(*inputs, plan, return_lse=True, kv_cache_scale=kv_scale, topk_indices=indices)
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
            log("instrumented layer (phase times)")
            phase_times, (out_i, lse_i) = phase_breakdown(plan, *inputs, kv_cache_scale=kv_scale, topk_indices=indices)
            phases = phase_times.phases_ms
            breakdown_diff = max(max_abs_error(out_i, out.float()), max_abs_error(lse_i, lse))
            progress.advance(task)

        checked = []
        tol_out, tol_lse = TOLERANCE[dtype_name]
        qo = plan.qo_indptr.tolist()
        for r in sample:
            progress.update(task, description=f"float64 check, request {r}")
            log(f"float64 check, request {r}")
            a, b = qo[r], qo[r + 1]
            # dense: the request's whole causal sequence; sparse: the same picks as the layer's (its rows of indices)
            reference = reference_request if indices is None else reference_sparse_request
            picks = {} if indices is None else {"topk_indices": indices[a:b]}
            ref_out, ref_lse = reference(
                q[a:b],
                kv_c[a:b],
                k_pe[a:b],
                weight,
                cache,
                block_table[r],
                workload.context_lens[r],
                dims,
                kv_cache_scale=kv_scale,
                **picks,
            )
            quant = {}
            if unquantized_cache is not None:  # the quantization error: against the cache before quantization
                unq_out, _ = reference(
                    q[a:b],
                    kv_c[a:b],
                    k_pe[a:b],
                    weight,
                    unquantized_cache,
                    block_table[r],
                    workload.context_lens[r],
                    dims,
                    **picks,
                )
                scale_ref = float(unq_out.abs().max()) if unq_out.numel() else 0.0
                quant = {
                    "max_abs_err_out_vs_unquantized": max_abs_error(out[a:b], unq_out),
                    "max_abs_ref_out_unquantized": scale_ref,
                }
            checked.append(
                {
                    **quant,
                    "request": r,
                    "new_tokens": b - a,
                    "context_tokens": workload.context_lens[r],
                    "max_abs_err_out": max_abs_error(out[a:b], ref_out),
                    "max_abs_err_lse": max_abs_error(lse[a:b], ref_lse),
                    "max_abs_ref_out": float(ref_out.abs().max()),
                    "max_excess_out": max_excess_error(out[a:b], ref_out, tol_out[1]),
                    "max_excess_lse": max_excess_error(lse[a:b], ref_lse, tol_lse[1]),
                }
            )
            progress.advance(task)

    # ---- numbers
    mean_ms = sum(layer_ms) / len(layer_ms)
    tflops = (attn_flops + up_flops) / (mean_ms * 1e-3) / 1e12 if mean_ms > 0 else None
    err_out = max((c["max_abs_err_out"] for c in checked), default=None)
    err_lse = max((c["max_abs_err_lse"] for c in checked), default=None)
    passed = None
    if checked:
        passed = all(
            math.isfinite(c["max_abs_err_out"])
            and math.isfinite(c["max_abs_err_lse"])
            and c["max_excess_out"] <= tol_out[0]
            and c["max_excess_lse"] <= tol_lse[0]
            for c in checked
        )
    if device.type == "cuda":
        device_text = f"{device} {torch.cuda.get_device_name(device)} (SM {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
    else:
        device_text = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    # ---- table
    table = Table(title=f"mla-bridge prefill: {model_name}", show_header=False, title_justify="left")
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("")
    add_row(
        table,
        "model dims",
        f"{dims.num_heads} heads, kv_lora_rank {dims.kv_lora_rank}, q/k {dims.qk_nope_head_dim}"
        f"+{dims.qk_rope_head_dim}, v {dims.v_head_dim}, softmax_scale {dims.softmax_scale:.6f}",
    )
    add_row(table, "kv_b_proj weight", weight_text)
    add_row(table, "device", device_text)
    add_row(table, "dtype", dtype_name)
    dense_note = (
        " (the dense passes' backend; not run: every layer runs the sparse pass)" if indices is not None else ""
    )
    add_row(table, "backend", Text.assemble((backend.name, "green"), f": {backend.reason}{dense_note}"))
    for name, why in backend.passed_over:
        add_row(table, "  passed over", f"{name}: {why}")
    table.add_section()
    add_row(table, "requests", str(len(workload.query_lens)))
    add_row(table, "new tokens", f"{sum(workload.query_lens)} ({lens_text(workload.query_lens)})")
    add_row(table, "context tokens", f"{sum(workload.context_lens)} ({lens_text(workload.context_lens)})")
    cache_text = cache_dtype_name(cache.dtype)
    if kv_scale is not None:
        cache_text += f", kv_cache_scale {kv_scale:.6g} (amax/448)"
    add_row(
        table,
        "paged cache",
        f"{cache.shape[0]} blocks x {args.block_size} tokens x {dims.latent_dim}, "
        f"shuffled block_table; {cache_text}; {cache_bytes / 2**20:.2f} MiB",
    )
    add_row(table, "schedule", schedule)
    bound, bound_fp8, bound_new = auto_bounds(dims)
    gathered = bound_fp8 if kv_scale is not None else bound
    kv_text = {
        "separate": f" ({kernels['gather']} gather + GEMM)",
        "fused": " (one Triton launch per pass)",
        "auto": f" (one Triton launch per pass under {gathered} gathered or {bound_new} "
        f"new-token rows, {kernels['gather']} gather + GEMM for larger ones)",
    }[kernels["kv"]]
    merge_text = kernels["merge"] if any(c.plan is not None for c in plan.chunks) else "none (no chunk to merge)"
    if indices is None:
        add_row(table, "kernels", f"k/v: {kernels['kv']}{kv_text}; merge: {merge_text}")
    else:
        choice = select_sparse(plan.dims, plan.dtype, plan.device.type)
        kernel = f", {triton_kernel_for(plan)} kernel" if choice.name == "triton" else ""
        add_row(
            table,
            "kernels",
            f"sparse attention: {choice.name}{kernel} ({choice.reason}); q_nope through W_UK, the picked latent rows, "
            f"W_UV",
        )
    loads = ", loads FlashInfer's kernels" if backend.is_flashinfer else ""
    add_row(
        table,
        "plan",
        f"{plan.num_plans} ragged plan(s), built once, {args.layers} layer(s) reuse it; host time "
        f"{ms_text(plan_ms)} (first build{loads}), {ms_text(plan_again_ms)} (built again)",
    )
    indices_ms = None
    if indices is not None:
        indices_ms = timer.each_ms("indices")[0]
        assert selected_pairs is not None  # counted with the indices
        source_text = (
            f"reference indexer (mla_bridge.indexer: {shape['index_n_heads']} heads x {shape['index_head_dim']}, "
            f"q_lora_rank {shape['q_lora_rank']}, hidden {shape['hidden_size']}; random weights and inputs, seed "
            f"{args.seed})"
            if shape is not None
            else f"random causal picks (seed {args.seed})"
        )
        add_row(table, "sparse attention", f"index_topk {index_topk}; topk_indices from {source_text}")
        share = selected_pairs / causal_pairs if causal_pairs else float("nan")
        add_row(
            table,
            "  selected pairs",
            f"{selected_pairs} (query, key) pairs of {causal_pairs} causal ones ({share:.1%}; dense prefill reads "
            f"them all)",
        )
        add_row(table, "  indices made in", f"{ms_text(indices_ms)} (once, untimed in the layers)")
    table.add_section()
    timing = "CUDA events" if device.type == "cuda" else "time.perf_counter"
    timing += ", after 1 untimed warm-up layer" if warmup else ", no warm-up layer"
    if len(layer_ms) > 1:
        add_row(
            table,
            "time per layer",
            f"{ms_text(mean_ms)} mean, {ms_text(min(layer_ms))} min, {ms_text(max(layer_ms))} max "
            f"over {len(layer_ms)} layers ({timing})",
        )
    else:
        add_row(table, "time per layer", f"{ms_text(mean_ms)} ({timing})")
    if phases is not None:
        gpu = device.type == "cuda"
        for name in ("gather + up-projection", "main pass", "context chunks", "merge", "sparse attention"):
            if name in phases:
                count = phase_times.passes[name]
                extra = f" ({count} passes)" if name in ("context chunks", "merge") else ""
                host = (
                    f"; host {ms_text(phase_times.host_ms[name])} to issue, gap {ms_text(phase_times.gap_ms[name])} "
                    f"on an idle GPU"
                    if gpu
                    else ""
                )
                add_row(table, f"  {name}", f"{ms_text(phases[name])}{extra}{host}")
        how = (
            f"GPU time, CUDA events at the phase boundaries with the GPU ahead of the host"
            f"{'' if phase_times.host_ran_ahead else ' (NOT reached: figures include host gaps)'}; host gaps "
            f"apart"
            if gpu
            else "time.perf_counter"
        )
        add_row(
            table,
            "  sum of phases",
            f"{ms_text(phase_times.sum_ms)} ({how}; mean of {phase_times.layers} extra "
            f"layer(s); output {'identical' if breakdown_diff == 0 else f'within {breakdown_diff:.1e}'} to "
            f"mla_prefill's)",
        )
    add_row(table, "total", f"{ms_text(sum(layer_ms))} for {len(layer_ms)} layer(s)")
    up_name = "up-projection" if indices is None else "absorption through W_UK / W_UV"
    attn_how = "" if indices is None else " over the selected pairs"
    add_row(
        table,
        "FLOPs per layer",
        f"{(attn_flops + up_flops) / 1e9:.2f} GFLOP (attention{attn_how} {attn_flops / 1e9:.2f}, "
        f"{up_name} {up_flops / 1e9:.2f})",
    )
    add_row(table, "throughput", "n/a" if tflops is None else f"{tflops:.3f} TFLOP/s")
    add_row(
        table,
        "peak extra memory",
        "n/a on CPU"
        if peak_extra is None
        else f"{peak_extra / 2**20:.1f} MiB (torch.cuda.max_memory_allocated over the inputs)",
    )
    table.add_section()
    if checked:
        verdict = ("PASS", "green") if passed else ("FAIL", "bold red")
        what = (
            "unchunked float64 attention from the paged cache (mla_bridge.reference"
            if indices is None
            else "float64 sparse attention over the same picks, MHA form, from the paged cache "
            "(mla_bridge.reference.reference_sparse_request"
        )
        add_row(
            table,
            "check",
            Text.assemble(
                verdict,
                f" (out and lse): requests {[c['request'] for c in checked]}"
                f"{_unchecked_note(workload.query_lens, args.check_requests, len(checked))} against {what}"
                f"{', FP8 bytes dequantized in float64' if kv_scale is not None else ''})",
            ),
        )
        add_row(table, "  max abs error out", f"{err_out:.3e} (tolerance {tol_text(tol_out)})")
        add_row(table, "  max abs error lse", f"{err_lse:.3e} (tolerance {tol_text(tol_lse)})")
        if unquantized_cache is not None:
            q_err = max(c["max_abs_err_out_vs_unquantized"] for c in checked)
            q_ref = max(c["max_abs_ref_out_unquantized"] for c in checked)
            add_row(
                table,
                "  fp8 quantization error",
                f"out vs float64 over the unquantized cache: {q_err:.3e} max abs "
                f"({q_err / q_ref if q_ref else float('nan'):.2e} of max |out|; reported, not checked)",
            )
    else:
        add_row(table, "check", "skipped (--check-requests 0)")
    console.print(table)

    results = {
        "model": model_name,
        "dims": {
            "num_heads": dims.num_heads,
            "kv_lora_rank": dims.kv_lora_rank,
            "qk_nope_head_dim": dims.qk_nope_head_dim,
            "qk_rope_head_dim": dims.qk_rope_head_dim,
            "v_head_dim": dims.v_head_dim,
            "softmax_scale": dims.softmax_scale,
        },
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
        "kv_cache": {
            "dtype": cache_dtype_name(cache.dtype),
            "scale": kv_scale,
            "bytes": cache_bytes,
            "quantization": "vLLM fp8 cache write: e4m3(x / scale), scale = amax / 448"
            if kv_scale is not None
            else None,
        },
        "chunk_tokens": chunk_tokens,
        "schedule": "sparse"
        if indices is not None
        else ("fused" if plan.fused else ("chunked" if run_chunks else "main-only")),
        "kernels": kernels
        if indices is None
        else {"sparse": select_sparse(plan.dims, plan.dtype, plan.device.type).name},
        "sparse": None
        if indices is None
        else {
            "index_topk": index_topk,
            "indices": indices_source,
            "indexer_shape": shape,
            "indices_ms": indices_ms,
            "selected_pairs": selected_pairs,
            "causal_pairs": causal_pairs,
            "flops_formula": "2 x selected pairs x heads x (kv_lora_rank + qk_rope_head_dim + kv_lora_rank)",
        },
        "num_chunks": run_chunks,
        "num_skipped_chunks": skipped,
        "num_merges": plan.num_merges,
        "num_plans": plan.num_plans,
        "layers": args.layers,
        "timing_method": timing,
        "timings_ms": {
            "plan": plan_ms,
            "plan_again": plan_again_ms,
            "per_layer": layer_ms,
            "layer_mean": mean_ms,
            "total": sum(layer_ms),
            "phases": phases,
            "phase_timing": None if phases is None else phase_times.to_dict(),
        },
        "flops": {
            "attention": attn_flops,
            ("up_projection" if indices is None else "absorption"): up_flops,
            "total": attn_flops + up_flops,
        },
        "tflops": tflops,
        "peak_extra_memory_bytes": peak_extra,
        "check": {
            "reference": (
                "mla_bridge.reference: unchunked float64 from the paged cache"
                if indices is None
                else "mla_bridge.reference.reference_sparse_request: float64 sparse attention over the same picks, "
                "from the paged cache"
            )
            + (" (dequantized: float64(stored) * scale)" if kv_scale is not None else ""),
            "requests": checked,
            "max_abs_err_out": err_out,
            "max_abs_err_lse": err_lse,
            "tolerance_out": {"atol": tol_out[0], "rtol": tol_out[1]},
            "tolerance_lse": {"atol": tol_lse[0], "rtol": tol_lse[1]},
            "passed": passed,
        },
        "seed": args.seed,
    }
    if args.json is not None:
        write_output(args.json, json.dumps(results, indent=2) + "\n")
        console.print(f"results written to {args.json}")
    if passed is False:
        print(
            f"mla-bridge prefill: check FAILED: max abs error out {err_out:.3e} (tolerance {tol_text(tol_out)}), "
            f"lse {err_lse:.3e} (tolerance {tol_text(tol_lse)})",
            file=sys.stderr,
        )
        return 1
    return 0
