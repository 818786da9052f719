"""The bench's timers on the GPU: a call that reads a device value on the host (a mask checked once per forward, a
``block_until_ready``) is timed as the latency a user measures when asked (``latency=True``), not charged the
overlapped timer's spin, which it has to wait out.

Marked ``gpu``:
    .venv/bin/python -m pytest tests/gpu/test_gpu_bench_timing.py -q -m gpu
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge.bench.common import Ctx  # noqa: E402


def _ctx() -> Ctx:
    from rich.console import Console

    return Ctx(
        device=torch.device("cuda"),
        quick=True,
        repeats=5,
        warmup=1,
        seed=0,
        backend=None,
        skip=set(),
        budget_s=None,
        console=Console(quiet=True),
    )


def test_latency_timing_is_the_wall_time_of_a_call_that_reads_the_device():
    x = torch.ones(1, device="cuda")

    def call() -> None:  # about 2 ms of GPU work, then a host read of its result
        torch.cuda._sleep(4_000_000)
        float((x + 1).item())

    wall = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    want = statistics.median(wall)
    ctx = _ctx()
    latency = ctx.measure_many("ttft", "case", [("call", call, {})], latency=True)[0]
    overlapped = ctx.measure_many("ttft", "case", [("call", call, {})])[0]
    assert latency.status == "ok" and latency.extra["timing"] == "latency"
    assert latency.ms == pytest.approx(want, rel=0.3), (latency.ms, wall)
    # the overlapped timer's host time holds the spin before the call (at least 1 ms, 3x the host time before)
    assert overlapped.extra["timing"] == "overlapped" and overlapped.ms > want + 1.0, (overlapped.ms, want)
