"""fa2's float workspace under CUDA graphs and threads, and which captures keep a pooled wrapper, on the GPU.

fa2 writes split-KV partials into the float workspace it is handed, at offsets its ``plan()`` laid out for the buffer
size it saw. The batches below make fa2 split the keys (few queries over thousands of keys), so the partials are
really written there. Each result is compared bit for bit with the same plan's run alone (same schedule, so the same
bits), with the GPU kept busy (``torch.cuda._sleep``) so that the host runs ahead and the streams overlap:

* a graph captured after the workspace grew, on a wrapper an earlier graph had captured, gets a region its plan fits
  in (before: the earlier capture's region, too small; the partials ran past its end into the graph's outputs);
* two graphs of one plan replayed at once on two streams (before: one shared region, 59 of 60 iterations differed);
* a memory check: a graph of several runs of one fa2 plan holds one region, in its own private pool;
* one plan run from two threads on two streams, ``lse_layout`` "NH" (direct call) and "HN" (``wrapper.run``) (before:
  a run could be handed the other thread's region: 4 of 37,864 NH runs, 378 of 32,130 HN runs differed);
* a user's own, unregistered ``torch.cuda.graph`` capture of a plan keeps its wrapper after a registered graph of the
  same plan is released (before: the wrapper was re-planned under the user's graph, error about 4).

CPU counterparts (bookkeeping, with stand-ins): tests/test_capture_regions.py. Marked ``gpu`` (skipped without CUDA
and FlashInfer). On the H200:
    python3 -m pytest tests/gpu/test_gpu_capture_regions.py -q -m gpu
"""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import Workspace  # noqa: E402
from mla_bridge.graphs import capture  # noqa: E402
from tests.helpers.gpu_cases import BACKENDS, SLEEP, TOL, Case, captured, cases, require  # noqa: E402

FA2 = "flashinfer-fa2"


def _alone(plan, case, lse_layout="NH"):
    """The plan's own run, synchronized: what every other run of it must give bit for bit."""
    out, lse = plan.run(case.q, case.k, case.v, lse_layout=lse_layout)
    torch.cuda.synchronize()
    return out.clone(), lse.clone()


def _same(got, want) -> bool:
    return torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_graph_captured_after_growth_gets_a_region_its_plan_fits_in():
    """A wrapper captured by a first graph while the workspace was 64 KiB, handed back, planned again for a split-KV
    batch after the workspace grew, and captured by a second graph (both graphs in one private pool, as
    ``capture(pool=...)`` allows for graphs never replayed together). Before: the second capture reused the first
    one's 64 KiB region and the partials ran past its end, over the outputs the second graph allocated after it."""
    require(FA2)
    tiny = Case(FA2, [16], [16], True, 8)  # 16 keys: nothing to split, no partials: fits in 64 KiB
    split = Case(FA2, [16], [8192], False, 9)  # 16 queries over 8192 keys: split-KV partials
    ws = Workspace(torch.device("cuda", torch.cuda.current_device()), float_workspace_bytes=64 * 1024)
    made = []
    new_buffer = ws._new_float_buffer

    def spy(nbytes):  # every float buffer the workspace makes: (while capturing?, bytes)
        made.append((torch.cuda.is_current_stream_capturing(), nbytes))
        return new_buffer(nbytes)

    ws._new_float_buffer = spy
    pool = torch.cuda.graph_pool_handle()
    first_plan = tiny.plan(ws)
    assert ws.float_workspace_bytes == 64 * 1024, "precondition: the first plan must fit in 64 KiB"
    wrapper = first_plan.flashinfer_wrapper
    # out / lse outside the graph: the first capture allocates nothing from the pool but fa2's float region, so what
    # the second capture allocates (its out and lse) comes right after that region in the pool's segment
    static = (torch.empty_like(tiny.ref), torch.empty_like(tiny.ref_lse))
    first = capture(
        lambda: first_plan.run(tiny.q, tiny.k, tiny.v, out=static[0], lse=static[1]), plans=[first_plan], pool=pool
    )
    first.replay()
    first.release()
    del first_plan
    gc.collect()
    torch.cuda.synchronize()
    second_plan = split.plan(ws)  # grows the workspace (FlashInfer reports the overflow) and takes the freed wrapper
    planned = ws.float_workspace_bytes
    assert planned > 64 * 1024 and second_plan.flashinfer_wrapper is wrapper
    want = _alone(second_plan, split)
    made.clear()
    second = capture(lambda: second_plan.run(split.q, split.k, split.v), plans=[second_plan], pool=pool)
    captured = [n for capturing, n in made if capturing]
    assert captured and min(captured) >= planned, (
        f"the captured run's float region: {captured} bytes, for a plan laid out in {planned}"
    )
    wrong = 0
    for _ in range(5):
        torch.cuda._sleep(SLEEP)
        got = second.replay()
        torch.cuda.synchronize()
        wrong += not _same(got, want)
    assert wrong == 0, f"{wrong} of 5 replays differ from the plan's run alone"


