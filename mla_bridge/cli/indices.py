"""The sparse prefill of ``mla-bridge prefill --index-topk K``: each new token's top-K keys (``topk_indices``), from
the reference lightning indexer (:mod:`mla_bridge.indexer`) with random weights, or random valid causal picks
(``--indices random``), and the FLOPs and memory of the sparse pass.

The indexer has DeepSeek-V3.2's shape (:data:`INDEXER_SHAPE`: 64 heads of 128, a 1536-wide low-rank query, hidden
size 7168), or the one a ``--checkpoint``'s config.json names (``index_n_heads``, ``index_head_dim``,
``q_lora_rank``, ``hidden_size``); RoPE on the model's ``qk_rope_head_dim`` leading values, base 10000 at each
token's position in its sequence. Its weights and inputs (the hidden states and low-rank query of every token of each
sequence, context included) are random, N(0, 1/fan_in) and N(0, 1), from a generator seeded from ``--seed`` apart from
the prefill inputs' (which stay those of the dense run with the same seed). Random picks
(:func:`mla_bridge.indexer.random_topk_indices`): per new token at position ``p`` of its sequence, ``min(K, p + 1)``
distinct positions of ``0 .. p``, drawn uniformly, the rest -1.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..indexer import DEEPSEEK_V32_INDEXER

__all__ = [
    "INDEXER_SHAPE",
    "INDICES_CHOICES",
    "indexer_shape",
    "make_topk_indices",
    "sparse_flops",
    "sparse_pass_bytes",
    "indices_bytes",
]

#: DeepSeek-V3.2's indexer (transformers' DeepseekV32Config defaults): its heads, head width, the low-rank query's
#: width and the hidden size its key and head weights read (:data:`mla_bridge.indexer.DEEPSEEK_V32_INDEXER`).
INDEXER_SHAPE = dict(DEEPSEEK_V32_INDEXER)
#: ``--indices``: where the picks come from.
INDICES_CHOICES = ("indexer", "random")


def indexer_shape(config: Optional[dict]) -> dict:
    """The indexer's shape: :data:`INDEXER_SHAPE`, with the values a checkpoint's ``config`` (its text config, where
    the model nests one) holds instead."""
    shape = dict(INDEXER_SHAPE)
    if isinstance(config, dict):
        text = config.get("text_config")
        if not isinstance(text, dict):
            text = config
        for key in shape:
            value = text.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                shape[key] = value
    return shape


def sparse_flops(dims, selected_pairs: int, num_tokens: int) -> tuple[int, int]:
    """``(attention FLOPs, absorption FLOPs)`` of one sparse layer. Attention: 2 x selected (query, key) pairs x
    heads x (kv_lora_rank + qk_rope_head_dim + kv_lora_rank) (scores over the latent rows, then P @ latent).
    Absorption: q_nope through W_UK and the latent output through W_UV, ``2 x T x H x kv_lora_rank x (qk_nope_head_dim
    + v_head_dim)``."""
    d = dims
    attn = 2 * selected_pairs * d.num_heads * (2 * d.kv_lora_rank + d.qk_rope_head_dim)
    absorb = 2 * num_tokens * d.num_heads * d.kv_lora_rank * (d.qk_nope_head_dim + d.v_head_dim)
    return attn, absorb


def sparse_pass_bytes(dims, num_tokens: int, index_topk: int, element_size: int, latent_rows: int = 0) -> int:
    """Bytes one sparse ``mla_prefill`` call allocates at most: the larger of its two paths
    (:mod:`mla_bridge.sparse`). The torch path, per chunk of queries: the selected latent rows (in the run's dtype
    and as float32), scores and probabilities, the latent query and output; for the call a float32 copy of W_UK
    and W_UV. The kernel's: per launch the latent query and output (``2 x rows x kv_lora_rank`` in the run's dtype),
    and for the call the fused key latents it gathers first, ``latent_rows x latent_dim`` in the run's dtype
    (``latent_rows``: the plan's fused placements where it has :attr:`mla_bridge.PrefillPlan.sparse_latent_meta`,
    else 0). Both: out, lse and 16 bytes per token."""
    from ..sparse import SPARSE_CHUNK_PAIRS, SPARSE_CHUNK_QUERIES, SPARSE_KERNEL_CHUNK_ROWS

    d, k, e = dims, index_topk, element_size
    n = min(num_tokens, max(1, min(SPARSE_CHUNK_QUERIES, SPARSE_CHUNK_PAIRS // k)))
    chunk = n * k * d.latent_dim * (e + 4) + 3 * n * d.num_heads * k * 4 + 2 * n * d.num_heads * d.kv_lora_rank * 4
    weights = d.num_heads * (d.qk_nope_head_dim + d.v_head_dim) * d.kv_lora_rank * 4
    launch = min(num_tokens, max(1, SPARSE_KERNEL_CHUNK_ROWS // d.num_heads))
    kernel = 2 * launch * d.num_heads * d.kv_lora_rank * e + latent_rows * d.latent_dim * e
    call = num_tokens * d.num_heads * (d.v_head_dim * e + 4) + 16 * num_tokens
    return max(chunk + weights, kernel) + call


def indices_bytes(
    query_lens: Sequence[int], context_lens: Sequence[int], index_topk: int, source: str, shape: dict, e: int
) -> int:
    """Peak bytes of making the indices (:func:`make_topk_indices`) besides the ``[T, K]`` int32 result: for the
    indexer its weights, one request's inputs and key, and the scores of a chunk of its queries (each ``[n, heads,
    S]`` float32, a few copies); for random picks a chunk's ``[n, S]`` scores and their top-k."""
    from ..indexer import INDEXER_CHUNK_QUERIES

    longest = max((q + c for q, c in zip(query_lens, context_lens)), default=0)
    most_new = max(query_lens, default=0)
    if source == "random":
        n = min(most_new, INDEXER_CHUNK_QUERIES)
        return n * longest * 4 * 2 + n * min(index_topk, longest) * 12
    h, dh, ql, hid = (shape[k] for k in ("index_n_heads", "index_head_dim", "q_lora_rank", "hidden_size"))
    weights = (h * dh * ql + dh * hid + 2 * dh + h * hid) * e
    inputs = longest * (hid + ql + 2 * 64) * e + longest * dh * (e + 4)
    n = min(most_new, INDEXER_CHUNK_QUERIES)
    scores = 3 * n * h * longest * 4 + n * h * dh * (e + 4) + 2 * n * longest * 4
    return weights + inputs + scores


