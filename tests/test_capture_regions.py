"""fa2's float workspace under CUDA graphs and threads, and which captures keep a pooled wrapper, on the CPU.

On the fake GPU of tests/helpers/async_fakes.py (recording stand-ins for streams, events and FlashInfer's wrapper), with
the current stream per thread. fa2 keeps split-KV partials in the float workspace its run is handed, at offsets
``plan()`` laid out for the buffer size it saw, so:

* a captured run gets a float region of its own, at least the size its plan was laid out against, and never one
  another capture (another graph) uses; the region is not kept by the wrapper (on CUDA it is allocated while the
  stream captures, from the graph's private pool, so the graph owns it);
* a run is handed the region of its own stream even while another thread runs the same plan on another stream: the
  region is an argument of the launch, never read back from the wrapper's one shared attribute;
* releasing a registered graph never hands back a wrapper that a capture nobody registered still replays.

The same faults on the H200 with the GPU kept busy: tests/gpu/test_gpu_capture_regions.py.
"""

from __future__ import annotations

import gc
import math
import threading
import types
import weakref

import pytest
import torch

import mla_bridge.dispatch as dispatch
from mla_bridge import Workspace
from mla_bridge.backends import flashinfer as fi_backend
from tests.helpers.async_fakes import (
    DVO,
    FakeGPU,
    H,
    StandInWrapper,
    graph_class,
    make_event_class,
    plan,
    run,
    tensors,
    wrapper_of,
)

FA2 = "flashinfer-fa2"


class ThreadGPU(FakeGPU):
    """The fake GPU with one current stream per thread, as CUDA's current stream is."""

    def __init__(self):
        self._tls = threading.local()
        self.launches: list = []
        super().__init__()

    @property
    def current(self):
        stream = getattr(self._tls, "stream", None)
        return stream if stream is not None else self.stream(1)

    @current.setter
    def current(self, stream):
        self._tls.stream = stream


class DirectStandIn:
    """FlashInfer 0.7.4's ragged wrapper with the structure the direct run depends on (``run`` builds ``run_args``
    from the wrapper's buffers and ends in ``self._cached_module.ragged_run(*run_args)``; "HN" goes through an NH
    temporary and a transpose), logging for each launch the thread, the stream and the float buffer it was handed.
    ``_float_workspace_buffer`` is a property so that a test can run code between the kernel's write of the
    attribute and its read (``on_read`` / ``on_write``)."""

    instances: list = []

    def __init__(self, gpu: ThreadGPU, float_workspace: torch.Tensor, backend: str):
        self.gpu, self.backend = gpu, backend
        self._fw = float_workspace
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)
        self._plan_info = None
        self._qo_indptr_buf = self._kv_indptr_buf = None
        self.planned_bytes = None
        self.on_read = self.on_write = None

        def ragged_run(fw, iw, info, q, k, v, qo, kv, out, lse, *rest):
            gpu.launches.append(
                dict(
                    thread=threading.get_ident(),
                    stream=gpu.current.cuda_stream,
                    fw=fw,
                    capturing=gpu.capturing,
                    planned=self.planned_bytes,
                )
            )
            out.copy_(q[..., :DVO].float() + 1)
            if lse is not None:
                lse.fill_(0.5)

        self._cached_module = types.SimpleNamespace(ragged_run=ragged_run)
        DirectStandIn.instances.append(self)

    @property
    def _float_workspace_buffer(self):
        if self.on_read is not None:
            self.on_read()
        return self._fw

    @_float_workspace_buffer.setter
    def _float_workspace_buffer(self, buf):
        self._fw = buf
        if self.on_write is not None:
            self.on_write()

    def plan(self, qo_indptr, kv_indptr, *args, **kwargs):
        self._plan_info = [qo_indptr.tolist()]
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr.clone(), kv_indptr.clone()
        self.planned_bytes = self._fw.numel()  # fa2's plan lays the partials out for this size

    def run(self, q, k, v, out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH"):
        nh = lse if lse_layout == "NH" or not return_lse else torch.empty(q.shape[0], q.shape[1])
        run_args = [
            self._float_workspace_buffer,
            self._int_workspace_buffer,
            self._plan_info,
            q,
            k,
            v,
            self._qo_indptr_buf,
            self._kv_indptr_buf,
            out,
            nh,
            0,
            0,
            -1,
            None,
        ]
        self._cached_module.ragged_run(*run_args)
        if return_lse:
            if lse_base == "ln":
                nh.mul_(math.log(2.0))
            if lse_layout == "HN":
                lse.copy_(nh.t())
        return (out, lse) if return_lse else out

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self._float_workspace_buffer = float_workspace_buffer


@pytest.fixture(params=["wrapper_run", "direct"])
def gpu(request, monkeypatch, fake_cuda_runtime):
    """A fake SM90 device whose FlashInfer wrapper is the stand-in of tests/helpers/async_fakes.py (every run through
    ``wrapper.run``) or :class:`DirectStandIn` (``lse_layout="NH"`` runs take the direct route)."""
    g = ThreadGPU()
    g.kind = request.param
    StandInWrapper.instances = []
    DirectStandIn.instances = []
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    fake_cuda_runtime(lambda: (9, 0), lambda: g.current, make_event_class(g), lambda: g.capturing)
    if request.param == "direct":
        monkeypatch.setattr(fi_backend, "new_wrapper", lambda buf, backend: DirectStandIn(g, buf, backend))
        real = fi_backend.DirectRun.record.__func__

        def record_on_cpu(cls, wrapper, shapes, dtype, device):  # the stand-ins of q/k/v: CPU tensors here
            return real(cls, wrapper, shapes, dtype, torch.device("cpu"))

        monkeypatch.setattr(fi_backend.DirectRun, "record", classmethod(record_on_cpu))
    else:
        monkeypatch.setattr(fi_backend, "new_wrapper", lambda buf, backend: StandInWrapper(g, buf, backend))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class(g))  # names the graph a capture goes into
    return g


