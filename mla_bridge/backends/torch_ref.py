"""Blockwise float32 reference attention for ragged batches (CPU and CUDA).

Online softmax (FlashAttention's recurrence) over key blocks for each block of queries, so memory stays bounded
by ``block_elems`` scores however long the sequence: a 10000-token prompt never materialises ``T x T x H``.
Causal masking is bottom-right aligned (FlashInfer's convention): query ``i`` of a request with ``q_len`` queries
and ``kv_len`` keys sees keys ``j <= i + kv_len - q_len``. Rows with no visible key give out 0 and lse -inf.
The LSE is natural-log.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["ragged_attention_reference", "make_kernel"]

_BLOCK_ELEMS = 1 << 22  # scores held at once (16 MiB of float32)


def _attend_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float,
                    block_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
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
            if causal and k1 - 1 > q0 + offset:
                qi = torch.arange(q0, q1, device=q.device).view(-1, 1)
                kj = torch.arange(k0, k1, device=q.device).view(1, -1)
                s = s.masked_fill(kj > qi + offset, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(dim=-1)
            acc = acc * corr.unsqueeze(-1) + torch.bmm(p, vh[:, k0:k1].float())
            m = m_new
        has_keys = l != 0  # structural emptiness only: a NaN stays NaN (never mistaken for "no keys")
        l_safe = torch.where(has_keys, l, torch.ones_like(l))
        out[q0:q1] = (acc / l_safe.unsqueeze(-1)).permute(1, 0, 2)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        lse[q0:q1] = torch.where(has_keys, m_safe + torch.log(l_safe), torch.full_like(l, float("-inf"))).t()
    return out, lse


def ragged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: list[int],
                               kv_indptr: list[int], *, causal: bool, sm_scale: float,
                               out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                               lse_layout: str = "NH", block_elems: int = _BLOCK_ELEMS
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
        return ragged_attention_reference(q, k, v, self._qo, self._kv, causal=self.spec.causal,
                                          sm_scale=self.spec.sm_scale, out=out, lse=lse, lse_layout=lse_layout)


def make_kernel(choice: Any, workspace: Any, spec: Any) -> TorchRaggedKernel:
    return TorchRaggedKernel(spec)
