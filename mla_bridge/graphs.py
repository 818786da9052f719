"""CUDA-graph capture and replay of the prefill layers of a planned batch.

Design: ONE graph per plan, captured over the whole forward -- every layer's ``mla_prefill`` (or anything else the
caller runs between them) -- the way serving engines capture whole models. Each layer's kernels are their own graph
nodes with their own pointers: its paged ``kv_cache``, its prepared ``kv_b_proj`` and its q / kv_c / k_pe buffers.
Nothing is copied into a staging buffer: a layer's cache is never moved (it is the engine's memory, written by the
engine between steps), and the inputs are the buffers the caller's own ops write before each replay.

Why this design and not the alternatives:
  * one graph per layer would need a replay (and a host launch) per layer, and the layers' graphs would still all be
    tied to the one plan: it keeps a per-layer host cost the whole-forward graph removes;
  * a layer-stacked cache with the layer index read on the device forces every engine to lay its caches out as one
    tensor (vLLM and SGLang keep one cache tensor per layer) and needs kernels of our own that read a device index;
  * in a real model, layer ``l + 1``'s q depends on layer ``l``'s output through ops mla_bridge does not own (o_proj,
    MLP, the next q/kv projections): so the capture takes the forward as a callable (:func:`capture`), and
    :func:`capture_prefill` is that callable for the case where every layer's inputs are already in their buffers
    (tests, the benchmark, a caller that runs the other ops itself).

Rules, checked or documented:
  * A graph replays fixed pointers and a fixed schedule: it serves exactly the batch its plan was built for
    (:class:`mla_bridge.PrefillPlan` lengths), and replays read whatever the captured input buffers hold then.
  * Graph safety (the plan-ownership rule): a :class:`PrefillGraph` holds, for as long as it can be
    replayed, the plans it was captured with (their index tensors, device schedule buffers and pooled FlashInfer
    wrappers, which :meth:`mla_bridge.RaggedPlan.retain_for_graph` keeps out of the pool for the graph's lifetime),
    the float workspace its kernels were captured against, and the captured callable with every tensor it closes
    over. :func:`retain_plan_for_graph` is the one place that registers a graph with its plans.
    :meth:`PrefillGraph.release` ends the graph's life explicitly; dropping the object does the same.
    Replays run on the current stream, in stream order with the caller's writes of the inputs, on any stream: the
    first replay on a stream marks the plans' device index tensors and the held float workspace used there
    (``record_stream``, :meth:`mla_bridge.PrefillPlan.use_on_stream`), and the release records the pooled wrappers'
    events on every stream the graph was replayed on, so that nothing the last replays read is handed to another
    allocation or plan before they have completed, whichever stream the graph is released or dropped on.
  * Capture follows torch's documented recipe: warm-up calls on a side stream (FlashInfer's and Triton's JIT, first
    allocations; run under :func:`mla_bridge.kv.capture_rule`, as the capture is, so they launch the kernels the capture
    records), then ``torch.cuda.graph`` capture; allocations inside the capture come from the graph's private memory
    pool, whose size is reported (:attr:`PrefillGraph.memory_bytes`) with the capture time
    (:attr:`PrefillGraph.capture_ms`).
  * Exactly equal to eager on the same kernels: a replay launches the captured kernels on the same data, so it is
    bitwise equal to eager calls that launch those kernels. :func:`capture` runs its warm-up calls and the capture
    under :func:`mla_bridge.kv.capture_rule`: there a call with the default ``kv_impl`` ("auto") builds each pass's
    k / v the way that is faster on the GPU, since a replay pays no host time per launch
    (:func:`mla_bridge.kv.pass_impl`): gather + cuBLAS on every pass, or the fused kernel on every pass for an
    identity-layout weight. Such a graph is bitwise eager ``mla_prefill(..., kv_impl="separate")`` (``"fused"`` for
    the identity layout) and within one rounding of k_nope / v of the default eager call, whose small passes take the
    one-launch fused kernel. An explicit ``kv_impl`` is captured as given.
  * On the CPU the same API runs eagerly: :meth:`PrefillGraph.replay` calls the captured callable (not under the
    rule, which changes nothing there: the CPU's passes are "separate"); ``graphed`` is False and the capture figures
    are 0. (On CUDA the torch backend is captured like FlashInfer's: it plans on host
    lengths and never syncs.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .kv import capture_rule
from .plan import PrefillPlan
from .prefill import kernel_choices, mla_prefill, validate_prefill_inputs
from .ragged import RaggedPlan
from .weights import PreparedKVBProj
from .workspace import capture_owner, current_stream

__all__ = ["PrefillGraph", "PrefillLayer", "capture", "capture_prefill", "retain_plan_for_graph"]


def _ragged_plans(plan: Any) -> list[RaggedPlan]:
    """The distinct ragged passes of a plan (chunks of one shape share one RaggedPlan)."""
    if isinstance(plan, RaggedPlan):
        return [plan]
    found = {id(plan.main): plan.main}
    for c in plan.chunks:
        if c.plan is not None:
            found.setdefault(id(c.plan), c.plan)
    return list(found.values())


def retain_plan_for_graph(plan: "PrefillPlan | RaggedPlan", graph: "PrefillGraph") -> tuple[list, list]:
    """Tell ``plan``'s ragged passes that ``graph`` replays their kernels; returns ``(held, releases)``: what the
    graph must hold, and the callables that hand the plans' resources back early (:meth:`PrefillGraph.release`).
    The wrappers' release events go on every stream in ``graph``'s list of replay streams (where it has one, as a
    :class:`PrefillGraph` does; else the stream current at the release).

    The one call site of the plan-ownership API (:meth:`mla_bridge.RaggedPlan.retain_for_graph`: a
    wrapper whose run was captured stays out of the workspace pool until every graph registered for it is gone and
    the GPU has finished the replays queued on the current stream). On top of it the graph holds strong references
    to the plan (its index tensors, which the captured gathers read), its ragged passes and, for FlashInfer plans,
    the float workspace tensor current at capture (a later growth swaps in a new tensor; a kernel captured against
    the old pointer needs it allocated). fa2's captured runs write their split-KV partials into a region of their
    own, allocated during the capture from the graph's private memory pool (so the graph owns it, and two graphs
    of one plan never share one: they may be replayed at once).
    """
    held: list = [plan]
    releases: list = []
    streams = getattr(graph, "_replay_streams", None)
    for rp in _ragged_plans(plan):
        held.append(rp)
        hook = getattr(rp, "retain_for_graph", None)
        if callable(hook):
            token = hook(graph) if streams is None else hook(graph, stream=streams)
            if callable(token):
                releases.append(token)
        if rp.backend.is_flashinfer:
            held.append(rp.workspace.float_workspace)
    return held, releases


class PrefillGraph:
    """A captured forward for one plan (see the module docstring). Made by :func:`capture` / :func:`capture_prefill`.

    Attributes:
        plans: the plans it holds (tuple).
        device: where it runs.
        graphed: True when a CUDA graph was captured (False: the CPU / eager form of the same API).
        outputs: what the captured callable returned at capture (on CUDA: the static output tensors every replay
            rewrites; on the CPU: the result of the latest :meth:`replay`, ``None`` before the first).
        capture_ms: host wall time of the capture itself (``torch.cuda.graph`` block: recording plus instantiation),
            milliseconds; warmup_ms: the warm-up calls before it.
        memory_bytes: device memory the capture reserved (the graph's private pool: its outputs and every buffer
            the captured calls allocate), bytes; 0 on the CPU.
        replays: how many times it was replayed.
    """

    def __init__(self, fn: Callable[[], Any], plans: Sequence[Any], device: torch.device):
        self._fn: Optional[Callable[[], Any]] = fn
        self.plans = tuple(plans)
        self.device = device
        self.graphed = False
        self.outputs: Any = None
        self.capture_ms = 0.0
        self.warmup_ms = 0.0
        self.memory_bytes = 0
        self.replays = 0
        self._graph: Any = None
        self._held: list = []
        self._releases: list = []
        self._replay_ptrs: set = set()  # raw handles of the streams replayed on
        self._replay_streams: list = []  # those streams (read by the wrappers' release hooks)
        for p in self.plans:
            held, releases = retain_plan_for_graph(p, self)
            self._held.extend(held)
            self._releases.extend(releases)

    @property
    def alive(self) -> bool:
        """False after :meth:`release`."""
        return self._fn is not None

    def replay(self) -> Any:
        """Run the captured forward once more; returns :attr:`outputs`.

        On CUDA this enqueues the graph on the current stream (no host work per layer, no sync); the outputs are the
        same tensors every time, rewritten by the replay. On the CPU it calls the callable eagerly.

        Raises:
            RuntimeError: after :meth:`release`.
        """
        if self._fn is None:
            raise RuntimeError("PrefillGraph.replay: this graph was released; capture a new one")
        if self.graphed:
            ptr, stream = current_stream(self.device)
            if ptr not in self._replay_ptrs:
                self._replayed_on(ptr, stream)
            self._graph.replay()
        else:
            self.outputs = self._fn()
        self.replays += 1
        return self.outputs

    def _replayed_on(self, ptr: int, stream: Any) -> None:
        """The first replay on ``stream``: what the captured kernels read and torch's caching allocator owns (the
        plans' device index tensors, the float workspace held) is marked used there, and the stream joins the list
        the wrappers' release events are recorded on (see the module docstring)."""
        if torch.cuda.is_current_stream_capturing():
            return  # replayed inside another capture: that graph's owner orders its replays
        for p in self.plans:
            if isinstance(p, PrefillPlan):
                p.use_on_stream(ptr, stream)
        for t in self._held:
            if isinstance(t, torch.Tensor):
                t.record_stream(stream)
        self._replay_streams.append(stream)
        self._replay_ptrs.add(ptr)

    def release(self) -> None:
        """Drop the CUDA graph, then the plans and buffers it held: their wrappers go back to the workspace pool once
        the replays queued so far on every stream the graph was replayed on have finished and nothing else holds
        the plans; the plans' device tensors are reused by torch's allocator only after those replays too. Call it
        on any stream (or drop the object, which does the same). Replaying afterwards raises."""
        self._graph = None
        self._fn = None
        self.outputs = None
        for give_back in self._releases:
            give_back()
        self._releases.clear()
        self._held.clear()
        self.plans = ()

    def __repr__(self) -> str:
        return (
            f"PrefillGraph(graphed={self.graphed}, plans={len(self.plans)}, device={self.device}, "
            f"capture_ms={self.capture_ms:.3f}, memory_bytes={self.memory_bytes}, alive={self.alive})"
        )


