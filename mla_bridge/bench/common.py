"""What every bench section shares: rows, checks, the run context, timers and FLOP/byte counts.

Timing (GPU): ``warmup`` calls first (they absorb FlashInfer's JIT compile and the caching allocator's first
allocations), then ``repeats`` timed calls. Each timed call starts on an idle GPU (synchronized), which then spins
(:func:`mla_bridge.profiling.keep_gpu_busy`, about 3x the call's warm host time) while the host issues the call
between two CUDA events: the events time the call's GPU work alone, ``perf_counter`` its host time alone (never a
wait for earlier work), and a sample is the larger of the two: a loop of the call, host and GPU overlapped, takes at
least each. Timing calls back to back instead mixes them up: on the H200 a host-bound path issued after GPU-heavy
ones showed events shorter than its host time (its start event fired late), and host times grew with waits on a full
launch queue (docs/results.md). The events' median
is kept as ``gpu_ms``. On the CPU both are wall-clock times.

That timing assumes a call that never waits for the device: a call that does (a host read of a device value, a
``block_until_ready``) waits out the spin too, and its host time grows by it (up to the 50 ms cap). Calls whose
latency from an idle GPU is the quantity (a whole model's time to first token, whose attention functions may read
a mask on the host once per forward) are timed with ``latency=True``: synchronize, ``perf_counter``, the call,
synchronize, ``perf_counter`` (the wall time a user measures; no spin, no events).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

__all__ = [
    "Row",
    "Check",
    "Job",
    "Timing",
    "Ctx",
    "Variant",
    "variants",
    "Case",
    "beside_raw",
    "causal_pairs",
    "attention_flops",
    "gemm_flops",
    "fmt_err",
    "SECTIONS",
    "DEFAULT_SECTIONS",
    "SECTION_TITLES",
    "HEAD_DIM_SUM",
]

#: Sections in report order (1 main ... 6 jax, 7 ttft).
SECTIONS = ("main", "context", "merge", "plan", "memory", "jax", "ttft")
#: What runs without ``--sections``: all but ``ttft`` (whole models, minutes on a GPU: asked for by name).
DEFAULT_SECTIONS = SECTIONS[:-1]
SECTION_TITLES = {
    "peak": "0. Machine peaks (same run)",
    "main": "1. Main pass: causal ragged attention",
    "context": "2. Context pass and full mla_prefill with prefix-cached context",
    "merge": "3. Merge of attention partials",
    "plan": "4. Planning: host time and plans per 61-layer loop",
    "memory": "5. Peak extra device memory of mla_prefill",
    "jax": "6. JAX adapter",
    "ttft": "7. Time to first token: a whole model's prefill (ms per forward)",
}
#: head_dim_qk + head_dim_vo for DeepSeek MLA (192 + 128): the FLOPs of one q-k pair and one p-v pair per head.
HEAD_DIM_SUM = 192 + 128


def causal_pairs(q_len: int, kv_len: int) -> int:
    """Visible (query, key) pairs of one request under bottom-right aligned causal masking, counted exactly:
    query ``i`` sees ``min(kv_len, max(0, i + kv_len - q_len + 1))`` keys."""
    if q_len <= 0 or kv_len <= 0:
        return 0
    offset = kv_len - q_len
    # i from 0..q_len-1: visible = clamp(i + offset + 1, 0, kv_len)
    total = 0
    lo = max(0, -offset)  # first query that sees at least one key
    if lo >= q_len:
        return 0
    full_from = max(lo, kv_len - offset - 1)  # queries i >= full_from see all kv_len keys
    full_from = min(full_from, q_len)
    n = full_from - lo  # queries with a partial (growing) view
    if n > 0:
        first = lo + offset + 1
        total += n * first + n * (n - 1) // 2
    total += (q_len - full_from) * kv_len
    return total


def attention_flops(
    q_lens: Sequence[int], kv_lens: Sequence[int], *, causal: bool, heads: int, head_dim_sum: int = HEAD_DIM_SUM
) -> float:
    """2 x (q·k pairs) x heads x (head_dim_qk + head_dim_vo); causal pairs counted exactly per request."""
    pairs = sum(causal_pairs(q, k) if causal else q * k for q, k in zip(q_lens, kv_lens))
    return 2.0 * pairs * heads * head_dim_sum


def gemm_flops(tokens: int, kv_lora_rank: int, out_features: int) -> float:
    """FLOPs of the up-projection ``[tokens, kv_lora_rank] @ [kv_lora_rank, out_features]``."""
    return 2.0 * tokens * kv_lora_rank * out_features


def fmt_err(err: BaseException, limit: int = 400) -> str:
    text = " ".join(str(err).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}"


@dataclass
class Row:
    """One figure of the report. ``status`` is "ok" or "skipped"; a skipped row says why in ``note`` and, when a
    kernel or call failed, carries the exception text in ``error``. Unmeasured figures are ``None``."""

    section: str
    case: str
    path: str
    status: str = "ok"
    ms: Optional[float] = None  # GPU time per call (median of repeats), CPU wall time on the CPU
    host_ms: Optional[float] = None  # host time to issue one call (median)
    tflops: Optional[float] = None
    gbps: Optional[float] = None
    fraction: Optional[float] = None  # of the measured bf16 matmul peak (TFLOP/s rows) or copy bandwidth (GB/s rows)
    fraction_of: Optional[str] = None  # "matmul_peak" or "copy_bandwidth"
    flops: Optional[float] = None
    bytes: Optional[float] = None
    seq_len: Optional[int] = None  # key tokens in the batch (sum of kv lengths): the plot's x axis
    heads: Optional[int] = None
    repeats: Optional[int] = None
    note: str = ""
    error: Optional[str] = None
    extra: dict = field(default_factory=dict)
    #: False for a row that cannot run on this machine at all (it needs CUDA, FlashInfer or Triton): kept in the
    #: JSON, left out of the printed tables and the plot.
    applies: bool = True
    order: tuple = field(default=(0, 0, 0), repr=False)  # display order, not written to JSON

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("order", None)
        return d


def attention_note(model_ms: float, noop_ms: float) -> str:
    """The ttft rows' note on attention's part of a forward: its ms (the forward minus the no-op's) and its share;
    a negative difference (a forward whose attention is lost in the timing noise, as on a busy CPU) is said to be
    so, not shown as a negative share."""
    att = model_ms - noop_ms
    if att < 0:
        return f"attention within the timing noise (forward - no-op = {att:.2f} ms)"
    return f"attention {att:.2f} ms, {100 * att / model_ms:.0f}% of the TTFT"


#: One token per :meth:`Ctx.measure_many` call's rounds.
_ROUNDS = itertools.count(1)


def paired_gap(a: Optional[Row], b: Optional[Row]) -> Optional[float]:
    """The median over rounds of ``a``'s time minus ``b``'s, in ms, for two rows timed in the same interleaved
    rounds (:meth:`Ctx.measure_many`: ``extra["ms_samples"]`` in round order). A difference of two forwards' times
    moves with the clock between rounds (a GPU at its power cap runs a few percent slower after heavy work); paired
    by round, the drift that hits both calls of a round cancels, which the difference of the two medians does not
    do. None unless both rows are measured with one sample per round of the same rounds (``extra["rounds"]``, one
    token per :meth:`Ctx.measure_many` call: rows timed each on its own after a failed round have their own)."""
    if a is None or b is None or a.status != "ok" or b.status != "ok":
        return None
    if a.extra.get("rounds") != b.extra.get("rounds"):
        return None
    xs, ys = a.extra.get("ms_samples"), b.extra.get("ms_samples")
    if not xs or not ys or len(xs) != len(ys):
        return None
    return statistics.median(x - y for x, y in zip(xs, ys))


@dataclass
class Check:
    """A performance target: ``value`` against ``target`` (``op`` "<=" or ">=" or "=="); ``passed`` is None when
    it could not be measured. ``applies`` is False in quick/CPU mode (the targets are for the H200)."""

    name: str
    value: Optional[float]
    target: float
    op: str
    passed: Optional[bool]
    applies: bool
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Job:
    """A unit of work in the progress bar: ``fn(ctx) -> list[Row]``. Optional jobs (slow peers) run after the
    others and are skipped once the time budget is spent."""

    section: str
    label: str
    fn: Callable[["Ctx"], list]
    optional: bool = False


#: What a variant may need, as its skipped row names it.
NEEDS = {"cuda": "CUDA", "flashinfer": "FlashInfer", "triton": "Triton", "jax": "JAX"}


@dataclass(frozen=True)
class Variant:
    """One path of a section, as data: ``label`` is its rows' ``path`` in the JSON (and the report's key), ``order``
    its display place within a case, ``needs`` what the machine must have (keys of :data:`NEEDS`; a variant that
    lacks one is recorded as not applying here, with ``"needs ..."`` as its note), ``note`` the note of its measured
    row (a format string the section fills), ``args`` what the section's builder reads to make its call."""

    name: str
    label: str
    order: float = 0.0
    needs: tuple[str, ...] = ()
    note: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)

    def missing(self, ctx: "Ctx") -> Optional[str]:
        """``"needs CUDA and Triton"`` (every need, when one is missing) or None when this machine has them all."""
        if all(_has(ctx, n) for n in self.needs):
            return None
        return "needs " + " and ".join(NEEDS[n] for n in self.needs)


