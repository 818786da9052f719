"""Phase times of one ``mla_prefill`` layer, measured one way for the CLI and the benchmark.

``mla_prefill(..., phase_hook=hook)`` calls ``hook(name)`` as each phase starts ("gather", "up-projection", "main
pass", "context chunk", "merge") and ``hook("end")`` after the last. :class:`PhaseTimer` records, at each call, a
CUDA event on the current stream and ``time.perf_counter()``; a phase lasts from its boundary to the next, so the
phases of a layer tile it with no gap and no overlap.

A CUDA event's timestamp is taken when the GPU reaches it. On an idle GPU the GPU waits for the host between
kernels, and those waits land inside whichever phase the host was issuing: that is how a 0.3 ms up-projection GEMM
once read as "gather + up-projection 1.33 ms" in a 3.26 ms layer. :func:`time_phases` therefore

1. times ``layers`` instrumented layers with the GPU kept busy first (``torch.cuda._sleep``), so that the host runs
   ahead and every phase's events measure GPU time only (``phases_ms``; their sum is the layer's GPU time). It checks
   that the host really ran ahead: the first event must still be pending when the last layer has been issued
   (``host_ran_ahead``);
2. reports the host apart: ``host_ms`` is the host time to issue each phase (``perf_counter`` between the same
   boundaries), and ``gap_ms`` is how much longer each phase takes in one more layer started on an idle GPU (the
   GPU waiting for the host; near 0 for a GPU-bound layer, large for a host-bound one).

On the CPU every figure is ``perf_counter`` wall time and there are no gaps. ``PhaseTimes.to_dict()`` says how the
figures were measured (``method``), so a JSON reader never has to guess.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

__all__ = ["PhaseTimer", "PhaseTimes", "time_phases", "keep_gpu_busy", "METHOD_CUDA", "METHOD_CPU"]

METHOD_CUDA = (
    "CUDA events at mla_prefill's phase boundaries (phase_hook) on the current stream, the GPU kept busy "
    "(torch.cuda._sleep) before the timed layers so that the host runs ahead and the events measure GPU "
    "time only; mean over the timed layers. host_ms: time.perf_counter between the same boundaries (host "
    "time to issue each phase). gap_ms: extra time of each phase in one more layer started on an idle GPU "
    "(the GPU waiting for the host), reported apart"
)
METHOD_CPU = "time.perf_counter at mla_prefill's phase boundaries (phase_hook); mean over the timed layers"

#: Cycles of ``torch.cuda._sleep`` per millisecond, for a GPU clock of at most 2 GHz (a slower clock sleeps longer,
#: which only makes the host further ahead).
_CYCLES_PER_MS = 2_000_000


def keep_gpu_busy(device: torch.device, ms: float) -> None:
    """Enqueue about ``ms`` milliseconds of GPU spinning on the current stream (nothing on the CPU), so that the
    host runs ahead of the GPU and CUDA events recorded next measure GPU time, not host launch gaps."""
    if torch.device(device).type == "cuda":
        torch.cuda._sleep(int(max(0.0, ms) * _CYCLES_PER_MS))


class PhaseTimer:
    """Records each ``hook(name)`` call of ``mla_prefill``'s ``phase_hook``: a CUDA event on the current stream (on a
    CUDA device) and ``time.perf_counter()``. ``labels`` renames phases (several names may share a label, and
    their times add up). Pass :meth:`hook` as ``phase_hook``; one timer may record several layers."""

    def __init__(self, device: Any, labels: Optional[Mapping[str, str]] = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.labels = dict(labels or {})
        self.marks: list[list[tuple[str, Any, float]]] = []  # per layer: (phase name, event or None, host time)

    def hook(self, name: str) -> None:
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        if not self.marks or self.marks[-1][-1][0] == "end":
            self.marks.append([])
        self.marks[-1].append((name, ev, time.perf_counter()))

    def first_event_pending(self) -> Optional[bool]:
        """Whether the GPU has not yet reached the first recorded boundary (``None`` off CUDA or before any)."""
        if not self.cuda or not self.marks:
            return None
        return not self.marks[0][0][1].query()

    def layers(self) -> list[dict]:
        """Per finished layer: ``{label: (device ms, host ms, passes)}`` (device ms = host ms on the CPU). Syncs."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out = []
        for marks in self.marks:
            if marks[-1][0] != "end":
                continue  # a layer that raised: not timed
            per: dict = {}
            for (name, ev0, h0), (_, ev1, h1) in zip(marks[:-1], marks[1:]):
                label = self.labels.get(name, name)
                dev_ms = ev0.elapsed_time(ev1) if self.cuda else (h1 - h0) * 1e3
                d, h, n = per.get(label, (0.0, 0.0, 0))
                per[label] = (d + dev_ms, h + (h1 - h0) * 1e3, n + 1)
            out.append(per)
        return out


