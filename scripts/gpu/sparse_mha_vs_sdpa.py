"""transformers' DSA attention (``indices=``) on CUDA: served by mla_bridge's sparse MHA pass, or handed back to
transformers' sdpa with the top-k folded into the mask. Both compute the same function; this times which is faster.

    PYTHONPATH=$PWD:$PWD/adapters python3 scripts/gpu/sparse_mha_vs_sdpa.py [--heads 16] [--topk 2048]

Per prompt length L (batch 1, causal, bf16, q/k 192 and v 128 per head, indices: each query's top-k of random
scores over the keys it may see, as transformers' indexer picks them, -1 padded by the mask for early queries), the
median of ``--repeats`` CUDA-event timings from an idle GPU of: the adapter's serving path (the picks the mask drops
made -1, then :func:`mla_bridge.sparse_mha.sparse_attention_mha` per batch row); the handed-back path (the top-k
folded into a boolean mask, then ``torch.nn.functional.scaled_dot_product_attention`` with it, as transformers'
sdpa function calls it); and dense causal sdpa (a different function: the top-k ignored) for scale. The largest
difference between the first two outputs is printed too.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mla_bridge.sparse_mha import sparse_attention_mha
from mla_bridge_transformers.attention import fold_indices, sparse_picks


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    dev, dt, h = torch.device("cuda"), torch.bfloat16, args.heads
    g = torch.Generator(device=dev).manual_seed(0)
    for L in args.lens:
        q = torch.randn(1, h, L, 192, device=dev, generator=g).to(dt)
        k = torch.randn(1, h, L, 192, device=dev, generator=g).to(dt)
        v = torch.randn(1, h, L, 128, device=dev, generator=g).to(dt)
        scores = torch.rand(1, L, L, device=dev, generator=g)
        scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=dev).tril(), float("-inf"))
        indices = scores.topk(min(args.topk, L), dim=-1).indices.int()  # [1, L, k]
        del scores
        mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None, None]
        scale = 192**-0.5
        out_s = torch.empty(1, L, h, 128, device=dev, dtype=dt)

        def served():
            picks = sparse_picks(mask, indices, q, k, True)
            sparse_attention_mha(
                q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), picks[0], scale, out=out_s[0]
            )

        def handed_back():
            folded = fold_indices(mask, indices, q, k, True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=folded, scale=scale)

        def dense():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

        try:
            t_s = timed(served, args.repeats)
        except torch.OutOfMemoryError as err:
            t_s = float("nan")
            print(f"L {L}: served: out of memory ({str(err)[:80]})")
        t_h = timed(handed_back, args.repeats)
        t_d = timed(dense, args.repeats)
        ref = handed_back().transpose(1, 2)
        served()
        diff = float((out_s.float() - ref.float()).abs().max())
        print(
            f"L {L:6d} heads {h} topk {args.topk}: served (sparse MHA) {t_s:8.2f} ms | handed back (sdpa, folded "
            f"mask) {t_h:8.2f} ms | dense causal sdpa {t_d:7.2f} ms | served / handed back {t_s / t_h:5.2f} | "
            f"max |diff| {diff:.3g}"
        )


if __name__ == "__main__":
    main()
