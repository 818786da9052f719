"""Sections 3-5: merge bandwidth, planning (host time, plans per 61-layer loop), peak memory."""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any, Callable

import torch

from ..merge import merge_attn_states, merge_attn_states_
from ..plan import PrefillPlan
from ..prefill import mla_prefill
from ..workspace import Workspace
from .cases import ContextCase, context_cases, dims_for, loop_case
from .common import Case, Ctx, Job, Row, Variant, fmt_err, variants
from .context import budget_bytes, handwritten_pipeline, make_inputs, merge_state_threads, peak_extra

__all__ = ["merge_jobs", "plan_jobs", "memory_jobs"]

GIB = 1024**3


# ------------------------------------------------------------------------------------------------ 3. merge
MERGE = variants(
    Variant("ours", "merge_attn_states", 0, note="read 2 partials + write 1 (out and lse)"),
    Variant("ours in place", "merge_attn_states_ (in place, as in mla_prefill)", 1),
    Variant("raw", "flashinfer.merge_state (raw, base-2 lse)", 2, ("cuda", "flashinfer")),
)


def _merge_job(ctx: Ctx, heads: int, ci: int) -> list[Row]:
    tokens, d = (2048 if ctx.quick else 2**20) // heads, 128  # the same bytes at every head count
    c = Case(ctx, "merge", f"{heads}h x {tokens} tokens, d {d}", MERGE, ci, dict(heads=heads, seq_len=tokens))
    g = ctx.generator(2000 + ci)
    out_a, out_b = ctx.randn(tokens, heads, d, gen=g), ctx.randn(tokens, heads, d, gen=g)
    lse_a = ctx.randn(tokens, heads, gen=g, dtype=torch.float32)
    lse_b = ctx.randn(tokens, heads, gen=g, dtype=torch.float32)
    nbytes = 3 * tokens * heads * (d * out_a.element_size() + 4)
    acc_out, acc_lse = out_a.clone(), lse_a.clone()
    items = [
        c.item("ours", lambda: merge_attn_states(out_a, lse_a, out_b, lse_b), nbytes=nbytes, note=MERGE["ours"].note),
        c.item("ours in place", lambda: merge_attn_states_(acc_out, acc_lse, out_b, lse_b), nbytes=nbytes),
    ]
    skipped = [row] if (row := c.unavailable("raw")) else []
    if not skipped and merge_state_threads(heads, d, out_a.element_size()) > 1024:
        # FlashInfer 0.7.4 launches head_dim/vec x heads threads per block: above 64 heads at bf16, d 128, the
        # launch fails (seen on the H200), and a failed launch can poison the next kernel's error check.
        why = (
            f"not run: FlashInfer's merge_state fails to launch above 64 heads at bf16, d {d} (block of {heads} x "
            f"{merge_state_threads(1, d, out_a.element_size())} threads > 1024); merge_attn_states folds heads into rows"
        )
        skipped.append(c.skip("raw", why))
    elif not skipped:
        from flashinfer import merge_state

        s_a, s_b = lse_a * 1.4426950408889634, lse_b * 1.4426950408889634
        items.append(c.item("raw", lambda: merge_state(out_a, s_a, out_b, s_b), nbytes=nbytes))
    rows = c.measure(items) + skipped
    main = rows[0]
    note = main.note if main.status != "ok" else ""
    ctx.check(f"merge {heads} heads: merge_attn_states GB/s", main.gbps, ">=", 2500.0, note)
    return rows


def merge_jobs(ctx: Ctx) -> list[Job]:
    return [Job("merge", f"merge {h} heads", partial(_merge_job, heads=h, ci=i)) for i, h in enumerate((16, 128))]


# ------------------------------------------------------------------------------------------------ 4. plan
PLAN = variants(
    Variant("build", "PrefillPlan.build host time", 0),
    Variant("flashinfer", "PrefillPlan.build: FlashInfer plan() calls", 1),
    Variant("own", "PrefillPlan.build: our own host work", 2),
)


