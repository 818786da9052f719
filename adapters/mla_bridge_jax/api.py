"""MLA ragged prefill for JAX: jax.Array in, jax.Array out, delegating to the mla_bridge torch core.

Two ways a call runs:
  * **eager** (concrete ``jax.Array`` inputs): DLPack views both ways (no copy, no host round trip; on CUDA each
    side makes the consumer's stream wait), then the core's :func:`mla_bridge.ragged_prefill` /
    :meth:`mla_bridge.RaggedPlan.run` / :func:`mla_bridge.mla_prefill` on torch's current stream; before returning,
    XLA's stream is ordered after that work (:func:`mla_bridge_jax._interop.order_xla_after_torch`), so the inputs may
    be donated or deleted right after the call (no host sync).
  * **traced** (inside ``jax.jit``, ``jax.vmap``, ``shard_map``...): one XLA custom call per attention that reads
    XLA's input buffers and writes its output buffers in place, on XLA's stream (no host copy on GPU). Routes
    (``jit_route``, or ``$MLA_BRIDGE_JAX_JIT_ROUTE``): "tvm_ffi" calls FlashInfer's compiled run from a C++ shim
    registered with jax-tvm-ffi, no Python per call (:mod:`mla_bridge_jax.tvm_ffi`; CUDA, fa2/fa3 plans);
    "buffer_callback" runs the core in a ``jax.experimental.buffer_callback`` under
    ``torch.cuda.ExternalStream(ctx.stream)`` (everywhere, CPU included); "auto" (default) takes tvm_ffi when it can
    serve a single-device call, else buffer_callback.

Plans are host-side: index pointers and lengths must be host values (Python lists, numpy, concrete arrays), never
tracers. Under ``jax.jit`` the plan is made when the function is traced and reused by every call of the compiled
function; a new compile happens when shapes/dtypes change or when the host lengths change (they are closed over or
static arguments). Validation is the core's, run on the host before anything is launched (at trace time under jit).

Differentiation is refused (``jax.grad``/``jax.jvp`` raise "inference only"); ``jax.vmap`` is supported by running
the batch elements one after another (``vmap_method="sequential"``), each with the same index pointers.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import torch
from jax.experimental.buffer_callback import buffer_callback

import mla_bridge as _core
from mla_bridge import switches
from mla_bridge import prefill as _core_prefill
from mla_bridge import MLADims, PrefillPlan, PreparedKVBProj, RaggedPlan, Workspace
from mla_bridge.checks import as_sm_scale, not_a_bool
from mla_bridge.plan import plans_by_device
from mla_bridge.plan_cache import shared_plan_cache
from mla_bridge.ragged import as_host_indptr, qkv_sizes
from mla_bridge.workspace import default_workspace

from ._interop import (
    jax_dtype_names,
    buffer_device,
    check_array,
    default_torch_device,
    host_values,
    is_tracer,
    jax_dtype,
    order_xla_after_torch,
    to_jax,
    to_torch,
    torch_device_of,
    torch_dtype,
    xla_stream,
)

__all__ = [
    "ragged_prefill",
    "plan_ragged",
    "run_ragged",
    "build_plan",
    "prepare_kv_b_proj",
    "mla_prefill",
    "JIT_ROUTES",
    "ENV_JIT_ROUTE",
    "InferenceOnlyError",
]

#: Routes a traced call can take: "buffer_callback" (any platform) and "tvm_ffi" (CUDA, FlashInfer fa2/fa3 plans,
#: needs jax-tvm-ffi); "auto" picks tvm_ffi when it can serve, else buffer_callback.
JIT_ROUTES = switches.JIT_ROUTES  # ("auto", "buffer_callback", "tvm_ffi")
#: The environment variable choosing the route under ``jax.jit`` when ``jit_route`` is not given (one of
#: :data:`JIT_ROUTES`).
ENV_JIT_ROUTE = switches.JAX_JIT_ROUTE


class InferenceOnlyError(NotImplementedError):
    """Raised when JAX tries to differentiate through an mla_bridge_jax call."""


def _inference_only(fn: Callable, what: str) -> Callable:
    """``fn`` with a JVP rule that raises: jax.grad / jax.jvp / jax.jacrev through it fail loudly instead of
    producing zero gradients. (Differentiating with respect to something that does not flow into ``fn`` still
    works: JAX skips the rule when every tangent is zero.)"""

    @jax.custom_jvp
    def wrapped(*args):
        return fn(*args)

    @wrapped.defjvp
    def _jvp(primals, tangents):
        raise InferenceOnlyError(
            f"{what} is inference only: it has no gradient (FlashInfer's ragged prefill has no backward pass "
            f"here). Wrap its inputs in jax.lax.stop_gradient if you differentiate a larger function through it."
        )

    return wrapped


def _proxy(shape: Sequence[int], dtype: Any, device: torch.device, fill: float = 0.0) -> torch.Tensor:
    """A torch stand-in for a traced array, for the core's host-side validation: right shape/dtype/device, one
    element of memory (an expanded scalar)."""
    return torch.full((), fill, dtype=torch_dtype(dtype), device=device).expand(tuple(shape))


#: Plans made inside traces (``ragged_prefill`` under ``jax.jit``) live in the plan cache the adapters share
#: (:func:`mla_bridge.plan_cache.shared_plan_cache`), whose bound ``$MLA_BRIDGE_JAX_MAX_PLANS`` sets (a positive int,
#: read when that cache is first made; unset: 16): its bound as this module found it at import. Each plan holds a
#: pooled FlashInfer wrapper (:attr:`mla_bridge.RaggedPlan.flashinfer_bytes`).
MAX_TRACED_PLANS = shared_plan_cache().maxsize


#: How many live :class:`_Plans` use each key of the shared plan cache (compiled functions of the same batch share
#: one plan): a plan is dropped from the cache when its last user dies, not its first.
_KEY_USERS: dict[tuple, int] = {}
# Reentrant: _discard is a finalizer, which a collection may run inside this lock's sections in the same thread. No
# other lock is taken while it is held (the plan cache's is taken after it is released: no lock-order inversion).
_KEY_USERS_LOCK = threading.RLock()
#: Keys whose last user died while the plan cache's lock was held or a trace was counting its key: dropped later
#: (:func:`_drop_dead_keys`) unless a user counted them again.
_DEAD_KEYS: collections.deque = collections.deque()
#: Traces between making a key and counting it (a finalizer that runs meanwhile, in a collection started by that
#: work, must not drop the plan the trace is about to count).
_COUNTING = [0]


def _count(key: Optional[tuple], step: int) -> bool:
    """Add ``step`` (+1 or -1) users to ``key`` (None: a call the cache does not key); whether none is left."""
    if key is None:
        return False
    with _KEY_USERS_LOCK:
        n = _KEY_USERS.get(key, 0) + step
        if n > 0:
            _KEY_USERS[key] = n
            return False
        _KEY_USERS.pop(key, None)
        return True


def _drop(key: tuple) -> None:
    """Drop ``key``'s plan from the shared cache, unless a user counted it again meanwhile; without waiting for the
    cache's lock (this runs in finalizers): where it is held, the key waits in :data:`_DEAD_KEYS`."""
    with _KEY_USERS_LOCK:
        if key in _KEY_USERS:
            return
        if _COUNTING[0]:
            _DEAD_KEYS.append(key)
            return
    if shared_plan_cache().discard(key, wait=False) is None:
        _DEAD_KEYS.append(key)


