"""Tiles of the sparse attention kernel (mla_bridge.kernels.sparse_attention): time a few SparseConfigs on the GPU, or
compile them for sm_90a without one and read what ptxas reports.

    PYTHONPATH=$PWD python3 scripts/gpu/sparse_tune.py [--heads 128] [--topk 2048] [--tokens 4096] [--context 65536]
    PYTHONPATH=$PWD python3 scripts/gpu/sparse_tune.py --offline      # no GPU: registers, spills, async copies

On the GPU: one request of ``--tokens`` new tokens after ``--context`` cached ones (bf16, block size 64, DeepSeek-V3.2
dims at ``--heads`` heads), random causal picks (every row full), and per config the median time of the kernel's
launch alone (``q_lat`` / ``o_lat`` made once), its TFLOP/s (2 x picks x heads x (kv_lora_rank + rope + kv_lora_rank)
FLOPs) and the largest difference of its ``o_lat`` from the default config's. ``--fp8`` times an FP8 cache. Then
(bf16) the route of gathered latents, as the sparse pass runs it where the context fits one chunk's memory: the
portable kernel and, on compute capability 9.0 with Triton 3.6, the Hopper kernel
(mla_bridge.kernels.sparse_attention_sm90) on the same picks.

``--offline`` compiles each config with Triton for ``cuda:90`` (no device needed) and runs the ptxas Triton ships
(``ptxas-blackwell``, new enough for Triton's PTX) with ``-v``: registers per thread, spilled bytes, shared memory and
whether the tile loads were pipelined (``async_copy`` ops in the TTGIR). Needs a Triton wheel with its NVIDIA backend.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

CONFIGS = [  # (block_h, block_k, num_warps, num_stages), after the default (default_config)
    (64, 32, 8, 2),
    (64, 16, 8, 2),
    (64, 16, 8, 3),
    (64, 32, 8, 3),
    (64, 64, 8, 2),
    (64, 64, 8, 1),
    (64, 64, 8, 3),
    (64, 64, 4, 2),
    (64, 128, 8, 1),
    (32, 32, 8, 2),
    (32, 64, 8, 2),
    (32, 32, 4, 2),
]


def offline(args) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mla_bridge.kernels import sparse_attention as sa

    fn = sa._sparse_kernel
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    dt = "bf16"
    for bh, bk, warps, stages in CONFIGS:
        types = {
            "lse_ptr": "*fp32",
            "idx_ptr": "*i32",
            "nctx_ptr": "*i32",
            "meta_ptr": "*i32",
            "table_ptr": "*i32",
            "cache_ptr": "*u8" if args.fp8 else f"*{dt}",
            "scale_ptr": "*fp32" if args.fp8 else f"*{dt}",
            "scale_val": "fp32",
            "qk_scale": "fp32",
        }
        consts = dict(
            BLOCK_SIZE=64,
            RANK=512,
            ROPE=64,
            BLOCK_R=512,
            BLOCK_P=64,
            BLOCK_H=bh,
            BLOCK_K=bk,
            SCAN=256,
            DEQUANT=args.fp8,
            SCALE_IS_PTR=args.fp8,
            HAS_LSE=True,
            IEEE=False,
            UPCAST=False,
            SPLIT=args.fp8,
            cs_elem=1,
            kvc_elem=1,
            kpe_elem=1,
            idx_elem=1,
            qp_elem=1,
        )
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in types:
                sig[name] = types[name]
            elif name.endswith("_ptr"):
                sig[name] = f"*{dt}"
            else:
                sig[name] = "i64" if "delta" in name else "i32"
        aligned = {"o_st", "o_sh", "ql_st", "ql_sh", "qp_st", "qp_sh", "idx_st", "cs_block", "cs_slot", "kvc_row"}
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, name in enumerate(fn.arg_names)
            if name.endswith("_ptr") or name in aligned | {"kpe_row"}
        }
        k = triton.compile(
            ASTSource(fn, sig, consts, attrs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=warps, num_stages=stages),
        )
        path = f"/tmp/sparse_tune_{bh}_{bk}_{warps}_{stages}{'_fp8' if args.fp8 else ''}.ptx"
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".cubin"], capture_output=True)
        info = [
            line.split(":", 1)[-1].strip()
            for line in res.stderr.decode().splitlines()
            if "registers" in line or "spill" in line
        ]
        print(
            f"block_h {bh:3d} block_k {bk:3d} warps {warps} stages {stages}: "
            f"async_copy {k.asm['ttgir'].count('async_copy')}, smem {k.metadata.shared} B; " + "; ".join(info)
        )


def on_gpu(args) -> None:
    from mla_bridge import MLADims, quantize_latent_cache
    from mla_bridge.kernels.sparse_attention import SparseConfig, default_config, sparse_attention_triton

    dev = torch.device("cuda")
    v32 = MLADims.preset("deepseek-v3.2")
    h, rank, rope, k = args.heads, v32.kv_lora_rank, v32.qk_rope_head_dim, args.topk
    t, c, bs = args.tokens, args.context, 64
    g = torch.Generator(device=dev).manual_seed(0)
    n_blocks = -(-c // bs)
    cache = torch.randn(n_blocks, bs, rank + rope, device=dev, generator=g).to(torch.bfloat16)
    table = torch.randperm(n_blocks, device=dev, generator=g).to(torch.int32)[None]
    scale = None
    if args.fp8:
        cache, scale = quantize_latent_cache(cache.float())
    kv_c = torch.randn(t, rank, device=dev, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(t, rope, device=dev, generator=g).to(torch.bfloat16)
    q_lat = torch.randn(t, h, rank, device=dev, generator=g).to(torch.bfloat16) * 0.1
    q_pe = torch.randn(t, h, rope, device=dev, generator=g).to(torch.bfloat16)
    own = c + torch.arange(t, device=dev)
    picks = (torch.rand(t, k, device=dev, generator=g) * (own[:, None] + 1).float()).long().clamp(max=own[:, None])
    idx = picks.to(torch.int32)
    meta = torch.tensor([[0, c, c + t, -c]], dtype=torch.int32, device=dev).expand(t, 4).contiguous()
    lse = torch.empty(t, h, device=dev)
    pairs = t * k
    flops = 2 * pairs * h * (rank + rope + rank)
    ref = None
    configs = [default_config(h, rank, k, torch.bfloat16)] + [SparseConfig(*cfg) for cfg in CONFIGS[: args.configs]]
    for cfg in configs:
        o = torch.empty(t, h, rank, dtype=torch.bfloat16, device=dev)

        def run():
            sparse_attention_triton(
                o, lse, q_lat, q_pe, idx, meta, cache, table, kv_c, k_pe, scale, v32.softmax_scale, cfg
            )

        try:
            run()
        except Exception as err:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            print(f"{cfg}: failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        ms = median_ms(run, args.repeats)
        diff = 0.0 if ref is None else float((o.float() - ref.float()).abs().max())
        ref = o if ref is None else ref
        print(f"{cfg}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, max |o_lat - default's| {diff:.3g}")
    if not args.fp8:
        latents(args, q_lat, q_pe, idx, flops, lse)


def median_ms(run, repeats: int) -> float:
    """The median time of ``run()`` in ms (CUDA events; one call first)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def latents(args, q_lat, q_pe, idx, flops, lse) -> None:
    """The route of gathered latents (every pick a row of one contiguous buffer, as the sparse pass lays the fused key
    latents out): the portable kernel's default tiles and, on compute capability 9.0 with Triton 3.6, the Hopper
    kernel (mla_bridge.kernels.sparse_attention_sm90), on the same picks."""
    from mla_bridge.kernels import triton_version
    from mla_bridge.kernels.sparse_attention import sparse_attention_triton

    dev, (t, h, rank), c = q_lat.device, q_lat.shape, args.context
    lat = torch.randn(c + t, rank + q_pe.shape[-1], device=dev).to(torch.bfloat16)
    own = c + torch.arange(t, device=dev)
    zero = torch.zeros_like(own)
    meta = torch.stack([zero, zero, own + 1, zero], 1).to(torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    scale = 192**-0.5
    o_port, o_h = (torch.empty(t, h, rank, dtype=torch.bfloat16, device=dev) for _ in range(2))

    def portable():
        sparse_attention_triton(
            o_port, lse, q_lat, q_pe, idx, meta, lat[:, None], table, lat[:, :rank], lat[:, rank:], None, scale
        )

    ms = median_ms(portable, args.repeats)
    print(f"latents, portable kernel: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
    if torch.cuda.get_device_capability(dev) != (9, 0) or triton_version() != (3, 6):
        print("latents, Hopper kernel: not run (compute capability 9.0 and Triton 3.6 only)")
        return
    from mla_bridge.kernels.sparse_attention_sm90 import sparse_attention_sm90

    ms = median_ms(lambda: sparse_attention_sm90(o_h, lse, q_lat, q_pe, idx, meta, lat, scale), args.repeats)
    diff = float((o_h.float() - o_port.float()).abs().max())
    print(f"latents, Hopper kernel: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, max |o_lat - portable's| {diff:.3g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--configs", type=int, default=len(CONFIGS), help="time the default and the first N of CONFIGS")
    p.add_argument("--offline", action="store_true")
    args = p.parse_args()
    if args.offline:
        offline(args)
    elif not torch.cuda.is_available():
        print("no CUDA device: use --offline", file=sys.stderr)
        return 2
    else:
        on_gpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
