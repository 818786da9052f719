"""mla_prefill: MLA prefill attention of one layer for a planned batch (new tokens + paged cached context).

Steps per layer (all host decisions were made in :class:`mla_bridge.PrefillPlan`):
  1. gather the context's latent rows through ``block_table`` (dequantizing an FP8 cache into the plan's dtype) and,
     for the fused schedule, place the new tokens after each request's context (:mod:`mla_bridge.cache`);
  2. up-project the 576-wide latent rows (kv_c ++ k_pe) of the keys with the layer's weight prepared once
     (:func:`mla_bridge.prepare_kv_b_proj`), whose output holds k = concat(k_nope, k_pe) and v side by side
     (steps 1 and 2 are one Triton launch per pass on CUDA: :mod:`mla_bridge.kv` chooses);
  3. attention: the fused schedule gathers context and new tokens into one key buffer and runs one causal pass;
     the chunked schedule runs the causal main pass over the new tokens, then for each context chunk gathers the
     latent cache by ``block_table``, up-projects it, runs a non-causal pass and merges by LSE (a row merged more
     than once, its request's context split over chunks, is carried in float32 between its merges and rounded to
     the plan's dtype once: :attr:`mla_bridge.PrefillPlan.merge_steps`).
The formula is DeepSeek-V2's MLA in its "MHA form" (``kv_b_proj`` splits into k_nope and v per head).
With ``topk_indices`` (a plan built with ``index_topk``: DeepSeek Sparse Attention) the call dispatches to the sparse
pass of :mod:`mla_bridge.sparse` instead (the absorbed form over each token's selected latent rows).

Non-finite inputs (NaN, inf), per row of ``out`` / ``lse``. A NaN or infinity in a new token's ``kv_c`` makes its key's
k and v non-finite (the up-projection mixes every latent channel into every head); in its ``k_pe``, its k; in a cached
context token's latent, that key's k and v; in ``q``, its own row's logits. Every step but attention is per token
(gather, up-projection) or per row (merge), so what differs is the attention kernel:
  * rows that attend a key with a NaN k (or a NaN / mixed-sign infinite logit) get a non-finite out and lse; a
    non-finite value in v alone leaves lse finite and makes out non-finite in those rows; a non-finite q makes its
    own row non-finite, no other. A context token is attended by every new token of its request, a new token ``t``
    by the request's rows ``t`` on (causal); other requests never see either.
  * torch backend (:mod:`mla_bridge.backends.torch_ref`): every other row is bitwise what it is without the bad
    value, in every schedule.
  * FlashInfer (fa2 and fa3 measured; cutlass, SM100, is the same kind of kernel): the kernels multiply a key tile's
    probabilities (0 for masked keys) by its values, and 0 times NaN is NaN, so a non-finite value in the v of a new
    token's key can also make ``out`` NaN in rows of the same request that cannot see it but share a kernel tile with
    rows that do: a run of rows right before the first row that sees it, shorter than 256 (a query tile and a key
    tile are at most 128 each); their ``lse`` stays finite. Rows whose keys end 256 keys or more before the bad key,
    and other requests, are unaffected. Context keys are not masked (every row of the request sees them), so a bad
    context token reaches exactly its request's rows on every backend. Measured per backend and schedule by
    ``tests/gpu/test_gpu_nonfinite.py``.
  * An infinite k alone gives logits of +inf or -inf by the sign of q: -inf is a weight of 0 (the row stays finite);
    +inf makes the row non-finite in every schedule: the chunked schedule's merges read a partial's lse of +inf as
    an infinite logit, never as an empty partial (:func:`mla_bridge.merge.merge_planned_`; the passes mark an empty
    row with -inf).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .checks import not_a_bool, offsets_why_not
from .cache import ChunkRows, check_kv_cache, gather_impl, gather_row_bytes
from . import kv as _kv
from . import switches
from .inference import refuse_autograd
from .kv import KVInputs, chunk_kv, fused_schedule_kv, new_tokens_kv
from .merge import merge_planned_, select_merge
from .plan import PrefillPlan
from .ragged import shares_memory
from .sparse import check_topk_indices, sparse_prefill
from .weights import PreparedKVBProj, as_prepared, prepared_weight_elements, up_projection_weight  # (moved there)

__all__ = [
    "mla_prefill",
    "validate_prefill_inputs",
    "up_projection_weight",
    "prefill_memory_bytes",
    "kernel_choices",
    "ENV_SWITCHES",
]

#: The environment switches of mla_bridge's kernel choices (each read by its own chooser, per call; all of them,
#: with what they do: :data:`mla_bridge.switches.SWITCHES`, listed by ``mla-bridge info``).
ENV_SWITCHES = switches.KERNEL_SWITCHES


def validate_prefill_inputs(
    q,
    kv_c,
    k_pe,
    kv_b_proj_weight,
    kv_cache,
    block_table,
    plan: PrefillPlan,
    out: Optional[torch.Tensor] = None,
    kv_cache_scale=None,
    topk_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Check every :func:`mla_prefill` input against ``plan`` on the host; returns ``k_pe`` as ``[T, rope]``.
    ``kv_b_proj_weight`` may be raw or a :class:`mla_bridge.PreparedKVBProj` (checked for the plan's dims, dtype and
    device by :func:`mla_bridge.weights.as_prepared`).

    Raises:
        TypeError: a non-tensor or a sparse one, or a dtype other than the plan's (block_table: an integer dtype;
            kv_cache: the plan's ``kv_cache_dtype``).
        ValueError: a shape that disagrees with the plan or the dims (the message names the argument and what was
            expected), an ``out`` that overlaps itself (expanded) or shares memory with an input (the weight, raw or
            prepared, included), an input that requires grad while autograd records or carries a forward-mode
            tangent (a ``kv_cache_scale`` tensor and a PreparedKVBProj's weight included; mla_bridge has no
            backward: run under ``torch.no_grad()`` or ``torch.inference_mode()``;
            :func:`mla_bridge.inference.refuse_autograd`), another device, a block_table row too short for its
            context, a context longer than the cache, and the cache-scale rules of
            :func:`mla_bridge.cache.check_kv_cache` (FP8 without ``kv_cache_scale``, a scale with an unquantized
            cache, a non-finite or non-positive scale, fp8_e5m2 / fp8_ds_mla caches); a strided ``q`` that reaches,
            through its strides, past the 32-bit element offsets of a backend of the plan's passes
            (:attr:`mla_bridge.PrefillPlan.offset_limit`); ``topk_indices`` as
            :func:`mla_bridge.sparse.check_topk_indices` refuses them (given with a dense plan, missing with a sparse
            one, a bad dtype or shape, on the CPU a non-causal or out-of-range pick).
    """
    return _checked_inputs(
        q, kv_c, k_pe, kv_b_proj_weight, kv_cache, block_table, plan, out, kv_cache_scale, topk_indices
    )[0]


