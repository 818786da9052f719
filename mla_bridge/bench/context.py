"""Section 2: the context pass and the full ``mla_prefill`` with prefix-cached context.

For each case and chunk budget: ``mla_prefill`` end to end (with the weight prepared once, the raw weight, the split
k_pe layout, and replayed from a CUDA graph, :mod:`mla_bridge.graphs`); its phases run alone on the same tensors
(gather by block table, up-projection with and without the k concat, the attention kernels, the merge); the
hand-written pipeline a user would write without mla_bridge (torch gather by block table, ``kv_b_proj`` matmul,
``torch.cat`` with k_pe, one FlashInfer fa3 run per chunk (fa2 off SM90), ``flashinfer.merge_state``); one context
pass (non-causal, the new tokens over the first context chunk) through ``RaggedPlan.run`` and the raw wrapper; and
mla_prefill's phases timed inside the layer by :mod:`mla_bridge.profiling` (the way the CLI times them), whose sum
is checked against the layer's time (within 5% on a GPU).

The phases mirror :func:`mla_bridge.prefill.mla_prefill` step by step (they call :mod:`mla_bridge.cache`'s
``fused_latent`` and ``gather_rows`` and the prepared weight's ``up_project``); keep them in step when it changes.
FP8-cache rows time the same case with its cache quantized, beside the bf16-cache ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..merge import merge_attn_states_
from ..plan import PrefillPlan, schedule_context_chunks
from ..cache import fused_latent, gather_impl, gather_latent, gather_rows, quantize_latent_cache
from ..graphs import PrefillLayer, capture_prefill
from ..kernels import triton_available
from ..kv import kv_impl
from ..prefill import mla_prefill, prefill_memory_bytes
from ..ragged import plan_ragged
from ..weights import PreparedKVBProj, prepare_kv_b_proj
from ..workspace import Workspace
from .cases import ContextCase, context_cases, dims_for
from .common import Ctx, Job, Row, attention_flops, flashinfer_importable, fmt_err, gemm_flops, indptr, plan_raw

__all__ = ["jobs", "PATHS", "Inputs", "make_inputs", "handwritten_pipeline", "handwritten_backend"]

SECTION = "context"
PATHS = (
    "mla_prefill",
    "mla_prefill, chunked schedule (fuse_context=False)",
    "hand-written pipeline",
    "phase: gather by block_table",
    "phase: up-projection (GEMM + k concat)",
    "phase: up-projection GEMM alone",
    "phase: attention kernels alone",
    "phase: merge",
    "sum of phases alone",
    "attention + GEMM alone",
    "context pass: RaggedPlan.run",
    "context pass: raw FlashInfer wrapper.run",
    "in mla_prefill: gather",
    "in mla_prefill: up-projection",
    "in mla_prefill: main pass",
    "in mla_prefill: context chunk",
    "in mla_prefill: merge",
    "in mla_prefill: sum of phases",
    "mla_prefill, raw weight (read in place; rearranged per call for cuBLAS passes)",
    "mla_prefill, identity layout (one GEMM with an identity block)",
    "mla_prefill, CUDA graph replay",
    "mla_prefill, identity layout, CUDA graph replay",
    "mla_prefill, FP8 cache",
    "phase: gather by block_table, FP8 cache",
    "phase: gather by block_table, torch gather",
    "phase: gather by block_table, FP8 cache, torch gather",
    "mla_prefill, fused gather+GEMM kernel (kv_impl='fused')",
    "mla_prefill, fused gather+GEMM kernel, CUDA graph replay",
    "mla_prefill, gather + cuBLAS GEMM on every pass (kv_impl='separate')",
    "mla_prefill, gather + cuBLAS GEMM on every pass, CUDA graph replay",
)
#: mla_prefill's own phases (the phase_hook names), timed inside the layer by mla_bridge.profiling (as the CLI does).
IN_LAYER_PHASES = ("gather", "up-projection", "main pass", "context chunk", "merge")
PHASE_SUM_TOLERANCE = 0.05  # the in-layer phases add up to the layer's time within 5%
#: FP8-cache rows: the same case with its cache quantized (mla_bridge.cache.quantize_latent_cache);
#: the ratio to the bf16-cache row of the same run is the target (<= 1.02).
FP8_TARGET = 1.02
I_FP8, I_FP8_GATHER, I_TORCH_GATHER, I_FP8_TORCH_GATHER = range(
    PATHS.index("mla_prefill, FP8 cache"), PATHS.index("mla_prefill, FP8 cache") + 4
)
#: The fused gather + up-projection kernel on every pass (mla_bridge.kv), eager and graphed; the separate path on
#: every pass (the default before the per-pass choice, kv_impl="auto"), eager and graphed (a replay has no
#: host cost per launch: the GPU-faster choice, which the default graph makes too, :func:`mla_bridge.kv.pass_impl`).
FUSED_KV_PATH, FUSED_KV_GRAPH, SEPARATE_KV_PATH, SEPARATE_KV_GRAPH = PATHS[-4:]
#: Targets on the four long context cases (mla_prefill / (attention + GEMM alone)), and of the host-bound
#: cases against their eager figure before it (``ContextCase.eager_ms_before``).
EAGER_TARGET, GRAPHED_TARGET, GRAPHED_SPEEDUP = 1.12, 1.05, 2.5


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
        attn = attention_flops(
            self.q_lens, [c + q for c, q in zip(self.c_lens, self.q_lens)], causal=True, heads=self.dims.num_heads
        )
        d = self.dims
        gemm = gemm_flops(
            self.num_context + self.num_tokens, d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim)
        )
        return attn, gemm


def make_inputs(ctx: Ctx, case: ContextCase, salt: int) -> Inputs:
    dims = dims_for(case.heads)
    heads = case.heads
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


def handwritten_pipeline(ctx: Ctx, x: Inputs, chunk_tokens: int) -> Callable[[], torch.Tensor]:
    """The pipeline without mla_bridge, planned once per batch (host metadata and one wrapper per pass) and
    returned as a per-layer function: torch gather by block table, ``kv_b_proj`` matmul, ``torch.cat`` with k_pe,
    a FlashInfer run per chunk, ``flashinfer.merge_state`` (base-2 LSE throughout)."""
    import flashinfer

    d, bs, h = x.dims, x.case.block_size, x.dims.num_heads
    fb = handwritten_backend(ctx)
    nope, rank = d.qk_nope_head_dim, d.kv_lora_rank
    qo = indptr(x.q_lens)
    main = ctx.raw_wrapper(fb, 0)
    plan_raw(main, qo, qo, heads=h, causal=True, sm_scale=d.softmax_scale, dtype=ctx.dtype)
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
                out, lse = flashinfer.merge_state(out, lse, c_out, c_lse)
            else:
                m_out, m_lse = flashinfer.merge_state(out[q0:q1], lse[q0:q1], c_out, c_lse)
                out[q0:q1] = m_out
                lse[q0:q1] = m_lse
        return out

    return layer


class _Phases:
    """mla_prefill's steps, each runnable alone on tensors prepared once (see the module docstring)."""

    def __init__(self, x: Inputs, plan: PrefillPlan):
        d = x.dims
        self.x, self.plan = x, plan
        e = x.q.element_size()
        self.out = torch.empty(x.num_tokens, d.num_heads, d.v_head_dim, dtype=plan.dtype, device=plan.device)
        self.lse = torch.empty(x.num_tokens, d.num_heads, dtype=torch.float32, device=plan.device)
        row_bytes = d.latent_dim * e
        # bytes a gather must move: context rows read (in the cache's dtype) and written, new rows read and written
        self.gather_bytes = lambda cache_e: (
            x.num_context * d.latent_dim * (cache_e + e) + (2 * x.num_tokens * row_bytes if plan.fused else 0)
        )
        if plan.fused:
            self.n_keys = int(plan.main_kv_indptr[-1])
            self.sources = [self.gather()]  # 576-wide latent rows, as mla_prefill passes them
        else:
            self.sources = [torch.cat([x.kv_c, x.k_pe], dim=-1)] + self.gather()
        self.kv = self.up_projection()
        self.partials = []
        self.attention()
        if not plan.fused:
            self.partials = [
                c.plan.run(x.q[c.q_start : c.q_end], k, v) if c.plan is not None else None
                for c, (k, v) in zip(plan.chunks, self.kv[1:])
            ]
        rows = sum(c.q_end - c.q_start for c in plan.chunks if c.plan is not None)
        self.merge_bytes = 3 * rows * d.num_heads * (d.v_head_dim * e + 4)

    def gather(self, cache=None, scale=None, impl=None):
        """The gather of mla_prefill (``cache``/``scale``: an FP8 copy of the cache; ``impl``: torch or triton)."""
        x, plan = self.x, self.plan
        cache = x.kv_cache if cache is None else cache
        if plan.fused:
            return fused_latent(plan, x.kv_c, x.k_pe, cache, x.block_table, scale, impl=impl)
        # as mla_bridge.kv.chunk_kv: by the chunk's rows (on CUDA its kv_indptr, no per-token tensors)
        return [
            gather_rows(cache, x.block_table, c.rows, dtype=plan.dtype, kv_cache_scale=scale, impl=impl)
            for c in plan.chunks
        ]

    def up_projection(self):
        return [self.x.wp.up_project(lat) for lat in self.sources]

    def gemm(self):
        # the bare kv_b_proj GEMM (kv_c @ W.T): the up-projection's inherent work, the stricter yardstick
        rank = self.x.dims.kv_lora_rank
        return [torch.matmul(lat[:, :rank], self.x.w.t()) for lat in self.sources]

    def attention(self):
        plan, q = self.plan, self.x.q
        k, v = self.kv[0]
        plan.main.run(q, k, v, out=self.out, lse=self.lse)
        if not plan.fused:
            for c, (k, v) in zip(plan.chunks, self.kv[1:]):
                if c.plan is not None:
                    c.plan.run(q[c.q_start : c.q_end], k, v)

    def merge(self):
        for c, part in zip(self.plan.chunks, self.partials):
            if part is not None:
                merge_attn_states_(self.out[c.q_start : c.q_end], self.lse[c.q_start : c.q_end], part[0], part[1])


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


