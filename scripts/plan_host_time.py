"""Our own host time in PrefillPlan.build, on a machine without a GPU or on one.

What the H200 bench section ``plan`` measures: build time minus the time inside FlashInfer's ``plan()``, here on the
fake SM90 device of the CPU tests (:func:`tests.helpers.fake_device.install_planning`: every CUDA branch of planning
runs and the wrapper's ``plan()`` does nothing). The device half of the fused schedule's index expansion is queued
work on a GPU (host time: its copy and launches); here it returns a view of one buffer, so that no per-token CPU work
is timed. The chunked case (batch 128 with context) expands nothing on CUDA: its chunks' rows are their passes'
device kv_indptrs (on the fake device the plan's own copy stands in for FlashInfer's, a CPU tensor).

    PYTHONPATH=$PWD python3 scripts/plan_host_time.py [--repeats 200] [--profile B,C] [--count] [--expand triton]
    PYTHONPATH=$PWD python3 scripts/plan_host_time.py --device cuda    # on a GPU: the real figures

``--device cuda`` times the same cases on the real GPU (FlashInfer's ``plan()`` timed apart as the bench does),
with the Triton expansion and with the torch ops (builds alternating between them per case), and prints own /
FlashInfer ``plan()`` time.

``--count`` adds, per case, the CUDA-side calls one build makes (after a warm-up build; the device half of the
index expansion then runs as on a GPU on CPU tensors: ``--expand triton``, the default and what a GPU with Triton
runs, its one kernel counted as one "Triton launch" (:func:`tests.helpers.fake_device.expand_kernel_on_cpu` computes
its values outside torch); ``--expand torch``, the fallback's torch ops): kernels and copies (aten ops that are not
views, the page-locked table, ``Tensor.to``, the Triton launch) and CUDA runtime calls (events made, recorded,
queried, waited on; the capability, capture-state and current-stream reads). Each costs 10-20 us of host time on the
H200's host (2026-12-01; a Triton launch through :func:`mla_bridge.kernels.launch.launch` about 10 us), a Python
statement 0.05-0.2 us, so the count predicts what the GPU host saves.

Numbers are medians in milliseconds. This machine's Python is not the H200 host's, and CUDA launches are not in them,
so compare before/after here and take the absolute figures from ``mla-bridge bench --sections plan`` on the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import gc
import pstats
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_bridge.plan as plan_mod
from mla_bridge import MLADims, PrefillPlan, Workspace
from tests.helpers.fake_device import Stream, install_planning

CASES = [(b, c) for c in (0, 2048) for b in (1, 16, 128)]


class _Wrapper:
    """FlashInfer's ragged wrapper as far as planning goes, with a plan() that does nothing."""

    def __init__(self, buf, backend):
        self._float_workspace_buffer = buf
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)

    def plan(self, *args, **kwargs):
        pass


def build_samples(ws: Workspace, dims: MLADims, batch: int, context: int, repeats: int):
    """``repeats`` builds of the case after one warm-up build, gc paused: the build times and the time inside
    FlashInfer's ``plan()`` of each (ms), and the last plan."""
    in_plan = [0.0]
    plan_with_growth = ws.plan_with_growth

    def timed(fn, *args, **kwargs):  # what the bench times apart as FlashInfer's
        t = time.perf_counter()
        try:
            return plan_with_growth(fn, *args, **kwargs)
        finally:
            in_plan[0] += time.perf_counter() - t

    ws.plan_with_growth = timed
    q, c = [512] * batch, [context] * batch
    build = lambda: PrefillPlan.build(q, c, dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)  # noqa
    plan = build()
    builds, plans = [], []
    gc.disable()
    try:
        for _ in range(repeats):
            plan = None  # the last plan hands its wrappers back first, as in a serving loop
            in_plan[0] = 0.0
            t = time.perf_counter()
            plan = build()
            builds.append((time.perf_counter() - t) * 1e3)
            plans.append(in_plan[0] * 1e3)
    finally:
        gc.enable()
        ws.plan_with_growth = plan_with_growth
    return builds, plans, plan