def handed(gpu):
    """The float buffer of every launch so far, in order (either stand-in)."""
    if gpu.kind == "direct":
        return [x["fw"] for x in gpu.launches]
    return [e[3] for e in gpu.log if e[0] == "run"]


class Graph:
    """Stands for a torch.cuda.CUDAGraph (a weak-referenceable object whose lifetime is the graph's)."""


def capture(gpu, p, t, graph=None):
    """``p``'s run captured into ``graph`` (None: a capture torch names no graph for: a torch without
    ``CUDAGraph.get_currently_capturing_graph``, or one begun outside torch); returns the float buffer the captured
    run was handed."""
    gpu.finish()  # torch.cuda.graph synchronizes before it captures
    gpu.capturing, gpu.capturing_graph = True, graph
    try:
        run(p, t)
    finally:
        gpu.capturing, gpu.capturing_graph = False, None
    return handed(gpu)[-1]


# ---------------------------------------------------------------------------------------------------------------
# a captured run's float region: the plan's size, one per capture, not kept by the wrapper
# ---------------------------------------------------------------------------------------------------------------


def test_a_capture_after_growth_gets_a_region_the_plan_fits_in(gpu):
    """A pooled wrapper captured once, handed back, then planned again on a grown workspace and captured again: the
    second capture's region is at least the size its plan was laid out against (before: the first capture's region,
    kept by the wrapper, 4096 bytes, for a plan laid out in 16384)."""
    ws = Workspace("cuda:0", float_workspace_bytes=4096, max_float_workspace_bytes=1 << 20)
    p = plan(ws, [0, 4], backend=FA2)
    w = wrapper_of(p)
    first = Graph()
    p.retain_for_graph(first)
    small = capture(gpu, p, 4, first)
    assert small.numel() >= 4096 and small is not ws.float_workspace
    del p, first
    gc.collect()
    gpu.finish()
    ws._grow(16384)
    q = plan(ws, [0, 2, 5], backend=FA2)
    assert wrapper_of(q) is w  # the same pooled wrapper, planned now against the grown workspace
    second = Graph()
    q.retain_for_graph(second)
    region = capture(gpu, q, 5, second)
    assert region.numel() >= 16384, f"a plan laid out for 16384 bytes was captured with a {region.numel()}-byte region"
    assert region is not small


