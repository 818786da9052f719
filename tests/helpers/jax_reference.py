"""Pure-JAX float32 references: the parity oracle on CPU, independent of torch and FlashInfer.

:func:`ragged_attention` builds, from the index pointers, the segment (request) and position of every query row
and key row, masks keys of other requests (and, when causal, keys past ``i + kv_len - q_len``: bottom-right
alignment), and runs dense softmax attention in float32 (``Precision.HIGHEST`` matmuls, so no TF32 on GPU).
Rows with no visible key give out 0 and lse -inf. Memory is ``O(H * T * S)``: it is a reference for tests and
small batches, not a kernel.

It is jit-able. ``qo_indptr`` / ``kv_indptr`` may be static (lists, numpy: validated against the shapes here) or
JAX arrays, traced or not (only ``T = q.shape[0]`` and ``S = k.shape[0]`` fix the shapes, so new lengths with the
same totals do not recompile; traced values are not validated).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Sequence

import numpy as np

import jax
import jax.numpy as jnp

__all__ = ["ragged_attention", "mla_attention"]

_HI = jax.lax.Precision.HIGHEST


def _check_static_indptr(name: str, indptr: Any, total: int, total_name: str) -> None:
    a = np.asarray(indptr)
    if a.ndim != 1 or a.size == 0 or a[0] != 0 or np.any(np.diff(a) < 0):
        raise ValueError(f"{name} must be 1-D non-decreasing prefix sums starting at 0, got {a.tolist()}")
    if int(a[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(a[-1])} but {total_name} has {total} rows")


def _segments(indptr: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Request and position of each of ``n`` rows. ``side="right"`` skips empty requests: a row belongs to the
    last request whose start is <= the row."""
    rows = jnp.arange(n, dtype=jnp.int32)
    seg = jnp.searchsorted(indptr, rows, side="right").astype(jnp.int32) - 1
    return seg, rows - indptr[seg]


def ragged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, qo_indptr: Any, kv_indptr: Any, *, causal: bool, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """Ragged attention, float32: q ``[T, H, Dqk]``, k ``[S, H, Dqk]``, v ``[S, H, Dvo]``.

    Returns:
        ``(out [T, H, Dvo] float32, lse [T, H] float32 natural log)``; out 0 / lse -inf for rows that see no key.

    Raises:
        ValueError: static indptrs that are malformed or disagree with ``T`` / ``S``.
    """
    t, s = q.shape[0], k.shape[0]
    for name, indptr, total, what in (("qo_indptr", qo_indptr, t, "q"), ("kv_indptr", kv_indptr, s, "k")):
        if not isinstance(indptr, jax.core.Tracer):
            _check_static_indptr(name, indptr, total, what)
    # float32 before the jitted core: bf16 and float32 inputs of one shape share one compiled function
    q, k, v = (jnp.asarray(x).astype(jnp.float32) for x in (q, k, v))
    return _ragged_attention(
        q,
        k,
        v,
        jnp.asarray(qo_indptr, dtype=jnp.int32),
        jnp.asarray(kv_indptr, dtype=jnp.int32),
        jnp.float32(sm_scale),
        causal=bool(causal),
    )


