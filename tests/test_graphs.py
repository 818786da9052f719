"""The graph API (mla_bridge.graphs) on the CPU: it runs eagerly with results identical to eager mla_prefill /
RaggedPlan.run, reads its input buffers at each replay, and keeps the plans it was captured with (and their pooled
wrappers and float workspace) for as long as it can be replayed -- checked with a stand-in FlashInfer wrapper."""

from __future__ import annotations

import dataclasses

import gc
import weakref

import pytest
import torch

from mla_bridge import (
    BackendChoice,
    MLADims,
    PrefillPlan,
    RaggedPlan,
    Workspace,
    mla_prefill,
    plan_ragged,
    prepare_kv_b_proj,
)
from mla_bridge.backends import flashinfer as fi_backend
from mla_bridge.graphs import PrefillGraph, PrefillLayer, capture, capture_prefill
from mla_bridge.ragged import RaggedSpec

QUERY_LENS = [3, 4, 1, 0, 5]
CONTEXT_LENS = [0, 37, 5, 9, 20]
LAYERS = 3


def _layers(ref, dims, seed):
    """LAYERS layers sharing one block table, each with its own cache, weight and inputs."""
    batch = ref.make_mla_batch(dims, QUERY_LENS, CONTEXT_LENS, 8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(LAYERS):
        cache = batch.cache.clone()
        live = ~torch.isnan(cache)
        cache[live] = torch.randn(int(live.sum()), generator=g)  # the poisoned (NaN) slots stay poisoned
        w = torch.randn(dims.kv_b_proj_shape, generator=g) * dims.kv_lora_rank**-0.5
        layers.append(
            PrefillLayer(
                torch.randn(batch.q.shape, generator=g),
                torch.randn(batch.kv_c.shape, generator=g),
                torch.randn(batch.k_pe.shape, generator=g),
                prepare_kv_b_proj(w, dims),
                cache,
            )
        )
    return layers, batch.block_table


def _eager(layers, block_table, plan):
    return [
        mla_prefill(x.q, x.kv_c, x.k_pe, x.kv_b_proj, x.kv_cache, block_table, plan, return_lse=True) for x in layers
    ]


@pytest.mark.parametrize("fuse", [True, False])
def test_cpu_graph_runs_eagerly_with_identical_results(ref, tiny_dims, fuse):
    layers, table = _layers(ref, tiny_dims, seed=1)
    ws = Workspace("cpu", chunk_tokens=1000 if fuse else 16)
    plan = PrefillPlan.build(
        QUERY_LENS, CONTEXT_LENS, dims=tiny_dims, workspace=ws, block_size=8, dtype=torch.float32, fuse_context=fuse
    )
    assert plan.fused == fuse and (fuse or len(plan.chunks) > 1)
    graph = capture_prefill(plan, layers, table, return_lse=True)
    assert isinstance(graph, PrefillGraph) and not graph.graphed and graph.outputs is None
    assert graph.capture_ms == 0 and graph.memory_bytes == 0 and graph.plans == (plan,)
    got = graph.replay()
    want = _eager(layers, table, plan)
    assert len(got) == LAYERS and graph.replays == 1
    for (o, s), (eo, es) in zip(got, want):
        assert torch.equal(o, eo) and torch.equal(s, es)
    # a replay reads what the input buffers hold then
    g = torch.Generator().manual_seed(9)
    for x in layers:
        x.q.copy_(torch.randn(x.q.shape, generator=g))
        x.kv_c.copy_(torch.randn(x.kv_c.shape, generator=g))
    got = graph.replay()
    want2 = _eager(layers, table, plan)
    for (o, s), (eo, es), (old, _) in zip(got, want2, want):
        assert torch.equal(o, eo) and torch.equal(s, es) and not torch.equal(o, old)


def test_cpu_graph_of_ragged_plan_run(ref):
    q, k, v, qo, kv = ref.make_ragged([5, 3], [9, 3], 4, 24, 16, seed=2)
    plan = plan_ragged(
        qo,
        kv,
        num_heads=4,
        head_dim_qk=24,
        head_dim_vo=16,
        causal=True,
        sm_scale=0.2,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )
    out = torch.empty(8, 4, 16)
    lse = torch.empty(8, 4)
    graph = capture(lambda: plan.run(q, k, v, out=out, lse=lse), plans=[plan])
    got_out, got_lse = graph.replay()
    want_out, want_lse = plan.run(q, k, v)
    assert got_out is out and torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_bad_arguments(ref, tiny_dims):
    layers, table = _layers(ref, tiny_dims, seed=3)
    plan = PrefillPlan.build(
        QUERY_LENS, CONTEXT_LENS, dims=tiny_dims, workspace=Workspace("cpu"), block_size=8, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="^plans must name at least one"):
        capture(lambda: None, plans=[])
    with pytest.raises(TypeError, match=r"^plans\[0\] must be a PrefillPlan or a RaggedPlan"):
        capture(lambda: None, plans=[object()])
    with pytest.raises(TypeError, match="^fn must be callable"):
        capture(None, plans=[plan])
    with pytest.raises(ValueError, match="^warmup must be an int >= 0"):
        capture(lambda: None, plans=[plan], warmup=-1)
    with pytest.raises(TypeError, match=r"^layers\[1\] must be a PrefillLayer"):
        capture_prefill(plan, [layers[0], "layer"], table)
    with pytest.raises(ValueError, match="^layers must hold at least one"):
        capture_prefill(plan, [], table)
    with pytest.raises(TypeError, match="^plan must be a PrefillPlan"):
        capture_prefill(plan.main, layers, table)
    graph = capture_prefill(plan, layers, table)
    graph.replay()
    graph.release()
    assert not graph.alive
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()


def test_capture_prefill_refuses_a_bad_layer_at_capture_naming_it(ref, tiny_dims):
    """Every layer's inputs are checked against the plan when the graph is made, on every device, and the error names
    the layer: on the CPU nothing runs at capture, and a bad layer used to surface only at the first replay."""
    layers, table = _layers(ref, tiny_dims, seed=4)
    plan = PrefillPlan.build(
        QUERY_LENS, CONTEXT_LENS, dims=tiny_dims, workspace=Workspace("cpu"), block_size=8, dtype=torch.float32
    )
    bad_q = dataclasses.replace(layers[1], q=layers[1].q[:-1])
    with pytest.raises(ValueError, match=r"^layers\[1\]: q must be"):
        capture_prefill(plan, [layers[0], bad_q], table)
    half = dataclasses.replace(layers[0], kv_cache=layers[0].kv_cache.half())
    with pytest.raises(TypeError, match=r"^layers\[0\]: kv_cache"):
        capture_prefill(plan, [half, layers[1]], table)
    with pytest.raises(ValueError, match="block_table"):
        capture_prefill(plan, layers, table[:, :1])
    with pytest.raises(ValueError, match="kv_impl"):
        capture_prefill(plan, layers, table, kv_impl="no-such-impl")
    graph = capture_prefill(plan, layers, table)  # the good layers still capture and replay
    assert torch.equal(graph.replay()[0], _eager(layers, table, plan)[0][0])


# ----------------------------------------------------------------------------------------------- plan lifetime
class StandInWrapper:
    """FlashInfer's ragged wrapper, as far as the workspace and the graph see it (no kernels)."""

    def __init__(self, float_workspace, backend):
        self._int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self.plans = 0

    def plan(self, *args, **kwargs):
        self.plans += 1

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        pass


def _fa2_plan(ws):
    spec = RaggedSpec(
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        4,
        24,
        16,
        True,
        0.1,
        torch.bfloat16,
        torch.device("cpu"),
    )
    return RaggedPlan(spec, BackendChoice("flashinfer-fa2", "stand-in"), ws)


def test_graph_keeps_its_plan_wrapper_and_workspace(monkeypatch):
    monkeypatch.setattr(fi_backend, "new_wrapper", StandInWrapper)
    registered = []
    real_retain = RaggedPlan.retain_for_graph

    def spy(plan, graph, **kw):  # the plan-ownership API, recorded and then run
        registered.append((id(plan), id(graph)))
        return real_retain(plan, graph, **kw)

    monkeypatch.setattr(RaggedPlan, "retain_for_graph", spy)
    ws = Workspace("cpu", float_workspace_bytes=1024, max_float_workspace_bytes=1 << 20)
    plan_a = _fa2_plan(ws)
    wrapper_a = plan_a.flashinfer_wrapper
    graph = capture(lambda: None, plans=[plan_a])
    assert registered == [(id(plan_a), id(graph))]
    alive = weakref.ref(plan_a)
    float_ws = ws.float_workspace
    del plan_a
    gc.collect()
    assert alive() is not None  # the graph holds it
    # another plan on the same workspace never gets the graph's wrapper
    plan_b = _fa2_plan(ws)
    assert plan_b.flashinfer_wrapper is not wrapper_a and ws.wrappers_created == 2
    # a growth of the float workspace keeps the tensor the graph's kernels were captured against allocated
    held = weakref.ref(float_ws)
    del float_ws
    ws._grow(4096)
    gc.collect()
    assert held() is not None and held() is not ws.float_workspace
    # release() hands everything back at once, even while the graph object itself is still referenced
    graph.release()
    gc.collect()
    assert alive() is None and held() is None
    plan_c = _fa2_plan(ws)
    assert plan_c.flashinfer_wrapper is wrapper_a and ws.wrappers_created == 2


def test_chunks_sharing_a_plan_register_it_once(ref, tiny_dims, monkeypatch):
    registered = []
    monkeypatch.setattr(RaggedPlan, "retain_for_graph", lambda plan, graph, **kw: registered.append(plan))
    plan = PrefillPlan.build(
        [2] * 6, [8] * 6, dims=tiny_dims, workspace=Workspace("cpu", chunk_tokens=16), block_size=8, dtype=torch.float32
    )
    assert len(plan.chunks) == 3 and plan.num_plans == 2
    capture(lambda: None, plans=[plan])
    assert registered == [plan.main, plan.chunks[0].plan]


def test_dropping_the_graph_frees_its_plans(monkeypatch):
    monkeypatch.setattr(fi_backend, "new_wrapper", StandInWrapper)
    ws = Workspace("cpu")
    plan = _fa2_plan(ws)
    alive = weakref.ref(plan)
    graph = capture(lambda: None, plans=[plan])
    del plan
    gc.collect()
    assert alive() is not None
    del graph
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("tensor_scale", [False, True])
def test_capture_prefill_takes_an_fp8_cache_with_its_scale(ref, tiny_dims, tensor_scale):
    """PrefillLayer carries an FP8 cache's kv_cache_scale to every mla_prefill call of the graph (capture_prefill had
    no way to pass one, so an FP8 cache was refused at the first replay). The replay
    equals eager mla_prefill with the scale, bitwise."""
    from mla_bridge import quantize_latent_cache

    layers, table = _layers(ref, tiny_dims, seed=4)
    plan = PrefillPlan.build(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=tiny_dims,
        workspace=Workspace("cpu", chunk_tokens=16),
        block_size=8,
        dtype=torch.float32,
        kv_cache_dtype="fp8",
    )
    fp8 = []
    for x in layers:
        cache8, scale = quantize_latent_cache(x.kv_cache)
        fp8.append(PrefillLayer(x.q, x.kv_c, x.k_pe, x.kv_b_proj, cache8, scale if tensor_scale else float(scale)))
    got = capture_prefill(plan, fp8, table, return_lse=True).replay()
    for (o, s), x in zip(got, fp8):
        eo, es = mla_prefill(
            x.q, x.kv_c, x.k_pe, x.kv_b_proj, x.kv_cache, table, plan, return_lse=True, kv_cache_scale=x.kv_cache_scale
        )
        assert torch.equal(o, eo) and torch.equal(s, es)
    assert PrefillLayer(*layers[0].__dict__.values()).kv_cache_scale is None  # unquantized caches need none


# ------------------------------------------------------------------------------------- replays on other streams
class _Replayer:
    """A captured CUDA graph as far as PrefillGraph sees it: records the stream each replay was queued on."""

    def __init__(self, current):
        self.current, self.streams = current, []

    def replay(self):
        self.streams.append(self.current[0])


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replay_on_another_stream_keeps_what_it_reads_until_it_ran(monkeypatch, fuse, dtype):
    """A graph built and captured on one stream, replayed on another, then released (or dropped) on any stream:
    what the replays read must outlive them. The plan's device index tensors (allocated on the build stream by
    torch's caching allocator) are marked used on each replay stream at its first replay (record_stream: the
    allocator then waits for that stream's work queued when the plan is dropped), and the pooled FlashInfer wrappers
    go back to the pool only after an event recorded on every replay stream. Before, only eager runs marked their
    stream (PrefillPlan.order_on_current_stream) and the release recorded its event on the current stream alone: a
    graph replayed on stream s and dropped had its index block handed to the next allocation on the build stream
    while s still read it (bf16 fused: the expansion's buffer; float32, the torch backend: the chunks' kv_indptr
    copies, or the fused expansion)."""
    from tests.helpers.fake_device import Stream, install_planning

    install_planning(monkeypatch.setattr, StandInWrapper)  # a fake SM90 device with FlashInfer 0.7.4

    class Other(Stream):
        cuda_stream = 2

    build, other = Stream(), Other()
    current = [build]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    recorded = []

    class Event:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            recorded.append((self, stream))

        def query(self):
            return True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    marks = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: marks.append((t, s)), raising=False)
    ws = Workspace("cuda:0", chunk_tokens=64 if fuse else 8)
    dims = MLADims(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=56, qk_rope_head_dim=8, v_head_dim=64)
    plan = PrefillPlan.build([3, 4, 2], [10, 7, 0], dims=dims, workspace=ws, block_size=4, dtype=dtype)
    # private: the plan's device index tensors and the graph's held tensors are the only view of what queued work
    # reads, each of which a replay on another stream must mark (the race tested here)
    assert plan.fused == fuse and plan._device_indices
    assert plan.backend.is_flashinfer == (dtype == torch.bfloat16)
    leases = [
        rp._kernel.lease
        for rp in (plan.main, *(c.plan for c in plan.chunks if c.plan is not None))
        if hasattr(rp._kernel, "lease")
    ]
    assert len(leases) == (0 if dtype == torch.float32 else plan.num_plans)
    graph = PrefillGraph(lambda: None, [plan], plan.device)  # what capture() makes, with a stand-in CUDA graph
    graph.graphed, graph._graph = True, _Replayer(current)
    graph.replay()  # on the build stream: nothing to mark there
    assert not [s for _, s in marks if s is not build]
    current[0] = other
    for _ in range(3):
        graph.replay()
    assert graph._graph.streams == [build, other, other, other]
    on_other = [t for t, s in marks if s is other]
    held = [t for t in graph._held if isinstance(t, torch.Tensor)]
    assert len(on_other) == len(plan._device_indices) + len(held)  # once each, at the first replay there
    assert all(any(t is m for m in on_other) for t in plan._device_indices + held)
    # released on the build stream (or dropped there): each wrapper's event is recorded on both replay streams
    current[0] = build
    recorded.clear()
    graph.release()
    for lease in leases:
        streams = [s for e, s in recorded if any(e is x for x in lease.run_events.values())]
        assert sorted(s.cuda_stream for s in streams) == [build.cuda_stream, other.cuda_stream]
        assert lease.graph_holds == 0