def variants(*table: Variant) -> dict[str, Variant]:
    """A section's variants by name (names unique), in table order."""
    out = {v.name: v for v in table}
    assert len(out) == len(table), "variant names must be unique"
    return out


def _has(ctx: "Ctx", need: str) -> bool:
    if need == "cuda":
        return ctx.cuda
    if need == "flashinfer":
        return ctx.cuda and flashinfer_importable()
    if need == "triton":
        from ..kernels import triton_available

        return ctx.cuda and triton_available()
    if need == "jax":
        import importlib.util

        return importlib.util.find_spec("jax") is not None
    raise ValueError(f"unknown need {need!r}; choose from {', '.join(NEEDS)}")


#: A section's first ``order`` field (the report sorts rows by ``order``).
SECTION_INDEX = {name: i for i, name in enumerate(("main", "context", "merge", "plan", "memory", "jax"))}


@dataclass
class Case:
    """One case of a section: makes its rows by variant name (``table``), each with the case's ``fields``
    (``seq_len``, ``heads``) and ``order`` ``(section index, ci, variant order)``."""

    ctx: "Ctx"
    section: str
    name: str
    table: Mapping[str, Variant]
    ci: int
    fields: dict = field(default_factory=dict)

    def meta(self, v: str, **kw: Any) -> dict[str, Any]:
        return dict(self.fields, order=(SECTION_INDEX[self.section], self.ci, self.table[v].order), **kw)

    def skip(self, v: str, note: str, err: Optional[BaseException] = None, *, applies: bool = True, **kw: Any) -> Row:
        """A skipped row of ``v`` (``applies`` False: a path this machine cannot run at all, :meth:`Ctx.not_here`)."""
        if not applies:
            return self.ctx.not_here(self.section, self.name, self.table[v].label, note, **self.meta(v, **kw))
        return self.ctx.skipped(self.section, self.name, self.table[v].label, note, err, **self.meta(v, **kw))

    def failed(self, v: str, err: BaseException, what: str = "failed", **kw: Any) -> Row:
        """After ``err``: the device recovered (:meth:`Ctx.recover`), a skipped row saying ``what: <error>``."""
        self.ctx.recover()
        return self.skip(v, f"{what}: " + fmt_err(err, 160), err, **kw)

    def unavailable(self, v: str, skip_name: Optional[str] = None) -> Optional[Row]:
        """The skipped row of ``v`` when ``--skip skip_name`` was given or the machine lacks what it needs."""
        if skip_name is not None and skip_name in self.ctx.skip:
            return self.skip(v, f"--skip {skip_name}")
        why = self.table[v].missing(self.ctx)
        return None if why is None else self.skip(v, why, applies=False)

    def item(self, v: str, fn: Callable[[], Any], **kw: Any) -> tuple[str, Callable[[], Any], dict]:
        """A :meth:`Ctx.measure_many` item of ``v``."""
        return (self.table[v].label, fn, self.meta(v, **kw))

    def measure(self, items: Sequence[tuple], **kw: Any) -> list[Row]:
        return self.ctx.measure_many(self.section, self.name, items, **kw)