@partial(jax.jit, static_argnames=("causal",))
def _ragged_attention(q, k, v, qo, kv, sm_scale, *, causal):
    t, s = q.shape[0], k.shape[0]
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    q_req, q_pos = _segments(qo, t)
    k_req, k_pos = _segments(kv, s)
    mask = q_req[:, None] == k_req[None, :]  # [T, S]
    if causal:
        offset = (kv[q_req + 1] - kv[q_req]) - (qo[q_req + 1] - qo[q_req])  # kv_len - q_len of each row's request
        mask &= k_pos[None, :] <= (q_pos + offset)[:, None]
    scores = jnp.einsum("thd,shd->hts", q32, k32, precision=_HI) * sm_scale
    scores = jnp.where(mask[None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, initial=-jnp.inf)  # [H, T]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask[None], jnp.exp(scores - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    has_keys = l > 0
    l_safe = jnp.where(has_keys, l, 1.0)
    out = jnp.einsum("hts,shd->thd", p / l_safe[..., None], v32, precision=_HI)
    lse = jnp.where(has_keys, m_safe + jnp.log(l_safe), -jnp.inf).T
    return out, lse


def mla_attention(
    q: jax.Array,
    kv_c: jax.Array,
    k_pe: jax.Array,
    kv_b_proj_weight: jax.Array,
    kv_cache: jax.Array,
    block_table: Any,
    query_lens: Sequence[int],
    context_lens: Optional[Sequence[int]] = None,
    *,
    qk_nope_head_dim: int = 128,
    v_head_dim: int = 128,
    sm_scale: float,
    block_size: Optional[int] = None,
) -> tuple[jax.Array, jax.Array]:
    """MLA prefill over the whole sequence, float32, unchunked: each request's context (read from the paged
    latent cache through ``block_table``) followed by its new tokens, up-projected with ``kv_b_proj_weight``
    (``k = concat(k_nope, k_pe)``, ``v``), then :func:`ragged_attention` with bottom-right causal alignment
    (every context key plus causal among the new tokens).

    ``query_lens`` / ``context_lens`` (and ``block_table``, read on the host) are static.

    Returns:
        ``(out [T, H, v_head_dim] float32, lse [T, H] float32 natural log)``.
    """
    q_lens = [int(x) for x in query_lens]
    c_lens = [0] * len(q_lens) if context_lens is None else [int(x) for x in context_lens]
    bs = kv_cache.shape[1] if block_size is None else block_size
    table = np.asarray(block_table)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    # One gather builds every request's key sequence: rows < num_slots are cache slots (context, through
    # block_table), rows >= num_slots are the new tokens.
    index: Any  # the per-request parts, then their concatenation
    index, qo, kvp, start = [], [0], [0], 0
    for r, (n, c) in enumerate(zip(q_lens, c_lens)):
        pos = np.arange(c)
        index.append(table[r, pos // bs].astype(np.int64) * bs + pos % bs)
        index.append(num_slots + start + np.arange(n))
        start += n
        qo.append(qo[-1] + n)
        kvp.append(kvp[-1] + c + n)
    index = np.concatenate(index) if index else np.zeros(0, np.int64)
    kv_c, k_pe, kv_b_proj_weight, kv_cache = (
        jnp.asarray(x).astype(jnp.float32) for x in (kv_c, k_pe, kv_b_proj_weight, kv_cache)
    )
    k, v = _mla_keys(
        kv_c,
        k_pe.reshape(k_pe.shape[0], -1),
        kv_b_proj_weight,
        kv_cache,
        jnp.asarray(index, jnp.int32),
        heads=q.shape[1],
        nope=qk_nope_head_dim,
        vdim=v_head_dim,
    )
    return ragged_attention(q, k, v, qo, kvp, causal=True, sm_scale=sm_scale)


@partial(jax.jit, static_argnames=("heads", "nope", "vdim"))
def _mla_keys(kv_c, k_pe, weight, kv_cache, index, *, heads, nope, vdim):
    rank = kv_c.shape[-1]
    source = jnp.concatenate(
        [
            kv_cache.reshape(-1, kv_cache.shape[-1]).astype(jnp.float32),
            jnp.concatenate([kv_c, k_pe], axis=-1).astype(jnp.float32),
        ],
        axis=0,
    )
    latent = source[index]  # [N, rank + rope]
    kv = jnp.einsum("nr,or->no", latent[:, :rank], weight.astype(jnp.float32), precision=_HI)
    kv = kv.reshape(latent.shape[0], heads, nope + vdim)
    rope = jnp.broadcast_to(latent[:, None, rank:], (latent.shape[0], heads, latent.shape[1] - rank))
    return jnp.concatenate([kv[..., :nope], rope], axis=-1), kv[..., nope:]
