"""The one dispatch layer: which kernel serves a ragged prefill on which GPU (SM100 first).

Every caller (the core, the JAX and vLLM adapters) asks :func:`select_backend`; the capability table
:data:`BACKENDS` below is the only place that knows what each kernel supports. Rows are tried in order and
the first that can serve wins; every row passed over is recorded with its reason.

Sources: FlashInfer 0.7.4 ``flashinfer/prefill.py`` (``_CUTLASS_PLAN_WORK_CAPACITY``,
``_CUTLASS_PLAN_QO_TILE_SIZE``, ``DISPATCH_head_dim`` of ``csrc/fmha_cutlass_sm100.cu``, the cutlass dtype rule),
``flashinfer/utils.py`` (``is_fa3_prefill_head_dim_supported``), and vLLM's MLA prefill selector (SM10x uses
FlashInfer's explicit ``backend="cutlass"``).

Head dims (:func:`head_dims_why_not`): fa2 prefill turns ``HEAD_DIM`` into ``NUM_MMA_D = HEAD_DIM / 16`` by integer
division and never checks it (``include/flashinfer/attention/prefill.cuh``); with 2-byte q/k/v only multiples of 64
work: others give an illegal memory access or "Invalid configuration : NUM_MMA_Q=1 NUM_MMA_D_QK=1" (head dim 16),
and dims that are not multiples of 16 return silently wrong values (flashinfer#4299; PR #4312 adds the check
``head_dim % 64 == 0``, which 0.7.4 lacks; DeepSeek's 192/128 qualifies). The rule is for 2-byte q/k/v; 1-byte (FP8)
KV needs a stricter one (PR #4312's review). fa3 takes what ``is_fa3_prefill_head_dim_supported`` allows: 64/64,
128/128, 256/256, 192/128 (read in the 0.7.4 wheel's ``flashinfer/utils.py``). A shape no FlashInfer row serves
runs on the torch backend, and :class:`BackendChoice` says why.

32-bit offsets (:data:`OFFSET_LIMITS`, :func:`tensor_extent`): the kernels address q/k/v/out as ``base + token *
stride_n + head * stride_h + d``, so what must stay below a backend's limit is the largest element offset a tensor of
the pass reaches through its strides (its *extent*: ``(tokens - 1) * stride_n + (heads - 1) * stride_h +
head_dim``), not its element count: k and v of :func:`mla_bridge.mla_prefill` are views of one ``[N, H, head_dim_qk
+ head_dim_vo]`` buffer, so they reach ``N x H x 320`` (DeepSeek), not ``N x H x 192``. Per backend, in the FlashInfer
0.7.4 sources:

* fa2 (limit ``2**32``): ``csrc/batch_prefill.cu:124-135`` narrows ``q/k/v.stride(0)``, ``stride(1)`` to
  ``uint32_t``; ``BatchPrefillRaggedParams`` holds them as ``uint32_t``
  (``include/flashinfer/attention/default_prefill_params.cuh:152-157``); ``BatchPrefillWithRaggedKVCacheKernel``
  computes ``q_indptr[r] * q_stride_n + head * q_stride_h`` (``include/flashinfer/attention/prefill.cuh:3497-3498``),
  the k/v tile starts ``(kv_indptr[r] + chunk_start + row) * k_stride_n + head * k_stride_h``
  (``prefill.cuh:3615-3626``) and out's ``o_indptr[r] * o_stride_n`` with ``o_stride_n = num_qo_heads *
  HEAD_DIM_VO`` (``prefill.cuh:3495-3503``: out is written as if contiguous) in 32-bit unsigned arithmetic: they wrap
  past ``2**32``. Measured on the H200 (fa2 forced, 128 heads, k/v views of the 320-wide buffer): a request starting
  at element offset 4,300,800,000 came back with max error 3.11, the first request right.
* cutlass (limit ``2**31``): ``csrc/fmha_cutlass_sm100.cu:103-108`` takes the strides as ``int``, and
  ``include/flashinfer/attention/blackwell/fmha_cutlass_sm100.cuh:52-58, 101-107`` builds int layouts (q, k, v, out,
  lse) from them. Its q/k/v/out loads and stores go through TMA descriptors, whose address arithmetic is not the
  kernel's, so whether offsets wrap at ``2**31`` could not be measured (no SM100 here): held to ``2**31``.
* fa3 (no limit): ``include/flashinfer/attention/hopper/default_params.cuh:96-103`` holds ``int64_t`` strides and
  ``hopper/mainloop.cuh:50`` builds ``int64_t`` layouts; measured correct on the H200 at 6.44e9 elements.

A pass whose extent reaches a backend's limit is routed past that row (or refused when that backend is forced);
:class:`mla_bridge.PrefillPlan` sizes its context chunks so that they stay below the limit of the backend that
serves them, and :meth:`mla_bridge.RaggedPlan.run` refuses, before any kernel, a q/k/v whose strides reach past the
limit of the backend it was planned for.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from . import switches

__all__ = [
    "BackendChoice",
    "BackendSpec",
    "BACKENDS",
    "BACKEND_NAMES",
    "ENV_VAR",
    "Request",
    "select_backend",
    "cutlass_work_items",
    "flashinfer_version",
    "head_dims_why_not",
    "FA3_HEAD_DIMS",
    "CUTLASS_HEAD_DIMS",
    "FA2_HEAD_DIM_MULTIPLE",
    "FA2_MAX_HEAD_DIM",
    "FA2_HEAD_DIMS_VO",
    "TORCH_DTYPES",
    "device_capability",
    "OFFSET_LIMITS",
    "tensor_extent",
    "pass_extents",
]

ENV_VAR = switches.BACKEND
CUTLASS_PLAN_WORK_CAPACITY = 131072  # FlashInfer: work-index buffers are allocated at this fixed size
CUTLASS_PLAN_QO_TILE_SIZE = 256  # FlashInfer: one work item per (q tile of 256, head, request)
#: Capability majors the cutlass row serves (SM100/SM103, SM110): the only row that reads per-request lengths, so
#: :func:`select_backend` remembers choices on every other device (see ``_CHOICES``).
CUTLASS_MAJORS = (10, 11)
# Largest extent (one past the largest element offset, through the tensor's strides) of a q/k/v/out tensor each
# kernel indexes correctly (see the module docstring for the sources). Measured on the H200 (FlashInfer 0.7.4, 128
# heads, 192/128, bf16): fa2 correct at 2.15e9 elements, wrong beyond 2**32 (4.43e9: the last request's rows off by
# 3.5, i.e. 32-bit unsigned offsets); fa3 correct at 4.43e9 and 6.44e9. cutlass takes `int` strides and could not
# be measured (no SM100 here): held to 2**31.
CUTLASS_ELEMENT_LIMIT = 2**31
FA2_ELEMENT_LIMIT = 2**32
#: Backends (:data:`BACKEND_NAMES`) whose kernels compute element offsets in 32 bits, and the extent
#: (:func:`tensor_extent`) no q/k/v/out tensor of a pass they serve may reach. Backends not listed have no such limit.
OFFSET_LIMITS = {"flashinfer-cutlass": CUTLASS_ELEMENT_LIMIT, "flashinfer-fa2": FA2_ELEMENT_LIMIT}
_HALF = (torch.float16, torch.bfloat16)
#: fa2 prefill: head dims multiples of this (flashinfer#4299 / PR #4312), up to FA2_MAX_HEAD_DIM. Measured on the
#: H200 (FlashInfer 0.7.4, bf16, raw wrapper vs float64): 16, 32, 48 fail in plan/run ("Invalid configuration");
#: 64, 128, 256 and 192/128 are right.
FA2_HEAD_DIM_MULTIPLE = 64
FA2_MAX_HEAD_DIM = 256
#: fa2's split-KV merge (``VariableLengthMergeStates``, ``DISPATCH_HEAD_DIM``) takes only these v head dims: measured
#: on the H200 (FlashInfer 0.7.4), fa2 at 96/96 fails there with "Unsupported head_dim: 96"; 192 is not among them
#: either.
FA2_HEAD_DIMS_VO = (64, 128, 256)
#: fa3 prefill: FlashInfer 0.7.4 ``flashinfer.utils.is_fa3_prefill_head_dim_supported``.
FA3_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
#: cutlass (SM100): ``DISPATCH_head_dim`` of ``csrc/fmha_cutlass_sm100.cu``.
CUTLASS_HEAD_DIMS = ((192, 128), (128, 128), (64, 64))


def head_dims_why_not(backend: str, head_dim_qk: Optional[int], head_dim_vo: Optional[int]) -> Optional[str]:
    """Why FlashInfer ``backend`` ("fa2", "fa3", "cutlass") cannot take these head dims, or ``None`` if it can.

    ``None`` dims are unknown and pass. Sources: see the module docstring (fa2: flashinfer#4299 / PR #4312;
    fa3: ``is_fa3_prefill_head_dim_supported``; cutlass: ``DISPATCH_head_dim``), measured on the H200 by
    ``scripts/gpu/head_dim_grid.sh``.
    """
    qk, vo = head_dim_qk, head_dim_vo
    if backend == "fa2":
        for name, d in (("head_dim_qk", qk), ("head_dim_vo", vo)):
            if d is not None and (d <= 0 or d % FA2_HEAD_DIM_MULTIPLE or d > FA2_MAX_HEAD_DIM):
                return (
                    f"{name} {d} is not a multiple of {FA2_HEAD_DIM_MULTIPLE} up to {FA2_MAX_HEAD_DIM} "
                    f"(fa2 prefill fails or is wrong at other head dims: flashinfer#4299)"
                )
        if vo is not None and vo not in FA2_HEAD_DIMS_VO:
            return (
                f"head_dim_vo {vo} is not one of {', '.join(map(str, FA2_HEAD_DIMS_VO))} (fa2's split-KV merge "
                f"dispatches only those; 96 failed there on the H200)"
            )
        return None
    table = {"fa3": FA3_HEAD_DIMS, "cutlass": CUTLASS_HEAD_DIMS}[backend]
    if qk is None or vo is None:
        return None
    if (qk, vo) not in table:
        return f"head dims {qk}/{vo} not in {', '.join(f'{a}/{b}' for a, b in table)}"
    return None


@functools.lru_cache(maxsize=1)
def _flashinfer_version_cached() -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("flashinfer-python")
        except PackageNotFoundError:
            return None
    except Exception:  # pragma: no cover - importlib.metadata always exists on 3.11
        return None


def flashinfer_version() -> Optional[str]:
    """The installed flashinfer-python version, or ``None`` when it is not installed (no import needed)."""
    return _flashinfer_version_cached()


#: ``(reader, device index) -> (major, minor)``: what :func:`device_capability` has read. The reader is
#: ``torch.cuda.get_device_capability`` as found at the call, so a stand-in monkeypatched over it is asked afresh.
_CAPABILITIES: dict = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of the CUDA ``device`` (a ``torch.device`` with an index), read from torch once per device
    per process: a device's compute capability never changes, and ``torch.cuda.get_device_capability`` costs a
    noticeable share of a plan build's own host time per call (measured on the H200's host: docs/results.md).

    Raises:
        TypeError / ValueError: ``device`` not a ``torch.device`` of type cuda with an index (the cache is keyed by it).
    """
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device('cuda', index), got {type(device).__name__}")
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device must be a torch.device('cuda', index), got {device}")
    read = torch.cuda.get_device_capability
    key = (read, device.index)
    capability = _CAPABILITIES.get(key)
    if capability is None:
        capability = _CAPABILITIES[key] = read(device)
    return capability


