"""mla_bridge.profiling: phase times that add up, host gaps apart.

The CUDA path is checked on the CPU against a model GPU: a clock per side, kernels that start no earlier than they
are issued, CUDA events stamped when the model GPU reaches them, ``torch.cuda._sleep`` as GPU time. A layer of
known kernel and host costs must come out as its kernels' GPU times (busy-ahead), with the host costs as gaps.
"""

from __future__ import annotations

import types

import pytest
import torch

from mla_bridge import profiling
from mla_bridge.profiling import PhaseTimer, time_phases


class ModelGPU:
    """A host clock and a GPU clock (ms). ``kernel(gpu_ms, host_ms)``: the host spends host_ms issuing, then the
    GPU runs gpu_ms from max(its clock, the issue time)."""

    def __init__(self):
        self.host = 0.0
        self.gpu = 0.0

    def kernel(self, gpu_ms: float, host_ms: float) -> None:
        self.host += host_ms
        self.gpu = max(self.gpu, self.host) + gpu_ms

    def sleep(self, cycles: int) -> None:
        self.kernel(cycles / profiling._CYCLES_PER_MS, 0.0)

    def install(self, monkeypatch):
        model = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                model.gpu = max(model.gpu, model.host)
                self.t = model.gpu

            def query(self):
                return self.t <= model.host

            def elapsed_time(self, other):
                return other.t - self.t

        def synchronize(device=None):
            model.host = max(model.host, model.gpu)

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleep)
        monkeypatch.setattr(profiling, "time", types.SimpleNamespace(perf_counter=lambda: model.host / 1e3))
        return self


# (phase, GPU ms, host ms to issue): the up-projection is host-bound (issuing takes longer than running)
LAYER = (
    ("gather", 0.5, 0.2),
    ("up-projection", 1.0, 1.5),
    ("main pass", 3.0, 0.1),
    ("context chunk", 0.4, 0.3),
    ("merge", 0.1, 0.05),
    ("context chunk", 0.4, 0.3),
    ("merge", 0.1, 0.05),
)


def model_layer(gpu: ModelGPU):
    def run(hook):
        for name, g, h in LAYER:
            hook(name)
            gpu.kernel(g, h)
        hook("end")
        return "result"

    return run


def test_busy_ahead_phases_are_gpu_time_and_gaps_apart(monkeypatch):
    gpu = ModelGPU().install(monkeypatch)
    times, result = time_phases(model_layer(gpu), torch.device("cuda"), layers=3)
    assert result == "result"
    expect = {"gather": 0.5, "up-projection": 1.0, "main pass": 3.0, "context chunk": 0.8, "merge": 0.2}
    assert times.phases_ms == pytest.approx(expect)
    assert list(times.phases_ms) == list(expect)  # phase order kept
    assert times.sum_ms == pytest.approx(5.5) and times.samples_ms == pytest.approx([5.5] * 3)
    assert times.passes == {"gather": 1, "up-projection": 1, "main pass": 1, "context chunk": 2, "merge": 2}
    assert times.host_ran_ahead is True
    assert times.host_ms == pytest.approx(
        {"gather": 0.2, "up-projection": 1.5, "main pass": 0.1, "context chunk": 0.6, "merge": 0.1}
    )
    # On the idle GPU each wait for the host is a gap: 0.2 ms before the gather's kernel, and 1.0 ms before the
    # up-projection's (issued 1.5 ms after the gather's ended 0.5 ms in); the GPU is ahead from then on.
    assert times.gap_ms == pytest.approx(
        {"gather": 0.2, "up-projection": 1.0, "main pass": 0.0, "context chunk": 0.0, "merge": 0.0}
    )
    assert times.idle_layer_ms == pytest.approx(times.sum_ms + sum(times.gap_ms.values()))
    assert "CUDA events" in times.method and "gap_ms" in times.method
    d = times.to_dict()
    assert d["phases_ms"] == times.phases_ms and d["method"] == times.method


def test_without_the_busy_gpu_phases_would_carry_host_gaps(monkeypatch):
    """The fault of the old CLI breakdown: events on an idle GPU put the host's issue time into the phases."""
    gpu = ModelGPU().install(monkeypatch)
    timer = PhaseTimer(torch.device("cuda"))
    model_layer(gpu)(timer.hook)
    (per,) = timer.layers()
    assert per["up-projection"][0] == pytest.approx(2.0)  # not its 1.0 ms of GPU work
    assert sum(v[0] for v in per.values()) > 5.5


def test_host_not_ahead_is_reported(monkeypatch):
    gpu = ModelGPU().install(monkeypatch)
    times, _ = time_phases(model_layer(gpu), torch.device("cuda"), layers=2, busy_ms=0.0)
    assert times.host_ran_ahead is False


def test_labels_group_phases_cpu(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(profiling, "time", types.SimpleNamespace(perf_counter=lambda: next(clock) / 1e3))
    timer = PhaseTimer("cpu", labels={"gather": "g+u", "up-projection": "g+u"})
    for name in ("gather", "up-projection", "main pass", "end", "gather", "up-projection", "main pass", "end"):
        timer.hook(name)
    layers = timer.layers()
    assert len(layers) == 2
    assert layers[0] == {"g+u": (2.0, 2.0, 2), "main pass": (1.0, 1.0, 1)}


def test_cpu_time_phases_tile_the_layer():
    calls = []

    def run(hook):
        for name in ("gather", "main pass"):
            hook(name)
            sum(range(20000))
        hook("end")
        calls.append(1)
        return len(calls)

    times, last = time_phases(run, "cpu", layers=2)
    assert last == 2 and len(calls) == 2  # no idle layer on the CPU
    assert set(times.phases_ms) == {"gather", "main pass"} and all(v > 0 for v in times.phases_ms.values())
    assert times.gap_ms == {} and times.host_ran_ahead is None and times.idle_layer_ms is None
    assert times.phases_ms == times.host_ms and "perf_counter" in times.method


def test_a_layer_that_never_ends_is_an_error():
    with pytest.raises(RuntimeError, match="'end'"):
        time_phases(lambda hook: hook("gather"), "cpu", layers=1)
    with pytest.raises(ValueError, match="layers"):
        time_phases(lambda hook: None, "cpu", layers=0)


def test_mla_prefill_phases_on_cpu(tiny_dims, ref):
    """The real pipeline through the shared timer: the phases of a chunked layer, each context chunk and merge
    counted, and the output the same as an uninstrumented call."""
    from mla_bridge import PrefillPlan, Workspace, mla_prefill

    b = ref.make_mla_batch(tiny_dims, [3, 5], [7, 9], 4)
    plan = PrefillPlan.build(
        b.query_lens,
        b.context_lens,
        dims=tiny_dims,
        workspace=Workspace("cpu", chunk_tokens=8),
        block_size=4,
        dtype=torch.float32,
        fuse_context=False,
    )
    args = (b.q, b.kv_c, b.k_pe, b.w, b.cache, b.block_table, plan)
    times, (out, lse) = time_phases(lambda hook: mla_prefill(*args, return_lse=True, phase_hook=hook), "cpu")
    chunks = sum(c.plan is not None for c in plan.chunks)
    assert chunks >= 2
    # the main pass gathers nothing (its GEMM reads the new tokens' kv_c and k_pe where they are)
    assert times.passes == {
        "gather": chunks,
        "up-projection": 1 + chunks,
        "main pass": 1,
        "context chunk": chunks,
        "merge": chunks,
    }
    o2, l2 = mla_prefill(*args, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)
