"""Sparse rows of section 2: DeepSeek Sparse Attention (``mla_prefill(..., topk_indices=)`` over a plan built with
``index_topk``) beside dense ``mla_prefill`` on the same batch, whose context is longer than ``index_topk``.

Each case (:func:`mla_bridge.bench.cases.sparse_cases`) draws random valid causal picks
(:func:`mla_bridge.indexer.random_topk_indices`: ``min(K, position + 1)`` distinct keys per new token) and times,
interleaved: the sparse pass, the same with an FP8 cache, and dense ``mla_prefill`` (the default schedule) over the
same inputs (at most :data:`SPARSE_REPEATS` rounds). The sparse rows' FLOPs are the sparse attention's, ``2 x selected pairs x heads x (kv_lora_rank +
qk_rope_head_dim + kv_lora_rank)`` (the absorption GEMMs, ``q_nope`` through ``W_UK`` and the output through
``W_UV``, run inside the timed call but are not counted); the dense row's, the causal attention and the up-projection
GEMM as in the other context rows. ``vs_dense`` (dense ms / sparse ms) on the sparse row: above 1 the sparse pass is
faster; the crossover lies between the cases where it crosses 1.

The sparse output is checked against :func:`mla_bridge.reference.reference_sparse_request` (float64 over the same
picks, the MHA form) within :data:`mla_bridge.reference.TOLERANCE` of the run's dtype, on every request of a case
whose sequences are at most :data:`CHECK_MAX_TOKENS` long (the float64 reference holds ``S x H x (qk_nope_head_dim +
v_head_dim)`` up-projected values): ``extra["check"]`` of the sparse row.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..cache import quantize_latent_cache
from ..indexer import random_topk_indices
from ..plan import PrefillPlan
from ..prefill import mla_prefill
from ..reference import TOLERANCE, max_abs_error, max_excess_error, reference_sparse_request
from ..workspace import Workspace
from .cases import SparseCase, sparse_cases
from .common import Case, Ctx, Job, Row, Variant, attention_flops, gemm_flops, variants
from .context import Inputs, make_inputs

__all__ = ["jobs", "VARIANTS", "CHECK_MAX_TOKENS", "SPARSE_TFLOPS_TARGET", "FP8_TARGET"]

SECTION = "context"
VARIANTS = variants(
    Variant("sparse", "sparse mla_prefill (topk_indices, absorbed form)", 0),
    Variant("sparse fp8", "sparse mla_prefill, FP8 cache", 1),
    Variant("dense", "dense mla_prefill on the same batch", 2),
)
#: The float64 check runs on cases whose sequences hold at most this many tokens (context + new).
CHECK_MAX_TOKENS = 20000
#: The sparse attention's throughput target at 128 heads, K = 2048, 16384 tokens of context and more (TFLOP/s).
SPARSE_TFLOPS_TARGET = 400.0
#: The FP8 cache's sparse pass against the bf16 cache's, same run.
FP8_TARGET = 1.05
#: Timed rounds per case at most (the paths are interleaved, so their ratios hold with few): the torch path of the
#: sparse pass takes a large share of a GPU run's time budget at 128 heads and K 2048.
SPARSE_REPEATS = 5
#: Case order after the dense context cases (whose ``ci`` are 10 x case + budget).
FIRST_CI = 200


def _sparse_check(ctx: Ctx, x: Inputs, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> dict:
    """The sparse output of every request against the float64 sparse reference over the same picks."""
    (tol_out, tol_lse) = TOLERANCE[str(ctx.dtype).replace("torch.", "")]
    err_out = err_lse = 0.0
    excess_out = excess_lse = float("-inf")
    row = 0
    for r, (n, c) in enumerate(zip(x.q_lens, x.c_lens)):
        a, b = row, row + n
        row = b
        ref_out, ref_lse = reference_sparse_request(
            x.q[a:b], x.kv_c[a:b], x.k_pe[a:b], x.w, x.kv_cache, x.block_table[r], c, x.dims, indices[a:b]
        )
        err_out = max(err_out, max_abs_error(out[a:b], ref_out))
        err_lse = max(err_lse, max_abs_error(lse[a:b], ref_lse))
        excess_out = max(excess_out, max_excess_error(out[a:b], ref_out, tol_out[1]))
        excess_lse = max(excess_lse, max_excess_error(lse[a:b], ref_lse, tol_lse[1]))
    passed = excess_out <= tol_out[0] and excess_lse <= tol_lse[0]  # False where NaN appeared
    return {
        "reference": "mla_bridge.reference.reference_sparse_request (float64, the same picks)",
        "max_abs_err_out": err_out,
        "max_abs_err_lse": err_lse,
        "tolerance_out": {"atol": tol_out[0], "rtol": tol_out[1]},
        "tolerance_lse": {"atol": tol_lse[0], "rtol": tol_lse[1]},
        "beyond_tolerance": max(excess_out - tol_out[0], excess_lse - tol_lse[0]),
        "passed": passed,
    }


def _case_job(ctx: Ctx, case: SparseCase, ci: int) -> list[Row]:
    x = make_inputs(ctx, case.as_context_case(), ci)
    d, k = x.dims, case.index_topk
    seq = x.num_context + x.num_tokens
    c = Case(ctx, SECTION, case.name, VARIANTS, ci, dict(seq_len=seq, heads=case.heads))
    ws = Workspace(ctx.device)
    build: dict[str, Any] = dict(dims=d, workspace=ws, block_size=case.block_size, dtype=ctx.dtype)
    kv_lens = [cc + q for cc, q in zip(x.c_lens, x.q_lens)]
    dense_flops = attention_flops(
        x.q_lens, kv_lens, causal=True, heads=d.num_heads, head_dim_sum=d.head_dim_qk + d.head_dim_vo
    ) + gemm_flops(seq, d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim))
    try:
        indices = random_topk_indices(x.q_lens, x.c_lens, k, generator=ctx.generator(5000 + ci))
        pairs = int((indices >= 0).sum())
        plan = PrefillPlan.build(x.q_lens, x.c_lens, index_topk=k, **build)
    except Exception as err:  # noqa: BLE001
        return [c.failed("sparse", err, "plan failed")]
    flops = 2.0 * pairs * d.num_heads * (2 * d.kv_lora_rank + d.qk_rope_head_dim)
    causal = sum(q * cc + q * (q + 1) // 2 for q, cc in zip(x.q_lens, x.c_lens))
    facts = dict(index_topk=k, selected_pairs=pairs, causal_pairs=causal, indices="random valid causal picks")

    def sparse_layer(cache: torch.Tensor, p: PrefillPlan, scale: Any = None, **kw: Any) -> Any:
        return mla_prefill(
            x.q, x.kv_c, x.k_pe, x.wp, cache, x.block_table, p, kv_cache_scale=scale, topk_indices=indices, **kw
        )

    note = f"K {k}: {pairs} selected pairs ({pairs / causal:.1%} of the causal ones)"
    items = [c.item("sparse", partial(sparse_layer, x.kv_cache, plan), flops=flops, note=note, extra=dict(facts))]
    skipped: list[Row] = []
    fp8_err = None
    try:
        cache8, scale = quantize_latent_cache(x.kv_cache)
        plan8 = PrefillPlan.build(x.q_lens, x.c_lens, index_topk=k, kv_cache_dtype="fp8", **build)
        base = sparse_layer(x.kv_cache, plan).float()
        fp8_err = float((sparse_layer(cache8, plan8, scale).float() - base).abs().max() / base.abs().max())
        note8 = f"fp8_e4m3 cache; max |out - out(unquantized cache)| / max |out| = {fp8_err:.2e}"
        items.append(c.item("sparse fp8", partial(sparse_layer, cache8, plan8, scale), flops=flops, note=note8))
    except Exception as err:  # noqa: BLE001
        skipped.append(c.failed("sparse fp8", err))
    try:
        dense = PrefillPlan.build(x.q_lens, x.c_lens, backend=ctx.backend, **build)
        sched = "fused (one causal pass)" if dense.fused else f"{len(dense.chunks)} chunk(s)"
        run = partial(mla_prefill, x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, dense)
        items.append(c.item("dense", run, flops=dense_flops, note=f"{sched}, {dense.backend.name}"))
    except Exception as err:  # noqa: BLE001
        skipped.append(c.failed("dense", err, "plan failed"))
    rows = c.measure(items, repeats=min(ctx.repeats, SPARSE_REPEATS), warmup=min(ctx.warmup, 1)) + skipped
    by = {r.path: r for r in rows}
    sparse, fp8, dense_row = (by.get(VARIANTS[v].label) for v in ("sparse", "sparse fp8", "dense"))
    name = f"context sparse {case.name}"
    if sparse is None or sparse.status != "ok":
        ctx.check(f"{name}: sparse mla_prefill within the float64 tolerance", None, "<=", 0.0, "not measured")
        return rows
    if dense_row is not None and dense_row.status == "ok":
        speedup = dense_row.ms / sparse.ms  # type: ignore[operator]  # ok rows have their ms
        sparse.extra["vs_dense"] = speedup
        sparse.note += f"; {speedup:.2f}x " + ("faster than dense" if speedup >= 1 else "the dense speed")
    if fp8 is not None and fp8.status == "ok":
        ratio = fp8.ms / sparse.ms  # type: ignore[operator]
        fp8.extra.update(vs_bf16_cache=ratio, rel_err_vs_unquantized=fp8_err)
        fp8.note += f"; {ratio:.3f}x the unquantized cache"
        ctx.check(f"{name}: sparse mla_prefill FP8 cache / bf16 cache", ratio, "<=", FP8_TARGET, "same run")
    if case.heads == 128 and k == 2048 and case.context >= 16384:
        what = "FLOPs = 2 x selected pairs x heads x (576 + 512)"
        ctx.check(f"{name}: sparse attention TFLOP/s", sparse.tflops, ">=", SPARSE_TFLOPS_TARGET, what)
    if max(kv_lens, default=0) > CHECK_MAX_TOKENS:
        sparse.extra["check"] = None
        sparse.note += f"; float64 check on cases up to {CHECK_MAX_TOKENS} tokens"
        return rows
    try:
        out, lse = sparse_layer(x.kv_cache, plan, return_lse=True)
        check = _sparse_check(ctx, x, indices, out, lse)
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        sparse.extra["check"] = {"passed": None, "error": f"{type(err).__name__}: {err}"}
        ctx.check(f"{name}: sparse mla_prefill within the float64 tolerance", None, "<=", 0.0, "check failed to run")
        return rows
    sparse.extra["check"] = check
    sparse.note += f"; float64 check {'passed' if check['passed'] else 'FAILED'}"
    ctx.check(
        f"{name}: sparse mla_prefill within the float64 tolerance",
        check["beyond_tolerance"],
        "<=",
        0.0,
        "max error beyond atol + rtol x |ref| (out and lse), every request",
    )
    return rows


def jobs(ctx: Ctx) -> list[Job]:
    return [
        Job(SECTION, f"context sparse {case.name}", partial(_case_job, case=case, ci=FIRST_CI + i))
        for i, case in enumerate(sparse_cases(ctx.quick))
    ]