def _case_job(ctx: Ctx, case: ContextCase, bi: int, ci: int) -> list[Row]:
    label, budget = case.budgets[bi]
    name = f"{case.name}, {label}"
    x = make_inputs(ctx, case, ci)
    attn_flops, up_flops = x.flops()
    seq = x.num_context + x.num_tokens
    # display order pi: the mla_prefill variants (0, 0.2, 0.4, 0.6) first, then the schedule, peers and phases
    meta: Callable[[float], dict[str, Any]] = lambda pi: dict(  # noqa: E731
        seq_len=seq, heads=case.heads, order=(1, ci, pi)
    )
    rows: list[Row] = []
    ws = Workspace(ctx.device, chunk_tokens=budget)
    try:
        plan = PrefillPlan.build(
            x.q_lens,
            x.c_lens,
            dims=x.dims,
            workspace=ws,
            block_size=case.block_size,
            dtype=ctx.dtype,
            backend=ctx.backend,
        )
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return [ctx.skipped(SECTION, name, PATHS[0], "plan failed: " + fmt_err(err, 160), err, **meta(0))]
    sched = "fused (one causal pass)" if plan.fused else f"{len(plan.chunks)} chunk(s)"
    extra = {"chunk_tokens": budget, "fused": plan.fused, "chunks": len(plan.chunks), "backend": plan.backend.name}
    flops = attn_flops + up_flops
    # Every path of this case is timed interleaved, so that the ratios below hold on a noisy machine.
    items: list = [
        (
            PATHS[0],
            lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan),
            dict(
                flops=flops,
                note=f"{sched}, {plan.backend.name}, k/v {kv_impl(ctx.device)}, weight prepared once",
                extra=dict(extra),
                **meta(0),
            ),
        ),
        (
            PATHS[18],
            lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.w, x.kv_cache, x.block_table, plan),
            dict(
                flops=flops,
                note="the checkpoint's kv_b_proj: the fused kernel reads it in place, a cuBLAS "
                "pass rearranges it per call",
                **meta(0.2),
            ),
        ),
        (
            PATHS[19],
            lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp_identity, x.kv_cache, x.block_table, plan),
            dict(
                flops=flops,
                note="one GEMM of 320 x 576 per head (40% more FLOPs), k_pe by the identity block",
                **meta(0.4),
            ),
        ),
    ]
    skipped: list[Row] = []
    graphs = []
    fused_kv = ctx.cuda and triton_available()
    if fused_kv:
        items.append(
            (
                FUSED_KV_PATH,
                lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan, kv_impl="fused"),
                dict(flops=flops, note="one Triton launch per pass: gather + GEMM + k layout", **meta(0.5)),
            )
        )
        items.append(
            (
                SEPARATE_KV_PATH,
                lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan, kv_impl="separate"),
                dict(flops=flops, note="every pass: gather, then cuBLAS", **meta(0.55)),
            )
        )
    else:
        skipped += [
            ctx.not_here(SECTION, name, p, "the fused kernel needs CUDA and Triton", **meta(0.5))
            for p in (FUSED_KV_PATH, FUSED_KV_GRAPH, SEPARATE_KV_PATH, SEPARATE_KV_GRAPH)
        ]
    for path, weight, pi, impl in (
        (PATHS[20], x.wp, 0.6, None),
        (PATHS[21], x.wp_identity, 0.8, None),
        (FUSED_KV_GRAPH, x.wp, 0.7, "fused"),
        (SEPARATE_KV_GRAPH, x.wp, 0.75, "separate"),
    ):
        if impl and not fused_kv:
            continue
        graph_item, graph = _graph_item(ctx, x, plan, weight, name, path, flops, meta(pi), kv_impl=impl)
        (skipped if graph is None else items).append(graph_item)
        graphs.append(graph)
    if plan.fused:
        try:
            plan2 = PrefillPlan.build(
                x.q_lens,
                x.c_lens,
                dims=x.dims,
                workspace=ws,
                block_size=case.block_size,
                dtype=ctx.dtype,
                backend=ctx.backend,
                fuse_context=False,
            )
            items.append(
                (
                    PATHS[1],
                    lambda: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan2),
                    dict(flops=flops, note=f"main pass + {len(plan2.chunks)} chunk(s) + merge", **meta(1)),
                )
            )
        except Exception as err:  # noqa: BLE001
            ctx.recover()
            skipped.append(ctx.skipped(SECTION, name, PATHS[1], "failed: " + fmt_err(err, 160), err, **meta(1)))
    hand = _handwritten_item(ctx, x, budget, name, flops, meta(2))
    if isinstance(hand, Row):
        skipped.append(hand)
    else:
        items.append(hand)
    try:
        ph = _Phases(x, plan) if case.context else None
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        ph = None
        skipped.append(ctx.skipped(SECTION, name, PATHS[3], "phases failed: " + fmt_err(err, 160), err, **meta(3)))
    if ph is not None:
        items += [
            (
                PATHS[3],
                ph.gather,
                dict(
                    nbytes=ph.gather_bytes(x.q.element_size()),
                    note=f"{gather_impl(ctx.device)} gather; latent rows read + written",
                    **meta(3),
                ),
            ),
            (PATHS[4], ph.up_projection, dict(flops=up_flops, **meta(4))),
            (PATHS[5], ph.gemm, dict(flops=up_flops, **meta(5))),
            (PATHS[6], ph.attention, dict(flops=attn_flops, **meta(6))),
        ]
        if plan.fused:
            skipped.append(
                ctx.skipped(SECTION, name, PATHS[7], "fused schedule: one pass, nothing to merge", **meta(7))
            )
        else:
            items.append(
                (PATHS[7], ph.merge, dict(nbytes=ph.merge_bytes, note="merge_attn_states_ per chunk", **meta(7)))
            )
    fp8 = _fp8_items(ctx, x, plan, ph, name, flops, dict(extra), meta)
    items += fp8["items"]
    rows = ctx.measure_many(SECTION, name, items) + skipped + fp8["skipped"]
    for graph in graphs:
        if graph is not None:
            graph.release()  # its private pool goes back before the next case
    rows.extend(_summary_rows(ctx, case, bi, name, {r.path: r for r in rows}, attn_flops, up_flops, meta))
    rows.extend(_in_layer_rows(ctx, x, plan, name, rows[0], meta))
    _fp8_summary(ctx, name, {r.path: r for r in rows}, fp8)
    if case.context:
        rows.extend(_context_pass_rows(ctx, x, budget, name, ws, meta))
    return rows


