"""Plan ownership on the CPU: a plan's state is never rewritten, freed or shared while queued GPU work can still read
it.

No GPU here: FlashInfer's wrapper, CUDA streams and CUDA events are recording stand-ins (monkeypatched into
``torch.cuda`` and ``mla_bridge.backends.flashinfer``), and "the GPU" is a list of events the test completes when it
wants, so the host can be made to run ahead of it. Each test checks the ordering itself (which wrapper a plan gets,
which stream waited for which event, which float buffer a run was handed) and fails on code that lacks that ordering.
The same faults on the H200 with the GPU kept busy: tests/gpu/test_gpu_async.py.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import pytest
import torch

import mla_bridge.dispatch as dispatch
from mla_bridge import Workspace
from mla_bridge.backends import flashinfer as fi_backend
from tests.helpers.async_fakes import (
    BF16,
    DQK,
    DVO,
    H,
    FakeGPU,
    StandInWrapper,
    graph_class,
    make_event_class,
    plan,
    run,
    wrapper_of,
)


@pytest.fixture
def gpu(monkeypatch, fake_cuda_runtime):
    """A fake SM90 device (fa3 by default; fa2/cutlass when forced) with stand-in streams, events and wrapper."""
    g = FakeGPU()
    StandInWrapper.instances = []
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    fake_cuda_runtime(lambda: g.capability, lambda: g.current, make_event_class(g), lambda: g.capturing)
    monkeypatch.setattr(fi_backend, "new_wrapper", lambda buf, backend: StandInWrapper(g, buf, backend))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class(g))
    g.capability = (9, 0)
    return g


# ---------------------------------------------------------------------------------------------------------------
# a pooled wrapper is re-planned before the previous plan's queued work ran
# ---------------------------------------------------------------------------------------------------------------


def test_dropped_plan_keeps_its_wrapper_until_the_gpu_is_done(gpu):
    ws = Workspace("cuda:0")
    a = plan(ws, [0, 4])
    wa = wrapper_of(a)
    run(a, 4)
    del a
    gc.collect()
    b = plan(ws, [0, 2, 6])  # the GPU has not run A yet: A's wrapper and its schedule buffer are still read
    assert wrapper_of(b) is not wa
    assert wa.schedule == [0, 4]  # A's schedule was never overwritten while queued
    gpu.finish()
    del b
    gc.collect()
    c = plan(ws, [0, 3])  # now A's (and B's) work is done: wrappers are reused, none created
    assert wrapper_of(c) in StandInWrapper.instances[:2] and ws.wrappers_created == 2


def test_plan_copy_alone_holds_the_wrapper(gpu):
    """A plan dropped before any run still has its schedule copy queued (plan() does not wait)."""
    ws = Workspace("cuda:0")
    a = plan(ws, [0, 4])
    wa = wrapper_of(a)
    del a
    gc.collect()
    assert wrapper_of(plan(ws, [0, 5])) is not wa
    gpu.finish()
    gc.collect()
    assert wrapper_of(plan(ws, [0, 5])) in (wa, StandInWrapper.instances[1])
    assert ws.wrappers_created == 2


def test_one_shot_calls_in_a_row(gpu, monkeypatch):
    """ragged_prefill twice in a row (the JAX eager path too): the second call never re-plans the first's wrapper
    while its run is queued."""
    ws = Workspace("cuda:0")
    seen = []
    for qo in ([0, 4], [0, 1, 4]):
        p = plan(ws, qo)
        run(p, 4)
        seen.append(wrapper_of(p))
        del p
    assert seen[0] is not seen[1]
    runs = [e for e in gpu.log if e[0] == "run"]
    assert [r[4] for r in runs] == [[0, 4], [0, 1, 4]]
    assert seen[0].schedule == [0, 4]


def test_event_recorded_after_plan_and_after_each_run_on_its_stream(gpu):
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4])
    kinds = [(e[0], e[1]) for e in gpu.log if e[0] in ("plan", "record")]
    assert kinds[-1] == ("record", 1) and gpu.log[-2][0] == "plan"  # the plan event follows plan()'s copy
    run(p, 4)
    run(p, 4)
    assert [e[0] for e in gpu.log[-4:]] == ["run", "record", "run", "record"]
    assert gpu.log[-1][2] is gpu.log[-3][2]  # one event per stream, re-recorded: no allocation per run


# ---------------------------------------------------------------------------------------------------------------
# runs on another stream are ordered after the plan's copies
# ---------------------------------------------------------------------------------------------------------------


def test_run_on_another_stream_waits_for_the_plan(gpu):
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4])
    plan_event = next(e[2] for e in reversed(gpu.log) if e[0] == "record")
    gpu.current = gpu.stream(7)
    run(p, 4)
    waits = [e for e in gpu.log if e[0] == "wait"]
    assert waits == [("wait", 7, plan_event)]
    i_wait = gpu.log.index(waits[0])
    i_run = next(i for i, e in enumerate(gpu.log) if e[0] == "run")
    assert i_wait < i_run
    run(p, 4)  # once per stream: the stream is ordered after the copy from then on
    assert len([e for e in gpu.log if e[0] == "wait"]) == 1
    gpu.current = gpu.stream(1)
    run(p, 4)  # the plan's own stream never waits
    assert len([e for e in gpu.log if e[0] == "wait"]) == 1


def test_held_until_every_stream_it_ran_on_is_done(gpu):
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4])
    w = wrapper_of(p)
    run(p, 4)
    gpu.current = gpu.stream(7)
    run(p, 4)
    del p
    gc.collect()
    for e in gpu.pending:
        if e.stream == 1:  # stream 1 caught up, stream 7 still runs
            e.done = True
    gpu.current = gpu.stream(1)
    assert wrapper_of(plan(ws, [0, 4])) is not w


# ---------------------------------------------------------------------------------------------------------------
# fa2 and cutlass ignore out's strides
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend,capability", [("flashinfer-fa2", (9, 0)), ("flashinfer-cutlass", (10, 0)), ("flashinfer-fa3", (9, 0))]
)
@pytest.mark.parametrize("view", ["last_dim_slice", "head_slice"])
def test_strided_out_is_written_at_its_strides(gpu, backend, capability, view):
    gpu.capability = capability
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 3, 5], backend=backend, causal=False)
    assert p.backend.name == backend
    if view == "last_dim_slice":
        buf = torch.full((5, H, 2 * DVO), -7.0, dtype=BF16)
        out = buf[..., :DVO]
    else:
        buf = torch.full((5, 2 * H, DVO), -7.0, dtype=BF16)
        out = buf[:, :H]
    assert not out.is_contiguous()
    q, got = run(p, 5, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, (q[..., :DVO].float() + 1).to(BF16), atol=0, rtol=0)
    rest = buf[..., DVO:] if view == "last_dim_slice" else buf[:, H:]
    assert (rest == -7).all()  # nothing written outside the view


def test_contiguous_out_is_written_directly(gpu):
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 5], backend="flashinfer-fa2")
    out = torch.empty(5, H, DVO, dtype=BF16)
    q, _ = run(p, 5, out=out)
    (entry,) = [e for e in gpu.log if e[0] == "run"]
    assert entry[5] == out.data_ptr()  # no temporary, no copy
    torch.testing.assert_close(out, (q[..., :DVO].float() + 1).to(BF16), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# plans that may run at once never share a float-workspace region (fa2)
# ---------------------------------------------------------------------------------------------------------------


def test_fa2_runs_on_two_streams_get_two_float_regions(gpu):
    ws = Workspace("cuda:0")
    a = plan(ws, [0, 4], backend="flashinfer-fa2")
    b = plan(ws, [0, 6], backend="flashinfer-fa2")
    run(a, 4)
    gpu.current = gpu.stream(2)
    run(b, 6)
    gpu.current = gpu.stream(3)
    run(a, 4)
    runs = [e for e in gpu.log if e[0] == "run"]
    bufs = [r[3] for r in runs]
    assert len({id(x) for x in bufs}) == 3  # streams 1, 2, 3: three regions
    assert all(x.numel() == ws.float_workspace_bytes for x in bufs)
    gpu.current = gpu.stream(2)
    run(a, 4)  # same stream as b's run: they are ordered, so they share stream 2's region
    assert gpu.log[-2][3] is bufs[1]
    assert bufs[0] is ws.float_workspace  # the first stream uses the workspace itself: no extra memory


def test_fa3_runs_use_no_extra_float_memory(gpu):
    ws = Workspace("cuda:0")
    a = plan(ws, [0, 4])
    gpu.current = gpu.stream(2)
    run(a, 4)
    ((_, _, stream, buf, _, _),) = [e for e in gpu.log if e[0] == "run"]
    assert stream == 2 and buf is ws.float_workspace  # not a region of its own for stream 2


# ---------------------------------------------------------------------------------------------------------------
# growth re-buffers free wrappers only
# ---------------------------------------------------------------------------------------------------------------

OVERFLOW = (
    "Buffer overflow when allocating memory for batch_prefill_tmp_v with size 5000 and alignment 16, "
    "but only 100 bytes available in AlignedAllocator. Increase the workspace buffer size."
)


def test_growth_leaves_live_plans_buffers_alone(gpu, monkeypatch):
    ws = Workspace("cuda:0", float_workspace_bytes=4096, max_float_workspace_bytes=1 << 20)
    live = plan(ws, [0, 4], backend="flashinfer-fa2")
    run(live, 4)
    done = plan(ws, [0, 4], backend="flashinfer-fa2")
    w_live, w_done = wrapper_of(live), wrapper_of(done)
    old = w_live._float_workspace_buffer
    del done
    gpu.finish()
    run(live, 4)  # queued again: live's work is pending
    gc.collect()
    fails = [1]
    real_plan = StandInWrapper.plan

    def overflowing(self, *args, **kwargs):
        if fails:
            fails.pop()
            raise RuntimeError(OVERFLOW)
        return real_plan(self, *args, **kwargs)

    monkeypatch.setattr(StandInWrapper, "plan", overflowing)
    grown = plan(ws, [0, 8], backend="flashinfer-fa2")  # the free wrapper (done's) is the one planned
    assert ws.float_workspace_bytes > 4096
    assert wrapper_of(grown) is w_done and w_done.resets and w_done.resets[-1] is ws.float_workspace
    assert w_live.resets == [] and w_live._float_workspace_buffer is old and old.numel() == 4096
    gpu.finish()
    del live
    gc.collect()
    again = plan(ws, [0, 2], backend="flashinfer-fa2")  # live's wrapper is free now: re-pointed at the new buffer
    assert wrapper_of(again) is w_live and w_live._float_workspace_buffer is ws.float_workspace


# ---------------------------------------------------------------------------------------------------------------
# the pool is locked (check-then-act race)
# ---------------------------------------------------------------------------------------------------------------


def test_threads_never_share_a_wrapper(gpu):
    ws = Workspace("cpu")  # a CPU workspace: no events involved, the pool logic alone
    factory = lambda buf, backend: object()  # noqa: E731

    class Owner:
        pass

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(1500):
            owners = [Owner() for _ in range(4)]
            got = [None] * 4
            barrier = threading.Barrier(4)

            def take(i):
                barrier.wait()
                got[i] = ws.acquire_wrapper("fa2", owners[i], factory)

            threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len({id(w) for w in got}) == 4, "one wrapper handed to two live plans"
            del owners
    finally:
        sys.setswitchinterval(old)


# ---------------------------------------------------------------------------------------------------------------
# a run captured into a CUDA graph keeps its wrapper
# ---------------------------------------------------------------------------------------------------------------


class Graph:
    pass


def test_captured_plan_is_retired_until_its_graph_is_gone(gpu):
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4], backend="flashinfer-fa2")
    w = wrapper_of(p)
    gpu.finish()  # torch.cuda.graph synchronizes before it captures
    graph = Graph()
    gpu.capturing, gpu.capturing_graph = True, graph  # torch names the graph being captured
    run(p, 4)  # no event is queried or recorded while capturing (the stand-in asserts it)
    gpu.capturing, gpu.capturing_graph = False, None
    captured_buf = [e for e in gpu.log if e[0] == "run"][-1][3]
    assert captured_buf is not ws.float_workspace  # fa2: a float workspace of its own (replays may overlap)
    fin = p.retain_for_graph(graph)  # registered after its capture
    del p
    gc.collect()
    gpu.finish()
    assert wrapper_of(plan(ws, [0, 4], backend="flashinfer-fa2")) is not w  # the graph may still replay it
    del graph
    gc.collect()
    assert not fin.alive
    gc.collect()
    assert wrapper_of(plan(ws, [0, 4], backend="flashinfer-fa2")) is not w  # its last replay may still be queued
    gpu.finish()
    gc.collect()
    assert wrapper_of(plan(ws, [0, 4], backend="flashinfer-fa2")) is w


def test_graph_collected_during_another_capture(gpu):
    """A graph garbage collected while a stream captures: no event is recorded then; the hand-back waits for the
    next plan, and the wrapper stays out of the pool until the event recorded then completes."""
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4])
    w = wrapper_of(p)
    gpu.finish()
    graph = Graph()
    gpu.capturing, gpu.capturing_graph = True, graph
    run(p, 4)
    gpu.capturing_graph = None  # a capture of another graph goes on
    p.retain_for_graph(graph)
    del graph, p
    gc.collect()  # the stand-in event asserts nothing is recorded or queried while capturing
    gpu.capturing = False
    assert wrapper_of(plan(ws, [0, 4])) is not w  # this plan records the hand-back's event; not complete yet
    gpu.finish()
    gc.collect()
    assert wrapper_of(plan(ws, [0, 4])) is w


def test_captured_without_owner_is_never_reused(gpu):
    """A capture nobody registers (and one torch names no graph for) retires the wrapper for good."""
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4])
    w = wrapper_of(p)
    gpu.finish()
    gpu.capturing = True
    run(p, 4)
    gpu.capturing = False
    del p
    gc.collect()
    gpu.finish()
    assert all(wrapper_of(plan(ws, [0, 4])) is not w for _ in range(3))
    # private: the pool's slots are the only view of a wrapper a captured run may still read (a race with replay)
    assert any(s.wrapper is w for s in ws._slots["fa3"])  # kept alive in the pool, not freed


# ---------------------------------------------------------------------------------------------------------------
# idle wrappers above a small bound are freed
# ---------------------------------------------------------------------------------------------------------------


def test_idle_wrappers_above_the_bound_are_freed(gpu):
    ws = Workspace("cuda:0", max_idle_wrappers=3)
    burst = [plan(ws, [0, 4]) for _ in range(20)]
    assert ws.wrappers_created == 20
    del burst
    gc.collect()
    gpu.finish()
    for _ in range(70):  # a steady loop of one plan at a time: the burst's other wrappers age out
        p = plan(ws, [0, 4])
        gpu.finish()
        del p
    assert ws.pooled_wrappers <= 1 + 3
    assert ws.wrappers_created == 20


def test_a_loop_cycling_many_wrappers_never_rebuilds_them(gpu):
    """Plans of 12 wrappers per step, the GPU one step behind: 24 wrappers cycle; none is freed and rebuilt."""
    ws = Workspace("cuda:0", max_idle_wrappers=3)
    previous = []
    for _ in range(30):
        step = [plan(ws, [0, 4]) for _ in range(12)]
        gpu.finish()  # the GPU catches up with the previous step only now
        previous = step
    assert ws.wrappers_created <= 24 and len(previous) == 12


def test_trim_frees_every_free_wrapper_beyond_the_bound(gpu):
    ws = Workspace("cuda:0", max_idle_wrappers=3)
    burst = [plan(ws, [0, 4]) for _ in range(6)]
    del burst
    gc.collect()
    gpu.finish()
    assert ws.trim() == 3 and ws.pooled_wrappers == 3


def test_busy_wrappers_are_never_freed(gpu):
    ws = Workspace("cuda:0", max_idle_wrappers=0)
    ps = [plan(ws, [0, 4]) for _ in range(3)]
    for p in ps:
        run(p, 4)
    del ps, p
    gc.collect()  # dropped, but their runs are queued
    assert ws.trim() == 0 and ws.pooled_wrappers == 3


# ---------------------------------------------------------------------------------------------------------------
# the vLLM adapter's per-step plans
# ---------------------------------------------------------------------------------------------------------------


def test_vllm_step_plans_replaced_while_the_gpu_runs_behind(gpu):
    plans_mod = pytest.importorskip("mla_bridge_vllm.plans")
    from mla_bridge.plan_cache import PlanCache
    from mla_bridge.ragged import indptr_from_lens

    ws = Workspace("cuda:0")
    cache = PlanCache(maxsize=2)  # one step's plans: a step's plans are dropped when the next one is planned

    def step(q_lens, ctx_lens):
        qo = indptr_from_lens(q_lens)
        chunk = plans_mod.ChunkIndptrs(0, qo, indptr_from_lens(ctx_lens))
        return plans_mod.PrefillStepPlans(
            qo,
            [chunk],
            num_heads=H,
            head_dim_qk=DQK,
            head_dim_vo=DVO,
            sm_scale=0.1,
            dtype=BF16,
            device="cuda:0",
            workspace=ws,
            cache=cache,
        )

    seen = []
    plans = None
    for q_lens in ([4, 2], [1, 1], [2, 3]):  # each step replaces the last one's plans (vLLM's metadata per step)
        plans = step(q_lens, [3, 5])
        seen.append({id(wrapper_of(plans.main)), id(wrapper_of(plans.chunks[0]))})
        run(plans.main, sum(q_lens))
        run(plans.chunks[0], sum(q_lens))
    # The GPU is still on step 1: step 3 (planned after step 1's plans were dropped) must not re-plan its wrappers.
    assert not seen[0] & seen[2] and not seen[1] & seen[2]
    sched = {id(w): w.schedule for w in StandInWrapper.instances}
    assert sorted(sched[i] for i in seen[0]) == [[0, 4, 6], [0, 4, 6]]
    gpu.finish()
    plans = step([1], [2])
    assert {id(wrapper_of(plans.main)), id(wrapper_of(plans.chunks[0]))} <= seen[0] | seen[1]


def test_a_dropped_workspace_keeps_wrappers_the_gpu_still_reads(gpu):
    """A one-shot call on a temporary workspace: the workspace is gone before the GPU ran the plan."""
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4])
    run(p, 4)
    w = weakref.ref(wrapper_of(p))
    StandInWrapper.instances.clear()  # the stand-ins' own records must not keep it alive
    gpu.log.clear()
    del p, ws
    gc.collect()
    assert w() is not None  # still alive: its copy and run are queued
    gpu.finish()
    Workspace("cuda:0").acquire_wrapper("fa3", gpu, lambda buf, backend: object())  # any later plan sweeps
    gc.collect()
    assert w() is None
