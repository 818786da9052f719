"""Workspace: per-device memory shared by every plan and layer, allocated once.

It holds FlashInfer's float workspace (fa2 keeps split-KV temporaries there), a pool of FlashInfer ragged
wrappers reused across batches (each one allocates 8 MiB of device memory and 8 MiB of pinned host memory when
constructed, FlashInfer 0.7.4), and ``chunk_tokens``, the budget in tokens for one context chunk of gathered
latent cache in :func:`mla_bridge.mla_prefill`.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Optional, TypeVar

import torch

__all__ = ["Workspace", "WorkspaceTooSmallError", "default_workspace", "DEFAULT_FLOAT_WORKSPACE_BYTES", "DEFAULT_CHUNK_TOKENS"]

#: FlashInfer's recommended float workspace (its docstring: "The recommended size is 128MB").
DEFAULT_FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024
#: Upper bound growth may reach before :class:`WorkspaceTooSmallError` (vLLM itself uses 394 MiB).
DEFAULT_MAX_FLOAT_WORKSPACE_BYTES = 2 * 1024 * 1024 * 1024
#: vLLM's cap on the context-chunk workspace: ``min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)``.
DEFAULT_CHUNK_TOKENS = 64 * 1024

_OVERFLOW = re.compile(r"Buffer overflow when allocating memory for (\S+) with size (\d+).*?only (\d+) bytes", re.S)
T = TypeVar("T")


class WorkspaceTooSmallError(RuntimeError):
    """FlashInfer's plan needs more float workspace than ``max_float_workspace_bytes`` allows.

    Attributes: ``needed_bytes`` (a lower bound on the size that would fit), ``limit_bytes``.
    """

    def __init__(self, needed_bytes: int, limit_bytes: int, what: str):
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            f"Workspace: FlashInfer's plan needs at least {needed_bytes} bytes of float workspace ({what}), more than "
            f"max_float_workspace_bytes={limit_bytes}; construct Workspace(..., max_float_workspace_bytes=...) larger, "
            f"or split the batch")


def _checked_device(device: "torch.device | str") -> torch.device:
    """``device`` as a concrete torch.device ("cpu", or "cuda:<index>" of a CUDA device that exists).

    Raises:
        ValueError: not a device, a device type other than cpu/cuda, CUDA unavailable, or no such CUDA device.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from err
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {dev}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev}: CUDA is not available here (torch {torch.__version__}, "
                             f"CUDA build: {torch.version.cuda or 'none'})")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {dev}: only {torch.cuda.device_count()} CUDA device(s)")
        dev = torch.device("cuda", index)
    return dev


class _Slot:
    __slots__ = ("wrapper", "owner")

    def __init__(self, wrapper: Any):
        self.wrapper = wrapper
        self.owner: Optional[weakref.ref] = None


