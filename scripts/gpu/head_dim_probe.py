#!/usr/bin/env python3
"""One head-dim case of FlashInfer's ragged prefill against a float64 torch reference; prints one JSON line.

    python3 scripts/gpu/head_dim_probe.py --backend fa2 --head-dim-qk 96 --head-dim-vo 96 --dtype bf16

Runs ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper(..., backend=B)`` directly (not through mla_bridge's
dispatch, which would refuse the shapes it knows are wrong) on random inputs: 3 causal requests of 17, 128 and 300
tokens, 4 heads, then synchronises and compares out and the natural-log LSE with float64 dense attention per
request. Output: ``{"backend", "head_dim_qk", "head_dim_vo", "dtype", "ok", "max_err", "max_lse_err", "error"}``;
``ok`` is true when the call returns, everything is finite and out is within 2e-2 and the LSE within 1e-2 of float64
(the tolerances of tests/gpu). An illegal memory access may kill the process before it prints: run each case in a
fresh process (``scripts/gpu/head_dim_grid.sh`` does, and records a crash as ``ok: false``). Exit code 0 when the
case ran and is right, 1 when it is wrong or failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

OUT_TOL, LSE_TOL = 2e-2, 1e-2
LENS = (17, 128, 300)
HEADS = 4


def reference(q, k, v, lens, sm_scale):
    """float64 causal attention per request: out [T, H, Dv], natural-log lse [T, H]."""
    import torch

    outs, lses, a = [], [], 0
    for n in lens:
        qq, kk, vv = (x[a : a + n].double() for x in (q, k, v))
        s = torch.einsum("qhd,khd->hqk", qq, kk) * sm_scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
        lses.append(lse.t())
        a += n
    return torch.cat(outs), torch.cat(lses)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, choices=("fa2", "fa3", "cutlass", "auto"))
    p.add_argument("--head-dim-qk", type=int, required=True)
    p.add_argument("--head-dim-vo", type=int, required=True)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    result = {
        "backend": a.backend,
        "head_dim_qk": a.head_dim_qk,
        "head_dim_vo": a.head_dim_vo,
        "dtype": a.dtype,
        "ok": False,
        "max_err": None,
        "max_lse_err": None,
        "error": None,
    }
    try:
        import torch
        import flashinfer

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(a.seed)
        t = sum(LENS)
        q = torch.randn(t, HEADS, a.head_dim_qk, device=dev, generator=g).to(dtype)
        k = torch.randn(t, HEADS, a.head_dim_qk, device=dev, generator=g).to(dtype)
        v = torch.randn(t, HEADS, a.head_dim_vo, device=dev, generator=g).to(dtype)
        indptr = torch.tensor([0] + [sum(LENS[: i + 1]) for i in range(len(LENS))], dtype=torch.int32)
        sm_scale = a.head_dim_qk**-0.5
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend=a.backend)
        w.plan(
            indptr,
            indptr,
            HEADS,
            HEADS,
            a.head_dim_qk,
            head_dim_vo=a.head_dim_vo,
            causal=True,
            sm_scale=sm_scale,
            q_data_type=dtype,
            kv_data_type=dtype,
            o_data_type=dtype,
        )
        # poison the output so that columns a kernel never writes show up
        out = torch.full((t, HEADS, a.head_dim_vo), float("nan"), dtype=dtype, device=dev)
        out, lse = w.run(q, k, v, out=out, return_lse=True, lse_base="ln")
        torch.cuda.synchronize()
        ro, rl = reference(q, k, v, LENS, sm_scale)
        err = (out.double() - ro).abs().nan_to_num(nan=math.inf).max().item()
        lerr = (lse.double() - rl).abs().nan_to_num(nan=math.inf).max().item()
        result.update(
            max_err=err if math.isfinite(err) else None,
            max_lse_err=lerr if math.isfinite(lerr) else None,
            ok=bool(err <= OUT_TOL and lerr <= LSE_TOL),
        )
        if not result["ok"]:
            result["error"] = f"wrong values: max out error {err:.3g} (tol {OUT_TOL}), lse {lerr:.3g} (tol {LSE_TOL})"
    except BaseException as err:  # noqa: BLE001 - the case's outcome is the output
        result["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
