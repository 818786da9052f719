"""GPU kernels of mla_bridge's own, one module per kernel, each imported only by the module that chooses it
(:mod:`mla_bridge.cache` for :mod:`mla_bridge.kernels.gather`). Nothing here imports Triton at import time."""

from __future__ import annotations

import functools
from typing import Optional

__all__ = ["triton_available", "triton_version", "triton_interpreting", "cdiv", "next_power_of_2"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` works (Triton ships with torch's CUDA builds; CPU builds have none)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


@functools.lru_cache(maxsize=None)
def triton_version() -> Optional[tuple[int, int]]:
    """``(major, minor)`` of the Triton that imports here, or None where none does."""
    if not triton_available():
        return None
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to interpret kernels on CPU tensors: the values Triton's own
    ``getenv_bool`` reads as true (1, true, yes, y, on; any case)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "y", "on")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints ``a >= 0``, ``b > 0``: ``triton.cdiv``'s value. The launchers compute grids and block
    sizes with these on every call: Triton 3.6+ makes ``triton.cdiv`` / ``triton.next_power_of_2`` constexpr functions
    whose host call costs about 2.5 us (measured on this project's CPU machine, Triton 3.9), 100x this."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0): ``triton.next_power_of_2``'s value (see
    :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
