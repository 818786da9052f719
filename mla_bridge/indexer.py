"""A reference lightning indexer (DeepSeek-V3.2's, as transformers implements it), in torch: a convenience.

DeepSeek Sparse Attention picks, for each query token, the ``index_topk`` earlier tokens of its sequence with the
highest indexer score; :func:`mla_bridge.mla_prefill` with ``topk_indices=`` then attends only those
(:mod:`mla_bridge.sparse`). Choosing the keys is the model's job, not the library's: this module exists so that the
CLI, the bench and the tests can produce realistic indices, in the format ``mla_prefill`` takes. It computes what
transformers' ``DeepseekV32Indexer.forward`` computes (transformers 5.25, ``models/deepseek_v32``), per request:

* ``q = wq_b(q_resid)`` viewed ``[S, n_heads, head_dim]``; ``k = LayerNorm(wk(hidden_states))`` ``[S, head_dim]``
  (one key per token, shared by the indexer's heads; eps 1e-6, with weight and bias);
* RoPE on the first ``rope_dim`` values of q and k, in the half-split (``rotate_half``) form, NOT the interleaved
  form of the main attention, with the model's ``(cos, sin)`` (cast to the inputs' dtype, as transformers does);
* ``score[s, t] = sum_j w[s, j] * ReLU(q[s, j] . k[t] * head_dim**-0.5)`` in float32, with ``w =
  weights_proj(hidden_states) * n_heads**-0.5``;
* keys after the query's own position masked (-inf), then ``topk(min(index_topk, S))``.

transformers' top-k of an early query also returns masked positions (there are fewer than ``index_topk`` unmasked
ones); its mask drops them. Here they come back as -1, and rows are padded with -1 to ``index_topk`` columns: int32
``[T, index_topk]``, the positions of each new token's picks in its request's sequence. The Hadamard rotation and
FP8 scoring of DeepSeek's own indexer are left out, as transformers leaves them out (the rotation preserves dot
products; FP8 is a precision trade). Memory: the scores of at most :data:`INDEXER_CHUNK_QUERIES` queries of one
request at a time (``n x n_heads x S`` float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .checks import as_lengths, positive_int

__all__ = [
    "IndexerWeights",
    "indexer_topk",
    "random_indexer_weights",
    "rope_cos_sin",
    "random_topk_indices",
    "INDEXER_CHUNK_QUERIES",
    "DEEPSEEK_V32_INDEXER",
]

#: Queries of one request scored at a time (bounds the ``[n, n_heads, S]`` float32 scores).
INDEXER_CHUNK_QUERIES = 1024
#: DeepSeek-V3.2's indexer shape (transformers' ``DeepseekV32Config`` defaults): ``index_n_heads``,
#: ``index_head_dim``, and the widths its weights read, ``q_lora_rank`` and ``hidden_size``.
DEEPSEEK_V32_INDEXER = {"index_n_heads": 64, "index_head_dim": 128, "q_lora_rank": 1536, "hidden_size": 7168}


@dataclass(frozen=True)
class IndexerWeights:
    """One layer's lightning-indexer weights (transformers' ``DeepseekV32Indexer``; :meth:`from_module` reads them).

    Attributes:
        wq_b: ``[n_heads * head_dim, q_lora_rank]``, the query projection of the low-rank query ``q_resid``.
        wk: ``[head_dim, hidden_size]``, the key projection of the hidden states.
        k_norm_weight, k_norm_bias: ``[head_dim]``, the key's LayerNorm.
        weights_proj: ``[n_heads, hidden_size]``, the per-head weights of each query.
        n_heads, head_dim: the indexer's heads and their width (``index_n_heads``, ``index_head_dim``).
        rope_dim: the leading values of q and k that carry RoPE (the model's ``qk_rope_head_dim``).
        eps: the LayerNorm's epsilon (1e-6 in transformers).
    All tensors of one dtype and device.
    """

    wq_b: torch.Tensor
    wk: torch.Tensor
    k_norm_weight: torch.Tensor
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor
    n_heads: int
    head_dim: int
    rope_dim: int
    eps: float = 1e-6

    def __post_init__(self) -> None:
        h, d = positive_int("n_heads", self.n_heads), positive_int("head_dim", self.head_dim)
        if not 0 < self.rope_dim <= d or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and in (0, head_dim={d}], got {self.rope_dim!r}")
        named = (
            ("wq_b", self.wq_b),
            ("wk", self.wk),
            ("k_norm_weight", self.k_norm_weight),
            ("k_norm_bias", self.k_norm_bias),
            ("weights_proj", self.weights_proj),
        )
        for name, x in named:
            if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
            if x.dtype != self.wq_b.dtype or x.device != self.wq_b.device:
                raise TypeError(f"{name} must have wq_b's dtype and device ({self.wq_b.dtype}, {self.wq_b.device})")
        hidden = self.wk.shape[-1]
        shapes = (
            ("wq_b", self.wq_b, (h * d, self.wq_b.shape[-1])),
            ("wk", self.wk, (d, hidden)),
            ("k_norm_weight", self.k_norm_weight, (d,)),
            ("k_norm_bias", self.k_norm_bias, (d,)),
            ("weights_proj", self.weights_proj, (h, hidden)),
        )
        for name, x, want in shapes:
            if x.dim() != len(want) or tuple(x.shape) != want:
                raise ValueError(f"{name} must be {list(want)}, got {list(x.shape)}")

    @classmethod
    def from_module(cls, indexer) -> "IndexerWeights":
        """The weights of a transformers ``DeepseekV32Indexer`` (or a module with its attributes: ``wq_b``, ``wk``,
        ``weights_proj`` linears, a ``k_norm`` LayerNorm, ``n_heads``, ``head_dim``, ``qk_rope_head_dim``), detached
        (no copy).

        Raises:
            AttributeError: a module without those attributes; TypeError / ValueError: as the constructor.
        """
        norm = indexer.k_norm
        return cls(
            wq_b=indexer.wq_b.weight.detach(),
            wk=indexer.wk.weight.detach(),
            k_norm_weight=norm.weight.detach(),
            k_norm_bias=norm.bias.detach(),
            weights_proj=indexer.weights_proj.weight.detach(),
            n_heads=int(indexer.n_heads),
            head_dim=int(indexer.head_dim),
            rope_dim=int(indexer.qk_rope_head_dim),
            eps=float(norm.eps),
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """RoPE (half-split) on the first ``rope_dim`` values of ``x`` (``[S, ..., head_dim]``; ``cos`` / ``sin``
    ``[S, rope_dim]``, broadcast over the middle dims)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    rot = x[..., :rope_dim]
    return torch.cat([(rot * c) + (_rotate_half(rot) * s), x[..., rope_dim:]], dim=-1)


def indexer_topk(
    weights: IndexerWeights,
    hidden_states: Sequence[torch.Tensor],
    q_resid: Sequence[torch.Tensor],
    position_embeddings: Sequence[tuple[torch.Tensor, torch.Tensor]],
    context_lens: Sequence[int],
    index_topk: int,
) -> torch.Tensor:
    """The lightning indexer's top-k picks of each new token (module docstring), as ``mla_prefill``'s
    ``topk_indices``.

    Args:
        weights: the layer's :class:`IndexerWeights`.
        hidden_states: per request ``[S_r, hidden_size]``, the layer's input for its whole sequence (its
            ``context_lens[r]`` cached tokens first, then its new tokens), in the weights' dtype and device.
        q_resid: per request ``[S_r, q_lora_rank]``, the low-rank query (``q_a_layernorm(q_a_proj(x))``) of the same
            tokens (only the new tokens' rows are read).
        position_embeddings: per request ``(cos, sin)``, each ``[S_r, rope_dim]``: the model's rotary embedding at
            each token's position (transformers' ``DeepseekV32RotaryEmbedding``; cast to the inputs' dtype here).
        context_lens: per request the cached tokens at the start of its sequence (``0 <= c <= S_r``); its new tokens
            are the other ``S_r - c``.
        index_topk: K, the picks per query (the model's ``index_topk``).

    Returns:
        int32 ``[T, index_topk]`` on the weights' device, ``T = sum(S_r - context_lens[r])`` (requests in order): each
        new token's picks as positions in its request's sequence, highest score first, -1 for none (a query at
        position ``p`` has ``p + 1`` candidates).

    Raises:
        ValueError: lists of different lengths, a context longer than its sequence, shapes that disagree with the
            weights, a bad ``index_topk``; TypeError: a dtype or device other than the weights'.
    """
    k_top = positive_int("index_topk", index_topk)
    c_lens = as_lengths("context_lens", context_lens)
    n = len(c_lens)
    if not (len(hidden_states) == len(q_resid) == len(position_embeddings) == n):
        raise ValueError(
            f"hidden_states ({len(hidden_states)}), q_resid ({len(q_resid)}), position_embeddings "
            f"({len(position_embeddings)}) and context_lens ({n}) must list the same requests"
        )
    w = weights
    dtype, device = w.wq_b.dtype, w.wq_b.device
    outs = []
    with torch.no_grad():
        for r, (x, qr, (cos, sin), c) in enumerate(zip(hidden_states, q_resid, position_embeddings, c_lens)):
            for name, t in (("hidden_states", x), ("q_resid", qr), ("cos", cos), ("sin", sin)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}[{r}] must be a torch.Tensor, got {type(t).__name__}")
                if t.device != device or (name in ("hidden_states", "q_resid") and t.dtype != dtype):
                    raise TypeError(
                        f"{name}[{r}] must be {dtype} on {device} (the weights'), got {t.dtype} on {t.device}"
                    )
            s = x.shape[0]
            if x.dim() != 2 or x.shape[1] != w.wk.shape[1]:
                raise ValueError(f"hidden_states[{r}] must be [S, hidden_size={w.wk.shape[1]}], got {list(x.shape)}")
            if tuple(qr.shape) != (s, w.wq_b.shape[1]):
                raise ValueError(f"q_resid[{r}] must be [S={s}, q_lora_rank={w.wq_b.shape[1]}], got {list(qr.shape)}")
            for name, t in (("cos", cos), ("sin", sin)):
                if tuple(t.shape) != (s, w.rope_dim):
                    raise ValueError(f"{name}[{r}] must be [S={s}, rope_dim={w.rope_dim}], got {list(t.shape)}")
            if c > s:
                raise ValueError(f"context_lens[{r}] = {c} is longer than its sequence ({s} tokens)")
            cos, sin = cos.to(dtype), sin.to(dtype)
            key = torch.nn.functional.layer_norm(
                torch.nn.functional.linear(x, w.wk), (w.head_dim,), w.k_norm_weight, w.k_norm_bias, w.eps
            )  # [S, D]
            key = _rope(key, cos, sin, w.rope_dim).float()
            kt = key.t()  # [D, S]
            width = min(k_top, s)
            for a in range(c, s, INDEXER_CHUNK_QUERIES):
                b = min(s, a + INDEXER_CHUNK_QUERIES)
                q = torch.nn.functional.linear(qr[a:b], w.wq_b).view(b - a, w.n_heads, w.head_dim)
                q = _rope(q, cos[a:b], sin[a:b], w.rope_dim)
                scores = torch.relu(torch.matmul(q.float(), kt) * w.head_dim**-0.5)  # [n, H, S]
                head_w = torch.nn.functional.linear(x[a:b], w.weights_proj).float() * (w.n_heads**-0.5)  # [n, H]
                index = torch.matmul(head_w.unsqueeze(-2), scores).squeeze(-2)  # [n, S]
                own = torch.arange(a, b, device=device)[:, None]
                later = torch.arange(s, device=device)[None, :] > own
                picks = index.masked_fill(later, float("-inf")).topk(width, dim=-1).indices
                picks = picks.masked_fill(picks > own, -1).to(torch.int32)  # masked picks of early queries
                row = torch.full((b - a, k_top), -1, dtype=torch.int32, device=device)
                row[:, :width] = picks
                outs.append(row)
    if not outs:
        return torch.empty(0, k_top, dtype=torch.int32, device=device)
    return torch.cat(outs)


def random_topk_indices(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    index_topk: int,
    *,
    generator: torch.Generator,
) -> torch.Tensor:
    """Random valid picks in the format of :func:`indexer_topk` (a stand-in for an indexer where only the picks'
    count and validity matter, as in the CLI's and the bench's timings): new token ``j`` of request ``r``, at position
    ``p = context_lens[r] + j``, picks ``min(index_topk, p + 1)`` distinct positions of ``0 .. p`` uniformly at
    random (in random order), then -1. Drawn on ``generator``'s device, one chunk of at most
    :data:`INDEXER_CHUNK_QUERIES` queries at a time (``[n, S]`` float32 random scores).

    Returns:
        int32 ``[sum(query_lens), index_topk]`` on the generator's device.

    Raises:
        ValueError: lengths that are not non-negative ints or differ in count, a bad ``index_topk``.
    """
    k_top = positive_int("index_topk", index_topk)
    q_lens, c_lens = as_lengths("query_lens", query_lens), as_lengths("context_lens", context_lens)
    if len(q_lens) != len(c_lens):
        raise ValueError(f"query_lens ({len(q_lens)}) and context_lens ({len(c_lens)}) must list the same requests")
    device = generator.device
    rows = []
    for q_len, c in zip(q_lens, c_lens):
        s = c + q_len
        width = min(k_top, s)
        for a in range(c, s, INDEXER_CHUNK_QUERIES):
            b = min(s, a + INDEXER_CHUNK_QUERIES)
            own = torch.arange(a, b, device=device)[:, None]
            later = torch.arange(s, device=device)[None, :] > own
            scores = torch.rand(b - a, s, generator=generator, device=device).masked_fill_(later, -1.0)
            picks = scores.topk(width, dim=-1).indices  # the top of uniform scores: a uniform random subset
            row = torch.full((b - a, k_top), -1, dtype=torch.int32, device=device)
            row[:, :width] = picks.masked_fill(picks > own, -1).to(torch.int32)
            rows.append(row)
    if not rows:
        return torch.empty(0, k_top, dtype=torch.int32, device=device)
    return torch.cat(rows)


def random_indexer_weights(
    rope_dim: int,
    *,
    generator: torch.Generator,
    n_heads: int = 64,
    head_dim: int = 128,
    q_lora_rank: int = 1536,
    hidden_size: int = 7168,
    dtype: torch.dtype = torch.float32,
    device: "torch.device | str | None" = None,
) -> IndexerWeights:
    """Random :class:`IndexerWeights`, DeepSeek-V3.2's shape by default (:data:`DEEPSEEK_V32_INDEXER`): a stand-in
    where no checkpoint is at hand (the CLI, the bench). ``wq_b``, ``wk``, ``weights_proj`` ~ N(0, 1/fan_in), drawn
    in float32 in that order on ``generator`` (on its device), then moved to ``device`` (default: the generator's)
    and ``dtype``; the LayerNorm's weight 1 and bias 0.

    Raises:
        ValueError / TypeError: as :class:`IndexerWeights` (``rope_dim`` even and in ``(0, head_dim]``).
    """
    device = generator.device if device is None else device

    def randn(*size: int, fan_in: int) -> torch.Tensor:
        x = torch.randn(*size, generator=generator, device=generator.device) * fan_in**-0.5
        return x.to(device=device, dtype=dtype)

    return IndexerWeights(
        wq_b=randn(n_heads * head_dim, q_lora_rank, fan_in=q_lora_rank),
        wk=randn(head_dim, hidden_size, fan_in=hidden_size),
        k_norm_weight=torch.ones(head_dim, device=device, dtype=dtype),
        k_norm_bias=torch.zeros(head_dim, device=device, dtype=dtype),
        weights_proj=randn(n_heads, hidden_size, fan_in=hidden_size),
        n_heads=n_heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
    )


def rope_cos_sin(
    length: int,
    rope_dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: "torch.device | str | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[length, rope_dim]``: plain RoPE (no scaling) at positions ``0 .. length - 1`` in the
    half-split layout :func:`indexer_topk` applies (the frequencies repeated, ``cat(f, f)``), computed in float32."""
    inv = 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
