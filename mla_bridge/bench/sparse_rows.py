"""Sparse rows of section 2: DeepSeek Sparse Attention (``mla_prefill(..., topk_indices=)`` over a plan built with
``index_topk``) beside dense ``mla_prefill`` on the same batch, whose context is longer than ``index_topk``.

Each case (:func:`mla_bridge.bench.cases.sparse_cases`) draws random valid causal picks
(:func:`mla_bridge.indexer.random_topk_indices`: ``min(K, position + 1)`` distinct keys per new token) and times,
interleaved: the sparse pass, the same with an FP8 cache, the reference lightning indexer
(:func:`mla_bridge.indexer.indexer_topk`, DeepSeek-V3.2's shape, random weights and inputs) followed by the sparse pass
over its picks (cases up to :data:`CHECK_MAX_TOKENS` tokens per sequence), and dense ``mla_prefill`` (the default
schedule) over the same inputs (at most :data:`SPARSE_REPEATS` rounds). The sparse rows' FLOPs are the sparse attention's, ``2 x selected pairs x heads x (kv_lora_rank +
qk_rope_head_dim + kv_lora_rank)`` (the absorption GEMMs, ``q_nope`` through ``W_UK`` and the output through
``W_UV``, run inside the timed call but are not counted); the indexer row's, those plus the indexer's projections
and scores (:func:`indexer_flops`); the dense row's, the causal attention and the up-projection
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
from ..indexer import DEEPSEEK_V32_INDEXER, indexer_topk, random_indexer_weights, random_topk_indices, rope_cos_sin
from ..plan import PrefillPlan
from ..prefill import mla_prefill
from ..reference import TOLERANCE, max_abs_error, max_excess_error, reference_sparse_request
from ..workspace import Workspace
from .cases import SparseCase, sparse_cases
from .common import Case, Ctx, Job, Row, Variant, attention_flops, gemm_flops, variants
from .context import Inputs, make_inputs

__all__ = ["jobs", "VARIANTS", "CHECK_MAX_TOKENS", "SPARSE_TFLOPS_TARGET", "FP8_TARGET", "indexer_flops"]

SECTION = "context"
VARIANTS = variants(
    Variant("sparse", "sparse mla_prefill (topk_indices, absorbed form)", 0),
    Variant("sparse fp8", "sparse mla_prefill, FP8 cache", 1),
    Variant("indexer", "reference indexer + sparse mla_prefill", 1.5),
    Variant("dense", "dense mla_prefill on the same batch", 2),
)
#: The float64 check and the reference indexer's row run on cases whose sequences hold at most this many tokens
#: (context + new): the reference holds ``S x H x (qk_nope_head_dim + v_head_dim)`` float64 values, the indexer
#: ``3 x 1024 x 64 x S`` float32 scores.
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


def indexer_flops(query_lens: list[int], context_lens: list[int], shape: dict) -> float:
    """FLOPs of :func:`mla_bridge.indexer.indexer_topk` over these requests (``shape`` as
    :data:`mla_bridge.indexer.DEEPSEEK_V32_INDEXER`): per request of ``n`` new tokens in ``S``, the key projection of
    all ``S`` tokens, the new tokens' query and head-weight projections, and their scores against every key (masked
    after the product) with the heads' weighted sum."""
    h, dh, ql, hid = (shape[k] for k in ("index_n_heads", "index_head_dim", "q_lora_rank", "hidden_size"))
    total = 0
    for n, c in zip(query_lens, context_lens):
        s = n + c
        total += 2 * s * hid * dh + 2 * n * (ql * h * dh + hid * h) + 2 * n * h * s * (dh + 1) if n else 0
    return float(total)


def _indexer_item(c: Case, x: Inputs, k: int, ci: int, sparse_layer: Any, flops: float) -> Any:
    """The reference indexer then the sparse pass over its picks, as a ``measure_many`` item (random indexer weights
    and inputs made once, outside the timing), or a skipped row."""
    ctx, d, shape = c.ctx, x.dims, DEEPSEEK_V32_INDEXER
    longest = max((q + cc for q, cc in zip(x.q_lens, x.c_lens)), default=0)
    if longest > CHECK_MAX_TOKENS:
        why = f"run on sequences up to {CHECK_MAX_TOKENS} tokens (the indexer's scores of 1024 queries over all keys)"
        return c.skip("indexer", why)
    try:
        g = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 7000 + ci)
        weights = random_indexer_weights(d.qk_rope_head_dim, generator=g, dtype=ctx.dtype)
        seqs = [q + cc for q, cc in zip(x.q_lens, x.c_lens)]
        hidden = [ctx.randn(s, shape["hidden_size"], gen=g) for s in seqs]
        q_resid = [ctx.randn(s, shape["q_lora_rank"], gen=g) for s in seqs]
        pes = [rope_cos_sin(s, d.qk_rope_head_dim, dtype=ctx.dtype, device=ctx.device) for s in seqs]
    except Exception as err:  # noqa: BLE001
        return c.failed("indexer", err)

    def layer() -> Any:
        return sparse_layer(topk_indices=indexer_topk(weights, hidden, q_resid, pes, x.c_lens, k))

    total = flops + indexer_flops(x.q_lens, x.c_lens, shape)
    note = f"indexer {shape['index_n_heads']} heads x {shape['index_head_dim']} (DeepSeek-V3.2's), random weights"
    return c.item("indexer", layer, flops=total, note=note)


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
        kw.setdefault("topk_indices", indices)
        return mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, cache, x.block_table, p, kv_cache_scale=scale, **kw)

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
    indexed = _indexer_item(c, x, k, ci, partial(sparse_layer, x.kv_cache, plan), flops)
    (skipped if isinstance(indexed, Row) else items).append(indexed)
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
    for row in (sparse, by.get(VARIANTS["indexer"].label)):
        if row is not None and row.status == "ok" and dense_row is not None and dense_row.status == "ok":
            speedup = dense_row.ms / row.ms  # type: ignore[operator]  # ok rows have their ms
            row.extra["vs_dense"] = speedup
            row.note += f"; {speedup:.2f}x " + ("faster than dense" if speedup >= 1 else "the dense speed")
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