def _fp8_items(
    ctx: Ctx, x: Inputs, plan: PrefillPlan, ph, name: str, flops: float, extra: dict, meta: Callable[[int], dict]
) -> dict:
    """The FP8-cache paths of a case (same inputs, the cache quantized once), the torch-gather phases, and the
    FP8 result's error against the bf16-cache result (the quantization error), computed once, untimed."""
    e = x.q.element_size()
    res: dict = {"items": [], "skipped": [], "rel_err": None, "applies": x.num_context > 0}
    if x.num_context == 0:
        res["skipped"].append(
            ctx.skipped(SECTION, name, PATHS[I_FP8], "no context: the cache is not read", **meta(I_FP8))
        )
        return res
    try:
        cache8, scale = quantize_latent_cache(x.kv_cache)
        plan8 = PrefillPlan.build(
            x.q_lens,
            x.c_lens,
            dims=x.dims,
            workspace=plan.workspace,
            block_size=x.case.block_size,
            dtype=ctx.dtype,
            backend=ctx.backend,
            kv_cache_dtype="fp8",
        )
        run8 = lambda: mla_prefill(  # noqa: E731
            x.q,
            x.kv_c,
            x.k_pe,
            x.wp,
            cache8,
            x.block_table,
            plan8,
            kv_cache_scale=scale,
        )
        ref = mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan).float()
        res["rel_err"] = float((run8().float() - ref).abs().max() / ref.abs().max())
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        res["skipped"].append(
            ctx.skipped(SECTION, name, PATHS[I_FP8], "failed: " + fmt_err(err, 160), err, **meta(I_FP8))
        )
        return res
    extra["kv_cache_scale"] = float(scale)
    res["items"].append(
        (
            PATHS[I_FP8],
            run8,
            dict(flops=flops, note=f"fp8_e4m3 cache, {gather_impl(ctx.device)} gather", extra=extra, **meta(I_FP8)),
        )
    )
    if ph is None:
        return res
    res["items"].append(
        (
            PATHS[I_FP8_GATHER],
            lambda: ph.gather(cache8, scale),
            dict(nbytes=ph.gather_bytes(1), note="fp8 rows read, dequantized rows written", **meta(I_FP8_GATHER)),
        )
    )
    if gather_impl(ctx.device) == "torch":
        res["skipped"] += [
            ctx.not_here(SECTION, name, PATHS[i], "the gather above is the torch one here", **meta(i))
            for i in (I_TORCH_GATHER, I_FP8_TORCH_GATHER)
        ]
    else:
        res["items"] += [
            (
                PATHS[I_TORCH_GATHER],
                lambda: ph.gather(impl="torch"),
                dict(nbytes=ph.gather_bytes(e), note="the torch fallback", **meta(I_TORCH_GATHER)),
            ),
            (
                PATHS[I_FP8_TORCH_GATHER],
                lambda: ph.gather(cache8, scale, impl="torch"),
                dict(nbytes=ph.gather_bytes(1), note="the torch fallback", **meta(I_FP8_TORCH_GATHER)),
            ),
        ]
    return res