def test_two_graphs_of_one_plan_never_share_a_region(gpu):
    """Two graphs of one plan may be replayed at once (on two streams): each capture gets its own region, neither the
    workspace nor a stream's, and the wrapper keeps none of them (on CUDA the graph's private pool holds it)."""
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4], backend=FA2)
    run(p, 4)  # an eager run on stream 1: the workspace itself
    g1, g2 = Graph(), Graph()
    p.retain_for_graph(g1)
    p.retain_for_graph(g2)
    r1 = capture(gpu, p, 4, g1)
    r2 = capture(gpu, p, 4, g2)
    assert r1 is not r2, "two graphs of one plan were captured with one float region"
    assert r1.numel() == r2.numel() == ws.float_workspace_bytes
    # private: the per-stream regions have no public view; sharing one with a capture is the race tested here
    assert all(r is not ws.float_workspace and all(r is not x for x in ws._regions.values()) for r in (r1, r2))
    alive = weakref.ref(r1)
    del r1, r2
    gpu.log.clear()
    gpu.launches.clear()
    gc.collect()
    assert alive() is None, "the wrapper keeps a captured run's region (the graph should own it)"


def test_a_capture_of_fa3_allocates_no_region(gpu):
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4])
    assert p.backend.name == "flashinfer-fa3"
    buf = capture(gpu, p, 4, None)
    # private: the per-stream regions have no public view; that none was allocated is the guarantee tested here
    assert buf is ws.float_workspace and ws._regions == {}


# ---------------------------------------------------------------------------------------------------------------
# the region of the calling stream, whatever another thread does meanwhile
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lse_layout", ["NH", "HN"])
def test_two_threads_running_one_plan_get_their_own_streams_regions(gpu, lse_layout):
    """Thread A runs a plan on stream 2; while A's launch is being built, thread B runs the same plan on stream 3.
    Every launch must be handed its own stream's region. Before: each run wrote its region into the wrapper's one
    ``_float_workspace_buffer`` and the launch read it back, so A's kernel got B's region (the stand-in's
    attribute lets B run exactly between A's write and A's read; fixed code never reads it there, or holds B off)."""
    if gpu.kind != "direct":
        pytest.skip("the attribute hook is DirectStandIn's")
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4], backend=FA2)
    run(p, 4)  # records the direct call on stream 1
    w = wrapper_of(p)
    a_reads, b_wrote = threading.Event(), threading.Event()
    names, a_wrote = {}, []

    def on_read():  # A reads the attribute after writing it: let B run first
        if threading.current_thread() is names.get("a") and a_wrote:
            a_reads.set()
            b_wrote.wait(timeout=0.5)  # before: B writes its region now; fixed: B cannot (or A never reads here)

    def on_write():
        if threading.current_thread() is names.get("a"):
            a_wrote.append(True)
        elif threading.current_thread() is names.get("b"):
            b_wrote.set()

    w.on_read, w.on_write = on_read, on_write
    q, k, v = tensors(4)
    errors = []

    def go(ptr, wait_for=None):
        try:
            if wait_for is not None:
                wait_for.wait(timeout=0.5)
            gpu.current = gpu.stream(ptr)
            lse = torch.empty(4, H) if lse_layout == "NH" else torch.empty(H, 4)
            p._kernel.run(q, k, v, torch.empty(4, H, DVO, dtype=q.dtype), lse, lse_layout)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    a = threading.Thread(target=go, args=(2,))
    b = threading.Thread(target=go, args=(3, a_reads))
    names.update(a=a, b=b)
    before = len(gpu.launches)
    a.start()
    b.start()
    a.join()
    b.join()
    w.on_read = w.on_write = None
    assert errors == []
    launches = gpu.launches[before:]
    assert sorted(x["stream"] for x in launches) == [2, 3]
    for x in launches:
        assert x["fw"] is ws.float_region(x["stream"]), (
            f"a launch on stream {x['stream']} was handed another stream's float region"
        )


