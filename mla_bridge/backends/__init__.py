"""Kernels behind :class:`mla_bridge.RaggedPlan`: one module per backend family.

Each module exposes ``make_kernel(choice, workspace, spec) -> kernel`` where ``spec`` is a
:class:`mla_bridge.ragged.RaggedSpec` and ``kernel.run(q, k, v, out, lse, lse_layout)`` fills ``out``
``[T, H, head_dim_vo]`` and ``lse`` (natural log, float32, ``[T, H]`` or ``[H, T]``; None: FlashInfer writes no
LSE, the torch backend one of its own that is dropped).
"""

from __future__ import annotations

from typing import Any

from ..dispatch import BackendChoice


def make_kernel(choice: BackendChoice, workspace: Any, spec: Any) -> Any:
    """Build the kernel for ``choice`` (imports FlashInfer only when a FlashInfer backend was chosen)."""
    if choice.is_flashinfer:
        from . import flashinfer

        return flashinfer.make_kernel(choice, workspace, spec)
    from . import torch_ref

    return torch_ref.make_kernel(choice, workspace, spec)