def tensor_extent(tokens: int, heads: int, head_dim: int, strides: Optional[Sequence[int]] = None) -> int:
    """Elements from the first element of a ``[tokens, heads, head_dim]`` tensor with a unit last stride to one past
    the last one a kernel reads through its ``(token, head)`` ``strides`` (elements; ``None``: contiguous):
    ``(tokens - 1) * stride_n + (heads - 1) * stride_h + head_dim``, 0 for an empty tensor. The largest element offset
    a kernel computes for it is this minus 1 (see the module docstring)."""
    if tokens <= 0 or heads <= 0 or head_dim <= 0:
        return 0
    if strides is None:
        return tokens * heads * head_dim
    stride_n, stride_h = strides
    return (tokens - 1) * int(stride_n) + (heads - 1) * int(stride_h) + head_dim


def pass_extents(
    num_qo_tokens: int,
    num_kv_tokens: int,
    num_heads: int,
    head_dim_qk: int,
    head_dim_vo: int,
    strides: Optional[Sequence] = None,
) -> tuple[tuple[str, int], ...]:
    """``(("q", extent), ("k", ...), ("v", ...), ("out", ...))``: the :func:`tensor_extent` of each tensor of one
    pass, q/k/v through ``strides`` (``(q, k, v)``, each ``(stride_n, stride_h)`` in elements or ``None`` for
    contiguous; ``None``: all contiguous), out as contiguous (fa2 and cutlass write it so whatever its strides; fa3
    has no offset limit)."""
    sq, sk, sv = strides if strides is not None else (None, None, None)
    return (
        ("q", tensor_extent(num_qo_tokens, num_heads, head_dim_qk, sq)),
        ("k", tensor_extent(num_kv_tokens, num_heads, head_dim_qk, sk)),
        ("v", tensor_extent(num_kv_tokens, num_heads, head_dim_vo, sv)),
        ("out", tensor_extent(num_qo_tokens, num_heads, head_dim_vo)),
    )