def _drop_dead_keys() -> None:
    """The keys :func:`_drop` could not drop at once (called where no lock is held)."""
    while _DEAD_KEYS:
        try:
            key = _DEAD_KEYS.popleft()
        except IndexError:  # another thread took the last one
            return
        _drop(key)


def _discard(keys: dict) -> None:
    """The finalizer of a :class:`_Plans`: its keys lose a user; those left with none are dropped."""
    for key in list(keys.values()):
        if _count(key, -1):
            _drop(key)  # type: ignore[arg-type]  # _count is True for a real key only


class _Plans:
    """Plans of one traced call, per torch device: a fixed plan (run_ragged: the caller's, held as long as the
    compiled function holds this object) or, given the plan's arguments (``spec``: :func:`mla_bridge.plan_ragged`'s
    but the workspace), plans found in the plan cache the adapters share
    (:func:`mla_bridge.plan_cache.shared_plan_cache`) for each device a callback runs on (ragged_prefill, shard_map
    over several devices): this object keeps only their keys.

    The shared cache bounds the plans held (least recently used out); this object's plans are dropped from it when it
    dies, i.e. with the compiled function whose callback holds it, unless another live one uses the same plan; an
    evicted one is made again on its next use (host planning, the run ordered after its copies by the core). The
    core keeps a dropped plan's wrapper out of the pool until the GPU has finished the work queued with it."""

    def __init__(self, spec: Optional[dict] = None, plan: Optional[RaggedPlan] = None):
        self._spec, self._plan = spec, plan  # one or the other
        self._keys: dict[torch.device, Optional[tuple]] = {}
        if spec is not None:
            weakref.finalize(self, _discard, self._keys)

    def get(self, device: torch.device) -> Any:
        if self._spec is None:
            assert self._plan is not None
            if self._plan.spec.device == device:
                return self._plan
            raise ValueError(
                f"mla_bridge_jax: the plan was made for {self._plan.spec.device}, but XLA ran the call on {device}; "
                f"build the plan for that device (device=...)"
            )
        _drop_dead_keys()
        cache = shared_plan_cache()
        plan = cache.lookup(self._keys.get(device))
        if plan is None:
            spec = dict(self._spec, workspace=default_workspace(device))
            # the key counted before the plan is looked up, and no key dropped while it is made and counted (a
            # collection meanwhile may finalize another user of it); a key may change: $MLA_BRIDGE_BACKEND enters it
            with _KEY_USERS_LOCK:
                _COUNTING[0] += 1
            try:
                (key, get_plan), old = cache.ragged_request(**spec), self._keys.get(device, None)
                if device not in self._keys or key != old:
                    self._keys[device] = key
                    _count(key, +1)
                    if _count(old, -1):
                        _DEAD_KEYS.append(old)
            finally:
                with _KEY_USERS_LOCK:
                    _COUNTING[0] -= 1
            plan = get_plan()  # the plan kept under the key counted above (the key made once)
            _drop_dead_keys()
        return plan


