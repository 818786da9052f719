"""Triton kernel: expand a table of runs into per-token int64 indices in ONE launch (:meth:`PrefillPlan._expand`).

The table (int64 ``[2, runs]``, on the device) holds per run where it ends in the output (``ends``, non-decreasing,
``ends[-1] = total``) and its base value (``base``). Token ``t`` belongs to the run ``r(t)``, the first whose end
exceeds ``t`` (an empty run never is), and::

    out[t] = base[r(t)] + (t if t < counting else 0)

(``counting``: the tokens of the leading *counting* runs, whose values count up; the others repeat their base).
Each program takes ``BLOCK`` tokens and finds their runs by a vectorized binary search over ``ends``: a runtime loop
of ``runs.bit_length()`` (= ``ceil(log2(runs + 1))``) halvings of the candidate runs ``[lo, hi]``, whose gathered
loads of the small table hit L1/L2. The values equal the torch ops of :func:`mla_bridge.plan._expand_on_device` (searchsorted with
``right=True``, index_select, add) exactly: integer arithmetic only.

Imported only by :mod:`mla_bridge.plan`, and only on first use: Triton is not needed on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv
from .launch import launch

__all__ = ["expand_runs_triton", "BLOCK"]

#: tokens per program
BLOCK = 1024
_OPTIONS = dict(num_warps=4)


# The ints are not specialized (on being 1 or divisible by 16): every batch shape runs one compiled kernel (one per
# int32 / int64 width of the ints), where specializing them would compile a new one (hundreds of ms, in the middle
# of serving) for each new combination.
@triton.jit(do_not_specialize=["runs", "total", "counting", "steps"])
def _expand_kernel(out_ptr, table_ptr, runs, total, counting, steps, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t < total
    lo = tl.zeros([BLOCK], dtype=tl.int64)  # the run of t lies in [lo, hi]: the first with ends[run] > t
    hi = tl.zeros([BLOCK], dtype=tl.int64) + runs
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(table_ptr + mid, mask=live & active, other=0)
        right = end <= t  # run mid ends at or before t: t lies after it
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    base = tl.load(table_ptr + runs + lo, mask=live, other=0)
    tl.store(out_ptr + t, base + tl.where(t < counting, t, 0), mask=live)


def expand_runs_triton(table: torch.Tensor, total: int, counting: int) -> torch.Tensor:
    """``out[t] = table[1, r(t)] + (t if t < counting else 0)``, ``r(t)`` the first run with ``table[0, r] > t``
    (module docstring), as a new int64 ``[total]`` tensor on ``table``'s device, from one launch (none for
    ``total = 0``) on that device's current stream.

    Args:
        table: int64 ``[2, runs]`` contiguous: per run its end in the output (non-decreasing, the last ``total``)
            and its base value. CUDA (or CPU under ``TRITON_INTERPRET=1``).
        total: tokens of the output, ``table[0, -1]`` (0 for no runs).
        counting: tokens of the counting runs, ``0 <= counting <= total``.
    """
    out = torch.empty(total, dtype=torch.int64, device=table.device)
    if total == 0:
        return out
    runs = table.shape[1]
    args = (out, table, runs, total, counting, runs.bit_length())
    grid = (cdiv(total, BLOCK),)
    index = table.device.index
    if table.is_cuda and index is not None and index != torch._C._cuda_getDevice():
        with torch.cuda.device(index):  # Triton launches on the current device: the table's, like torch's ops
            launch(_expand_kernel, grid, args, dict(BLOCK=BLOCK), _OPTIONS)
    else:
        launch(_expand_kernel, grid, args, dict(BLOCK=BLOCK), _OPTIONS)
    return out
