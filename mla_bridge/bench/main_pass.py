"""Section 1: the causal main pass. ``RaggedPlan.run`` vs the raw FlashInfer wrapper's ``run()`` on the same tensors
(both planned once, same backend and arguments) vs torch SDPA (dense, equal lengths only) vs ``flex_attention`` with
a document-causal block mask vs the torch backend (small shapes only on the GPU)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..ragged import plan_ragged
from .cases import TORCH_BACKEND_MAX_WORK, MainShape, dims_for, main_shapes
from .common import Ctx, Job, Row, attention_flops, causal_pairs, fmt_err, indptr, plan_raw

__all__ = ["jobs", "PATHS"]

SECTION = "main"
PATHS = (
    "mla_bridge RaggedPlan.run",
    "raw FlashInfer wrapper.run",
    "torch SDPA (dense)",
    "flex_attention (doc-causal)",
    "mla_bridge torch backend",
)


def _tensors(ctx: Ctx, shape: MainShape, salt: int):
    g = ctx.generator(salt)
    t, h = shape.tokens, shape.heads
    return (ctx.randn(t, h, 192, gen=g), ctx.randn(t, h, 192, gen=g), ctx.randn(t, h, 128, gen=g))


def _meta(shape: MainShape, ci: int, pi: int) -> dict:
    return dict(seq_len=shape.tokens, heads=shape.heads, order=(0, ci, pi))


def _flops(shape: MainShape) -> float:
    return attention_flops(shape.lens, shape.lens, causal=True, heads=shape.heads)


def _core_and_raw(ctx: Ctx, shape: MainShape, ci: int) -> list[Row]:
    dims = dims_for(shape.heads)
    q, k, v = _tensors(ctx, shape, ci)
    qo = indptr(shape.lens)
    flops = _flops(shape)
    rows: list[Row] = []
    plan = None
    try:
        plan = plan_ragged(
            qo,
            qo,
            num_heads=shape.heads,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=True,
            sm_scale=dims.softmax_scale,
            dtype=ctx.dtype,
            workspace=ctx.workspace(),
            backend=ctx.backend,
        )
    except Exception as err:  # noqa: BLE001 - e.g. the fa3 JIT compile failed
        ctx.recover()
        rows.append(
            ctx.skipped(
                SECTION,
                shape.name,
                PATHS[0],
                "plan failed: " + fmt_err(err, 160),
                err,
                flops=flops,
                **_meta(shape, ci, 0),
            )
        )
    items = []
    if plan is not None:
        items.append(
            (
                PATHS[0],
                lambda: plan.run(q, k, v),
                dict(flops=flops, note=f"backend {plan.backend.name}", **_meta(shape, ci, 0)),
            )
        )
    fi_backend = plan.backend.flashinfer_backend if plan is not None else None
    raw_row = None
    if "raw" in ctx.skip:
        raw_row = ctx.skipped(SECTION, shape.name, PATHS[1], "--skip raw", **_meta(shape, ci, 1))
    elif fi_backend is None and plan is not None:
        raw_row = ctx.not_here(
            SECTION,
            shape.name,
            PATHS[1],
            "needs CUDA and FlashInfer (the plan runs the torch backend)",
            **_meta(shape, ci, 1),
        )
    elif fi_backend is None:
        raw_row = ctx.skipped(SECTION, shape.name, PATHS[1], "no plan", **_meta(shape, ci, 1))
    else:
        try:
            wrapper = ctx.raw_wrapper(fi_backend)
            plan_raw(wrapper, qo, qo, heads=shape.heads, causal=True, sm_scale=dims.softmax_scale, dtype=ctx.dtype)
            items.append(
                (
                    PATHS[1],
                    lambda: wrapper.run(q, k, v, return_lse=True),
                    dict(flops=flops, note=f"backend {fi_backend}, base-2 lse", **_meta(shape, ci, 1)),
                )
            )
        except Exception as err:  # noqa: BLE001
            ctx.recover()
            raw_row = ctx.skipped(
                SECTION,
                shape.name,
                PATHS[1],
                "plan failed: " + fmt_err(err, 160),
                err,
                flops=flops,
                **_meta(shape, ci, 1),
            )
    rows.extend(ctx.measure_many(SECTION, shape.name, items))  # interleaved: the ratio is what counts
    if raw_row is not None:
        rows.append(raw_row)
    core, raw = rows[0], rows[1]
    if core.status == raw.status == "ok":
        ratio = raw.ms / core.ms  # type: ignore[operator]  # an ok row has its ms
        core.extra["vs_raw"] = ratio
        core.note += f"; {ratio:.3f}x raw"
        ctx.check(
            f"main {shape.name}: mla_bridge / raw FlashInfer throughput",
            ratio,
            ">=",
            0.98,
            "no extra copies, syncs or per-call planning",
        )
    elif ctx.cuda:
        ctx.check(
            f"main {shape.name}: mla_bridge / raw FlashInfer throughput",
            None,
            ">=",
            0.98,
            "not measured: " + (core.note if core.status != "ok" else raw.note),
        )
    rows.append(_sdpa(ctx, shape, ci, q, k, v, flops))
    return rows


def _sdpa(ctx: Ctx, shape: MainShape, ci: int, q, k, v, flops: float) -> Row:
    meta = _meta(shape, ci, 2)
    if "sdpa" in ctx.skip:
        return ctx.skipped(SECTION, shape.name, PATHS[2], "--skip sdpa", **meta)
    if not shape.equal:
        return ctx.skipped(SECTION, shape.name, PATHS[2], "ragged batch: dense SDPA needs equal lengths", **meta)
    b, length, h = len(shape.lens), shape.lens[0], shape.heads
    scale = dims_for(h).softmax_scale
    try:
        # [B, H, L, D] contiguous copies, made once outside the timing (SDPA's preferred layout).
        qs, ks, vs = (x.view(b, length, h, -1).transpose(1, 2).contiguous() for x in (q, k, v))
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return ctx.skipped(SECTION, shape.name, PATHS[2], "failed: " + fmt_err(err, 160), err, flops=flops, **meta)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with _fused_sdpa_only(ctx):
        row = ctx.measure(
            SECTION,
            shape.name,
            PATHS[2],
            lambda: sdpa(qs, ks, vs, is_causal=True, scale=scale),
            flops=flops,
            note="[B,H,L,D]; torch picks flash/efficient/cuDNN" if ctx.cuda else "[B,H,L,D]",
            **meta,
        )
    return row


def _fused_sdpa_only(ctx: Ctx) -> Any:
    """On CUDA, SDPA without its math fallback: that one materialises B x H x L x L scores (100 GB at 16 x 10000)."""
    import contextlib

    if not ctx.cuda:
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001 - very old torch: no restriction
        return contextlib.nullcontext()
    backends = [
        getattr(SDPBackend, n)
        for n in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
        if hasattr(SDPBackend, n)
    ]
    return sdpa_kernel(backends)


def _flex(ctx: Ctx, shape: MainShape, ci: int) -> list[Row]:
    meta = _meta(shape, ci, 3)
    flops = _flops(shape)
    if "flex" in ctx.skip:
        return [ctx.skipped(SECTION, shape.name, PATHS[3], "--skip flex", **meta)]
    if ctx.over_budget():
        return [ctx.skipped(SECTION, shape.name, PATHS[3], f"time budget ({ctx.budget_s:.0f} s) spent", **meta)]
    if shape.equal:
        # Flex's set-up costs seconds per shape eagerly on the CPU and a torch.compile per shape on a GPU (minutes
        # each on the H200 after the JAX section: six shapes read as a hang), so it runs on
        # the ragged shape only, the one its document mask is for.
        return [
            ctx.skipped(SECTION, shape.name, PATHS[3], "run on the ragged shape only (a compile per shape)", **meta)
        ]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as err:  # noqa: BLE001
        return [ctx.skipped(SECTION, shape.name, PATHS[3], "flex_attention unavailable", err, **meta)]
    h, t = shape.heads, shape.tokens
    g = ctx.generator(ci)
    try:
        # [1, H, T, D]: the packed batch as one sequence; the mask keeps each document causal and to itself.
        q, k, v = (ctx.randn(t, h, d, gen=g).transpose(0, 1).unsqueeze(0).contiguous() for d in (192, 192, 128))
        doc = torch.repeat_interleave(
            torch.arange(len(shape.lens), device=ctx.device), torch.tensor(shape.lens, device=ctx.device)
        )

        def doc_causal(b: Any, hh: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mask = create_block_mask(doc_causal, None, None, t, t, device=str(ctx.device), _compile=ctx.cuda)
        fn = _compiled_flex(ctx, flex_attention)
        scale = dims_for(h).softmax_scale
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return [ctx.skipped(SECTION, shape.name, PATHS[3], "failed: " + fmt_err(err, 160), err, flops=flops, **meta)]
    note = "torch.compile'd" if ctx.cuda else "eager (unfused; CPU quick mode)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = ctx.measure(
            SECTION,
            shape.name,
            PATHS[3],
            lambda: fn(q, k, v, block_mask=mask, scale=scale),
            flops=flops,
            note=note + f", mask sparsity {mask.sparsity():.0f}%",
            **meta,
        )
    return [row]


def _compiled_flex(ctx: Ctx, flex_attention: Any) -> Any:
    if not ctx.cuda:
        return flex_attention
    fn = getattr(ctx, "_flex_fn", None)
    if fn is None:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):  # one compile per shape; don't fall back to eager
            try:
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(64, int(getattr(torch._dynamo.config, name))))
            except Exception:  # noqa: BLE001 - a renamed knob: the default limit (8) still covers 6 shapes
                pass
        fn = torch.compile(flex_attention, dynamic=False)
        ctx._flex_fn = fn  # type: ignore[attr-defined]
    return fn


def _torch_backend(ctx: Ctx, shape: MainShape, ci: int) -> list[Row]:
    meta = _meta(shape, ci, 4)
    flops = _flops(shape)
    if "torch" in ctx.skip:
        return [ctx.skipped(SECTION, shape.name, PATHS[4], "--skip torch", **meta)]
    work = sum(causal_pairs(n, n) for n in shape.lens) * shape.heads
    if ctx.cuda and not ctx.quick and work > TORCH_BACKEND_MAX_WORK:
        return [
            ctx.skipped(
                SECTION,
                shape.name,
                PATHS[4],
                "slow reference: run only on shapes up to 1x10000 at 16 heads",
                flops=flops,
                **meta,
            )
        ]
    if ctx.over_budget():
        return [ctx.skipped(SECTION, shape.name, PATHS[4], f"time budget ({ctx.budget_s:.0f} s) spent", **meta)]
    dims = dims_for(shape.heads)
    q, k, v = _tensors(ctx, shape, ci)
    qo = indptr(shape.lens)
    try:
        plan = plan_ragged(
            qo,
            qo,
            num_heads=shape.heads,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=True,
            sm_scale=dims.softmax_scale,
            dtype=ctx.dtype,
            workspace=ctx.workspace(),
            backend="torch",
        )
    except Exception as err:  # noqa: BLE001
        return [ctx.skipped(SECTION, shape.name, PATHS[4], "plan failed", err, **meta)]
    # The reference is slow on big shapes: fewer repeats there.
    repeats = ctx.repeats if ctx.quick or not ctx.cuda else min(ctx.repeats, 3)
    return [
        ctx.measure(
            SECTION,
            shape.name,
            PATHS[4],
            lambda: plan.run(q, k, v),
            flops=flops,
            repeats=repeats,
            warmup=1,
            note="blockwise float32 reference",
            **meta,
        )
    ]


def jobs(ctx: Ctx) -> list[Job]:
    out: list[Job] = []
    shapes = main_shapes(ctx.quick)
    for ci, shape in enumerate(shapes):
        # mypy cannot infer a lambda with default arguments (each binds its loop values)
        out.append(Job(SECTION, f"main {shape.name}", lambda c, s=shape, i=ci: _core_and_raw(c, s, i)))  # type: ignore[misc]
    # Slow peers last, inside the time budget: flex_attention compiles once per shape.
    for ci, shape in enumerate(shapes):
        out.append(
            Job(SECTION, f"main {shape.name}: flex_attention", lambda c, s=shape, i=ci: _flex(c, s, i), optional=True)  # type: ignore[misc]
        )
        out.append(
            Job(
                SECTION,
                f"main {shape.name}: torch backend",
                lambda c, s=shape, i=ci: _torch_backend(c, s, i),  # type: ignore[misc]
                optional=True,
            )
        )
    return out
