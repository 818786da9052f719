"""Timing of the prefill command: the per-layer timer (CUDA events or time.perf_counter) and the phase breakdown,
which is :mod:`mla_bridge.profiling`'s (shared with the benchmark's context section)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Timer:
    """Phase timer: CUDA events on a GPU (no sync between phases), time.perf_counter on the CPU."""

    device: Any
    spans: dict = field(default_factory=dict)

    def start(self):
        import torch

        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, name: str, start) -> None:
        import torch

        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.spans.setdefault(name, []).append((start, ev))
        else:
            self.spans.setdefault(name, []).append(time.perf_counter() - start)

    def totals_ms(self) -> dict:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {k: sum(a.elapsed_time(b) for a, b in v) for k, v in self.spans.items()}
        return {k: 1e3 * sum(v) for k, v in self.spans.items()}

    def each_ms(self, name: str) -> list:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) for a, b in self.spans.get(name, [])]
        return [1e3 * x for x in self.spans.get(name, [])]


#: How the prefill command groups mla_prefill's phases in its table.
PHASE_LABELS = {
    "gather": "gather + up-projection",
    "up-projection": "gather + up-projection",
    "context chunk": "context chunks",
}


def phase_breakdown(
    plan,
    q,
    kv_c,
    k_pe,
    weight,
    cache,
    block_table,
    *,
    layers: Optional[int] = None,
    kv_cache_scale=None,
    topk_indices=None,
):
    """Phase times of mla_prefill on these inputs, measured by :func:`mla_bridge.profiling.time_phases` (the one way
    the CLI and the benchmark time phases: CUDA events at the phase boundaries with the GPU kept ahead of the host,
    host gaps apart). Gather and up-projection are reported together, as are the context chunks. ``layers``: timed
    layers (default 3 on a GPU, 1 on the CPU, where a layer may take seconds); ``kv_cache_scale``: an FP8 cache's scale;
    ``topk_indices``: a sparse plan's picks (its one phase is "sparse attention").

    Returns:
        ``(PhaseTimes, (out, lse) of the last timed layer)``.
    """
    from ..prefill import mla_prefill
    from ..profiling import time_phases

    def layer(hook):
        return mla_prefill(
            q,
            kv_c,
            k_pe,
            weight,
            cache,
            block_table,
            plan,
            return_lse=True,
            phase_hook=hook,
            kv_cache_scale=kv_cache_scale,
            topk_indices=topk_indices,
        )

    if layers is None:
        layers = 3 if plan.device.type == "cuda" else 1
    return time_phases(layer, plan.device, layers=layers, labels=PHASE_LABELS)
