"""Workspace: per-device memory shared by every plan and layer, allocated once.

It holds FlashInfer's float workspace (fa2 keeps split-KV temporaries there), a pool of FlashInfer ragged
wrappers reused across batches, and ``chunk_tokens``, the budget in tokens for one context chunk of gathered latent
cache in :func:`mla_bridge.mla_prefill`.

A FlashInfer 0.7.4 wrapper allocates an 8 MiB int workspace on the device and 8 MiB of page-locked host memory when
constructed (``BatchPrefillWithRaggedKVCacheWrapper.__init__``: ``_int_workspace_buffer``,
``_pin_memory_int_workspace_buffer``), where its ``plan()`` writes the schedule and copies it; a chunked plan holds one
wrapper per distinct chunk shape, so at 16 MiB each a small chunk budget made gigabytes (126 plans, 2 GiB). Each
wrapper's int workspace is therefore sized to what its plan writes (:meth:`Workspace.fit_int_workspace`, from
:func:`mla_bridge.backends.flashinfer.int_workspace_bytes`), and grown if FlashInfer still reports it too small; the
constructor's buffers go back to torch's caching allocators at once.
"""

from __future__ import annotations

import contextlib
import numbers
import re
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch

from .backends import flashinfer_internals as internals
from .checks import checked_device

__all__ = [
    "Workspace",
    "WorkspaceTooSmallError",
    "default_workspace",
    "capture_owner",
    "DEFAULT_FLOAT_WORKSPACE_BYTES",
    "DEFAULT_CHUNK_TOKENS",
    "MIN_INT_WORKSPACE_BYTES",
]

#: FlashInfer's recommended float workspace (its docstring: "The recommended size is 128MB").
DEFAULT_FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024
#: Upper bound growth may reach before :class:`WorkspaceTooSmallError` (vLLM itself uses 394 MiB).
DEFAULT_MAX_FLOAT_WORKSPACE_BYTES = 2 * 1024 * 1024 * 1024
#: vLLM's cap on the context-chunk workspace: ``min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)``.
DEFAULT_CHUNK_TOKENS = 64 * 1024
#: Idle pooled wrappers kept per FlashInfer backend (each with its int workspace, :meth:`Workspace.fit_int_workspace`).
DEFAULT_MAX_IDLE_WRAPPERS = 8
#: The smallest int workspace a wrapper is given (device bytes, and as many page-locked host bytes); sizes are powers of
#: two from here, so that a pooled wrapper planned again for a similar shape keeps its buffers.
MIN_INT_WORKSPACE_BYTES = 4096
#: FlashInfer 0.7.4's allocations from the float workspace (fa2's split-KV partials, ``scheduler.cuh``); every other
#: allocation its ragged ``plan()`` reports a "Buffer overflow" for is in the int workspace.
_FLOAT_ALLOCATIONS = ("batch_prefill_tmp_v", "batch_prefill_tmp_s")
#: A free wrapper beyond ``max_idle_wrappers`` that was not handed out in this many plans of its backend is freed.
IDLE_AFTER_ACQUISITIONS = 64

_OVERFLOW = re.compile(r"Buffer overflow when allocating memory for (\S+) with size (\d+).*?only (\d+) bytes", re.S)
T = TypeVar("T")


class WorkspaceTooSmallError(RuntimeError):
    """FlashInfer's plan needs more float workspace than ``max_float_workspace_bytes`` allows.

    Attributes: ``needed_bytes`` (a lower bound on the size that would fit), ``limit_bytes``.
    """

    def __init__(self, needed_bytes: int, limit_bytes: int, what: str):
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            f"Workspace: FlashInfer's plan needs at least {needed_bytes} bytes of float workspace ({what}), more than "
            f"max_float_workspace_bytes={limit_bytes}; construct Workspace(..., max_float_workspace_bytes=...) larger, "
            f"or split the batch"
        )


