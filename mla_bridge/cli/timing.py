"""Timing of the prefill command: a phase timer (CUDA events or time.perf_counter) and the instrumented layer
that times each pass of mla_prefill through its phase hook."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


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


def _instrumented_layer(plan, q, kv_c, k_pe, weight, cache, block_table, timer: Timer, kv_cache_scale=None):
    """One layer of mla_prefill with each phase timed through its ``phase_hook`` (the same code path, so the phases
    add up to a real layer). Gather and up-projection are reported together, as are the context chunks."""
    from ..prefill import mla_prefill

    label = {"gather": "gather + up-projection", "up-projection": "gather + up-projection",
             "context chunk": "context chunks"}
    current: list = []

    def hook(name: str) -> None:
        if current:
            timer.stop(*current.pop())
        if name != "end":
            current.append((label.get(name, name), timer.start()))

    return mla_prefill(q, kv_c, k_pe, weight, cache, block_table, plan, return_lse=True, phase_hook=hook,
                       kv_cache_scale=kv_cache_scale)
