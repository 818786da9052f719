"""MLA prefill at DeepSeek-V2-Lite's dims with mla_bridge's public API: plan once, run per layer.

    python examples/prefill_deepseek_v2_lite.py

Runs FlashInfer on an NVIDIA GPU (bf16) and the torch reference backend on the CPU (float32).
"""

import argparse

import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

# DeepSeek-V2-Lite / DeepSeek-Coder-V2-Lite-Instruct: 16 heads, kv_lora_rank 512, q/k 128+64, v 128,
# softmax scale 192**-0.5 * yarn mscale**2. MLADims.from_hf_config("path/to/config.json") reads any DeepSeek V2/V3.
dims = MLADims.deepseek_v2_lite()

# The batch: three requests with 100, 37 and 250 new tokens; the second and third have 64 and 300 tokens of
# cached context (a prefix-cache hit) in the paged latent cache.
query_lens = [100, 37, 250]
context_lens = [0, 64, 300]
block_size = 16

# One workspace per device, made once: FlashInfer's float workspace, its wrapper pool, the context-chunk budget.
workspace = Workspace(device)

# Plan once per batch (host-side indptrs, the context-chunk schedule, FlashInfer's plan()).
plan = PrefillPlan.build(
    query_lens, context_lens, dims=dims, workspace=workspace, block_size=block_size, device=device, dtype=dtype
)
print(plan, "| backend:", plan.backend.name, "-", plan.backend.reason)

# The paged latent cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] = [.., 16, 576] and each
# request's block_table row listing the blocks that hold its context (any blocks, in any order).
blocks = [-(-c // block_size) for c in context_lens]
kv_cache = torch.randn(sum(blocks), block_size, dims.latent_dim, device=device, dtype=dtype)
block_table = torch.zeros(len(query_lens), max(blocks), dtype=torch.int32, device=device)
start = 0
for r, n in enumerate(blocks):
    block_table[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
    start += n

num_layers, t = 3, sum(query_lens)
for layer in range(num_layers):
    # What a model's attention layer has at this point for the new tokens (random here):
    q = torch.randn(t, dims.num_heads, dims.head_dim_qk, device=device, dtype=dtype)  # [T, 16, 192], RoPE applied
    kv_c = torch.randn(t, dims.kv_lora_rank, device=device, dtype=dtype)  # [T, 512] latent after the KV RMSNorm
    k_pe = torch.randn(t, dims.qk_rope_head_dim, device=device, dtype=dtype)  # [T, 64] RoPE key, shared by heads
    # kv_b_proj.weight as stored in the checkpoint: [16 * (128 + 128), 512]
    w_kv_b = torch.randn(*dims.kv_b_proj_shape, device=device, dtype=dtype) * dims.kv_lora_rank**-0.5

    # Every layer reuses the same plan: nothing is re-planned. lse is natural-log, [T, H].
    out, lse = mla_prefill(q, kv_c, k_pe, w_kv_b, kv_cache, block_table, plan, return_lse=True)
    print(
        f"layer {layer}: out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}, "
        f"finite: {bool(torch.isfinite(out).all() and torch.isfinite(lse).all())}"
    )

# Check the last layer's third request against an independent float64 computation from the paged cache.
from mla_bridge.reference import reference_request  # noqa: E402

r = 2
a, b = sum(query_lens[:r]), sum(query_lens[: r + 1])
ref_out, ref_lse = reference_request(
    q[a:b], kv_c[a:b], k_pe[a:b], w_kv_b, kv_cache, block_table[r], context_lens[r], dims
)
print(
    f"request {r} vs float64: max abs error out {(out[a:b].cpu().double() - ref_out).abs().max():.2e}, "
    f"lse {(lse[a:b].cpu().double() - ref_lse).abs().max():.2e}"
)
