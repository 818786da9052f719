"""mla_bridge_jax: MLA (DeepSeek-V2/V3) ragged prefill for JAX, through the mla_bridge torch core.

jax.Array in, jax.Array out, on the same device; eager calls pass buffers by DLPack (zero-copy), calls inside
``jax.jit`` run as one XLA custom call on XLA's stream (see :mod:`mla_bridge_jax.api`).

Public API:
  * :func:`ragged_prefill` -- one-shot ragged attention ``(out, lse)``.
  * :func:`plan_ragged` + :func:`run_ragged` -- plan once (host), run per layer (eager or under jit).
  * :func:`build_plan` + :func:`mla_prefill` -- MLA prefill with the paged latent cache and context chunks;
    :func:`prepare_kv_b_proj` prepares each layer's weight once, at load time; with ``build_plan(...,
    index_topk=K)`` and ``mla_prefill(..., topk_indices=)``, DeepSeek Sparse Attention (the core's sparse pass).
  * :func:`from_torch` / :func:`to_torch` -- DLPack conversion (one device copy for views DLPack cannot pass).
  * :func:`sharded_ragged_prefill`, :func:`build_sharded_plans` + :func:`sharded_mla_prefill` -- heads sharded over
    a mesh axis with ``shard_map``.
  The adapter against the torch core is timed by the bench (``mla-bridge bench --sections jax``,
  :mod:`mla_bridge.bench.jax_rows`), which imports this package; this package never imports the bench.
"""

import atexit
import gc

try:
    import jax
except ImportError as err:  # a clear error naming the framework and the extra, not one from deep inside
    raise ImportError(
        "mla_bridge_jax needs JAX, which is not installed here: pip install 'mla-bridge[jax]' "
        "(or 'mla-bridge[jax-ffi]' for the compiled jit route on CUDA)"
    ) from err

from mla_bridge import MLADims, Workspace
from mla_bridge.plan_cache import shared_plan_cache

from ._interop import from_torch, release_tokens
from ._interop import to_torch as _to_torch
from .api import (
    ENV_JIT_ROUTE,
    JIT_ROUTES,
    InferenceOnlyError,
    build_plan,
    mla_prefill,
    plan_ragged,
    prepare_kv_b_proj,
    ragged_prefill,
    run_ragged,
)
from .sharding import build_sharded_plans, head_shardings, sharded_mla_prefill, sharded_ragged_prefill, shard_map


def to_torch(x):
    """Zero-copy torch view of a single-device jax.Array (DLPack). It shares JAX's buffer: never write into it. JAX
    does not wait for torch's work on the view: let that work finish (e.g. ``torch.cuda.current_stream()
    .synchronize()``) before the view is dropped or the array donated or deleted (mla_bridge_jax's own eager calls
    order XLA after their torch work themselves)."""
    return _to_torch("x", x)


def _release_at_exit() -> None:
    """Drop, at interpreter exit, what JAX's compiled functions and this adapter's caches keep of mla_bridge (plans
    captured by jitted closures, traced plans, the ordering token), while CUDA is still up: their device tensors may
    carry uses on XLA's stream (``Tensor.record_stream``), and freed after CUDA's own teardown they abort the process
    ("CUDA error: context is destroyed"). Registered after ``import jax``, so it runs before JAX's exit handlers."""
    try:
        jax.clear_caches()
    except Exception:  # noqa: BLE001 - a JAX without it, or already shut down: nothing more to release here
        pass
    shared_plan_cache().clear()
    release_tokens()
    gc.collect()


atexit.register(_release_at_exit)

__all__ = [
    "ragged_prefill",
    "plan_ragged",
    "run_ragged",
    "build_plan",
    "prepare_kv_b_proj",
    "mla_prefill",
    "from_torch",
    "to_torch",
    "sharded_ragged_prefill",
    "sharded_mla_prefill",
    "build_sharded_plans",
    "head_shardings",
    "shard_map",
    "InferenceOnlyError",
    "JIT_ROUTES",
    "ENV_JIT_ROUTE",
    "MLADims",
    "Workspace",
]
