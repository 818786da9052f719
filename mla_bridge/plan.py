"""PrefillPlan: everything about one prefill batch that is known on the host, planned once for every layer.

A batch is ``query_lens[r]`` new tokens per request ``r`` plus ``context_lens[r]`` cached tokens before them
(a prefix-cache hit or the earlier part of a chunked prefill). Data flows one way: this plan -> the passes in
:mod:`mla_bridge.prefill` -> the merge.

Two schedules, picked here from host lengths alone:
  * **fused** (all context fits one chunk, ``sum(context_lens) <= workspace.chunk_tokens``, and the fused keys
    stay under 2**31 elements): each request's keys
    are its context followed by its new tokens, and ONE causal pass covers everything. Bottom-right causal
    alignment makes new token ``i`` see all ``context_len`` context keys plus new keys ``<= i`` -- exactly MLA
    prefill's mask -- so no merge is needed.
  * **chunked** (context larger than one chunk): a causal main pass over the new tokens, then the context cut into
    chunks of at most ``chunk_tokens`` tokens, packed request by request in order and split at any token, each run
    non-causally over the queries of the requests it holds and merged by LSE (vLLM's context-chunk scheme).
"""

from __future__ import annotations

import numbers
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .cache import resolve_kv_cache_dtype
from .dims import MLADims
from .dispatch import ENV_VAR
from .ragged import INT32_MAX, RaggedPlan, indptr_from_lens, plan_ragged
from .workspace import Workspace, _checked_device

__all__ = ["PrefillPlan", "ContextChunk", "schedule_context_chunks", "PlanCache"]


@dataclass(frozen=True)
class ContextChunk:
    """One context chunk: requests ``req_start:req_end`` (contiguous, so their query rows ``q_start:q_end`` are
    contiguous too), with ``spans[i] = (request, first context token, end)``; ``plan`` is its non-causal pass."""

    req_start: int
    req_end: int
    q_start: int
    q_end: int
    spans: tuple[tuple[int, int, int], ...]
    plan: Optional[RaggedPlan]
    req_ids: Optional[torch.Tensor]  # int64 [chunk tokens] on the device: request of each gathered token
    positions: Optional[torch.Tensor]  # int64 [chunk tokens]: its position in that request's context

    @property
    def num_tokens(self) -> int:
        return sum(end - start for _, start, end in self.spans)


def schedule_context_chunks(context_lens: Sequence[int], chunk_tokens: int) -> list[list[tuple[int, int, int]]]:
    """Pack context tokens into chunks of at most ``chunk_tokens``, request by request in order.

    Returns a list of chunks, each a list of ``(request, start, end)`` spans with ``end > start`` (no empty
    segment); a request's context may be split across consecutive chunks at any token.
    """
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


def _lengths(name: str, values: Sequence[int]) -> list[int]:
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
    if all(type(v) is int for v in values) and (not values or min(values) >= 0):
        return values  # plain non-negative ints (the common case): no per-item work
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


def _check_length_sums(q_lens: list[int], c_lens: list[int]) -> None:
    """New and context tokens each index int32 offsets (qo_indptr, block positions, vLLM's seq_lens): refuse sums
    beyond ``2**31 - 1`` in O(requests), before any per-token or per-chunk work."""
    for name, lens in (("query_lens", q_lens), ("context_lens", c_lens)):
        total = sum(lens)
        if total > INT32_MAX:
            raise ValueError(f"{name} sum to {total} tokens, beyond what an int32 indptr holds "
                             f"(2**31 - 1 = {INT32_MAX} tokens)")