@dataclass
class PhaseTimes:
    """Phase times of one layer (mean over ``layers`` timed layers); see the module docstring.

    Attributes:
        phases_ms: label -> ms per layer (GPU time on CUDA, wall time on the CPU), in phase order.
        host_ms: label -> host ms to issue the phase.
        gap_ms: label -> ms the phase takes longer on an idle GPU (empty on the CPU).
        passes: label -> times the phase ran per layer (context chunks, merges).
        sum_ms: sum of ``phases_ms`` (the layer's time as the phases tile it).
        idle_layer_ms: the idle-GPU layer end to end (``None`` on the CPU).
        layers: timed layers; host_ran_ahead: whether the check in the module docstring held (``None`` on the CPU).
        method: how the figures were measured (in words).
    """

    phases_ms: dict
    host_ms: dict
    gap_ms: dict
    passes: dict
    sum_ms: float
    idle_layer_ms: Optional[float]
    layers: int
    host_ran_ahead: Optional[bool]
    method: str
    samples_ms: list = field(default_factory=list)  # per timed layer: the sum of its phases

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(per_layer: list[dict], index: int) -> dict:
    labels: list = []
    for per in per_layer:
        labels += [k for k in per if k not in labels]
    return {k: statistics.fmean(per.get(k, (0.0, 0.0, 0))[index] for per in per_layer) for k in labels}


def time_phases(
    run_layer: Callable[[Callable[[str], None]], Any],
    device: Any,
    *,
    layers: int = 3,
    labels: Optional[Mapping[str, str]] = None,
    busy_ms: Optional[float] = None,
) -> tuple[PhaseTimes, Any]:
    """Time the phases of ``run_layer(phase_hook)`` (one ``mla_prefill`` layer calling the hook it is given).

    The caller warms up first (JIT compiles, first allocations). Runs ``layers`` timed layers with the GPU kept busy
    ahead of the host, then one layer on an idle GPU for the host gaps (on CUDA only).

    Args:
        run_layer: ``hook -> result``; called ``layers + 1`` times on CUDA, ``layers`` times on the CPU.
        device: where the layer runs.
        layers: timed layers (>= 1), averaged.
        labels: phase name -> reported label (see :class:`PhaseTimer`).
        busy_ms: GPU spin before the timed layers (default: 4x the idle layer's host time, at least 20 ms).

    Returns:
        ``(PhaseTimes, the last timed layer's result)``.

    Raises:
        ValueError: ``layers`` < 1. Whatever ``run_layer`` raises propagates.
    """
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive int, got {layers!r}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    idle = None
    if cuda:
        torch.cuda.synchronize(device)
        idle = PhaseTimer(device, labels)
        t0 = time.perf_counter()
        run_layer(idle.hook)
        issue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize(device)
        keep_gpu_busy(device, busy_ms if busy_ms is not None else max(20.0, 4.0 * issue_ms * layers))
    timer = PhaseTimer(device, labels)
    result = None
    for _ in range(layers):
        result = None  # the previous layer's output goes before the next one allocates
        result = run_layer(timer.hook)
    ahead = timer.first_event_pending()
    per_layer = timer.layers()
    if len(per_layer) != layers:
        raise RuntimeError(
            f"run_layer must call its hook through to 'end' once per call; got {len(per_layer)} "
            f"finished layers of {layers}"
        )
    phases, host = _mean(per_layer, 0), _mean(per_layer, 1)
    passes = {k: int(round(v)) for k, v in _mean(per_layer, 2).items()}
    gap: dict = {}
    idle_ms = None
    if idle is not None:
        (idle_per,) = idle.layers()
        gap = {k: idle_per.get(k, (0.0,))[0] - phases[k] for k in phases}
        idle_ms = sum(v[0] for v in idle_per.values())
    return PhaseTimes(
        phases_ms=phases,
        host_ms=host,
        gap_ms=gap,
        passes=passes,
        sum_ms=sum(phases.values()),
        idle_layer_ms=idle_ms,
        layers=layers,
        host_ran_ahead=ahead,
        method=METHOD_CUDA if cuda else METHOD_CPU,
        samples_ms=[sum(v[0] for v in per.values()) for per in per_layer],
    ), result