@dataclass
class Timing:
    ms: float
    host_ms: float
    samples: list
    repeats: int
    gpu_ms: Optional[float] = None  # the CUDA events' median alone (module docstring)


def _rotated(order: Sequence[int], rep: int) -> list[int]:
    """``order`` started at position ``rep`` (mod its length): round ``rep`` of the interleaved timing, so that every
    path takes every place in a round equally often (A B C, B C A, C A B, ...). Why: on the H200, in a fixed
    order, the first path of each round took about 1.3x the time of a later path running the same kernels: a cost
    of the place, not the path (docs/results.md)."""
    k = rep % len(order) if order else 0
    return list(order[k:]) + list(order[:k])


def _spin_ms(host_ms: float) -> float:
    """The GPU spin before a timed call whose host time is about ``host_ms``: 3x that, within [1, 50] ms (the host
    must finish issuing the call before the GPU reaches it)."""
    return min(50.0, max(1.0, 3.0 * host_ms))


def _event_samples(events: Sequence[tuple], host: Sequence[float]) -> tuple[list[float], list[float]]:
    """``(samples, gpu)`` in ms from CUDA event pairs and the host times of the same calls: ``gpu`` the events'
    elapsed times, each sample the larger of a call's two (the module docstring says why)."""
    gpu = [start.elapsed_time(end) for start, end in events]
    return [max(g, h) for g, h in zip(gpu, host)], gpu


