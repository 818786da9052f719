"""The sparse pass of DeepSeek Sparse Attention (DSA) prefill: each new token attends only the keys its indexer chose.

DeepSeek-V3.2 and GLM-5 keep MLA's latent cache and add a lightning indexer that keeps, for each query token, the top
``index_topk`` earlier tokens of its sequence (:mod:`mla_bridge.indexer` is a reference one); the attention of that
query runs over those keys only. :func:`mla_bridge.mla_prefill` serves it with ``topk_indices=`` over a plan built
with ``PrefillPlan.build(..., index_topk=K)``; this module holds the pass, :mod:`mla_bridge.prefill` only dispatches
to it.

Design: the sparse plan is a :class:`mla_bridge.PrefillPlan` with :attr:`~mla_bridge.PrefillPlan.index_topk` set,
not a class of its own: the sparse pass reads what every plan holds (the lengths, ``qo_indptr``, the dims and
dtypes, the block size), the caller passes the same tensors as for dense prefill, and a :class:`mla_bridge.PlanCache`
keys both kinds alike (``index_topk`` is part of the key). A plan is for one kind of call: indices with a dense plan,
or a sparse plan without indices, are refused by name.

**Indices** (``topk_indices``, int32 ``[T, K]``, ``K = plan.index_topk``, on the plan's device): row ``t`` lists the
keys of new token ``t`` as positions in its own request's sequence, ``0 .. context_lens[r] + query_lens[r] - 1``: the
first ``context_lens[r]`` positions are the cached context (read from the paged cache through ``block_table``), the
rest the request's new tokens (read from ``kv_c`` / ``k_pe``, as dense prefill does). ``-1`` marks no key (fewer than
K picks). A query may pick only positions up to its own (``context_lens[r] + j`` for its ``j``-th new token): on the
CPU a later position (a non-causal pick), one past the sequence or below -1 is refused with a ValueError naming
``topk_indices``; on CUDA that is the caller's contract, as ``block_table`` ids are (checking would synchronize every
layer). A position listed twice in one row is attended twice (as FlashMLA's sparse kernel does); an indexer's top-k
never lists one twice. The order within a row does not matter.

**The absorbed (MQA) form.** With ``W_UK [H, qk_nope_head_dim, kv_lora_rank]`` and ``W_UV [H, v_head_dim,
kv_lora_rank]`` the per-head blocks of ``kv_b_proj`` (:meth:`mla_bridge.PreparedKVBProj.absorbed_weights`),
``q_nope . (W_UK c) = (W_UK^T q_nope) . c``: each head's query becomes ``q_lat = W_UK^T q_nope`` (``kv_lora_rank``
values) plus its ``q_pe``, scored against the selected latent rows ``c ++ k_pe`` (576 values for DeepSeek, shared by
every head), ``score = (q_lat . c + q_pe . k_pe) * sm_scale`` with the dense path's softmax scale
(``plan.dims.softmax_scale``); the softmax runs in float32; ``o_lat = P @ c`` and ``out = W_UV o_lat``
(``[T, H, v_head_dim]``). The LSE is the natural log of the sum of the exponentials of the scaled scores, ``[T, H]``
float32, as dense prefill's. A query with no selected key (a row of -1) gets out 0 and lse -inf, the dense passes'
convention for a row without keys.

**Two paths, chosen in one place** (:func:`select_sparse`): on CUDA where Triton imports, the Triton kernel of
:mod:`mla_bridge.kernels.sparse_attention` (the attention over the selected latent rows; the absorption matmuls
before and after it are torch ``bmm`` in the plan's dtype); the torch path below everywhere else (the CPU, Triton
missing, a shape the kernel does not take, with the reason), and wherever ``MLA_BRIDGE_SPARSE=torch`` asks for it
(``=triton`` forces the kernel, refused where it cannot serve). Both compute the same function; they round
differently (below).

*The Triton path.* Per chunk of at most :data:`SPARSE_KERNEL_CHUNK_ROWS` (token, head) rows: ``q_lat = W_UK^T q_nope``
(a bmm in the plan's dtype, float32 accumulation, rounded to the plan's dtype); one launch that gathers each token's
selected rows itself, never writing them to memory (context rows through ``block_table``, new tokens' rows from
``kv_c`` / ``k_pe``), and computes the scores, a float32 online softmax, ``o_lat`` (rounded to the plan's dtype) and
the LSE (float32); then ``out = W_UV o_lat`` (a bmm). The attended context is first gathered once per call into
the fused key latents (:func:`mla_bridge.cache.fused_latent`: each request's context rows, an FP8 cache's as
``stored * scale`` rounded to the plan's dtype as the torch path rounds it, then its new tokens' rows), which the
kernel reads as new rows, contiguous, with no page lookup (:attr:`mla_bridge.PrefillPlan.sparse_latent_meta` places
them), where they take no more memory than one context chunk's up-projected k / v (``(gathered context + T) x
latent_dim <= chunk_tokens x H x (head_dim_qk + head_dim_vo)``: the plan decides); beyond that the kernel reads
each tile through ``block_table`` and converts an FP8 tile's values, applying the scale to their scores and
probabilities, so ``stored * scale`` is never rounded. With bf16/fp16 the probabilities enter ``P @
c`` in that dtype (as in FlashAttention). So the kernel rounds ``q_lat``, ``P`` and ``o_lat`` where the torch path
keeps float32: in bf16 both are within 2e-2 of a float64 attention (``out`` absolute and relative, the LSE
absolute). It holds per chunk ``q_lat`` and ``o_lat`` (``2 x rows x kv_lora_rank`` elements of the plan's dtype:
256 MiB at 2**17 rows, kv_lora_rank 512, bf16) and for the call 16 bytes per new token (its request, context and
sequence lengths, copied to the device at plan time), and with the route above the gathered latents. The kernel
takes fp16/bf16/float32 plans, ``kv_lora_rank`` up to :data:`SPARSE_KERNEL_MAX_RANK` and ``qk_rope_head_dim`` up to
:data:`SPARSE_KERNEL_MAX_ROPE` (0 included), any block size, bf16/fp16/float32 and FP8 e4m3 caches. On CUDA a pick
past its request's sequence is skipped by the kernel, never read (the indices are not checked there).

On compute capability 9.0 the launches over the gathered latents of a bf16/fp16 plan run the Hopper kernel of
:mod:`mla_bridge.kernels.sparse_attention_sm90` (:func:`sm90_kernel_serves`): the same function, each score
computed once where the portable kernel's layout computes it twice, rounded as the portable kernel rounds (equal
within rounding: the products' order differs).

*The torch path.* Float32 arithmetic: the selected rows are gathered in the plan's dtype, an FP8 cache's
dequantized into it as the dense gather does, and then read as float32; ``out`` is rounded once to the plan's dtype.
Queries go in chunks of at most :data:`SPARSE_CHUNK_QUERIES` and at most :data:`SPARSE_CHUNK_PAIRS` (query, selected
key) pairs (one query at least), so a call never holds the ``[T, K, 576]`` selected rows of all queries: per chunk
of ``n`` queries it holds ``n x K`` selected rows (in the plan's dtype and as float32: ``n x K x 576 x (e + 4)``
bytes), the scores and probabilities (``3 x n x H x K x 4`` bytes) and the latent query and output (``2 x n x H x
kv_lora_rank x 4``); for the whole call a float32 copy of ``W_UK`` and ``W_UV`` (none for a float32 weight), ``out``
and the LSE, and the per-token request and position (16 bytes per new token). On CUDA it is a correct fallback,
not a fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import switches
from .cache import fused_latent, gather_latent
from .dims import MLADims
from .kernels import triton_available, triton_interpreting
from .kernels import triton_version as kernel_triton_version
from .plan import PrefillPlan
from .weights import PreparedKVBProj

__all__ = [
    "SPARSE_CHUNK_PAIRS",
    "SPARSE_CHUNK_QUERIES",
    "SPARSE_KERNEL_CHUNK_ROWS",
    "SPARSE_KERNEL_DTYPES",
    "SPARSE_KERNEL_MAX_RANK",
    "SPARSE_KERNEL_MAX_ROPE",
    "SPARSE_ENV",
    "SparseChoice",
    "check_topk_indices",
    "kernel_why_not",
    "select_sparse",
    "token_meta",
    "token_positions",
    "sparse_prefill",
    "sm90_kernel_serves",
    "triton_kernel_for",
]

#: (query, selected key) pairs per chunk of the torch path: 32768 pairs hold 75 MB of float32 latent rows at 576
#: values per row (module docstring).
SPARSE_CHUNK_PAIRS = 1 << 15
#: Queries per chunk at most (bounds the latent queries and outputs, ``n x H x kv_lora_rank`` float32 each, where K
#: is small).
SPARSE_CHUNK_QUERIES = 256
#: (token, head) rows per launch of the Triton path: bounds its latent queries and outputs (module docstring).
SPARSE_KERNEL_CHUNK_ROWS = 1 << 17
#: Plan dtypes the Triton kernel computes (fp16/bf16 on tensor cores; float32 with ieee dots, slow, for checks).
SPARSE_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The largest kv_lora_rank the Triton kernel takes: a program holds a float32 ``[heads, kv_lora_rank]`` accumulator
#: (64 heads x 512 in registers; more would spill). DeepSeek and GLM-5 use 512.
SPARSE_KERNEL_MAX_RANK = 512
#: The largest qk_rope_head_dim the Triton kernel takes (DeepSeek and GLM-5 use 64).
SPARSE_KERNEL_MAX_ROPE = 128
#: The environment variable forcing a sparse attention implementation ("triton", "torch"; "auto" or unset: chosen).
SPARSE_ENV = switches.SPARSE


@dataclass(frozen=True)
class SparseChoice:
    """The sparse attention :func:`select_sparse` picked.

    Attributes:
        name: ``"triton"`` (:mod:`mla_bridge.kernels.sparse_attention`) or ``"torch"`` (the torch path).
        reason: why, in words (for the torch path on CUDA: why not the kernel).
        forced: True when ``MLA_BRIDGE_SPARSE`` asked for it by name.
    """

    name: str
    reason: str
    forced: bool = False


def sm90_kernel_serves(
    dims: MLADims,
    dtype: torch.dtype,
    capability: Optional[tuple[int, int]],
    triton_version: Optional[tuple[int, int]] = None,
) -> bool:
    """Whether the Triton path's launches over the fused key latents run the Hopper kernel
    (:mod:`mla_bridge.kernels.sparse_attention_sm90`, warp-specialized) rather than the portable one: a device of
    compute capability 9.0 (``capability``, None off CUDA); Triton 3.6 (``triton_version``, default the one that
    imports: the Gluon dialect the kernel is written in changes between releases, 3.9 renamed its asynchronous
    copies, so other versions run the portable kernel); a bf16/fp16 plan of at least 64 heads (the kernel's blocks
    are 64 heads: fewer would multiply padding); and ``kv_lora_rank`` 512 with ``qk_rope_head_dim`` 64, the dims of
    the DSA models (DeepSeek-V3.2, GLM-5) and the only ones the kernel has been checked at on a GPU (it compiles for
    other powers of two; they run the portable kernel). Where the latents are not gathered (the plan's choice) the
    portable kernel reads the cache itself."""
    if capability != (9, 0) or dtype not in (torch.float16, torch.bfloat16) or dims.num_heads < 64:
        return False
    if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (512, 64):
        return False
    return (kernel_triton_version() if triton_version is None else triton_version) == (3, 6)


def triton_kernel_for(plan: PrefillPlan) -> str:
    """Which kernel the Triton path launches for ``plan``: ``"hopper"``
    (:mod:`mla_bridge.kernels.sparse_attention_sm90`) where the attended context is gathered into the fused key
    latents (:attr:`mla_bridge.PrefillPlan.sparse_latent_meta`) and :func:`sm90_kernel_serves` takes the plan's
    dims, dtype and device, else ``"portable"`` (:mod:`mla_bridge.kernels.sparse_attention`)."""
    gathered = plan.sparse_latent_meta is not None
    return "hopper" if gathered and sm90_kernel_serves(plan.dims, plan.dtype, plan.capability) else "portable"


def kernel_why_not(dims: MLADims, dtype: torch.dtype) -> Optional[str]:
    """Why the Triton kernel cannot serve dims ``dims`` at plan dtype ``dtype``, or None where it can (any device:
    the device is :func:`select_sparse`'s question)."""
    if dtype not in SPARSE_KERNEL_DTYPES:
        return f"the kernel computes float16, bfloat16 or float32 plans, got {dtype}"
    if dims.kv_lora_rank > SPARSE_KERNEL_MAX_RANK:
        return (
            f"kv_lora_rank {dims.kv_lora_rank} > {SPARSE_KERNEL_MAX_RANK}: the kernel's float32 [heads, kv_lora_rank] "
            f"accumulator would not fit a program's registers"
        )
    if dims.qk_rope_head_dim > SPARSE_KERNEL_MAX_ROPE:
        return f"qk_rope_head_dim {dims.qk_rope_head_dim} > {SPARSE_KERNEL_MAX_ROPE}, the kernel's largest"
    return None


def select_sparse(
    dims: MLADims, dtype: torch.dtype, device_type: str, *, triton: Optional[bool] = None
) -> SparseChoice:
    """The ONE place choosing the sparse attention's implementation (module docstring): the Triton kernel on CUDA
    where Triton imports and :func:`kernel_why_not` finds nothing, else the torch path, with the reason.

    ``MLA_BRIDGE_SPARSE=torch`` forces the torch path (for comparison and as an escape hatch); ``=triton`` forces the
    kernel (on the CPU only with ``TRITON_INTERPRET=1``, for development); ``auto`` or unset: the default.

    Args:
        dims, dtype: the plan's dims and dtype; device_type: ``"cuda"`` or ``"cpu"``.
        triton: whether Triton imports (default: :func:`mla_bridge.kernels.triton_available`, asked only when the
            kernel could run).

    Raises:
        ValueError: another ``MLA_BRIDGE_SPARSE`` value; ``=triton`` off CUDA without ``TRITON_INTERPRET=1``, where
            Triton does not import, or for dims / a dtype the kernel does not take (the message gives the reason).
    """
    forced = switches.sparse()  # "auto", "torch" or "triton" (another value is refused there)
    if forced == "torch":
        return SparseChoice("torch", f"forced by {SPARSE_ENV}=torch", forced=True)
    why_not = kernel_why_not(dims, dtype)
    if forced == "triton":
        if device_type != "cuda" and not triton_interpreting():
            raise ValueError(
                f"{SPARSE_ENV}=triton runs a Triton kernel: it needs a CUDA device, got {device_type} "
                f"(TRITON_INTERPRET=1 runs it on the CPU, for development)"
            )
        if not (triton_available() if triton is None else triton):
            raise ValueError(f"{SPARSE_ENV}=triton, but Triton does not import here")
        if why_not is not None:
            raise ValueError(f"{SPARSE_ENV}=triton, but the kernel cannot serve this layer: {why_not}")
        return SparseChoice("triton", f"forced by {SPARSE_ENV}=triton", forced=True)
    if device_type != "cuda":
        return SparseChoice("torch", f"the torch path serves {device_type} tensors (the Triton kernel runs on CUDA)")
    if not (triton_available() if triton is None else triton):
        return SparseChoice("torch", "fallback: Triton does not import here")
    if why_not is not None:
        return SparseChoice("torch", f"fallback: {why_not}")
    return SparseChoice("triton", "CUDA with Triton: the sparse attention kernel")


def token_positions(plan: PrefillPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(req_ids, positions)``, int64 ``[T]`` each on the plan's device: the request of each new token and its
    position in that request's sequence (``context_lens[r] + j`` for the request's ``j``-th new token), the last
    position its ``topk_indices`` row may name. Read from :func:`token_meta` (a token's row minus the row of its
    sequence position 0).

    Raises:
        ValueError: a dense plan (no ``index_topk``).
    """
    meta = token_meta(plan).long()
    rows = torch.arange(plan.num_tokens, dtype=torch.int64, device=meta.device)
    return meta[:, 0], rows - meta[:, 3]


def check_topk_indices(topk_indices, plan: PrefillPlan) -> Optional[torch.Tensor]:
    """Check ``topk_indices`` against ``plan`` on the host (module docstring): None for a dense plan without
    indices, else the indices (unchanged).

    Raises:
        TypeError: not a dense torch.Tensor, or not int32.
        ValueError: indices with a plan built without ``index_topk``, no indices with a plan built with it, another
            device, a shape other than ``[T, plan.index_topk]``; on the CPU, a position after the query's own (a
            non-causal pick), past its request's sequence, or below -1 (the message names the row, the pick and the
            request).
    """
    k = plan.index_topk
    if topk_indices is None:
        if k is not None:
            raise ValueError(
                f"topk_indices is required: the plan was built with index_topk={k} for sparse attention (build the "
                f"plan without index_topk for dense prefill)"
            )
        return None
    if k is None:
        raise ValueError(
            "topk_indices was given, but the plan was built for dense prefill: build it with "
            "PrefillPlan.build(..., index_topk=K) for sparse attention"
        )
    if not isinstance(topk_indices, torch.Tensor):
        raise TypeError(f"topk_indices must be a torch.Tensor, got {type(topk_indices).__name__}")
    if topk_indices.layout != torch.strided:
        raise TypeError(f"topk_indices must be a dense (strided) tensor, got layout {topk_indices.layout}")
    if topk_indices.dtype != torch.int32:
        raise TypeError(f"topk_indices must be int32 (positions, -1 for none), got {topk_indices.dtype}")
    if topk_indices.device != plan.device:
        raise ValueError(f"topk_indices is on {topk_indices.device}, but the plan is on {plan.device}")
    t = plan.num_tokens
    if topk_indices.shape != (t, k):
        raise ValueError(
            f"topk_indices must be [T={t} (new tokens), index_topk={k} (the plan's)], got {list(topk_indices.shape)}"
        )
    if topk_indices.device.type == "cpu" and topk_indices.numel():
        req, own = token_positions(plan)
        idx = topk_indices.long()
        bad = (idx < -1) | (idx > own[:, None])
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            p, r = int(idx[row, col]), int(req[row])
            length = plan.context_lens[r] + plan.query_lens[r]
            why = (
                "below -1 (-1 marks no key)"
                if p < -1
                else f"past request {r}'s sequence of {length} positions (context {plan.context_lens[r]} + new "
                f"{plan.query_lens[r]})"
                if p >= length
                else f"after the query's own position {int(own[row])} in request {r} (a non-causal pick)"
            )
            raise ValueError(f"topk_indices[{row}, {col}] = {p} is {why}")
    return topk_indices


def token_meta(plan: PrefillPlan) -> torch.Tensor:
    """int32 ``[T, 4]`` on the plan's device, per new token: its request, the request's context length, its sequence
    length (context + new) and the row of ``kv_c`` / ``k_pe`` holding its sequence position 0 (its first new token's
    row minus the context length): what the Triton kernel and the torch path read to place each pick. The plan's
    :attr:`mla_bridge.plan.PrefillPlan.sparse_token_meta`, made once at its build (a layer copies nothing to the
    device, so the host never waits for the GPU).

    Raises:
        ValueError: a dense plan (no ``index_topk``).
    """
    if plan.sparse_token_meta is None:
        raise ValueError("the plan is dense (index_topk=None): build it with PrefillPlan.build(..., index_topk=K)")
    return plan.sparse_token_meta


def sparse_prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    weight: PreparedKVBProj,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: PrefillPlan,
    topk_indices: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    kv_cache_scale=None,
    gather: Optional[str] = None,
    hook: Optional[Callable[[str], None]] = None,
    impl: Optional[str] = None,
):
    """The sparse attention of one layer in the absorbed form (module docstring): the Triton kernel or the torch
    path, as :func:`select_sparse` chooses.

    Inputs as :func:`mla_bridge.mla_prefill` takes them, checked there (:func:`check_topk_indices` included):
    ``k_pe`` as ``[T, qk_rope_head_dim]``, ``kv_cache`` / ``kv_cache_scale`` as
    :func:`mla_bridge.cache.check_kv_cache` returns them, ``weight`` any layout. ``gather``: the gather
    implementation for context rows of the torch path (:func:`mla_bridge.cache.gather_impl`; None: chosen there).
    ``hook``: called with "sparse attention" before the first chunk and "end" after the last. ``impl``: "triton" or
    "torch" instead of :func:`select_sparse`'s choice (tests and benchmarks: whether it can serve is not checked).

    Returns:
        ``out [T, H, v_head_dim]`` in the plan's dtype (written into ``out`` where given), or ``(out, lse)`` with
        ``return_lse`` (``lse [T, H]`` float32, natural log; -inf for a row without keys).

    Raises:
        ValueError: ``MLA_BRIDGE_SPARSE`` (or, for the kernel, ``MLA_BRIDGE_TRITON_LAUNCH``) that cannot serve here, or
            an unknown ``impl``, before anything is allocated.
    """
    d, t, kk = plan.dims, plan.num_tokens, plan.index_topk
    assert kk is not None  # check_topk_indices refused a dense plan
    if impl is None:
        impl = select_sparse(d, plan.dtype, plan.device.type).name
    elif impl not in switches.SPARSE_IMPLS:
        raise ValueError(f"impl must be one of {switches.SPARSE_IMPLS} or None (chosen by select_sparse), got {impl!r}")
    if impl == "triton":
        switches.triton_launch()  # read by each launch: a value that cannot serve is refused before any work
    h = d.num_heads
    dev, dtype = plan.device, plan.dtype
    hook = hook if hook is not None else (lambda name: None)
    if out is None:
        out = torch.empty(t, h, d.v_head_dim, dtype=dtype, device=dev)
    lse = torch.empty(t, h, dtype=torch.float32, device=dev) if return_lse else None
    hook("sparse attention")
    run = _triton_path if impl == "triton" else _torch_path
    run(q, kv_c, k_pe, weight, kv_cache, block_table, plan, topk_indices, out, lse, kv_cache_scale, gather)
    hook("end")
    return (out, lse) if return_lse else out


def _triton_path(q, kv_c, k_pe, weight, kv_cache, block_table, plan, topk_indices, out, lse, kv_cache_scale, gather):
    """The Triton path (module docstring): per chunk of tokens, ``q_lat`` by a bmm, one kernel launch for ``o_lat``
    and the LSE, ``out`` by a bmm."""
    from .kernels.sparse_attention import sparse_attention_triton

    d, t = plan.dims, plan.num_tokens
    if t == 0:
        return
    h, nope = d.num_heads, d.qk_nope_head_dim
    w_uk, w_uv = weight.absorbed_weights()  # [H, nope, rank], [H, v, rank] in the plan's dtype
    meta = token_meta(plan)
    latent, sm90 = None, False
    if plan.sparse_latent_meta is not None:
        # The context rows gathered once (an FP8 cache's dequantized) into the fused key latents (each request's
        # context, then its new tokens), which the kernel reads as new rows: no page lookup or conversion per tile
        latent = fused_latent(plan, kv_c, k_pe, kv_cache, block_table, kv_cache_scale, impl=gather)
        meta, kv_cache, kv_cache_scale = plan.sparse_latent_meta, latent[:, None], None
        kv_c, k_pe = latent[:, : d.kv_lora_rank], latent[:, d.kv_lora_rank :]
        # (its 16-byte copies need aligned rows a multiple of 16 elements apart, as the fused latents' 576 are)
        aligned = latent.stride(0) % 16 == 0 and latent.data_ptr() % 16 == 0
        sm90 = aligned and triton_kernel_for(plan) == "hopper"
    if sm90:
        from .kernels.sparse_attention_sm90 import sparse_attention_sm90

        kernel, rows = sparse_attention_sm90, (latent,)  # every pick a row of the gathered latents
    else:
        kernel, rows = sparse_attention_triton, (kv_cache, block_table, kv_c, k_pe, kv_cache_scale)
    step = max(1, SPARSE_KERNEL_CHUNK_ROWS // max(1, h))
    for a in range(0, t, step):
        b = min(t, a + step)
        qa = q[a:b]
        q_lat = torch.bmm(qa[..., :nope].transpose(0, 1), w_uk)  # [H, n, rank]
        o_lat = torch.empty_like(q_lat)
        kernel(
            o_lat.transpose(0, 1),
            None if lse is None else lse[a:b],
            q_lat.transpose(0, 1),
            qa[..., nope:],
            topk_indices[a:b],
            meta[a:b],
            *rows,
            d.softmax_scale,
        )
        out[a:b] = torch.bmm(o_lat, w_uv.transpose(1, 2)).transpose(0, 1)  # [n, H, v]


def _torch_path(q, kv_c, k_pe, weight, kv_cache, block_table, plan, topk_indices, out, lse, kv_cache_scale, gather):
    """The torch path (module docstring), in chunks of queries."""
    d, t, kk = plan.dims, plan.num_tokens, plan.index_topk
    nope, rank = d.qk_nope_head_dim, d.kv_lora_rank
    dev, dtype = plan.device, plan.dtype
    w_uk, w_uv = (w.float() for w in weight.absorbed_weights())  # [H, nope, rank], [H, v, rank]
    meta = token_meta(plan).long()  # per token: request, context length, sequence length, kv_c row of position 0
    step = max(1, min(SPARSE_CHUNK_QUERIES, SPARSE_CHUNK_PAIRS // kk))
    for a in range(0, t, step):
        b = min(t, a + step)
        idx = topk_indices[a:b].long()  # [n, K]
        valid = idx >= 0
        req = meta[a:b, 0, None].expand_as(idx)
        ctx = meta[a:b, 1, None]
        from_cache = valid & (idx < ctx)
        from_new = valid & (idx >= ctx)
        sel = torch.zeros(b - a, kk, d.latent_dim, dtype=dtype, device=dev)  # -1 picks stay 0 (masked below)
        cache_req, cache_pos = req[from_cache], idx[from_cache]
        if cache_req.numel():
            sel[from_cache] = gather_latent(
                kv_cache, block_table, cache_req, cache_pos, dtype=dtype, kv_cache_scale=kv_cache_scale, impl=gather
            )
        rows = (meta[a:b, 3, None] + idx)[from_new]
        if rows.numel():
            sel[from_new] = torch.cat([kv_c[rows], k_pe[rows]], dim=-1)
        lat = sel.float()
        c_sel, pe_sel = lat[..., :rank], lat[..., rank:]
        qa = q[a:b].float()
        q_lat = torch.einsum("nhd,hdr->nhr", qa[..., :nope], w_uk)
        s = torch.einsum("nhr,nkr->nhk", q_lat, c_sel) + torch.einsum("nhp,nkp->nhk", qa[..., nope:], pe_sel)
        s = s.mul_(d.softmax_scale).masked_fill_(~valid[:, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # a row without keys: exp(-inf) = 0
        e = torch.exp(s - m)
        total = e.sum(dim=-1)  # [n, H]
        has_keys = valid.any(dim=-1)[:, None]
        o_lat = torch.einsum("nhk,nkr->nhr", e, c_sel) / torch.where(has_keys, total, 1.0)[..., None]
        out[a:b] = torch.einsum("nhr,hvr->nhv", o_lat, w_uv).to(dtype)
        if lse is not None:
            lse[a:b] = torch.where(has_keys, m.squeeze(-1) + torch.log(total), float("-inf"))
