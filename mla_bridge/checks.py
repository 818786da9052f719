"""The argument checks the modules of mla_bridge and its adapters share: one home, imported by name.

Each check raises (or, for the ``*_why_not`` ones, returns) the error its callers have always raised, with the
argument named in the message; the messages are part of the behaviour (tests match them). Nothing here imports
another module of mla_bridge: this module sits at the bottom of the import graph, with :mod:`mla_bridge.dims` and
:mod:`mla_bridge.switches`.

  * flags and numbers: :func:`not_a_bool`, :func:`positive_int`, :func:`as_sm_scale`;
  * devices: :func:`checked_device`;
  * per-request lengths: :func:`as_lengths`, :func:`check_length_sums` (:data:`INT32_MAX`);
  * sizes that cannot fit: :func:`device_memory_bytes`, :func:`refuse_beyond_memory`;
  * tensors a kernel reads in place: :func:`kernel_ready`, :func:`kernel_strides`, :func:`strided_extent`,
    :func:`offsets_why_not`.
"""

from __future__ import annotations

import functools
import numbers
import os
from typing import Any, Optional, Sequence

import torch

__all__ = [
    "INT32_MAX",
    "not_a_bool",
    "positive_int",
    "as_sm_scale",
    "checked_device",
    "as_lengths",
    "check_length_sums",
    "device_memory_bytes",
    "refuse_beyond_memory",
    "kernel_ready",
    "kernel_strides",
    "strided_extent",
    "offsets_why_not",
]

#: The largest token offset an int32 indptr holds.
INT32_MAX = 2**31 - 1
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def not_a_bool(name: str, value: Any) -> TypeError:
    """The error for a flag that is not a Python bool, naming the value's type with its module (numpy 2's bool is
    named ``bool`` too)."""
    kind = type(value)
    where = "" if kind.__module__ == "builtins" else kind.__module__ + "."
    return TypeError(f"{name} must be a bool (True or False), got {value!r} of type {where}{kind.__qualname__}")


def as_sm_scale(sm_scale: Any) -> float:
    """``sm_scale`` as a Python float: any real scalar (int, float, numpy, a 0-d torch tensor, a concrete JAX scalar),
    positive and finite in float32 (the kernels' logit type).

    Raises:
        ValueError: a bool, a non-number, a traced value (it must be static: the plan is made on the host), zero,
            negative, NaN, or beyond float32.
    """
    value = None
    if not isinstance(sm_scale, (bool, str, bytes)):
        try:
            value = float(sm_scale)
        except Exception:  # noqa: BLE001 - a tracer, a string, a tensor of several elements...
            value = None
    if value is None or not (0 < value <= _FLOAT32_MAX):
        raise ValueError(
            f"sm_scale must be a positive finite float (a static value, not a traced one; at most "
            f"{_FLOAT32_MAX:.3g}), got {sm_scale!r}"
        )
    return value


def positive_int(name: str, value: Any) -> int:
    """``value`` as a Python int above 0 (an int, or any ``numbers.Integral`` such as a numpy integer; not a bool).

    Raises:
        ValueError: a bool, a non-integer, zero or negative (the message names ``name``).
    """
    if type(value) is int and value > 0:
        return value  # the common case, without the abstract-class check of numbers.Integral
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def checked_device(device: "torch.device | str") -> torch.device:
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
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the CPU too: tensors made on it report plain "cpu"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {dev}: CUDA is not available here (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'none'})"
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {dev}: only {torch.cuda.device_count()} CUDA device(s)")
        dev = torch.device("cuda", index)
    return dev


def as_lengths(name: str, values: Sequence[int]) -> list[int]:
    """Per-request token counts as a list of non-negative Python ints: a sequence of ints or numpy integers, or a
    1-D integer tensor (read on the host).

    Raises:
        TypeError: a mapping, set, string or other non-sequence; an entry that is not an int (bools included); a
            float or bool tensor.
        ValueError: a tensor that is not 1-D; a negative entry (the message names ``name[r]``).
    """
    if isinstance(values, (dict, set, frozenset, str, bytes)):  # keys, no order, or characters: not lengths
        raise TypeError(f"{name} must be a sequence of ints (one per request), got {type(values).__name__}")
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D [batch], got shape {list(values.shape)}")
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {values.dtype}")
        values = values.tolist()
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints (one per request), got {type(values).__name__}") from None
    if set(map(type, values)) <= {int} and (not values or min(values) >= 0):
        return values  # plain non-negative ints (the common case): no per-item work in Python
    out = []
    for r, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            try:
                import numpy as np

                if not isinstance(v, np.integer):
                    raise TypeError
                v = int(v)
            except TypeError:
                raise TypeError(f"{name}[{r}] must be an int, got {v!r}") from None
        if v < 0:
            raise ValueError(f"{name}[{r}] = {v} is negative")
        out.append(int(v))
    return out


