"""Ragged batches on the GPU with their references, for the tests that keep the GPU busy behind the host
(tests/gpu/test_gpu_async.py, tests/gpu/test_gpu_plan_events.py, tests/gpu/test_gpu_capture_regions.py). Each
result is compared with a reference computed separately, on its own workspace and after a synchronize (the same
backend: the faults give errors of about 4, the tolerance is 1e-2)."""

from __future__ import annotations

import pytest
import torch

from mla_bridge import MLADims, Workspace, plan_ragged, select_backend
from tests.helpers.reference import cumsum0


BF16 = torch.bfloat16


SCALE = MLADims.deepseek_v2_lite().softmax_scale


HEADS = 16


SLEEP = int(2e8)  # GPU cycles (about 0.1 s on the H200): far longer than any host step below


TOL = 1e-2


BACKENDS = ("flashinfer-fa3", "flashinfer-fa2")


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def require(backend: str) -> None:
    try:
        select_backend(dev(), requested=backend, dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    except ValueError:
        pytest.skip(f"{backend} cannot serve on capability {torch.cuda.get_device_capability()}")


def inputs(q_lens, kv_lens, seed):
    g = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(kv_lens)
    q = torch.randn(t, HEADS, 192, generator=g).to(BF16).to(dev())
    k = torch.randn(s, HEADS, 192, generator=g).to(BF16).to(dev())
    v = torch.randn(s, HEADS, 128, generator=g).to(BF16).to(dev())
    return q, k, v


class Case:
    """One ragged batch: inputs, host indptrs, and its reference output (own workspace, synchronized)."""

    def __init__(self, backend, q_lens, kv_lens, causal, seed):
        self.backend, self.causal = backend, causal
        self.qo, self.kv = cumsum0(q_lens), cumsum0(kv_lens)
        self.q, self.k, self.v = inputs(q_lens, kv_lens, seed)
        ref_plan = self.plan(Workspace(dev()))
        self.ref, self.ref_lse = ref_plan.run(self.q, self.k, self.v)
        torch.cuda.synchronize()
        del ref_plan

    def plan(self, ws):
        return plan_ragged(
            self.qo,
            self.kv,
            num_heads=HEADS,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=self.causal,
            sm_scale=SCALE,
            dtype=BF16,
            workspace=ws,
            backend=self.backend,
        )

    def error(self, out) -> float:
        return (out.float() - self.ref.float()).abs().max().item()


def cases(backend):
    # Different batch layouts, hence different schedules: a plan that read another's schedule is far off.
    return (
        Case(backend, [300, 700], [300, 700], True, 1),
        Case(backend, [50, 1450, 200], [50, 1450, 200], True, 2),
        Case(backend, [16, 16], [6000, 3000], False, 3),
    )


def captured(plan, case):
    """A CUDA graph of ``plan.run`` into static out/lse (warm-up on a side stream first, as torch recommends)."""
    out = torch.empty_like(case.ref)
    lse = torch.empty_like(case.ref_lse)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.run(case.q, case.k, case.v, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.q, case.k, case.v, out=out, lse=lse)
    return graph, out
