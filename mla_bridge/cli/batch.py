"""The prefill command's batch: the workload from the arguments (demo defaults), device and dtype, random inputs
in a shuffled paged latent cache, FLOPs per layer, and the requests the float64 check samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import CLIError

DEMO_BATCH = 4
DEMO_PROMPT_LEN = 256
DEMO_CONTEXT_LENS = (0, 256, 512, 1024)
#: Most requests one run takes: the command keeps per-request Python lists (and samples over them) before its
#: memory estimate can refuse a batch, so a larger ``--batch`` would cost minutes and gigabytes by itself.
MAX_REQUESTS = 1 << 20


@dataclass
class Workload:
    query_lens: list[int]
    context_lens: list[int]
    demo: bool


def resolve_workload(args) -> Workload:
    explicit = args.prompt_lens is not None or args.batch is not None or args.prompt_len is not None
    if args.prompt_lens is not None:
        if args.batch is not None or args.prompt_len is not None:
            raise CLIError("--prompt-lens cannot be combined with --batch / --prompt-len (give one or the other)")
        query_lens = list(args.prompt_lens)
    else:
        batch = DEMO_BATCH if args.batch is None else args.batch
        if batch > MAX_REQUESTS:
            raise CLIError(
                f"--batch {batch}: at most {MAX_REQUESTS} requests per run (the command keeps "
                f"per-request lists on the host)"
            )
        query_lens = [DEMO_PROMPT_LEN if args.prompt_len is None else args.prompt_len] * batch
    if args.context_lens is None:
        context_lens = [0] * len(query_lens) if explicit else list(DEMO_CONTEXT_LENS)
    elif len(args.context_lens) == 1:
        context_lens = args.context_lens * len(query_lens)
    elif len(args.context_lens) == len(query_lens):
        context_lens = list(args.context_lens)
    else:
        raise CLIError(
            f"--context-lens has {len(args.context_lens)} values but the batch has {len(query_lens)} "
            f"request{'' if len(query_lens) == 1 else 's'} (give one value per request, or one for all)"
        )
    if sum(query_lens) == 0:
        raise CLIError("--prompt-lens / --prompt-len: every request has 0 new tokens, nothing to compute")
    return Workload(query_lens, context_lens, demo=not explicit)


def resolve_device_dtype(args):
    import torch

    if args.device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError) as err:
            raise CLIError(f"--device {args.device!r} is not a device ({err})") from None
        if device.type not in ("cpu", "cuda"):
            raise CLIError(f"--device {args.device!r}: only cpu and cuda are supported")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CLIError(f"--device {args.device!r}: CUDA is not available here (torch {torch.__version__})")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {args.device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, name), name


def make_inputs(dims, workload: Workload, block_size: int, dtype, device, seed: int, weight=None):
    """Random q / kv_c / k_pe / kv_b_proj weight at the model's dims, and a shuffled paged latent cache.

    Scales keep attention away from degenerate (one-hot or uniform) softmax: q, kv_c, k_pe ~ N(0, 1) (kv_c is
    RMS-normalised in the model), weight ~ N(0, 1/kv_lora_rank) so k_nope and v have unit variance too.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    t = sum(workload.query_lens)
    h, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

    q = randn(t, h, dims.head_dim_qk)
    kv_c = randn(t, r)
    k_pe = randn(t, rope)
    if weight is None:
        weight = randn(*dims.kv_b_proj_shape, std=r**-0.5)
    else:
        weight = weight.to(device=device, dtype=dtype)
    blocks_per_req = [-(-c // block_size) for c in workload.context_lens]
    num_blocks = sum(blocks_per_req) + 1  # one spare block that no request uses
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(workload.query_lens), max(1, max(blocks_per_req)), dtype=torch.int32)
    # Every slot that holds no context is NaN: reading one would show up in the check.
    cache = torch.full((num_blocks, block_size, dims.latent_dim), float("nan"))
    nxt = 0
    for req, (c, nb) in enumerate(zip(workload.context_lens, blocks_per_req)):
        ids = perm[nxt : nxt + nb]
        nxt += nb
        block_table[req, :nb] = ids.to(torch.int32)
        for j, b in enumerate(ids.tolist()):
            n = min(block_size, c - j * block_size)
            cache[b, :n] = torch.randn(n, dims.latent_dim, generator=g)
    return q, kv_c, k_pe, weight, cache.to(device=device, dtype=dtype), block_table.to(device)


def batch_flops(dims, workload: Workload, gathered_context: int) -> tuple[int, int]:
    """(attention FLOPs, up-projection FLOPs) of one layer.

    Attention: 2 x (q.k pairs) x heads x (head_dim_qk + head_dim_vo), pairs counted exactly per request:
    ``q_len * context_len + q_len * (q_len + 1) / 2``. Up-projection: ``2 * N * kv_lora_rank * H * (nope + v)``
    for the N tokens that are up-projected: the new ones and ``gathered_context``, the context tokens the plan's passes
    gather (:attr:`mla_bridge.PrefillPlan.num_gathered_context_tokens`: no pass reads the context of a request without
    new tokens, unless it shares a chunk with one).
    """
    pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(workload.query_lens, workload.context_lens))
    attn = 2 * pairs * dims.num_heads * (dims.head_dim_qk + dims.head_dim_vo)
    n = sum(workload.query_lens) + gathered_context
    up = 2 * n * dims.kv_lora_rank * dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    return attn, up


def sample_requests(query_lens: Sequence[int], k: int) -> list[int]:
    """Up to k request ids spread evenly over those with new tokens (first and last included)."""
    ids = [i for i, q in enumerate(query_lens) if q > 0]
    if k <= 0 or not ids:
        return []
    if k >= len(ids):
        return ids
    if k == 1:
        return [ids[-1]]
    picks = sorted({ids[round(j * (len(ids) - 1) / (k - 1))] for j in range(k)})
    return picks
