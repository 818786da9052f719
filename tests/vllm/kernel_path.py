"""The adapter's kernel path without vLLM: the calls ``MLABridgePrefillBackend`` makes, on vLLM-shaped inputs.

Imports neither vLLM nor its test harness, so it runs where vLLM is not installed (the H200, the core CI).

* :func:`chunk_layout` packs contexts into workspace-sized chunks the way vLLM >= 0.28 does
  (``plan_mla_context_chunks``, no decode context parallelism): requests in order, a request split only at a block
  boundary, a request without context closing the chunk. ``test_vllm_forward`` checks it against vLLM's own builder.
* :func:`run_like_vllm` plans a :class:`mla_bridge_vllm.plans.PrefillStepPlans` from the host indptrs the adapter
  derives (new-token offsets; each chunk's ``seq_lens``), then drives it as ``forward_mha`` does: q/k/v shaped and
  strided as vLLM hands them (k a fresh concat of k_nope and the broadcast k_pe, v a view into the up-projected
  ``[S, H, 256]`` buffer, q of a chunk a row slice), the chunks' partials folded as ``accumulate_mla_context_chunk``
  folds them, and the final merge as vLLM's ``merge_attn_states`` (its torch form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mla_bridge_vllm.plans import ChunkIndptrs, PrefillStepPlans, host_indptr_from_lens, vllm_strides

RANK, NOPE, ROPE, VDIM = 512, 128, 64, 128


@dataclass(frozen=True)
class Chunk:
    """One context chunk, as vLLM's ``ContextChunk`` describes it (host values only)."""

    index: int
    request_slice: slice
    starts: tuple[int, ...]  # per request, the context offset the chunk starts at
    seq_lens: tuple[int, ...]  # per request, context tokens in the chunk

    @property
    def is_continuation(self) -> bool:
        return self.starts[0] > 0


def chunk_layout(context_lens: Sequence[int], workspace_tokens: int, block_size: int) -> list[Chunk]:
    """vLLM's packing of contexts into chunks of at most ``workspace_tokens`` (see the module docstring)."""
    max_chunk = workspace_tokens // block_size * block_size
    chunks: list[Chunk] = []
    r, start = 0, 0
    while r < len(context_lens):
        if context_lens[r] == 0:
            r += 1
            continue
        first, starts, lens, used = r, [], [], 0
        while r < len(context_lens) and context_lens[r] > 0:
            remaining = context_lens[r] - start
            if used + remaining > workspace_tokens:
                # split at a block boundary, leaving at least one token for the next chunk
                split = min(
                    max_chunk,
                    (remaining - 1) // block_size * block_size,
                    (workspace_tokens - used) // block_size * block_size,
                )
                if split > 0:
                    starts.append(start)
                    lens.append(split)
                    start += split
                break
            starts.append(start)
            lens.append(remaining)
            used += remaining
            r, start = r + 1, 0
        chunks.append(Chunk(len(chunks), slice(first, first + len(lens)), tuple(starts), tuple(lens)))
    return chunks


@dataclass
class MLAInputs:
    """New tokens' q / kv_c / k_pe, kv_b_proj's weight and each request's context latents (unpaged: the gather from
    the paged cache is vLLM's, not the adapter's)."""

    query_lens: list[int]
    context_lens: list[int]
    heads: int
    q: torch.Tensor  # [T, H, 192]
    kv_c: torch.Tensor  # [T, 512]
    k_pe: torch.Tensor  # [T, 1, 64]
    w: torch.Tensor  # [H * 256, 512]
    context: list  # per request [context_len, 576]


def make_inputs(query_lens, context_lens, heads, dtype, device, seed=0) -> MLAInputs:
    g = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    cast = lambda x: x.to(dtype=dtype, device=device)  # noqa: E731
    return MLAInputs(
        list(query_lens),
        list(context_lens),
        heads,
        q=cast(torch.randn(t, heads, NOPE + ROPE, generator=g)),
        kv_c=cast(torch.randn(t, RANK, generator=g)),
        k_pe=cast(torch.randn(t, 1, ROPE, generator=g)),
        w=cast(torch.randn(heads * (NOPE + VDIM), RANK, generator=g) * RANK**-0.5),
        context=[cast(torch.randn(c, RANK + ROPE, generator=g)) for c in context_lens],
    )


