"""Sections 3-5: merge bandwidth, planning (host time, plans per 61-layer loop), peak memory."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..merge import merge_attn_states, merge_attn_states_
from ..plan import PrefillPlan
from ..prefill import mla_prefill
from ..workspace import Workspace
from .cases import ContextCase, context_cases, dims_for, loop_case
from .common import Ctx, Job, Row, flashinfer_importable, fmt_err
from .context import budget_bytes, handwritten_pipeline, make_inputs, peak_extra

__all__ = ["merge_jobs", "plan_jobs", "memory_jobs"]

GIB = 1024**3


# ------------------------------------------------------------------------------------------------ 3. merge
MERGE_PATHS = (
    "merge_attn_states",
    "merge_attn_states_ (in place, as in mla_prefill)",
    "flashinfer.merge_state (raw, base-2 lse)",
)


def _merge_job(ctx: Ctx, heads: int, ci: int) -> list[Row]:
    tokens = (2048 if ctx.quick else 2**20) // heads  # the same bytes at every head count
    d = 128
    case = f"{heads}h x {tokens} tokens, d {d}"
    g = ctx.generator(2000 + ci)
    out_a, out_b = ctx.randn(tokens, heads, d, gen=g), ctx.randn(tokens, heads, d, gen=g)
    lse_a = ctx.randn(tokens, heads, gen=g, dtype=torch.float32)
    lse_b = ctx.randn(tokens, heads, gen=g, dtype=torch.float32)
    nbytes = 3 * tokens * heads * (d * out_a.element_size() + 4)
    meta: Callable[[int], dict[str, Any]] = lambda pi: dict(  # noqa: E731
        heads=heads, seq_len=tokens, order=(2, ci, pi)
    )
    acc_out, acc_lse = out_a.clone(), lse_a.clone()
    items = [
        (
            MERGE_PATHS[0],
            lambda: merge_attn_states(out_a, lse_a, out_b, lse_b),
            dict(nbytes=nbytes, note="read 2 partials + write 1 (out and lse)", **meta(0)),
        ),
        (MERGE_PATHS[1], lambda: merge_attn_states_(acc_out, acc_lse, out_b, lse_b), dict(nbytes=nbytes, **meta(1))),
    ]
    skipped = []
    if not ctx.cuda or not flashinfer_importable():
        skipped.append(ctx.not_here("merge", case, MERGE_PATHS[2], "needs CUDA and FlashInfer", **meta(2)))
    elif heads * (d // max(16 // out_a.element_size(), d // 32)) > 1024:
        # FlashInfer 0.7.4 launches head_dim/vec x heads threads per block: above 64 heads at bf16, d 128, the
        # launch fails (seen on the H200), and a failed launch can poison the next kernel's error check.
        skipped.append(
            ctx.skipped(
                "merge",
                case,
                MERGE_PATHS[2],
                f"not run: FlashInfer's merge_state fails to "
                f"launch above 64 heads at bf16, d {d} (block of {heads} x "
                f"{d // max(16 // out_a.element_size(), d // 32)} threads > 1024); "
                f"merge_attn_states folds heads into rows",
                **meta(2),
            )
        )
    else:
        from flashinfer import merge_state

        s_a, s_b = lse_a * 1.4426950408889634, lse_b * 1.4426950408889634
        items.append((MERGE_PATHS[2], lambda: merge_state(out_a, s_a, out_b, s_b), dict(nbytes=nbytes, **meta(2))))
    rows = ctx.measure_many("merge", case, items) + skipped
    main = rows[0]
    ctx.check(
        f"merge {heads} heads: merge_attn_states GB/s",
        main.gbps,
        ">=",
        2500.0,
        main.note if main.status != "ok" else "",
    )
    return rows


def merge_jobs(ctx: Ctx) -> list[Job]:
    # mypy cannot infer a lambda with default arguments (each binds its loop values)
    return [
        Job("merge", f"merge {h} heads", lambda c, hh=h, i=i: _merge_job(c, hh, i))  # type: ignore[misc]
        for i, h in enumerate((16, 128))
    ]


# ------------------------------------------------------------------------------------------------ 4. plan
def _build_time_job(ctx: Ctx, batch: int, with_context: bool, ci: int) -> list[Row]:
    dims = dims_for(16)
    new, cached = 512, (2048 if with_context else 0)
    case = f"batch {batch}: {new} new" + (f" + {cached} cached" if cached else "") + " per request"
    path = "PrefillPlan.build host time"
    meta: dict[str, Any] = dict(heads=16, seq_len=batch * (new + cached), order=(3, ci, 0))
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
        ctx.recover()
        row = ctx.skipped("plan", case, path, "failed: " + fmt_err(err, 160), err, **meta)
        rows = [row]
    else:
        ms = statistics.median(times)
        fi_ms = statistics.median(fi_times)
        own = statistics.median([t - f for t, f in zip(times, fi_times)])
        ratio = own / fi_ms if fi_ms > 0 else None
        split = {
            "flashinfer_plans": plans,
            "flashinfer_plan_ms": fi_ms,
            "own_host_ms": own,
            "own_over_flashinfer": ratio,
        }
        row = Row(
            "plan",
            case,
            path,
            ms=ms,
            host_ms=ms,
            repeats=len(times),
            note=f"{shape}, {backend}, host time, {plans} FlashInfer plan(s)",
            extra={"ms_samples": [round(t, 6) for t in times], "schedule": shape, "backend": backend, **split},
            **meta,
        )
        rows = [row] + [
            Row(
                "plan",
                case,
                p,
                ms=v,
                host_ms=v,
                repeats=len(times),
                note=n,
                extra=dict(split),
                **dict(meta, order=(3, ci, k + 1)),
            )
            for k, (p, v, n) in enumerate(
                (
                    ("PrefillPlan.build: FlashInfer plan() calls", fi_ms, f"{plans} plan(s)"),
                    (
                        "PrefillPlan.build: our own host work",
                        own,
                        "build minus FlashInfer's plan()" + (f"; {ratio:.2f}x of it" if ratio else ""),
                    ),
                )
            )
        ]
    if batch == 128:
        ctx.check(f"plan: PrefillPlan.build host ms, {case}", row.ms, "<=", 1.0)
    if batch == 128 and with_context:
        ctx.check(
            f"plan: own host work / FlashInfer plan() time, {case}",
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
    out = []
    ci = 0
    for with_context in (False, True):
        for batch in (1, 16, 128):
            out.append(
                Job(
                    "plan",
                    f"plan build batch {batch}" + (" with context" if with_context else ""),
                    lambda c, b=batch, w=with_context, i=ci: _build_time_job(c, b, w, i),  # type: ignore[misc]
                )
            )
            ci += 1
    first = loop_case(ctx.quick)
    main_only = ContextCase(
        f"{first.batch}x{first.new} new, no context",
        first.batch,
        0,
        first.new,
        (("no context", first.context),),
        first.block_size,
        heads=first.heads,
    )
    loops = [(main_only, "no context", first.context)] + [(first, label, b) for label, b in first.budgets]
    for i, (case, label, budget) in enumerate(loops):
        out.append(
            Job(
                "plan",
                f"{ctx.layers}-layer loop {case.name}" + (f", {label}" if case.context else ""),
                lambda c, cs=case, lb=label, b=budget, k=i: _loop_job(c, cs, lb, b, k),  # type: ignore[misc]
            )
        )
    return out


# ------------------------------------------------------------------------------------------------ 5. memory
MEMORY_PATHS = ("mla_prefill peak extra memory", "hand-written pipeline peak extra memory")


def _memory_job(ctx: Ctx, case: ContextCase, bi: int, ci: int) -> list[Row]:
    label, budget = case.budgets[bi]
    name = f"{case.name}, {label}"
    x = make_inputs(ctx, case, 4000 + ci)
    seq = x.num_context + x.num_tokens
    meta = lambda pi: dict(heads=x.dims.num_heads, seq_len=seq, order=(4, ci, pi))  # noqa: E731
    ws = Workspace(ctx.device, chunk_tokens=budget)
    plan = PrefillPlan.build(
        x.q_lens, x.c_lens, dims=x.dims, workspace=ws, block_size=case.block_size, dtype=ctx.dtype, backend=ctx.backend
    )
    limit = budget_bytes(x, plan)
    if not ctx.cuda:
        return [
            ctx.not_here(
                "memory",
                name,
                MEMORY_PATHS[0],
                "needs CUDA (torch.cuda memory statistics)",
                extra={"budget_bytes": limit},
                **meta(0),
            )
        ]
    rows = []
    try:
        peak = peak_extra(ctx, lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan))
        sched = "fused" if plan.fused else f"{len(plan.chunks)} chunk(s)"
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        rows.append(ctx.skipped("memory", name, MEMORY_PATHS[0], "failed: " + fmt_err(err, 160), err, **meta(0)))
        ctx.check(f"memory {name}: peak extra / (workspace budget + output)", None, "<=", 1.0, rows[-1].note)
    else:
        ratio = peak / limit["total"]
        rows.append(
            Row(
                "memory",
                name,
                MEMORY_PATHS[0],
                bytes=float(peak),
                note=f"{sched}: peak {peak / GIB:.3f} GiB vs budget {limit['total'] / GIB:.3f} GiB ({ratio:.2f}x)",
                extra={"peak_bytes": peak, "budget_bytes": limit, "peak_over_budget": ratio},
                **meta(0),
            )
        )
        ctx.check(
            f"memory {name}: peak extra / (workspace budget + output)",
            ratio,
            "<=",
            1.0,
            "budget: mla_bridge.prefill.prefill_memory_bytes(plan)",
        )
    if flashinfer_importable():
        try:
            layer = handwritten_pipeline(ctx, x, budget)
            peak = peak_extra(ctx, layer)
            rows.append(
                Row(
                    "memory",
                    name,
                    MEMORY_PATHS[1],
                    bytes=float(peak),
                    note=f"peak {peak / GIB:.3f} GiB ({peak / limit['total']:.2f}x the same budget)",
                    extra={"peak_bytes": peak, "budget_bytes": limit, "peak_over_budget": peak / limit["total"]},
                    **meta(1),
                )
            )
        except Exception as err:  # noqa: BLE001
            ctx.recover()
            rows.append(ctx.skipped("memory", name, MEMORY_PATHS[1], "failed: " + fmt_err(err, 160), err, **meta(1)))
    return rows


def memory_jobs(ctx: Ctx) -> list[Job]:
    out = []
    for k, case in enumerate(context_cases(ctx.quick)):
        for bi, (label, _) in enumerate(case.budgets):
            ci = 10 * k + bi
            out.append(
                Job("memory", f"memory {case.name}, {label}", lambda c, cs=case, b=bi, i=ci: _memory_job(c, cs, b, i))  # type: ignore[misc]
            )
    return out