@dataclass(kw_only=True, eq=False)
class Ctx:
    """The run's settings and shared state (device, dtype, timers, peaks, reusable FlashInfer objects)."""

    device: torch.device
    quick: bool
    repeats: int
    warmup: int
    seed: int
    backend: Optional[str]
    skip: set
    budget_s: Optional[float]
    console: Any
    layers: int = 61
    peaks: dict = field(default_factory=dict, init=False)
    checks: list[Check] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.t0 = time.perf_counter()
        self._raw_float_ws: Optional[torch.Tensor] = None
        self._raw_wrappers: dict = {}
        self._workspace: Any = None

    def workspace(self) -> Any:
        """The run's shared :class:`mla_bridge.Workspace` for main-pass plans (one per device, as a user holds)."""
        if self._workspace is None:
            from ..workspace import Workspace

            self._workspace = Workspace(self.device)
        return self._workspace

    # ------------------------------------------------------------------ time
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.budget_s is not None and self.elapsed() > self.budget_s

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _warm_up(self, fn: Callable[[], Any], calls: int) -> float:
        """Run ``fn`` ``calls`` times, synchronize; the GPU spin in ms for its first timed call (:func:`_spin_ms` of
        the last call's host time)."""
        host = 0.0
        for _ in range(calls):
            t = time.perf_counter()
            fn()
            host = (time.perf_counter() - t) * 1e3
        self.sync()
        return _spin_ms(host)

    def _issue(self, fn: Callable[[], Any], busy_ms: float, host: list) -> tuple:
        """One timed call on CUDA (module docstring): idle GPU, spin, events around ``fn()``; appends its host ms to
        ``host``, returns the event pair."""
        from ..profiling import keep_gpu_busy

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        keep_gpu_busy(self.device, busy_ms)
        t = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t) * 1e3)
        return start, end

    def _latency(self, fn: Callable[[], Any], host: list, rest_s: float = 0.0) -> None:
        """One call timed from an idle device to its work's end (module docstring, ``latency=True``), after
        ``rest_s`` seconds with the device idle (untimed); appends ms."""
        self.sync()
        if rest_s > 0:
            time.sleep(rest_s)
        t = time.perf_counter()
        fn()
        self.sync()
        host.append((time.perf_counter() - t) * 1e3)

    def time(self, fn: Callable[[], Any], *, repeats: Optional[int] = None, warmup: Optional[int] = None) -> Timing:
        """Median time of ``fn()`` (see the module docstring); exceptions propagate. On CUDA at least one warm-up
        call is always made, so that a JIT compile is never timed."""
        r = max(1, self.repeats if repeats is None else repeats)
        w = self.warmup if warmup is None else warmup
        if self.cuda:
            w = max(1, w)
        return self._rounds([fn], [self._warm_up(fn, w)], r)[0]

    def _rounds(
        self,
        fns: Sequence[Callable[[], Any]],
        busy: Sequence[float],
        r: int,
        latency: bool = False,
        rest_s: float = 0.0,
    ) -> list[Timing]:
        """``r`` interleaved rounds of ``fns`` (each taking every place in a round in turn, :func:`_rotated`; ``busy``
        their first GPU spins; ``latency``: each call timed from an idle device to its end instead, module
        docstring, after ``rest_s`` idle seconds), a :class:`Timing` each; exceptions propagate."""
        busy = list(busy)
        host: list[list[float]] = [[] for _ in fns]
        events: list[list] = [[] for _ in fns]
        for rep in range(r):
            for i in _rotated(range(len(fns)), rep):
                if latency:
                    self._latency(fns[i], host[i], rest_s)
                elif self.cuda:
                    events[i].append(self._issue(fns[i], busy[i], host[i]))
                    busy[i] = _spin_ms(host[i][-1])
                else:
                    t = time.perf_counter()
                    fns[i]()
                    host[i].append((time.perf_counter() - t) * 1e3)
        self.sync()
        out = []
        for ev, h in zip(events, host):
            samples, gpu = _event_samples(ev, h) if self.cuda and not latency else (h, None)
            med_gpu = None if gpu is None else statistics.median(gpu)
            out.append(
                Timing(statistics.median(samples), statistics.median(h), [round(x, 6) for x in samples], r, med_gpu)
            )
        return out

    def phases_alone(self, run_layer: Callable[[Callable[[str], None]], Any]) -> dict[str, Timing]:
        """Each phase of ``run_layer(phase_hook)`` (one ``mla_prefill`` layer, :func:`mla_bridge.prefill.mla_prefill`
        reports its phases to the hook) timed alone: at each boundary the device is synchronized and, on CUDA, kept
        busy while the host issues the phase between two CUDA events, as :meth:`time` times a call (a sample is the
        larger of the phase's GPU and host time; its passes in one layer add up). ``warmup`` untimed layers, then
        ``repeats`` timed ones; returns a :class:`Timing` per phase name, in the order the layer reports them."""
        t = time.perf_counter()
        for _ in range(max(1 if self.cuda else 0, self.warmup)):
            t = time.perf_counter()
            run_layer(lambda name: None)
        spin = _spin_ms((time.perf_counter() - t) * 1e3)
        self.sync()
        marks: list[list[tuple[str, Any, Any, float]]] = []  # per layer: (phase, start event, end event, host ms)
        current: list = []

        def hook(name: str) -> None:
            now = time.perf_counter()
            if current:
                phase, ev0, t0 = current.pop()
                ev1 = self._event()
                marks[-1].append((phase, ev0, ev1, (now - t0) * 1e3))
            if name == "end":
                return
            self.sync()
            if self.cuda:
                from ..profiling import keep_gpu_busy

                keep_gpu_busy(self.device, spin)
            current.append((name, self._event(), time.perf_counter()))

        for _ in range(max(1, self.repeats)):
            marks.append([])
            run_layer(hook)
        self.sync()
        per: dict[str, list[list[float]]] = {}  # phase -> [samples, gpu, host] per layer
        for layer in marks:
            sums: dict[str, list[float]] = {}
            for phase, ev0, ev1, host in layer:
                gpu = ev0.elapsed_time(ev1) if self.cuda else host
                acc = sums.setdefault(phase, [0.0, 0.0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + max(gpu, host), acc[1] + gpu, acc[2] + host
            for phase, acc in sums.items():
                for lst, v in zip(per.setdefault(phase, [[], [], []]), acc):
                    lst.append(v)
        return {
            phase: Timing(
                statistics.median(s),
                statistics.median(h),
                [round(v, 6) for v in s],
                len(s),
                statistics.median(g) if self.cuda else None,
            )
            for phase, (s, g, h) in per.items()
        }

    def _event(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    # ------------------------------------------------------------------ rows
    def row(
        self,
        section: str,
        case: str,
        path: str,
        timing: Optional[Timing] = None,
        *,
        ms: Optional[float] = None,
        flops: Optional[float] = None,
        nbytes: Optional[float] = None,
        **kw: Any,
    ) -> Row:
        """A measured row: TFLOP/s from ``flops`` (fraction of the matmul peak), else GB/s from ``nbytes``
        (fraction of the copy bandwidth)."""
        row = Row(section=section, case=case, path=path, flops=flops, bytes=nbytes, **kw)
        if timing is not None:
            row.ms, row.host_ms, row.repeats = timing.ms, timing.host_ms, timing.repeats
            row.extra.setdefault("ms_samples", timing.samples)
            if timing.gpu_ms is not None:
                row.extra.setdefault("gpu_ms", timing.gpu_ms)
        elif ms is not None:
            row.ms = ms
        if row.ms and row.ms > 0:
            if flops:
                row.tflops = flops / (row.ms * 1e-3) / 1e12
                peak = self.peaks.get("matmul_tflops")
                if peak:
                    row.fraction, row.fraction_of = row.tflops / peak, "matmul_peak"
            if nbytes:
                row.gbps = nbytes / (row.ms * 1e-3) / 1e9
                peak = self.peaks.get("copy_gbps")
                if peak and not flops:
                    row.fraction, row.fraction_of = row.gbps / peak, "copy_bandwidth"
        return row

    def skipped(
        self, section: str, case: str, path: str, note: str, err: Optional[BaseException] = None, **kw: Any
    ) -> Row:
        return Row(
            section=section,
            case=case,
            path=path,
            status="skipped",
            note=note,
            error=None if err is None else fmt_err(err),
            **kw,
        )

    def not_here(self, section: str, case: str, path: str, note: str, **kw: Any) -> Row:
        """A skipped row for a path this machine cannot run at all (``note`` names what it needs: CUDA, FlashInfer,
        Triton): recorded in the JSON with ``applies`` False, not printed and not plotted."""
        return Row(section=section, case=case, path=path, status="skipped", note=note, applies=False, **kw)

    def measure_many(
        self,
        section: str,
        case: str,
        items: Sequence[tuple[str, Callable[[], Any], dict]],
        *,
        repeats: Optional[int] = None,
        warmup: Optional[int] = None,
        latency: bool = False,
        rest_s: float = 0.0,
    ) -> list[Row]:
        """Time several paths of one case interleaved (A B C, B C A, C A B, ...: clock and thermal drift hit each
        alike and each takes every place in a round, so their ratios hold on a noisy machine). ``items`` are
        ``(path, fn, row keywords)``; the keywords may hold ``flops`` / ``nbytes`` and any :class:`Row` field.
        ``latency``: each call timed from an idle device to the end of its work (module docstring); each row's
        ``extra["timing"]`` says which (``"latency"`` or ``"overlapped"``). ``rest_s`` (with ``latency``): seconds
        the device stays idle before each timed call, untimed (``extra["rest_s"]``): a GPU at its power cap lowers
        its clock for what follows a power-hungry call, so without a rest each call's time depends on the one before
        it in the round. Rows come back
        in ``items`` order; a path that fails becomes a skipped row with the error text, the others are still
        timed."""
        r = max(1, self.repeats if repeats is None else repeats)
        w = self.warmup if warmup is None else warmup
        if self.cuda:
            w = max(1, w)  # FlashInfer's JIT compile and first allocations are never timed
        rows: list[Optional[Row]] = [None] * len(items)
        live: list[int] = []
        busy: dict[int, float] = {}
        for i, (path, fn, kw) in enumerate(items):
            try:
                busy[i] = self._warm_up(fn, w)
                live.append(i)
            except Exception as err:  # noqa: BLE001 - reported in the row
                self.recover()
                rows[i] = self._failed(section, case, path, err, kw)
        try:
            timings = self._rounds([items[i][1] for i in live], [busy[i] for i in live], r, latency, rest_s)
        except Exception as err:  # noqa: BLE001 - time each alone, so that the row that fails is the one named
            self.recover()
            for i in live:
                path, fn, kw = items[i]
                rows[i] = (
                    self._failed(section, case, path, err, kw)
                    if len(live) == 1
                    else self.measure_many(
                        section, case, [items[i]], repeats=r, warmup=0, latency=latency, rest_s=rest_s
                    )[0]
                )
            return [row for row in rows if row is not None]
        rounds = next(_ROUNDS)  # the rows timed in these rounds (paired_gap pairs only rows of the same rounds)
        for i, timing in zip(live, timings):
            path, _, kw = items[i]
            kw = dict(kw)
            rows[i] = self.row(
                section, case, path, timing, flops=kw.pop("flops", None), nbytes=kw.pop("nbytes", None), **kw
            )
            rows[i].extra["timing"] = "latency" if latency else "overlapped"  # type: ignore[union-attr]
            rows[i].extra["rounds"] = rounds  # type: ignore[union-attr]
            if latency and rest_s > 0:
                rows[i].extra["rest_s"] = rest_s  # type: ignore[union-attr]
        return [row for row in rows if row is not None]

    def _failed(self, section: str, case: str, path: str, err: BaseException, kw: dict) -> Row:
        kw = dict(kw)
        kw.pop("note", None)
        flops, nbytes = kw.pop("flops", None), kw.pop("nbytes", None)
        return self.skipped(section, case, path, "failed: " + fmt_err(err, 160), err, flops=flops, bytes=nbytes, **kw)

    def recover(self) -> None:
        """After a failed call: surface a pending launch error on a throw-away kernel (so it is not blamed on the
        next row's), then drop cached blocks so the next row starts from a clean allocator."""
        if self.cuda:
            for _ in range(2):
                try:
                    torch.cuda.synchronize(self.device)
                    torch.ones(1, device=self.device).add_(1)  # its launch check reads (and clears) a stale error
                    torch.cuda.synchronize(self.device)
                    break
                except Exception:  # noqa: BLE001 - sticky errors stay; the run goes on and reports them per row
                    continue
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    def check(self, name: str, value: Optional[float], op: str, target: float, note: str = "") -> Check:
        passed: Optional[bool]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            passed = None
        elif op == "<=":
            passed = value <= target
        elif op == ">=":
            passed = value >= target
        else:
            passed = value == target
        c = Check(name, value, target, op, passed, applies=self.cuda and not self.quick, note=note)
        self.checks.append(c)
        return c

    # ------------------------------------------------------------------ tensors
    def generator(self, salt: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1_000_003 + salt)
        return g

    def randn(
        self, *shape: int, gen: torch.Generator, scale: float = 1.0, dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=self.device, dtype=dtype or self.dtype)
        return x.mul_(scale) if scale != 1.0 else x

    # ------------------------------------------------------------------ FlashInfer, built by the bench itself
    def raw_float_workspace(self) -> torch.Tensor:
        """The float workspace of the bench's own FlashInfer wrappers (512 MiB: fa2's split-KV never overflows)."""
        if self._raw_float_ws is None:
            self._raw_float_ws = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device=self.device)
        return self._raw_float_ws

    def raw_wrapper(self, backend: str, slot: int = 0) -> Any:
        """A raw ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper(float_ws, "NHD", backend=...)``, reused across
        cases (each construction pins 8 MiB of host memory); re-planned per case."""
        key = (backend, slot)
        if key not in self._raw_wrappers:
            import flashinfer

            self._raw_wrappers[key] = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.raw_float_workspace(), "NHD", backend=backend
            )
        return self._raw_wrappers[key]

    def close(self) -> None:
        self._raw_wrappers.clear()
        self._workspace = None
        self._raw_float_ws = None
        self.recover()


def beside_raw(
    c: Case,
    core: str,
    raw: str,
    plan: Any,
    q: Any,
    k: Any,
    v: Any,
    *,
    flops: float,
    raw_note: str = "",
    fi_missing: str = "",
) -> list[Row]:
    """``[core row, raw row]``: ``plan.run(q, k, v)`` (a :class:`mla_bridge.RaggedPlan`, variant ``core``) and a raw
    FlashInfer wrapper planned on the same spec (variant ``raw``, ``--skip raw`` to leave out), timed
    interleaved; the core row gets ``vs_raw`` (raw ms / core ms) when both ran. ``raw_note`` follows the raw row's
    backend in its note, ``fi_missing`` the "needs CUDA and FlashInfer" of a plan without a FlashInfer backend."""
    items = [c.item(core, lambda: plan.run(q, k, v), flops=flops, note=f"backend {plan.backend.name}")]
    fb, sp = plan.backend.flashinfer_backend, plan.spec
    raw_row = None
    if "raw" in c.ctx.skip:
        raw_row = c.skip(raw, "--skip raw")
    elif fb is None:
        raw_row = c.skip(raw, "needs CUDA and FlashInfer" + fi_missing, applies=False)
    else:
        try:
            wrapper = c.ctx.raw_wrapper(fb, 0)
            plan_raw(
                wrapper, sp.qo_indptr, sp.kv_indptr, heads=sp.num_heads, causal=sp.causal, sm_scale=sp.sm_scale,
                dtype=c.ctx.dtype, head_dim_qk=sp.head_dim_qk, head_dim_vo=sp.head_dim_vo,
            )  # fmt: skip
            run = lambda: wrapper.run(q, k, v, return_lse=True)  # noqa: E731
            items.append(c.item(raw, run, flops=flops, note=f"backend {fb}{raw_note}"))
        except Exception as err:  # noqa: BLE001
            raw_row = c.failed(raw, err, "plan failed", flops=flops)
    rows = c.measure(items)
    core_row, raw_row = rows[0], raw_row or rows[1]
    if core_row.status == raw_row.status == "ok":  # an ok row has its ms
        core_row.extra["vs_raw"] = raw_row.ms / core_row.ms  # type: ignore[operator]
        core_row.note += f"; {raw_row.ms / core_row.ms:.3f}x raw"  # type: ignore[operator]
    return [core_row, raw_row]


def plan_raw(
    wrapper: Any,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    heads: int,
    causal: bool,
    sm_scale: float,
    dtype: torch.dtype,
    head_dim_qk: int = 192,
    head_dim_vo: int = 128,
) -> None:
    """Plan a raw FlashInfer ragged wrapper with the arguments the core's FlashInfer backend passes."""
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        heads,
        heads,
        head_dim_qk,
        head_dim_vo=head_dim_vo,
        causal=causal,
        sm_scale=sm_scale,
        q_data_type=dtype,
        kv_data_type=dtype,
        o_data_type=dtype,
    )


def indptr(lens: Sequence[int]) -> torch.Tensor:
    """int32 CPU prefix sums ``[len(lens) + 1]``."""
    t = torch.zeros(len(lens) + 1, dtype=torch.int64)
    if lens:
        t[1:] = torch.tensor(list(lens), dtype=torch.int64).cumsum(0)
    return t.to(torch.int32)


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True
