"""PrefillPlan.build's chunked-schedule expansion on the GPU (host time of planning).

The chunked schedule's per-token indices (the context stream: each token's position in its request's context, then
that request) are one expansion of the runs ``[c, c]``: one page-locked copy of the run table, then one Triton kernel
(:func:`mla_bridge.plan._expand_on_device_triton`) or four torch kernels (:func:`mla_bridge.plan._expand_on_device`).
Each must queue everything (no synchronizing call while the GPU is busy) and give the CPU device's numpy values.

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
    ends = np.concatenate([cum[1:], total + cum[1:]])  # the runs [c, c]: positions (counting), then req_ids
    table = np.stack([ends, np.concatenate([-cum[:-1], np.arange(len(c))])])
    dev = torch.device("cuda", torch.cuda.current_device())
    plan_mod._expand_on_device_triton(table, 2 * total, total, dev)  # compiled before the GPU is kept busy
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    torch.cuda.set_sync_debug_mode("error")
    try:
        made = [
            half(table, 2 * total, total, dev)
            for half in (plan_mod._expand_on_device_triton, plan_mod._expand_on_device)
        ]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    counts = np.diff(cum)
    for out, host in made:
        assert host.is_pinned() and out.is_cuda and out.dtype == torch.int64
        positions, req_ids = out.split_with_sizes([total, total])
        assert torch.equal(req_ids.cpu(), torch.from_numpy(np.repeat(np.arange(len(c)), counts)))
        assert torch.equal(positions.cpu(), torch.from_numpy(np.arange(total) - np.repeat(cum[:-1], counts)))