def _build_time_job(ctx: Ctx, batch: int, with_context: bool, ci: int) -> list[Row]:
    dims = dims_for(16)
    new, cached = 512, (2048 if with_context else 0)
    name = f"batch {batch}: {new} new" + (f" + {cached} cached" if cached else "") + " per request"
    c = Case(ctx, "plan", name, PLAN, ci, dict(heads=16, seq_len=batch * (new + cached)))
    ws = Workspace(ctx.device)
    q_lens, c_lens = [new] * batch, [cached] * batch
    in_flashinfer = [0.0]
    plan_with_growth = ws.plan_with_growth

    def timed_plan(fn: Any, *args: Any, **kwargs: Any) -> Any:  # FlashInfer's plan() calls, timed apart from ours
        t0 = time.perf_counter()
        try:
            return plan_with_growth(fn, *args, **kwargs)
        finally:
            in_flashinfer[0] += time.perf_counter() - t0

    ws.plan_with_growth = timed_plan  # type: ignore[method-assign, assignment]  # this workspace only, timed

    def build() -> Any:
        return PrefillPlan.build(
            q_lens, c_lens, dims=dims, workspace=ws, block_size=64, dtype=ctx.dtype, backend=ctx.backend
        )

    try:
        plan = build()  # warm-up: FlashInfer's JIT and first allocations
        shape = "fused" if plan.fused else (f"{len(plan.chunks)} chunk(s)" if plan.chunks else "no context")
        backend = plan.backend.name
        times, fi_times = [], []
        for _ in range(max(10, ctx.repeats)):
            plan = None  # the last plan gives its pooled wrappers back first, as in a serving loop
            in_flashinfer[0] = 0.0
            p0 = ws.plans_made
            t = time.perf_counter()
            plan = build()
            times.append((time.perf_counter() - t) * 1e3)
            fi_times.append(in_flashinfer[0] * 1e3)
        plans = ws.plans_made - p0
    except Exception as err:  # noqa: BLE001
        rows = [row := c.failed("build", err)]
    else:
        ms, fi_ms = statistics.median(times), statistics.median(fi_times)
        own = statistics.median([t - f for t, f in zip(times, fi_times)])
        ratio = own / fi_ms if fi_ms > 0 else None
        split = dict(flashinfer_plans=plans, flashinfer_plan_ms=fi_ms, own_host_ms=own, own_over_flashinfer=ratio)
        figures = (
            ("build", ms, f"{shape}, {backend}, host time, {plans} FlashInfer plan(s)"),
            ("flashinfer", fi_ms, f"{plans} plan(s)"),
            ("own", own, "build minus FlashInfer's plan()" + (f"; {ratio:.2f}x of it" if ratio else "")),
        )
        rows = [
            Row(
                "plan", name, PLAN[v].label, ms=t, host_ms=t, repeats=len(times), note=n, extra=dict(split), **c.meta(v)
            )
            for v, t, n in figures
        ]
        row = rows[0]
        row.extra = {"ms_samples": [round(t, 6) for t in times], "schedule": shape, "backend": backend, **split}
    if batch == 128:
        ctx.check(f"plan: PrefillPlan.build host ms, {name}", row.ms, "<=", 1.0)
    if batch == 128 and with_context:
        ctx.check(
            f"plan: own host work / FlashInfer plan() time, {name}",
            row.extra.get("own_over_flashinfer"),
            "<=",
            0.20,
            "needs FlashInfer plans" if row.extra.get("own_over_flashinfer") is None else "",
        )
    return rows


def _loop_job(ctx: Ctx, case: ContextCase, budget_label: str, budget: int, ci: int) -> list[Row]:
    """Build a plan once and run ``ctx.layers`` layers of mla_prefill: FlashInfer plans must be 1 + distinct chunk
    shapes (``plan.num_plans``), all made by the build, none by the layers."""
    name = f"{case.name}, {budget_label}" if case.context else case.name
    path = f"{ctx.layers}-layer loop: FlashInfer plans"
    x = make_inputs(ctx, case, 3000 + ci)
    attn, up = x.flops()
    meta = dict(heads=x.dims.num_heads, seq_len=x.num_context + x.num_tokens, order=(3, 100 + ci, 0))
    ws = Workspace(ctx.device, chunk_tokens=budget)
    try:
        p0 = ws.plans_made
        plan = PrefillPlan.build(
            x.q_lens,
            x.c_lens,
            dims=x.dims,
            workspace=ws,
            block_size=case.block_size,
            dtype=ctx.dtype,
            backend=ctx.backend,
        )
        p1 = ws.plans_made

        def loop() -> None:
            for _ in range(ctx.layers):
                mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan)

        warm = 1 if ctx.cuda else 0
        timing = ctx.time(loop, repeats=1, warmup=warm)
        p2 = ws.plans_made
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        row = ctx.skipped("plan", name, path, "failed: " + fmt_err(err, 160), err, **meta)
        ctx.check(f"plan: FlashInfer plans in a {ctx.layers}-layer loop, {name}", None, "==", 0, row.note)
        return [row]
    flashinfer = plan.backend.is_flashinfer
    expected = plan.num_plans if flashinfer else 0
    per_layer = timing.ms / ctx.layers
    row = ctx.row(
        "plan",
        name,
        path,
        ms=per_layer,
        flops=attn + up,
        **meta,
        note=(
            f"plans: {p1 - p0} at build + {p2 - p1} in {ctx.layers * (1 + warm)} layers "
            f"(expected {plan.num_plans}: main + distinct shapes of {len(plan.chunks)} chunk(s))"
            if flashinfer
            else f"torch backend: no FlashInfer plan to count; {ctx.layers} layers on one plan"
        )
        + "; ms per layer",
    )
    row.host_ms = timing.host_ms / ctx.layers
    row.repeats = 1
    row.extra.update(
        plans_at_build=p1 - p0,
        plans_in_loop=p2 - p1,
        layers_run=ctx.layers * (1 + warm),
        chunks=len(plan.chunks),
        fused=plan.fused,
        expected_plans=expected,
        backend=plan.backend.name,
        loop_ms=timing.ms,
    )
    ctx.check(
        f"plan: FlashInfer plans in a {ctx.layers}-layer loop, {name}",
        p2 - p0,
        "==",
        expected,
        f"{p1 - p0} at build, {p2 - p1} in the layers",
    )
    return [row]


