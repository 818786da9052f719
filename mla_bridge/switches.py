"""The ``MLA_BRIDGE_*`` environment switches: the one module that reads and validates each of them.

Every switch is read at the moment its user asks (:data:`SWITCHES` says when: per call, or once at import), through
its function here, which returns the value in the form its user needs or raises a ``ValueError`` naming the
variable. What a valid value then does, and whether it can serve on this machine (Triton importable, a CUDA
device), is decided by the module named in :attr:`Switch.read_by`; the errors it raises name the switch too.
``mla-bridge info`` lists the switches from :data:`SWITCHES` with their values now, flagging any :func:`problem` finds.

Nothing here imports another module of mla_bridge: this module sits at the bottom of the import graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = [
    "Switch",
    "SWITCHES",
    "KERNEL_SWITCHES",
    "BACKEND",
    "KV",
    "GATHER",
    "MERGE",
    "SPARSE",
    "FLASHINFER_DIRECT",
    "TRITON_LAUNCH",
    "JAX_JIT_ROUTE",
    "JAX_MAX_PLANS",
    "DEBUG",
    "BACKEND_NAMES",
    "KV_IMPLS",
    "MERGE_IMPLS",
    "SPARSE_IMPLS",
    "LAUNCH_MODES",
    "JIT_ROUTES",
    "raw",
    "backend",
    "kv",
    "gather",
    "merge",
    "sparse",
    "flashinfer_direct",
    "triton_launch",
    "jax_jit_route",
    "jax_max_plans",
    "debug",
    "problem",
]

BACKEND = "MLA_BRIDGE_BACKEND"
KV = "MLA_BRIDGE_KV"
GATHER = "MLA_BRIDGE_GATHER"
MERGE = "MLA_BRIDGE_MERGE"
SPARSE = "MLA_BRIDGE_SPARSE"
FLASHINFER_DIRECT = "MLA_BRIDGE_FLASHINFER_DIRECT"
TRITON_LAUNCH = "MLA_BRIDGE_TRITON_LAUNCH"
JAX_JIT_ROUTE = "MLA_BRIDGE_JAX_JIT_ROUTE"
JAX_MAX_PLANS = "MLA_BRIDGE_JAX_MAX_PLANS"
DEBUG = "MLA_BRIDGE_DEBUG"

#: The attention backends of the dispatch table, in priority order (:data:`mla_bridge.dispatch.BACKEND_NAMES`, which
#: is built from the table and checked against this at import).
BACKEND_NAMES = ("flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2", "torch")
#: How a pass builds its k and v (:func:`mla_bridge.kv.kv_impl`), besides "auto".
KV_IMPLS = ("fused", "separate")
#: The merge implementations (:func:`mla_bridge.merge.select_merge`), besides "auto".
MERGE_IMPLS = ("triton", "flashinfer", "torch")
#: The sparse attention implementations (:func:`mla_bridge.sparse.select_sparse`), besides "auto".
SPARSE_IMPLS = ("triton", "torch")
#: How Triton kernels are launched (:mod:`mla_bridge.kernels.launch`).
LAUNCH_MODES = ("direct", "jit")
#: The JAX adapter's routes under ``jax.jit`` (``mla_bridge_jax.JIT_ROUTES``).
JIT_ROUTES = ("auto", "buffer_callback", "tvm_ffi")


@dataclass(frozen=True)
class Switch:
    """One environment switch.

    Attributes:
        name: the variable.
        values: the values it takes, in words (case and surrounding spaces as :attr:`read_by` says).
        default: what an unset variable means.
        doc: what it chooses.
        read_by: the module that reads it (through this module's function), and when: per call, or at import.
    """

    name: str
    values: str
    default: str
    doc: str
    read_by: str


#: Every environment variable mla_bridge and its adapters read, in the order ``mla-bridge info`` lists them.
SWITCHES: tuple[Switch, ...] = (
    Switch(
        BACKEND,
        " | ".join(BACKEND_NAMES) + " | auto; case-insensitive",
        "the dispatch table",
        "the attention backend, where backend= is not given",
        "mla_bridge.dispatch, per call (select_backend)",
    ),
    Switch(
        KV,
        " | ".join(KV_IMPLS) + " | auto; case-insensitive",
        "auto",
        "how a pass builds k and v: fused (one Triton kernel), separate (gather + GEMM), or per pass (auto)",
        "mla_bridge.kv, per call (kv_impl)",
    ),
    Switch(
        GATHER,
        "triton | torch | auto; case-insensitive",
        "auto",
        "the paged-cache gather: the Triton kernel or torch",
        "mla_bridge.cache, per call (gather_impl)",
    ),
    Switch(
        MERGE,
        " | ".join(MERGE_IMPLS) + " | auto; case-insensitive",
        "auto",
        "the merge of partials: the Triton kernel, FlashInfer's merge_state or torch",
        "mla_bridge.merge, per call (select_merge)",
    ),
    Switch(
        SPARSE,
        " | ".join(SPARSE_IMPLS) + " | auto; case-insensitive",
        "auto",
        "the sparse attention (topk_indices): the Triton kernels (on compute capability 9.0 with Triton 3.6 the "
        "Hopper one over gathered latents) or torch",
        "mla_bridge.sparse, per call (select_sparse)",
    ),
    Switch(
        FLASHINFER_DIRECT,
        "1 | 0 | auto; case-insensitive",
        "1",
        "fa2/fa3 runs call FlashInfer's ragged_run directly (1) or wrapper.run (0)",
        "mla_bridge.backends.flashinfer, at a plan's first run; checked by mla_prefill per call",
    ),
    Switch(
        TRITON_LAUNCH,
        " | ".join(LAUNCH_MODES) + " | auto; case-insensitive",
        "direct",
        "Triton launches: direct (the compiled launcher) or jit (kernel[grid])",
        "mla_bridge.kernels.launch, per launch; checked by mla_prefill per call",
    ),
    Switch(
        JAX_JIT_ROUTE,
        " | ".join(JIT_ROUTES),
        "auto",
        "the JAX adapter's route under jax.jit, where jit_route is not given",
        "mla_bridge_jax.api, per traced call where jit_route is not given",
    ),
    Switch(
        JAX_MAX_PLANS,
        "a positive int",
        "16",
        "plans the shared plan cache (mla_bridge.plan_cache, all adapters) and the JAX tvm_ffi registry each keep",
        "mla_bridge.plan_cache, when the shared plan cache is first made; mla_bridge_jax.tvm_ffi, at import",
    ),
    Switch(
        DEBUG,
        "1 | true | yes | on, case-insensitive; anything else: off",
        "0",
        "mla-bridge prints the traceback of an unexpected error, not one line (exit code 3)",
        "mla_bridge.cli, when a command fails",
    ),
)

#: The switches of mla_prefill's kernel choices (each read by its own chooser, per call).
KERNEL_SWITCHES = (BACKEND, KV, GATHER, MERGE, SPARSE, FLASHINFER_DIRECT, TRITON_LAUNCH)


def raw(name: str) -> Optional[str]:
    """The variable ``name`` as set now (``None`` when unset), unvalidated: for keys of cached choices, which must
    tell two settings apart exactly as their readers do."""
    return os.environ.get(name)


def backend() -> Optional[str]:
    """``MLA_BRIDGE_BACKEND`` (spaces stripped, lower case), or ``None`` when unset or empty; "auto" is returned as
    given (the dispatch table decides).

    Raises:
        ValueError: a name outside :data:`BACKEND_NAMES` and "auto" (the message names the variable).
    """
    value = (os.environ.get(BACKEND) or "").strip().lower() or None
    if value is not None and value != "auto" and value not in BACKEND_NAMES:
        raise ValueError(f"{BACKEND}: unknown backend {value!r}; expected one of {list(BACKEND_NAMES)} or 'auto'")
    return value


def kv() -> str:
    """``MLA_BRIDGE_KV`` (spaces stripped, lower case): one of :data:`KV_IMPLS`, "auto", or "" when unset.

    Raises:
        ValueError: any other value (the message lists :data:`KV_IMPLS`).
    """
    value = os.environ.get(KV, "")
    choice = value.strip().lower()
    if choice not in ("", "auto") and choice not in KV_IMPLS:
        raise ValueError(f"{KV} must be one of {KV_IMPLS} or 'auto', got {value!r}")
    return choice


def gather() -> str:
    """``MLA_BRIDGE_GATHER`` (spaces stripped, lower case): "torch", "triton", or "auto" (also when unset or empty).

    Raises:
        ValueError: any other value.
    """
    forced = os.environ.get(GATHER, "auto").strip().lower()
    if forced in ("", "auto"):
        return "auto"
    if forced not in ("torch", "triton"):
        raise ValueError(f"{GATHER}={forced!r}: expected torch, triton or auto")
    return forced


def merge() -> Optional[str]:
    """``MLA_BRIDGE_MERGE`` as one of :data:`MERGE_IMPLS`, or ``None`` (unset, empty or "auto"; case-insensitive).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(MERGE)
    if value is None:
        return None
    forced = value.strip().lower()
    if forced in ("", "auto"):
        return None
    if forced not in MERGE_IMPLS:
        raise ValueError(f"{MERGE}={value!r}: expected one of {', '.join(MERGE_IMPLS)} or auto")
    return forced


def sparse() -> str:
    """``MLA_BRIDGE_SPARSE`` (spaces stripped, lower case): "torch", "triton", or "auto" (also when unset or empty).

    Raises:
        ValueError: any other value (the message names the variable).
    """
    value = os.environ.get(SPARSE, "")
    forced = value.strip().lower()
    if forced in ("", "auto"):
        return "auto"
    if forced not in SPARSE_IMPLS:
        raise ValueError(f"{SPARSE}={value!r}: expected one of {', '.join(SPARSE_IMPLS)} or auto")
    return forced


def flashinfer_direct() -> bool:
    """``MLA_BRIDGE_FLASHINFER_DIRECT``: True when unset, empty, "1" or "auto" (the default), False for "0".

    Raises:
        ValueError: any other value (the message names the variable).
    """
    value = os.environ.get(FLASHINFER_DIRECT, "")
    choice = value.strip().lower()
    if choice in ("", "1", "auto"):
        return True
    if choice == "0":
        return False
    raise ValueError(f"{FLASHINFER_DIRECT}={value!r}: expected 1 (direct runs, the default), 0 (wrapper.run) or auto")


def triton_launch() -> str:
    """``MLA_BRIDGE_TRITON_LAUNCH``: "direct" (also when unset, empty or "auto") or "jit" (case-insensitive).

    Raises:
        ValueError: any other value (the message lists :data:`LAUNCH_MODES`).
    """
    value = os.environ.get(TRITON_LAUNCH, "")
    m = value.strip().lower()
    if m in ("", "auto", "direct"):
        return "direct"
    if m == "jit":
        return "jit"
    raise ValueError(f"{TRITON_LAUNCH}={value!r}: expected one of {LAUNCH_MODES} or auto")


def jax_jit_route(requested: Optional[str] = None) -> str:
    """The JAX adapter's route under ``jax.jit``, one of :data:`JIT_ROUTES`: ``requested`` (its ``jit_route``
    argument) when given, else ``MLA_BRIDGE_JAX_JIT_ROUTE`` (exactly, case-sensitive), "auto" when unset or empty.

    Raises:
        ValueError: any other value, naming ``jit_route``, or the variable (saying the ``jit_route`` argument was not
            given: the variable is read only then).
    """
    if requested:
        if requested not in JIT_ROUTES:
            raise ValueError(f"jit_route must be one of {list(JIT_ROUTES)}, got {requested!r}")
        return requested
    route = os.environ.get(JAX_JIT_ROUTE) or "auto"
    if route not in JIT_ROUTES:
        raise ValueError(f"${JAX_JIT_ROUTE} (jit_route not given) must be one of {list(JIT_ROUTES)}, got {route!r}")
    return route


def jax_max_plans(default: int = 16) -> int:
    """``MLA_BRIDGE_JAX_MAX_PLANS`` as a positive int (``default`` when unset or blank; spaces stripped).

    Despite its name it bounds the plan cache every adapter shares (:func:`mla_bridge.plan_cache.shared_plan_cache`,
    read when that cache is first made), as well as the JAX adapter's tvm_ffi registry (read at its import).

    Raises:
        ValueError: any other value (not an integer, or below 1), naming the variable.
    """
    value = os.environ.get(JAX_MAX_PLANS, "")
    if not value.strip():
        return default
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{JAX_MAX_PLANS}={value!r}: expected a positive int (plans held at once; unset: {default})")
    return n


def debug() -> bool:
    """``MLA_BRIDGE_DEBUG``: True for "1", "true", "yes" or "on" (case-insensitive, spaces stripped), else False
    (unset, "", "0", "false", "no", "off" or anything else: never an error, it is read while reporting one)."""
    return os.environ.get(DEBUG, "").strip().lower() in ("1", "true", "yes", "on")


def problem(name: str) -> Optional[str]:
    """The message the reader of switch ``name`` would raise for the value set now, or ``None`` (unset, valid, a
    switch that takes any value, or not a switch). ``mla-bridge info`` flags values with a problem."""
    readers: dict[str, Callable[[], object]] = {
        BACKEND: backend,
        KV: kv,
        GATHER: gather,
        MERGE: merge,
        SPARSE: sparse,
        FLASHINFER_DIRECT: flashinfer_direct,
        TRITON_LAUNCH: triton_launch,
        JAX_JIT_ROUTE: jax_jit_route,
        JAX_MAX_PLANS: jax_max_plans,
    }
    reader = readers.get(name)
    if reader is None:
        return None
    try:
        reader()
    except ValueError as err:
        return str(err)
    return None
