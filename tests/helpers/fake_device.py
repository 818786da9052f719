"""A fake SM90 CUDA device for machines without a GPU: planning and running take their CUDA branches on CPU tensors.

One place for the stand-ins that ``tests/conftest.py`` (``fake_cuda_runtime``), ``tests/test_plan_host.py``
(``fake_cuda``) and ``scripts/plan_host_time.py`` install. Every function takes ``setattr``: pytest's
``monkeypatch.setattr`` in tests (undone after each test), the builtin in a script (not undone). No pytest here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = [
    "Stream",
    "Event",
    "TorchOnCPU",
    "install_runtime",
    "install_planning",
    "page_locked_on_cpu",
    "expand_kernel_on_cpu",
    "indptrs_on_cpu",
]


class Stream:
    """A CUDA stream as far as the workspace's bookkeeping goes."""

    cuda_stream = 1

    def wait_event(self, event):
        pass


class Event:
    """A CUDA event that has always completed."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True


class TorchOnCPU:
    """``torch`` for mla_bridge.workspace with its device allocations made on the CPU (no CUDA here)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, device=None, pin_memory=False, **kwargs):  # CPU-only torch cannot page-lock
        return torch.empty(*args, **kwargs)


def install_runtime(
    setattr: Callable,
    capability: Callable,
    current_stream: Callable,
    event_class: type,
    capturing: Callable = lambda: False,
) -> None:
    """torch reports one CUDA device of ``capability()`` (CUDA 12.8), ``torch.cuda.current_stream`` returns
    ``current_stream()``, ``torch.cuda.Event`` is ``event_class``, ``is_current_stream_capturing`` returns
    ``capturing()``, and mla_bridge.workspace allocates on the CPU. The caller adds its FlashInfer wrapper stand-in."""
    import mla_bridge.workspace as workspace_module

    setattr(torch.cuda, "is_available", lambda: True)
    setattr(torch.cuda, "device_count", lambda: 1)
    setattr(torch.cuda, "get_device_capability", lambda dev=None: capability())
    setattr(torch.version, "cuda", "12.8")
    setattr(torch.cuda, "current_stream", lambda device=None: current_stream())
    setattr(torch.cuda, "Event", event_class)
    setattr(torch.cuda, "is_current_stream_capturing", capturing)
    setattr(workspace_module, "torch", TorchOnCPU())


def page_locked_on_cpu(table) -> torch.Tensor:
    """``mla_bridge.plan._page_locked`` without page-locking (CPU-only torch cannot): an int64 copy of ``table``."""
    return torch.from_numpy(table.astype("int64", copy=True))


def expand_kernel_on_cpu(table: torch.Tensor, total: int, counting: int) -> torch.Tensor:
    """``mla_bridge.plan._launch_expand`` (the Triton expansion kernel) on CPU tensors: the output allocated with
    torch as the real one is, the kernel's values (``base[r(t)] + (t if t < counting else 0)``, ``r(t)`` the first run
    whose end exceeds ``t``) written through numpy, so that no torch op stands for the one launch."""
    import numpy as np

    out = torch.empty(total, dtype=torch.int64)
    ends, base = table.numpy()
    t = np.arange(total)
    out.numpy()[:] = base[np.searchsorted(ends, t, side="right")] + np.where(t < counting, t, 0)
    return out


def indptrs_on_cpu(indptrs: list, device) -> list:
    """``mla_bridge.plan._indptrs_on_device`` on the CPU (no page-locking, no copy to a device): int32 copies."""
    assert device.type == "cuda"
    return [torch.from_numpy(a.astype("int32", copy=True)) for a in indptrs]


def install_planning(
    setattr: Callable, wrapper_class: type, tables: Optional[list] = None, expand: str = "torch"
) -> None:
    """A fake SM90 device with FlashInfer 0.7.4 for planning: every CUDA branch of ``PrefillPlan.build`` runs, the
    FlashInfer wrapper is ``wrapper_class(float_buffer, backend)``, and the device half of the index expansion that
    ``expand`` names (``"torch"``: its torch ops; ``"triton"``: its one kernel, as :func:`expand_kernel_on_cpu`) runs
    on the CPU (:func:`page_locked_on_cpu` stands in for page-locking: CPU-only torch cannot page-lock). Each table
    it is handed is appended to ``tables`` when given."""
    import mla_bridge.dispatch as dispatch
    import mla_bridge.plan as plan_mod
    from mla_bridge.backends import flashinfer as fi_backend

    if expand not in ("torch", "triton"):
        raise ValueError(f"expand must be 'torch' or 'triton', got {expand!r}")
    stream = Stream()
    setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    install_runtime(setattr, lambda: (9, 0), lambda: stream, Event)
    setattr(fi_backend, "new_wrapper", wrapper_class)
    setattr(plan_mod, "_page_locked", page_locked_on_cpu)
    setattr(plan_mod, "_indptrs_on_device", indptrs_on_cpu)  # the stand-in wrapper holds no device kv_indptr
    setattr(plan_mod, "_expand_impl", lambda device: expand)
    setattr(plan_mod, "_launch_expand", expand_kernel_on_cpu)
    for name in ("_expand_on_device", "_expand_on_device_triton"):
        device_half = getattr(plan_mod, name)

        def on_cpu(table, total, counting, device, device_half=device_half) -> Any:
            assert device.type == "cuda"
            if tables is not None:
                tables.append(table.copy())
            return device_half(table, total, counting, torch.device("cpu"))

        setattr(plan_mod, name, on_cpu)
