"""Optional jit route without Python in the call path (placeholder until implemented)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["why_not", "ragged_call"]


def why_not(plan: Any) -> Optional[str]:
    return "the tvm_ffi route is not implemented yet"


def ragged_call(plan: Any, out_types: Any):  # pragma: no cover
    raise NotImplementedError