def _fp8_summary(ctx: Ctx, name: str, by_path: dict, fp8: dict) -> None:
    """FP8 row against the bf16-cache row of the same run (the <= 1.02 target) and its quantization error."""
    full, row8 = by_path.get(PATHS[0]), by_path.get(PATHS[I_FP8])
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
    for fast, slow in ((PATHS[3], PATHS[I_TORCH_GATHER]), (PATHS[I_FP8_GATHER], PATHS[I_FP8_TORCH_GATHER])):
        a, b = by_path.get(fast), by_path.get(slow)
        if a is not None and b is not None and a.status == b.status == "ok":
            a.extra["vs_torch_gather"] = a.ms / b.ms
            a.note += f"; {a.ms / b.ms:.3f}x the torch gather"


def _graph_item(
    ctx: Ctx,
    x: Inputs,
    plan: PrefillPlan,
    weight: PreparedKVBProj,
    name: str,
    path: str,
    flops: float,
    meta: dict,
    kv_impl: Optional[str] = None,
):
    """``(item, graph)``: mla_prefill of this layer (``weight`` prepared once) captured in a CUDA graph
    (:func:`mla_bridge.graphs.capture_prefill`) as a ``measure_many`` item, with the capture time and the graph's
    memory in ``extra``; or ``(skipped row, None)``. On the CPU the same API runs eagerly."""
    try:
        graph = capture_prefill(
            plan, [PrefillLayer(x.q, x.kv_c, x.k_pe, weight, x.kv_cache)], x.block_table, kv_impl=kv_impl
        )
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return ctx.skipped(SECTION, name, path, "capture failed: " + fmt_err(err, 160), err, **meta), None
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
    return (path, graph.replay, dict(flops=flops, note=note, extra=extra, applies=graph.graphed, **meta)), graph


