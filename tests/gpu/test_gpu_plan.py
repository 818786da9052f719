"""PrefillPlan.build's device index expansion on the GPU: right while the GPU runs behind, no sync.

The expansion copies one page-locked ``[2, runs]`` table with ``non_blocking=True`` and expands it with four kernels
(arange, searchsorted, index_select, add). Each test keeps the GPU busy with ``torch.cuda._sleep`` first, so the copy
and the kernels are still queued while the host builds the next plan (and drops the last one): the index tensors must
still equal the CPU device's numpy expansion, and the expansion must never synchronize. (That expansion is the fused
schedule's; a chunked plan's indices follow from its passes' kv_indptrs as FlashInfer's plan() copied them to the
device, queued the same way, see ``tests/gpu/test_gpu_gather.py``.)

Marked ``gpu`` (skipped without CUDA + FlashInfer). On the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_plan.py -q -m gpu
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

import mla_bridge.plan as plan_mod  # noqa: E402
from mla_bridge import MLADims, PrefillPlan, Workspace  # noqa: E402

BF16 = torch.bfloat16
SLEEP = int(2e8)  # GPU cycles (about 0.1 s on the H200): far longer than any host step below
DIMS = MLADims.deepseek_v2_lite()
CASES = [  # (query_lens, context_lens, chunk_tokens)
    ([3, 4, 1, 5], [10, 0, 7, 20], 64),  # fused
    ([3, 4, 1, 5], [10, 0, 7, 20], 8),  # chunked, requests split across chunks
    ([0, 2, 0, 6], [5, 0, 9, 0], 4),  # chunks without new tokens, requests without context
    ([512] * 128, [2048] * 128, 65536),  # the bench's batch 128 with context: 4 equal chunks
    ([7] * 33, [300] * 33, 1000),  # fused, 33 requests
]


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _indices(plan) -> dict:
    out = {n: getattr(plan, n) for n in ("ctx_req_ids", "ctx_positions", "ctx_dst", "new_dst")}
    out.update({f"chunk{i}.{n}": getattr(c, n) for i, c in enumerate(plan.chunks) for n in ("req_ids", "positions")})
    return out


def _assert_same(cuda_plan, cpu_plan) -> None:
    got, want = _indices(cuda_plan), _indices(cpu_plan)
    assert got.keys() == want.keys()
    for name, w in want.items():
        if w is None:
            assert got[name] is None, name
        else:
            assert got[name].is_cuda and got[name].dtype == torch.int64, name
            assert torch.equal(got[name].cpu(), w), name


@pytest.mark.parametrize("q_lens,c_lens,chunk", CASES)
def test_cuda_index_tensors_equal_the_cpu_ones_while_the_gpu_runs_behind(q_lens, c_lens, chunk):
    """Two plans built back to back while the GPU sleeps, the first dropped before the second is built (its
    page-locked table must not be handed to the second while its copy is queued): both equal the CPU plan."""
    ws = Workspace(dev(), chunk_tokens=chunk)
    cpu = PrefillPlan.build(
        q_lens, c_lens, dims=DIMS, workspace=Workspace("cpu", chunk_tokens=chunk), block_size=16, dtype=BF16
    )
    other_q, other_c = [q + 1 for q in q_lens], [c + 3 for c in c_lens]
    cpu_other = PrefillPlan.build(
        other_q, other_c, dims=DIMS, workspace=Workspace("cpu", chunk_tokens=chunk), block_size=16, dtype=BF16
    )
    torch.cuda._sleep(SLEEP)
    first = PrefillPlan.build(other_q, other_c, dims=DIMS, workspace=ws, block_size=16, dtype=BF16)
    assert first.fused == cpu_other.fused
    first_values = {k: v.clone() for k, v in _indices(first).items() if v is not None}  # queued behind the sleep
    del first
    gc.collect()
    plan = PrefillPlan.build(q_lens, c_lens, dims=DIMS, workspace=ws, block_size=16, dtype=BF16)
    assert plan.fused == cpu.fused and len(plan.chunks) == len(cpu.chunks)
    _assert_same(plan, cpu)
    want_first = {k: v for k, v in _indices(cpu_other).items() if v is not None}
    assert first_values.keys() == want_first.keys()
    for name, w in want_first.items():
        assert torch.equal(first_values[name].cpu(), w), name


def test_device_expansion_never_synchronizes():
    """The expansion (page-locking, copy, four kernels) queues everything: torch's sync debug mode "error" raises
    on any synchronizing call (an ``.item()``, a pageable copy, ``repeat_interleave`` without ``output_size``)."""
    counts = np.array([2048] * 128 * 2, dtype=np.int64)
    ends = np.cumsum(counts)
    base = np.concatenate([-(ends - counts)[:128], np.arange(128)])
    table = np.stack([ends, base])
    torch.cuda._sleep(SLEEP)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, host = plan_mod._expand_on_device(table, int(ends[-1]), int(ends[127]), dev())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert host.is_pinned()
    got = out.cpu()
    assert torch.equal(got[: 128 * 2048], torch.arange(2048).repeat(128))
    assert torch.equal(got[128 * 2048 :], torch.arange(128).repeat_interleave(2048))


def test_batch_128_with_context_makes_two_flashinfer_plans():
    """The bench's target batch: 128 x (512 new + 2048 cached), default chunk budget: 4 chunks of 65536 tokens of
    one shape, so the main pass and ONE chunk plan."""
    ws = Workspace(dev())
    plan = PrefillPlan.build([512] * 128, [2048] * 128, dims=DIMS, workspace=ws, block_size=16, dtype=BF16)
    assert len(plan.chunks) == 4 and plan.num_plans == 2
    if plan.backend.is_flashinfer:
        assert ws.plans_made == 2
