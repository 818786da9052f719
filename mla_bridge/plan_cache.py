"""One cache of plans, for every caller that plans the same batch more than once: :class:`PlanCache`.

It keeps both kinds of plan the core makes, each keyed on EVERYTHING it depends on, never on a partial key:

* :class:`mla_bridge.PrefillPlan` (:meth:`PlanCache.get`): per-request query and context lengths, dims, dtype, cache
  dtype, block size, chunk budget, backend asked for, schedule switch, workspace and device
  (:attr:`mla_bridge.PrefillPlan.key`);
* :class:`mla_bridge.RaggedPlan` (:meth:`PlanCache.get_ragged`): the contents of both indptrs, heads, head dims,
  causal, ``sm_scale``, dtype, the ``(q, k, v)`` strides declared for the dispatch, the backend asked for (the
  argument, else ``MLA_BRIDGE_BACKEND`` read at the call), the workspace (by identity: a plan holds its wrappers) and
  its device.

The adapters share one instance, :func:`shared_plan_cache` (the JAX adapter's plans made under ``jax.jit`` and its
``tvm_ffi`` re-plans, the transformers attention function, the vLLM backend's per-step plans): equal batches get one
plan, and the number of plans held (each holds one pooled FlashInfer wrapper) has one bound.
"""

from __future__ import annotations

import numbers
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from . import switches
from .dims import MLADims
from .plan import PrefillPlan, keep_key, lookup_key
from .ragged import IndptrLike, RaggedPlan, as_host_indptr, as_sm_scale, indptr_from_lens, plan_ragged
from .workspace import Workspace

__all__ = ["PlanCache", "shared_plan_cache", "SHARED_MAXSIZE"]

#: Plans the process-wide :func:`shared_plan_cache` keeps (least recently used dropped first).
SHARED_MAXSIZE = 16

Plan = Union[PrefillPlan, RaggedPlan]