class Workspace:
    """Per-device memory for ragged prefill, made once and handed to every plan (FlashInfer's wrapper pattern).

    Args:
        device: where the kernels run (``torch.device``, ``"cuda:0"``, ``"cpu"``...).
        float_workspace_bytes: FlashInfer's float workspace, bytes (default 128 MiB); allocated on first use by a
            FlashInfer plan, never for the torch backend.
        chunk_tokens: tokens of gathered context per chunk in :func:`mla_bridge.mla_prefill` (default 65536, vLLM's
            cap). One chunk's up-projected k/v take ``chunk_tokens * num_heads * (head_dim_qk + head_dim_vo) * 2``
            bytes at bf16.
        max_float_workspace_bytes: when fa2's plan reports "buffer overflow", the float workspace grows (doubling, or
            to what the plan asked for) up to this many bytes, then :class:`WorkspaceTooSmallError` is raised.

    Raises:
        ValueError: a size that is not a positive int; a device that is not cpu or an existing CUDA device.
    """

    def __init__(self, device: "torch.device | str" = "cpu", *, float_workspace_bytes: int = DEFAULT_FLOAT_WORKSPACE_BYTES,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 max_float_workspace_bytes: int = DEFAULT_MAX_FLOAT_WORKSPACE_BYTES):
        for name, value in (("float_workspace_bytes", float_workspace_bytes), ("chunk_tokens", chunk_tokens),
                            ("max_float_workspace_bytes", max_float_workspace_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Workspace: {name} must be a positive int, got {value!r}")
        self.device = _checked_device(device)
        self.float_workspace_bytes = float_workspace_bytes
        self.max_float_workspace_bytes = max(max_float_workspace_bytes, float_workspace_bytes)
        self.chunk_tokens = chunk_tokens
        self._float_workspace: Optional[torch.Tensor] = None
        self._slots: dict[str, list[_Slot]] = {}
        self.wrappers_created = 0
        self.plans_made = 0  # FlashInfer plan() calls through this workspace (a benchmark counts them)

    @property
    def float_workspace(self) -> torch.Tensor:
        """The uint8 float workspace ``[float_workspace_bytes]`` on ``device`` (allocated on first access)."""
        if self._float_workspace is None:
            self._float_workspace = torch.empty(self.float_workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._float_workspace

    def acquire_wrapper(self, backend: str, owner: object, factory: Callable[[torch.Tensor, str], Any]) -> Any:
        """A FlashInfer ragged wrapper for ``backend`` ("cutlass", "fa3", "fa2") that no live plan holds.

        ``owner`` (the plan) holds it until ``owner`` is garbage collected; then the next plan reuses it.
        ``factory(float_workspace, backend)`` builds a new one when every pooled wrapper is held.
        """
        slots = self._slots.setdefault(backend, [])
        for slot in slots:
            if slot.owner is None or slot.owner() is None:
                slot.owner = weakref.ref(owner)
                return slot.wrapper
        slot = _Slot(factory(self.float_workspace, backend))
        self.wrappers_created += 1
        slot.owner = weakref.ref(owner)
        slots.append(slot)
        return slot.wrapper

    def plan_with_growth(self, plan: Callable[[], T]) -> T:
        """Run a FlashInfer ``plan`` call, growing the float workspace while it reports "Buffer overflow".

        Raises:
            WorkspaceTooSmallError: the plan needs more than ``max_float_workspace_bytes``.
        """
        while True:
            try:
                result = plan()
                self.plans_made += 1
                return result
            except RuntimeError as err:
                match = _OVERFLOW.search(str(err))
                if match is None:
                    raise
                what, size, available = match.group(1), int(match.group(2)), int(match.group(3))
                needed = self.float_workspace_bytes + max(0, size - available) + 4096
                new_size = max(needed, 2 * self.float_workspace_bytes)
                if new_size > self.max_float_workspace_bytes:
                    if needed > self.max_float_workspace_bytes:
                        raise WorkspaceTooSmallError(needed, self.max_float_workspace_bytes, what) from None
                    new_size = self.max_float_workspace_bytes
                    if new_size <= self.float_workspace_bytes:
                        raise WorkspaceTooSmallError(needed, self.max_float_workspace_bytes, what) from None
                self._grow(new_size)

    def _grow(self, new_size: int) -> None:
        self.float_workspace_bytes = new_size
        self._float_workspace = None
        buf = self.float_workspace
        for slots in self._slots.values():
            for slot in slots:
                slot.wrapper.reset_workspace_buffer(buf, slot.wrapper._int_workspace_buffer)

    def __repr__(self) -> str:
        pooled = sum(len(s) for s in self._slots.values())
        return (f"Workspace(device={self.device}, float_workspace_bytes={self.float_workspace_bytes}, "
                f"chunk_tokens={self.chunk_tokens}, wrappers={pooled})")


_DEFAULT_WORKSPACES: dict[torch.device, Workspace] = {}


def default_workspace(device: "torch.device | str") -> Workspace:
    """The process-wide :class:`Workspace` for ``device``, made on first use (what the one-shot calls share)."""
    dev = _checked_device(device)
    ws = _DEFAULT_WORKSPACES.get(dev)
    if ws is None:
        ws = _DEFAULT_WORKSPACES[dev] = Workspace(dev)
    return ws
