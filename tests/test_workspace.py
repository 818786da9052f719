"""Workspace.plan_with_growth: FlashInfer's "Buffer overflow" while planning grows the float workspace and plans
again, up to ``max_float_workspace_bytes``, then raises WorkspaceTooSmallError naming the size; it never reaches the
user. A live plan's wrapper keeps the buffers its queued work reads. (Events and leases:
tests/test_workspace_events.py.)
"""

from __future__ import annotations

import gc

import pytest
import torch

from mla_bridge import Workspace, WorkspaceTooSmallError


OVERFLOW = (
    "Buffer overflow when allocating memory for batch_prefill_tmp_v with size {size} and alignment 16, "
    "but only {avail} bytes available in AlignedAllocator. Increase the workspace buffer size."
)


class GrowWrapper:
    def __init__(self):
        self._int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self.resets = []

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self.resets.append((float_workspace_buffer, int_workspace_buffer))


def failing_plan(times, size=123, avail=45):
    calls = []

    def plan():
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError(OVERFLOW.format(size=size, avail=avail))
        return "planned"

    return plan, calls


def test_workspace_grows_on_overflow():
    ws = Workspace("cpu", float_workspace_bytes=1024, max_float_workspace_bytes=1 << 20)

    class Owner:
        pass

    live, gone = Owner(), Owner()
    wrappers = [ws.acquire_wrapper("fa2", owner, lambda buf, b: GrowWrapper()) for owner in (live, gone)]
    old_buf = ws.float_workspace
    del gone
    gc.collect()
    plan, calls = failing_plan(1)
    assert ws.plan_with_growth(plan) == "planned"
    assert len(calls) == 2 and ws.plans_made == 1
    needed = 1024 + (123 - 45) + 4096
    assert ws.float_workspace_bytes == max(needed, 2 * 1024) == 5198
    assert ws.float_workspace.numel() == 5198
    # Growth under a live plan: only the free wrapper is re-buffered (keeping its own int buffer); the live plan's
    # wrapper keeps the buffers its queued work reads until it is free again.
    assert wrappers[0].resets == [] and old_buf.numel() == 1024
    ((buf, int_buf),) = wrappers[1].resets
    assert buf is ws.float_workspace and int_buf is wrappers[1]._int_workspace_buffer


def test_workspace_doubles_and_retries():
    ws = Workspace("cpu", float_workspace_bytes=100_000, max_float_workspace_bytes=1 << 30)
    plan, calls = failing_plan(3, size=10, avail=5)
    assert ws.plan_with_growth(plan) == "planned"
    assert len(calls) == 4 and ws.float_workspace_bytes == 800_000  # doubled three times


def test_workspace_growth_is_clamped_to_the_maximum():
    ws = Workspace("cpu", float_workspace_bytes=5500, max_float_workspace_bytes=10_000)
    plan, _ = failing_plan(1, size=100, avail=90)  # needs 5500 + 10 + 4096 = 9606 <= 10000 < 2 * 5500
    assert ws.plan_with_growth(plan) == "planned"
    assert ws.float_workspace_bytes == 10_000


def test_workspace_too_small_raises_our_error_naming_the_size():
    ws = Workspace("cpu", float_workspace_bytes=1024, max_float_workspace_bytes=4096)
    plan, calls = failing_plan(100)
    with pytest.raises(WorkspaceTooSmallError) as info:
        ws.plan_with_growth(plan)
    err = info.value
    needed = 1024 + (123 - 45) + 4096
    assert err.needed_bytes == needed and err.limit_bytes == 4096
    msg = str(err)
    assert str(needed) in msg and "max_float_workspace_bytes=4096" in msg and "batch_prefill_tmp_v" in msg
    assert "Buffer overflow" not in msg and "AlignedAllocator" not in msg
    assert err.__cause__ is None and err.__suppress_context__
    assert isinstance(err, RuntimeError)


def test_workspace_grows_until_the_limit_then_raises():
    ws = Workspace("cpu", float_workspace_bytes=8192, max_float_workspace_bytes=20_000)
    plan, calls = failing_plan(100, size=10, avail=5)
    with pytest.raises(WorkspaceTooSmallError, match="20000"):
        ws.plan_with_growth(plan)
    assert ws.float_workspace_bytes == 16384 and len(calls) == 2


def test_workspace_growth_lets_other_errors_pass_through():
    ws = Workspace("cpu", float_workspace_bytes=1024)

    def plan():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        ws.plan_with_growth(plan)
    assert ws.float_workspace_bytes == 1024 and ws.plans_made == 0


def test_flashinfer_kernel_plans_through_growth(monkeypatch):
    """FlashInferRaggedKernel's plan goes through Workspace.plan_with_growth (fake FlashInfer wrapper)."""
    from mla_bridge import BackendChoice
    from mla_bridge.backends import flashinfer as fi_backend
    from mla_bridge.ragged import RaggedSpec

    made = []

    class Wrapper(GrowWrapper):
        def __init__(self, buf, backend):
            super().__init__()
            self.backend, self.failures = backend, 1
            made.append(self)

        def plan(self, *args, **kwargs):
            if self.failures:
                self.failures -= 1
                raise RuntimeError(OVERFLOW.format(size=5000, avail=100))

    monkeypatch.setattr(fi_backend, "new_wrapper", lambda buf, backend: Wrapper(buf, backend))
    ws = Workspace("cpu", float_workspace_bytes=2048, max_float_workspace_bytes=1 << 20)
    spec = RaggedSpec(
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        128,
        192,
        128,
        True,
        0.1,
        torch.bfloat16,
        torch.device("cpu"),
    )
    fi_backend.FlashInferRaggedKernel(BackendChoice("flashinfer-fa2", "test"), ws, spec)
    (w,) = made
    assert w.backend == "fa2" and len(w.resets) == 1 and ws.float_workspace_bytes == 2048 + 4900 + 4096
    ws_small = Workspace("cpu", float_workspace_bytes=2048, max_float_workspace_bytes=4096)
    with pytest.raises(WorkspaceTooSmallError, match=str(2048 + 4900 + 4096)):
        fi_backend.FlashInferRaggedKernel(BackendChoice("flashinfer-fa2", "test"), ws_small, spec)