class _CountOps(TorchDispatchMode):
    """Counts the aten ops that are not views (each a kernel launch or copy on a GPU)."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _counting(counts: collections.Counter) -> None:
    """Count every CUDA runtime stand-in of the fake device, the page-locked tables and ``Tensor.to`` (a script: not
    undone)."""

    def counted(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counts[label] += 1
            return fn(*args, **kwargs)

        setattr(owner, name, wrapper)

    for name in ("get_device_capability", "is_current_stream_capturing", "current_stream"):
        counted(torch.cuda, name, f"torch.cuda.{name}")
    counted(plan_mod, "_page_locked", "page-locked table")
    counted(plan_mod, "_launch_expand", "Triton launch")
    counted(torch.Tensor, "to", "Tensor.to")
    event = torch.cuda.Event
    for name in ("record", "query"):
        counted(event, name, f"Event.{name}")
    counted(event, "__init__", "Event() made")
    counted(Stream, "wait_event", "Stream.wait_event")


def count_calls(ws: Workspace, dims: MLADims, batch: int, context: int, counts: collections.Counter) -> dict:
    """The CUDA-side calls of one build of the case (after a warm-up build whose plan is dropped first)."""
    q, c = [512] * batch, [context] * batch
    build = lambda: PrefillPlan.build(q, c, dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)  # noqa
    gc.collect()  # earlier workspaces collected now, their wrappers swept (events queried) by the warm-up build
    plan = build()
    plan = None  # noqa: F841 - the warm-up plan hands its wrappers back, as in a serving loop
    gc.disable()  # no finalizer of an earlier plan or workspace inside the counted build
    try:
        counts.clear()
        with _CountOps(counts):
            plan = build()  # noqa: F841
    finally:
        gc.enable()
    return dict(counts)


def _print_times(ws: Workspace, dims: MLADims, repeats: int, impls: tuple = (), rounds: int = 5) -> None:
    """One line per case (and per device half of the expansion in ``impls``, on a real GPU), medians over
    ``repeats`` builds: the build, our own host time (build minus FlashInfer's ``plan()``, per build as the bench
    takes it) and, on a real GPU, own / FlashInfer ``plan()``. With several ``impls`` the builds alternate between
    them in ``rounds`` rounds per case, so that none is measured first while the process warms up (measured on the
    H200's host, 2026-12-02: the first of two halves run one after the other took 1.7x the second's time on batches
    without context, where both run the same code)."""
    rounds = rounds if len(impls) > 1 else 1
    for b, c in CASES:
        samples = {impl: ([], []) for impl in impls or ("",)}
        for _ in range(rounds):
            for impl in samples:
                if impl:
                    plan_mod._expand_impl = lambda device, impl=impl: impl  # a script: nothing is undone
                builds, plans, plan = build_samples(ws, dims, b, c, max(1, repeats // rounds))
                samples[impl][0].extend(builds)
                samples[impl][1].extend(plans)
        sched = "fused" if plan.fused else f"{len(plan.chunks)} chunks" if plan.chunks else "no context"
        for impl, (builds, plans) in samples.items():
            own = statistics.median(t - f for t, f in zip(builds, plans))
            in_plan = statistics.median(plans)
            ratio = f", own / FlashInfer plan() {own / in_plan:.3f}" if impl and in_plan > 0 else ""
            label = f"[{impl}] " if impl else ""
            print(
                f"B={b:<3} C={c:<4} {label}build {statistics.median(builds):.3f} ms, own {own:.3f} ms{ratio}  "
                f"({sched}, {plan.num_plans} plan(s), {plan.backend.name})"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--profile", default=None, help="B,C: cProfile 200 builds of that case")
    p.add_argument("--count", action="store_true", help="count the CUDA-side calls of one build per case")
    p.add_argument(
        "--expand",
        choices=("triton", "torch"),
        default="triton",
        help="the device half of the index expansion on the fake device (default triton: what a GPU with Triton runs)",
    )
    p.add_argument(
        "--device",
        choices=("fake", "cuda"),
        default="fake",
        help="fake: the CPU tests' fake SM90 device (default); cuda: the real GPU (FlashInfer's plan() "
        "runs and is timed apart; both device halves of the expansion, triton and torch, alternating)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    dims = MLADims.deepseek_v2_lite()
    if args.device == "cuda":
        if args.count or args.profile:
            p.error("--count and --profile run on the fake device only")
        _print_times(Workspace("cuda:0"), dims, args.repeats, impls=("triton", "torch"))
        return
    install_planning(setattr, _Wrapper, expand=args.expand)  # a script: nothing is undone
    names = ("_expand_on_device", "_expand_on_device_triton")
    device_halves = [getattr(plan_mod, name) for name in names]
    buf = torch.empty(4 * 128 * (512 + 2048), dtype=torch.int64)  # more than any case expands, allocated once
    for name in names:
        setattr(plan_mod, name, lambda table, total, counting, device: (buf[:total], torch.from_numpy(table)))
    ws = Workspace("cuda:0")
    _print_times(ws, dims, args.repeats)
    if args.profile:
        b, c = map(int, args.profile.split(","))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            PrefillPlan.build([512] * b, [c] * b, dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    if args.count:  # last: the counting wrappers cost time too
        for name, device_half in zip(names, device_halves):
            setattr(plan_mod, name, device_half)
        counts: collections.Counter = collections.Counter()
        _counting(counts)
        ws = Workspace("cuda:0")
        for b, c in CASES:
            got = count_calls(ws, dims, b, c, counts)
            print(
                f"B={b:<3} C={c:<4} CUDA-side calls per build: {sum(got.values())}  "
                + ", ".join(f"{k} {v}" for k, v in sorted(got.items()))
            )


if __name__ == "__main__":
    main()