def _plan_device(plans: Sequence[Any]) -> torch.device:
    if not plans:
        raise ValueError("plans must name at least one PrefillPlan or RaggedPlan the captured calls use")
    devices = set()
    for i, p in enumerate(plans):
        if isinstance(p, PrefillPlan):
            devices.add(p.device)
        elif isinstance(p, RaggedPlan):
            devices.add(p.spec.device)
        else:
            raise TypeError(f"plans[{i}] must be a PrefillPlan or a RaggedPlan, got {type(p).__name__}")
    if len(devices) != 1:
        raise ValueError(f"plans must all be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


def capture(fn: Callable[[], Any], *, plans: Sequence[Any], warmup: int = 2, pool: Any = None) -> PrefillGraph:
    """Capture ``fn`` (a forward that calls :func:`mla_bridge.mla_prefill` / :meth:`RaggedPlan.run` for ``plans``)
    into one CUDA graph; replay it with :meth:`PrefillGraph.replay`.

    Args:
        fn: takes no arguments, launches work on the current stream only, never syncs the device, and reads and
            writes only tensors that outlive the graph (the graph holds ``fn``, so what it closes over lives as long
            as the graph). Its return value becomes :attr:`PrefillGraph.outputs`.
        plans: every plan ``fn`` uses (the graph keeps them alive and reserved, see :func:`retain_plan_for_graph`).
        warmup: eager calls of ``fn`` on a side stream before the capture (at least 1 on CUDA).
        pool: an optional ``torch.cuda.graph_pool_handle()`` to share one private pool between graphs that are
            never replayed at the same time.

    Returns:
        A :class:`PrefillGraph`. On the CPU nothing is run here; :meth:`PrefillGraph.replay` calls ``fn``.

    Raises:
        TypeError / ValueError: a plan that is not a PrefillPlan/RaggedPlan, plans on several devices, ``warmup``
            not an int >= 0; whatever ``fn`` raises in its first warm-up call (before any capture).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    device = _plan_device(list(plans))
    graph = PrefillGraph(fn, plans, device)
    if device.type != "cuda":
        return graph
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)  # the plans' schedule copies were queued on the current stream
    t0 = time.perf_counter()
    with torch.cuda.stream(side), capture_rule():  # the warm-up launches the kernels the capture records
        for _ in range(max(1, warmup)):
            fn()
    current.wait_stream(side)
    torch.cuda.synchronize(device)
    graph.warmup_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.empty_cache()  # so that the reserved-memory difference below is the graph's pool alone
    reserved = torch.cuda.memory_reserved(device)
    cuda_graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    # capture_owner: the runs captured here are this graph's (registered for its plans in PrefillGraph.__init__), so
    # its release hands their wrappers back; a plan fn uses but `plans` does not name stays retired for good.
    with torch.cuda.device(device), capture_rule(), capture_owner(graph):  # the rule the warm-up ran under
        with torch.cuda.graph(cuda_graph, pool=pool, stream=side):
            outputs = fn()
    torch.cuda.synchronize(device)
    graph.capture_ms = (time.perf_counter() - t0) * 1e3
    graph.memory_bytes = max(0, torch.cuda.memory_reserved(device) - reserved)
    graph._graph, graph.outputs, graph.graphed = cuda_graph, outputs, True
    return graph


@dataclass(frozen=True)
class PrefillLayer:
    """One layer's tensors for :func:`capture_prefill`: the buffers its replays read (shapes as
    :func:`mla_bridge.mla_prefill`). ``q`` / ``kv_c`` / ``k_pe`` are the graph's inputs: write each batch's values
    into them (``copy_``) before :meth:`PrefillGraph.replay`. ``kv_b_proj`` should be prepared
    (:func:`mla_bridge.prepare_kv_b_proj`); a raw weight is read in place by the fused kernel's passes and
    rearranged again inside every replay for the separate ones, which under the default ``kv_impl`` are all of them
    (a copy of the weight per replay and layer; :mod:`mla_bridge.weights`). ``kv_cache_scale``: an FP8 cache's
    per-tensor scale, as :func:`mla_bridge.mla_prefill` takes it (None for an unquantized cache; a Python float is
    baked into the captured kernels, a tensor is read at every replay)."""

    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_b_proj: "torch.Tensor | PreparedKVBProj"
    kv_cache: torch.Tensor
    kv_cache_scale: Any = None


def capture_prefill(
    plan: PrefillPlan,
    layers: Sequence[PrefillLayer],
    block_table: torch.Tensor,
    *,
    return_lse: bool = False,
    warmup: int = 2,
    pool: Any = None,
    kv_impl: Optional[str] = None,
) -> PrefillGraph:
    """One graph over the prefill attention of every layer of ``plan``'s batch (layer order; each layer its own
    cache, weight and input buffers; ``block_table`` ``[batch, max_blocks]`` shared by all, as in serving).

    Returns:
        A :class:`PrefillGraph` whose :attr:`~PrefillGraph.outputs` is a list with one ``out [T, H, v_head_dim]`` per
        layer, or ``(out, lse)`` pairs with ``return_lse`` (lse float32 natural log ``[T, H]``). ``kv_impl`` is
        passed to every :func:`mla_bridge.mla_prefill` call (captured as chosen; the default picks per pass what is
        faster on the GPU, see the module docstring).

    Raises:
        TypeError / ValueError: ``plan`` not a PrefillPlan, a plan built with ``index_topk`` (sparse attention is not
            captured: its torch path synchronizes the host, its kernel's path copies a per-token table), no layers, a
            layer that is not a PrefillLayer; every check of :func:`mla_bridge.mla_prefill` on each layer's tensors
            (:func:`mla_bridge.prefill.validate_prefill_inputs`, the message starting ``layers[i]:``), an unknown
            ``kv_impl`` or environment switch (:func:`mla_bridge.prefill.kernel_choices`): on the host, before any
            warm-up or capture, on every device.
    """
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan, got {type(plan).__name__}")
    if plan.index_topk is not None:
        raise ValueError(
            f"capture_prefill captures dense prefill; the plan was built with index_topk={plan.index_topk}: the sparse "
            f"pass (mla_bridge.sparse) is not captured, call mla_prefill(..., topk_indices=) eagerly"
        )
    layers = list(layers)
    if not layers:
        raise ValueError("layers must hold at least one PrefillLayer")
    for i, layer in enumerate(layers):
        if not isinstance(layer, PrefillLayer):
            raise TypeError(f"layers[{i}] must be a PrefillLayer, got {type(layer).__name__}")
    # every layer's inputs against the plan now, on the host (on the CPU nothing runs until the first replay)
    for i, x in enumerate(layers):
        try:
            validate_prefill_inputs(
                x.q, x.kv_c, x.k_pe, x.kv_b_proj, x.kv_cache, block_table, plan, kv_cache_scale=x.kv_cache_scale
            )
        except (TypeError, ValueError) as err:
            raise type(err)(f"layers[{i}]: {err}") from err
    kernel_choices(plan.device, plan.dtype, plan.dims, kv_impl)  # an unknown kv_impl or a bad switch, named

    def forward() -> list:
        return [
            mla_prefill(
                x.q,
                x.kv_c,
                x.k_pe,
                x.kv_b_proj,
                x.kv_cache,
                block_table,
                plan,
                return_lse=return_lse,
                kv_cache_scale=x.kv_cache_scale,
                kv_impl=kv_impl,
            )
            for x in layers
        ]

    return capture(forward, plans=[plan], warmup=warmup, pool=pool)
