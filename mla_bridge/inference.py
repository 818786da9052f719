"""mla_bridge is inference-only: the one guard every entry point calls before any work.

Its kernels have no derivative: FlashInfer's runs and merges and the Triton kernels write their outputs outside
autograd. An input that autograd would differentiate (one that requires grad while autograd records, or one carrying
a forward-mode tangent) would lose its gradient without a word on CUDA, and on the CPU a call would differentiate or
fail depending on the path. So :func:`refuse_autograd` refuses it by name; under ``torch.no_grad()`` (no tangents)
or ``torch.inference_mode()`` (how vLLM and inference run) nothing is refused. At the ground of the import graph
(torch only): ragged, merge, weights and prefill ask it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad

__all__ = ["refuse_autograd", "differentiated", "forward_ad_active"]


def forward_ad_active() -> bool:
    """Whether forward-mode AD may be recording (``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad``'s
    ``dual_level``): a level is open (``forward_ad._current_level >= 0``) and forward gradients are enabled
    (``torch.no_grad()`` leaves them on, ``torch.inference_mode()`` turns them off). One attribute read where no
    level is open (the common case). Where this torch has neither private attribute, False (no level is known)."""
    if getattr(_forward_ad, "_current_level", -1) < 0:
        return False
    enabled = getattr(torch._C, "_is_fwd_grad_enabled", None)
    return True if enabled is None else bool(enabled())


def differentiated(named: Sequence[tuple[str, Any]]) -> Optional[tuple[str, str]]:
    """The first of ``named`` (``(name, value)`` pairs; values that are not tensors are skipped) that autograd would
    differentiate, as ``(name, "grad")`` (it requires grad while autograd records, ``torch.is_grad_enabled()``) or
    ``(name, "tangent")`` (it carries a forward-mode tangent, :func:`forward_ad_active`); None when there is none.
    What :func:`refuse_autograd` refuses and the transformers adapter hands to sdpa."""
    if torch.is_grad_enabled():
        for name, x in named:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                return name, "grad"
    if forward_ad_active():
        for name, x in named:
            if isinstance(x, torch.Tensor) and _forward_ad.unpack_dual(x).tangent is not None:
                return name, "tangent"
    return None


def refuse_autograd(named: Sequence[tuple[str, Any]]) -> None:
    """Refuse the first of ``named`` that autograd would differentiate (:func:`differentiated`).

    Raises:
        ValueError: names the input and what to do.
    """
    found = differentiated(named)
    if found is None:
        return
    name, kind = found
    if kind == "grad":
        raise ValueError(
            f"{name} requires grad and autograd is recording, but mla_bridge's kernels have no "
            f"backward (its gradient would be lost): run under torch.no_grad() or "
            f"torch.inference_mode(), or pass {name}.detach()"
        )
    raise ValueError(
        f"{name} carries a forward-mode tangent (torch.func.jvp / jacfwd, torch.autograd.forward_ad), "
        f"but mla_bridge's kernels have no derivative (the tangent would be lost): pass "
        f"forward_ad.unpack_dual({name}).primal, or run under torch.inference_mode()"
    )
