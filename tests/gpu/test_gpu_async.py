"""Plan ownership on the GPU: correct when the GPU runs behind the host (FlashInfer fa3 / fa2, bf16, 192/128).

Every test keeps the GPU busy with ``torch.cuda._sleep`` before it plans, so FlashInfer's asynchronous schedule
copies (and the runs) are still queued while the host goes on: planning the next batch, dropping plans, growing the
workspace, switching streams. Each result is compared with a reference computed separately, on its own workspace
and after a synchronize (the same backend: the faults give errors of about 4, the tolerance is 1e-2).

Marked ``gpu`` (skipped without CUDA + FlashInfer). On the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_async.py -q -m gpu
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, ragged_prefill  # noqa: E402
from tests.helpers.gpu_cases import (  # noqa: E402
    BACKENDS,
    BF16,
    HEADS,
    SCALE,
    SLEEP,
    TOL,
    Case,
    captured,
    cases,
    dev,
    require,
)


# ---------------------------------------------------------------------------------------------------------------
# a pooled wrapper is never re-planned while the previous plan's copy or run is queued
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_and_replan_while_the_gpu_is_busy(backend):
    require(backend)
    a, b, c = cases(backend)
    ws = Workspace(dev())
    outs = []
    torch.cuda._sleep(SLEEP)
    for case in (a, b, c, a, b):
        plan = case.plan(ws)
        outs.append((case, plan.run(case.q, case.k, case.v)[0]))
        del plan  # dropped at once: its wrapper must not serve the next plan before the GPU ran this one
    torch.cuda.synchronize()
    errors = [case.error(out) for case, out in outs]
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_shot_calls_in_a_row(backend):
    require(backend)
    a, b, _ = cases(backend)
    torch.cuda._sleep(SLEEP)
    out_a, _ = ragged_prefill(a.q, a.k, a.v, a.qo, a.kv, causal=a.causal, sm_scale=SCALE, backend=backend)
    out_b, _ = ragged_prefill(b.q, b.k, b.v, b.qo, b.kv, causal=b.causal, sm_scale=SCALE, backend=backend)
    torch.cuda.synchronize()
    assert a.error(out_a) < TOL and b.error(out_b) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_step_plans_replaced_each_step(backend):
    require(backend)
    from mla_bridge_vllm.plans import ChunkIndptrs, PrefillStepPlans

    ws = Workspace(dev())
    steps = cases(backend)[:2]
    outs = []
    torch.cuda._sleep(SLEEP)
    for step in steps + steps:
        qo = torch.tensor(step.qo, dtype=torch.int32)
        plans = PrefillStepPlans(
            qo,
            [ChunkIndptrs(0, qo, qo)],
            num_heads=HEADS,
            head_dim_qk=192,
            head_dim_vo=128,
            sm_scale=SCALE,
            dtype=BF16,
            device=dev(),
            workspace=ws,
            backend=backend,
        )
        outs.append((step, plans.run_new_tokens(step.q, step.k, step.v, False)))
    torch.cuda.synchronize()
    assert max(step.error(out) for step, out in outs) < TOL


# ---------------------------------------------------------------------------------------------------------------
# a run on another stream is ordered after its plan's copies
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_on_default_stream_run_on_another(backend):
    require(backend)
    a, b, _ = cases(backend)
    ws = Workspace(dev())
    side = torch.cuda.Stream()
    torch.cuda._sleep(SLEEP)  # the default stream is busy: the plan's copies are queued behind the sleep
    plans = [a.plan(ws), b.plan(ws)]
    with torch.cuda.stream(side):
        outs = [p.run(c.q, c.k, c.v)[0] for p, c in zip(plans, (a, b))]
    torch.cuda.synchronize()
    assert a.error(outs[0]) < TOL and b.error(outs[1]) < TOL


# ---------------------------------------------------------------------------------------------------------------
# fa2 and cutlass ignore out's strides
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("view", ["last_dim_slice", "head_slice"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_out(backend, view):
    require(backend)
    a = cases(backend)[1]
    t = a.qo[-1]
    if view == "last_dim_slice":
        buf = torch.full((t, HEADS, 256), float("nan"), dtype=BF16, device=dev())
        out, rest = buf[..., :128], buf[..., 128:]
    else:
        buf = torch.full((t, 2 * HEADS, 128), float("nan"), dtype=BF16, device=dev())
        out, rest = buf[:, :HEADS], buf[:, HEADS:]
    plan = a.plan(Workspace(dev()))
    got, _ = plan.run(a.q, a.k, a.v, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert a.error(out) < TOL
    assert torch.isnan(rest).all()  # nothing written outside the view


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_prefill_into_a_strided_out(backend, ref):
    require(backend)
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, [5, 17, 40], [40, 0, 250], 16, dtype=BF16, device=dev())
    plan = PrefillPlan.build(
        batch.query_lens,
        batch.context_lens,
        dims=dims,
        workspace=Workspace(dev()),
        block_size=16,
        dtype=BF16,
        backend=backend,
    )
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan)
    expected = mla_prefill(*args)
    buf = torch.full((sum(batch.query_lens), dims.num_heads, 256), float("nan"), dtype=BF16, device=dev())
    mla_prefill(*args, out=buf[..., :128])
    torch.cuda.synchronize()
    assert (buf[..., :128].float() - expected.float()).abs().max().item() < TOL
    assert torch.isnan(buf[..., 128:]).all()


# ---------------------------------------------------------------------------------------------------------------
# fa2 plans running at once on two streams never share split-KV temporaries
# ---------------------------------------------------------------------------------------------------------------


def test_two_fa2_plans_on_two_streams():
    require("flashinfer-fa2")
    # Few queries over long keys: fa2 splits the keys and keeps partials in the float workspace.
    a = Case("flashinfer-fa2", [16], [8192], False, 4)
    b = Case("flashinfer-fa2", [16, 16], [4096, 8192], False, 5)
    ws = Workspace(dev())
    pa, pb = a.plan(ws), b.plan(ws)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    wrong = []
    for i in range(40):
        with torch.cuda.stream(s1):
            torch.cuda._sleep(int(1e6))
            out_a, _ = pa.run(a.q, a.k, a.v)
        with torch.cuda.stream(s2):
            out_b, _ = pb.run(b.q, b.k, b.v)
        torch.cuda.synchronize()
        if a.error(out_a) >= TOL or b.error(out_b) >= TOL:
            wrong.append(i)
    assert wrong == []  # before: 27 of 40 iterations wrong


# ---------------------------------------------------------------------------------------------------------------
# growing the float workspace under live plans
# ---------------------------------------------------------------------------------------------------------------


def test_growth_while_a_live_plan_is_queued():
    require("flashinfer-fa2")
    small = Case("flashinfer-fa2", [300, 700], [300, 700], True, 6)
    large = Case("flashinfer-fa2", [16] * 8, [8192] * 8, False, 7)
    ws = Workspace(dev(), float_workspace_bytes=64 * 1024)
    torch.cuda._sleep(SLEEP)
    live = small.plan(ws)  # grows the tiny workspace to what it needs (31 MB on the H200, 2026-12-01)
    before, old_buffer = ws.float_workspace_bytes, live.flashinfer_wrapper._float_workspace_buffer
    out1, _ = live.run(small.q, small.k, small.v)
    # Growth while `live` has its copy and run queued, as Workspace.plan_with_growth does on FlashInfer's "buffer
    # overflow" (called directly: which batch overflows a given size is FlashInfer's business, not this test's).
    ws._grow(2 * before)
    assert ws.float_workspace_bytes == 2 * before
    assert live.flashinfer_wrapper._float_workspace_buffer is old_buffer, "a live plan's buffer was replaced"
    grown = large.plan(ws)
    assert grown.flashinfer_wrapper._float_workspace_buffer is not old_buffer
    out2, _ = live.run(small.q, small.k, small.v)
    out3, _ = grown.run(large.q, large.k, large.v)
    torch.cuda.synchronize()
    assert small.error(out1) < TOL and small.error(out2) < TOL and large.error(out3) < TOL


# ---------------------------------------------------------------------------------------------------------------
# a captured CUDA graph keeps its plan's wrapper
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_replays_right_after_its_plan_is_dropped(backend):
    require(backend)
    a, b, c = cases(backend)
    ws = Workspace(dev())
    plan = a.plan(ws)
    graph, out = captured(plan, a)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert a.error(out) < TOL
    del plan
    gc.collect()
    torch.cuda._sleep(SLEEP)
    others = [(case, case.plan(ws)) for case in (b, c)]  # the pool must not hand them the graph's wrapper
    other_outs = [(case, p.run(case.q, case.k, case.v)[0]) for case, p in others]
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert a.error(out) < TOL  # before: error 4.0
    assert max(case.error(o) for case, o in other_outs) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_retain_for_graph_hands_the_wrapper_back(backend):
    """A user's own torch.cuda.graph registered after its capture. The capture belongs to the graph torch names for
    it (``CUDAGraph.get_currently_capturing_graph``); on a torch without that function no graph is named, and the
    wrapper stays retired for good (a registration cannot tell which capture it covers)."""
    require(backend)
    named = callable(getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None))
    a, b, c = cases(backend)
    ws = Workspace(dev())
    plan = a.plan(ws)
    graph, out = captured(plan, a)
    fin = plan.retain_for_graph(graph)
    del plan
    gc.collect()
    torch.cuda._sleep(SLEEP)
    graph.replay()
    others = [case.plan(ws) for case in (b, c)]
    assert ws.wrappers_created == 3  # the graph's wrapper is still out of the pool
    del others
    torch.cuda.synchronize()
    assert a.error(out) < TOL
    del graph  # the graph is gone: its wrapper comes back once its last replay is done
    gc.collect()
    assert fin is not None and not fin.alive
    torch.cuda.synchronize()
    again = [case.plan(ws) for case in (a, b, c)]
    assert ws.wrappers_created == (3 if named else 4) and len(again) == 3


# ---------------------------------------------------------------------------------------------------------------
# PrefillPlan.build does not block the host on queued GPU work
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fuse", [True, False])
def test_prefill_plan_build_does_not_wait_for_the_gpu(ref, fuse):
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, [5, 17, 40], [40, 3, 250], 16, dtype=BF16, device=dev())
    ws = Workspace(dev(), chunk_tokens=4096 if fuse else 128)  # 293 context tokens: fused, or three chunks
    build = lambda: PrefillPlan.build(  # noqa: E731
        batch.query_lens,
        batch.context_lens,
        dims=dims,
        workspace=ws,
        block_size=16,
        dtype=BF16,
        fuse_context=fuse,
    )
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table)
    expected = mla_prefill(*args, build())  # warm-up: allocator and page-locked blocks, kernels compiled
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    plan = build()
    assert not torch.cuda.current_stream().query(), "PrefillPlan.build waited for the queued GPU work"
    assert plan.fused == fuse
    got = mla_prefill(*args, plan)
    torch.cuda.synchronize()
    assert (got.float() - expected.float()).abs().max().item() < TOL


@pytest.mark.parametrize("fuse", [True, False])
def test_index_tensors_outlive_a_dropped_plan_on_another_stream(ref, fuse):
    """A plan built on the default stream, run on a side stream kept busy, then dropped: torch's caching allocator
    must not hand its index tensors' memory to a new allocation on the build stream while the side stream's queued
    gather may still read it (PrefillPlan.order_on_current_stream marks its own with record_stream; a chunked plan's
    are its chunks' device kv_indptrs, FlashInfer's copies, which the workspace's pooled wrapper keeps until the
    events recorded after the side stream's runs complete). Without that, the next same-size allocation on the
    default stream gets the freed block at once."""
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, [5, 17, 40], [40, 3, 250], 16, dtype=BF16, device=dev())
    ws = Workspace(dev(), chunk_tokens=4096 if fuse else 128)
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table)
    build = lambda: PrefillPlan.build(  # noqa: E731
        batch.query_lens,
        batch.context_lens,
        dims=dims,
        workspace=ws,
        block_size=16,
        dtype=BF16,
        fuse_context=fuse,
    )
    mla_prefill(*args, build())
    torch.cuda.synchronize()
    plan = build()
    # fused: the expansion's one buffer; chunked: the first chunk's device kv_indptr (FlashInfer's copy), which its
    # gathers read in place of per-token indices
    index = plan.ctx_req_ids if fuse else plan.chunks[0].rows.kv_indptr
    index = index if index._base is None else index._base
    ptr, numel, dtype = index.data_ptr(), index.numel(), index.dtype
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10 * SLEEP)  # about a second: the side stream's gather is still queued below
        mla_prefill(*args, plan)
    del plan, index
    gc.collect()
    assert not side.query(), "the side stream finished too early for this test to mean anything"
    fresh = [torch.empty(numel, dtype=dtype, device=dev()) for _ in range(8)]
    reused = any(f.data_ptr() == ptr for f in fresh)
    still_queued = not side.query()
    torch.cuda.synchronize()
    assert still_queued and not reused, "a freed index tensor was reused while the side stream still read it"
