"""Recording stand-ins for a CUDA device under FlashInfer (streams, events, the ragged wrapper, CUDA graphs) and the
small plan-and-run calls the plan-ownership tests share (tests/test_async_safety.py, tests/test_workspace_events.py,
tests/test_capture_regions.py). "The GPU" is a list of events the test completes when it wants, so the host can be
made to run ahead of it.
"""

from __future__ import annotations

import torch

from mla_bridge import plan_ragged

BF16 = torch.bfloat16
H, DQK, DVO = 2, 64, 64  # head dims every FlashInfer backend serves (fa3 and cutlass: 64/64)


class FakeGPU:
    """Streams, events and a log of what the host queued, in order."""

    def __init__(self):
        self.log: list = []
        self.pending: list = []
        self.capturing = False
        self.capturing_graph = None  # what torch.cuda.CUDAGraph.get_currently_capturing_graph names while capturing
        self.streams = {}
        self.current = self.stream(1)

    def stream(self, ptr: int) -> "FakeStream":
        if ptr not in self.streams:
            self.streams[ptr] = FakeStream(self, ptr)
        return self.streams[ptr]

    def finish(self) -> None:
        """The GPU catches up: every event recorded so far completes."""
        for e in self.pending:
            e.done = True
        self.pending = []


class FakeStream:
    def __init__(self, gpu: FakeGPU, ptr: int):
        self.gpu, self.cuda_stream = gpu, ptr

    def wait_event(self, event) -> None:
        self.gpu.log.append(("wait", self.cuda_stream, event))

    def __repr__(self):
        return f"FakeStream({self.cuda_stream})"


def make_event_class(gpu: FakeGPU):
    class FakeEvent:
        def __init__(self, *args, **kwargs):
            self.done = True
            self.stream = None

        def record(self, stream=None):
            stream = stream or gpu.current
            assert not gpu.capturing, "an event was recorded while a stream was capturing"
            self.stream, self.done = stream.cuda_stream, False
            gpu.pending.append(self)
            gpu.log.append(("record", stream.cuda_stream, self))

        def query(self):
            assert not gpu.capturing, "an event was queried while a stream was capturing"
            return self.done

        def synchronize(self):
            self.done = True

    return FakeEvent


class StandInWrapper:
    """FlashInfer's ragged wrapper as far as the asynchrony goes: plan() stands for "write the schedule into the one
    page-locked buffer and queue its copy"; run() logs the stream and the float buffer it was handed and, like fa2
    and cutlass, writes ``out`` as if it were contiguous (``out[t, h, d] = q[t, h, d] + 1`` at contiguous strides)."""

    instances: list = []

    def __init__(self, gpu: FakeGPU, float_workspace: torch.Tensor, backend: str):
        self.gpu, self.backend = gpu, backend
        self._float_workspace_buffer = float_workspace
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)
        self.resets: list = []
        self.schedule = None
        StandInWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, *args, **kwargs):
        self.schedule = qo_indptr.tolist()
        self.gpu.log.append(("plan", self, self.schedule))

    def run(self, q, k, v, out=None, lse=None, **kwargs):
        self.gpu.log.append(
            ("run", self, self.gpu.current.cuda_stream, self._float_workspace_buffer, self.schedule, out.data_ptr())
        )
        vals = q[..., : out.shape[-1]].float() + 1
        if self.backend in ("fa2", "cutlass"):
            contiguous = torch.empty(out.shape).stride()
            out.as_strided(out.shape, contiguous).copy_(vals)
        else:
            out.copy_(vals)
        lse.fill_(0.5)
        return out, lse

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self.resets.append(float_workspace_buffer)
        self._float_workspace_buffer = float_workspace_buffer


def graph_class(gpu: FakeGPU) -> type:
    """``torch.cuda.CUDAGraph`` as far as the workspace asks it which graph the current stream captures into."""

    class CUDAGraph:
        @staticmethod
        def get_currently_capturing_graph():
            if not gpu.capturing or gpu.capturing_graph is None:
                raise RuntimeError(
                    "get_currently_capturing_graph() can be used only between capture_begin() and capture_end()"
                )
            return gpu.capturing_graph

    return CUDAGraph


def plan(ws, qo, backend=None, causal=True):
    return plan_ragged(
        qo,
        qo,
        num_heads=H,
        head_dim_qk=DQK,
        head_dim_vo=DVO,
        causal=causal,
        sm_scale=0.1,
        dtype=BF16,
        workspace=ws,
        backend=backend,
    )


def tensors(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, DQK, generator=g).to(BF16)
    return q, q.clone(), q[..., :DVO].clone()


def run(p, t, out=None, seed=0):
    """plan.run's kernel call on CPU tensors (the plan's device is the fake CUDA one, so validation is skipped)."""
    q, k, v = tensors(t, seed)
    out = torch.empty(t, H, DVO, dtype=BF16) if out is None else out
    lse = torch.empty(t, H)
    p._kernel.run(q, k, v, out, lse, "NH")
    return q, out


def wrapper_of(p):
    return p.flashinfer_wrapper