def up_project(x: MLAInputs, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward_mha``'s k/v: ``kv_b_proj`` then ``_concat_k_nope_k_pe`` (k contiguous [S,H,192]; v a strided view)."""
    kv_nope = (kv_c @ x.w.t()).view(-1, x.heads, NOPE + VDIM)
    k_nope, v = kv_nope.split([NOPE, VDIM], dim=-1)
    k = torch.empty(*k_nope.shape[:-1], NOPE + ROPE, dtype=k_nope.dtype, device=k_nope.device)
    k[..., :NOPE] = k_nope
    k[..., NOPE:] = k_pe
    return k, v


def merge_like_vllm(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None):
    """vLLM's ``merge_attn_states`` (torch form; lse natural log ``[H, T]``; +inf read as empty)."""
    fix = lambda s: torch.where(torch.isinf(s) & (s > 0), torch.full_like(s, float("-inf")), s).float()  # noqa: E731
    p, s = fix(prefix_lse), fix(suffix_lse)
    m = torch.maximum(p, s)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    pe, se = torch.exp(p - m_safe), torch.exp(s - m_safe)
    tot = pe + se
    empty = tot == 0
    tot_safe = torch.where(empty, torch.ones_like(tot), tot)
    merged = prefix_output.float() * (pe / tot_safe).t().unsqueeze(-1) + suffix_output.float() * (
        se / tot_safe
    ).t().unsqueeze(-1)
    output.copy_(merged.masked_fill(empty.t().unsqueeze(-1), 0.0).to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.where(empty, torch.full_like(m, float("-inf")), torch.log(tot_safe) + m_safe))


@dataclass
class KernelPathResult:
    out: torch.Tensor  # final [T, H, 128]
    passes: list  # (name, out, lse [H, T]) of every call, in call order
    plans: PrefillStepPlans


def run_like_vllm(
    x: MLAInputs, chunks: Sequence[Chunk], sm_scale: float, backend: Optional[str] = None, workspace=None
) -> KernelPathResult:
    """The adapter's calls for one layer of one step, driven as vLLM's ``forward_mha`` drives them."""
    device, dtype, h = x.q.device, x.q.dtype, x.heads
    qo = host_indptr_from_lens(torch.tensor(x.query_lens))  # = host_indptr_from_lens(query_lens_cpu)
    plans = PrefillStepPlans(
        qo,
        [
            ChunkIndptrs(
                c.index,
                qo[c.request_slice.start : c.request_slice.stop + 1] - qo[c.request_slice.start],
                host_indptr_from_lens(torch.tensor(c.seq_lens)),
            )
            for c in chunks
        ],
        num_heads=h,
        head_dim_qk=NOPE + ROPE,
        head_dim_vo=VDIM,
        sm_scale=sm_scale,
        dtype=dtype,
        device=device,
        workspace=workspace,
        backend=backend,
        strides=vllm_strides(h, NOPE, VDIM),
    )  # as the backend plans
    passes = []
    k, v = up_project(x, x.kv_c, x.k_pe)
    has_context = bool(chunks)
    res = plans.run_new_tokens(x.q, k, v, return_softmax_lse=has_context)
    suffix_out, suffix_lse = res if has_context else (res, None)
    passes.append(("new", suffix_out, suffix_lse))
    if not has_context:
        return KernelPathResult(suffix_out, passes, plans)

    t = x.q.shape[0]
    qo_list = qo.tolist()
    ctx_out = torch.zeros(t, h, VDIM, dtype=dtype, device=device)  # requests without context: out 0, lse -inf
    ctx_lse = torch.full((h, t), float("-inf"), dtype=torch.float32, device=device)
    for c in chunks:
        r0, r1 = c.request_slice.start, c.request_slice.stop
        latent = torch.cat([x.context[r][s : s + n] for r, s, n in zip(range(r0, r1), c.starts, c.seq_lens)])
        ck, cv = up_project(x, latent[:, :RANK], latent[:, RANK:].unsqueeze(1))
        tok0, tok1 = qo_list[r0], qo_list[r1]
        out, lse = plans.run_context_chunk(c.index, x.q[tok0:tok1], ck, cv)
        passes.append((f"chunk{c.index}", out, lse))
        init = tok0
        if c.is_continuation:  # accumulate_mla_context_chunk: the first request's rows merge, the rest are set
            init = qo_list[r0 + 1]
            merge_like_vllm(
                ctx_out[tok0:init],
                ctx_out[tok0:init],
                ctx_lse[:, tok0:init],
                out[: init - tok0],
                lse[:, : init - tok0],
                output_lse=ctx_lse[:, tok0:init],
            )
        ctx_out[init:tok1] = out[init - tok0 :]
        ctx_lse[:, init:tok1] = lse[:, init - tok0 :]
    final = torch.empty(t, h, VDIM, dtype=dtype, device=device)
    merge_like_vllm(final, ctx_out, ctx_lse, suffix_out, suffix_lse)
    return KernelPathResult(final, passes, plans)


def reference(x: MLAInputs, sm_scale: float) -> torch.Tensor:
    """Full-sequence attention in float64 (context all visible, new tokens causal), on the inputs' device."""
    w = x.w.double()
    out = torch.zeros(x.q.shape[0], x.heads, VDIM, dtype=torch.float64, device=x.q.device)
    start = 0
    for n, c, ctx in zip(x.query_lens, x.context_lens, x.context):
        if n == 0:
            continue
        latent = torch.cat([ctx, torch.cat([x.kv_c[start : start + n], x.k_pe[start : start + n, 0]], -1)]).double()
        kv = (latent[:, :RANK] @ w.t()).view(-1, x.heads, NOPE + VDIM)
        k = torch.cat([kv[..., :NOPE], latent[:, RANK:].unsqueeze(1).expand(-1, x.heads, -1)], -1)
        mask = torch.ones(n, c + n, dtype=torch.bool, device=x.q.device)
        mask[:, c:] = torch.ones(n, n, dtype=torch.bool, device=x.q.device).tril()
        o = torch.nn.functional.scaled_dot_product_attention(
            x.q[start : start + n].double().transpose(0, 1),
            k.transpose(0, 1),
            kv[..., NOPE:].transpose(0, 1),
            attn_mask=mask,
            scale=sm_scale,
        )
        out[start : start + n] = o.transpose(0, 1)
        start += n
    return out