def test_two_graphs_of_one_fa2_plan_replayed_at_once_on_two_streams():
    require(FA2)
    case = Case(FA2, [16, 16], [4096, 8192], False, 5)
    plan = case.plan(Workspace(torch.device("cuda", torch.cuda.current_device())))
    want = _alone(plan, case)
    outs = [(torch.empty_like(want[0]), torch.empty_like(want[1])) for _ in range(2)]
    graphs = [capture(lambda o=o, s=s: plan.run(case.q, case.k, case.v, out=o, lse=s), plans=[plan]) for o, s in outs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    wrong = []
    for i in range(60):
        for o, s in outs:
            o.zero_()
            s.zero_()
        torch.cuda._sleep(int(1e6))  # both streams start together, after this
        for stream, graph in zip(streams, graphs):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.synchronize()
        if not all(_same(got, want) for got in outs):
            wrong.append(i)
    assert wrong == [], f"{len(wrong)} of 60 iterations differ from the plan's run alone"  # before: 59 of 60


def test_a_graph_of_several_fa2_runs_holds_one_region_in_its_own_pool():
    """Each captured run allocates its region from the graph's private pool and frees it once recorded, so the
    next run of the capture reuses it: a graph of three runs reserves one region (not three), and does reserve it
    (the graph owns it)."""
    require(FA2)
    case = Case(FA2, [16, 16], [4096, 8192], False, 5)
    ws = Workspace(torch.device("cuda", torch.cuda.current_device()))
    plan = case.plan(ws)
    want = _alone(plan, case)
    region = ws.float_workspace_bytes
    graph = capture(lambda: [plan.run(case.q, case.k, case.v) for _ in range(3)], plans=[plan])
    assert region <= graph.memory_bytes < 2 * region, (graph.memory_bytes, region)
    torch.cuda._sleep(SLEEP)
    got = graph.replay()
    torch.cuda.synchronize()
    assert all(_same(x, want) for x in got)


@pytest.mark.parametrize("lse_layout", ["NH", "HN"])
def test_one_fa2_plan_run_from_two_threads_on_two_streams(lse_layout):
    """Two threads run one plan, each on its own stream, the GPU busy so that both streams' runs overlap; the
    interpreter switches threads every microsecond so that one thread's run often starts while the other's is
    being built."""
    require(FA2)
    case = Case(FA2, [16, 16], [4096, 8192], False, 5)
    plan = case.plan(Workspace(torch.device("cuda", torch.cuda.current_device())))
    want = _alone(plan, case, lse_layout)
    runs = 1500
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results: list = [[], []]
    errors: list = []
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            with torch.cuda.stream(streams[i]):
                torch.cuda._sleep(SLEEP)  # the host runs ahead: every run below is queued behind this
                barrier.wait()
                for _ in range(runs):
                    results[i].append(plan.run(case.q, case.k, case.v, lse_layout=lse_layout))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    torch.cuda.synchronize()
    assert errors == []
    wrong = sum(not _same(got, want) for r in results for got in r)
    assert wrong == 0, f"{wrong} of {2 * runs} runs differ from the plan's run alone"


@pytest.mark.parametrize("backend", BACKENDS)
def test_releasing_a_registered_graph_keeps_the_wrapper_a_users_own_graph_replays(backend):
    require(backend)
    a, b, c = cases(backend)
    ws = Workspace(torch.device("cuda", torch.cuda.current_device()))
    plan = a.plan(ws)
    own, out = captured(plan, a)  # the user's own torch.cuda.graph, never registered
    registered = capture(lambda: plan.run(a.q, a.k, a.v), plans=[plan])
    registered.replay()
    registered.release()
    del plan, registered
    gc.collect()
    torch.cuda.synchronize()  # the registered graph's replays are done: only the user's graph holds the wrapper now
    torch.cuda._sleep(SLEEP)
    others = [(case, case.plan(ws)) for case in (b, c)]  # before: the first one re-planned the user's graph's wrapper
    other_outs = [(case, p.run(case.q, case.k, case.v)[0]) for case, p in others]
    out.zero_()
    own.replay()
    torch.cuda.synchronize()
    assert a.error(out) < TOL  # before: error about 4
    assert max(case.error(o) for case, o in other_outs) < TOL
    assert ws.wrappers_created == 3