def _in_layer_rows(
    ctx: Ctx, x: Inputs, plan: PrefillPlan, name: str, full: Row, meta: Callable[[int], dict]
) -> list[Row]:
    """mla_prefill's phases timed inside the layer by :func:`mla_bridge.profiling.time_phases` (CUDA events at the
    phase boundaries with the GPU ahead of the host; host issue time and idle-GPU gaps apart), and their sum against
    the layer's own time (``full``, the mla_prefill row): within 5% on a GPU."""
    from ..profiling import time_phases

    base = 12  # index of "in mla_prefill: gather" in PATHS
    try:
        times, _ = time_phases(
            lambda hook: mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan, phase_hook=hook),
            ctx.device,
            layers=max(1, min(ctx.repeats, 5)),
        )
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return [ctx.skipped(SECTION, name, PATHS[base + 5], "failed: " + fmt_err(err, 160), err, **meta(base + 5))]
    d, e = x.dims, x.q.element_size()
    attn, up = x.flops()
    main_attn = attn if plan.fused else attention_flops(x.q_lens, x.q_lens, causal=True, heads=d.num_heads)
    # what each phase moves or computes: latent rows read + written; the GEMM; the attention; partials read + written
    work = {
        "gather": dict(
            nbytes=((4 * x.num_context + 2 * x.num_tokens) if plan.fused else 2 * (x.num_context + x.num_tokens))
            * d.latent_dim
            * e
        ),
        "up-projection": dict(flops=up),
        "main pass": dict(flops=main_attn),
        "context chunk": dict(flops=attn - main_attn),
        "merge": dict(nbytes=merge_phase_bytes(plan, e)),
    }
    rows = []
    for i, phase in enumerate(IN_LAYER_PHASES):
        if phase in times.phases_ms:
            row = ctx.row(
                SECTION,
                name,
                PATHS[base + i],
                ms=times.phases_ms[phase],
                **work[phase],
                **meta(base + i),
                note=f"{times.passes[phase]} pass(es) per layer",
            )
            row.host_ms, row.repeats = times.host_ms[phase], times.layers
            row.extra.update(passes=times.passes[phase], gap_ms=times.gap_ms.get(phase), method=times.method)
            rows.append(row)
    total = ctx.row(SECTION, name, PATHS[base + 5], ms=times.sum_ms, flops=attn + up, **meta(base + 5))
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
    if gaps > PHASE_SUM_TOLERANCE * times.sum_ms:
        # host-bound: the layer waits for the host, which GPU phase times leave out (reported as gaps instead)
        total.note += f"; host-bound: {gaps:.3f} ms of host gaps on an idle GPU"
        ctx.check(
            f"context {name}: in-layer phase sum / mla_prefill (host-bound: GPU time <= layer)",
            ratio,
            "<=",
            1.0 + PHASE_SUM_TOLERANCE,
            "phases timed inside the layer (mla_bridge.profiling)",
        )
    else:
        ctx.check(
            f"context {name}: |in-layer phase sum / mla_prefill - 1|",
            None if ratio is None else abs(ratio - 1.0),
            "<=",
            PHASE_SUM_TOLERANCE,
            "phases timed inside the layer (mla_bridge.profiling)",
        )
    return rows


