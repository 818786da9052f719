"""The page-locked host tables of PrefillPlan.build's device expansions on the GPU (host time).

:func:`mla_bridge.plan._page_locked` allocates the table page-locked and fills it through numpy (instead of
``Tensor.pin_memory()``, which first asks the driver about the numpy memory, then copies through a torch op). The
table must be page-locked (so the copy to the device never blocks the host), hold the exact values, and the fused
schedule's expansion must queue everything (no synchronizing call while the GPU is busy) and equal numpy's.

Marked ``gpu`` (skipped without CUDA + FlashInfer). On the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_plan_tables.py -q -m gpu
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

import mla_bridge.plan as plan_mod  # noqa: E402

SLEEP = int(2e8)  # GPU cycles (about 0.1 s on the H200): far longer than the host step below


@pytest.mark.parametrize("shape", [(129,), (2, 516), (1,)])
def test_page_locked_table_is_pinned_and_exact(shape):
    table = np.random.default_rng(0).integers(-(2**40), 2**40, size=shape, dtype=np.int64)
    host = plan_mod._page_locked(table)
    assert host.is_pinned() and host.dtype == torch.int64 and tuple(host.shape) == shape and host.is_contiguous()
    assert torch.equal(host, torch.from_numpy(table))
    assert host.data_ptr() != table.ctypes.data  # a copy: the numpy table may be reused at once


def test_fused_expansion_never_synchronizes_and_equals_numpy():
    q = np.array([512] * 16 + [0, 3], dtype=np.int64)
    c = np.array([2048] * 16 + [7, 0], dtype=np.int64)
    b = c.size
    seq_start = np.cumsum(c + q) - (c + q)
    counts = np.concatenate([c, c, q, c])
    firsts = np.concatenate([np.zeros(b, dtype=np.int64), seq_start, seq_start + c, np.arange(b)])
    counting_runs = 3 * b
    ends = np.cumsum(counts)
    base = firsts - np.where(np.arange(counts.size) < counting_runs, ends - counts, 0)
    total, counting = int(ends[-1]), int(ends[counting_runs - 1])
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda._sleep(SLEEP)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, host = plan_mod._expand_on_device(np.stack([ends, base]), total, counting, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert host.is_pinned() and out.is_cuda and out.dtype == torch.int64
    want = np.repeat(base, counts)
    want[:counting] += np.arange(counting)
    assert torch.equal(out.cpu(), torch.from_numpy(want))