def make_topk_indices(
    source: str,
    dims,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    index_topk: int,
    *,
    device,
    dtype,
    seed: int,
    shape: Optional[dict] = None,
):
    """int32 ``[T, index_topk]`` on ``device``: each new token's picks as positions in its request's sequence, -1 for
    none (the module docstring says how ``source``, ``"indexer"`` or ``"random"``, makes them). One request at a
    time, so that only one sequence's indexer inputs and scores are held.

    Raises:
        ValueError: an unknown ``source``; the indexer with a model whose ``qk_rope_head_dim`` the indexer cannot
            take (zero or odd: its RoPE part is the model's).
    """
    import torch

    if source not in INDICES_CHOICES:
        raise ValueError(f"indices source must be one of {INDICES_CHOICES}, got {source!r}")
    salted = (seed + 0x5EED) % 2**63  # apart from the prefill inputs' generator
    rows = []
    if source == "random":  # drawn where they are used (a GPU draws the scores of a long batch in milliseconds)
        from ..indexer import random_topk_indices

        g = torch.Generator(device=device).manual_seed(salted)
        return random_topk_indices(query_lens, context_lens, index_topk, generator=g)

    from ..indexer import indexer_topk, random_indexer_weights, rope_cos_sin

    g = torch.Generator().manual_seed(salted)  # on the CPU, as the prefill inputs' (the same draws on every device)
    shape = dict(INDEXER_SHAPE) if shape is None else shape
    h, dh, ql, hid = (shape[k] for k in ("index_n_heads", "index_head_dim", "q_lora_rank", "hidden_size"))
    rope = dims.qk_rope_head_dim
    if not 0 < rope <= dh or rope % 2:
        raise ValueError(
            f"the reference indexer applies RoPE to the model's qk_rope_head_dim leading values, which must be even "
            f"and in (0, index_head_dim={dh}]: got {rope}"
        )
    weights = random_indexer_weights(
        rope, generator=g, n_heads=h, head_dim=dh, q_lora_rank=ql, hidden_size=hid, dtype=dtype, device=device
    )

    def randn(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    for q_len, c in zip(query_lens, context_lens):
        s = c + q_len
        if q_len == 0:
            continue
        hidden, q_resid = randn(s, hid), randn(s, ql)
        rows.append(
            indexer_topk(
                weights, [hidden], [q_resid], [rope_cos_sin(s, rope, dtype=dtype, device=device)], [c], index_topk
            )
        )
        del hidden, q_resid
    return torch.cat(rows) if rows else torch.empty(0, index_topk, dtype=torch.int32, device=device)
