"""Blockwise float32 reference attention for ragged batches (CPU and CUDA).

Online softmax (FlashAttention's recurrence) over key blocks for each block of queries, so memory stays bounded
by ``block_elems`` scores however long the sequence: a 10000-token prompt never materialises ``T x T x H``.
Causal masking is bottom-right aligned (FlashInfer's convention): query ``i`` of a request with ``q_len`` queries
and ``kv_len`` keys sees keys ``j <= i + kv_len - q_len``. Rows with no visible key give out 0 and lse -inf.
The LSE is natural-log.

Non-finite inputs stay in the rows that attend them: a masked key's probability is 0, and 0 times a NaN or infinite
value is NaN, so in a block where some rows see a key and others do not, the non-finite values of v among the keys
some row cannot see are taken out of the block's product and added back (NaN, or an infinity of one sign) to the
rows that see them only (:func:`_probs_times_values`: a few elementwise passes over those keys, fewer than the
block's rows). A row is then non-finite exactly when it attends a NaN k or a non-finite v (or its q is non-finite),
and every other row is bitwise what it is without the bad value.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["ragged_attention_reference", "make_kernel"]

_BLOCK_ELEMS = 1 << 22  # scores held at once (16 MiB of float32)


def _attend_request(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float, block_elems: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Lq,H,Dqk], k [Lk,H,Dqk], v [Lk,H,Dvo] -> out [Lq,H,Dvo] float32, lse [Lq,H] float32 (natural log)."""
    lq, h, _ = q.shape
    lk = k.shape[0]
    dvo = v.shape[-1]
    out = torch.zeros(lq, h, dvo, dtype=torch.float32, device=q.device)
    lse = torch.full((lq, h), float("-inf"), dtype=torch.float32, device=q.device)
    if lq == 0 or lk == 0:
        return out, lse
    offset = lk - lq  # bottom-right causal alignment
    bq = max(1, min(lq, 256))
    bk = max(1, min(lk, block_elems // (bq * h)))
    kh = k.permute(1, 2, 0)  # [H, Dqk, Lk]
    vh = v.permute(1, 0, 2)  # [H, Lk, Dvo]
    for q0 in range(0, lq, bq):
        q1 = min(lq, q0 + bq)
        qb = q[q0:q1].permute(1, 0, 2).float() * sm_scale  # [H, bq, Dqk]
        m = torch.full((h, q1 - q0), float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros((h, q1 - q0), dtype=torch.float32, device=q.device)
        acc = torch.zeros((h, q1 - q0, dvo), dtype=torch.float32, device=q.device)
        k_end = lk if not causal else max(0, min(lk, q1 - 1 + offset + 1))
        for k0 in range(0, k_end, bk):
            k1 = min(k_end, k0 + bk)
            s = torch.bmm(qb, kh[:, :, k0:k1].float())  # [H, bq, bk]
            partial = causal and k1 - 1 > q0 + offset  # some row of the block does not see every key
            if partial:
                qi = torch.arange(q0, q1, device=q.device).view(-1, 1)
                kj = torch.arange(k0, k1, device=q.device).view(1, -1)
                s = s.masked_fill(kj > qi + offset, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(dim=-1)
            vb = vh[:, k0:k1].float()
            if partial:  # row q0 + r sees keys up to q0 + r + offset: past ``first``, a prefix of ``seen[r]`` keys
                first = max(0, q0 + offset + 1 - k0)
                seen = (qi.view(-1) + (offset + 1 - k0 - first)).clamp_(0, k1 - k0 - first)
                pv = _probs_times_values(p, vb, first, seen)
            else:
                pv = torch.bmm(p, vb)
            acc = acc * corr.unsqueeze(-1) + pv
            m = m_new
        has_keys = l != 0  # structural emptiness only: a NaN stays NaN (never mistaken for "no keys")
        l_safe = torch.where(has_keys, l, torch.ones_like(l))
        out[q0:q1] = (acc / l_safe.unsqueeze(-1)).permute(1, 0, 2)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        lse[q0:q1] = torch.where(has_keys, m_safe + torch.log(l_safe), torch.full_like(l, float("-inf"))).t()
    return out, lse


def _all_finite_on_host(finite: torch.Tensor) -> bool:
    """On the CPU, where reading a value costs no device sync: whether ``finite`` (a mask) is all True. False on
    CUDA (the torch backend never syncs there)."""
    return finite.device.type == "cpu" and bool(finite.all())


def _probs_times_values(p: torch.Tensor, v: torch.Tensor, first: int, seen: torch.Tensor) -> torch.Tensor:
    """``p @ v`` (``[H, bq, bk] @ [H, bk, Dvo]``) of a causal block whose rows do not all see every key, with the
    non-finite values of v reaching only the rows that see their key (see the module docstring). Every row sees the
    keys before ``first``, whose values enter as they are; row ``r`` sees the next ``seen[r]`` keys (``[bq]`` int64,
    0 to ``bk - first``: a prefix, causal masks being prefixes), where its ``p`` is 0 beyond them. Among those
    ``n = bk - first`` keys (``n < bq <= 256``), a non-finite value becomes 0 in the product, and for each row and
    channel the NaN / +inf / -inf values among the keys it sees are counted (one int32 per value, a count per byte:
    running sums over the keys, read at ``seen``; each count is at most ``n < 256``) and added back: NaN where a NaN
    or both infinities are seen, else the infinity seen. Branch-free on CUDA (no host sync); on the CPU a block whose
    values are all finite takes the plain product."""
    tail = v[:, first:]
    finite = torch.isfinite(tail)
    if _all_finite_on_host(finite):
        return torch.bmm(p, v)
    # one product of the block's shape, as the plain one: the rows' finite values are summed in the same order
    pv = torch.bmm(p, torch.cat([v[:, :first], torch.where(finite, tail, torch.zeros_like(tail))], 1))
    kinds = (
        torch.isnan(tail).to(torch.int32)
        + (tail == float("inf")).to(torch.int32) * 256
        + (tail == float("-inf")).to(torch.int32) * 65536
    )
    counts = torch.cat([torch.zeros_like(kinds[:, :1]), kinds.cumsum(1, dtype=torch.int32)], 1).index_select(1, seen)
    nan, pos, neg = (counts & 255) > 0, (counts & 65280) > 0, counts >= 65536  # [H, bq, Dvo] each
    bad = torch.zeros_like(pv).masked_fill_(pos, float("inf")).masked_fill_(neg, float("-inf"))
    return pv + bad.masked_fill_(nan | (pos & neg), float("nan"))


def ragged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: list[int],
    kv_indptr: list[int],
    *,
    causal: bool,
    sm_scale: float,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    lse_layout: str = "NH",
    block_elems: int = _BLOCK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention, float32 accumulation: q ``[T,H,Dqk]``, k ``[S,H,Dqk]``, v ``[S,H,Dvo]`` with host indptrs.

    Returns ``out [T,H,Dvo]`` (q's dtype unless ``out`` is given) and ``lse`` float32 natural-log, ``[T,H]``
    (``lse_layout="NH"``) or ``[H,T]`` ("HN"). Inputs are assumed validated (see :mod:`mla_bridge.ragged`).
    """
    t, h = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(t, h, v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((t, h) if lse_layout == "NH" else (h, t), dtype=torch.float32, device=q.device)
    for r in range(len(qo_indptr) - 1):
        qa, qb, ka, kb = qo_indptr[r], qo_indptr[r + 1], kv_indptr[r], kv_indptr[r + 1]
        if qb == qa:
            continue
        o_r, lse_r = _attend_request(q[qa:qb], k[ka:kb], v[ka:kb], causal, sm_scale, block_elems)
        out[qa:qb] = o_r.to(out.dtype)
        if lse_layout == "NH":
            lse[qa:qb] = lse_r
        else:
            lse[:, qa:qb] = lse_r.t()
    return out, lse


class TorchRaggedKernel:
    """The torch backend's planned kernel: host indptrs kept as Python ints."""

    def __init__(self, spec: Any):
        self.spec = spec
        self._qo = [int(x) for x in spec.qo_indptr.tolist()]
        self._kv = [int(x) for x in spec.kv_indptr.tolist()]

    def run(self, q, k, v, out, lse, lse_layout):
        return ragged_attention_reference(
            q,
            k,
            v,
            self._qo,
            self._kv,
            causal=self.spec.causal,
            sm_scale=self.spec.sm_scale,
            out=out,
            lse=lse,
            lse_layout=lse_layout,
        )


def make_kernel(choice: Any, workspace: Any, spec: Any) -> TorchRaggedKernel:
    return TorchRaggedKernel(spec)