#: one torch.cuda.Stream object per (device index, raw stream handle) seen by :func:`current_stream`
_STREAMS: dict = {}


def current_stream(device: torch.device) -> tuple[int, Any]:
    """``(raw handle, torch.cuda.Stream)`` of ``device``'s current CUDA stream, for the per-run bookkeeping of the
    hot path (events recorded and waited on, streams keyed by handle).

    The handle comes from ``torch._C._cuda_getCurrentRawStream`` (what Triton's driver reads, about 40x cheaper in host
    time than ``torch.cuda.current_stream()`` on the H200's host: docs/results.md), and the
    Stream object is made once per (device, handle) and kept (torch's streams come from fixed pools; an external
    stream's wrapper acts on its handle, the same value). Where torch has no such function (CPU builds, and so the
    tests' fake CUDA device) it asks ``torch.cuda.current_stream``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    stream: Optional[torch.cuda.Stream]
    if raw is None:
        stream = torch.cuda.current_stream(device)
        return stream.cuda_stream, stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    ptr = raw(index)
    stream = _STREAMS.get((index, ptr))
    if stream is None:
        stream = _STREAMS[(index, ptr)] = torch.cuda.current_stream(index)
    return ptr, stream


class _Lease:
    """One pooled FlashInfer wrapper and what says whether queued GPU work may still read it.

    A lease is *busy* while its plan (``owner``) lives, while a CUDA graph may replay a run of it, and until every
    CUDA event it recorded has completed: ``plan_event`` (recorded on ``plan_stream`` after FlashInfer's ``plan()``
    queued its host-to-device schedule copy from the wrapper's one page-locked buffer) and ``run_events`` (one per
    stream a run was queued on, re-recorded after each run). Only a lease that is not busy is handed to another plan,
    re-planned, re-buffered or freed.

    Graphs are counted in two separate ways (:meth:`Workspace.captured`): ``graph_holds`` counts the registered graphs
    that still exist (:meth:`Workspace.retain_for_graph`; ``registered`` maps each one's ``id`` to a weak reference
    and its count of registrations), and a capture that belongs to no registered graph retires the lease for good:
    ``pending`` (the graph torch names for that capture, until it is registered) or ``captured`` (a capture no graph
    is named for). Releasing a registered graph only lowers ``graph_holds``: it never hands back a wrapper that a
    graph nobody registered may still replay.

    Event objects are reused (:meth:`event`): once :meth:`gpu_done` has seen an event complete, it goes to ``spare``
    and the lease's next plan or first run on a stream records it again instead of making a new one (a new
    ``torch.cuda.Event`` creates its CUDA event at its first record, and a dropped one is destroyed; a new event
    and its record cost tens of microseconds of host time on the H200's host: docs/results.md). Recording again is
    safe: the event's last record has completed, nothing reads the event as pending any more (it has left
    ``plan_event`` / ``run_events``), a stream that waited on an earlier record waited on that record only
    (``cudaStreamWaitEvent`` takes the event's state when it is called), and ``query`` reads the latest record.
    """

    __slots__ = (
        "wrapper",
        "backend",
        "owner",
        "plan_event",
        "plan_stream",
        "run_events",
        "spare",
        "captured",
        "pending",
        "graph_holds",
        "registered",
        "last_acquired",
        "__weakref__",
    )

    def __init__(self, wrapper: Any, backend: str):
        self.wrapper = wrapper
        self.backend = backend
        self.owner: Optional[weakref.ref] = None
        self.plan_event: Any = None
        self.plan_stream: int = 0  # cuda_stream pointer of the stream plan() queued its copies on
        self.run_events: dict[
            int | tuple[str, int], Any
        ] = {}  # cuda_stream pointer -> event recorded after the last run there
        self.spare: list = []  # events whose last record has completed, to record again (see the class docstring)
        self.captured = False  # captured where no graph was named: never handed back by the pool again
        self.pending: dict[int, weakref.ref] = {}  # id -> graph that captured a run and is not registered (yet)
        self.graph_holds = 0  # graphs registered through RaggedPlan.retain_for_graph that still exist
        self.registered: dict[int, list] = {}  # id -> [weak reference to the graph, its registrations]
        self.last_acquired = 0  # the workspace's acquisition count when this lease was last handed out

    def gpu_done(self) -> bool:
        """Every event this lease recorded has completed (``Event.query``, no wait); clears them once done (they
        become ``spare``)."""
        if self.plan_event is not None:
            if not self.plan_event.query():
                return False
            self.spare.append(self.plan_event)
            self.plan_event = None
        if self.run_events:
            if not all(e.query() for e in self.run_events.values()):
                return False
            self.spare.extend(self.run_events.values())
            self.run_events = {}
        return True

    def event(self) -> Any:
        """A CUDA event to record for this lease: a spare one (its last record has completed), else a new one."""
        try:
            return self.spare.pop()
        except IndexError:
            return torch.cuda.Event()

    def record_plan(self, stream: Any, ptr: int) -> None:
        """Record ``plan_event`` on ``stream`` (raw handle ``ptr``) after ``plan()`` queued its copies there."""
        event = self.event()
        event.record(stream)
        self.plan_stream, self.plan_event = ptr, event

    def graphed(self) -> bool:
        """A graph may replay a run of this wrapper: a registered one exists, or a capture nobody registered."""
        return self.captured or bool(self.pending) or self.graph_holds > 0

    def free(self) -> bool:
        """No plan holds it, no graph may replay it, and the GPU has finished everything queued on it."""
        return (self.owner is None or self.owner() is None) and not self.graphed() and self.gpu_done()


#: the graph that runs captured on this thread belong to (:func:`capture_owner`), or None
_CAPTURE_OWNER = threading.local()


@contextlib.contextmanager
def capture_owner(graph: Any) -> Iterator[None]:
    """Runs captured on this thread inside the block belong to ``graph`` (what :func:`mla_bridge.graphs.capture`
    wraps around its ``torch.cuda.graph`` block, naming its :class:`mla_bridge.graphs.PrefillGraph`): a pooled wrapper
    they capture is handed back once ``graph`` is gone, if ``graph`` was registered for that wrapper's plan
    (:meth:`mla_bridge.RaggedPlan.retain_for_graph`), and retired for good otherwise. Outside such a block the
    capturing graph is the one torch names (``torch.cuda.CUDAGraph.get_currently_capturing_graph``, where this torch
    has it)."""
    previous = getattr(_CAPTURE_OWNER, "graph", None)
    _CAPTURE_OWNER.graph = graph
    try:
        yield
    finally:
        _CAPTURE_OWNER.graph = previous


def capturing_graph() -> Any:
    """The graph the current stream's capture belongs to: :func:`capture_owner`'s, else the ``torch.cuda.CUDAGraph``
    that torch says captures now, else None (a torch without ``CUDAGraph.get_currently_capturing_graph``, or a capture
    begun outside torch). Asked only while a stream captures."""
    graph = getattr(_CAPTURE_OWNER, "graph", None)
    if graph is not None:
        return graph
    ask = getattr(getattr(torch.cuda, "CUDAGraph", None), "get_currently_capturing_graph", None)
    if ask is None:
        return None
    try:
        return ask()
    except Exception:  # noqa: BLE001 - torch knows of no graph for this capture (begun outside torch)
        return None


_BURIED: list[_Lease] = []  # leases of garbage-collected workspaces whose GPU work may still be queued
_BURIED_LOCK = threading.Lock()


def _bury(slots: dict[str, list[_Lease]]) -> None:
    # A finalizer: no CUDA call here (it may run while a stream captures); _sweep_buried queries later.
    keep = [
        lease
        for leases in slots.values()
        for lease in leases
        if lease.graphed() or lease.plan_event is not None or lease.run_events
    ]
    if keep:
        with _BURIED_LOCK:
            _BURIED.extend(keep)


def _sweep_buried() -> None:
    with _BURIED_LOCK:
        _BURIED[:] = [lease for lease in _BURIED if lease.graphed() or not lease.gpu_done()]


class Workspace:
    """Per-device memory for ragged prefill, made once and handed to every plan (FlashInfer's wrapper pattern).

    Args:
        device: where the kernels run (``torch.device``, ``"cuda:0"``, ``"cpu"``...).
        float_workspace_bytes: FlashInfer's float workspace, bytes (default 128 MiB); allocated on first use by a
            FlashInfer plan, never for the torch backend.
        chunk_tokens: tokens of gathered context per chunk in :func:`mla_bridge.mla_prefill` (default 65536, vLLM's
            cap). One chunk's up-projected k/v take ``chunk_tokens * num_heads * (head_dim_qk + head_dim_vo) * 2``
            bytes at bf16.
        max_float_workspace_bytes: when fa2's plan reports "buffer overflow", the float workspace grows (doubling, or
            to what the plan asked for) up to this many bytes, then :class:`WorkspaceTooSmallError` is raised.
        max_idle_wrappers: pooled wrappers per FlashInfer backend kept while no plan holds them (default 8, each
            with the int workspace its last plan needed). Beyond that, a free wrapper not handed out in
            the last :data:`IDLE_AFTER_ACQUISITIONS` (64) plans of its backend is freed when the next plan is made
            (so a serving loop that cycles through more wrappers never frees and rebuilds them), and :meth:`trim`
            frees every free one beyond the bound at once.

    Threads, streams and graphs (the rule: a plan owns what its queued GPU work reads until the GPU is done):
      * The pool is locked: any number of threads may plan on one workspace (``default_workspace`` is shared).
      * A wrapper goes back to the pool only when its plan is gone AND the CUDA events recorded after its
        ``plan()`` copies and after each of its runs have completed (``Event.query``: never a wait); until then
        the next plan takes or creates another wrapper. Growth of the float workspace re-buffers free wrappers
        only; wrappers of live plans keep their old buffers.
      * fa2 keeps split-KV partials in the float workspace, at offsets its ``plan()`` laid out for the buffer size it
        saw, so runs that may overlap must not share it: each CUDA stream a run is queued on gets its own
        float-workspace region of ``float_workspace_bytes`` (runs on one stream are ordered, so they share it
        safely); the stream that first allocated the workspace uses it directly. The region is handed to the launch
        itself, never through the wrapper's one ``_float_workspace_buffer`` attribute, so threads running one plan
        on several streams each get their own. A captured run gets a region of its own of the size its plan was laid
        out against, allocated while the stream captures (from the graph's private memory pool, so it lives as long
        as the graph and no other graph uses it). fa3 and cutlass do not use the float workspace (FlashInfer
        0.7.4), so they cost nothing extra.
      * A run captured into a CUDA graph keeps its wrapper out of the pool while that graph may replay it. A graph
        registered with :meth:`mla_bridge.RaggedPlan.retain_for_graph` (:func:`mla_bridge.graphs.capture` registers
        its own) hands the wrapper back once the graph object is gone and its last replay has completed; a capture
        into a graph nobody registered retires the wrapper for good (kept alive, never handed to another plan), and
        releasing a registered graph never changes that (see :meth:`captured`).

    Raises:
        ValueError: a size that is not a positive int; a device that is not cpu or an existing CUDA device.
    """

    def __init__(
        self,
        device: "torch.device | str" = "cpu",
        *,
        float_workspace_bytes: int = DEFAULT_FLOAT_WORKSPACE_BYTES,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        max_float_workspace_bytes: int = DEFAULT_MAX_FLOAT_WORKSPACE_BYTES,
        max_idle_wrappers: int = DEFAULT_MAX_IDLE_WRAPPERS,
    ):
        for name, value in (
            ("float_workspace_bytes", float_workspace_bytes),
            ("chunk_tokens", chunk_tokens),
            ("max_float_workspace_bytes", max_float_workspace_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"Workspace: {name} must be a positive int, got {value!r}")
        float_workspace_bytes, chunk_tokens = int(float_workspace_bytes), int(chunk_tokens)  # numpy ints too
        max_float_workspace_bytes = int(max_float_workspace_bytes)
        if isinstance(max_idle_wrappers, bool) or not isinstance(max_idle_wrappers, int) or max_idle_wrappers < 0:
            raise ValueError(f"Workspace: max_idle_wrappers must be an int >= 0, got {max_idle_wrappers!r}")
        self.device = checked_device(device)
        self.float_workspace_bytes = float_workspace_bytes
        self.max_float_workspace_bytes = max(max_float_workspace_bytes, float_workspace_bytes)
        self._chunk_tokens = chunk_tokens
        self.max_idle_wrappers = max_idle_wrappers
        self._float_workspace: Optional[torch.Tensor] = None
        self._float_stream: Any = None  # the stream the float workspace was allocated on
        self._regions: dict[Any, torch.Tensor] = {}  # stream pointer (or an external key) -> float region
        self._slots: dict[str, list[_Lease]] = {}
        self._acquisitions: dict[str, int] = {}
        self._released_graphs: list[tuple] = []  # (lease, streams, graph key) of graphs collected while a stream
        # captured (see _graph_released)
        self._lock = threading.RLock()
        # A workspace dropped while the GPU still reads its wrappers (a one-shot call on a temporary workspace)
        # leaves those wrappers in _BURIED until their events complete: freed earlier, FlashInfer's page-locked
        # schedule buffer could be handed to another allocation while its copy is still queued.
        weakref.finalize(self, _bury, self._slots)
        self.wrappers_created = 0
        self.plans_made = 0  # FlashInfer plan() calls through this workspace (a benchmark counts them)
        self.int_workspace_growths = 0  # int workspaces grown after FlashInfer reported one too small

    @property
    def chunk_tokens(self) -> int:
        """Tokens of gathered context per chunk (see the constructor). May be set between plans (a plan reads it
        when built, :class:`mla_bridge.PlanCache` keys on it); a value other than a positive int raises ValueError
        where it is set."""
        return self._chunk_tokens

    @chunk_tokens.setter
    def chunk_tokens(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"Workspace: chunk_tokens must be a positive int, got {value!r}")
        self._chunk_tokens = int(value)

    def _new_float_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _stream_key(self) -> int:
        return current_stream(self.device)[0] if self.device.type == "cuda" else 0

    @property
    def float_workspace(self) -> torch.Tensor:
        """The uint8 float workspace ``[float_workspace_bytes]`` on ``device`` (allocated on first access)."""
        buf = self._float_workspace
        if buf is None:
            with self._lock:
                buf = self._float_workspace
                if buf is None:
                    self._float_stream = self._stream_key()
                    buf = self._float_workspace = self._new_float_buffer(self.float_workspace_bytes)
        return buf

    def float_region(self, key: Any) -> torch.Tensor:
        """The float workspace region of stream ``key`` (a ``cuda_stream`` pointer, or a string naming work queued
        outside torch, such as XLA's stream): ``[float_workspace_bytes]`` uint8, made on first use (while that
        stream is current, so torch's allocator orders its reuse on it) and shared only by runs on that stream."""
        buf = self._regions.get(key)
        if buf is None:
            with self._lock:
                buf = self._regions.get(key)
                if buf is None:
                    base = self.float_workspace
                    buf = base if key == self._float_stream else self._new_float_buffer(self.float_workspace_bytes)
                    self._regions[key] = buf
        return buf

    def acquire(self, backend: str, owner: object, factory: Callable[[torch.Tensor, str], Any]) -> _Lease:
        """A :class:`_Lease` of a FlashInfer ragged wrapper for ``backend`` ("cutlass", "fa3", "fa2") that is free
        (see the class docstring), now held by ``owner`` (the kernel) until ``owner`` is garbage collected.

        ``factory(float_workspace, backend)`` builds a new wrapper when no pooled one is free. Idle wrappers beyond
        ``max_idle_wrappers`` are freed here.
        """
        if _BURIED:
            _sweep_buried()
        if self._released_graphs:
            with self._lock:
                released, self._released_graphs = self._released_graphs, []
            for lease, streams, key in released:
                self._graph_released(lease, streams, key)
        with self._lock:
            base = self.float_workspace
            slots = self._slots.setdefault(backend, [])
            self._acquisitions[backend] = now = self._acquisitions.get(backend, 0) + 1
            lease = None
            idle = []
            for slot in slots:
                if slot.free():
                    if lease is None:
                        lease = slot
                        if len(slots) <= self.max_idle_wrappers + 1:
                            break  # the others cannot outnumber the bound: no need to query their events
                    else:
                        idle.append(slot)
            if len(idle) > self.max_idle_wrappers:
                idle.sort(key=lambda s: s.last_acquired, reverse=True)  # keep the most recently used
                drop = {
                    id(s) for s in idle[self.max_idle_wrappers :] if now - s.last_acquired > IDLE_AFTER_ACQUISITIONS
                }
                if drop:
                    slots[:] = [s for s in slots if id(s) not in drop]
            if lease is None:
                lease = _Lease(factory(base, backend), backend)
                self.wrappers_created += 1
                slots.append(lease)
            elif internals.float_workspace(lease.wrapper, base) is not base:
                # fa2 plans size their split-KV partials against this buffer (FlashInfer reads its numel): after a
                # growth, or an external runtime's region (FlashInferRaggedKernel.external_wrapper), point it back at
                # the current workspace.
                internals.set_float_workspace(lease.wrapper, base)
            lease.owner = weakref.ref(owner)
            lease.last_acquired = now
            lease.plan_event = None
            lease.run_events = {}
            return lease

    def fit_int_workspace(self, lease: _Lease, nbytes: int) -> None:
        """Give ``lease``'s wrapper an int workspace for a plan that writes at most ``nbytes`` into it (FlashInfer
        0.7.4: ``_int_workspace_buffer`` on the device, where the runs read the schedule, and
        ``_pin_memory_int_workspace_buffer``, page-locked host memory of the same size, where ``plan()`` writes it
        before queuing the copy; ``plan()`` and the runs read both attributes as they are). The size is the power of
        two at or above ``nbytes``, at least :data:`MIN_INT_WORKSPACE_BYTES`; buffers already between that and 4
        times it are kept. Call it on a lease :meth:`acquire` just handed out, before its ``plan()``: nothing queued
        reads the buffers it replaces (a new wrapper's constructor buffers, or those of a plan whose copies and runs
        have completed). A wrapper without an int workspace (a stand-in) is left alone."""
        buf = internals.int_workspace(lease.wrapper)
        if buf is None:
            return
        target = max(MIN_INT_WORKSPACE_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())
        have = buf.numel() * buf.element_size()
        if not target <= have <= 4 * target:
            self._set_int_workspace(lease.wrapper, target)

    def _set_int_workspace(self, wrapper: Any, nbytes: int) -> None:
        internals.set_int_workspace(
            wrapper,
            torch.empty(nbytes, dtype=torch.uint8, device=self.device),
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda"),
        )

    def acquire_wrapper(self, backend: str, owner: object, factory: Callable[[torch.Tensor, str], Any]) -> Any:
        """The wrapper of :meth:`acquire` (held by ``owner`` until it is garbage collected)."""
        return self.acquire(backend, owner, factory).wrapper

    def trim(self) -> int:
        """Free every pooled wrapper that is free (no plan, no graph, GPU done) beyond ``max_idle_wrappers`` per
        backend; returns how many were freed."""
        freed = 0
        with self._lock:
            for slots in self._slots.values():
                idle = sorted((s for s in slots if s.free()), key=lambda s: s.last_acquired, reverse=True)
                drop = {id(s) for s in idle[self.max_idle_wrappers :]}
                freed += len(drop)
                slots[:] = [s for s in slots if id(s) not in drop]
        return freed

    @property
    def pooled_wrappers(self) -> int:
        """Wrappers the pool holds now (held by plans, retained by graphs, or idle)."""
        with self._lock:
            return sum(len(s) for s in self._slots.values())

    def retain_for_graph(self, lease: _Lease, graph: Any, stream: Any = None) -> Any:
        """Keep ``lease`` out of the pool while ``graph`` exists (see :meth:`mla_bridge.RaggedPlan.retain_for_graph`:
        ``stream`` is a stream, a list of streams, or None): captures of ``lease`` into ``graph``, made before this
        call or after it, are then ``graph``'s. Returns the ``weakref.finalize`` that hands it back (call it to hand
        back early)."""
        key = id(graph)
        ref = weakref.ref(graph)
        with self._lock:
            lease.graph_holds += 1
            entry = lease.registered.get(key)
            if entry is None or entry[0]() is not graph:
                lease.registered[key] = [ref, 1]
            else:
                entry[1] += 1
            pending = lease.pending.get(key)
            if pending is not None and pending() is graph:
                del lease.pending[key]  # captured before it was registered: now a registered graph's capture
        return weakref.finalize(graph, self._graph_released, lease, stream, key)

    def captured(self, lease: _Lease) -> None:
        """A run of ``lease``'s wrapper is being captured into a CUDA graph: it stays out of the pool while that
        graph may replay it. The graph is the one :func:`capturing_graph` names: if it is registered for ``lease``
        (:meth:`retain_for_graph`, before or after the capture) its registration covers the capture; if it is not
        (yet), it is kept as ``pending`` until it is registered; where no graph is named, the wrapper is retired for
        good (``captured``). No CUDA call (a stream is capturing)."""
        graph = capturing_graph()
        with self._lock:
            if graph is None:
                lease.captured = True
                return
            key = id(graph)
            entry = lease.registered.get(key)
            if entry is not None and entry[0]() is graph:
                return
            try:
                lease.pending[key] = weakref.ref(graph)
            except TypeError:  # not weakly referenceable: it can never be matched to a registration
                lease.captured = True

    def _graph_released(self, lease: _Lease, stream: Any, key: int) -> None:
        # The graph is gone; its replays were queued on ``stream``: one stream, or a list of them (read now: the graph
        # owner appends each stream it replays on), or None / an empty list for the current one. The wrapper stays
        # busy until the work queued so far on each of them has completed. A finalizer may run while a stream
        # captures: then the events are recorded at the next plan instead (an event recorded now on the capturing
        # stream would become part of that graph).
        # Only this graph's hold is released: captures no registered graph covers keep the wrapper out of the pool.
        if self.device.type == "cuda":
            if (stream is None or isinstance(stream, list)) and torch.cuda.is_current_stream_capturing():
                with self._lock:
                    self._released_graphs.append((lease, stream, key))
                return
            streams = list(stream) if isinstance(stream, list) else [] if stream is None else [stream]
            for s in streams or [torch.cuda.current_stream(self.device)]:
                event = lease.event()
                event.record(s)
                with self._lock:
                    lease.run_events[("graph", id(event))] = event
        with self._lock:
            lease.graph_holds -= 1
            entry = lease.registered.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del lease.registered[key]

    def plan_with_growth(self, plan: Callable[[], T], lease: Optional[_Lease] = None) -> T:
        """Run a FlashInfer ``plan`` call, growing the float workspace while it reports "Buffer overflow" for one of
        its float allocations (fa2's split-KV partials), and ``lease``'s int workspace while it reports one for an
        allocation of the int workspace (:meth:`fit_int_workspace` sized it from an upper bound, so this happens
        only where FlashInfer's schedule differs from that bound's; :attr:`int_workspace_growths` counts them).

        ``lease``: the wrapper being planned (re-buffered on growth with the free wrappers; nothing of it is queued
        yet: FlashInfer's plan fails on the host before it copies).

        Raises:
            WorkspaceTooSmallError: the plan needs more than ``max_float_workspace_bytes``.
        """
        grown_int: set = set()  # int allocations grown for: one reported again is not the int workspace's
        while True:
            try:
                result = plan()
                with self._lock:
                    self.plans_made += 1
                return result
            except RuntimeError as err:
                match = _OVERFLOW.search(str(err))
                if match is None:
                    raise
                what, size, available = match.group(1), int(match.group(2)), int(match.group(3))
                buf = internals.int_workspace(lease.wrapper) if lease is not None else None
                if what not in _FLOAT_ALLOCATIONS and buf is not None and what not in grown_int:
                    assert lease is not None  # buf is lease.wrapper's
                    grown_int.add(what)
                    have = buf.numel() * buf.element_size()
                    need = have + max(0, size - available) + 4096
                    self._set_int_workspace(lease.wrapper, 1 << (max(need, 2 * have) - 1).bit_length())
                    with self._lock:
                        self.int_workspace_growths += 1
                    continue
                needed = self.float_workspace_bytes + max(0, size - available) + 4096
                new_size = max(needed, 2 * self.float_workspace_bytes)
                if new_size > self.max_float_workspace_bytes:
                    if needed > self.max_float_workspace_bytes:
                        raise WorkspaceTooSmallError(needed, self.max_float_workspace_bytes, what) from None
                    new_size = self.max_float_workspace_bytes
                    if new_size <= self.float_workspace_bytes:
                        raise WorkspaceTooSmallError(needed, self.max_float_workspace_bytes, what) from None
                self._grow(new_size, lease)

    def _grow(self, new_size: int, planning: Optional[_Lease] = None) -> None:
        """A larger float workspace. Free wrappers (and the one being planned) are re-buffered now; wrappers of live
        plans keep the old buffer, which they hold, until they are free again (then :meth:`acquire` re-points them).
        Old stream regions are dropped: each was allocated on its own stream, so torch reuses it only after the
        work queued there."""
        with self._lock:
            if new_size > self.float_workspace_bytes:  # else another thread grew it meanwhile
                self.float_workspace_bytes = new_size
                self._float_workspace = None
                self._regions = {}
                buf = self.float_workspace
                for slots in self._slots.values():
                    for slot in slots:
                        if slot is not planning and slot.free():
                            slot.wrapper.reset_workspace_buffer(buf, internals.int_workspace(slot.wrapper))
            buf = self.float_workspace
            if planning is not None and internals.float_workspace(planning.wrapper) is not buf:
                planning.wrapper.reset_workspace_buffer(buf, internals.int_workspace(planning.wrapper))

    def __repr__(self) -> str:
        pooled = sum(len(s) for s in self._slots.values())
        return (
            f"Workspace(device={self.device}, float_workspace_bytes={self.float_workspace_bytes}, "
            f"chunk_tokens={self.chunk_tokens}, wrappers={pooled})"
        )


_DEFAULT_WORKSPACES: dict[torch.device, Workspace] = {}
_DEFAULT_LOCK = threading.Lock()


def default_workspace(device: "torch.device | str") -> Workspace:
    """The process-wide :class:`Workspace` for ``device``, made on first use (what the one-shot calls share)."""
    dev = checked_device(device)
    ws = _DEFAULT_WORKSPACES.get(dev)
    if ws is None:
        with _DEFAULT_LOCK:
            ws = _DEFAULT_WORKSPACES.get(dev)
            if ws is None:
                ws = _DEFAULT_WORKSPACES[dev] = Workspace(dev)
    return ws
