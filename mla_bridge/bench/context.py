"""Section 2: the context pass and the full ``mla_prefill`` with prefix-cached context.

For each case and chunk budget: ``mla_prefill`` end to end (with the weight prepared once, the raw weight, the split
k_pe layout, and replayed from a CUDA graph, :mod:`mla_bridge.graphs`); its phases run alone (each started on an idle
device, through ``mla_prefill``'s own ``phase_hook``: gather by block table, up-projection, the attention kernels, the
merge), the bare up-projection GEMM; the hand-written pipeline a user would write without mla_bridge (torch gather by
block table, ``kv_b_proj`` matmul, ``torch.cat`` with k_pe, one FlashInfer fa3 run per chunk (fa2 off SM90),
``flashinfer.merge_state``); one context pass (non-causal, the new tokens over the first context chunk) through
``RaggedPlan.run`` and the raw wrapper; and mla_prefill's phases timed inside the layer by
:mod:`mla_bridge.profiling` (the way the CLI times them), whose sum is checked against the layer's time (within 5%
on a GPU). FP8-cache rows time the same case with its cache quantized, beside the bf16-cache ones.

Every path is a :class:`~mla_bridge.bench.common.Variant` of :data:`VARIANTS`, addressed by name.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch

from .. import switches
from ..cache import gather_impl, gather_latent, quantize_latent_cache
from ..graphs import PrefillLayer, capture_prefill
from ..kv import kv_impl
from ..plan import PrefillPlan, schedule_context_chunks
from ..prefill import mla_prefill, prefill_memory_bytes
from ..profiling import time_phases
from ..ragged import plan_ragged
from ..weights import PreparedKVBProj, prepare_kv_b_proj
from ..workspace import Workspace
from .cases import ContextCase, context_cases
from .common import (
    Case,
    Ctx,
    Job,
    Row,
    Timing,
    Variant,
    attention_flops,
    beside_raw,
    gemm_flops,
    indptr,
    plan_raw,
    variants,
)

__all__ = ["jobs", "VARIANTS", "path", "Inputs", "make_inputs", "handwritten_pipeline", "handwritten_backend"]

SECTION = "context"
_MLA = "mla_prefill, "
#: The paths of a context case. ``args`` of an mla_prefill variant: the weight (an :class:`Inputs` field), the
#: ``kv_impl`` and whether it replays a CUDA graph; ``phase`` of a phase variant: the ``phase_hook`` names it sums.
VARIANTS = variants(
    Variant("eager", "mla_prefill", 0, note="{sched}, {backend}, k/v {kv}, weight prepared once", args=dict(w="wp")),
    Variant(
        "raw weight",
        _MLA + "raw weight (read in place; rearranged per call for cuBLAS passes)",
        0.2,
        note="the checkpoint's kv_b_proj: the fused kernel reads it in place, a cuBLAS pass rearranges it per call",
        args=dict(w="w"),
    ),
    Variant(
        "identity",
        _MLA + "identity layout (one GEMM with an identity block)",
        0.4,
        note="one GEMM of 320 x 576 per head (40% more FLOPs), k_pe by the identity block",
        args=dict(w="wp_identity"),
    ),
    Variant(
        "fused kv",
        _MLA + "fused gather+GEMM kernel (kv_impl='fused')",
        0.5,
        ("cuda", "triton"),
        "one Triton launch per pass: gather + GEMM + k layout",
        dict(w="wp", kv_impl="fused"),
    ),
    Variant(
        "separate kv",
        _MLA + "gather + cuBLAS GEMM on every pass (kv_impl='separate')",
        0.55,
        ("cuda", "triton"),
        "every pass: gather, then cuBLAS",
        dict(w="wp", kv_impl="separate"),
    ),
    Variant("graph", _MLA + "CUDA graph replay", 0.6, args=dict(w="wp", graph="eager")),
    Variant(
        "fused kv graph",
        _MLA + "fused gather+GEMM kernel, CUDA graph replay",
        0.7,
        ("cuda", "triton"),
        args=dict(w="wp", kv_impl="fused", graph="fused kv"),
    ),
    Variant(
        "separate kv graph",
        _MLA + "gather + cuBLAS GEMM on every pass, CUDA graph replay",
        0.75,
        ("cuda", "triton"),
        args=dict(w="wp", kv_impl="separate", graph="separate kv"),
    ),
    Variant(
        "identity graph", _MLA + "identity layout, CUDA graph replay", 0.8, args=dict(w="wp_identity", graph="identity")
    ),
    Variant("chunked", _MLA + "chunked schedule (fuse_context=False)", 1),
    Variant("handwritten", "hand-written pipeline", 2, ("cuda", "flashinfer")),
    Variant("gather", "phase: gather by block_table", 3, args=dict(phase=("gather",))),
    Variant("up-projection", "phase: up-projection (GEMM + k concat)", 4, args=dict(phase=("up-projection",))),
    Variant("gemm", "phase: up-projection GEMM alone", 5),
    Variant("attention", "phase: attention kernels alone", 6, args=dict(phase=("main pass", "context chunk"))),
    Variant("merge", "phase: merge", 7, args=dict(phase=("merge",))),
    Variant("phase sum", "sum of phases alone", 8),
    Variant("attention + gemm", "attention + GEMM alone", 9),
    Variant("context pass", "context pass: RaggedPlan.run", 10),
    Variant("context pass raw", "context pass: raw FlashInfer wrapper.run", 11, ("cuda", "flashinfer")),
    *(
        Variant(f"in layer: {p}", f"in mla_prefill: {p}", 12 + i)
        for i, p in enumerate(("gather", "up-projection", "main pass", "context chunk", "merge", "sum of phases"))
    ),
    Variant("fp8", _MLA + "FP8 cache", 22),
    Variant("fp8 gather", "phase: gather by block_table, FP8 cache", 23),
    Variant("torch gather", "phase: gather by block_table, torch gather", 24),
    Variant("fp8 torch gather", "phase: gather by block_table, FP8 cache, torch gather", 25),
)
#: mla_prefill's variants timed end to end (in table order), and the graph of each eager one.
LAYER = [v for v in VARIANTS.values() if "w" in v.args]
#: mla_prefill's own phases (the phase_hook names), timed inside the layer by mla_bridge.profiling (as the CLI does).
IN_LAYER_PHASES = ("gather", "up-projection", "main pass", "context chunk", "merge")
PHASE_SUM_TOLERANCE = 0.05  # the in-layer phases add up to the layer's time within 5%
#: FP8-cache rows: the same case with its cache quantized (mla_bridge.cache.quantize_latent_cache);
#: the ratio to the bf16-cache row of the same run is the target (<= 1.02).
FP8_TARGET = 1.02
#: Targets on the four long context cases (mla_prefill / (attention + GEMM alone)), and of the host-bound
#: cases against their eager figure before it (``ContextCase.eager_ms_before``).
EAGER_TARGET, GRAPHED_TARGET, GRAPHED_SPEEDUP = 1.12, 1.05, 2.5


def path(name: str) -> str:
    """The JSON ``path`` of the context variant ``name``."""
    return VARIANTS[name].label


@dataclass
class Inputs:
    """One layer's inputs for a context case (random bf16 on the GPU, float32 on the CPU); ``wp`` / ``wp_identity``:
    the weight prepared once (default split / identity layout), as a user prepares it at load time."""

    case: ContextCase
    dims: Any
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    wp: PreparedKVBProj
    wp_identity: PreparedKVBProj

    @property
    def q_lens(self) -> list[int]:
        return [self.case.new] * self.case.batch

    @property
    def c_lens(self) -> list[int]:
        return [self.case.context] * self.case.batch

    @property
    def num_tokens(self) -> int:
        return self.case.new * self.case.batch

    @property
    def num_context(self) -> int:
        return self.case.context * self.case.batch

    def flops(self) -> tuple[float, float]:
        """(attention FLOPs, up-projection GEMM FLOPs) of one mla_prefill over this batch."""
        d = self.dims
        attn = attention_flops(
            self.q_lens,
            [c + q for c, q in zip(self.c_lens, self.q_lens)],
            causal=True,
            heads=d.num_heads,
            head_dim_sum=d.head_dim_qk + d.head_dim_vo,
        )
        gemm = gemm_flops(
            self.num_context + self.num_tokens, d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim)
        )
        return attn, gemm


def make_inputs(ctx: Ctx, case: ContextCase, salt: int) -> Inputs:
    dims = case.dims
    heads = dims.num_heads
    g = ctx.generator(1000 + salt)
    t = case.batch * case.new
    bs = case.block_size
    per_req = math.ceil(case.context / bs)
    num_blocks = case.batch * per_req + 1
    q = ctx.randn(t, heads, dims.head_dim_qk, gen=g)
    kv_c = ctx.randn(t, dims.kv_lora_rank, gen=g)
    k_pe = ctx.randn(t, dims.qk_rope_head_dim, gen=g)
    w = ctx.randn(dims.kv_b_proj_shape[0], dims.kv_lora_rank, gen=g, scale=dims.kv_lora_rank**-0.5)
    kv_cache = ctx.randn(num_blocks, bs, dims.latent_dim, gen=g)
    cpu_gen = torch.Generator().manual_seed(ctx.seed + salt)
    perm = torch.randperm(num_blocks, generator=cpu_gen)[: case.batch * per_req]  # scattered pages
    block_table = perm.view(case.batch, per_req).to(torch.int32).to(ctx.device)
    return Inputs(
        case,
        dims,
        q,
        kv_c,
        k_pe,
        w,
        kv_cache,
        block_table,
        prepare_kv_b_proj(w, dims),
        prepare_kv_b_proj(w, dims, layout="identity"),
    )


def handwritten_backend(ctx: Ctx) -> str:
    """fa3 on SM90, fa2 elsewhere (what a user of FlashInfer would pick by hand)."""
    from flashinfer.utils import is_sm90a_supported

    return "fa3" if is_sm90a_supported(ctx.device) else "fa2"


def merge_state_threads(heads: int, head_dim: int, element_size: int) -> int:
    """Threads per block of FlashInfer 0.7.4's ``merge_state``: ``head_dim / vec`` per head, all heads in one block.
    Above 1024 its launch fails ("invalid argument": bf16 at 128 heads of 128, or 64 heads of 256)."""
    return heads * (head_dim // max(16 // element_size, head_dim // 32))


def _torch_merge(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor, s_b: torch.Tensor):
    """The merge of two partials with base-2 LSEs (``out [T, H, D]``, ``lse [T, H]`` float32) in torch ops, as a user
    writes it where ``flashinfer.merge_state`` cannot launch: weights ``2^(s - max)``, float32, one rounding."""
    m = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp2(s_a - m), torch.exp2(s_b - m)
    total = w_a + w_b
    out = (o_a.float() * (w_a / total)[..., None] + o_b.float() * (w_b / total)[..., None]).to(o_a.dtype)
    return out, m + torch.log2(total)


def handwritten_merges_in_flashinfer(x: Inputs) -> bool:
    """Whether the hand-written pipeline of ``x`` merges with ``flashinfer.merge_state`` (else torch ops: it
    cannot launch at these dims, :func:`merge_state_threads`)."""
    return merge_state_threads(x.dims.num_heads, x.dims.head_dim_vo, x.q.element_size()) <= 1024


def handwritten_pipeline(ctx: Ctx, x: Inputs, chunk_tokens: int) -> Callable[[], torch.Tensor]:
    """The pipeline without mla_bridge, planned once per batch (host metadata and one wrapper per pass) and
    returned as a per-layer function: torch gather by block table, ``kv_b_proj`` matmul, ``torch.cat`` with k_pe,
    a FlashInfer run per chunk, ``flashinfer.merge_state`` (base-2 LSE throughout; torch ops where it cannot launch,
    :func:`merge_state_threads`)."""
    import flashinfer

    d, bs, h = x.dims, x.case.block_size, x.dims.num_heads
    merge = flashinfer.merge_state if handwritten_merges_in_flashinfer(x) else _torch_merge
    fb = handwritten_backend(ctx)
    nope, rank = d.qk_nope_head_dim, d.kv_lora_rank
    qo = indptr(x.q_lens)
    main = ctx.raw_wrapper(fb, 0)
    dims_kw = dict(head_dim_qk=d.head_dim_qk, head_dim_vo=d.head_dim_vo)
    plan_raw(main, qo, qo, heads=h, causal=True, sm_scale=d.softmax_scale, dtype=ctx.dtype, **dims_kw)
    chunks = []
    for i, spans in enumerate(schedule_context_chunks(x.c_lens, chunk_tokens)):
        r0, r1 = spans[0][0], spans[-1][0] + 1
        kv_lens = [0] * (r1 - r0)
        for r, s, e in spans:
            kv_lens[r - r0] = e - s
        q0, q1 = int(qo[r0]), int(qo[r1])
        wrapper = ctx.raw_wrapper(fb, i + 1)
        plan_raw(
            wrapper,
            qo[r0 : r1 + 1] - q0,
            indptr(kv_lens),
            heads=h,
            causal=False,
            sm_scale=d.softmax_scale,
            dtype=ctx.dtype,
            **dims_kw,
        )
        req_ids = torch.cat([torch.full((e - s,), r, dtype=torch.int64) for r, s, e in spans]).to(ctx.device)
        pos = torch.cat([torch.arange(s, e, dtype=torch.int64) for _, s, e in spans]).to(ctx.device)
        chunks.append((wrapper, q0, q1, req_ids, pos))
    t = x.num_tokens
    cache = x.kv_cache.view(-1, d.latent_dim)

    def up(kv_c: torch.Tensor, k_pe: torch.Tensor):
        kv = torch.matmul(kv_c, x.w.t()).view(kv_c.shape[0], h, nope + d.v_head_dim)
        k_nope, v = kv.split([nope, d.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)], dim=-1)
        return k, v

    def layer() -> torch.Tensor:
        k, v = up(x.kv_c, x.k_pe)
        out, lse = main.run(x.q, k, v, return_lse=True)
        for wrapper, q0, q1, req_ids, pos in chunks:
            slots = x.block_table[req_ids, pos // bs].long() * bs + pos % bs
            latent = cache[slots]
            k, v = up(latent[:, :rank], latent[:, rank:])
            c_out, c_lse = wrapper.run(x.q[q0:q1], k, v, return_lse=True)
            if q0 == 0 and q1 == t:
                out, lse = merge(out, lse, c_out, c_lse)
            else:
                m_out, m_lse = merge(out[q0:q1], lse[q0:q1], c_out, c_lse)
                out[q0:q1] = m_out
                lse[q0:q1] = m_lse
        return out

    return layer


@contextlib.contextmanager
def _gather_forced(impl: Optional[str]) -> Iterator[None]:
    """``MLA_BRIDGE_GATHER`` set to ``impl`` while the block runs (None: unchanged), so that ``mla_prefill``'s own
    gather runs the torch fallback beside its default."""
    old = os.environ.get(switches.GATHER)
    if impl is not None:
        os.environ[switches.GATHER] = impl
    try:
        yield
    finally:
        if impl is not None:
            if old is None:
                os.environ.pop(switches.GATHER, None)
            else:
                os.environ[switches.GATHER] = old


def _layer(x: Inputs, plan: PrefillPlan, cache=None, scale=None, **kw: Any) -> Callable[..., torch.Tensor]:
    """``mla_prefill`` of this case as a function of its keyword arguments (``phase_hook``, ``kv_impl``, ...)."""
    cache = x.kv_cache if cache is None else cache
    return lambda **more: mla_prefill(
        x.q, x.kv_c, x.k_pe, more.pop("w", x.wp), cache, x.block_table, plan, kv_cache_scale=scale, **kw, **more
    )


def _case_job(ctx: Ctx, case: ContextCase, bi: int, ci: int) -> list[Row]:
    label, budget = case.budgets[bi]
    name = f"{case.name}, {label}"
    x = make_inputs(ctx, case, ci)
    attn_flops, up_flops = x.flops()
    flops = attn_flops + up_flops
    seq = x.num_context + x.num_tokens

    c = Case(ctx, SECTION, name, VARIANTS, ci, dict(seq_len=seq, heads=case.heads))
    meta, skip = c.meta, c.skip
    ws = Workspace(ctx.device, chunk_tokens=budget)
    build = dict(dims=x.dims, workspace=ws, block_size=case.block_size, dtype=ctx.dtype, backend=ctx.backend)
    try:
        plan = PrefillPlan.build(x.q_lens, x.c_lens, **build)  # type: ignore[arg-type]
    except Exception as err:  # noqa: BLE001
        return [c.failed("eager", err, "plan failed")]
    run = _layer(x, plan)
    sched = "fused (one causal pass)" if plan.fused else f"{len(plan.chunks)} chunk(s)"
    extra = {"chunk_tokens": budget, "fused": plan.fused, "chunks": len(plan.chunks), "backend": plan.backend.name}
    fmt = dict(sched=sched, backend=plan.backend.name, kv=kv_impl(ctx.device))
    # Every path of this case is timed interleaved, so that the ratios below hold on a noisy machine.
    items: list = []
    skipped: list[Row] = []
    graphs = []
    for v in LAYER:
        why = v.missing(ctx)
        if why:
            skipped.append(skip(v.name, why, applies=False))
            continue
        kw = dict(w=getattr(x, v.args["w"]), kv_impl=v.args.get("kv_impl"))
        keywords = dict(flops=flops, note=v.note.format(**fmt), **meta(v.name))
        if v.name == "eager":
            keywords["extra"] = dict(extra)
        if "graph" not in v.args:
            items.append((v.label, lambda kw=kw: run(**kw), keywords))
            continue
        graph_item, graph = _graph_item(c, x, plan, v, flops)
        (skipped if graph is None else items).append(graph_item)
        graphs.append(graph)
    if plan.fused:
        try:
            plan2 = PrefillPlan.build(x.q_lens, x.c_lens, fuse_context=False, **build)  # type: ignore[arg-type]
            note = f"main pass + {len(plan2.chunks)} chunk(s) + merge"
            items.append((path("chunked"), _layer(x, plan2), dict(flops=flops, note=note, **meta("chunked"))))
        except Exception as err:  # noqa: BLE001
            skipped.append(c.failed("chunked", err))
    hand = _handwritten_item(c, x, budget, flops)
    (skipped if isinstance(hand, Row) else items).append(hand)
    if case.context:
        rank = x.dims.kv_lora_rank
        sizes = [int(plan.main_kv_indptr[-1])] if plan.fused else [x.num_tokens] + [ch.num_tokens for ch in plan.chunks]
        g = ctx.generator(3000 + ci)
        latents = [ctx.randn(n, rank, gen=g) for n in sizes]
        # the bare kv_b_proj GEMM (kv_c @ W.T) of each pass: the up-projection's inherent work, the stricter yardstick
        gemm = lambda: [torch.matmul(lat, x.w.t()) for lat in latents]  # noqa: E731
        items.append((path("gemm"), gemm, dict(flops=up_flops, **meta("gemm"))))
    fp8 = _fp8_setup(c, x, plan, run)
    if fp8.get("run") is not None:
        note = f"fp8_e4m3 cache, {gather_impl(ctx.device)} gather"
        fp8_extra = dict(extra, kv_cache_scale=float(fp8["scale"]))
        items.append((path("fp8"), fp8["run"], dict(flops=flops, note=note, extra=fp8_extra, **meta("fp8"))))
    rows = c.measure(items) + skipped + fp8["skipped"]
    for graph in graphs:
        if graph is not None:
            graph.release()  # its private pool goes back before the next case
    if case.context:
        rows += _phase_rows(c, x, plan, fp8)
    by_path = {r.path: r for r in rows}
    rows += _summary_rows(c, case, bi, by_path, flops)
    rows += _in_layer_rows(c, x, plan, by_path[path("eager")])
    _fp8_summary(ctx, name, {r.path: r for r in rows}, fp8)
    if case.context:
        rows += _context_pass_rows(c, x, budget, ws)
    return rows


def _gather_bytes(x: Inputs, plan: PrefillPlan, cache_e: int) -> int:
    """Bytes the separate path's gathers of one layer move (:mod:`mla_bridge.kv`): every context row read from the
    cache (``cache_e`` bytes an element) and written in the compute dtype; on the fused schedule the new tokens' rows
    too, read and written (the chunked schedule's pass of new tokens gathers nothing)."""
    d, e, rows = x.dims, x.q.element_size(), plan.num_gathered_context_tokens
    return rows * d.latent_dim * (cache_e + e) + (2 * x.num_tokens * d.latent_dim * e if plan.fused else 0)


def _phase_rows(c: Case, x: Inputs, plan: PrefillPlan, fp8: dict) -> list[Row]:
    """mla_prefill's phases, each run alone (:meth:`Ctx.phases_alone`, through its ``phase_hook``), with the separate
    k/v path so that the gather is a phase of its own: the default gather and the torch one, on the bf16 and the FP8
    cache. Bytes of a gather: context rows read (in the cache's dtype) and written, new rows read and written."""
    ctx, e, skip = c.ctx, x.q.element_size(), c.skip
    attn, up = x.flops()

    gathered, gathered_fp8 = _gather_bytes(x, plan, e), _gather_bytes(x, plan, 1)
    work: dict[str, dict[str, Any]] = {
        "gather": dict(nbytes=gathered, note=f"{gather_impl(ctx.device)} gather; latent rows read + written"),
        "up-projection": dict(flops=up),
        "attention": dict(flops=attn),
        "merge": dict(nbytes=merge_phase_bytes(plan, e), note="mla_prefill's merges"),
        "fp8 gather": dict(nbytes=gathered_fp8, note="fp8 rows read, dequantized rows written"),
        "torch gather": dict(nbytes=gathered, note="the torch fallback"),
        "fp8 torch gather": dict(nbytes=gathered_fp8, note="the torch fallback"),
    }
    runs: list[tuple[str, Callable, Optional[str]]] = [("", _separate(_layer(x, plan)), None)]
    if fp8.get("layer") is not None:
        runs.append(("fp8 ", _separate(fp8["layer"]), None))
    rows: list[Row] = []
    if gather_impl(ctx.device) != "torch":
        runs += [(prefix + "torch ", fn, "torch") for prefix, fn, _ in runs]
    else:
        why = "the gather above is the torch one here"
        rows += [skip(p + "torch gather", why, applies=False) for p, _, _ in runs]
    for prefix, layer, impl in runs:
        names = ("gather", "up-projection", "attention", "merge") if not prefix else ("gather",)
        try:
            with _gather_forced(impl):
                times = ctx.phases_alone(layer)
        except Exception as err:  # noqa: BLE001
            rows.append(c.failed(prefix + "gather", err, "phases failed"))
            continue
        for v in names:
            phases = VARIANTS[v].args["phase"]
            key = prefix + v
            if not any(p in times for p in phases):
                rows.append(skip(key, "fused schedule: one pass, nothing to merge"))
                continue
            timing = _summed([times[p] for p in phases if p in times])
            rows.append(ctx.row(SECTION, c.name, path(key), timing, **work[key], **c.meta(key)))
    return rows


def _separate(layer: Callable[..., torch.Tensor]) -> Callable[[Callable[[str], None]], Any]:
    """A layer of the separate k/v path (its gather a phase of its own) as ``phase_hook -> out``."""
    return lambda hook: layer(phase_hook=hook, kv_impl="separate")


def _summed(timings: list[Timing]) -> Timing:
    """Phases reported together (the main pass and the context chunks): their samples added per layer."""
    if len(timings) == 1:
        return timings[0]
    samples = [round(sum(s), 6) for s in zip(*(t.samples for t in timings))]
    gpu = None if timings[0].gpu_ms is None else sum(t.gpu_ms or 0.0 for t in timings)
    return Timing(statistics.median(samples), sum(t.host_ms for t in timings), samples, timings[0].repeats, gpu)


def _graph_item(c: Case, x: Inputs, plan: PrefillPlan, v: Variant, flops: float):
    """``(item, graph)``: mla_prefill of this layer (``v``'s weight and kv_impl) captured in a CUDA graph
    (:func:`mla_bridge.graphs.capture_prefill`) as a ``measure_many`` item, with the capture time and the graph's
    memory in ``extra``; or ``(skipped row, None)``. On the CPU the same API runs eagerly."""
    layer = PrefillLayer(x.q, x.kv_c, x.k_pe, getattr(x, v.args["w"]), x.kv_cache)
    try:
        graph = capture_prefill(plan, [layer], x.block_table, kv_impl=v.args.get("kv_impl"))
    except Exception as err:  # noqa: BLE001
        return c.failed(v.name, err, "capture failed"), None
    note = (
        f"captured in {graph.capture_ms:.1f} ms (+ {graph.warmup_ms:.1f} ms warm-up), graph pool "
        f"{graph.memory_bytes / 2**20:.1f} MiB"
        if graph.graphed
        else "CPU: the same API, run eagerly"
    )
    extra = {
        "graphed": graph.graphed,
        "capture_ms": graph.capture_ms,
        "warmup_ms": graph.warmup_ms,
        "graph_memory_bytes": graph.memory_bytes,
    }
    # a CUDA graph row applies where a graph was captured: on the CPU the same API runs eagerly, a row kept in the JSON
    # (the API is exercised) but not printed or plotted as a graph replay
    return c.item(v.name, graph.replay, flops=flops, note=note, extra=extra, applies=graph.graphed), graph


def _in_layer_rows(c: Case, x: Inputs, plan: PrefillPlan, full: Row) -> list[Row]:
    """mla_prefill's phases timed inside the layer by :func:`mla_bridge.profiling.time_phases` (CUDA events at the
    phase boundaries with the GPU ahead of the host; host issue time and idle-GPU gaps apart), and their sum against
    the layer's own time (``full``, the mla_prefill row): within 5% on a GPU."""
    ctx, name, meta, total_v = c.ctx, c.name, c.meta, "in layer: sum of phases"
    try:
        times, _ = time_phases(
            lambda hook: _layer(x, plan)(phase_hook=hook), ctx.device, layers=max(1, min(ctx.repeats, 5))
        )
    except Exception as err:  # noqa: BLE001
        return [c.failed(total_v, err)]
    d, e = x.dims, x.q.element_size()
    attn, up = x.flops()
    head_dim_sum = d.head_dim_qk + d.head_dim_vo
    main_attn = (
        attn
        if plan.fused
        else attention_flops(x.q_lens, x.q_lens, causal=True, heads=d.num_heads, head_dim_sum=head_dim_sum)
    )
    # what each phase moves or computes: latent rows read + written; the GEMM; the attention; partials read + written
    work: dict[str, dict[str, Any]] = {
        "gather": dict(nbytes=_gather_bytes(x, plan, e)),
        "up-projection": dict(flops=up),
        "main pass": dict(flops=main_attn),
        "context chunk": dict(flops=attn - main_attn),
        "merge": dict(nbytes=merge_phase_bytes(plan, e)),
    }
    gathering_passes = 1 if plan.fused else sum(chunk.plan is not None for chunk in plan.chunks)
    rows = []
    for phase in IN_LAYER_PHASES:
        if phase in times.phases_ms:
            v, n = "in layer: " + phase, times.passes[phase]
            # the bytes are those of every pass gathering: where some ran the fused kernel (no gather phase), none
            counted = phase != "gather" or n == gathering_passes
            row = ctx.row(
                SECTION, name, path(v), ms=times.phases_ms[phase], **(work[phase] if counted else {}), **meta(v)
            )
            row.note = f"{n} pass(es) per layer" + ("" if counted else f" of {gathering_passes}: bytes not counted")
            row.host_ms, row.repeats = times.host_ms[phase], times.layers
            row.extra.update(passes=n, gap_ms=times.gap_ms.get(phase), method=times.method)
            rows.append(row)
    total = ctx.row(SECTION, name, path(total_v), ms=times.sum_ms, flops=attn + up, **meta(total_v))
    total.repeats = times.layers
    total.extra.update(phase_timing=times.to_dict(), method=times.method)
    ratio = times.sum_ms / full.ms if full.status == "ok" and full.ms else None
    if ratio is not None:
        total.extra["vs_layer"] = ratio
        total.note = f"{ratio:.3f}x the mla_prefill row"
    if not times.host_ran_ahead and ctx.cuda:
        total.note += "; the host did not run ahead: phases include host gaps"
    gaps = sum(times.gap_ms.values())
    total.extra["host_gap_ms"] = gaps
    rows.append(total)
    how = "phases timed inside the layer (mla_bridge.profiling)"
    if gaps > PHASE_SUM_TOLERANCE * times.sum_ms:
        # host-bound: the layer waits for the host, which GPU phase times leave out (reported as gaps instead)
        total.note += f"; host-bound: {gaps:.3f} ms of host gaps on an idle GPU"
        what = "in-layer phase sum / mla_prefill (host-bound: GPU time <= layer)"
        ctx.check(f"context {name}: {what}", ratio, "<=", 1.0 + PHASE_SUM_TOLERANCE, how)
    else:
        value = None if ratio is None else abs(ratio - 1.0)
        ctx.check(f"context {name}: |in-layer phase sum / mla_prefill - 1|", value, "<=", PHASE_SUM_TOLERANCE, how)
    return rows


def _handwritten_item(c: Case, x: Inputs, budget: int, flops: float):
    """The hand-written pipeline as a ``measure_many`` item, or a skipped row."""
    unavailable = c.unavailable("handwritten", "handwritten")
    if unavailable is not None:
        return unavailable
    try:
        layer = handwritten_pipeline(c.ctx, x, budget)
        fb = handwritten_backend(c.ctx)
    except Exception as err:  # noqa: BLE001
        return c.failed("handwritten", err, "plan failed")
    fits = handwritten_merges_in_flashinfer(x)
    merge = "merge_state" if fits else "a torch merge (FlashInfer's merge_state cannot launch at these dims)"
    return c.item("handwritten", layer, flops=flops, note=f"torch gather, matmul, cat, {fb} per chunk, {merge}")


def _summary_rows(c: Case, case: ContextCase, bi: int, by_path: dict, flops: float) -> list[Row]:
    """Sums of the phases run alone, and the targets: each mla_prefill path against (attention + GEMM alone) and
    against the hand-written pipeline; on the host-bound cases, graphed and eager against eager before the per-pass
    choice (``ContextCase.eager_ms_before``)."""
    ctx, name, meta = c.ctx, c.name, c.meta

    def ok(v: str) -> Any:  # the row of an ok path (its ms set), or None
        row = by_path.get(path(v))
        return row if row is not None and row.status == "ok" else None

    rows = []
    if ok("gather") and ok("up-projection") and ok("attention"):
        parts = [r.ms for r in map(ok, ("gather", "up-projection", "attention", "merge")) if r]
        note = "gather + up-projection + attention + merge"
        rows.append(
            ctx.row(SECTION, name, path("phase sum"), ms=sum(parts), flops=flops, **meta("phase sum"), note=note)
        )
    base = None
    if ok("gemm") and ok("attention"):
        # the kernels' GPU time (their CUDA events): a sample's host time, when the host lags, is no kernel work
        base = sum(r.extra.get("gpu_ms", r.ms) for r in map(ok, ("gemm", "attention")))
        timed = "GPU time (CUDA events)" if ctx.cuda else "times (wall clock: no GPU)"
        note = f"the targets' denominator: the two kernels' {timed}"
        rows.append(
            ctx.row(
                SECTION, name, path("attention + gemm"), ms=base, flops=flops, **meta("attention + gemm"), note=note
            )
        )
    long_case = not case.eager_ms_before
    hand = ok("handwritten")
    targets = {"eager": EAGER_TARGET, "graph": GRAPHED_TARGET}
    for v in LAYER:
        target, row = targets.get(v.name), ok(v.name)
        what = f"context {name}: {v.label} / (attention + GEMM alone)"
        if row is None:
            if target and long_case and case.context:
                missing = by_path.get(v.label)
                ctx.check(what, None, "<=", target, "not measured: " + (missing.note if missing is not None else ""))
            continue
        if base is not None:
            ratio = row.ms / base
            row.extra["vs_attention_plus_gemm"] = ratio
            row.note += f"; {ratio:.3f}x attn+GEMM"
            if target and long_case:
                ctx.check(what, ratio, "<=", target)
        elif target and long_case and case.context:
            ctx.check(what, None, "<=", target, "phases not measured")
        if hand is not None:
            ratio = row.ms / hand.ms
            row.extra["vs_handwritten"] = ratio
            row.note += f"; {ratio:.3f}x hand-written"
            ctx.check(f"context {name}: {v.label} / hand-written pipeline", ratio, "<=", 1.0, "never slower")
    full = by_path.get(path("eager"))
    if hand is None and ctx.cuda:
        h = by_path.get(path("handwritten"))
        why = h.note if h is not None and h.status != "ok" else (full.note if full is not None else "")
        ctx.check(f"context {name}: mla_prefill / hand-written pipeline", None, "<=", 1.0, "not measured: " + why)
    for v in (v for v in LAYER if "graph" in v.args):  # graph / eager
        g, e = ok(v.name), ok(v.args["graph"])
        if g is not None and e is not None:
            g.extra["speedup_vs_eager"] = e.ms / g.ms
            g.note += f"; {e.ms / g.ms:.2f}x faster than eager"
    if case.eager_ms_before:
        before, graphed, eager = case.eager_ms_before[bi], ok("graph"), ok("eager")
        ctx.check(
            f"context {name}: graphed mla_prefill speedup over the H200 eager baseline ({before} ms)",
            before / graphed.ms if graphed else None,  # type: ignore[operator]
            ">=",
            GRAPHED_SPEEDUP,
        )
        ctx.check(
            f"context {name}: eager mla_prefill ms against the H200 eager baseline ({before} ms)",
            eager.ms if eager else None,
            "<=",
            before,
            "no slower",
        )
    return rows


def _fp8_setup(c: Case, x: Inputs, plan: PrefillPlan, run: Callable[..., torch.Tensor]) -> dict:
    """The FP8-cache layer of a case (same inputs, the cache quantized once) and its error against the bf16-cache
    result (the quantization error), computed once, untimed."""
    ctx = c.ctx
    res: dict[str, Any] = {"skipped": [], "rel_err": None, "applies": x.num_context > 0}
    if x.num_context == 0:
        res["skipped"].append(c.skip("fp8", "no context: the cache is not read"))
        return res
    try:
        cache8, scale = quantize_latent_cache(x.kv_cache)
        build = dict(dims=x.dims, workspace=plan.workspace, block_size=x.case.block_size, dtype=ctx.dtype)
        plan8 = PrefillPlan.build(x.q_lens, x.c_lens, backend=ctx.backend, kv_cache_dtype="fp8", **build)  # type: ignore[arg-type]
        layer = _layer(x, plan8, cache8, scale)
        ref = run().float()
        res["rel_err"] = float((layer().float() - ref).abs().max() / ref.abs().max())
    except Exception as err:  # noqa: BLE001
        res["skipped"].append(c.failed("fp8", err))
        return res
    res.update(layer=layer, run=lambda: layer(), scale=scale)
    return res


def _fp8_summary(ctx: Ctx, name: str, by_path: dict, fp8: dict) -> None:
    """FP8 row against the bf16-cache row of the same run (the <= 1.02 target) and its quantization error."""
    full, row8 = by_path.get(path("eager")), by_path.get(path("fp8"))
    if not fp8["applies"]:
        return
    if row8 is None or row8.status != "ok":
        ctx.check(f"context {name}: mla_prefill FP8 cache / bf16 cache", None, "<=", FP8_TARGET, "not measured")
        return
    row8.extra["rel_err_vs_unquantized"] = fp8["rel_err"]
    unquantized = str(ctx.dtype).replace("torch.", "")  # the cache dtype of the unquantized rows
    row8.note += f"; max |out - out({unquantized} cache)| / max |out| = {fp8['rel_err']:.2e} (quantization error)"
    ratio = row8.ms / full.ms if full is not None and full.status == "ok" else None
    if ratio is not None:
        row8.extra["vs_bf16_cache"] = ratio
        row8.note += f"; {ratio:.3f}x the {unquantized}-cache row"
    ctx.check(f"context {name}: mla_prefill FP8 cache / bf16 cache", ratio, "<=", FP8_TARGET, "same run")
    for fast, slow in (("gather", "torch gather"), ("fp8 gather", "fp8 torch gather")):
        a, b = by_path.get(path(fast)), by_path.get(path(slow))
        if a is not None and b is not None and a.status == b.status == "ok":
            a.extra["vs_torch_gather"] = a.ms / b.ms
            a.note += f"; {a.ms / b.ms:.3f}x the torch gather"


def _context_pass_rows(c: Case, x: Inputs, budget: int, ws: Workspace) -> list[Row]:
    """One context chunk alone (the first of the schedule): non-causal, its requests' new tokens over it."""
    ctx, d = c.ctx, x.dims
    spans = schedule_context_chunks(x.c_lens, budget)[0]
    r0, r1 = spans[0][0], spans[-1][0] + 1
    kv_lens = [0] * (r1 - r0)
    for r, s, e in spans:
        kv_lens[r - r0] = e - s
    q_lens = x.q_lens[r0:r1]
    q0 = sum(x.q_lens[:r0])
    q = x.q[q0 : q0 + sum(q_lens)]
    flops = attention_flops(
        q_lens, kv_lens, causal=False, heads=d.num_heads, head_dim_sum=d.head_dim_qk + d.head_dim_vo
    )
    name = f"{c.name}: chunk 0 (q {'+'.join(map(str, q_lens))} over kv {'+'.join(map(str, kv_lens))})"
    c = replace(c, name=name, fields=dict(c.fields, seq_len=sum(kv_lens)))
    heads = dict(num_heads=d.num_heads, head_dim_qk=d.head_dim_qk, head_dim_vo=d.head_dim_vo)
    try:
        req_ids = torch.cat([torch.full((e - s,), r, dtype=torch.int64) for r, s, e in spans]).to(ctx.device)
        pos = torch.cat([torch.arange(s, e, dtype=torch.int64) for _, s, e in spans]).to(ctx.device)
        k, v = x.wp.up_project(gather_latent(x.kv_cache, x.block_table, req_ids, pos, dtype=ctx.dtype))
        plan = plan_ragged(
            indptr(q_lens), indptr(kv_lens), **heads, causal=False, sm_scale=d.softmax_scale, dtype=ctx.dtype,
            workspace=ws, backend=ctx.backend,
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001
        return [c.failed("context pass", err)]
    return beside_raw(c, "context pass", "context pass raw", plan, q, k, v, flops=flops)


def jobs(ctx: Ctx) -> list[Job]:
    return [
        Job(SECTION, f"context {case.name}, {label}", partial(_case_job, case=case, bi=bi, ci=10 * k + bi))
        for k, case in enumerate(context_cases(ctx.quick))
        for bi, (label, _) in enumerate(case.budgets)
    ]


def merge_phase_bytes(plan: PrefillPlan, e: int) -> int:
    """Bytes the merges of one :func:`mla_bridge.mla_prefill` call move (``e``: the out dtype's size): per step of
    :attr:`mla_bridge.PrefillPlan.merge_steps`, its rows' out (or float32 running out) and partial read, the merged
    out (or running out) written, and the float32 LSEs (two read, one written)."""
    h, dv = plan.dims.num_heads, plan.dims.v_head_dim
    total = 0
    for steps in plan.merge_steps:
        for start, stop, src, dst in steps or ():
            total += (stop - start) * h * (dv * ((e if src is None else 4) + e + (e if dst is None else 4)) + 12)
    return total


def budget_bytes(x: Inputs, plan: PrefillPlan) -> dict:
    """The memory budget of one mla_prefill with the weight prepared once (section 5): what
    :func:`mla_bridge.prefill.prefill_memory_bytes` documents for the plan (latent rows, the k/v GEMM output of the
    largest pass, out, lse; the prepared weight is the caller's, allocated before the call)."""
    return {"total": prefill_memory_bytes(plan, prepared_weight=True)}


def peak_extra(ctx: Ctx, fn: Callable[[], Any]) -> int:
    """Peak device memory allocated by ``fn()`` above what was allocated before it (after one warm-up call)."""
    fn()
    torch.cuda.synchronize(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    result = fn()
    torch.cuda.synchronize(ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - base
    del result
    return int(peak)
