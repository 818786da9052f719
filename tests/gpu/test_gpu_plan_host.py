"""PrefillPlan.build's chunked-schedule expansion on the GPU (issue 13, item 5, host time of planning).

The chunked schedule's per-token indices come from one page-locked copy of the request offsets and four kernels
(:func:`mla_bridge.plan._context_stream_on_device`: arange, searchsorted, index_select, in-place sub). It must queue
everything (no synchronizing call while the GPU is busy) and give the CPU device's numpy values.

Marked ``gpu`` (skipped without CUDA + FlashInfer). On the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_plan_host.py -q -m gpu
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

import mla_bridge.plan as plan_mod  # noqa: E402

SLEEP = int(2e8)  # GPU cycles (about 0.1 s on the H200): far longer than the host step below


def test_context_stream_never_synchronizes_and_equals_numpy():
    c = [2048] * 64 + [0, 5, 0] + [2048] * 64  # the bench's shape, with empty contexts among them
    cum = np.concatenate([[0], np.cumsum(c)]).astype(np.int64)
    total = int(cum[-1])
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda._sleep(SLEEP)
    torch.cuda.set_sync_debug_mode("error")
    try:
        positions, req_ids, host = plan_mod._context_stream_on_device(cum, total, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert host.is_pinned() and positions.is_cuda and req_ids.is_cuda
    assert positions.dtype == req_ids.dtype == torch.int64
    counts = np.diff(cum)
    assert torch.equal(req_ids.cpu(), torch.from_numpy(np.repeat(np.arange(len(c)), counts)))
    assert torch.equal(positions.cpu(), torch.from_numpy(np.arange(total) - np.repeat(cum[:-1], counts)))