def _handwritten_item(ctx: Ctx, x: Inputs, budget: int, name: str, flops: float, meta: dict):
    """The hand-written pipeline as a ``measure_many`` item, or a skipped row."""
    if "handwritten" in ctx.skip:
        return ctx.skipped(SECTION, name, PATHS[2], "--skip handwritten", **meta)
    if not ctx.cuda or not flashinfer_importable():
        return ctx.not_here(SECTION, name, PATHS[2], "needs CUDA and FlashInfer", **meta)
    try:
        layer = handwritten_pipeline(ctx, x, budget)
        fb = handwritten_backend(ctx)
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return ctx.skipped(SECTION, name, PATHS[2], "plan failed: " + fmt_err(err, 160), err, **meta)
    return (PATHS[2], layer, dict(flops=flops, note=f"torch gather, matmul, cat, {fb} per chunk, merge_state", **meta))


def _summary_rows(
    ctx: Ctx,
    case: ContextCase,
    bi: int,
    name: str,
    by_path: dict,
    attn_flops: float,
    up_flops: float,
    meta: Callable[[int], dict],
) -> list[Row]:
    """Sums of the phases run alone, and the targets: each mla_prefill path against (attention + GEMM alone) and
    against the hand-written pipeline; on the host-bound cases, graphed and eager against eager before the per-pass
    choice (``ContextCase.eager_ms_before``)."""
    ok = lambda p: p in by_path and by_path[p].status == "ok"  # noqa: E731
    full, hand = by_path.get(PATHS[0]), by_path.get(PATHS[2])
    rows = []
    if ok(PATHS[3]) and ok(PATHS[4]) and ok(PATHS[6]):
        parts = [by_path[p].ms for p in (PATHS[3], PATHS[4], PATHS[6], PATHS[7]) if ok(p)]
        rows.append(
            ctx.row(
                SECTION,
                name,
                PATHS[8],
                ms=sum(parts),
                flops=attn_flops + up_flops,
                **meta(8),
                note="gather + up-projection + attention + merge",
            )
        )
    base = None
    if ok(PATHS[5]) and ok(PATHS[6]):
        # the kernels' GPU time (their CUDA events): a sample's host time, when the host lags, is no kernel work
        base = sum(by_path[p].extra.get("gpu_ms", by_path[p].ms) for p in (PATHS[5], PATHS[6]))
        rows.append(
            ctx.row(
                SECTION,
                name,
                PATHS[9],
                ms=base,
                flops=attn_flops + up_flops,
                **meta(9),
                note="the targets' denominator: the two kernels' GPU time (CUDA events)",
            )
        )
    long_case = not case.eager_ms_before
    # (path, target against attention + GEMM alone on the long cases)
    for path, target in (
        (PATHS[0], EAGER_TARGET),
        (PATHS[20], GRAPHED_TARGET),
        (PATHS[18], None),
        (PATHS[19], None),
        (PATHS[21], None),
        (FUSED_KV_PATH, None),
        (FUSED_KV_GRAPH, None),
        (SEPARATE_KV_PATH, None),
        (SEPARATE_KV_GRAPH, None),
    ):
        row = by_path.get(path)
        if not ok(path):
            if target and long_case and case.context:
                ctx.check(
                    f"context {name}: {path} / (attention + GEMM alone)",
                    None,
                    "<=",
                    target,
                    "not measured: " + (row.note if row is not None else ""),
                )
            continue
        assert row is not None  # ok(path): a row of by_path
        if base is not None:
            ratio = row.ms / base
            row.extra["vs_attention_plus_gemm"] = ratio
            row.note += f"; {ratio:.3f}x attn+GEMM"
            if target and long_case:
                ctx.check(f"context {name}: {path} / (attention + GEMM alone)", ratio, "<=", target)
        elif target and long_case and case.context:
            ctx.check(f"context {name}: {path} / (attention + GEMM alone)", None, "<=", target, "phases not measured")
        if ok(PATHS[2]):
            assert hand is not None  # ok(PATHS[2]): a row of by_path
            ratio = row.ms / hand.ms
            row.extra["vs_handwritten"] = ratio
            row.note += f"; {ratio:.3f}x hand-written"
            ctx.check(f"context {name}: {path} / hand-written pipeline", ratio, "<=", 1.0, "never slower")
    if not ok(PATHS[2]) and ctx.cuda:
        why = hand.note if hand is not None and hand.status != "ok" else (full.note if full is not None else "")
        ctx.check(f"context {name}: mla_prefill / hand-written pipeline", None, "<=", 1.0, "not measured: " + why)
    for g, e in (
        (PATHS[20], PATHS[0]),
        (PATHS[21], PATHS[19]),
        (FUSED_KV_GRAPH, FUSED_KV_PATH),
        (SEPARATE_KV_GRAPH, SEPARATE_KV_PATH),
    ):  # graph / eager
        if ok(g) and ok(e):
            by_path[g].extra["speedup_vs_eager"] = by_path[e].ms / by_path[g].ms
            by_path[g].note += f"; {by_path[e].ms / by_path[g].ms:.2f}x faster than eager"
    graphed = by_path.get(PATHS[20])
    if case.eager_ms_before:
        before = case.eager_ms_before[bi]
        ctx.check(
            f"context {name}: graphed mla_prefill speedup over the H200 eager baseline ({before} ms)",
            before / graphed.ms if ok(PATHS[20]) else None,  # type: ignore[union-attr]  # ok: a row of by_path
            ">=",
            GRAPHED_SPEEDUP,
        )
        ctx.check(
            f"context {name}: eager mla_prefill ms against the H200 eager baseline ({before} ms)",
            full.ms if ok(PATHS[0]) else None,  # type: ignore[union-attr]  # ok: a row of by_path
            "<=",
            before,
            "no slower",
        )
    return rows