def _checked_strides(strides: Any) -> Optional[tuple]:
    """``strides`` (:func:`select_backend`) as ``((q_n, q_h) | None, (k_n, k_h) | None, (v_n, v_h) | None)`` of ints,
    or None.

    Raises:
        TypeError / ValueError: not None nor three entries, each None or two non-negative ints (named).
    """
    if strides is None:
        return None
    if isinstance(strides, (str, bytes)) or not isinstance(strides, Sequence) or len(strides) != 3:
        raise TypeError(
            f"strides must be None or (q, k, v) strides, each (stride_n, stride_h) or None, got {strides!r}"
        )
    out: list[Optional[tuple[int, int]]] = []
    for name, pair in zip("qkv", strides):
        if pair is None:
            out.append(None)
            continue
        if (
            isinstance(pair, (str, bytes))
            or not isinstance(pair, Sequence)
            or len(pair) != 2
            or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in pair)
        ):
            raise TypeError(
                f"strides[{'qkv'.index(name)}] ({name}) must be (stride_n, stride_h) ints or None, got {pair!r}"
            )
        if min(int(x) for x in pair) < 0:
            raise ValueError(f"strides[{'qkv'.index(name)}] ({name}) must be non-negative, got {tuple(pair)}")
        out.append((int(pair[0]), int(pair[1])))
    return tuple(out)


