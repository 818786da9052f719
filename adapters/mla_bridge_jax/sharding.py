"""Multi-device recipe: shard the heads of a ragged prefill across one mesh axis with ``shard_map``.

Attention heads are independent, so each device runs :func:`mla_bridge_jax.ragged_prefill` on its slice of heads
with the full (replicated) index pointers: q/k/v ``[*, H, D]`` are split as ``P(None, axis, None)``, out as
``P(None, axis, None)`` and lse ``[T, H]`` as ``P(None, axis)``. ``H`` must be divisible by the axis size. Inside the
``shard_map`` every device gets its own traced call (one XLA custom call per device, each planned for its own
device on first use), and no collective is needed.

The same recipe runs the whole MLA prefill (:func:`sharded_mla_prefill`): q and ``kv_b_proj_weight`` are split by
heads (the weight's rows are per-head blocks of ``qk_nope_head_dim + v_head_dim``), while the paged latent cache,
kv_c, k_pe and the block table have no head axis and are replicated; each device runs its own plan for its
``H / n`` heads (:func:`build_sharded_plans`, made outside the trace). Only the ``buffer_callback`` route serves it
(the ``tvm_ffi`` route serves one device per plan). Tested on forced CPU devices; on several GPUs it has not been
run (see docs/results.md).

``shard_map`` is ``jax.shard_map`` (JAX >= 0.7) or ``jax.experimental.shard_map.shard_map`` on older versions.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mla_bridge import MLADims, Workspace
from mla_bridge.checks import not_a_bool

from ._interop import torch_device_of
from .api import build_plan, mla_prefill, ragged_prefill

__all__ = ["shard_map", "sharded_ragged_prefill", "head_shardings", "build_sharded_plans", "sharded_mla_prefill"]


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
    """``shard_map`` across JAX versions, with the replication/VMA check off (an XLA custom call has no VMA rule)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # JAX < 0.7

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def head_shardings(mesh: Mesh, axis: str) -> tuple[NamedSharding, NamedSharding]:
    """``(NamedSharding for q/k/v/out [*, H, D], NamedSharding for lse [T, H])`` splitting heads over ``axis``."""
    return NamedSharding(mesh, P(None, axis, None)), NamedSharding(mesh, P(None, axis))