#: The integer dtypes a block_table may hold: torch has no min/max or indexing kernels for the wider unsigned ones
#: (uint16/32/64) or the sub-byte ones, so those are refused by name instead of failing inside the range check.
_BLOCK_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _checked_inputs(q, kv_c, k_pe, kv_b_proj_weight, kv_cache, block_table, plan, out, kv_cache_scale, topk_indices):
    """:func:`validate_prefill_inputs`, returning ``(k_pe [T, rope], kv_cache, kv_cache_scale)`` with the cache and
    scale as :func:`mla_bridge.cache.check_kv_cache` gives them (the view and the value the kernels read)."""
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan, got {type(plan).__name__}")
    d, t = plan.dims, plan.num_tokens
    prepared = isinstance(kv_b_proj_weight, PreparedKVBProj)
    if prepared:
        as_prepared(kv_b_proj_weight, d, plan.dtype, plan.device)
    named = (("q", q), ("kv_c", kv_c), ("k_pe", k_pe)) + (() if prepared else (("kv_b_proj_weight", kv_b_proj_weight),))
    named += (("kv_cache", kv_cache), ("block_table", block_table)) + ((("out", out),) if out is not None else ())
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
        if x.device != plan.device:
            raise ValueError(f"{name} is on {x.device}, but the plan is on {plan.device}")
        if x.dtype != plan.dtype and name not in ("block_table", "kv_cache"):
            raise TypeError(f"{name} must have dtype {plan.dtype} (the plan's), got {x.dtype}")
    # no backward: a gradient would be lost (on CUDA silently); the scale and a prepared weight's tensor too
    refuse_autograd(
        named
        + ((("kv_b_proj_weight.weight", kv_b_proj_weight.weight),) if prepared else ())
        + (("kv_cache_scale", kv_cache_scale),)
    )
    checked_cache, scale = check_kv_cache(kv_cache, kv_cache_scale, plan.kv_cache_dtype)
    if q.dim() != 3 or q.shape[0] != t:
        raise ValueError(f"q must be [T={t} (qo_indptr[-1]), H, head_dim_qk], got {list(q.shape)}")
    if q.shape[1:] != (d.num_heads, d.head_dim_qk):
        raise ValueError(
            f"q must be [T, H={d.num_heads}, head_dim_qk={d.head_dim_qk}] (qk_nope_head_dim "
            f"{d.qk_nope_head_dim} + qk_rope_head_dim {d.qk_rope_head_dim}), got {list(q.shape)}"
        )
    if not q.is_contiguous():  # the passes were planned for a contiguous q: a strided one must reach no farther
        limit, backend = plan.offset_limit
        reason = None if limit is None else offsets_why_not("q", q, limit, backend)
        if reason is not None:
            raise ValueError(reason)
    if kv_c.shape != (t, d.kv_lora_rank):
        raise ValueError(f"kv_c must be [T={t}, kv_lora_rank={d.kv_lora_rank}], got {list(kv_c.shape)}")
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe.squeeze(1)
    if k_pe.shape != (t, d.qk_rope_head_dim):
        raise ValueError(
            f"k_pe must be [T={t}, qk_rope_head_dim={d.qk_rope_head_dim}] or "
            f"[T, 1, {d.qk_rope_head_dim}], got {list(k_pe.shape)}"
        )
    if not prepared and kv_b_proj_weight.shape != d.kv_b_proj_shape:
        raise ValueError(
            f"kv_b_proj_weight must be [H*(qk_nope_head_dim+v_head_dim), kv_lora_rank] = "
            f"{list(d.kv_b_proj_shape)}, got {list(kv_b_proj_weight.shape)}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[1:] != (plan.block_size, d.latent_dim):
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size={plan.block_size}, "
            f"kv_lora_rank+qk_rope_head_dim={d.latent_dim}], got {list(kv_cache.shape)}"
        )
    if block_table.dtype not in _BLOCK_ID_DTYPES:
        raise TypeError(
            f"block_table must hold integer block ids (int32 / int64, or int8 / int16 / uint8), got {block_table.dtype}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != plan.batch_size:
        raise ValueError(
            f"block_table must be [num_requests={plan.batch_size}, max_blocks], got {list(block_table.shape)}"
        )
    capacity = kv_cache.shape[0] * plan.block_size
    longest = max(plan.context_lens, default=0)  # per layer: the per-request loop (and its messages) only on failure
    ok = longest <= capacity and -(-longest // plan.block_size) <= block_table.shape[1]
    for r, c in enumerate(() if ok else plan.context_lens):
        if c > capacity:
            raise ValueError(
                f"context_lens[{r}] = {c} tokens is longer than the cache ({kv_cache.shape[0]} blocks "
                f"x {plan.block_size})"
            )
        blocks = -(-c // plan.block_size)
        if blocks > block_table.shape[1]:
            raise ValueError(
                f"block_table row {r} has {block_table.shape[1]} blocks, too short for "
                f"context_lens[{r}] = {c} ({blocks} blocks of {plan.block_size})"
            )
    if block_table.device.type == "cpu" and plan.num_context_tokens:
        for r, c in enumerate(plan.context_lens):
            ids = block_table[r, : -(-c // plan.block_size)]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= kv_cache.shape[0]):
                raise ValueError(f"block_table row {r} holds block ids outside [0, {kv_cache.shape[0]})")
    if out is not None and out.shape != plan.out_shapes[0]:
        raise ValueError(f"out must be [T={t}, H={d.num_heads}, v_head_dim={d.v_head_dim}], got {list(out.shape)}")
    if out is not None:
        if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
            raise ValueError(
                f"out must not overlap itself (an expanded view: strides {list(out.stride())}); pass a "
                f"tensor of its own"
            )
        weight = kv_b_proj_weight.weight if prepared else kv_b_proj_weight  # read in place by every pass
        for name, x in (
            ("q", q),
            ("kv_c", kv_c),
            ("k_pe", k_pe),
            ("kv_cache", kv_cache),
            ("block_table", block_table),
            ("kv_b_proj_weight", weight),
        ) + ((("topk_indices", topk_indices),) if isinstance(topk_indices, torch.Tensor) else ()):
            if shares_memory(out, x):
                raise ValueError(
                    f"out shares memory with {name}: mla_prefill reads {name} after it starts writing "
                    f"out (every context chunk reads q, its cache rows and the weight again); pass an "
                    f"out of its own"
                )
    check_topk_indices(topk_indices, plan)
    return k_pe, checked_cache, scale


def kernel_choices(device: torch.device, dtype: torch.dtype, dims, kv_impl: Optional[str] = None) -> dict:
    """What :func:`mla_prefill` will run on ``device`` for ``dtype`` and ``dims`` besides the attention backend
    (:func:`mla_bridge.select_backend`), as the choosers decide now: ``{"kv": "separate" | "fused" | "auto",
    "gather": "triton" | "torch", "merge": "triton" | "flashinfer" | "torch", "triton_launch": "direct" | "jit" |
    None, "flashinfer_direct": bool | None}`` (the gather is that of the separate path; the merge that of ``[rows,
    H, v_head_dim]`` partials; the launch mode that of the Triton kernels, :mod:`mla_bridge.kernels.launch`, None
    where none can run: off CUDA or without Triton; whether fa2/fa3 runs call FlashInfer's ``ragged_run`` directly,
    None where FlashInfer is not installed). For reports (``mla-bridge prefill`` prints it) and to refuse a bad
    environment switch before any work.

    Raises:
        ValueError / TypeError / RuntimeError: what :func:`mla_bridge.kv.kv_impl`,
            :func:`mla_bridge.cache.gather_impl`, :func:`mla_bridge.merge.select_merge`,
            :func:`mla_bridge.switches.triton_launch` and :func:`mla_bridge.switches.flashinfer_direct` raise for
            a switch that cannot serve (the message names it).
    """
    from .kernels import triton_available

    from .dispatch import flashinfer_version

    device = torch.device(device)
    launch = switches.triton_launch()
    direct = switches.flashinfer_direct()  # read (and a bad value refused) even where FlashInfer is missing
    return {
        "kv": _kv.kv_impl(device, kv_impl, dtype),
        "gather": gather_impl(device),
        "merge": select_merge((1, dims.num_heads, dims.v_head_dim), dtype, device.type).name,
        "triton_launch": launch if device.type == "cuda" and triton_available() else None,
        "flashinfer_direct": direct if flashinfer_version() else None,
    }


PhaseHook = Callable[[str], None]


def mla_prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_proj_weight: "torch.Tensor | PreparedKVBProj",
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: PrefillPlan,
    *,
    out: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    phase_hook: Optional[PhaseHook] = None,
    kv_cache_scale=None,
    kv_impl: Optional[str] = None,
    topk_indices: Optional[torch.Tensor] = None,
):
    """MLA prefill attention for one layer: each request's new tokens over its whole sequence (context + new,
    causal among the new tokens).

    Args:
        q: ``[T, H, qk_nope_head_dim + qk_rope_head_dim]`` (192 for DeepSeek; RoPE already applied to the last
            ``qk_rope_head_dim``), ``T = plan.num_tokens``, requests packed in order.
        kv_c: ``[T, kv_lora_rank]`` latent of the new tokens (after the KV RMSNorm).
        k_pe: ``[T, qk_rope_head_dim]`` or ``[T, 1, qk_rope_head_dim]``, the new tokens' RoPE key (shared by heads).
            Any strides (a view of a larger tensor is read in place).
        kv_b_proj_weight: the layer's weight prepared once at load time (:func:`mla_bridge.prepare_kv_b_proj`, the
            fast form), or the raw ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` as stored in DeepSeek
            checkpoints (slower: the fused kernel reads it in place, but a pass that takes the separate path
            rearranges it first, once per call: a copy of the weight per call and layer; :mod:`mla_bridge.weights`).
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` paged latent cache holding each
            request's first ``context_lens[r]`` tokens in the blocks its ``block_table`` row lists; dtype
            ``plan.kv_cache_dtype``: the plan's dtype, or FP8 e4m3 (``float8_e4m3fn`` or its uint8 view). Read
            through its strides (never copied).
        block_table: ``[batch, max_blocks]`` integer block ids. On CUDA their range is not checked on the host (that
            would sync every layer); on the CPU it is.
        plan: the batch's :class:`PrefillPlan` (built once, shared by every layer).
        out: optional destination ``[T, H, v_head_dim]``.
        return_lse: also return the LSE ``[T, H]`` float32, natural log.
        phase_hook: for profiling: called with "gather", "up-projection", "main pass", "context chunk", "merge" as
            each phase starts and "end" after the last (the CLI and the benchmark time phases with it). Where the
            fused kernel builds k and v (:func:`mla_bridge.kv.kv_impl`), the gather runs inside "up-projection" and
            no "gather" phase is reported.
        kv_cache_scale: the FP8 cache's per-tensor scale (required for FP8, refused otherwise): a Python float or a
            0-d/1-element float32 tensor on the cache's device (vLLM's ``layer._k_scale``; read on the device, no
            host sync). Context rows are dequantized into the plan's dtype where they are read (the gather of
            :mod:`mla_bridge.cache`, or the fused kernel's A tiles).
        kv_impl: how each pass's k and v are built: ``"separate"`` (gather, then the cuBLAS GEMM), ``"fused"`` (one
            Triton launch per pass, CUDA only) or ``"auto"`` (per pass, :func:`mla_bridge.kv.pass_impl`: the fused
            kernel for the smaller passes, the separate path for the others; inside :func:`mla_bridge.kv.capture_rule`,
            as in the captures of :mod:`mla_bridge.graphs`, the GPU-faster path of each pass; the default on CUDA with
            Triton, "separate" elsewhere); ``None`` = :func:`mla_bridge.kv.kv_impl` (the ``MLA_BRIDGE_KV`` environment
            variable, else the default). Checked, not read, by the sparse pass.
        topk_indices: DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): int32 ``[T, plan.index_topk]``, the keys of
            each new token as positions in its request's sequence (context first, then the new tokens), -1 for none;
            required with a plan built with ``index_topk``, refused otherwise. Each token then attends only its picks
            (:mod:`mla_bridge.sparse`: the contract, the absorbed form; a Triton kernel on CUDA, the torch path
            elsewhere, chosen by :func:`mla_bridge.sparse.select_sparse`). ``phase_hook`` then sees "sparse
            attention" and "end".

    Returns:
        ``out [T, H, v_head_dim]`` in the plan's dtype, or ``(out, lse)`` with ``return_lse=True``. Which rows a NaN or
        infinity in one token's input reaches, per backend: the module docstring ("Non-finite inputs").

    Precision (fp16/bf16): each pass's kernel rounds its partial out to the plan's dtype; a row merged more than
    once (its request's context split over chunks) is carried in float32 between its merges and rounded once, by
    its last merge (:attr:`mla_bridge.PrefillPlan.merge_steps`), so the error does not grow with the number of
    chunks. The LSE is float32 throughout.

    Raises:
        TypeError / ValueError: see :func:`validate_prefill_inputs`; an unknown ``kv_impl``, or an environment
            switch (``MLA_BRIDGE_KV`` / ``MLA_BRIDGE_GATHER`` / ``MLA_BRIDGE_MERGE`` / ``MLA_BRIDGE_TRITON_LAUNCH`` /
            ``MLA_BRIDGE_FLASHINFER_DIRECT``; ``MLA_BRIDGE_SPARSE`` with ``topk_indices``) that cannot serve here; a ``return_lse`` that is not a bool, a
            ``phase_hook`` that is not callable; raised before any kernel runs.
    """
    if not isinstance(return_lse, bool):
        raise not_a_bool("return_lse", return_lse)
    if phase_hook is not None and not callable(phase_hook):
        raise TypeError(
            f"phase_hook must be callable (called with each phase's name) or None, got {type(phase_hook).__name__}"
        )
    k_pe, kv_cache, scale = _checked_inputs(
        q, kv_c, k_pe, kv_b_proj_weight, kv_cache, block_table, plan, out, kv_cache_scale, topk_indices
    )
    impl = _kv.kv_impl(plan.device, kv_impl, plan.dtype)
    if topk_indices is not None:  # a sparse plan (checked): the sparse pass, its own module
        return sparse_prefill(
            q,
            kv_c,
            k_pe,
            as_prepared(kv_b_proj_weight, plan.dims, plan.dtype, plan.device),
            kv_cache,
            block_table,
            plan,
            topk_indices,
            out=out,
            return_lse=return_lse,
            kv_cache_scale=scale,
            gather=gather_impl(plan.device) if plan.num_context_tokens else None,
            hook=phase_hook,
        )
    # the other kernels of this call, chosen once, now: an environment switch that cannot serve is refused here,
    # before anything is allocated or written (not after the main pass has written out); the gather choice is
    # handed to every pass
    gather = gather_impl(plan.device) if plan.num_context_tokens and impl != "fused" else None
    merge = (
        select_merge((1, plan.dims.num_heads, plan.dims.v_head_dim), plan.dtype, plan.device.type)
        if plan.chunks
        else None
    )
    switches.triton_launch()  # MLA_BRIDGE_TRITON_LAUNCH, read by each Triton launch: refused here if it cannot serve
    switches.flashinfer_direct()  # MLA_BRIDGE_FLASHINFER_DIRECT, read at a plan's first run
    hook = phase_hook if phase_hook is not None else (lambda name: None)
    dims = plan.dims
    out_shape, lse_shape = plan.out_shapes
    if out is None:
        out = torch.empty(out_shape, dtype=plan.dtype, device=plan.device)
    # the LSE only where it is returned or merged into (no buffer, no kernel writing it, no base conversion)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=plan.device) if return_lse or plan.partial_rows else None

    plan.order_on_current_stream()  # index tensors and schedules were queued at plan time, maybe on another stream
    weight = as_prepared(kv_b_proj_weight, dims, plan.dtype, plan.device)  # a raw weight: taken as it is (no copy)
    inputs = KVInputs(
        weight, kv_c, k_pe, kv_cache, block_table, kv_cache_scale=scale, hook=hook, impl=impl, gather=gather
    )
    k, v = fused_schedule_kv(plan, inputs) if plan.fused else new_tokens_kv(inputs)
    hook("main pass")
    plan.main.run(q, k, v, out=out, lse=lse, return_lse=lse is not None)
    # One partial out / lse for every merge round (plan.chunks' part_row / merge_rows): the chunks of a round write
    # their rows of it, then one merge reads it, before the next round's first pass writes it again (one stream).
    # A row merged more than once (its request's context split over chunks) is carried between its merges in a
    # float32 running out (plan.merge_steps), rounded to the plan's dtype once, by its last merge, so that the error
    # does not grow with the number of chunks; plans whose rows are each merged once have none.
    part_out = part_lse = running = None
    steps = plan.merge_steps if plan.running_rows else None
    for i, chunk in enumerate(plan.chunks):
        if chunk.plan is None:
            continue
        del k, v  # free the previous pass's buffers before this chunk allocates its own
        k, v = chunk_kv(chunk, inputs)
        hook("context chunk")
        if part_out is None:
            n = plan.partial_rows
            part_out = torch.empty(n, dims.num_heads, dims.v_head_dim, dtype=plan.dtype, device=plan.device)
            part_lse = torch.empty(n, dims.num_heads, dtype=torch.float32, device=plan.device)
            if steps is not None:
                running = torch.empty(
                    plan.running_rows, dims.num_heads, dims.v_head_dim, dtype=torch.float32, device=plan.device
                )
        assert part_lse is not None  # made with part_out
        part = slice(chunk.part_row, chunk.part_row + chunk.q_end - chunk.q_start)
        chunk.plan.run(
            q[chunk.q_start : chunk.q_end], k, v, out=part_out[part], lse=part_lse[part], lse_base="log2"
        )  # FlashInfer's base 2, unconverted
        if chunk.merge_rows is not None:
            hook("merge")
            # merge: plan.chunks is non-empty; lse: partial_rows > 0 where a chunk merges (its rows are not empty)
            assert merge is not None and lse is not None
            start, stop = chunk.merge_rows
            if steps is None:
                merge_planned_(
                    merge,
                    out[start:stop],
                    lse[start:stop],
                    part_out[: stop - start],
                    part_lse[: stop - start],
                    lse_b_base="log2",
                )  # converted as read
                continue
            assert running is not None  # made with the partials wherever steps is
            for a, b, src, dst in steps[i]:
                p, n = a - start, b - a
                merge_planned_(
                    merge,
                    out[a:b] if src is None else running[src : src + n],
                    lse[a:b],
                    part_out[p : p + n],
                    part_lse[p : p + n],
                    lse_b_base="log2",
                    dst=None if src is None and dst is None else out[a:b] if dst is None else running[dst : dst + n],
                )
    hook("end")
    return (out, lse) if return_lse else out


def prefill_memory_bytes(plan: PrefillPlan, *, prepared_weight: bool = False) -> int:
    """Bytes of device memory one :func:`mla_prefill` call allocates at its peak (out and lse included), by schedule.

    With ``e`` the dtype's size, ``L = kv_lora_rank + qk_rope_head_dim`` (576), ``P = head_dim_qk + head_dim_vo``
    (320) and ``H`` heads, a pass over ``N`` key tokens holds the latent rows (``N x L x e``, plus the gathered copy
    of its context rows; the new tokens' pass of the chunked schedule stages none, so this over-counts it) and the
    buffer holding k and v (``N x H x P x e``). Always held: the prepared
    weight (:func:`mla_bridge.weights.prepared_weight_elements` of the default layout, times ``e``), out (``T x H x
    v_head_dim x e``) and lse (``T x H x 4``; allocated only with ``return_lse`` or context chunks, counted always: an
    upper bound). The fused schedule has one pass over context + new tokens; the
    chunked one frees each pass before the next, and from its first chunk on holds one partial out/lse for the most
    query rows of any merge round (``plan.partial_rows``, at most T, reused by every round) plus the merge's float32
    LSE copies for those rows (FlashInfer's merge makes them; the Triton merge makes none), and a float32 running
    out of ``plan.running_rows x H x v_head_dim x 4`` bytes for the rows merged more than once (0 where every row is
    merged once, and for float32 plans: :attr:`mla_bridge.PrefillPlan.merge_steps`). The gather's temporaries
    per context row are :func:`mla_bridge.cache.gather_row_bytes` for the plan's cache dtype (the torch path's: the
    rows in the cache's dtype, for FP8 also their float32 dequantization and rounded copy, and 24 bytes of indices;
    the Triton gather allocates none of them, so the formula is an upper bound there; on CUDA the torch path of a
    context chunk also makes the chunk's per-token indices, :data:`mla_bridge.cache.ChunkRows.INDEX_BYTES` per row,
    counted too). The device memory the plan's FlashInfer plans hold (:attr:`mla_bridge.PrefillPlan.flashinfer_bytes`:
    int workspaces sized to each pass's schedule, indptr copies, cutlass's work-index buffers) is counted too: the call
    needs it alive (0 for the torch backend). The cache itself (``num_blocks x
    block_size x L`` bytes of its dtype: 1 for FP8) is the caller's, not counted. This is the "workspace budget" the
    benchmark checks peak memory against. With ``prepared_weight=True`` (the call is handed a
    :class:`mla_bridge.PreparedKVBProj`) the weight is held by the caller, not allocated by the call, and is left
    out; that holds for :func:`mla_bridge.prepare_kv_b_proj`'s layouts, not for a raw weight wrapped by
    :func:`mla_bridge.weights.as_prepared` (checkpoint layout: a pass on the separate path still makes the split copy
    in the call), for which ``prepared_weight=False`` is the bound.

    Raises:
        TypeError: ``plan`` not a PrefillPlan, ``prepared_weight`` not a bool.
        ValueError: a plan built with ``index_topk`` (the sparse pass's memory is bounded per chunk of queries, as
            :mod:`mla_bridge.sparse` says; this formula is the dense passes').
    """
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan, got {type(plan).__name__}")
    if plan.index_topk is not None:
        raise ValueError(
            f"prefill_memory_bytes counts the dense passes; the plan was built with index_topk={plan.index_topk} "
            f"for the sparse pass, whose memory is bounded per chunk of queries (mla_bridge.sparse)"
        )
    if not isinstance(prepared_weight, bool):
        raise not_a_bool("prepared_weight", prepared_weight)
    d = plan.dims
    e = torch.empty((), dtype=plan.dtype).element_size()
    lat, p, h, t = d.latent_dim, d.head_dim_qk + d.head_dim_vo, d.num_heads, plan.num_tokens
    fixed = (0 if prepared_weight else prepared_weight_elements(d) * e) + t * h * (d.v_head_dim * e + 4)
    fixed += plan.flashinfer_bytes[0]  # held by the plan's FlashInfer plans while the call runs

    row = gather_row_bytes(plan.kv_cache_dtype, plan.dtype, lat)

    def one_pass(keys: int, gathered: int, indices: int = 0) -> int:
        return keys * lat * e + gathered * (row + indices) + keys * h * p * e

    if plan.fused:
        return fixed + one_pass(int(plan.main_kv_indptr[-1]), plan.num_gathered_context_tokens)
    peak = one_pass(t, 0)
    # allocated at the first chunk, held to the end: the partial out / lse, and the float32 running rows
    partials = plan.partial_rows * h * (d.v_head_dim * e + 4 + 8) + plan.running_rows * h * d.v_head_dim * 4
    for c in plan.chunks:
        if c.plan is not None:  # a CUDA chunk's torch gather makes its per-token indices in the call
            extra = ChunkRows.INDEX_BYTES if c.rows.indices is None else 0
            peak = max(peak, one_pass(c.num_tokens, c.num_tokens, extra) + partials)
    return fixed + peak