def cutlass_work_items(qo_indptr: Sequence[int], num_heads: int) -> int:
    """Work items FlashInfer's cutlass ``fmha_varlen_plan`` emits: ``sum(ceil(q_len / 256)) * num_heads``.

    FlashInfer 0.7.4 writes one entry per (q tile, head, request) into buffers of 131072 entries without a bounds
    check (``_cutlass_plan_work_items`` in ``flashinfer/prefill.py``), so more than that must not reach it.
    """
    tiles = sum(-(-(int(b) - int(a)) // CUTLASS_PLAN_QO_TILE_SIZE) for a, b in zip(qo_indptr[:-1], qo_indptr[1:]))
    return tiles * num_heads


@dataclass(frozen=True)
class Request:
    """What a backend is asked to serve. ``None`` fields are unknown and pass every check that needs them."""

    device_type: str  # "cuda" or "cpu"
    capability: Optional[tuple[int, int]]
    cuda_version: Optional[tuple[int, int]]
    flashinfer: bool
    dtype: Optional[torch.dtype] = None
    out_dtype: Optional[torch.dtype] = None
    head_dim_qk: Optional[int] = None
    head_dim_vo: Optional[int] = None
    causal: Optional[bool] = None
    num_heads: Optional[int] = None
    qo_indptr: Optional[Sequence[int]] = None
    kv_indptr: Optional[Sequence[int]] = None
    strides: Optional[tuple] = None  # (q, k, v): (stride_n, stride_h) in elements or None (contiguous)


@dataclass(frozen=True)
class BackendSpec:
    """One row of the capability table: a name, FlashInfer's backend string (``None`` for torch), what it serves
    (in words, for error messages) and ``why_not(request) -> reason or None``."""

    name: str
    flashinfer_backend: Optional[str]
    supports: str
    why_not: Callable[[Request], Optional[str]]


def _flashinfer_common(req: Request, element_limit: Optional[int]) -> Optional[str]:
    if req.device_type != "cuda":
        return f"needs a CUDA device, got {req.device_type}"
    if not req.flashinfer:
        return "flashinfer-python is not installed (pip install 'mla-bridge[flashinfer]')"
    if req.dtype is not None and req.dtype not in _HALF:
        return f"FlashInfer runs float16/bfloat16 only, got {req.dtype}"
    if req.out_dtype is not None and req.dtype is not None and req.out_dtype != req.dtype:
        return f"output dtype {req.out_dtype} differs from q's {req.dtype}"
    if element_limit is not None:
        name, extent = _largest_extent(
            req.qo_indptr, req.kv_indptr, req.num_heads, req.head_dim_qk, req.head_dim_vo, req.strides
        )
        if extent >= element_limit:
            return (
                f"a q/k/v tensor of {extent} elements reaches its offset limit ({element_limit}): {name}, "
                f"counted through its strides; split the batch"
            )
    return None


def _largest_extent(qo_indptr, kv_indptr, num_heads, head_dim_qk, head_dim_vo, strides) -> tuple[str, int]:
    """``(name, extent)`` of the pass's tensor reaching farthest (:func:`pass_extents`), ``("", 0)`` where the
    lengths or sizes are unknown."""
    if qo_indptr is None or kv_indptr is None or num_heads is None or head_dim_qk is None:
        return "", 0
    extents = pass_extents(
        int(qo_indptr[-1]),
        int(kv_indptr[-1]),
        num_heads,
        head_dim_qk,
        head_dim_vo if head_dim_vo is not None else head_dim_qk,
        strides,
    )
    return max(extents, key=lambda item: item[1])


def _cutlass_why_not(req: Request) -> Optional[str]:
    if req.capability is None or req.capability[0] not in CUTLASS_MAJORS:
        return f"needs SM100/SM103/SM110 (capability 10.x or 11.x), got {_cap(req.capability)}"
    need = (13, 0) if req.capability[0] == 11 else (12, 8)
    if req.cuda_version is None or req.cuda_version < need:
        return f"needs CUDA >= {need[0]}.{need[1]} on {_cap(req.capability)}, got {_ver(req.cuda_version)}"
    reason = _flashinfer_common(req, OFFSET_LIMITS["flashinfer-cutlass"])
    if reason:
        return reason
    reason = head_dims_why_not("cutlass", req.head_dim_qk, req.head_dim_vo)
    if reason:
        return reason
    if req.qo_indptr is not None and req.kv_indptr is not None:
        if req.causal:
            for r, (qa, qb, ka, kb) in enumerate(
                zip(req.qo_indptr[:-1], req.qo_indptr[1:], req.kv_indptr[:-1], req.kv_indptr[1:])
            ):
                if qb - qa > kb - ka:
                    return f"causal request {r} has q_len {qb - qa} > kv_len {kb - ka}"
        if req.num_heads is not None:
            items = cutlass_work_items(req.qo_indptr, req.num_heads)
            if items > CUTLASS_PLAN_WORK_CAPACITY:
                return f"{items} plan work items (q tiles x heads x requests) > {CUTLASS_PLAN_WORK_CAPACITY}"
    return None


def _fa3_why_not(req: Request) -> Optional[str]:
    if req.capability is None or req.capability[0] != 9:
        return f"needs SM90 (capability 9.x), got {_cap(req.capability)}"
    reason = _flashinfer_common(req, None)
    if reason:
        return reason
    return head_dims_why_not("fa3", req.head_dim_qk, req.head_dim_vo)


def _fa2_why_not(req: Request) -> Optional[str]:
    if req.capability is None or req.capability < (8, 0):
        return f"needs SM80 or newer (capability >= 8.0), got {_cap(req.capability)}"
    reason = _flashinfer_common(req, OFFSET_LIMITS["flashinfer-fa2"])
    if reason:
        return reason
    return head_dims_why_not("fa2", req.head_dim_qk, req.head_dim_vo)


#: The q/k/v dtypes the torch backend computes (in float32 blocks; float64 in, float64 out).
TORCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _torch_why_not(req: Request) -> Optional[str]:
    if req.dtype is not None and req.dtype not in TORCH_DTYPES:
        return f"computes bfloat16, float16, float32 or float64 q/k/v, got {req.dtype}"
    return None


#: The capability table, SM100 first. Order is preference: the first row that can serve wins.
BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(
        "flashinfer-cutlass",
        "cutlass",
        "SM100/SM103 (10.x, CUDA >= 12.8) and SM110 (11.x, CUDA >= 13.0); fp16/bf16 with out dtype == q dtype, "
        "tensors reaching < 2**31 elements through their strides; "
        "head dims 192/128, 128/128, 64/64; causal only with q_len <= kv_len; <= 131072 plan work items",
        _cutlass_why_not,
    ),
    BackendSpec(
        "flashinfer-fa3", "fa3", "SM90 (9.x); fp16/bf16; head dims 64/64, 128/128, 256/256, 192/128", _fa3_why_not
    ),
    BackendSpec(
        "flashinfer-fa2",
        "fa2",
        "SM80 and newer (8.x, 9.x, 10.x, 12.x); fp16/bf16, tensors reaching "
        "< 2**32 elements through their strides; head dims multiples of 64 "
        "up to 256 (192/128 included)",
        _fa2_why_not,
    ),
    BackendSpec(
        "torch", None, "any device; bfloat16/float16/float32/float64 (blockwise float32 reference)", _torch_why_not
    ),
)
#: The names of the backends in the dispatch table, in priority order (what ``backend=`` and ``MLA_BRIDGE_BACKEND``
#: accept, besides "auto").
BACKEND_NAMES: tuple[str, ...] = tuple(spec.name for spec in BACKENDS)
assert BACKEND_NAMES == switches.BACKEND_NAMES, "the switch lists the table's backends, in its order"
_BY_NAME = {spec.name: spec for spec in BACKENDS}


@dataclass(frozen=True)
class BackendChoice:
    """The backend :func:`select_backend` picked.

    Attributes:
        name: one of :data:`BACKEND_NAMES`.
        reason: why it was picked (in words).
        passed_over: ``(name, reason)`` for each preferred row that could not serve.
        forced: True when the backend was asked for by name (``requested=`` / ``backend=``, or
            ``MLA_BRIDGE_BACKEND``) rather than picked by the table (``reason`` then says which: "forced by ...").
    """

    name: str
    reason: str
    passed_over: tuple[tuple[str, str], ...] = ()
    forced: bool = False

    @property
    def flashinfer_backend(self) -> Optional[str]:
        """FlashInfer's ``backend=`` string ("cutlass", "fa3", "fa2"), or ``None`` for the torch backend."""
        return _BY_NAME[self.name].flashinfer_backend

    @property
    def is_flashinfer(self) -> bool:
        return self.flashinfer_backend is not None


def _cap(capability: Optional[tuple[int, int]]) -> str:
    return "no CUDA device" if capability is None else f"capability {capability[0]}.{capability[1]}"


def _ver(version: Optional[tuple[int, int]]) -> str:
    return "no CUDA toolkit" if version is None else f"CUDA {version[0]}.{version[1]}"


@functools.lru_cache(maxsize=8)  # a pure function of the version string, read at every select_backend call
def _parse_cuda_version(text: Optional[str]) -> Optional[tuple[int, int]]:
    if not text:
        return None
    parts = str(text).split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def _int_list(values: Optional[Sequence[int]]) -> Optional[list[int]]:
    """``values`` as a list of Python ints; an int32/int64 tensor or numpy array, or a list of ints (what the planners
    hand over) in one call."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor) and values.dtype in (torch.int32, torch.int64):
        return values.tolist()
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.tolist()
    if type(values) is list and set(map(type, values)) <= {int}:
        return values
    return [int(x) for x in values]


def select_backend(
    device: "torch.device | str | int | None" = None,
    *,
    capability: Optional[tuple[int, int]] = None,
    dtype: Optional[torch.dtype] = None,
    head_dim_qk: Optional[int] = None,
    head_dim_vo: Optional[int] = None,
    causal: Optional[bool] = None,
    requested: Optional[str] = None,
    out_dtype: Optional[torch.dtype] = None,
    num_heads: Optional[int] = None,
    qo_indptr: Optional[Sequence[int]] = None,
    kv_indptr: Optional[Sequence[int]] = None,
    cuda_version: Optional[tuple[int, int]] = None,
    strides: Optional[Sequence] = None,
) -> BackendChoice:
    """Pick the kernel for a ragged prefill, SM100 first (see :data:`BACKENDS`).

    Args:
        device: the device the tensors live on (``None``: the current CUDA device if there is one, else CPU).
        capability: ``(major, minor)``; given, it is used instead of querying a device (vLLM asks this way), and
            the request is taken to be on CUDA.
        dtype / out_dtype: q/k/v dtype and output dtype (``None``: unknown, not checked).
        head_dim_qk / head_dim_vo: 192 / 128 for DeepSeek MLA.
        causal, num_heads, qo_indptr, kv_indptr: host lengths, known at plan time (indptrs as sequences of ints,
            integer tensors or numpy arrays); they enable the cutlass checks on q_len > kv_len and on plan work items.
        requested: force a backend by name (one of :data:`BACKEND_NAMES`, or "auto"; case-insensitively, spaces
            stripped); when ``None`` the environment variable ``MLA_BRIDGE_BACKEND`` is read (the same spellings).
        cuda_version: ``(major, minor)`` of the CUDA toolkit (default: ``torch.version.cuda``).
        strides: ``(q, k, v)``, each the ``(stride_n, stride_h)`` in elements the kernel will read that tensor through
            (``None``, or a ``None`` entry: contiguous ``[tokens, heads, head_dim]``). With the indptrs and sizes, they
            give each tensor's extent (:func:`pass_extents`), held below the 32-bit offset limit of the backends that
            have one (:data:`OFFSET_LIMITS`).

    Returns:
        a :class:`BackendChoice` (immutable). Answers are remembered: the capability, the CUDA and FlashInfer
        versions and ``MLA_BRIDGE_BACKEND`` are read at every call and, with every argument, key the answer; of the
        indptrs and strides the key holds only the farthest-reaching tensor's extent when it reaches an offset limit,
        since no other row reads them, except on SM100/SM110 (the cutlass row checks each request), where nothing is
        remembered.
        Errors are never remembered.

    Raises:
        ValueError: the forced backend is unknown, or cannot serve this request (the message names the
            capability and what the backend supports); no backend serves it (a dtype outside
            :data:`TORCH_DTYPES`, which the torch row, the last, also refuses); negative ``strides``.
        TypeError: ``strides`` not ``None`` nor three entries of ``(stride_n, stride_h)`` ints or ``None``.
    """
    strides = _checked_strides(strides)
    if capability is not None:
        device_type = "cuda"
        capability = (int(capability[0]), int(capability[1]))
    else:
        if device is None:
            dev = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        elif isinstance(device, torch.device):
            dev = device
        else:
            dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        device_type = dev.type
        capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    if cuda_version is None:
        cuda_version = _parse_cuda_version(torch.version.cuda)
    flashinfer = flashinfer_version() is not None
    source = "requested"
    if isinstance(requested, str):  # the spellings MLA_BRIDGE_BACKEND takes: spaces stripped, any case
        requested = requested.strip().lower()
    if requested is None:
        requested = switches.backend()  # read per call, as the other switches are
        source = ENV_VAR
    key = None
    if capability is None or capability[0] not in CUTLASS_MAJORS:
        key = (
            device_type,
            capability,
            cuda_version,
            flashinfer,
            dtype,
            out_dtype,
            head_dim_qk,
            head_dim_vo,
            causal,
            num_heads,
            requested,
            source,
            _elements_key(qo_indptr, kv_indptr, num_heads, head_dim_qk, head_dim_vo, strides),
        )
        choice = _CHOICES.get(key)
        if choice is not None:
            return choice
    req = Request(
        device_type=device_type,
        capability=capability,
        cuda_version=cuda_version,
        flashinfer=flashinfer,
        dtype=dtype,
        out_dtype=out_dtype,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        causal=causal,
        num_heads=num_heads,
        qo_indptr=_int_list(qo_indptr),
        kv_indptr=_int_list(kv_indptr),
        strides=strides,
    )
    choice = _walk_table(req, requested, source)
    if key is not None:
        if len(_CHOICES) >= _CHOICES_MAX:
            _CHOICES.clear()
        _CHOICES[key] = choice
    return choice


#: Choices made so far (:func:`select_backend`), by everything they depend on; at most ``_CHOICES_MAX``, then cleared.
_CHOICES: dict = {}
_CHOICES_MAX = 256


def _elements_key(qo_indptr, kv_indptr, num_heads, head_dim_qk, head_dim_vo, strides) -> tuple:
    """What the table reads of the lengths and strides outside the cutlass row: the farthest-reaching tensor and its
    extent (:func:`_largest_extent`) when it reaches an offset limit (the reason then names them), else ``("", 0)``
    (no row's verdict or words depend on them)."""
    name, extent = _largest_extent(qo_indptr, kv_indptr, num_heads, head_dim_qk, head_dim_vo, strides)
    return (name, extent) if extent >= min(OFFSET_LIMITS.values()) else ("", 0)


def _walk_table(req: Request, requested: Optional[str], source: str) -> BackendChoice:
    """The dispatch table's answer for ``req`` (``requested``: a forced backend name or None, named by ``source``
    in errors)."""
    capability = req.capability
    if requested is not None and requested != "auto":
        spec = _BY_NAME.get(requested)
        if spec is None:
            raise ValueError(
                f"{source}: unknown backend {requested!r}; expected one of {list(BACKEND_NAMES)} or 'auto'"
            )
        reason = spec.why_not(req)
        if reason is not None:
            raise ValueError(
                f"{source}: backend {requested!r} cannot serve this request on {_cap(capability)} "
                f"({reason}); it supports {spec.supports}"
            )
        return BackendChoice(spec.name, f"forced by {source}", forced=True)

    passed_over: list[tuple[str, str]] = []
    for spec in BACKENDS:
        reason = spec.why_not(req)
        if reason is None:
            why = f"first backend that serves {_cap(capability)}"
            if spec.name == "torch":
                why = (
                    "fallback: no FlashInfer backend serves this request ("
                    + "; ".join(f"{name}: {r}" for name, r in passed_over)
                    + ")"
                )
            return BackendChoice(spec.name, why, tuple(passed_over))
        passed_over.append((spec.name, reason))
    raise ValueError("no backend serves this request (" + "; ".join(f"{name}: {r}" for name, r in passed_over) + ")")