def test_the_attribute_is_never_left_pointing_at_a_stream_region(gpu):
    """Runs hand their region to the launch: the wrapper's attribute keeps the buffer it was planned against (what
    JAX's route and a later plan of the pooled wrapper read)."""
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4], backend=FA2)
    w = wrapper_of(p)
    planned = w._float_workspace_buffer
    for ptr in (1, 2, 3):
        gpu.current = gpu.stream(ptr)
        run(p, 4)
        out, lse = torch.empty(4, H, DVO, dtype=torch.bfloat16), torch.empty(H, 4)
        p._kernel.run(*tensors(4), out, lse, "HN")
    gpu.current = gpu.stream(1)
    assert w._float_workspace_buffer is planned
    assert [id(x) for x in handed(gpu)] == [id(ws.float_region(s)) for s in (1, 1, 2, 2, 3, 3)]


# ---------------------------------------------------------------------------------------------------------------
# registered graphs and captures nobody registered
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("own", ["unnamed", "named"])
def test_releasing_a_registered_graph_keeps_a_wrapper_another_capture_replays(gpu, own):
    """The user captures a plan into a graph of their own and never registers it; a second graph of the same plan is
    registered (RaggedPlan.retain_for_graph). Releasing the registered graph must leave the wrapper retired: the
    user's graph still replays its schedule. ``unnamed``: torch cannot say which graph captured (a torch without
    ``CUDAGraph.get_currently_capturing_graph``, or a capture made outside torch); ``named``: it can. Before: one
    ``captured`` flag for both, cleared when the registered graph went, and the next plan re-planned the wrapper."""
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4], backend=FA2)
    w = wrapper_of(p)
    users = Graph()
    capture(gpu, p, 4, users if own == "named" else None)
    registered = Graph()
    p.retain_for_graph(registered)
    capture(gpu, p, 4, registered)
    del p, registered
    gc.collect()
    gpu.finish()
    gc.collect()
    assert all(wrapper_of(plan(ws, [0, 4], backend=FA2)) is not w for _ in range(3)), (
        "the wrapper a user's own graph replays went back to the pool"
    )
    # private: the pool's slots are the only view of a wrapper a graph still replays (a race with its release)
    assert any(s.wrapper is w for s in ws._slots["fa2"])  # kept, not freed


@pytest.mark.parametrize("order", ["registered_first", "captured_first"])
def test_a_registered_graph_alone_hands_its_wrapper_back(gpu, order):
    """The counterpart: a graph registered before or after its capture (torch names the capturing graph) hands the
    wrapper back once it is gone and its last replay has completed."""
    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4], backend=FA2)
    w = wrapper_of(p)
    graph = Graph()
    if order == "registered_first":
        p.retain_for_graph(graph)
    capture(gpu, p, 4, graph)
    if order == "captured_first":
        p.retain_for_graph(graph)
    del p
    gc.collect()
    gpu.finish()
    assert wrapper_of(plan(ws, [0, 4], backend=FA2)) is not w  # the graph may still replay
    del graph
    gc.collect()
    assert wrapper_of(plan(ws, [0, 4], backend=FA2)) is not w  # its last replay may still be queued
    gpu.finish()
    gc.collect()
    assert wrapper_of(plan(ws, [0, 4], backend=FA2)) is w


def test_a_capture_under_capture_owner_belongs_to_that_graph(gpu):
    """mla_bridge.graphs.capture names its graph for the captures it makes (``capture_owner``), so they count as the
    registered graph's even where torch names no graph; a plan that graph did not register stays retired."""
    from mla_bridge.workspace import capture_owner

    ws = Workspace("cuda:0")
    p = plan(ws, [0, 4], backend=FA2)
    other = plan(ws, [0, 4], backend=FA2)
    wp, wo = wrapper_of(p), wrapper_of(other)
    graph = Graph()
    p.retain_for_graph(graph)  # `other` is used by the captured forward but not registered for this graph
    with capture_owner(graph):
        capture(gpu, p, 4, None)
        capture(gpu, other, 4, None)
    del p, other, graph
    gc.collect()
    gpu.finish()
    gc.collect()
    got = {wrapper_of(plan(ws, [0, 4], backend=FA2)) for _ in range(3)}
    assert wp in got and wo not in got
