#!/usr/bin/env python3
"""The fused kernel's FP8 path against a float64 reference, many runs with the caching allocator polluted between
them: the check of the pipeline race of :mod:`mla_bridge.kernels.up_project` (wrong results with 3 stages).

    python3 scripts/gpu/fp8_fused_stress.py [--runs 20] [--bf16] [--stages N]

For the four cases of tests/gpu/test_gpu_up_project.py with an FP8 cache (block size 16 and 1, fused and chunked
schedules; DeepSeek-V2-Lite dims, NaN in every cache slot no request reads), each run fills and frees about 120 MB
of device memory with large values, keeps the GPU busy (``torch.cuda._sleep``), builds every pass's k and v by the
separate path (:func:`mla_bridge.kv.chunk_kv` / :func:`mla_bridge.kv.fused_schedule_kv`) and by the fused kernel
(:func:`mla_bridge.kernels.up_project.up_project_triton` called directly, with the scale as a tensor and as a float),
and counts the elements of k_nope and v farther than one bf16 step (2**-7 relative, plus 2**-12) from float64 sums
over the same dequantized rows. ``--stages 3`` lifts the kernel's cap on pipeline stages
(:data:`mla_bridge.kernels.up_project.DEQUANT_MAX_STAGES`) to show the race. On the H200 (2026-12-01, Triton 3.6),
with 3 stages and the dequantization rounded on the bits, 20 runs per case gave one wrong fused run (976 elements;
block size 1, fused schedule) and no wrong separate run. Prints one line per wrong pass and a count per case; exit
code 1 when any pass was wrong. ``--bf16`` adds the same cases with a bf16 cache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu"))

import test_gpu_up_project as T  # noqa: E402  (its _case: the test's inputs)

from mla_bridge import PrefillPlan, prepare_kv_b_proj  # noqa: E402
from mla_bridge import cache as C  # noqa: E402
from mla_bridge.cache import fused_latent, gather_latent  # noqa: E402
from mla_bridge.kernels import up_project as UP  # noqa: E402
from mla_bridge.kernels.up_project import up_project_triton  # noqa: E402

BF16 = torch.bfloat16


def _fused(plan, kv_c, k_pe, cache, table, scale, weight, stages=None):
    """Every pass's (k, v) from the fused kernel (``stages``: its pipeline stages, default its own)."""
    d = weight.dims
    passes = (
        [
            dict(
                kv_cache=cache,
                block_table=table,
                req_ids=plan.ctx_req_ids,
                positions=plan.ctx_positions,
                ctx_dst=plan.ctx_dst,
                kv_c=kv_c,
                k_pe=k_pe,
                new_dst=plan.new_dst,
            )
        ]
        if plan.fused
        else (
            [dict(kv_c=kv_c, k_pe=k_pe)]
            + [dict(kv_cache=cache, block_table=table, req_ids=c.req_ids, positions=c.positions) for c in plan.chunks]
        )
    )
    out = []
    for p in passes:
        rows = (
            int(plan.main_kv_indptr[-1])
            if plan.fused
            else (p["kv_c"].shape[0] if "kv_c" in p else p["req_ids"].shape[0])
        )
        buf = torch.empty(rows, d.num_heads, d.head_dim_qk + d.v_head_dim, dtype=BF16, device=cache.device)
        up_project_triton(
            buf,
            weight,
            kv_cache_scale=scale if "kv_cache" in p else None,
            **({} if stages is None else {"num_stages": stages}),
            **p,
        )
        out.append((buf[..., : d.head_dim_qk], buf[..., d.head_dim_qk :]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per case (default 20)")
    parser.add_argument("--bf16", action="store_true", help="also the same cases with a bf16 cache")
    parser.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages of the fused kernel, its FP8 cap lifted (default: the kernel's own)",
    )
    args = parser.parse_args()
    if args.stages is not None:
        UP.DEQUANT_MAX_STAGES = args.stages
    wrong_total = 0
    cases = [
        (fp8, bs, fuse)
        for fp8 in ((True, False) if args.bf16 else (True,))
        for bs, fuse in ((16, True), (1, False), (16, False), (1, True))
    ]
    for fp8, bs, fuse in cases:
        d, ws, q_lens, c_lens, cache, scale, table, q, kv_c, k_pe, w = T._case(
            bs, fp8, seed=bs + 3 * fp8, chunk_tokens=4096 if fuse else 1024
        )
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=d,
            workspace=ws,
            block_size=bs,
            dtype=BF16,
            fuse_context=fuse,
            kv_cache_dtype="fp8" if fp8 else None,
        )
        cache, s = C.check_kv_cache(cache, scale, plan.kv_cache_dtype)
        weight = prepare_kv_b_proj(w, d, layout="split")
        raw = w.double().view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)  # k_nope rows, v rows
        lats = (
            [fused_latent(plan, kv_c, k_pe, cache, table, s, impl="torch")]
            if plan.fused
            else [torch.cat([kv_c, k_pe], -1)]
            + [
                gather_latent(cache, table, c.req_ids, c.positions, dtype=BF16, kv_cache_scale=s, impl="torch")
                for c in plan.chunks
            ]
        )
        refs = [
            (
                torch.einsum("nr,hdr->nhd", x[:, : d.kv_lora_rank].double(), raw[:, : d.qk_nope_head_dim]),
                torch.einsum("nr,hdr->nhd", x[:, : d.kv_lora_rank].double(), raw[:, d.qk_nope_head_dim :]),
            )
            for x in lats
        ]
        wrong = {"separate": 0, "fused": 0}
        for run in range(args.runs):
            junk = torch.randn(int(3e7) + run * 4099, device=cache.device) * 1e20
            del junk
            for sc in (s, float(s)) if fp8 else (None,):
                torch.cuda._sleep(int(1e8))
                results = {
                    "separate": T._passes(plan, kv_c, k_pe, cache, table, sc, weight, "separate"),
                    "fused": _fused(plan, kv_c, k_pe, cache, table, sc, weight, args.stages),
                }
                torch.cuda.synchronize()
                for name, res in results.items():
                    for pi, ((k, v), (rn, rv)) in enumerate(zip(res, refs)):
                        n = sum(
                            int(((x.double() - r).abs() > r.abs() * 2.0**-7 + 2.0**-12).sum())
                            for x, r in ((k[..., : d.qk_nope_head_dim], rn), (v, rv))
                        )
                        if n:
                            wrong[name] += 1
                            print(
                                f"{'FP8' if fp8 else 'bf16'} cache, block {bs}, {'fused' if fuse else 'chunked'} "
                                f"schedule, run {run}, scale "
                                f"{type(sc).__name__}: {name} pass {pi} ({k.shape[0]} rows) has {n} wrong",
                                flush=True,
                            )
        print(
            f"{'FP8' if fp8 else 'bf16'} cache, block {bs}, {'fused' if fuse else 'chunked'} schedule: wrong "
            f"passes in {(2 if fp8 else 1) * args.runs} runs: {wrong}",
            flush=True,
        )
        wrong_total += sum(wrong.values())
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main())
