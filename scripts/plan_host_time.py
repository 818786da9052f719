"""Our own host time in PrefillPlan.build, on a machine without a GPU (issue 13, item 5).

What the H200 bench section ``plan`` measures (build time minus the time inside FlashInfer's ``plan()``), here with a
fake SM90 CUDA device: torch.cuda's capability, streams and events and FlashInfer's wrapper are stand-ins (as in
tests/test_async_safety.py), and the wrapper's plan() does nothing, so everything timed is our own Python. The per-token
device index expansion cannot run without CUDA: it is replaced by a stand-in that only allocates its outputs on the
host, and its torch op sequence is timed apart on small CPU tensors (``--ops``: the dispatcher cost per op, a lower
bound of what each op costs the host on CUDA, where a launch adds some microseconds).

    PYTHONPATH=$PWD python3 scripts/plan_host_time.py [--repeats 200] [--profile B,C]

Numbers are medians in milliseconds; this machine's Python is not the H200 host's, so compare before/after here and
take the absolute figures from ``mla-bridge bench --sections plan`` on the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

import mla_bridge.dispatch as dispatch
import mla_bridge.plan as plan_mod
import mla_bridge.workspace as workspace_module
from mla_bridge import MLADims, PrefillPlan, Workspace
from mla_bridge.backends import flashinfer as fi_backend

CASES = [(b, c) for c in (0, 2048) for b in (1, 16, 128)]


class _Stream:
    cuda_stream = 1

    def wait_event(self, event):
        pass


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True


class _Wrapper:
    def __init__(self, buf, backend):
        self._float_workspace_buffer = buf
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)

    def plan(self, *args, **kwargs):
        pass


class _TorchOnCPU:
    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, **kwargs)


def fake_cuda() -> None:
    """A fake SM90 device with CUDA 12.8 and FlashInfer 0.7.4 (nothing is undone: this is a script)."""
    stream = _Stream()
    dispatch.flashinfer_version = lambda: "0.7.4"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda dev=None: (9, 0)
    torch.version.cuda = "12.8"
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.Event = _Event
    torch.cuda.is_current_stream_capturing = lambda: False
    workspace_module.torch = _TorchOnCPU()
    fi_backend.new_wrapper = _Wrapper
    stub_device_expansion()


def stub_device_expansion() -> None:
    """Replace the device part of the index expansion (page-locking, copy, kernels) by host allocations: the landed
    code's outputs are one-element tensors (what its build does with them, a few tiny ops, then costs the
    dispatcher's time, not per-token work), the reworked code's one buffer (a view of one allocated once) it splits
    into views."""
    if hasattr(plan_mod, "_expand_on_device"):  # the reworked plan.py
        buf = torch.empty(4 * 128 * (512 + 2048), dtype=torch.int64)  # the largest case's output, allocated once
        plan_mod._expand_on_device = lambda table, total, counting, device: (buf[:total], torch.from_numpy(table))
        return
    orig = plan_mod.PrefillPlan._expand  # the landed plan.py: host half kept, device half stubbed

    def expand(self, counts, *values):
        if self.device.type == "cpu":
            return orig(self, counts, *values)
        total = int(counts.sum())
        starts = np.cumsum(counts) - counts
        torch.from_numpy(np.stack([counts, starts, *values]).astype(np.int64))
        return [torch.zeros(1, dtype=torch.int64) for _ in range(1 + len(values))]

    plan_mod.PrefillPlan._expand = expand


def own_ms(ws, dims, batch, context, repeats):
    q, c = [512] * batch, [context] * batch
    build = lambda: PrefillPlan.build(q, c, dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)  # noqa
    plan = build()
    times = []
    for _ in range(repeats):
        plan = None
        t = time.perf_counter()
        plan = build()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), plan


def _new_on_cpu(table, total, counting):
    """The reworked _expand_on_device on CPU tensors, page-locking left out (CPU-only torch)."""
    small = torch.from_numpy(table).to("cpu", non_blocking=True)
    t = torch.arange(total, dtype=torch.int64)
    out = small[1].index_select(0, torch.searchsorted(small[0], t, right=True, out_int32=True))
    out[:counting] += t[:counting]
    return out


def op_sequences(repeats):
    """The device expansion's torch ops on CPU tensors (tiny sizes: dispatcher cost, not work)."""
    out = {}
    counts = np.array([3, 4], dtype=np.int64)
    dev = torch.device("cpu")

    def old_expand(counts, *values):  # the landed _expand's CUDA branch, pin_memory left out (CPU-only torch)
        total = int(counts.sum())
        starts = np.cumsum(counts) - counts
        host = torch.from_numpy(np.stack([counts, starts, *values]).astype(np.int64))
        small = host.to(dev, non_blocking=True)
        seg = torch.repeat_interleave(torch.arange(counts.size, device=dev), small[0], output_size=total)
        offset = torch.arange(total, device=dev) - small[1][seg]
        return [offset] + [small[2 + j][seg] for j in range(len(values))]

    def old_fused():
        c = q = counts
        seq_start = np.cumsum(c + q) - (c + q)
        pos, req, ctx_base = old_expand(c, np.arange(c.size), seq_start)
        new_pos, new_base = old_expand(q, seq_start + c)
        return ctx_base + pos, new_base + new_pos

    def old_chunked():
        spans = np.array([[0, 0, 3], [1, 0, 4]], dtype=np.int64)
        positions, req_ids, first = old_expand(spans[:, 2] - spans[:, 1], spans[:, 0], spans[:, 1])
        positions += first
        return positions, req_ids

    seqs = {"landed fused": old_fused, "landed chunked": old_chunked}
    if hasattr(plan_mod, "_expand_on_device"):
        def new(kind):
            segs = np.array([[3, 0, 1], [4, 0, 1]] * (3 if kind == "fused" else 2), dtype=np.int64)
            table = np.stack([np.cumsum(segs[:, 0]), segs[:, 1]])
            return lambda: _new_on_cpu(table, int(segs[:, 0].sum()), int(segs[:, 0].sum()))
        seqs.update({"new fused": new("fused"), "new chunked": new("chunked")})
    for name, fn in seqs.items():
        fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        ops = sorted({e.name for e in prof.events() if e.name.startswith("aten::")})
        top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        t = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
        out[name] = (statistics.median(t), len(top), ops)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--profile", default=None, help="B,C: cProfile 200 builds of that case")
    p.add_argument("--ops", action="store_true", help="time the device expansion's torch ops on the CPU")
    args = p.parse_args()
    torch.set_num_threads(1)
    fake_cuda()
    dims = MLADims.deepseek_v2_lite()
    ws = Workspace("cuda:0")
    for b, c in CASES:
        ms, plan = own_ms(ws, dims, b, c, args.repeats)
        sched = "fused" if plan.fused else f"{len(plan.chunks)} chunks" if plan.chunks else "no context"
        print(f"B={b:<3} C={c:<4} own {ms:.3f} ms  ({sched}, {plan.num_plans} plan(s), {plan.backend.name})")
    if args.ops:
        for name, (ms, n, ops) in op_sequences(args.repeats).items():
            print(f"{name:15s} {ms * 1e3:6.1f} us on CPU tensors, {n} top-level aten ops: {', '.join(ops)}")
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
