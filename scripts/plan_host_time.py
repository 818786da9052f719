"""Our own host time in PrefillPlan.build, on a machine without a GPU (issue 13, item 5).

What the H200 bench section ``plan`` measures: build time minus the time inside FlashInfer's ``plan()``, here on the
fake SM90 device of the CPU tests (:func:`tests.fake_device.install_planning`: every CUDA branch of planning runs and
the wrapper's ``plan()`` does nothing). The device halves of the index expansion are queued kernels on a GPU (host
time: their launches); here they return views of one buffer, so that no per-token CPU work is timed.

    PYTHONPATH=$PWD python3 scripts/plan_host_time.py [--repeats 200] [--profile B,C]

Numbers are medians in milliseconds. This machine's Python is not the H200 host's, and CUDA launches are not in them,
so compare before/after here and take the absolute figures from ``mla-bridge bench --sections plan`` on the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time

import torch

import mla_bridge.plan as plan_mod
from mla_bridge import MLADims, PrefillPlan, Workspace
from tests.fake_device import install_planning

CASES = [(b, c) for c in (0, 2048) for b in (1, 16, 128)]


class _Wrapper:
    """FlashInfer's ragged wrapper as far as planning goes, with a plan() that does nothing."""

    def __init__(self, buf, backend):
        self._float_workspace_buffer = buf
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)

    def plan(self, *args, **kwargs):
        pass


def own_ms(ws: Workspace, dims: MLADims, batch: int, context: int, repeats: int):
    """Median (build, time inside plan()) in ms over ``repeats`` builds, gc paused, and the last plan."""
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
    return statistics.median(builds), statistics.median(plans), plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--profile", default=None, help="B,C: cProfile 200 builds of that case")
    args = p.parse_args()
    torch.set_num_threads(1)
    install_planning(setattr, _Wrapper)  # a script: nothing is undone
    buf = torch.empty(4 * 128 * (512 + 2048), dtype=torch.int64)  # more than any case expands, allocated once
    plan_mod._expand_on_device = lambda table, total, counting, device: (buf[:total], torch.from_numpy(table))
    plan_mod._context_stream_on_device = lambda cum, total, device: (buf[:total], buf[:total], torch.from_numpy(cum))
    dims = MLADims.deepseek_v2_lite()
    ws = Workspace("cuda:0")
    for b, c in CASES:
        build, in_plan, plan = own_ms(ws, dims, b, c, args.repeats)
        sched = "fused" if plan.fused else f"{len(plan.chunks)} chunks" if plan.chunks else "no context"
        print(f"B={b:<3} C={c:<4} build {build:.3f} ms, own {build - in_plan:.3f} ms  ({sched}, {plan.num_plans} "
              f"plan(s), {plan.backend.name})")
    if args.profile:
        b, c = map(int, args.profile.split(","))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            PrefillPlan.build([512] * b, [c] * b, dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
