"""Section 1: the causal main pass. ``RaggedPlan.run`` vs the raw FlashInfer wrapper's ``run()`` on the same tensors
(both planned once, same backend and arguments) vs torch SDPA (dense, equal lengths only) vs ``flex_attention`` with
a document-causal block mask vs the torch backend (small shapes only on the GPU). Each shape has its model's head dims
(:attr:`mla_bridge.bench.cases.MainShape.dims`: DeepSeek's 192/128, GLM-5's 256/256)."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch

from ..ragged import plan_ragged
from .cases import TORCH_BACKEND_MAX_WORK, MainShape, main_shapes
from .common import Case, Ctx, Job, Row, Variant, attention_flops, beside_raw, causal_pairs, indptr, variants

__all__ = ["jobs", "VARIANTS"]

SECTION = "main"
VARIANTS = variants(
    Variant("core", "mla_bridge RaggedPlan.run", 0),
    Variant("raw", "raw FlashInfer wrapper.run", 1),
    Variant("sdpa", "torch SDPA (dense)", 2),
    Variant("flex", "flex_attention (doc-causal)", 3),
    Variant("torch", "mla_bridge torch backend", 4),
)


def _case(ctx: Ctx, shape: MainShape, ci: int) -> Case:
    return Case(ctx, SECTION, shape.name, VARIANTS, ci, dict(seq_len=shape.tokens, heads=shape.heads))


def _tensors(ctx: Ctx, shape: MainShape, salt: int):
    g = ctx.generator(salt)
    t, h, d = shape.tokens, shape.heads, shape.dims
    return tuple(ctx.randn(t, h, n, gen=g) for n in (d.head_dim_qk, d.head_dim_qk, d.head_dim_vo))


def _flops(shape: MainShape) -> float:
    d = shape.dims
    return attention_flops(
        shape.lens, shape.lens, causal=True, heads=shape.heads, head_dim_sum=d.head_dim_qk + d.head_dim_vo
    )


def _plan(ctx: Ctx, shape: MainShape, backend: Any):
    qo, d = indptr(shape.lens), shape.dims
    return plan_ragged(
        qo, qo, num_heads=shape.heads, head_dim_qk=d.head_dim_qk, head_dim_vo=d.head_dim_vo, causal=True,
        sm_scale=d.softmax_scale, dtype=ctx.dtype, workspace=ctx.workspace(), backend=backend,
    )  # fmt: skip


def _core_and_raw(ctx: Ctx, shape: MainShape, ci: int) -> list[Row]:
    c = _case(ctx, shape, ci)
    q, k, v = _tensors(ctx, shape, ci)
    flops = _flops(shape)
    try:
        plan = _plan(ctx, shape, ctx.backend)
    except Exception as err:  # noqa: BLE001 - e.g. the fa3 JIT compile failed
        rows = [
            c.failed("core", err, "plan failed", flops=flops),
            c.skip("raw", "--skip raw" if "raw" in ctx.skip else "no plan"),
        ]
    else:
        note = " (the plan runs the torch backend)"
        rows = beside_raw(c, "core", "raw", plan, q, k, v, flops=flops, raw_note=", base-2 lse", fi_missing=note)
    core, raw = rows
    what = f"main {shape.name}: mla_bridge / raw FlashInfer throughput"
    if core.status == raw.status == "ok":
        ctx.check(what, core.extra["vs_raw"], ">=", 0.98, "no extra copies, syncs or per-call planning")
    elif ctx.cuda:
        ctx.check(what, None, ">=", 0.98, "not measured: " + (core.note if core.status != "ok" else raw.note))
    rows.append(_sdpa(ctx, c, shape, q, k, v, flops))
    return rows


def _sdpa(ctx: Ctx, c: Case, shape: MainShape, q, k, v, flops: float) -> Row:
    if "sdpa" in ctx.skip:
        return c.skip("sdpa", "--skip sdpa")
    if not shape.equal:
        return c.skip("sdpa", "ragged batch: dense SDPA needs equal lengths")
    b, length, h = len(shape.lens), shape.lens[0], shape.heads
    scale = shape.dims.softmax_scale
    try:
        # [B, H, L, D] contiguous copies, made once outside the timing (SDPA's preferred layout).
        qs, ks, vs = (x.view(b, length, h, -1).transpose(1, 2).contiguous() for x in (q, k, v))
    except Exception as err:  # noqa: BLE001
        return c.failed("sdpa", err, flops=flops)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    note = "[B,H,L,D]; torch picks flash/efficient/cuDNN" if ctx.cuda else "[B,H,L,D]"
    with _fused_sdpa_only(ctx):
        return c.measure(
            [c.item("sdpa", lambda: sdpa(qs, ks, vs, is_causal=True, scale=scale), flops=flops, note=note)]
        )[0]


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
    c = _case(ctx, shape, ci)
    flops = _flops(shape)
    if "flex" in ctx.skip:
        return [c.skip("flex", "--skip flex")]
    if ctx.over_budget():
        return [c.skip("flex", f"time budget ({ctx.budget_s:.0f} s) spent")]
    if shape.equal:
        # Flex's set-up costs seconds per shape eagerly on the CPU and a torch.compile per shape on a GPU (minutes
        # each on the H200 after the JAX section: six shapes read as a hang), so it runs on
        # the ragged shape only, the one its document mask is for.
        return [c.skip("flex", "run on the ragged shape only (a compile per shape)")]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as err:  # noqa: BLE001
        return [c.skip("flex", "flex_attention unavailable", err)]
    h, t, dims = shape.heads, shape.tokens, shape.dims
    g = ctx.generator(ci)
    try:
        # [1, H, T, D]: the packed batch as one sequence; the mask keeps each document causal and to itself.
        q, k, v = (
            ctx.randn(t, h, d, gen=g).transpose(0, 1).unsqueeze(0).contiguous()
            for d in (dims.head_dim_qk, dims.head_dim_qk, dims.head_dim_vo)
        )
        doc = torch.repeat_interleave(
            torch.arange(len(shape.lens), device=ctx.device), torch.tensor(shape.lens, device=ctx.device)
        )

        def doc_causal(b: Any, hh: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mask = create_block_mask(doc_causal, None, None, t, t, device=str(ctx.device), _compile=ctx.cuda)
        fn = _compiled_flex(ctx, flex_attention)
        scale = dims.softmax_scale
    except Exception as err:  # noqa: BLE001
        return [c.failed("flex", err, flops=flops)]
    note = (
        "torch.compile'd" if ctx.cuda else "eager (unfused; CPU quick mode)"
    ) + f", mask sparsity {mask.sparsity():.0f}%"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return c.measure([c.item("flex", lambda: fn(q, k, v, block_mask=mask, scale=scale), flops=flops, note=note)])


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
    c = _case(ctx, shape, ci)
    flops = _flops(shape)
    if "torch" in ctx.skip:
        return [c.skip("torch", "--skip torch")]
    if not ctx.cuda or ctx.backend == "torch":  # mla_bridge's own row runs this very call: not drawn twice
        return [c.skip("torch", "the same call as mla_bridge's row (its plan runs the torch backend)", applies=False)]
    work = sum(causal_pairs(n, n) for n in shape.lens) * shape.heads
    if ctx.cuda and not ctx.quick and work > TORCH_BACKEND_MAX_WORK:
        return [c.skip("torch", "slow reference: run only on shapes up to 1x10000 at 16 heads", flops=flops)]
    if ctx.over_budget():
        return [c.skip("torch", f"time budget ({ctx.budget_s:.0f} s) spent")]
    q, k, v = _tensors(ctx, shape, ci)
    try:
        plan = _plan(ctx, shape, "torch")
    except Exception as err:  # noqa: BLE001
        return [c.skip("torch", "plan failed", err)]
    # The reference is slow on big shapes: fewer repeats there.
    repeats = ctx.repeats if ctx.quick or not ctx.cuda else min(ctx.repeats, 3)
    item = c.item("torch", lambda: plan.run(q, k, v), flops=flops, note="blockwise float32 reference")
    return c.measure([item], repeats=repeats, warmup=1)


def jobs(ctx: Ctx) -> list[Job]:
    shapes = main_shapes(ctx.quick)
    out = [Job(SECTION, f"main {s.name}", partial(_core_and_raw, shape=s, ci=i)) for i, s in enumerate(shapes)]
    # Slow peers last, inside the time budget: flex_attention compiles once per shape.
    for i, s in enumerate(shapes):
        out.append(Job(SECTION, f"main {s.name}: flex_attention", partial(_flex, shape=s, ci=i), optional=True))
        out.append(Job(SECTION, f"main {s.name}: torch backend", partial(_torch_backend, shape=s, ci=i), optional=True))
    return out