def _context_pass_rows(
    ctx: Ctx, x: Inputs, budget: int, name: str, ws: Workspace, meta: Callable[[int], dict]
) -> list[Row]:
    """One context chunk alone (the first of the schedule): non-causal, its requests' new tokens over it."""
    d = x.dims
    spans = schedule_context_chunks(x.c_lens, budget)[0]
    r0, r1 = spans[0][0], spans[-1][0] + 1
    kv_lens = [0] * (r1 - r0)
    for r, s, e in spans:
        kv_lens[r - r0] = e - s
    q_lens = x.q_lens[r0:r1]
    qo = indptr(q_lens)
    q0 = sum(x.q_lens[:r0])
    q = x.q[q0 : q0 + sum(q_lens)]
    flops = attention_flops(q_lens, kv_lens, causal=False, heads=d.num_heads)
    case = f"{name}: chunk 0 (q {'+'.join(map(str, q_lens))} over kv {'+'.join(map(str, kv_lens))})"
    m0, m1 = meta(10), meta(11)
    m0["seq_len"] = m1["seq_len"] = sum(kv_lens)
    try:
        req_ids = torch.cat([torch.full((e - s,), r, dtype=torch.int64) for r, s, e in spans]).to(ctx.device)
        pos = torch.cat([torch.arange(s, e, dtype=torch.int64) for _, s, e in spans]).to(ctx.device)
        lat = gather_latent(x.kv_cache, x.block_table, req_ids, pos, dtype=ctx.dtype)
        k, v = x.wp.up_project(lat)
        plan = plan_ragged(
            qo,
            indptr(kv_lens),
            num_heads=d.num_heads,
            head_dim_qk=d.head_dim_qk,
            head_dim_vo=d.head_dim_vo,
            causal=False,
            sm_scale=d.softmax_scale,
            dtype=ctx.dtype,
            workspace=ws,
            backend=ctx.backend,
        )
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return [ctx.skipped(SECTION, case, PATHS[10], "failed: " + fmt_err(err, 160), err, **m0)]
    items = [(PATHS[10], lambda: plan.run(q, k, v), dict(flops=flops, note=f"backend {plan.backend.name}", **m0))]
    fb = plan.backend.flashinfer_backend
    raw = None
    if fb is None or "raw" in ctx.skip:
        raw = (
            ctx.skipped(SECTION, case, PATHS[11], "--skip raw", **m1)
            if fb
            else ctx.not_here(SECTION, case, PATHS[11], "needs CUDA and FlashInfer", **m1)
        )
    else:
        try:
            wrapper = ctx.raw_wrapper(fb, 0)
            plan_raw(
                wrapper, qo, indptr(kv_lens), heads=d.num_heads, causal=False, sm_scale=d.softmax_scale, dtype=ctx.dtype
            )
            items.append(
                (
                    PATHS[11],
                    lambda: wrapper.run(q, k, v, return_lse=True),
                    dict(flops=flops, note=f"backend {fb}", **m1),
                )
            )
        except Exception as err:  # noqa: BLE001
            ctx.recover()
            raw = ctx.skipped(SECTION, case, PATHS[11], "plan failed: " + fmt_err(err, 160), err, **m1)
    measured = ctx.measure_many(SECTION, case, items)
    core = measured[0]
    if raw is None:
        raw = measured[1]
    if core.status == raw.status == "ok":
        # an ok row has its ms
        core.extra["vs_raw"] = raw.ms / core.ms  # type: ignore[operator]
        core.note += f"; {raw.ms / core.ms:.3f}x raw"  # type: ignore[operator]
    return [core, raw]


def jobs(ctx: Ctx) -> list[Job]:
    out = []
    for k, case in enumerate(context_cases(ctx.quick)):
        for bi, (label, _) in enumerate(case.budgets):
            ci = 10 * k + bi
            out.append(
                Job(SECTION, f"context {case.name}, {label}", lambda c, cs=case, b=bi, i=ci: _case_job(c, cs, b, i))  # type: ignore[misc]
            )
    return out


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
