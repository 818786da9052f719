"""Multi-device recipe: shard the heads of a ragged prefill across one mesh axis with ``shard_map``.

Attention heads are independent, so each device runs :func:`mla_bridge_jax.ragged_prefill` on its slice of heads
with the full (replicated) index pointers: q/k/v ``[*, H, D]`` are split as ``P(None, axis, None)``, out as
``P(None, axis, None)`` and lse ``[T, H]`` as ``P(None, axis)``. ``H`` must be divisible by the axis size. Inside the
``shard_map`` every device gets its own traced call (one XLA custom call per device, each planned for its own
device on first use), and no collective is needed.

The same recipe applies to :func:`mla_bridge_jax.run_ragged` with one plan per device, and to
:func:`mla_bridge_jax.mla_prefill` with ``kv_b_proj_weight`` split by head blocks and a per-shard plan
(``MLADims(num_heads=H // n)``); the helper below covers the one-shot ragged call.

``shard_map`` is ``jax.shard_map`` (JAX >= 0.7) or ``jax.experimental.shard_map.shard_map`` on older versions.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .api import ragged_prefill

__all__ = ["shard_map", "sharded_ragged_prefill", "head_shardings"]


def _shard_map():
    if hasattr(jax, "shard_map"):
        return jax.shard_map, "check_vma"
    from jax.experimental.shard_map import shard_map as legacy  # JAX < 0.7

    return legacy, "check_rep"


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
    """``shard_map`` across JAX versions, with the replication/VMA check off (an XLA custom call has no VMA rule)."""
    impl, check = _shard_map()
    return impl(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{check: False})


def head_shardings(mesh: Mesh, axis: str) -> tuple[NamedSharding, NamedSharding]:
    """``(NamedSharding for q/k/v/out [*, H, D], NamedSharding for lse [T, H])`` splitting heads over ``axis``."""
    return NamedSharding(mesh, P(None, axis, None)), NamedSharding(mesh, P(None, axis))


def sharded_ragged_prefill(q: jax.Array, k: jax.Array, v: jax.Array, qo_indptr: Any, kv_indptr: Any, *, mesh: Mesh,
                           axis: str, causal: bool, sm_scale: float, backend: Optional[str] = None
                           ) -> tuple[jax.Array, jax.Array]:
    """:func:`mla_bridge_jax.ragged_prefill` with heads sharded over ``mesh`` axis ``axis``, index pointers replicated
    (host values, closed over). Works eagerly (inputs are placed with :func:`head_shardings` first) and inside
    ``jax.jit``.

    Returns:
        ``(out [T, H, Dvo] sharded P(None, axis, None), lse [T, H] sharded P(None, axis))``.

    Raises:
        ValueError: ``axis`` not an axis of ``mesh`` (the message lists the mesh's axes); ``H`` not divisible by
            the axis size; errors of :func:`mla_bridge_jax.ragged_prefill`.
    """
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh; its axes are {list(mesh.axis_names)} "
                         f"(sizes {dict(mesh.shape)})")
    n = mesh.shape[axis]
    if q.ndim != 3 or q.shape[1] % n:
        raise ValueError(f"q must be [T, H, D] with H divisible by mesh axis {axis!r} of size {n}, "
                         f"got shape {list(q.shape)}")
    spec, lse_spec = P(None, axis, None), P(None, axis)
    if not any(isinstance(x, jax.core.Tracer) for x in (q, k, v)):
        qkv_sharding, _ = head_shardings(mesh, axis)
        q, k, v = (jax.device_put(x, qkv_sharding) for x in (q, k, v))
    body = partial(ragged_prefill, qo_indptr=qo_indptr, kv_indptr=kv_indptr, causal=causal, sm_scale=sm_scale,
                   backend=backend)
    return shard_map(lambda a, b, c: body(a, b, c), mesh=mesh, in_specs=(spec, spec, spec),
                     out_specs=(spec, lse_spec))(q, k, v)
