"""The Triton index expansion of PrefillPlan.build on the GPU (host time of planning).

:meth:`mla_bridge.plan.PrefillPlan._expand` makes every per-token index tensor of a fused plan (its placements; a
chunked plan on CUDA makes none: its gathers read each pass's kv_indptr) from one page-locked run table copied to the
device, then ONE
Triton kernel (:mod:`mla_bridge.kernels.expand`) where Triton imports, four torch kernels otherwise
(:func:`mla_bridge.plan._expand_on_device`). Here, with the GPU kept busy (``torch.cuda._sleep``) so that the host
runs ahead of it:

* the Triton expansion equals the torch ops bitwise on the run tables of ``tests/helpers/run_tables.py::run_tables``
  (empty runs, a single run, runs longer than a block, no tokens, counting 0 and counting = total, deep searches),
  and the written-out runs; it queues everything (no synchronizing call: torch's sync debug mode "error");
* plans at batch 1, 16 and 128, fused and chunked: every index tensor of the Triton-expanded plan equals the torch-op
  plan's and the CPU device's plan's (numpy), for a fused plan all views of ONE device buffer (a chunked plan's are
  made from its chunks' device kv_indptrs when asked for);
* an expansion on a CUDA device other than the current one (two GPUs): the kernel runs on the table's device.

Marked ``gpu`` (skipped without CUDA + FlashInfer). On the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_expand.py -q -m gpu
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

import mla_bridge.plan as plan_mod  # noqa: E402
from mla_bridge import MLADims, PrefillPlan, Workspace  # noqa: E402
from tests.helpers.run_tables import expanded, index_tensors, run_table, run_tables  # noqa: E402

BF16 = torch.bfloat16
DIMS = MLADims.deepseek_v2_lite()
SLEEP = int(1e8)  # GPU cycles (about 50 ms on the H200): longer than the host steps below


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _args(counts: np.ndarray, firsts: np.ndarray, counting_runs: int) -> tuple[np.ndarray, int, int]:
    """(table, total, counting) as PrefillPlan._expand hands them to the device half."""
    ends, base = run_table(counts, firsts, counting_runs)
    total = int(ends[-1]) if ends.size else 0
    counting = int(ends[counting_runs - 1]) if counting_runs else 0
    return np.stack([ends, base]).reshape(2, counts.size), total, counting


def test_triton_expansion_equals_torch_ops_bitwise_and_never_synchronizes():
    assert plan_mod._expand_impl(dev()) == "triton"  # Triton ships with torch's CUDA builds
    cases = run_tables(seed=3)
    for case in cases:  # compile every specialization first (not a synchronizing call, but slow)
        plan_mod._expand_on_device_triton(*_args(*case), dev())
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [plan_mod._expand_on_device_triton(*_args(*case), dev()) for case in cases]
        want = [plan_mod._expand_on_device(*_args(*case), dev()) if case[0].size else None for case in cases]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (counts, firsts, counting_runs), (out, host), ops in zip(cases, got, want):
        assert (
            host.is_pinned() or host.numel() == 0
        ) and out.is_cuda  # torch pins no empty tensor and out.dtype == torch.int64 and out.is_contiguous()
        if ops is not None:  # (torch's searchsorted is not asked about an empty table: a plan never makes one)
            assert torch.equal(out, ops[0]), (counts.size, counting_runs)
        assert out.cpu().tolist() == expanded(counts, firsts, counting_runs), (counts.size, counting_runs)


def _batch(batch: int, fused: bool, seed: int) -> tuple[list, list]:
    """Random lengths: new tokens 0..512, context 0..2048 (0..512 for a fused batch of 128, so that it fits one
    chunk), some requests without context or without new tokens, the first with at least 64 context tokens."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 513, size=batch)
    c = rng.integers(0, 513 if fused and batch > 16 else 2049, size=batch)
    c[3::5] = 0
    q[2::7] = 0
    c[0] = max(int(c[0]), 64)
    return q.tolist(), c.tolist()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("batch", [1, 16, 128])
def test_plan_index_tensors_equal_torch_ops_and_cpu(batch, fused, monkeypatch):
    q, c = _batch(batch, fused, seed=batch + fused)
    chunk = 65536 if fused else max(1, sum(c) // 4 + 3)  # chunked: about 4 chunks, split inside requests

    def build(ws):
        return PrefillPlan.build(q, c, dims=DIMS, workspace=ws, block_size=16, dtype=BF16, fuse_context=fused)

    ws = Workspace(dev(), chunk_tokens=chunk)
    build(ws)  # warm-up: the kernel compiled (or loaded)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    triton_plan = build(ws)  # queued behind the sleep
    monkeypatch.setattr(plan_mod, "_expand_impl", lambda device: "torch")
    torch_plan = build(ws)
    cpu_plan = build(Workspace("cpu", chunk_tokens=chunk))
    assert triton_plan.fused == torch_plan.fused == cpu_plan.fused == fused
    assert len(triton_plan.chunks) == len(cpu_plan.chunks) and (fused or len(cpu_plan.chunks) >= 2)
    got, ops, want = index_tensors(triton_plan), index_tensors(torch_plan), index_tensors(cpu_plan)
    assert got.keys() == ops.keys() == want.keys()
    if fused:  # one expansion: one device buffer that every index tensor views
        assert len(triton_plan._device_indices) == 1 and triton_plan._pinned_runs.is_pinned()
        buffer = triton_plan._device_indices[0].untyped_storage().data_ptr()
    else:  # no expansion: the chunks' indices follow from their passes' device kv_indptrs when asked for
        assert getattr(triton_plan, "_pinned_runs", None) is None
        assert all(c.rows.indices is None for c in triton_plan.chunks + torch_plan.chunks)
    for name, w in want.items():
        if w is None:
            assert got[name] is None and ops[name] is None, name
            continue
        g = got[name]
        assert g.is_cuda and g.dtype == torch.int64 and g.is_contiguous(), name
        assert not fused or g.untyped_storage().data_ptr() == buffer, name
        assert torch.equal(g, ops[name]), name
        assert torch.equal(g.cpu(), w), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_expansion_on_a_device_other_than_the_current_one():
    """Triton launches on the current device; the expansion makes it the table's (where torch's ops run)."""
    other = torch.device("cuda", 1 - torch.cuda.current_device())
    for counts, firsts, counting_runs in run_tables(seed=7)[-4:]:
        out, _ = plan_mod._expand_on_device_triton(*_args(counts, firsts, counting_runs), other)
        assert out.device == other and out.cpu().tolist() == expanded(counts, firsts, counting_runs)