def check_length_sums(q_lens: list[int], c_lens: list[int]) -> tuple[int, int]:
    """New and context tokens each index int32 offsets (qo_indptr, block positions, vLLM's seq_lens): refuse sums
    beyond ``2**31 - 1`` in O(requests), before any per-token or per-chunk work. Returns the two sums."""
    totals = []
    for name, lens in (("query_lens", q_lens), ("context_lens", c_lens)):
        total = sum(lens)
        if total > INT32_MAX:
            raise ValueError(
                f"{name} sum to {total} tokens, beyond what an int32 indptr holds (2**31 - 1 = {INT32_MAX} tokens)"
            )
        totals.append(total)
    return totals[0], totals[1]


@functools.lru_cache(maxsize=None)
def device_memory_bytes(device: torch.device) -> Optional[int]:
    """All the memory of ``device``, in bytes: a CUDA device's ``total_memory``, the host's physical memory for the
    CPU (``sysconf``); None where it cannot be told (then nothing is refused for it). Read once per device."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError, RuntimeError, AssertionError):
        pass
    return None


def refuse_beyond_memory(name: str, what: str, nbytes: int, device: torch.device) -> None:
    """Refuse, before anything is allocated, a call whose own allocations (``nbytes``: ``what``, a lower bound)
    exceed all the memory of ``device``: no such call can run, and the allocator's error would name no argument.
    Only what cannot fit at all is refused; what fits the device but not its free memory is the allocator's to say.

    Raises:
        ValueError: naming ``name`` (the argument that sets the size), the bytes and the device's.
    """
    total = device_memory_bytes(device)
    if total is not None and nbytes > total:
        raise ValueError(
            f"{name}: {what} need {nbytes / 2**30:.1f} GiB, more than all the memory of {device} "
            f"({total / 2**30:.1f} GiB)"
        )


def kernel_ready(x: torch.Tensor) -> bool:
    """Whether FlashInfer can read ``x`` (``[N, H, D]``) in place: it reads through ``(stride_n, stride_h)`` with a
    unit last stride, strides that are multiples of 16 bytes and a 16-byte aligned start (an empty tensor: always)."""
    st = x.stride()
    align = 16 // x.element_size()
    if st[-1] == 1 and st[0] % align == 0 and st[1] % align == 0 and x.data_ptr() % 16 == 0:
        return True
    return x.numel() == 0


def kernel_strides(x: torch.Tensor) -> Optional[tuple[int, int]]:
    """The ``(stride_n, stride_h)`` a kernel reads ``[N, H, D]`` ``x`` through in place (an entry of
    :func:`mla_bridge.plan_ragged`'s ``strides``), or None: contiguous, or not :func:`kernel_ready` (then
    :meth:`mla_bridge.RaggedPlan.run` hands the kernel a contiguous copy)."""
    return None if x.is_contiguous() or not kernel_ready(x) else (x.stride(0), x.stride(1))


def strided_extent(x: torch.Tensor) -> int:
    """One past the largest element offset of ``x`` from its first element, through its strides (non-negative):
    ``1 + sum((n - 1) * stride)``, 0 when empty (:func:`mla_bridge.dispatch.tensor_extent` of a tensor at hand)."""
    if x.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))


def offsets_why_not(name: str, x: torch.Tensor, limit: int, backend: str) -> Optional[str]:
    """Why a kernel of ``backend`` (32-bit offsets below ``limit``, :data:`mla_bridge.dispatch.OFFSET_LIMITS`) cannot
    read ``x``, or ``None``: one FlashInfer reads in place (:func:`kernel_ready`) must reach below ``limit`` through
    its strides, one it is handed a contiguous copy of, through its element count."""
    strided = kernel_ready(x) and not x.is_contiguous()
    extent = strided_extent(x) if strided else x.numel()
    if extent < limit:
        return None
    how = (
        f"pass {name} contiguous, or plan with strides= so that the dispatch routes the pass to a backend that "
        f"addresses it"
        if strided
        else "split the batch"
    )
    return (
        f"{name} reaches {extent} elements through its strides {list(x.stride())} (shape {list(x.shape)}), past "
        f"the 32-bit element offsets of {backend}, the backend this plan was made for (limit {limit}): {how}"
    )
