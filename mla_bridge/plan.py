"""PrefillPlan: everything about one prefill batch that is known on the host, planned once for every layer.

A batch is ``query_lens[r]`` new tokens per request ``r`` plus ``context_lens[r]`` cached tokens before them
(a prefix-cache hit or the earlier part of a chunked prefill). Data flows one way: this plan -> the passes in
:mod:`mla_bridge.prefill` -> the merge.

Two schedules, picked here from host lengths alone:
  * **fused** (all context fits one chunk, ``sum(context_lens) <= workspace.chunk_tokens``, and the fused keys' k/v
    buffer, ``keys x H x (head_dim_qk + head_dim_vo)`` elements, stays under 2**31): each request's keys
    are its context followed by its new tokens, and ONE causal pass covers everything. Bottom-right causal
    alignment makes new token ``i`` see all ``context_len`` context keys plus new keys ``<= i`` -- exactly MLA
    prefill's mask -- so no merge is needed.
  * **chunked** (context larger than one chunk): a causal main pass over the new tokens, then the context cut into
    chunks of at most ``chunk_tokens`` tokens, packed request by request in order and split at any token, each run
    non-causally over the queries of the requests it holds and merged by LSE (vLLM's context-chunk scheme). Where a
    chunk's k/v buffer would reach the 32-bit element offsets of the backend serving it (cutlass on SM100 with 128
    heads: from 52429 tokens), chunks are made smaller (:meth:`PrefillPlan._chunk_step`).

A request without new tokens attends nothing, so no pass reads its context: the fused schedule gathers only the
context of requests with new tokens (only that counts toward its one chunk), and the chunked schedule skips every
chunk that holds no request's new tokens (:attr:`PrefillPlan.num_gathered_context_tokens`).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from . import switches
from .cache import ChunkRows, resolve_kv_cache_dtype
from .dims import MLADims
from .dispatch import ENV_VAR, OFFSET_LIMITS, device_capability, select_backend
from .kernels import triton_available
from .checks import (
    INT32_MAX,
    as_lengths,
    check_length_sums,
    checked_device,
    not_a_bool,
    positive_int,
    refuse_beyond_memory,
)
from .ragged import RaggedPlan, checked_plan_sizes, plan_checked
from .workspace import Workspace, current_stream

__all__ = ["PrefillPlan", "ContextChunk", "schedule_context_chunks", "lookup_key", "keep_key", "plans_by_device"]


@dataclass(frozen=True)
class ContextChunk:
    """One context chunk: requests ``req_start:req_end`` (contiguous, so their query rows ``q_start:q_end`` are
    contiguous too), ``kv_indptr`` (int32 CPU ``[req_end - req_start + 1]``) their context tokens in the chunk,
    the first request's starting at position ``first_start`` of its context, the others' at 0; ``plan`` is its
    non-causal pass (``None`` when the chunk's requests have no new tokens), ``spans[i] = (request, first context
    token, end)`` its nonempty pieces.

    Its rows for the gather, ``rows`` (:class:`mla_bridge.cache.ChunkRows`): on CUDA the pass's kv_indptr on the device,
    as FlashInfer's ``plan()`` copied it (or the plan's own copy), from which the kernels find each token's request
    themselves; on the CPU the host kv_indptr, from which the torch gather makes the per-token ``(req_ids,
    positions)`` in each call. Planning makes no per-token index tensor for a chunk on either device (``rows.indices``
    is None). :attr:`req_ids` / :attr:`positions` make them on request.

    Merge rounds (:meth:`PrefillPlan._plan_chunks`): ``part_row`` is the first row of this chunk's partial out / lse
    in the call's partial buffer, and ``merge_rows`` the query rows ``(start, stop)`` merged into the output after
    this chunk's pass (None: a later chunk of its round merges them)."""

    req_start: int
    req_end: int
    q_start: int
    q_end: int
    kv_indptr: torch.Tensor
    first_start: int
    plan: Optional[RaggedPlan]
    rows: ChunkRows
    part_row: int = 0
    merge_rows: Optional[tuple[int, int]] = None

    @property
    def spans(self) -> tuple[tuple[int, int, int], ...]:
        kv = self.kv_indptr.tolist()
        starts = [self.first_start] + [0] * (len(kv) - 2)
        return tuple(
            (r, s, s + b - a) for r, s, a, b in zip(range(self.req_start, self.req_end), starts, kv, kv[1:]) if b > a
        )

    @property
    def num_tokens(self) -> int:
        return int(self.kv_indptr[-1])

    def token_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(req_ids, positions)``, int64 ``[num_tokens]``: the request and context position of each of the chunk's
        tokens, in order (:meth:`mla_bridge.cache.ChunkRows.token_indices`, the torch gather's input), made at each
        call from :attr:`rows` on the plan's device (16 bytes per token, plus temporaries)."""
        return self.rows.token_indices()

    @property
    def req_ids(self) -> torch.Tensor:
        """The request of each token (:meth:`token_indices`)."""
        return self.token_indices()[0]

    @property
    def positions(self) -> torch.Tensor:
        """Each token's position in its request's context (:meth:`token_indices`)."""
        return self.token_indices()[1]


def schedule_context_chunks(context_lens: Sequence[int], chunk_tokens: int) -> list[list[tuple[int, int, int]]]:
    """Pack context tokens into chunks of at most ``chunk_tokens``, request by request in order.

    Returns a list of chunks, each a list of ``(request, start, end)`` spans with ``end > start`` (no empty
    segment); a request's context may be split across consecutive chunks at any token. (The reference loop:
    :class:`PrefillPlan` computes the same chunks with O(1) numpy calls, see :meth:`PrefillPlan._plan_chunks`.)

    Raises:
        ValueError: ``chunk_tokens`` not a positive int (0 or a negative budget would never fill a chunk: the loop
            would not end).
    """
    chunk_tokens = positive_int("chunk_tokens", chunk_tokens)
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = chunk_tokens
    for r, n in enumerate(context_lens):
        start = 0
        while start < n:
            take = min(n - start, room)
            current.append((r, start, start + take))
            start += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_tokens
    if current:
        chunks.append(current)
    return chunks


#: The most context chunks one plan holds. Each is host bookkeeping (:class:`ContextChunk`, its kv_indptr and rows:
#: about :data:`CHUNK_HOST_BYTES`, and about 10 us of build time) and a few kernel launches per layer, whether or not
#: it has new tokens to run; 2**20 chunks are about 1 GiB. The default chunk budget (65536 tokens) never reaches it
#: (``2**31 - 1`` context tokens are 32768 chunks); a budget under 2048 tokens can.
MAX_CONTEXT_CHUNKS = 1 << 20
#: Host bytes of one context chunk of a plan, an upper bound of what was measured (0.6 to 1.1 KiB).
CHUNK_HOST_BYTES = 1024


def _bytes_text(n: int) -> str:
    return f"{n} bytes" if n < 2**20 else f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def _check_chunk_count(total_context: int, chunk_tokens: int) -> None:
    """Refuse, in O(1), a chunked schedule of more than :data:`MAX_CONTEXT_CHUNKS` chunks, naming ``context_lens``,
    the chunk budget and the host bytes the chunks would take.

    Raises:
        ValueError: ``ceil(total_context / chunk_tokens) > MAX_CONTEXT_CHUNKS``.
    """
    chunks = -(-total_context // chunk_tokens)
    if chunks > MAX_CONTEXT_CHUNKS:
        raise ValueError(
            f"context_lens sum to {total_context} tokens: {chunks} context chunks of at most chunk_tokens="
            f"{chunk_tokens} tokens, more than a plan holds ({MAX_CONTEXT_CHUNKS}, MAX_CONTEXT_CHUNKS); they would take "
            f"about {_bytes_text(chunks * CHUNK_HOST_BYTES)} of host memory ({CHUNK_HOST_BYTES} bytes each) and "
            f"{chunks} passes per layer. Raise the workspace's chunk budget (Workspace(chunk_tokens=...)) to "
            f"chunk_tokens >= {-(-total_context // MAX_CONTEXT_CHUNKS)}"
        )


def _checked_topk(index_topk) -> Optional[int]:
    """``index_topk`` as a plan records it: None (dense), or a positive int (sparse attention over the top K keys)."""
    return None if index_topk is None else positive_int("index_topk", index_topk)


def _check_fuse_context(fuse_context) -> None:
    if not isinstance(fuse_context, bool):
        raise not_a_bool("fuse_context", fuse_context)


def _indptr(lens: np.ndarray) -> np.ndarray:
    """int32 ``[0, l0, l0 + l1, ...]`` (numpy) of non-negative int64 lengths whose sum :func:`check_length_sums` has
    checked (so every prefix fits int32: accumulated straight into an int32 buffer)."""
    out = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return out


class PrefillPlan:
    """Host-side plan of one MLA prefill batch, shared by every layer (see the module docstring).

    Build it with :meth:`build`. Attributes: ``dims``, ``block_size``, ``query_lens``, ``context_lens`` (lists of ints),
    ``qo_indptr`` (int32 CPU ``[batch + 1]``), ``main_kv_indptr`` (int32 CPU: the main pass's keys; in the fused
    schedule attended context + new: :attr:`num_gathered_context_tokens`), ``fused`` (bool), ``main``
    (:class:`RaggedPlan`), ``chunks`` (list of :class:`ContextChunk`, with their merge rounds: :attr:`num_merges`,
    :attr:`partial_rows`, :attr:`merge_steps`, :attr:`running_rows`), ``device``, ``dtype``, ``kv_cache_dtype``, ``workspace``, ``key`` (everything the plan
    depends on, see :class:`PlanCache`; made on first use), and for the fused schedule the device index tensors that
    place gathered context and new tokens into one key buffer.
    """

    # What build sets (annotations only: no class attribute, so the properties' ``self.__dict__.get`` of the lazily
    # made ones still sees them absent until made).
    dims: MLADims
    workspace: Workspace
    block_size: int
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    query_lens: list[int]
    context_lens: list[int]
    index_topk: Optional[int]
    qo_indptr: torch.Tensor
    main_kv_indptr: torch.Tensor
    fused: bool
    main: RaggedPlan
    chunks: list[ContextChunk]
    ctx_req_ids: Optional[torch.Tensor]
    ctx_positions: Optional[torch.Tensor]
    ctx_dst: Optional[torch.Tensor]
    new_dst: Optional[torch.Tensor]
    sparse_token_meta: Optional[torch.Tensor]
    sparse_latent_meta: Optional[torch.Tensor]
    _sizes: dict
    _backend: Optional[str]
    _requested: Optional[str]
    _fuse_context: bool
    _chunk_tokens: int
    _key: Optional[tuple]
    _num_tokens: int
    _num_context_tokens: int
    _num_gathered: int
    _capability: Optional[tuple[int, int]]
    _kv_row: int
    _device_indices: list[torch.Tensor]
    _streams_seen: set[int]
    _ready: Optional[torch.cuda.Event]
    _pinned_runs: torch.Tensor
    _pinned_meta: torch.Tensor
    _partial_rows: int
    _offset_limit: tuple
    _merge_steps: tuple[tuple, int]

    def __init__(self) -> None:  # use PrefillPlan.build
        raise TypeError("use PrefillPlan.build(query_lens, context_lens, dims=..., workspace=..., block_size=..., ...)")

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Optional[Sequence[int]] = None,
        *,
        dims: MLADims,
        workspace: Workspace,
        block_size: int,
        device: "torch.device | str | None" = None,
        dtype: torch.dtype = torch.bfloat16,
        backend: Optional[str] = None,
        fuse_context: bool = True,
        kv_cache_dtype=None,
        index_topk: Optional[int] = None,
    ) -> "PrefillPlan":
        """Plan a batch once: indptrs, the context-chunk schedule, and one :class:`RaggedPlan` per pass.

        Args:
            query_lens: new tokens per request (ints >= 0), ``[batch]``.
            context_lens: cached context tokens per request (default all 0), ``[batch]``.
            dims: the layer's :class:`MLADims`.
            workspace: the device's :class:`Workspace`; ``workspace.chunk_tokens`` bounds one chunk (tokens).
            block_size: tokens per block of the paged latent cache.
            device: must be the workspace's device (default: it).
            dtype: q / cache / weight dtype (bf16 or fp16 for FlashInfer; float32 runs the torch backend; float64 is
                taken too, but the torch backend computes attention in float32: out comes back in float64 with
                float32 accuracy, LSE is float32; for a float64 reference use :mod:`mla_bridge.reference`).
            backend: force a backend for every pass (see :func:`mla_bridge.select_backend`).
            fuse_context: allow the fused single-pass schedule when the context fits one chunk (default True).
            kv_cache_dtype: the paged cache's dtype (``plan.kv_cache_dtype``): None / ``"auto"`` = ``dtype``;
                ``"fp8"`` / ``torch.float8_e4m3fn`` / ``torch.uint8`` = an FP8 e4m3 cache with one per-tensor
                scale, dequantized into ``dtype`` in the gather (see :mod:`mla_bridge.cache`).
            index_topk: None (default) for dense prefill; a positive int ``K`` for DeepSeek Sparse Attention: every
                :func:`mla_bridge.mla_prefill` call with this plan then takes ``topk_indices [T, K]`` and runs the
                sparse pass of :mod:`mla_bridge.sparse` (a dense call is refused, as are indices with a dense plan).
                The dense passes are planned as for ``index_topk=None`` (the sparse pass reads only the plan's
                lengths, dims and dtypes). :attr:`index_topk`; part of :attr:`key`.

        Raises:
            TypeError / ValueError: lengths that are not non-negative ints or differ in count, ``query_lens`` or
                ``context_lens`` summing beyond ``2**31 - 1`` tokens (checked first, in O(requests)), a chunked
                schedule of more than :data:`MAX_CONTEXT_CHUNKS` chunks (``sum(context_lens) / chunk_tokens``: the
                message names both and the host bytes; in O(1), before any chunk), a bad block size, a device other than the workspace's, a forced backend that cannot serve, a kv_cache_dtype that
                is not supported (fp8_e5m2, fp8_ds_mla, an unquantized dtype other than ``dtype``), an ``index_topk`` that
                is neither None nor a positive int; ``query_lens`` whose out, lse and (dense) k / v buffers alone
                exceed all the memory of the device (:func:`mla_bridge.checks.refuse_beyond_memory`).

        Host work is O(requests + chunks) on CUDA, never a synchronizing call, and one FlashInfer ``plan()`` per
        distinct pass shape. The chunked schedule makes no per-token index tensor there: each chunk's gather reads its
        pass's kv_indptr as ``plan()`` copied it to the device (:class:`ContextChunk`, :class:`ChunkRows`). The fused
        schedule's placements are ONE expansion of a small run table on the device (:meth:`_expand`): one
        page-locked host-to-device copy and one Triton kernel where Triton imports (four torch kernels otherwise);
        the first such build in a process compiles that kernel (or loads it from Triton's cache). :attr:`key` is
        not made here (on first use). The fused schedule's placements (a sparse plan has them too, where its fused
        key latents fit one chunk's k / v memory) are 24 bytes per gathered context token and 8 per new token, device
        memory (on the CPU device, host memory); the chunked schedule makes no per-token tensor on any device (its
        gathers make a chunk's indices in each call),
        so a plan's host memory is O(requests + chunks): about :data:`CHUNK_HOST_BYTES` per chunk, at most
        :data:`MAX_CONTEXT_CHUNKS` chunks. A request without new tokens has its context neither gathered nor indexed.
        """
        _check_fuse_context(fuse_context)
        self = object.__new__(cls)
        self.index_topk = _checked_topk(index_topk)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        q_lens = as_lengths("query_lens", query_lens)
        c_lens = [0] * len(q_lens) if context_lens is None else as_lengths("context_lens", context_lens)
        if len(c_lens) != len(q_lens):
            raise ValueError(f"context_lens has {len(c_lens)} entries but query_lens has {len(q_lens)}")
        num_new, total_context = check_length_sums(q_lens, c_lens)
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims must be an MLADims, got {type(dims).__name__}")
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a mla_bridge.Workspace, got {type(workspace).__name__}")
        block_size = positive_int("block_size", block_size)
        if block_size > INT32_MAX:  # the kernels address a slot of a block with 32-bit positions
            raise ValueError(f"block_size must be at most {INT32_MAX} tokens, got {block_size}")
        dev = workspace.device if device is None else checked_device(device)
        if dev != workspace.device:
            raise ValueError(f"device {dev} differs from the workspace's device {workspace.device}")
        # Every pass shares these sizes: checked once here, before any index tensor or plan is made.
        self._sizes = checked_plan_sizes(
            num_heads=dims.num_heads,
            head_dim_qk=dims.head_dim_qk,
            head_dim_vo=dims.head_dim_vo,
            sm_scale=dims.softmax_scale,
            dtype=dtype,
            workspace=workspace,
        )
        # what every call of the plan allocates at least: out and lse, and (dense) the new tokens' k / v buffer
        d, e = dims, dtype.itemsize
        kv_dims = 0 if self.index_topk is not None else d.head_dim_qk + d.head_dim_vo
        refuse_beyond_memory(
            "query_lens",
            f"{'out and lse' if kv_dims == 0 else 'out, lse and k / v'} of {num_new} new tokens x {d.num_heads} heads",
            num_new * d.num_heads * ((d.v_head_dim + kv_dims) * e + 4),
            dev,
        )
        self._backend = backend
        self.dims, self.workspace, self.block_size, self.device, self.dtype = dims, workspace, block_size, dev, dtype
        self.query_lens, self.context_lens = q_lens, c_lens
        # What the key reads that may change after the build (the budget, the environment), as the plan was made;
        # the key itself is made on first use (:attr:`key`: build does not need it).
        self._fuse_context, self._chunk_tokens = fuse_context, workspace.chunk_tokens
        self._requested = _requested_backend(backend)
        self._key = None
        self._num_tokens, self._num_context_tokens = num_new, total_context
        # Context that no new token attends (a request with cached context and no new tokens) is never read: the
        # fused schedule does not gather it, nor count it toward its one chunk (the chunked one skips such chunks).
        gathered_lens = [c if q else 0 for q, c in zip(q_lens, c_lens)] if total_context and 0 in q_lens else c_lens
        self._num_gathered = total_context if gathered_lens is c_lens else sum(gathered_lens)
        qo = list(itertools.accumulate(q_lens, initial=0))  # exact Python ints, each <= the checked sum
        qo_host = np.array(qo, dtype=np.int32)
        self.qo_indptr = torch.from_numpy(qo_host)
        # One dispatch-table read of the device for every pass (they run on it together), remembered per device.
        self._capability = device_capability(dev) if dev.type == "cuda" else None
        fused_keys = self._num_gathered + num_new
        # Every pass reads k and v as views of one [keys, H, head_dim_qk + head_dim_vo] buffer (mla_bridge.kv), whose
        # (token, head) strides the dispatch bounds (_kv_strides). The fused keys' buffer stays below every kernel's
        # 32-bit offset limit (mla_bridge.dispatch.OFFSET_LIMITS), so fusing never changes which backend serves the
        # main pass.
        self._kv_row = dims.num_heads * (dims.head_dim_qk + dims.head_dim_vo)  # elements per key token
        self.fused = (
            fuse_context
            and 0 < self._num_gathered <= workspace.chunk_tokens
            and fused_keys * self._kv_row < min(OFFSET_LIMITS.values())
        )
        self.chunks = []
        self.ctx_req_ids = self.ctx_positions = self.ctx_dst = self.new_dst = None
        self._device_indices = []
        # The sparse pass gathers the attended context once into the fused key latents (each request's context, then
        # its new tokens: the fused schedule's placements; an FP8 cache dequantized) where they take no more memory
        # than one context chunk's up-projected k / v; the kernel then reads contiguous rows (mla_bridge.sparse)
        sparse_latent = (
            self.index_topk is not None
            and self._num_gathered > 0
            and (self._num_gathered + num_new) * dims.latent_dim <= workspace.chunk_tokens * self._kv_row
        )
        q = np.asarray(q_lens, dtype=np.int64)
        c = np.asarray(gathered_lens, dtype=np.int64)
        if self.fused:
            kv_host = _indptr(c + q)
            self.main_kv_indptr = torch.from_numpy(kv_host)
        else:
            _check_chunk_count(total_context, workspace.chunk_tokens)  # before any chunk or pass is made
            kv_host, self.main_kv_indptr = qo_host, self.qo_indptr  # keys = queries; neither is ever written
            self.chunks = self._plan_chunks(qo, qo_host)
        if self.fused or sparse_latent:
            self._plan_fused_indices(q, c)
        self.sparse_token_meta = self.sparse_latent_meta = None
        if self.index_topk is not None:
            self._sparse_token_meta(qo_host, c if sparse_latent else None)
        self.main = self._plan_pass(
            qo_host, kv_host, True, num_new, fused_keys if self.fused else num_new, self.qo_indptr, self.main_kv_indptr
        )
        self._streams_seen, self._ready = set(), None
        if self._device_indices:
            ptr, stream = current_stream(dev)
            self._streams_seen.add(ptr)
            if self.main.flashinfer_wrapper is None and not torch.cuda.is_current_stream_capturing():
                # No FlashInfer plan event covers the copies and kernels queued above (the torch backend, or an empty
                # main pass: no new tokens, so no chunk has a pass either, but their kv_indptrs were copied): our own.
                self._ready = torch.cuda.Event()
                self._ready.record(stream)
        return self

    def order_on_current_stream(self) -> None:
        """Call before a layer reads this plan's device data on the current stream (:func:`mla_bridge.mla_prefill`
        does). It waits for the copies queued at plan time (:meth:`RaggedPlan.order_after_plan`; where the passes run
        the torch backend, which plans nothing on the device, or an empty main pass, for an event the build recorded
        after its own copies).
        The first time a stream other than the build stream reads the plan's device index tensors, it also marks them
        used there
        (``Tensor.record_stream``), so that torch's caching allocator does not hand their memory to a new allocation
        on the build stream while work queued on this stream still reads it after the plan is dropped. Costs one
        ``current_stream`` look-up per call; nothing on the CPU or while a CUDA graph is being captured (a graph
        holds its plans)."""
        self.main.order_after_plan()
        if not self._device_indices or torch.cuda.is_current_stream_capturing():
            return
        ptr, stream = current_stream(self.device)
        if ptr not in self._streams_seen:
            self.use_on_stream(ptr, stream)

    def use_on_stream(self, ptr: int, stream) -> None:
        """Mark this plan's device index tensors used on ``stream`` (raw handle ``ptr``), once per stream: the stream
        waits for the plan's own event (where the build recorded one) and each tensor gets ``record_stream``, so that
        torch's caching allocator keeps their memory from new allocations until the work queued on ``stream`` when the
        plan is dropped has completed. :meth:`order_on_current_stream` does this for eager calls;
        :meth:`mla_bridge.graphs.PrefillGraph.replay` for each stream a captured graph is replayed on (a replay runs
        no Python per layer). Nothing on the CPU device (no device index tensors)."""
        if ptr in self._streams_seen or not self._device_indices:
            return
        if self._ready is not None:
            stream.wait_event(self._ready)
        for t in self._device_indices:
            t.record_stream(stream)
        self._streams_seen.add(ptr)

    def _plan_pass(
        self,
        qo: np.ndarray,
        kv: np.ndarray,
        causal: bool,
        num_qo_tokens: int,
        num_kv_tokens: int,
        qo_indptr: Optional[torch.Tensor] = None,
        kv_indptr: Optional[torch.Tensor] = None,
    ) -> RaggedPlan:
        """One pass's :class:`RaggedPlan`: int32 indptrs ``qo``, ``kv`` made here from checked lengths (their last
        entries, the token counts, known here; ``qo_indptr`` / ``kv_indptr``: the tensors viewing them where made
        already), sizes checked and the device's capability read once in :meth:`build`."""
        return plan_checked(
            torch.from_numpy(qo) if qo_indptr is None else qo_indptr,
            torch.from_numpy(kv) if kv_indptr is None else kv_indptr,
            causal=causal,
            backend=self._backend,
            num_qo_tokens=num_qo_tokens,
            num_kv_tokens=num_kv_tokens,
            host=(qo, kv),
            capability=self._capability,
            strides=self._kv_strides(),
            **self._sizes,
        )

    def _kv_strides(self) -> tuple:
        """The ``(q, k, v)`` strides every pass is planned with (:func:`mla_bridge.select_backend`): q as the caller's
        contiguous ``[T, H, head_dim_qk]`` (a strided q is checked where it is handed over:
        :func:`mla_bridge.mla_prefill` before any kernel, :meth:`RaggedPlan.validate`), k and v as views of the
        pass's ``[keys, H, head_dim_qk + head_dim_vo]`` buffer (:mod:`mla_bridge.kv`, both weight layouts)."""
        p = self.dims.head_dim_qk + self.dims.head_dim_vo
        return (None, (self._kv_row, p), (self._kv_row, p))

    def _chunk_step(self) -> int:
        """Context tokens per chunk: ``workspace.chunk_tokens`` as the plan was built, lowered where a chunk's k/v
        buffer would reach the 32-bit offset limit (:data:`mla_bridge.dispatch.OFFSET_LIMITS`) of the backend that
        serves a chunk below it on this device (what :func:`mla_bridge.select_backend` answers for a non-causal
        pass, the backend asked for included), so that every chunk stays with that backend instead of being routed
        past it (128 heads x 320 on SM100: 52428 tokens, not 65536, for cutlass). Asked only where a chunk could
        reach the smallest limit."""
        step = self._chunk_tokens
        if self.device.type != "cuda" or step * self._kv_row < min(OFFSET_LIMITS.values()):
            return step
        s = self._sizes
        choice = select_backend(
            self.device,
            capability=self._capability,
            dtype=s["dtype"],
            out_dtype=s["dtype"],
            head_dim_qk=s["head_dim_qk"],
            head_dim_vo=s["head_dim_vo"],
            causal=False,
            num_heads=s["num_heads"],
            requested=self._backend,
        )
        limit = OFFSET_LIMITS.get(choice.name)
        return step if limit is None else max(1, min(step, (limit - 1) // self._kv_row))

    def _sparse_token_meta(self, qo_host: np.ndarray, gathered: Optional[np.ndarray]) -> None:
        """:attr:`sparse_token_meta`: int32 ``[T, 4]`` on the plan's device, per new token its request, the request's
        context length, its sequence length (context + new) and the row of ``kv_c`` / ``k_pe`` holding its sequence
        position 0 (its first new token's row minus the context length): where the sparse pass
        (:mod:`mla_bridge.sparse`) places each pick. And :attr:`sparse_latent_meta` where ``gathered`` (int64 ``[batch]``,
        each request's gathered context) is given: the same table for the fused key latents
        (:func:`mla_bridge.cache.fused_latent`, each request's context then its new tokens), context length 0 and the
        request's first key row in the last column. Made once per plan, not per layer: O(T) numpy work into
        page-locked memory and one host-to-device copy that never blocks the host, queued before the main pass's plan (whose event covers it, or the plan's own event) and kept in
        ``_device_indices``."""
        q = np.asarray(self.query_lens, dtype=np.int64)
        c = np.asarray(self.context_lens, dtype=np.int64)
        req = np.repeat(np.arange(q.size, dtype=np.int64), q)
        tables: list[tuple[np.ndarray, ...]] = [
            (req, c[req], (c + q)[req], qo_host[:-1].astype(np.int64)[req] - c[req])
        ]
        if gathered is not None:
            seq_start = np.cumsum(gathered + q) - (gathered + q)  # each request's first row of the fused key latents
            tables.append((req, np.zeros_like(req), (c + q)[req], seq_start[req]))
        host = torch.empty(len(tables), req.size, 4, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        for i, cols in enumerate(tables):
            for j, col in enumerate(cols):
                host.numpy()[i, :, j] = col
        if self.device.type == "cpu":
            meta = host
        else:
            self._pinned_meta = host
            meta = host.to(self.device, non_blocking=True)
            self._device_indices.append(meta)
        self.sparse_token_meta = meta[0]
        if len(tables) > 1:
            self.sparse_latent_meta = meta[1]

    def _expand(self, counts: np.ndarray, firsts: np.ndarray, counting_runs: int) -> torch.Tensor:
        """Per-token indices from per-request host data: runs of int64 values, concatenated in order, run ``i``
        holding ``counts[i]`` values, ``firsts[i], firsts[i] + 1, ...`` for the first ``counting_runs`` runs
        (counting runs) and ``firsts[i]`` repeated for the others (constant runs). Returns one int64 tensor of
        ``counts.sum()`` values on the plan's device, which the caller splits into views: ONE buffer per plan, the
        fused schedule's placements (:meth:`_plan_fused_indices`; the chunked schedule makes none: its gathers read
        the chunks' kv_indptrs).

        The host makes a table of ``2 x runs`` int64 (each run's end in the output and its base value, the value at
        token ``t`` being ``base[run] (+ t in a counting run)``), O(runs) numpy work. On CUDA the expansion runs on
        the device, so host work stays O(runs), not O(tokens), with a fixed few torch calls whatever the batch: the
        table goes to the device in one small host-to-device copy that never blocks the host (it leaves page-locked
        memory with ``non_blocking=True`` on the current stream, ordered before the RaggedPlans made after it, whose
        plan events therefore cover it; the page-locked tensor stays referenced by the plan as ``_pinned_runs``, and
        torch's host allocator records the copy's event before it reuses that memory), then ONE Triton kernel
        (:mod:`mla_bridge.kernels.expand`: an output allocation and a launch) where Triton imports, else four torch
        kernels (:func:`_expand_on_device`); :func:`_expand_impl` chooses. The device buffer goes to
        ``_device_indices`` (:meth:`order_on_current_stream` marks it used on each stream that reads it). On the CPU
        device host memory is device memory: numpy expands the runs.
        """
        table = np.empty((2, counts.size), dtype=np.int64)  # per run: where it ends in the output, its base value
        ends, base = table
        np.cumsum(counts, out=ends)
        total = int(ends[-1]) if ends.size else 0
        counting = int(ends[counting_runs - 1]) if counting_runs else 0  # tokens of the counting runs
        base[:] = firsts  # the output's value at token t is base[run] (+ t in a counting run)
        base[:counting_runs] -= ends[:counting_runs] - counts[:counting_runs]
        out: "np.ndarray | torch.Tensor"
        if self.device.type == "cpu":
            out = np.repeat(base, counts)
            out[:counting] += np.arange(counting)
            return torch.from_numpy(out)
        expand = _expand_on_device_triton if _expand_impl(self.device) == "triton" else _expand_on_device
        out, self._pinned_runs = expand(table, total, counting, self.device)
        self._device_indices.append(out)
        return out

    def _plan_fused_indices(self, q: np.ndarray, c: np.ndarray) -> None:
        """The fused schedule's rows: context token ``i`` of request ``r`` is gathered from position ``i`` of ``r``'s
        context (``ctx_req_ids``, ``ctx_positions``) into key row ``ctx_dst``; new token ``j`` goes to key row
        ``new_dst``; each request's keys are its context followed by its new tokens."""
        b = c.size
        seq_start = np.cumsum(c + q) - (c + q)  # first key row of each request
        counts = np.concatenate([c, c, q, c])
        firsts = np.concatenate([np.zeros(b, dtype=np.int64), seq_start, seq_start + c, np.arange(b)])
        flat = self._expand(counts, firsts, counting_runs=3 * b)
        n_ctx, n_new = self._num_gathered, self._num_tokens
        self.ctx_positions, self.ctx_dst, self.new_dst, self.ctx_req_ids = flat.split_with_sizes(
            [n_ctx, n_ctx, n_new, n_ctx]
        )

    def _plan_chunks(self, qo_list: list[int], qo_all: np.ndarray) -> list[ContextChunk]:
        """The chunks of :func:`schedule_context_chunks`, with O(1) numpy calls plus O(1) work per chunk: all context
        tokens, request after request, form one stream, and chunk ``k`` is its tokens ``[k * chunk_tokens, (k + 1) *
        chunk_tokens)``. One :class:`RaggedPlan` per distinct ``(qo_indptr, kv_indptr)`` pair (chunks of the same shape
        share it, and its host indptrs: nothing else of a chunk enters FlashInfer's plan).

        A chunk's rows for the gather: on CUDA its pass's kv_indptr on the device (:class:`ChunkRows`), the copy
        FlashInfer's ``plan()`` makes anyway (:attr:`RaggedPlan.device_kv_indptr`; where a pass has none, the torch
        backend, one page-locked copy for all such passes, :func:`_indptrs_on_device`): no per-token tensor, no
        kernel. On the CPU device its host kv_indptr (the same tensor): the torch gather makes the chunk's per-token
        ``(req_ids, positions)`` from it in each call (:meth:`ChunkRows.token_indices`), so that no device holds
        memory per context token between calls (``rows.indices`` is None). ``qo_list`` / ``qo_all``: ``qo_indptr``
        as Python ints and as int32."""
        total = self._num_context_tokens
        if total == 0:
            return []
        step = self._chunk_step()
        # The stream offset where each request's context starts (qo_list: the same for its new tokens), as Python ints
        # for the chunk bounds (bisect = np.searchsorted(side="right"): a few chunks per batch, where a numpy call per
        # quantity costs more than the loop) and as int32, whose slices are the chunks' keys.
        offsets = list(itertools.accumulate(self.context_lens, initial=0))
        cum, q_lens = np.array(offsets, dtype=np.int32), self.query_lens
        starts = range(0, total, step)  # chunk i holds the stream's tokens starts[i]:starts[i] + sizes[i]
        sizes = [step] * (total // step) + ([total % step] if total % step else [])
        on_cpu = self.device.type == "cpu"
        # The chunks' requests; then merge rounds (below), which need the next chunk's rows.
        bounds = []
        for start, size in zip(starts, sizes):
            req_start = bisect.bisect_right(offsets, start) - 1  # the request holding the chunk's first token
            req_end = bisect.bisect_right(offsets, start + size - 1)  # 1 + the request holding its last token
            bounds.append((req_start, req_end, qo_list[req_start], qo_list[req_end]))
        rounds = _merge_rounds([(q_start, q_end) for _, _, q_start, q_end in bounds])
        plans: dict = {}
        made = []
        for start, size, (req_start, req_end, q_start, q_end) in zip(starts, sizes, bounds):
            # The chunk's keys: the stream's [start, start + size) cut at its requests' edges (only the first
            # request begins before the chunk, only the last ends after it).
            kv = cum[req_start : req_end + 1] - start
            kv[0], kv[-1] = 0, size
            plan = None
            if q_end > q_start:
                # Its shape: these keys and its requests' query lengths (which fix qo_indptr from 0).
                key = (kv.tobytes(), tuple(q_lens[req_start:req_end]))
                plan = plans.get(key)
                if plan is None:
                    plan = plans[key] = self._plan_pass(
                        qo_all[req_start : req_end + 1] - q_start,
                        kv,
                        False,
                        q_end - q_start,
                        size,
                        kv_indptr=torch.from_numpy(kv),
                    )
                kv_indptr = plan.kv_indptr  # equal values: the first chunk of this shape's tensor
            else:
                kv_indptr = torch.from_numpy(kv)
            made.append((kv_indptr, start - offsets[req_start], plan))
        chunks = []
        device_kv = None if on_cpu else self._device_kv_indptrs(made)
        for i, ((kv_indptr, first, plan), (req_start, req_end, q_start, q_end), (part_row, merge_rows)) in enumerate(
            zip(made, bounds, rounds)
        ):
            # mypy drops ChunkRows's default for indices (it takes INDEX_BYTES in the class body for a bad field), and
            # device_kv is a list wherever on_cpu is false
            rows = ChunkRows(
                kv_indptr if on_cpu else device_kv[i],  # type: ignore[call-arg,index]
                req_start,
                first,
                sizes[i],
            )
            chunks.append(
                ContextChunk(req_start, req_end, q_start, q_end, kv_indptr, first, plan, rows, part_row, merge_rows)
            )
        return chunks

    def _device_kv_indptrs(self, made: list) -> list:
        """Each chunk's kv_indptr on the device (``made``: per chunk its host kv_indptr, first start and pass): its
        pass's copy from FlashInfer's ``plan()`` (:attr:`RaggedPlan.device_kv_indptr`, shared by the chunks of one
        pass); for a pass without one (the torch backend) and a chunk without a pass (never gathered by
        :func:`mla_bridge.mla_prefill`, but :func:`mla_bridge.kv.chunk_kv` takes any chunk) ONE page-locked
        host-to-device copy for all of them (:func:`_indptrs_on_device`, queued before the main pass's plan, whose
        event covers it, or the plan's own event), which goes to ``_device_indices``. A pass's own copy does not: it
        belongs to FlashInfer's wrapper, which the workspace's pool neither frees nor plans again until the events
        recorded after the runs that read it have completed (:class:`mla_bridge.Workspace`), so it needs no
        ``record_stream`` (which, on a stream that another library destroys first, such as XLA's at interpreter exit,
        made freeing it abort the process)."""
        found, missing = {}, {}  # by id of the pass, or of the chunk's host kv_indptr for a chunk without one
        for kv_indptr, _, plan in made:
            owner = kv_indptr if plan is None else plan
            if id(owner) not in found and id(owner) not in missing:
                dev = None if plan is None else plan.device_kv_indptr
                if dev is None:
                    missing[id(owner)] = kv_indptr
                else:
                    found[id(owner)] = dev
        if missing:
            copies = _indptrs_on_device([kv.numpy() for kv in missing.values()], self.device)
            found.update(zip(missing, copies))
            self._device_indices.extend(copies)
        return [found[id(kv_indptr if plan is None else plan)] for kv_indptr, _, plan in made]

    @property
    def key(self) -> tuple:
        """Everything this plan depends on, hashable (:func:`_plan_key`, with the chunk budget and the backend asked
        for as they were at :meth:`build`): what :class:`PlanCache` keys it by. Made on first use and kept."""
        key = self._key
        if key is None:
            key = self._key = _plan_key(
                self.query_lens,
                self.context_lens,
                self.dims,
                self.workspace,
                self.block_size,
                self.device,
                self.dtype,
                self._requested,
                self._fuse_context,
                self.kv_cache_dtype,
                self._chunk_tokens,
                self.index_topk,
            )
        return key

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """New tokens in the batch (rows of q and out): ``sum(query_lens)`` (= ``qo_indptr[-1]``)."""
        return self._num_tokens

    @property
    def out_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """The shapes of a :func:`mla_bridge.mla_prefill` call's ``out`` ``[T, H, v_head_dim]`` and ``lse`` ``[T, H]``
        (``T`` = :attr:`num_tokens`)."""
        t, h = self._num_tokens, self.dims.num_heads
        return (t, h, self.dims.v_head_dim), (t, h)

    @property
    def num_context_tokens(self) -> int:
        """Cached context tokens in the batch: ``sum(context_lens)``."""
        return self._num_context_tokens

    @property
    def num_gathered_context_tokens(self) -> int:
        """Cached context tokens one :func:`mla_bridge.mla_prefill` call gathers (and up-projects): in the fused
        schedule those of the requests with new tokens, in the chunked one those of the chunks holding some request's
        new tokens (no pass reads the context of a request without any, unless it shares a chunk with one). At most
        :attr:`num_context_tokens`."""
        if self.fused:
            return self._num_gathered
        return sum(c.num_tokens for c in self.chunks if c.plan is not None)

    @property
    def capability(self) -> Optional[tuple[int, int]]:
        """The CUDA device's compute capability ``(major, minor)``, read once at build; None off CUDA."""
        return self._capability

    @property
    def backend(self):
        """The :class:`BackendChoice` of the main pass (every pass uses the same dispatch table)."""
        return self.main.backend

    @property
    def partial_rows(self) -> int:
        """Query rows of the merge round with the most (0 without planned chunks): the rows of the one partial out /
        lse that :func:`mla_bridge.mla_prefill` allocates per call and reuses for every round (at most
        :attr:`num_tokens`)."""
        rows = self.__dict__.get("_partial_rows")
        if rows is None:
            rows = self._partial_rows = max(
                (c.merge_rows[1] - c.merge_rows[0] for c in self.chunks if c.merge_rows is not None), default=0
            )
        return rows

    @property
    def offset_limit(self) -> tuple:
        """``(limit, backend name)``: the smallest 32-bit offset limit (:data:`mla_bridge.dispatch.OFFSET_LIMITS`)
        among the backends of this plan's passes, ``(None, None)`` where none has one. Every pass reads q (or a slice
        of its rows), so a q that reaches this far through its strides cannot be read in place by all of them
        (:func:`mla_bridge.mla_prefill` refuses it before any kernel)."""
        found = self.__dict__.get("_offset_limit")
        if found is None:
            passes = [self.main] + [c.plan for c in self.chunks if c.plan is not None]
            limits = [
                (OFFSET_LIMITS[p.backend.name], p.backend.name) for p in passes if p.backend.name in OFFSET_LIMITS
            ]
            found = self._offset_limit = min(limits) if limits else (None, None)
        return found

    @property
    def num_merges(self) -> int:
        """Merges one :func:`mla_bridge.mla_prefill` call runs: one per merge round."""
        return sum(c.merge_rows is not None for c in self.chunks)

    @property
    def flashinfer_bytes(self) -> tuple[int, int]:
        """``(device bytes, page-locked host bytes)`` the FlashInfer plans of this plan's passes hold while it lives
        (:attr:`RaggedPlan.flashinfer_bytes` of the main pass and of each distinct chunk pass): int workspaces sized
        to each pass's schedule, indptr copies, and on cutlass FlashInfer's work-index buffers (about 1.5 MiB per pass
        plan). Counted in :func:`mla_bridge.prefill.prefill_memory_bytes`."""
        device = host = 0
        for p in [self.main] + list({id(c.plan): c.plan for c in self.chunks if c.plan is not None}.values()):
            d, h = p.flashinfer_bytes
            device, host = device + d, host + h
        return device, host

    @property
    def running_rows(self) -> int:
        """Rows of the float32 running out one :func:`mla_bridge.mla_prefill` call holds between the merges of a row
        that is merged more than once (a request whose context is split over chunks): 0 where every row is merged
        at most once, and for float32 / float64 plans (their out holds the running state itself). At most the new
        tokens of one request (:attr:`merge_steps`)."""
        return self._merge_schedule()[1]

    @property
    def merge_steps(self) -> tuple:
        """Per chunk (aligned with :attr:`chunks`): None for a chunk whose pass merges nothing, else its merge as
        consecutive steps ``(row_start, row_stop, src, dst)`` that tile its ``merge_rows``: rows
        ``row_start:row_stop`` of out merge with their partial from the running out ``src`` (None: from out itself,
        the row's first merge; an int: that row of the float32 running out, :attr:`running_rows`) into ``dst``
        (None: out in the plan's dtype, the row's last merge; an int: the running row). Without running rows each
        merge is one step ``(start, stop, None, None)``: out merged in place, as for one merge per row.
        Made on first use (:func:`_merge_steps`) and kept."""
        return self._merge_schedule()[0]

    def _merge_schedule(self) -> tuple:
        made = self.__dict__.get("_merge_steps")
        if made is None:
            made = self._merge_steps = _merge_steps(
                [c.merge_rows for c in self.chunks], running=self.dtype.itemsize < 4
            )
        return made

    @property
    def num_plans(self) -> int:
        """Ragged plans made for this batch: the main pass plus one per distinct chunk shape (chunks with equal
        query and key lengths share one; never one per layer)."""
        return 1 + len({id(c.plan) for c in self.chunks if c.plan is not None})

    def __repr__(self) -> str:
        return (
            f"PrefillPlan(batch={self.batch_size}, new_tokens={self.num_tokens}, "
            f"context_tokens={self.num_context_tokens}, fused={self.fused}, chunks={len(self.chunks)}, "
            f"backend={self.backend.name!r}"
            + ("" if self.index_topk is None else f", index_topk={self.index_topk}")
            + ")"
        )


def _merge_rounds(rows: Sequence[tuple[int, int]]) -> list[tuple[int, Optional[tuple[int, int]]]]:
    """Per chunk (its query rows ``(q_start, q_end)``, in order), ``(part_row, merge_rows)``: where its partial out /
    lse starts in the call's partial buffer, and the rows merged into the output after its pass (None: not yet).

    A merge round is a run of consecutive chunks with query rows (chunks without any are skipped: no pass, no
    partial), each beginning at the row where the one before it ended: their partials tile the round's rows, each row
    written by exactly one pass, so ONE merge of those rows after the round's last pass does what one merge per chunk
    did, on every row the same operation on the same values (bitwise the same). A chunk that shares a request's rows
    with the one before it (a request's context split between them) or leaves a gap of rows (requests without
    context between them, rows no pass of the round writes) starts a new round. Requests whose context fits one
    chunk, the common case, so cost one merge per round of chunks instead of one per chunk (a batch of 16 x (2048 +
    512) in 8 chunks: 1 instead of 8); one long request split over chunks keeps one merge per chunk."""
    out: list = []
    open_start = None  # the first row of the open round
    prev_end = None
    for i, (q_start, q_end) in enumerate(rows):
        if q_end == q_start:
            out.append((0, None))
            continue
        if q_start != prev_end:
            if open_start is not None:
                j = last
                out[j] = (out[j][0], (open_start, prev_end))
            open_start = q_start
        assert open_start is not None  # set by the first chunk with rows (prev_end is None there), never reset
        out.append((q_start - open_start, None))
        prev_end, last = q_end, i
    if open_start is not None:
        out[last] = (out[last][0], (open_start, prev_end))
    return out


def _merge_steps(merge_rows: Sequence[Optional[tuple[int, int]]], running: bool) -> tuple[tuple, int]:
    """``(steps per chunk, running rows)`` of :attr:`PrefillPlan.merge_steps` for the chunks' ``merge_rows`` (in
    order; None for a chunk that merges nothing); ``running``: whether rows merged more than once keep a float32
    running out between their merges (half-precision plans), else every merge is one in-place step.

    Merge rounds (:func:`_merge_rounds`) come in row order: round ``k`` merges rows ``[s_k, e_k)``, with ``s_k`` and
    ``e_k`` non-decreasing in ``k``, and two consecutive rounds share at most the rows of one request (the one whose
    context the chunk edge splits). So the rows of round ``k`` merged before are ``[s_k, min(e_k, e_{k-1}))`` and the
    rows merged again are ``[max(s_k, s_{k+1}), e_k)``, both the rows of that one request; the running row of query
    row ``r`` is ``r - s_{k+1}`` while it goes from round ``k`` to round ``k + 1`` (where one request's rows are
    both, ``s_k = s_{k+1}``: the same running rows, merged in place). Up to three steps per round (merged before and
    last / first and last / first and merged again); the running out holds the rows of one request at a time."""
    merges = [rows for rows in merge_rows if rows is not None]
    out: list = []
    width, k = 0, 0
    for rows in merge_rows:
        if rows is None:
            out.append(None)
            continue
        s, e = rows
        if not running:
            out.append(((s, e, None, None),))
            continue
        before = min(e, max(s, merges[k - 1][1])) if k else s  # [s, before): read from the running out
        again = max(s, min(e, merges[k + 1][0])) if k + 1 < len(merges) else e  # [again, e): written to it
        cuts = sorted({s, before, again, e})
        out.append(
            tuple(
                (lo, hi, lo - s if lo < before else None, lo - again if lo >= again else None)
                for lo, hi in zip(cuts, cuts[1:])
            )
        )
        width = max(width, e - again)
        k += 1
    return tuple(out), width


def _page_locked(table: np.ndarray) -> torch.Tensor:
    """A page-locked int64 copy of ``table``, for a host-to-device copy that never blocks the host: allocated
    page-locked (torch's caching host allocator) and filled through numpy. ``Tensor.pin_memory()`` would first ask
    the driver whether the numpy memory is page-locked already (``cudaPointerGetAttributes`` under a device guard)
    and then copy through a torch op: host time per plan build on the GPU host, for the same bytes."""
    host = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = table
    return host


def _indptrs_on_device(indptrs: list, device: torch.device) -> list:
    """int32 copies on ``device`` of the numpy indptrs ``indptrs``: one page-locked buffer filled on the host, ONE
    host-to-device copy that never blocks the host (``non_blocking`` from page-locked memory, on the current stream),
    views of the result."""
    sizes = [a.size for a in indptrs]
    host = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=True)
    np.concatenate(indptrs, out=host.numpy())
    return list(host.to(device, non_blocking=True).split(sizes))


def _expand_impl(device: torch.device) -> str:
    """The ONE place choosing the device half of :meth:`PrefillPlan._expand`: ``"triton"`` (one kernel,
    :func:`_expand_on_device_triton`) on CUDA where Triton imports, else ``"torch"`` (four torch kernels,
    :func:`_expand_on_device`). Both give the same values (integer arithmetic)."""
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def _expand_on_device(
    table: np.ndarray, total: int, counting: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device half of :meth:`PrefillPlan._expand` in torch ops (the fallback where Triton does not import): one
    copy and four kernels whatever the batch. From ``table`` (int64 ``[2, runs]``: where each run ends in the output,
    and its base value), the int64 ``[total]`` output ``out[t] = base[run holding t] + (t if t < counting else 0)`` on
    ``device``, and the page-locked copy of ``table`` the caller keeps. The run of token ``t`` is the first whose end
    exceeds ``t`` (an empty run never is)."""
    host = _page_locked(table)
    small = host.to(device, non_blocking=True)
    t = torch.arange(total, dtype=torch.int64, device=device)
    run = torch.searchsorted(small[0], t, right=True, out_int32=True)
    out = small[1].index_select(0, run)
    out[:counting].add_(t[:counting])  # in place on the view (``+=`` on a slice also runs a __setitem__ copy call)
    return out, host


def _expand_on_device_triton(
    table: np.ndarray, total: int, counting: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_expand_on_device` with ONE Triton kernel for the four torch ones (:func:`_launch_expand`): the same
    copy of the page-locked table, then an output allocation and a launch on the current stream."""
    host = _page_locked(table)
    return _launch_expand(host.to(device, non_blocking=True), total, counting), host


def _launch_expand(table: torch.Tensor, total: int, counting: int) -> torch.Tensor:
    """The expansion kernel (:func:`mla_bridge.kernels.expand.expand_runs_triton`) on the device ``table``, imported
    on first use (Triton is not needed on the CPU)."""
    from .kernels.expand import expand_runs_triton

    return expand_runs_triton(table, total, counting)


def _requested_backend(backend: Optional[str]) -> Optional[str]:
    """The backend asked for: ``backend``, else ``MLA_BRIDGE_BACKEND`` (as :func:`mla_bridge.select_backend` reads
    it), else None."""
    return backend if backend is not None else (switches.raw(ENV_VAR) or None)


def _plan_key(
    q_lens: list,
    c_lens: list,
    dims: MLADims,
    workspace: Workspace,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    requested: Optional[str],
    fuse_context: bool,
    kv_cache_dtype: torch.dtype,
    chunk_tokens: int,
    index_topk: Optional[int] = None,
) -> tuple:
    """Everything a :class:`PrefillPlan` depends on, hashable: per-request query and context lengths, dims (sizes and
    softmax scale), dtype, the cache dtype (resolved: ``"fp8"`` and ``torch.uint8`` are one key), block size, the chunk
    budget (``chunk_tokens``: ``workspace.chunk_tokens`` when the plan is made or asked for), the backend asked for
    (``requested``: :func:`_requested_backend`), the schedule switch, the workspace (by identity: a plan holds its
    wrappers), the device and ``index_topk`` (None for a dense plan)."""
    return (
        tuple(q_lens),
        tuple(c_lens),
        dims,
        dtype,
        kv_cache_dtype,
        block_size,
        chunk_tokens,
        requested,
        bool(fuse_context),
        id(workspace),
        device,
        index_topk,
    )


def plans_by_device(plans: Iterable[PrefillPlan]) -> dict[torch.device, PrefillPlan]:
    """``{device: plan}`` of per-device plans of one batch (at least one; e.g. one per device of a head-sharded mesh,
    each for its share of the heads), checked to agree on every host value but the device: lengths, dims, dtypes,
    block size, schedule (fused, number of chunks), ``index_topk``.

    Raises:
        ValueError: two plans that differ in anything but their device (both shown).
    """
    found = {p.device: p for p in plans}
    first, *others = found.values()
    for p in others:
        if _shared_values(p) != _shared_values(first):
            raise ValueError(f"per-device plans must agree on everything but the device, got {first!r} and {p!r}")
    return found


def _shared_values(p: PrefillPlan) -> tuple:
    sizes = (p.query_lens, p.context_lens, p.dims, p.dtype, p.kv_cache_dtype, p.block_size)
    return sizes + (p.fused, len(p.chunks), p.index_topk)


def lookup_key(
    query_lens: Sequence[int],
    context_lens: Optional[Sequence[int]] = None,
    *,
    dims: MLADims,
    workspace: Workspace,
    block_size: int,
    device: "torch.device | str | None" = None,
    dtype: torch.dtype = torch.bfloat16,
    backend: Optional[str] = None,
    fuse_context: bool = True,
    kv_cache_dtype=None,
    index_topk: Optional[int] = None,
) -> tuple[list, list, int, Optional[tuple]]:
    """The key :meth:`PrefillPlan.build` would give its plan for these arguments (:attr:`PrefillPlan.key`), made
    before building it, for a cache's look-up (:class:`mla_bridge.plan_cache.PlanCache`): ``(query_lens, context_lens,
    block_size, key)`` with the lengths and block size as build reads them; ``key`` is None where ``dims`` or
    ``workspace`` is not of its type (build then raises). What build refuses in the lengths, block size and schedule
    switch (and ``index_topk``) is refused here, before any look-up (``4.0 == 4`` and ``1 == True`` as key parts).

    Raises:
        TypeError / ValueError: as :meth:`PrefillPlan.build` for the lengths, ``block_size``, ``fuse_context`` and
            ``index_topk``.
    """
    q_lens = as_lengths("query_lens", query_lens)
    c_lens = [0] * len(q_lens) if context_lens is None else as_lengths("context_lens", context_lens)
    _check_fuse_context(fuse_context)
    block_size = positive_int("block_size", block_size)
    index_topk = _checked_topk(index_topk)
    key = None
    if isinstance(workspace, Workspace) and isinstance(dims, MLADims):
        dev = workspace.device if device is None else checked_device(device)
        key = _plan_key(
            q_lens,
            c_lens,
            dims,
            workspace,
            block_size,
            dev,
            dtype,
            _requested_backend(backend),
            fuse_context,
            resolve_kv_cache_dtype(kv_cache_dtype, dtype),
            workspace.chunk_tokens,
            index_topk,
        )
    return q_lens, c_lens, block_size, key


def keep_key(plan: PrefillPlan, key: Optional[tuple]) -> PrefillPlan:
    """``plan`` with :attr:`PrefillPlan.key` set to ``key`` (from :func:`lookup_key` on the arguments it was built
    from, read at the same moment), so the key is not made twice; ``None`` leaves it to be made on first use."""
    if key is not None:
        plan._key = key
    return plan


def __getattr__(name: str):
    if name == "PlanCache":  # its home is mla_bridge.plan_cache (above this module); kept importable from here
        from .plan_cache import PlanCache

        return PlanCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