def _axis_size(mesh: Mesh, axis: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.shape:
        raise ValueError(
            f"axis {axis!r} is not an axis of the mesh; its axes are {list(mesh.axis_names)} (sizes {dict(mesh.shape)})"
        )
    return mesh.shape[axis]


def sharded_ragged_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    qo_indptr: Any,
    kv_indptr: Any,
    *,
    mesh: Mesh,
    axis: str,
    causal: bool,
    sm_scale: float,
    backend: Optional[str] = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`mla_bridge_jax.ragged_prefill` with heads sharded over ``mesh`` axis ``axis``, index pointers replicated
    (host values, closed over). Works eagerly (inputs are placed with :func:`head_shardings` first) and inside
    ``jax.jit``.

    Returns:
        ``(out [T, H, Dvo] sharded P(None, axis, None), lse [T, H] sharded P(None, axis))``.

    Raises:
        TypeError: ``mesh`` not a ``jax.sharding.Mesh``.
        ValueError: ``axis`` not an axis of ``mesh`` (the message lists the mesh's axes); ``H`` not divisible by
            the axis size; errors of :func:`mla_bridge_jax.ragged_prefill`.
    """
    n = _axis_size(mesh, axis)
    if q.ndim != 3 or q.shape[1] % n:
        raise ValueError(
            f"q must be [T, H, D] with H divisible by mesh axis {axis!r} of size {n}, got shape {list(q.shape)}"
        )
    spec, lse_spec = P(None, axis, None), P(None, axis)
    if not any(isinstance(x, jax.core.Tracer) for x in (q, k, v)):
        qkv_sharding, _ = head_shardings(mesh, axis)
        q, k, v = (jax.device_put(x, qkv_sharding) for x in (q, k, v))
    body = partial(
        ragged_prefill, qo_indptr=qo_indptr, kv_indptr=kv_indptr, causal=causal, sm_scale=sm_scale, backend=backend
    )
    return shard_map(lambda a, b, c: body(a, b, c), mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, lse_spec))(
        q, k, v
    )


def build_sharded_plans(
    query_lens: Any,
    context_lens: Any = None,
    *,
    dims: MLADims,
    mesh: Mesh,
    axis: str,
    block_size: int,
    dtype: Any = jnp.bfloat16,
    chunk_tokens: Optional[int] = None,
    backend: Optional[str] = None,
    fuse_context: bool = True,
    kv_cache_dtype: Any = None,
    index_topk: Optional[int] = None,
) -> dict:
    """One :class:`mla_bridge.PrefillPlan` per device of ``mesh`` for its share of the heads: ``{torch device:
    plan}``, each planned for ``MLADims(num_heads=H / n)`` (the same softmax scale), for
    :func:`sharded_mla_prefill`. Build it once per batch, outside ``jax.jit``; it is shared by every layer.

    Args:
        query_lens, context_lens, block_size, dtype, backend, fuse_context, kv_cache_dtype, index_topk: as
            :func:`mla_bridge_jax.build_plan` (with ``index_topk``, every device's plan is a sparse one).
        dims: the model's dims (all ``H`` heads); ``H`` must be divisible by the size of ``axis``.
        chunk_tokens: the context-chunk budget of each device's workspace (default: the device's shared one).

    Raises:
        TypeError: ``mesh`` not a ``jax.sharding.Mesh``.
        ValueError: ``axis`` not in ``mesh``; ``H`` not divisible by its size; the core's errors.
    """
    n = _axis_size(mesh, axis)
    if dims.num_heads % n:
        raise ValueError(f"dims.num_heads = {dims.num_heads} is not divisible by mesh axis {axis!r} of size {n}")
    shard = dataclasses.replace(dims, num_heads=dims.num_heads // n)
    plans: dict = {}
    for device in mesh.devices.flat:
        tdev = torch_device_of(device)
        if tdev not in plans:  # forced CPU devices are all torch's one CPU: one plan serves them
            ws = None if chunk_tokens is None else Workspace(tdev, chunk_tokens=chunk_tokens)
            plans[tdev] = build_plan(
                query_lens,
                context_lens,
                dims=shard,
                block_size=block_size,
                dtype=dtype,
                device=device,
                workspace=ws,
                backend=backend,
                fuse_context=fuse_context,
                kv_cache_dtype=kv_cache_dtype,
                index_topk=index_topk,
            )
    return plans


def sharded_mla_prefill(
    q: jax.Array,
    kv_c: jax.Array,
    k_pe: jax.Array,
    kv_b_proj_weight: jax.Array,
    kv_cache: jax.Array,
    block_table: jax.Array,
    plans: dict,
    *,
    mesh: Mesh,
    axis: str,
    return_lse: bool = False,
    kv_cache_scale: Optional[float] = None,
    topk_indices: Optional[jax.Array] = None,
):
    """:func:`mla_bridge_jax.mla_prefill` with heads sharded over ``mesh`` axis ``axis`` (see the module docstring):
    q ``[T, H, 192]`` as ``P(None, axis, None)``, the raw ``kv_b_proj_weight [H * 256, 512]`` as ``P(axis, None)``,
    kv_c, k_pe, the cache and the block table replicated; ``plans`` from :func:`build_sharded_plans`. Works eagerly
    (inputs placed first) and inside ``jax.jit``. ``topk_indices`` (int32 ``[T, K]``, plans built with
    ``index_topk=K``): as :func:`mla_bridge_jax.mla_prefill`, replicated (every head of a token attends the same
    keys).

    Returns:
        ``out [T, H, 128]`` sharded ``P(None, axis, None)``, or ``(out, lse [T, H] sharded P(None, axis))``.

    Raises:
        TypeError: a prepared weight (it is per device: pass the raw weight, split here), or ``kv_cache_scale`` that
            is not a Python float.
        TypeError: ``mesh`` not a ``jax.sharding.Mesh``; ``plans`` not a dict of per-device plans.
        ValueError: ``axis`` not in ``mesh``; H not divisible by its size; ``plans`` planned for another number of
            heads per device than ``H / n``; errors of :func:`mla_bridge_jax.mla_prefill`.
    """
    if not isinstance(return_lse, bool):  # checked here: the shard_map's output specs depend on it
        raise not_a_bool("return_lse", return_lse)
    n = _axis_size(mesh, axis)
    if not hasattr(kv_b_proj_weight, "ndim"):
        raise TypeError(
            "sharded_mla_prefill takes the raw kv_b_proj_weight [H * 256, 512] (split by heads here); "
            f"a prepared weight is per device, got {type(kv_b_proj_weight).__name__}"
        )
    if kv_cache_scale is not None and not isinstance(kv_cache_scale, (int, float)):
        raise TypeError(f"kv_cache_scale must be a Python float here (static), got {type(kv_cache_scale).__name__}")
    if q.ndim != 3 or q.shape[1] % n:
        raise ValueError(
            f"q must be [T, H, 192] with H divisible by mesh axis {axis!r} of size {n}, got shape {list(q.shape)}"
        )
    if not isinstance(plans, dict) or not plans:
        raise TypeError(
            f"plans must be the {{device: plan}} of build_sharded_plans (one plan per device for its share of the "
            f"heads), got {type(plans).__name__}"
        )
    for plan in plans.values():
        if getattr(getattr(plan, "dims", None), "num_heads", None) != q.shape[1] // n:
            raise ValueError(
                f"plans must be planned for H / {n} = {q.shape[1] // n} heads per device (build_sharded_plans over "
                f"mesh axis {axis!r}), got a plan of {getattr(getattr(plan, 'dims', None), 'num_heads', None)} heads"
            )
    heads, rep, lse_spec = P(None, axis, None), P(), P(None, axis)
    sparse = topk_indices is not None
    in_specs = (heads, rep, rep, P(axis, None), rep, rep) + ((rep,) if sparse else ())
    args = (q, kv_c, k_pe, kv_b_proj_weight, kv_cache, block_table) + ((topk_indices,) if sparse else ())
    if not any(isinstance(x, jax.core.Tracer) for x in args):
        args = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(args, in_specs))

    def body(*a):
        topk = a[6] if sparse else None
        return mla_prefill(*a[:6], plans, return_lse=return_lse, kv_cache_scale=kv_cache_scale, topk_indices=topk)

    out_specs = (heads, lse_spec) if return_lse else heads
    return shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