def _spread_over_devices() -> Optional[str]:
    """Why a traced call may run on several devices (then each device needs its own plan, which only the
    buffer_callback route makes on demand), or None."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        manual = [name for name, kind in zip(mesh.axis_names, mesh.axis_types) if "Manual" in str(kind)]
        if manual and math.prod(mesh.shape[a] for a in manual) > 1:
            return f"inside shard_map over {manual}"
    except Exception:  # noqa: BLE001 - older JAX: no abstract mesh
        pass
    if jax.local_device_count() > 1:
        return f"{jax.local_device_count()} local devices (a jit over sharded arrays runs the call on each)"
    return None


def _route(requested: Optional[str], plan: Any) -> str:
    """The traced route for ``plan``: "auto" takes tvm_ffi when it can serve and the call is single-device."""
    route = switches.jax_jit_route(requested)
    if route == "buffer_callback":
        return route
    from . import tvm_ffi

    reason = tvm_ffi.why_not(plan)
    if route == "tvm_ffi":
        if reason is not None:
            raise ValueError(f"jit_route='tvm_ffi' cannot serve this call: {reason}")
        return route
    if reason is None and _spread_over_devices() is None:
        return "tvm_ffi"
    return "buffer_callback"


# ---------------------------------------------------------------------------------------------------------------
# ragged attention
# ---------------------------------------------------------------------------------------------------------------


def _ragged_callback(plans: _Plans) -> Callable:
    def callback(ctx, outs, q, k, v):
        out, lse = outs
        with xla_stream(ctx, buffer_device(q), plans.get) as plan:
            plan.run(
                torch.from_dlpack(q),
                torch.from_dlpack(k),
                torch.from_dlpack(v),
                out=torch.from_dlpack(out),
                lse=torch.from_dlpack(lse),
            )

    return callback


def _ragged_traced(plans: _Plans, plan: RaggedPlan, q, k, v, jit_route: Optional[str]):
    """Validate against ``plan`` now (host, trace time), then emit one custom call."""
    with jax_dtype_names():
        plan.validate(*(_proxy(x.shape, x.dtype, plan.spec.device) for x in (q, k, v)))  # type: ignore[arg-type]
    *_, out_shape, lse_shape = plan.spec.shapes
    out_types = (jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32))
    call = None
    route = _route(jit_route, plan)
    if route == "tvm_ffi":
        from . import tvm_ffi

        try:
            call = tvm_ffi.ragged_call(plan, out_types)
        except LookupError:  # FlashInfer's wrapper is not the one the recorder knows
            if jit_route == "tvm_ffi" or switches.raw(ENV_JIT_ROUTE) == "tvm_ffi":
                raise
    if call is None:
        call = buffer_callback(_ragged_callback(plans), out_types, vmap_method="sequential")
    out, lse = _inference_only(call, "mla_bridge_jax.ragged_prefill")(q, k, v)
    return out, lse


def _eager_qkv(q, k, v, jit_route: Optional[str]) -> bool:
    """Check q / k / v (JAX arrays, named) and ``jit_route`` (eager calls do not use it, but a bad value is refused
    alike); whether the call is eager (no tracer among q / k / v)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
    switches.jax_jit_route(jit_route)
    return not any(is_tracer(x) for x in (q, k, v))


