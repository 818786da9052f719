"""The keys and values of each attention pass of :func:`mla_bridge.mla_prefill`, built from latent rows.

A pass reads ``k = [k_nope | k_pe]`` ``[N, H, qk_nope_head_dim + qk_rope_head_dim]`` and ``v`` ``[N, H, v_head_dim]``
for its N key tokens: context rows read from the paged cache through ``block_table`` (dequantized when the cache is
FP8), and, in the fused schedule or the chunked schedule's main pass, the new tokens' own ``kv_c`` / ``k_pe``. Two
implementations, chosen in ONE place (:func:`kv_impl`):

* ``"separate"`` (the default): the latent rows are gathered into a buffer (:mod:`mla_bridge.cache`; Triton or torch,
  chosen by :func:`mla_bridge.cache.gather_impl`), then up-projected by the prepared weight's GEMM
  (:meth:`mla_bridge.PreparedKVBProj.up_project`, cuBLAS on CUDA).
* ``"fused"`` (opt-in, CUDA): one Triton launch per pass (:mod:`mla_bridge.kernels.up_project`): a GEMM whose A rows
  are gathered (and dequantized) as they are loaded and whose epilogue writes k (with the k_pe broadcast) and v in
  place; no latent rows staged in memory and no GEMM FLOPs on the identity layout's padding. Why it is not the
  default: :func:`kv_impl`.

Both give k and v as strided views of one ``[N, H, 320]`` buffer. The k_pe columns are equal between them (the
identity layout's GEMM writes +0.0 where the kernel copies a -0.0);
k_nope and v are equal within the dtype's rounding of a float32 sum taken in another order (both sum the same
``kv_lora_rank`` products in float32; :mod:`mla_bridge.kernels.up_project`).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from .cache import fused_latent, gather_latent
from .weights import PreparedKVBProj

__all__ = ["kv_impl", "KV_IMPLS", "fused_schedule_kv", "new_tokens_kv", "chunk_kv"]

#: The implementations :func:`kv_impl` chooses from (module docstring).
KV_IMPLS = ("fused", "separate")

Hook = Callable[[str], None]


def kv_impl(device: torch.device, requested: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> str:
    """The ONE place choosing how a pass's k and v are built.

    ``requested`` (``mla_prefill(kv_impl=)``), else ``MLA_BRIDGE_KV``, else the default: ``"separate"`` (``"auto"``
    names the default too; both are read case-insensitively). The fused kernel is opt-in because it is not faster
    where it matters, measured on the H200 (2026-12-01, bf16, DeepSeek-V2-Lite dims): its Triton GEMM reaches about
    400 TFLOP/s where cuBLAS reaches about 580, which costs more than the gather round trip it saves on long passes
    (40000 keys, 80% of them gathered: 0.44 against 0.43 ms; 8192 new tokens: 0.16 against 0.10 ms; an FP8 cache
    dequantized in every program: a 10% slower layer); it wins only on short gathered passes (4096 keys: 0.117
    against 0.136 ms). ``"fused"`` off CUDA runs only under ``TRITON_INTERPRET=1``, for development, and not in
    bfloat16 (``dtype``): the interpreter's bfloat16 ``tl.dot`` is wrong (Triton 3.9), so it is refused there.

    Raises:
        ValueError: ``requested`` or ``MLA_BRIDGE_KV`` other than :data:`KV_IMPLS` or "auto" (the message lists
            them); "fused" where Triton does not import, off CUDA without ``TRITON_INTERPRET=1``, or interpreted in
            bfloat16.
        TypeError: ``requested`` not a string.
    """
    if requested is not None and not isinstance(requested, str):
        raise TypeError(f"kv_impl must be a string ({', '.join(KV_IMPLS)} or 'auto') or None, got "
                        f"{type(requested).__name__}")
    where = "kv_impl" if requested is not None else "MLA_BRIDGE_KV"
    raw = requested if requested is not None else os.environ.get("MLA_BRIDGE_KV", "")
    choice = raw.strip().lower()
    if requested is None and choice in ("", "auto"):
        return "separate"
    if choice == "auto":
        return "separate"
    if choice not in KV_IMPLS:
        raise ValueError(f"{where} must be one of {KV_IMPLS} or 'auto', got {raw!r}")
    if choice == "fused":
        from .kernels import triton_available
        on_cpu = torch.device(device).type != "cuda"
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{where} 'fused' runs a Triton kernel: it needs a CUDA device, got {device} "
                             f"(TRITON_INTERPRET=1 runs it on the CPU, for development)")
        if not triton_available():
            raise ValueError(f"{where} 'fused' needs Triton, which does not import here; use 'separate'")
        if on_cpu and dtype == torch.bfloat16:
            raise ValueError(f"{where} 'fused' under TRITON_INTERPRET=1 cannot run bfloat16 (the interpreter's "
                             f"bfloat16 tl.dot is wrong); use float16 or float32 on the CPU")
    return choice


def _kv_buffer(n: int, weight: PreparedKVBProj, dtype: torch.dtype, device: torch.device):
    d = weight.dims
    out = torch.empty(n, d.num_heads, d.head_dim_qk + d.v_head_dim, dtype=dtype, device=device)
    return out, out[..., : d.head_dim_qk], out[..., d.head_dim_qk:]


def fused_schedule_kv(plan, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      kv_cache_scale, weight: PreparedKVBProj, hook: Hook, impl: Optional[str] = None,
                      gather: Optional[str] = None):
    """k, v of the fused schedule's one pass: ``main_kv_indptr[-1]`` keys, each request's context rows (placed by
    ``plan.ctx_dst``) followed by its new tokens (``plan.new_dst``). ``kv_cache`` / ``kv_cache_scale`` as checked by
    :func:`mla_bridge.cache.check_kv_cache`; ``k_pe`` ``[T, rope]``. Calls ``hook("gather")`` before a separate gather
    and ``hook("up-projection")`` before the GEMM (the fused kernel is one "up-projection" phase). ``impl`` /
    ``gather``: the choices of :func:`kv_impl` / :func:`mla_bridge.cache.gather_impl`, when the caller made them."""
    if (impl or kv_impl(plan.device)) == "fused":
        hook("up-projection")
        from .kernels.up_project import up_project_triton
        out, k, v = _kv_buffer(int(plan.main_kv_indptr[-1]), weight, plan.dtype, plan.device)
        up_project_triton(out, weight, kv_cache=kv_cache, block_table=block_table, req_ids=plan.ctx_req_ids,
                          positions=plan.ctx_positions, ctx_dst=plan.ctx_dst, kv_c=kv_c, k_pe=k_pe,
                          new_dst=plan.new_dst, kv_cache_scale=kv_cache_scale)
        return k, v
    hook("gather")
    latent = fused_latent(plan, kv_c, k_pe, kv_cache, block_table, kv_cache_scale, impl=gather)
    hook("up-projection")
    return weight.up_project(latent)


def new_tokens_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, weight: PreparedKVBProj, hook: Hook,
                  impl: Optional[str] = None):
    """k, v of the new tokens alone (the chunked schedule's main pass): ``kv_c`` ``[T, rank]``, ``k_pe`` ``[T, rope]``.
    Hooks as :func:`fused_schedule_kv` (the separate path's "gather" is the concatenation of kv_c and k_pe)."""
    if (impl or kv_impl(kv_c.device)) == "fused":
        hook("up-projection")
        from .kernels.up_project import up_project_triton
        out, k, v = _kv_buffer(kv_c.shape[0], weight, kv_c.dtype, kv_c.device)
        up_project_triton(out, weight, kv_c=kv_c, k_pe=k_pe)
        return k, v
    hook("gather")
    latent = torch.cat([kv_c, k_pe], dim=-1)
    hook("up-projection")
    return weight.up_project(latent)


def chunk_kv(chunk, kv_cache: torch.Tensor, block_table: torch.Tensor, kv_cache_scale, weight: PreparedKVBProj,
             dtype: torch.dtype, hook: Hook, impl: Optional[str] = None, gather: Optional[str] = None):
    """k, v of one context chunk (:class:`mla_bridge.plan.ContextChunk`): its ``chunk.num_tokens`` context rows
    ``(chunk.req_ids[i], chunk.positions[i])`` in order. Hooks as :func:`fused_schedule_kv`."""
    if (impl or kv_impl(kv_cache.device)) == "fused":
        hook("up-projection")
        from .kernels.up_project import up_project_triton
        out, k, v = _kv_buffer(chunk.req_ids.shape[0], weight, dtype, kv_cache.device)
        up_project_triton(out, weight, kv_cache=kv_cache, block_table=block_table, req_ids=chunk.req_ids,
                          positions=chunk.positions, kv_cache_scale=kv_cache_scale)
        return k, v
    hook("gather")
    latent = gather_latent(kv_cache, block_table, chunk.req_ids, chunk.positions, dtype=dtype,
                           kv_cache_scale=kv_cache_scale, impl=gather)
    hook("up-projection")
    return weight.up_project(latent)
