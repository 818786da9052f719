"""Shared parity inputs: fixed seeds, framework-neutral (numpy float32), for every adapter's parity test.

Nothing here imports JAX or vLLM. Each case builds float32 numpy arrays from its own seed; a test casts them to the
dtype under test in its framework (float32 -> bf16 rounds to nearest even in torch, JAX and numpy alike, so every
framework sees the same bits). Use :func:`to_torch` for the torch side.

* :data:`RAGGED_CASES` -- ragged attention (q/k/v + indptrs): causal and non-causal, lengths 0 and 1, key lengths
  longer and shorter than query lengths, 16 and 128 heads (128-head cases are small in tokens).
* :data:`PREFILL_CASES` -- MLA prefill (q, kv_c, k_pe, kv_b_proj weight, paged latent cache, block table) with
  context: fused (context fits one chunk) and chunked (``chunk_tokens`` smaller than the context, a request split
  across chunks, a request with no context), 16 and 128 heads. Unused cache blocks are NaN and block-table padding is
  -1, so reading anything but the context shows up.
* :data:`TOLERANCES` -- against a float32 reference: out 2e-2 / lse 1e-2 (bf16), 1e-5 / 1e-5 (float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = [
    "RaggedCase",
    "PrefillCase",
    "RAGGED_CASES",
    "PREFILL_CASES",
    "DTYPES",
    "TOLERANCES",
    "ragged_inputs",
    "prefill_inputs",
    "cumsum0",
    "to_torch",
    "HEAD_DIM_QK",
    "HEAD_DIM_VO",
]

HEAD_DIM_QK, HEAD_DIM_VO = 192, 128  # DeepSeek MLA prefill (qk_nope 128 + rope 64; v 128)
DTYPES = ("bfloat16", "float32")
TOLERANCES = {"bfloat16": {"out": 2e-2, "lse": 1e-2}, "float32": {"out": 1e-5, "lse": 1e-5}}


def cumsum0(lens) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


@dataclass(frozen=True)
class RaggedCase:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    heads: int
    causal: bool
    seed: int

    @property
    def qo_indptr(self) -> list[int]:
        return cumsum0(self.q_lens)

    @property
    def kv_indptr(self) -> list[int]:
        return cumsum0(self.kv_lens)

    @property
    def sm_scale(self) -> float:
        return HEAD_DIM_QK**-0.5

    def __str__(self) -> str:
        return self.name


RAGGED_CASES: tuple[RaggedCase, ...] = (
    RaggedCase("causal_mixed_h16", (3, 0, 1, 5, 1), (3, 0, 1, 5, 1), 16, True, 101),
    RaggedCase("causal_kv_longer_h16", (2, 3, 1), (6, 3, 4), 16, True, 102),
    RaggedCase("causal_q_longer_h16", (4, 2), (2, 2), 16, True, 103),  # first rows of request 0 see no key
    RaggedCase("noncausal_empty_rows_h16", (1, 0, 2, 4), (5, 3, 0, 7), 16, False, 104),
    RaggedCase("single_token_h16", (1,), (1,), 16, True, 105),
    RaggedCase("causal_mixed_h128", (2, 1, 0, 3), (3, 1, 2, 3), 128, True, 106),
    RaggedCase("noncausal_h128", (1, 2), (4, 0), 128, False, 107),
)


def ragged_inputs(case: RaggedCase) -> dict:
    """``q [T,H,192]``, ``k [S,H,192]``, ``v [S,H,128]`` float32 numpy (seeded by the case), plus the indptrs."""
    rng = np.random.default_rng(case.seed)
    t, s = sum(case.q_lens), sum(case.kv_lens)
    return dict(
        q=rng.standard_normal((t, case.heads, HEAD_DIM_QK), dtype=np.float32),
        k=rng.standard_normal((s, case.heads, HEAD_DIM_QK), dtype=np.float32),
        v=rng.standard_normal((s, case.heads, HEAD_DIM_VO), dtype=np.float32),
        qo_indptr=case.qo_indptr,
        kv_indptr=case.kv_indptr,
    )


@dataclass(frozen=True)
class PrefillCase:
    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    heads: int
    block_size: int
    chunk_tokens: int  # Workspace(chunk_tokens=...): smaller than the total context -> chunked schedule
    seed: int
    spare_blocks: int = 2

    @property
    def fused(self) -> bool:
        return 0 < sum(self.context_lens) <= self.chunk_tokens

    def __str__(self) -> str:
        return self.name


PREFILL_CASES: tuple[PrefillCase, ...] = (
    PrefillCase("fused_h16", (3, 0, 2, 1), (5, 4, 0, 9), 16, 4, 1024, 201),
    PrefillCase("chunked_h16", (3, 0, 2, 1), (5, 4, 0, 9), 16, 4, 8, 202),
    PrefillCase("no_context_h16", (4, 1, 0), (0, 0, 0), 16, 4, 1024, 203),
    PrefillCase("chunked_h128", (2, 1), (7, 3), 128, 4, 4, 204),
)


def prefill_inputs(
    case: PrefillCase,
    *,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    qk_nope_head_dim: int = 128,
    v_head_dim: int = 128,
) -> dict:
    """New tokens' ``q [T,H,192]``, ``kv_c [T,512]``, ``k_pe [T,64]``, ``kv_b_proj_weight [H*256, 512]``, the paged
    latent cache ``kv_cache [num_blocks, block_size, 576]`` (float32 numpy; unused blocks NaN) and
    ``block_table [batch, max_blocks]`` int32 (blocks in a seeded random order, padding -1)."""
    rng = np.random.default_rng(case.seed)
    h, t = case.heads, sum(case.query_lens)
    latent = kv_lora_rank + qk_rope_head_dim
    q = rng.standard_normal((t, h, qk_nope_head_dim + qk_rope_head_dim), dtype=np.float32)
    kv_c = rng.standard_normal((t, kv_lora_rank), dtype=np.float32)
    k_pe = rng.standard_normal((t, qk_rope_head_dim), dtype=np.float32)
    w = rng.standard_normal((h * (qk_nope_head_dim + v_head_dim), kv_lora_rank), dtype=np.float32) * np.float32(
        kv_lora_rank**-0.5
    )
    bs = case.block_size
    blocks = [-(-c // bs) for c in case.context_lens]
    num_blocks = sum(blocks) + case.spare_blocks
    order = rng.permutation(num_blocks)
    cache = np.full((num_blocks, bs, latent), np.nan, dtype=np.float32)
    table = np.full((len(case.query_lens), max(blocks + [1]) + 1), -1, dtype=np.int32)
    nxt = 0
    for r, c in enumerate(case.context_lens):
        ctx = rng.standard_normal((c, latent), dtype=np.float32)
        for b in range(blocks[r]):
            blk = int(order[nxt])
            nxt += 1
            table[r, b] = blk
            n = min(bs, c - b * bs)
            cache[blk, :n] = ctx[b * bs : b * bs + n]
    return dict(q=q, kv_c=kv_c, k_pe=k_pe, kv_b_proj_weight=w, kv_cache=cache, block_table=table)


def to_torch(array: np.ndarray, dtype: Optional[str] = None, device: str = "cpu"):
    """A numpy input as a torch tensor of ``dtype`` ("bfloat16", "float32", ...; default: keep) on ``device``."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None and t.is_floating_point():
        t = t.to(getattr(torch, dtype))
    return t.to(device)