def plan_jobs(ctx: Ctx) -> list[Job]:
    builds = [(w, b) for w in (False, True) for b in (1, 16, 128)]
    out = [
        Job(
            "plan",
            f"plan build batch {b}" + (" with context" if w else ""),
            partial(_build_time_job, batch=b, with_context=w, ci=i),
        )
        for i, (w, b) in enumerate(builds)
    ]
    first = loop_case(ctx.quick)
    main_only = ContextCase(
        f"{first.batch}x{first.new} new, no context", first.batch, 0, first.new, (("no context", first.context),),
        first.block_size, heads=first.heads,
    )  # fmt: skip
    loops = [(main_only, "no context", first.context)] + [(first, label, b) for label, b in first.budgets]
    for i, (case, label, budget) in enumerate(loops):
        name = f"{ctx.layers}-layer loop {case.name}" + (f", {label}" if case.context else "")
        out.append(Job("plan", name, partial(_loop_job, case=case, budget_label=label, budget=budget, ci=i)))
    return out


# ------------------------------------------------------------------------------------------------ 5. memory
MEMORY = variants(
    Variant("ours", "mla_prefill peak extra memory", 0, ("cuda",)),
    Variant("handwritten", "hand-written pipeline peak extra memory", 1, ("flashinfer",)),
)


def _memory_job(ctx: Ctx, case: ContextCase, bi: int, ci: int) -> list[Row]:
    label, budget = case.budgets[bi]
    x = make_inputs(ctx, case, 4000 + ci)
    fields = dict(heads=x.dims.num_heads, seq_len=x.num_context + x.num_tokens)
    c = Case(ctx, "memory", f"{case.name}, {label}", MEMORY, ci, fields)
    ws = Workspace(ctx.device, chunk_tokens=budget)
    plan = PrefillPlan.build(
        x.q_lens, x.c_lens, dims=x.dims, workspace=ws, block_size=case.block_size, dtype=ctx.dtype, backend=ctx.backend
    )
    limit = budget_bytes(x, plan)
    if not ctx.cuda:
        return [
            c.skip("ours", "needs CUDA (torch.cuda memory statistics)", applies=False, extra={"budget_bytes": limit})
        ]
    what = f"memory {c.name}: peak extra / (workspace budget + output)"
    rows = []

    def peak_row(v: str, fn: Callable[[], Any], note: str) -> Row:
        peak = peak_extra(ctx, fn)
        ratio = peak / limit["total"]
        extra = {"peak_bytes": peak, "budget_bytes": limit, "peak_over_budget": ratio}
        note = note.format(peak=peak / GIB, ratio=ratio)
        return Row("memory", c.name, MEMORY[v].label, bytes=float(peak), note=note, extra=extra, **c.meta(v))

    try:
        sched = "fused" if plan.fused else f"{len(plan.chunks)} chunk(s)"
        note = f"{sched}: peak {{peak:.3f}} GiB vs budget {limit['total'] / GIB:.3f} GiB ({{ratio:.2f}}x)"
        rows.append(
            peak_row("ours", lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan), note)
        )
        ctx.check(
            what, rows[-1].extra["peak_over_budget"], "<=", 1.0, "budget: mla_bridge.prefill.prefill_memory_bytes(plan)"
        )
    except Exception as err:  # noqa: BLE001
        rows.append(c.failed("ours", err))
        ctx.check(what, None, "<=", 1.0, rows[-1].note)
    if MEMORY["handwritten"].missing(ctx) is None:
        try:
            layer = handwritten_pipeline(ctx, x, budget)
            rows.append(peak_row("handwritten", layer, "peak {peak:.3f} GiB ({ratio:.2f}x the same budget)"))
        except Exception as err:  # noqa: BLE001
            rows.append(c.failed("handwritten", err))
    return rows


def memory_jobs(ctx: Ctx) -> list[Job]:
    return [
        Job("memory", f"memory {case.name}, {label}", partial(_memory_job, case=case, bi=bi, ci=10 * k + bi))
        for k, case in enumerate(context_cases(ctx.quick))
        for bi, (label, _) in enumerate(case.budgets)
    ]