def _run_eager(run: Callable, q, k, v) -> tuple[jax.Array, jax.Array]:
    """``run`` (the core's) on DLPack views of q / k / v; XLA is ordered after the work it queued."""
    with jax_dtype_names():
        out, lse = run(to_torch("q", q), to_torch("k", k), to_torch("v", v))
    order_xla_after_torch(out.device)  # XLA must not reuse q / k / v before the queued kernel read them
    return to_jax(out), to_jax(lse)


def ragged_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    qo_indptr: Any,
    kv_indptr: Any,
    *,
    causal: bool,
    sm_scale: float,
    backend: Optional[str] = None,
    jit_route: Optional[str] = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged (packed-batch) attention, MLA prefill shapes, as :func:`mla_bridge.ragged_prefill`.

    Args:
        q: ``[T, H, head_dim_qk]`` (192 for DeepSeek), ``T = qo_indptr[-1]``.
        k: ``[S, H, head_dim_qk]``, ``S = kv_indptr[-1]``.
        v: ``[S, H, head_dim_vo]`` (128).
        qo_indptr, kv_indptr: ``[batch + 1]`` int prefix sums on the HOST (list, numpy, torch, or a concrete
            jax.Array, read back once); under ``jax.jit`` they must not be traced arguments.
        causal: bottom-right aligned causal mask (query ``i`` sees keys ``j <= i + kv_len - q_len``).
        sm_scale: logit scale.
        backend: force a core backend ("flashinfer-fa3", "torch", ...; see :func:`mla_bridge.select_backend`).
        jit_route: traced calls only: "auto" (default, or ``$MLA_BRIDGE_JAX_JIT_ROUTE``), "buffer_callback" or
            "tvm_ffi" (see :data:`JIT_ROUTES`).

    Returns:
        ``(out [T, H, head_dim_vo] in q's dtype, lse [T, H] float32, natural log)``; rows with no visible key give
        out 0 and lse -inf.

    Raises:
        TypeError: a non-JAX q/k/v, or a traced indptr (named).
        ValueError / TypeError: the core's validation (shapes against the indptrs, dtypes, bad indptrs), raised
            before anything runs (at trace time under jit).
        InferenceOnlyError: on differentiation.
    """
    eager = _eager_qkv(q, k, v, jit_route)
    qo = host_values("qo_indptr", qo_indptr, where="ragged_prefill")
    kv = host_values("kv_indptr", kv_indptr, where="ragged_prefill")
    if eager:
        core_args = dict(qo_indptr=qo, kv_indptr=kv, causal=causal, sm_scale=sm_scale, backend=backend)
        return _run_eager(functools.partial(_core.ragged_prefill, **core_args), q, k, v)
    # Traced: what planning reads of q / k / v is checked by the core's eager call's own checks (on the traced
    # arrays); every other check is the core's too (RaggedPlan.validate, on stand-ins, in _ragged_traced).
    # the values of this trace, copied: the compiled function plans again from them after an eviction, and the
    # caller may refill its indptr buffer or 0-d scale array meanwhile
    spec: dict[str, Any] = dict(
        qo_indptr=as_host_indptr("qo_indptr", qo),
        kv_indptr=as_host_indptr("kv_indptr", kv),
        causal=causal,
        sm_scale=as_sm_scale(sm_scale),
        backend=backend,
        **qkv_sizes(q, k, v),
    )
    spec.update(dtype=torch_dtype(q.dtype))
    plans = _Plans(spec)
    with jax_dtype_names():  # planning refuses a dtype: named as the caller's JAX arrays name it
        plan = plans.get(default_torch_device())
    return _ragged_traced(plans, plan, q, k, v, jit_route)


def plan_ragged(
    qo_indptr: Any,
    kv_indptr: Any,
    *,
    num_heads: int,
    head_dim_qk: int,
    head_dim_vo: int,
    causal: bool,
    sm_scale: float,
    dtype: Any = jnp.bfloat16,
    device: Any = None,
    workspace: Optional[Workspace] = None,
    backend: Optional[str] = None,
) -> RaggedPlan:
    """Plan a ragged batch once, outside ``jax.jit`` (the core's :func:`mla_bridge.plan_ragged`); run it per layer
    with :func:`run_ragged`, eagerly or inside jit.

    Args:
        qo_indptr, kv_indptr: host prefix sums (list, numpy, torch, concrete jax.Array; never a tracer).
        dtype: a JAX/numpy (or torch) dtype, q/k/v's.
        device: the ``jax.Device`` the arrays live on (or a torch device / "cuda:0"); default: the workspace's
            device, else JAX's default device.
        workspace: a :class:`mla_bridge.Workspace` (default: the device's shared one).
        Others: as :func:`mla_bridge.plan_ragged`.

    Returns:
        the core's :class:`mla_bridge.RaggedPlan` (holds one pooled FlashInfer wrapper while it lives).
    """
    qo = host_values("qo_indptr", qo_indptr, where="plan_ragged")
    kv = host_values("kv_indptr", kv_indptr, where="plan_ragged")
    if workspace is None:
        workspace = default_workspace(default_torch_device() if device is None else torch_device_of(device))
    elif device is not None and torch_device_of(device) != workspace.device:
        raise ValueError(f"device {torch_device_of(device)} differs from the workspace's device {workspace.device}")
    return _core.plan_ragged(
        qo,
        kv,
        num_heads=num_heads,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        causal=causal,
        sm_scale=sm_scale,
        dtype=torch_dtype(dtype),
        workspace=workspace,
        backend=backend,
    )


def run_ragged(
    plan: RaggedPlan, q: jax.Array, k: jax.Array, v: jax.Array, *, jit_route: Optional[str] = None
) -> tuple[jax.Array, jax.Array]:
    """Run a :func:`plan_ragged` plan: ``(out [T, H, head_dim_vo], lse [T, H] float32 natural log)``.

    Eagerly or inside ``jax.jit`` (close over the plan; the compiled function reuses it on every call).

    Raises:
        TypeError: ``plan`` is not a RaggedPlan, or a non-JAX q/k/v (named).
        ValueError / TypeError: the core's :meth:`mla_bridge.RaggedPlan.validate`, before anything runs.
    """
    if not isinstance(plan, RaggedPlan):
        raise TypeError(
            f"plan must be a mla_bridge.RaggedPlan (from mla_bridge_jax.plan_ragged), got {type(plan).__name__}"
        )
    if _eager_qkv(q, k, v, jit_route):
        return _run_eager(plan.run, q, k, v)
    return _ragged_traced(_Plans(plan=plan), plan, q, k, v, jit_route)


# ---------------------------------------------------------------------------------------------------------------
# MLA prefill (latent cache, up-projection, context chunks)
# ---------------------------------------------------------------------------------------------------------------


def build_plan(
    query_lens: Any,
    context_lens: Any = None,
    *,
    dims: MLADims,
    block_size: int,
    dtype: Any = jnp.bfloat16,
    device: Any = None,
    workspace: Optional[Workspace] = None,
    backend: Optional[str] = None,
    fuse_context: bool = True,
    kv_cache_dtype: Any = None,
    index_topk: Optional[int] = None,
) -> PrefillPlan:
    """The core's :meth:`mla_bridge.PrefillPlan.build` from host lengths, for :func:`mla_prefill`; build it once per
    batch, outside ``jax.jit``, and share it across layers.

    Args:
        query_lens, context_lens: new / cached tokens per request (host values: list, numpy, concrete jax.Array).
        dtype: q / cache / weight dtype (a JAX or numpy dtype).
        device: the ``jax.Device`` the arrays live on (default: the workspace's, else JAX's default device).
        workspace: a :class:`mla_bridge.Workspace` (default: the device's shared one); its ``chunk_tokens`` bounds
            one context chunk.
        dims, block_size, backend, fuse_context: as :meth:`mla_bridge.PrefillPlan.build`.
        kv_cache_dtype: the paged cache's dtype: None / "auto" (= ``dtype``), "fp8", ``jnp.float8_e4m3fn`` or
            ``jnp.uint8`` (a view of FP8 bytes): an FP8 e4m3 cache with one per-tensor scale (see
            :mod:`mla_bridge.cache`).
        index_topk: None (default) for dense prefill; a positive int ``K`` for DeepSeek Sparse Attention: the plan
            then serves :func:`mla_prefill` with ``topk_indices`` int32 ``[T, K]`` (and only with them), as
            :meth:`mla_bridge.PrefillPlan.build` (:mod:`mla_bridge.sparse`).

    Raises:
        TypeError: traced lengths (named); the core's errors otherwise (an ``index_topk`` that is not a positive
            int included).
    """
    q_lens = host_values("query_lens", query_lens, where="build_plan")
    c_lens = None if context_lens is None else host_values("context_lens", context_lens, where="build_plan")
    q_lens = q_lens.tolist() if hasattr(q_lens, "tolist") else q_lens
    c_lens = c_lens.tolist() if hasattr(c_lens, "tolist") else c_lens  # type: ignore[union-attr]  # None: no tolist
    if workspace is None:
        workspace = default_workspace(default_torch_device() if device is None else torch_device_of(device))
    return PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=workspace,
        block_size=block_size,
        device=None if device is None else torch_device_of(device),
        dtype=torch_dtype(dtype),
        backend=backend,
        fuse_context=fuse_context,
        kv_cache_dtype=_cache_dtype(kv_cache_dtype),
        index_topk=index_topk,
    )


def _cache_dtype(dtype: Any) -> Any:
    """A JAX/numpy cache dtype as torch's (``float8_e4m3fn`` included); strings and None pass through."""
    if dtype is None or isinstance(dtype, (str, torch.dtype)):
        return dtype
    return torch_dtype(dtype, "kv_cache_dtype")


_MLA_ARGS = ("q", "kv_c", "k_pe", "kv_b_proj_weight", "kv_cache", "block_table")


def prepare_kv_b_proj(kv_b_proj_weight: jax.Array, dims: MLADims, *, layout: Optional[str] = None) -> PreparedKVBProj:
    """One layer's ``kv_b_proj.weight`` prepared once, at load time, for :func:`mla_prefill` (the core's
    :func:`mla_bridge.prepare_kv_b_proj`: the layout the up-projection reads, made on the array's device).

    Args:
        kv_b_proj_weight: concrete ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` jax.Array on one device
            (read once through DLPack; the prepared copy is the core's own memory, the array may be deleted after).
        dims, layout: as :func:`mla_bridge.prepare_kv_b_proj`.

    Returns:
        A :class:`mla_bridge.PreparedKVBProj`: pass it as ``kv_b_proj_weight`` to :func:`mla_prefill`, eagerly or
        closed over inside ``jax.jit`` (it is a constant of the compiled function, not a traced argument).

    Raises:
        TypeError: a traced weight (prepare it outside jit), a non-JAX input; the core's errors otherwise.
    """
    check_array("kv_b_proj_weight", kv_b_proj_weight)
    if is_tracer(kv_b_proj_weight):
        raise TypeError(
            "mla_bridge_jax.prepare_kv_b_proj: kv_b_proj_weight is traced; prepare the weight once, "
            "outside jax.jit, at load time"
        )
    prepared = _core.prepare_kv_b_proj(to_torch("kv_b_proj_weight", kv_b_proj_weight), dims, layout=layout)
    if prepared.device.type == "cuda":
        torch.cuda.current_stream(prepared.device).synchronize()  # load time: ready before XLA's stream reads it
    return prepared


def _shallow(err: BaseException, what: str) -> BaseException:
    """``err`` as a new exception of its type, message ``"<what>: <message>"``, raised once in a fresh thread.

    Why: an error raised inside a ``buffer_callback`` reaches the user as XLA's ``JaxRuntimeError: INTERNAL: Error
    when calling buffer callback: <text>``, where ``<text>`` is the Python stack of the deepest frame of the
    exception's traceback (a dozen frames of jax's dispatch, and the user's own) and only then the message.
    A thread's first frame has no caller, so raised from there the text is one frame line and then
    ``ValueError: mla_bridge_jax...: <message>`` (XLA's prefix itself cannot be changed from Python).
    """
    import _thread

    try:
        new = type(err)(f"{what}: {err}")
    except Exception:  # an exception type with another constructor: keep it as it is
        new = err
    done = threading.Event()

    def mla_bridge_jax_input_error():
        try:
            raise new
        except BaseException:
            pass
        finally:
            done.set()

    _thread.start_new_thread(mla_bridge_jax_input_error, ())
    done.wait()
    new.__cause__, new.__suppress_context__ = None, True
    return new


def _mla_callback(
    plans: dict,
    scale: Any = None,
    prepared: Optional[PreparedKVBProj] = None,
    *,
    sparse: bool = False,
    scale_buffer: bool = False,
    return_lse: bool = True,
) -> Callable:
    """The traced call's body; ``plans``: torch device -> its PrefillPlan (one entry, or one per device of a
    ``shard_map``); ``scale``: a Python float closed over, or None (no scale, or ``scale_buffer``: the scale is the
    last buffer, read on the device); ``prepared``: the prepared weight, a constant of the compiled function (not one
    of XLA's buffers); ``sparse``: ``topk_indices`` is the buffer after ``block_table`` (before a scale buffer);
    ``return_lse``: the call has the lse as its second output (else ``out`` alone: the lse is not written)."""

    def get_plan(device: torch.device) -> PrefillPlan:
        plan = plans.get(device)
        if plan is None:
            raise ValueError(
                f"mla_bridge_jax.mla_prefill: the plan is for {', '.join(map(str, plans))}, but XLA ran "
                f"the call on {device}; build the plan for that device (under shard_map: "
                f"mla_bridge_jax.build_sharded_plans)"
            )
        return plan

    def callback(ctx, outs, *args):
        with xla_stream(ctx, buffer_device(args[0]), get_plan) as plan:
            t_out = torch.from_dlpack(outs[0])
            tensors = [torch.from_dlpack(a) for a in args]
            s = tensors.pop() if scale_buffer else scale
            topk = tensors.pop() if sparse else None
            if prepared is not None:
                tensors.insert(3, prepared)
            try:  # block ids and picks are traced values: the core checks them (on a CPU plan) only now, at run time
                result = _core.mla_prefill(
                    *tensors, plan, out=t_out, return_lse=return_lse, kv_cache_scale=s, topk_indices=topk
                )
            except (ValueError, TypeError, IndexError) as err:
                raise _shallow(err, "mla_bridge_jax.mla_prefill") from None
            if return_lse:
                torch.from_dlpack(outs[1]).copy_(result[1])

    return callback


def _plans_by_device(plan: Any) -> dict:
    """``{torch device: PrefillPlan}`` from one plan or a mapping of per-device plans (checked to agree:
    :func:`mla_bridge.plan.plans_by_device`)."""
    if isinstance(plan, PrefillPlan):
        return {plan.device: plan}
    if isinstance(plan, Mapping) and plan and all(isinstance(p, PrefillPlan) for p in plan.values()):
        return plans_by_device(plan.values())
    raise TypeError(
        f"plan must be a mla_bridge.PrefillPlan (from mla_bridge_jax.build_plan) or a mapping of "
        f"per-device plans (mla_bridge_jax.build_sharded_plans), got {type(plan).__name__}"
    )


def mla_prefill(
    q: jax.Array,
    kv_c: jax.Array,
    k_pe: jax.Array,
    kv_b_proj_weight: "jax.Array | PreparedKVBProj",
    kv_cache: jax.Array,
    block_table: jax.Array,
    plan: PrefillPlan,
    *,
    return_lse: bool = False,
    kv_cache_scale: Any = None,
    topk_indices: Optional[jax.Array] = None,
):
    """MLA prefill attention of one layer, as :func:`mla_bridge.mla_prefill` (same shapes and conventions).

    Args:
        q ``[T, H, 192]``, kv_c ``[T, 512]``, k_pe ``[T, 64]`` or ``[T, 1, 64]``, kv_cache
        ``[num_blocks, block_size, 576]``, block_table ``[batch, max_blocks]`` int32: jax.Arrays (tracers inside
        jit) on the plan's device.
        kv_cache may be FP8 e4m3 (``jnp.float8_e4m3fn``, or a ``jnp.uint8`` view of it) when the plan was built with
        ``kv_cache_dtype="fp8"``; DLPack hands it to torch zero-copy as ``torch.float8_e4m3fn`` (uint8 as uint8,
        reinterpreted by the core).
        kv_b_proj_weight: the layer's weight from :func:`prepare_kv_b_proj` (made once at load time; the fast form),
            or the raw ``[H * 256, 512]`` jax.Array (slower: read in place by the fused kernel, rearranged in
            every call where a pass takes the cuBLAS path; :mod:`mla_bridge.weights`).
        plan: from :func:`build_plan` (host lengths; built outside jit, closed over inside it); or, for a call
            inside ``shard_map``, a mapping torch device -> plan from :func:`mla_bridge_jax.build_sharded_plans`
            (each device runs its own; see :func:`mla_bridge_jax.sharded_mla_prefill`).
        return_lse: also return the natural-log lse ``[T, H]`` float32.
        kv_cache_scale: the FP8 cache's per-tensor scale: a Python float (static under jit), or a 0-d/1-element
            float32 jax.Array on the plan's device (traced under jit: passed to the custom call as a buffer and read
            on the device). Required for FP8, refused otherwise (as :func:`mla_bridge.mla_prefill`).
        topk_indices: DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): int32 ``[T, K]`` jax.Array (a tracer inside
            jit) on the plan's device, ``K`` the ``index_topk`` the plan was built with (:func:`build_plan`): each new
            token's keys as positions in its request's sequence (its cached context first, then its new tokens), -1
            for none; only positions up to the token's own (:mod:`mla_bridge.sparse`, the contract). Required with a
            plan built with ``index_topk``, refused otherwise. Handed to the core by DLPack (no copy), which runs the
            sparse pass (chosen there, on every device).

    Returns:
        ``out [T, H, 128]`` in the plan's dtype, or ``(out, lse)``.

    Raises:
        TypeError: a non-JAX input (named), a plan that is not a PrefillPlan (or a mapping of them), a
            ``return_lse`` that is not a bool, ``topk_indices`` that is not int32 (its JAX dtype named; eagerly and
            under jit alike).
        ValueError: per-device plans that differ in anything but their device.
        ValueError / TypeError: the core's ``mla_bridge.prefill.validate_prefill_inputs`` (at trace time
            under jit; block ids on a CPU plan are range-checked when the call runs: under jit that error comes
            inside XLA's ``JaxRuntimeError``, as its last line ``ValueError: mla_bridge_jax.mla_prefill: ...``
            after a one-frame traceback); ``topk_indices`` with a dense plan, none with a sparse plan, a shape other
            than ``[T, plan.index_topk]`` (at trace time under jit); on a CPU plan a non-causal or out-of-range pick
            (eagerly; under jit when the call runs, inside XLA's ``JaxRuntimeError`` as block ids are).
        InferenceOnlyError: on differentiation.
    """
    if not isinstance(return_lse, bool):  # the core checks it eagerly; a traced call never reaches the core with it
        raise not_a_bool("return_lse", return_lse)
    if topk_indices is not None:
        check_array("topk_indices", topk_indices)
        # here, named as JAX names it: a traced uint32 (no torch dtype in the adapter) would fail making its proxy
        if jnp.dtype(topk_indices.dtype) != jnp.int32:
            raise TypeError(
                f"topk_indices must be int32 (positions, -1 for none), got {jnp.dtype(topk_indices.dtype).name}"
            )
    plans = _plans_by_device(plan)
    plan = next(iter(plans.values()))  # the same lengths, dims and dtypes on every device: validation reads it
    prepared = kv_b_proj_weight if isinstance(kv_b_proj_weight, PreparedKVBProj) else None
    names = [n for n in _MLA_ARGS if prepared is None or n != "kv_b_proj_weight"]
    args = tuple(x for x in (q, kv_c, k_pe, kv_b_proj_weight, kv_cache, block_table) if x is not prepared)
    for name, x in zip(names, args):
        check_array(name, x)

    def core_args(convert: Callable) -> list:
        tensors = [convert(n, x) for n, x in zip(names, args)]
        return tensors if prepared is None else tensors[:3] + [prepared] + tensors[3:]

    scale_array = isinstance(kv_cache_scale, (jax.Array, jax.core.Tracer))
    sparse = topk_indices is not None
    extra = ((topk_indices,) if sparse else ()) + ((kv_cache_scale,) if scale_array else ())  # buffers after the six
    if not any(is_tracer(x) for x in args + extra):
        scale = to_torch("kv_cache_scale", kv_cache_scale) if scale_array else kv_cache_scale
        tensors = core_args(to_torch)
        # tensors: the six inputs before the plan (mypy cannot tell a list's length)
        with jax_dtype_names():
            result = _core.mla_prefill(
                *tensors,
                plans.get(tensors[0].device, plan),  # type: ignore[call-arg]
                return_lse=return_lse,
                kv_cache_scale=scale,
                topk_indices=to_torch("topk_indices", topk_indices) if sparse else None,
            )
        order_xla_after_torch(tensors[0].device)  # nor the inputs (the cache, a raw weight) before the kernels ran
        return (to_jax(result[0]), to_jax(result[1])) if return_lse else to_jax(result)

    proxies = core_args(
        lambda n, x: _proxy(x.shape, _cache_dtype(x.dtype) if n == "kv_cache" else x.dtype, plan.device)
    )
    scale_proxy = (
        _proxy(kv_cache_scale.shape, kv_cache_scale.dtype, plan.device, 1.0) if scale_array else kv_cache_scale
    )
    # all zeros: valid picks (position 0) for the host checks of a CPU plan; the real values are checked at run time
    topk_proxy = _proxy(topk_indices.shape, topk_indices.dtype, plan.device) if sparse else None  # type: ignore[union-attr]
    # proxies: the six inputs before the plan (mypy cannot tell a list's length)
    with jax_dtype_names():
        _core_prefill.validate_prefill_inputs(  # type: ignore[call-arg, misc]
            *proxies, plan, kv_cache_scale=scale_proxy, topk_indices=topk_proxy
        )
    out_shape, lse_shape = plan.out_shapes
    out_types: tuple = (jax.ShapeDtypeStruct(out_shape, jax_dtype(plan.dtype)),)
    if return_lse:  # only then an lse buffer, and the core asked for it
        out_types += (jax.ShapeDtypeStruct(lse_shape, jnp.float32),)
    body = _mla_callback(
        plans,
        None if scale_array else kv_cache_scale,
        prepared,
        sparse=sparse,
        scale_buffer=scale_array,
        return_lse=return_lse,
    )
    call = buffer_callback(body, out_types, vmap_method="sequential")
    outs = _inference_only(call, "mla_bridge_jax.mla_prefill")(*args, *extra)
    return tuple(outs) if return_lse else outs[0]