class PrefillPlan:
    """Host-side plan of one MLA prefill batch, shared by every layer (see the module docstring).

    Build it with :meth:`build`. Attributes: ``dims``, ``block_size``, ``query_lens``, ``context_lens`` (lists of
    ints), ``qo_indptr`` (int32 CPU ``[batch + 1]``), ``main_kv_indptr`` (int32 CPU: the main pass's keys; in the
    fused schedule context + new), ``fused`` (bool), ``main`` (:class:`RaggedPlan`), ``chunks``
    (list of :class:`ContextChunk`), ``device``, ``dtype``, ``kv_cache_dtype``, ``workspace``, ``key`` (everything
    the plan depends on, see :class:`PlanCache`), and for the fused schedule the device index tensors that place
    gathered context and new tokens into one key buffer.
    """

    def __init__(self) -> None:  # use PrefillPlan.build
        raise TypeError("use PrefillPlan.build(query_lens, context_lens, dims=..., workspace=..., block_size=..., ...)")

    @classmethod
    def build(cls, query_lens: Sequence[int], context_lens: Optional[Sequence[int]] = None, *, dims: MLADims,
              workspace: Workspace, block_size: int, device: "torch.device | str | None" = None,
              dtype: torch.dtype = torch.bfloat16, backend: Optional[str] = None,
              fuse_context: bool = True, kv_cache_dtype=None) -> "PrefillPlan":
        """Plan a batch once: indptrs, the context-chunk schedule, and one :class:`RaggedPlan` per pass.

        Args:
            query_lens: new tokens per request (ints >= 0), ``[batch]``.
            context_lens: cached context tokens per request (default all 0), ``[batch]``.
            dims: the layer's :class:`MLADims`.
            workspace: the device's :class:`Workspace`; ``workspace.chunk_tokens`` bounds one chunk (tokens).
            block_size: tokens per block of the paged latent cache.
            device: must be the workspace's device (default: it).
            dtype: q / cache / weight dtype (bf16 or fp16 for FlashInfer; float32 runs the torch backend).
            backend: force a backend for every pass (see :func:`mla_bridge.select_backend`).
            fuse_context: allow the fused single-pass schedule when the context fits one chunk (default True).
            kv_cache_dtype: the paged cache's dtype (``plan.kv_cache_dtype``): None / ``"auto"`` = ``dtype``;
                ``"fp8"`` / ``torch.float8_e4m3fn`` / ``torch.uint8`` = an FP8 e4m3 cache with one per-tensor
                scale, dequantized into ``dtype`` in the gather (see :mod:`mla_bridge.cache`).

        Raises:
            TypeError / ValueError: lengths that are not non-negative ints or differ in count, ``query_lens`` or
                ``context_lens`` summing beyond ``2**31 - 1`` tokens (checked first, in O(requests)), a bad block
                size, a device other than the workspace's, a forced backend that cannot serve, a kv_cache_dtype that
                is not supported (fp8_e5m2, fp8_ds_mla, an unquantized dtype other than ``dtype``).

        Host work is O(requests + chunks) on CUDA (per-token index tensors are expanded on the device). On the CPU
        device those index tensors are host memory, made here: 16 bytes per context token in the chunked schedule,
        24 per context token and 8 per new token in the fused one.
        """
        self = object.__new__(cls)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        q_lens = _lengths("query_lens", query_lens)
        c_lens = [0] * len(q_lens) if context_lens is None else _lengths("context_lens", context_lens)
        if len(c_lens) != len(q_lens):
            raise ValueError(f"context_lens has {len(c_lens)} entries but query_lens has {len(q_lens)}")
        _check_length_sums(q_lens, c_lens)
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims must be an MLADims, got {type(dims).__name__}")
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a mla_bridge.Workspace, got {type(workspace).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        block_size = int(block_size)
        dev = workspace.device if device is None else _checked_device(device)
        if dev != workspace.device:
            raise ValueError(f"device {dev} differs from the workspace's device {workspace.device}")
        self.dims, self.workspace, self.block_size, self.device, self.dtype = dims, workspace, block_size, dev, dtype
        self.query_lens, self.context_lens = q_lens, c_lens
        self.key = _plan_key(q_lens, c_lens, dims, workspace, block_size, dev, dtype, backend, fuse_context)
        self.qo_indptr = indptr_from_lens(q_lens, "query_lens")
        total_context = sum(c_lens)
        fused_keys = total_context + sum(q_lens)
        # Fused keys stay below every kernel's 32-bit offset limit (mla_bridge.dispatch), so fusing never changes
        # which backend serves the main pass.
        self.fused = (fuse_context and 0 < total_context <= workspace.chunk_tokens
                      and fused_keys * dims.num_heads * max(dims.head_dim_qk, dims.head_dim_vo) < 2 ** 31)
        common = dict(num_heads=dims.num_heads, head_dim_qk=dims.head_dim_qk, head_dim_vo=dims.head_dim_vo,
                      sm_scale=dims.softmax_scale, dtype=dtype, workspace=workspace, backend=backend)
        self.chunks = []
        self.ctx_req_ids = self.ctx_positions = self.ctx_dst = self.new_dst = None
        if self.fused:
            seq = [c + q for c, q in zip(c_lens, q_lens)]
            self.main_kv_indptr = indptr_from_lens(seq)
            self._plan_fused_indices()
        else:
            self.main_kv_indptr = self.qo_indptr.clone()
            self.chunks = self._plan_chunks(schedule_context_chunks(c_lens, workspace.chunk_tokens), common)
        self.main = plan_ragged(self.qo_indptr, self.main_kv_indptr, causal=True, **common)
        self._device_indices = [t for t in (self.ctx_req_ids, self.ctx_positions, self.ctx_dst, self.new_dst,
                                            *(x for c in self.chunks for x in (c.req_ids, c.positions)))
                                if isinstance(t, torch.Tensor) and t.is_cuda]
        self._streams_seen = ({torch.cuda.current_stream(dev).cuda_stream} if self._device_indices else set())
        return self

    def order_on_current_stream(self) -> None:
        """Call before a layer reads this plan's device data on the current stream (:func:`mla_bridge.mla_prefill`
        does). It waits for the copies queued at plan time (:meth:`RaggedPlan.order_after_plan`). The first time a
        stream other than the build stream reads the plan's device index tensors, it also marks them used there
        (``Tensor.record_stream``), so that torch's caching allocator does not hand their memory to a new allocation
        on the build stream while work queued on this stream still reads it after the plan is dropped. Costs one
        ``current_stream`` look-up per call; nothing on the CPU or while a CUDA graph is being captured (a graph
        holds its plans)."""
        self.main.order_after_plan()
        if not self._device_indices or torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream not in self._streams_seen:
            for t in self._device_indices:
                t.record_stream(stream)
            self._streams_seen.add(stream.cuda_stream)

    def _expand(self, counts: np.ndarray, *values: np.ndarray) -> list[torch.Tensor]:
        """Per-token device indices from per-segment host data, with one small host-to-device copy.

        For segments of ``counts[i]`` tokens returns ``[offset of each token in its segment] + [values[j][segment of
        each token] for each j]`` (int64 device tensors of ``counts.sum()`` entries). On CUDA the expansion runs on the
        device, so host work stays O(segments), not O(tokens). The copy never blocks the host: it leaves page-locked
        memory with ``non_blocking=True`` on the current stream (ordered before the RaggedPlans made after it, whose
        plan events therefore cover it); the page-locked tensor stays referenced by the plan (and torch's host
        allocator records the copy's event before it reuses that memory).
        """
        total = int(counts.sum())
        starts = np.cumsum(counts) - counts
        if self.device.type == "cpu":  # host memory is device memory: expand with numpy
            offset = np.arange(total) - np.repeat(starts, counts)
            return [torch.from_numpy(a) for a in [offset] + [np.repeat(v.astype(np.int64), counts) for v in values]]
        host = torch.from_numpy(np.stack([counts, starts, *values]).astype(np.int64)).pin_memory()
        self.__dict__.setdefault("_pinned_indices", []).append(host)
        small = host.to(self.device, non_blocking=True)
        seg = torch.repeat_interleave(torch.arange(counts.size, device=self.device), small[0], output_size=total)
        offset = torch.arange(total, device=self.device) - small[1][seg]
        return [offset] + [small[2 + j][seg] for j in range(len(values))]

    def _plan_fused_indices(self) -> None:
        c = np.asarray(self.context_lens, dtype=np.int64)
        q = np.asarray(self.query_lens, dtype=np.int64)
        seq_start = np.cumsum(c + q) - (c + q)
        pos, req, ctx_base = self._expand(c, np.arange(c.size), seq_start)
        new_pos, new_base = self._expand(q, seq_start + c)
        self.ctx_req_ids, self.ctx_positions = req, pos
        self.ctx_dst = ctx_base + pos
        self.new_dst = new_base + new_pos

    def _plan_chunks(self, schedule, common) -> list[ContextChunk]:
        """The chunks of ``schedule``: one :class:`RaggedPlan` per distinct ``(qo_indptr, kv_indptr)`` pair (chunks of
        the same shape share it: nothing else of a chunk enters FlashInfer's plan), and every chunk's token indices
        from ONE expansion over all spans (one host-to-device copy for the whole schedule), sliced per chunk."""
        if not schedule:
            return []
        spans = np.asarray([span for chunk in schedule for span in chunk], dtype=np.int64)
        positions, req_ids, first = self._expand(spans[:, 2] - spans[:, 1], spans[:, 0], spans[:, 1])
        positions += first  # offset in the span + the span's first position (in place: one token-long buffer less)
        del first
        qo_all = self.qo_indptr.numpy()
        plans: dict = {}
        chunks, tok = [], 0
        for chunk in schedule:
            req_start, req_end = chunk[0][0], chunk[-1][0] + 1
            kv_lens = [0] * (req_end - req_start)
            for r, start, end in chunk:
                kv_lens[r - req_start] = end - start
            q_start, q_end = int(qo_all[req_start]), int(qo_all[req_end])
            plan = None
            if q_end > q_start:
                qo = qo_all[req_start:req_end + 1] - q_start
                key = (tuple(qo.tolist()), tuple(kv_lens))
                plan = plans.get(key)
                if plan is None:
                    plan = plans[key] = plan_ragged(torch.from_numpy(qo), indptr_from_lens(kv_lens), causal=False,
                                                    **common)
            n = sum(kv_lens)
            chunks.append(ContextChunk(req_start, req_end, q_start, q_end, tuple(chunk), plan,
                                       req_ids[tok:tok + n], positions[tok:tok + n]))
            tok += n
        return chunks

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """New tokens in the batch (rows of q and out)."""
        return int(self.qo_indptr[-1])

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def backend(self):
        """The :class:`BackendChoice` of the main pass (every pass uses the same dispatch table)."""
        return self.main.backend

    @property
    def num_plans(self) -> int:
        """Ragged plans made for this batch: the main pass plus one per distinct chunk shape (chunks with equal
        query and key lengths share one; never one per layer)."""
        return 1 + len({id(c.plan) for c in self.chunks if c.plan is not None})

    def __repr__(self) -> str:
        return (f"PrefillPlan(batch={self.batch_size}, new_tokens={self.num_tokens}, "
                f"context_tokens={self.num_context_tokens}, fused={self.fused}, chunks={len(self.chunks)}, "
                f"backend={self.backend.name!r})")


def _plan_key(q_lens: list, c_lens: list, dims: MLADims, workspace: Workspace, block_size: int, device: torch.device,
              dtype: torch.dtype, backend: Optional[str], fuse_context: bool) -> tuple:
    """Everything a :class:`PrefillPlan` depends on, hashable: per-request query and context lengths, dims (sizes and
    softmax scale), dtype, block size, the chunk budget (``workspace.chunk_tokens`` now), the backend asked for (with
    ``MLA_BRIDGE_BACKEND`` when none is named, as :func:`mla_bridge.select_backend` reads it), the schedule switch,
    the workspace (by identity: a plan holds its wrappers) and the device."""
    requested = backend if backend is not None else (os.environ.get(ENV_VAR) or None)
    return (tuple(q_lens), tuple(c_lens), dims, dtype, block_size, workspace.chunk_tokens, requested,
            bool(fuse_context), id(workspace), device)


class PlanCache:
    """Reuse of :class:`PrefillPlan` across batches: a plan is handed out again only when EVERYTHING it depends on is
    equal (:attr:`PrefillPlan.key`: the per-request query and context lengths, dims, dtype, block size, chunk budget,
    backend, workspace and device), never on a partial key.

    Args:
        maxsize: plans kept (least recently used dropped first; default 8). Each kept plan holds its pooled FlashInfer
            wrappers (8 MiB device + 8 MiB page-locked host memory each, 1 + distinct chunk shapes per plan).

    Attributes: ``hits``, ``misses`` (counts of :meth:`get`).

    Raises:
        ValueError: ``maxsize`` not a positive int.
    """

    def __init__(self, maxsize: int = 8):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize <= 0:
            raise ValueError(f"PlanCache: maxsize must be a positive int, got {maxsize!r}")
        self.maxsize = maxsize
        self._plans: "OrderedDict[tuple, PrefillPlan]" = OrderedDict()
        self.hits = self.misses = 0

    def get(self, query_lens: Sequence[int], context_lens: Optional[Sequence[int]] = None, *, dims: MLADims,
            workspace: Workspace, block_size: int, device: "torch.device | str | None" = None,
            dtype: torch.dtype = torch.bfloat16, backend: Optional[str] = None,
            fuse_context: bool = True) -> PrefillPlan:
        """The plan of :meth:`PrefillPlan.build` for these arguments: a kept one whose key is equal, else a new one
        (kept). Same arguments and errors as :meth:`PrefillPlan.build`."""
        q_lens = _lengths("query_lens", query_lens)
        c_lens = [0] * len(q_lens) if context_lens is None else _lengths("context_lens", context_lens)
        if isinstance(workspace, Workspace) and isinstance(dims, MLADims):
            dev = workspace.device if device is None else _checked_device(device)
            key = _plan_key(q_lens, c_lens, dims, workspace, block_size, dev, dtype, backend, fuse_context)
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self.hits += 1
                return plan
        plan = PrefillPlan.build(q_lens, c_lens, dims=dims, workspace=workspace, block_size=block_size, device=device,
                                 dtype=dtype, backend=backend, fuse_context=fuse_context)
        self.misses += 1
        self._plans[plan.key] = plan
        while len(self._plans) > self.maxsize:
            self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Drop every kept plan (their wrappers go back to the workspace pool once nothing else holds them)."""
        self._plans.clear()