def _size(value: Any) -> Optional[int]:
    """An integer size as a key part (``numpy.int64(4)`` and ``4`` plan alike), or None for anything
    :func:`mla_bridge.plan_ragged` may refuse (a bool, a float: never keyed, so never let through by a hit)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _strides_part(strides: Optional[Sequence]) -> Any:
    """``strides`` as a hashable key part (``None`` for contiguous), or ``False`` where it is not exactly
    ``(q, k, v)`` of ``None`` / ``(int, int)`` (then the plan is not kept: :func:`plan_ragged` checks it)."""
    if strides is None:
        return None
    try:
        parts = tuple(None if s is None else tuple(_size(v) for v in s) for s in strides)
    except TypeError:
        return False
    if len(parts) != 3 or any(p is not None and (len(p) != 2 or None in p) for p in parts):
        return False
    return None if parts == (None, None, None) else parts  # all contiguous: as no strides


def _spec_key(
    *,
    num_heads: Any,
    head_dim_qk: Any,
    head_dim_vo: Any,
    causal: Any,
    sm_scale: Any,
    dtype: Any,
    workspace: Any,
    backend: Optional[str],
    strides: Optional[Sequence],
) -> Optional[tuple]:
    """The key parts of a ragged plan but its indptrs, or None where an argument is not of a kind that can be keyed
    safely (:meth:`PlanCache.ragged_key`).

    Raises:
        TypeError / ValueError: a bad ``sm_scale``, as :func:`mla_bridge.plan_ragged`.
    """
    scale = as_sm_scale(sm_scale)
    sizes = (_size(num_heads), _size(head_dim_qk), _size(head_dim_vo))
    requested = backend if backend is not None else (switches.raw(switches.BACKEND) or None)
    stride_key = _strides_part(strides)
    if (
        None in sizes
        or not isinstance(causal, (bool, np.bool_))
        or not isinstance(dtype, torch.dtype)
        or not isinstance(workspace, Workspace)
        or not (requested is None or isinstance(requested, str))
        or stride_key is False
    ):
        return None
    return (*sizes, bool(causal), scale, dtype, stride_key, requested, id(workspace), workspace.device)


def _ragged_key(
    qo_indptr: IndptrLike, kv_indptr: IndptrLike, **args: Any
) -> tuple[torch.Tensor, torch.Tensor, Optional[tuple]]:
    """``(qo, kv, key)``: the checked host indptrs and :meth:`PlanCache.ragged_key`'s key (``args``: the keywords of
    :func:`_spec_key`)."""
    qo, kv = as_host_indptr("qo_indptr", qo_indptr), as_host_indptr("kv_indptr", kv_indptr)
    parts = _spec_key(**args)
    if parts is None:
        return qo, kv, None
    return qo, kv, ("ragged", qo.numpy().tobytes(), kv.numpy().tobytes(), *parts)


class PlanCache:
    """Reuse of :class:`mla_bridge.PrefillPlan` and :class:`mla_bridge.RaggedPlan` across batches: a plan is handed
    out again only when EVERYTHING it depends on is equal (module docstring), never on a partial key. Two specs that
    differ in anything a plan depends on never share a plan.

    Args:
        maxsize: plans kept, of both kinds together (least recently used dropped first; default 8). Each kept plan
            holds its pooled FlashInfer wrappers (a RaggedPlan one; a PrefillPlan 1 + distinct chunk shapes: what they
            hold, :attr:`mla_bridge.PrefillPlan.flashinfer_bytes`). ``maxsize`` may be changed later (a positive int);
            the next insertion drops down to it.

    Attributes: ``hits``, ``misses`` (counts of :meth:`get`, :meth:`get_ragged` and the hits of :meth:`lookup`).

    Threads: one cache may be shared by threads. Its look-ups, reorderings, insertions and evictions run under one
    lock (a hit is never evicted by another thread between its look-up and its reordering); a miss builds its plan
    outside the lock, so threads build different plans at once, and where two threads built the same key at once
    both get the plan inserted first. A dropped plan's wrappers go back to the workspace pool only once the GPU has
    finished the work queued with them on torch's streams (:class:`mla_bridge.Workspace`).

    Raises:
        ValueError: ``maxsize`` not a positive int.
    """

    def __init__(self, maxsize: int = 8):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize <= 0:
            raise ValueError(f"PlanCache: maxsize must be a positive int, got {maxsize!r}")
        self.maxsize = maxsize
        self._plans: "OrderedDict[tuple, Plan]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._last_lens: tuple = (None, None)  # (get_ragged_lens's last arguments, their key), replaced whole

    # --- the two kinds ----------------------------------------------------------------------------------------
    def get(
        self,
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
    ) -> PrefillPlan:
        """The plan of :meth:`PrefillPlan.build` for these arguments: a kept one whose key is equal, else a new one
        (kept). Same arguments and errors as :meth:`PrefillPlan.build` (what it refuses is refused before the
        look-up)."""
        q_lens, c_lens, block_size, key = lookup_key(
            query_lens,
            context_lens,
            dims=dims,
            workspace=workspace,
            block_size=block_size,
            device=device,
            dtype=dtype,
            backend=backend,
            fuse_context=fuse_context,
            kv_cache_dtype=kv_cache_dtype,
            index_topk=index_topk,
        )  # key None: without a Workspace and MLADims, build raises
        if key is not None:
            kept = self.lookup(key)
            if kept is not None:
                return kept  # type: ignore[return-value]  # PrefillPlan keys never name a RaggedPlan
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=dims,
            workspace=workspace,
            block_size=block_size,
            device=device,
            dtype=dtype,
            backend=backend,
            fuse_context=fuse_context,
            kv_cache_dtype=kv_cache_dtype,
            index_topk=index_topk,
        )  # outside the lock: FlashInfer plans take time
        # the plan's key: the same arguments, read at the same moment (not made twice)
        return self._insert(keep_key(plan, key).key, plan)  # type: ignore[return-value]

    def ragged_key(
        self,
        qo_indptr: IndptrLike,
        kv_indptr: IndptrLike,
        *,
        num_heads: int,
        head_dim_qk: int,
        head_dim_vo: int,
        causal: bool,
        sm_scale: float,
        dtype: torch.dtype,
        workspace: Workspace,
        backend: Optional[str] = None,
        strides: Optional[Sequence] = None,
    ) -> Optional[tuple]:
        """The key :meth:`get_ragged` keeps the plan of these arguments under, or None where an argument is not of a
        kind that can be keyed safely (a bool or float size, a causal that is not a bool, a non-Workspace...: then
        :func:`mla_bridge.plan_ragged` decides, and raises where it refuses). The backend asked for is ``backend``,
        else ``MLA_BRIDGE_BACKEND`` read now.

        Raises:
            TypeError / ValueError: bad indptrs or ``sm_scale``, as :func:`mla_bridge.plan_ragged` (the indptrs are
                copied to the host here: a device tensor costs a device-to-host copy, as planning does).
        """
        return _ragged_key(
            qo_indptr,
            kv_indptr,
            num_heads=num_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            causal=causal,
            sm_scale=sm_scale,
            dtype=dtype,
            workspace=workspace,
            backend=backend,
            strides=strides,
        )[2]

    def get_ragged(
        self,
        qo_indptr: IndptrLike,
        kv_indptr: IndptrLike,
        *,
        num_heads: int,
        head_dim_qk: int,
        head_dim_vo: int,
        causal: bool,
        sm_scale: float,
        dtype: torch.dtype,
        workspace: Workspace,
        backend: Optional[str] = None,
        strides: Optional[Sequence] = None,
    ) -> RaggedPlan:
        """The plan of :func:`mla_bridge.plan_ragged` for these arguments: a kept one whose key
        (:meth:`ragged_key`) is equal, else a new one (kept when it could be keyed). Same arguments and errors as
        :func:`mla_bridge.plan_ragged`."""
        args: dict[str, Any] = dict(
            num_heads=num_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            causal=causal,
            sm_scale=sm_scale,
            dtype=dtype,
            workspace=workspace,
            backend=backend,
            strides=strides,
        )
        return self.ragged_request(qo_indptr, kv_indptr, **args)[1]()

    def ragged_request(
        self, qo_indptr: IndptrLike, kv_indptr: IndptrLike, **args: Any
    ) -> tuple[Optional[tuple], Callable[[], RaggedPlan]]:
        """:meth:`ragged_key` and :meth:`get_ragged` of the same arguments (those of :meth:`get_ragged`), made
        once: ``(key, get)``, where ``get()`` returns the plan kept under ``key`` (made and kept on a miss). The
        indptrs are copied to the host and the key made here, once: a caller that counts the key before it takes the
        plan (the JAX adapter) takes the plan kept under the key it counted.

        Raises:
            TypeError / ValueError: here, bad indptrs or ``sm_scale`` (as :meth:`ragged_key`); from ``get()``, what
                :func:`mla_bridge.plan_ragged` refuses.
        """
        args = dict(backend=None, strides=None) | args  # get_ragged's defaults
        qo, kv, key = _ragged_key(qo_indptr, kv_indptr, **args)
        return key, lambda: self._get_keyed(qo, kv, key, args)

    def _get_keyed(self, qo: torch.Tensor, kv: torch.Tensor, key: Optional[tuple], args: dict) -> RaggedPlan:
        """:meth:`get_ragged` once the host indptrs and the key are made (:func:`_ragged_key`)."""
        if key is not None:
            kept = self.lookup(key)
            if kept is not None:
                return kept  # type: ignore[return-value]  # ragged keys never name a PrefillPlan
        # the host copies, not the caller's tensors again; outside the lock: FlashInfer plans take time
        plan = plan_ragged(qo, kv, **args)
        if key is None:
            with self._lock:
                self.misses += 1
            return plan
        return self._insert(key, plan)  # type: ignore[return-value]

    def get_ragged_lens(
        self,
        query_lens: tuple[int, ...],
        kv_lens: tuple[int, ...],
        *,
        num_heads: int,
        head_dim_qk: int,
        head_dim_vo: int,
        causal: bool,
        sm_scale: float,
        dtype: torch.dtype,
        workspace: Workspace,
        backend: Optional[str] = None,
        strides: Optional[Sequence] = None,
    ) -> RaggedPlan:
        """:meth:`get_ragged` of the indptrs of per-request ``query_lens`` / ``kv_lens`` (tuples of ints), for a
        caller that asks for one batch many times in a row (a model's layers, one call each; the transformers
        adapter): a call whose arguments equal the last call's (the backend asked for read now, the workspace by
        identity) finds the plan by the last call's key, without making the indptrs or the key again. Same keywords
        and errors as :meth:`get_ragged`."""
        args: dict[str, Any] = dict(
            num_heads=num_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            causal=causal,
            sm_scale=sm_scale,
            dtype=dtype,
            workspace=workspace,
            backend=backend,
            strides=strides,
        )
        # the key's own parts (what cannot be keyed is never found here: get_ragged decides), the workspace's by id
        local = (tuple(query_lens), tuple(kv_lens), _spec_key(**args))
        last_local, last_key = self._last_lens
        plan = self.lookup(last_key) if local[2] is not None and last_local == local else None
        if plan is None:
            qo, kv, key = _ragged_key(indptr_from_lens(query_lens), indptr_from_lens(kv_lens), **args)
            plan = self._get_keyed(qo, kv, key, args)  # the indptrs and the key made once
            self._last_lens = (local, key)
        return plan  # type: ignore[return-value]  # ragged keys never name a PrefillPlan

    # --- by key -----------------------------------------------------------------------------------------------
    def lookup(self, key: Optional[tuple]) -> Optional[Plan]:
        """The plan kept under ``key`` (made most recently used; a hit), or None (not counted as a miss)."""
        if key is None:
            return None
        with self._lock:  # another thread's eviction must not come between the look-up and the reordering
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self.hits += 1
            return plan

    def discard(self, key: Optional[tuple], *, wait: bool = True) -> Optional[bool]:
        """Drop the plan kept under ``key`` (a caller done with it; another caller of the same key plans again on
        its next miss). Returns whether one was kept. ``wait=False``: return None at once, dropping nothing, where
        the cache's lock is held (a finalizer must not wait for it: a garbage collection may run it inside this
        cache's own critical section, in the thread that holds the lock)."""
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            return self._plans.pop(key, None) is not None  # type: ignore[arg-type]  # None is never a key
        finally:
            self._lock.release()

    def _insert(self, key: tuple, plan: Plan) -> Plan:
        with self._lock:
            self.misses += 1
            kept = self._plans.get(key)  # another thread built the same plan meanwhile: one plan for both
            if kept is not None:
                self._plans.move_to_end(key)
                return kept
            self._plans[key] = plan
            while len(self._plans) > max(1, self.maxsize):
                self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Drop every kept plan (their wrappers go back to the workspace pool once nothing else holds them)."""
        with self._lock:
            self._plans.clear()


_SHARED: Optional[PlanCache] = None
_SHARED_LOCK = threading.Lock()


def shared_plan_cache() -> PlanCache:
    """The process-wide :class:`PlanCache` the adapters share (transformers, vLLM, JAX). Made on first use, bounded
    by ``$MLA_BRIDGE_JAX_MAX_PLANS`` (:func:`mla_bridge.switches.jax_max_plans`, read then; despite its name it
    bounds this cache for every adapter) or else :data:`SHARED_MAXSIZE`; its ``maxsize`` may be changed later, e.g.
    lowered to bound the FlashInfer wrappers held.

    Raises:
        ValueError: ``$MLA_BRIDGE_JAX_MAX_PLANS`` set to anything but a positive int (named), while the cache is not
            made yet.
    """
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = PlanCache(switches.jax_max_plans(SHARED_MAXSIZE))
        return _SHARED
