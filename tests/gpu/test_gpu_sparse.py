"""GPU tests of the sparse prefill (mla_bridge.sparse) on CUDA: the Triton kernel and the torch path.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run on the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_sparse.py -q -m gpu
The torch path (``MLA_BRIDGE_SPARSE=torch``):
* bf16 on CUDA (the context rows gathered by the gather of mla_bridge.cache, Triton where it imports) against the
  same call on the CPU in float32 (itself checked against float64 in tests/test_sparse.py), at DeepSeek-V2-Lite dims,
  bf16 and FP8 caches, block sizes 1/16/64;
* the Triton gather and the torch gather (MLA_BRIDGE_GATHER=torch) give bitwise the same sparse output.
The Triton kernels (mla_bridge.kernels.sparse_attention, the default on CUDA, and on compute capability 9.0 the
Hopper kernel of mla_bridge.kernels.sparse_attention_sm90 where the context is gathered into the fused key latents;
its own test also compares it with the portable kernel directly), against the float64 sparse reference
of tests/test_sparse.py (computed on the GPU in float64 from the same bf16 inputs) and against the torch path:
* DeepSeek-V3.2 dims (128 heads) and DeepSeek-V2-Lite dims (16 heads), K = 2048 and K = 64, -1 padding, rows with
  fewer picks than K and rows without any, block sizes 1/16/64, context in the chunked schedule;
* FP8 caches (a tensor and a float scale), GLM-5 dims (64 heads, kv_lora_rank 512, rope 64, v_head_dim 256), and
  kv_lora_rank 256 / 128 with rope 32 / 0 and a head count not a power of two;
* a pick past its request's sequence is skipped; every causal key selected equals dense mla_prefill (both paths).
Tolerances (bf16): out within 2e-2 absolute + 2e-2 relative, lse within 2e-2 absolute (the kernel rounds the latent
query and its latent output to bf16 and feeds bf16 probabilities to the second product; the torch path keeps them
in float32). No speed is measured here (the bench does).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, quantize_latent_cache  # noqa: E402

V2_LITE = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
QUERY_LENS = [37, 0, 130, 9]
CONTEXT_LENS = [300, 40, 0, 1025]
OUT_TOL, LSE_TOL = 2e-2, 1e-2


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def indices(k: int, seed: int, fill: float = 0.8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for q, c in zip(QUERY_LENS, CONTEXT_LENS):
        for j in range(q):
            own = c + j
            most = min(k, own + 1)
            m = max(1, int(most * fill))
            row = torch.full((k,), -1, dtype=torch.int32)
            row[torch.randperm(k, generator=g)[:m]] = torch.randperm(own + 1, generator=g)[:m].to(torch.int32)
            rows.append(row)
    return torch.stack(rows)


def bf16_batch(ref, dims, block_size, seed):
    """A batch whose values are bf16 numbers (held as float32), so that the CPU float32 call and the CUDA bf16 call
    read the same inputs."""
    batch = ref.make_mla_batch(dims, QUERY_LENS, CONTEXT_LENS, block_size, seed=seed)
    for name in ("q", "kv_c", "k_pe", "w", "cache"):
        setattr(batch, name, getattr(batch, name).to(torch.bfloat16).float())
    return batch


def bf16_plan(dims, k: int, block_size: int, kv_cache_dtype=None, chunk_tokens=None) -> PrefillPlan:
    """A bf16 sparse plan of the test batch (QUERY_LENS after CONTEXT_LENS) on the GPU. ``chunk_tokens``: the
    workspace's (a small one makes the kernel read the context through block_table: the latents exceed it)."""
    return PrefillPlan.build(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=dims,
        workspace=Workspace(dev()) if chunk_tokens is None else Workspace(dev(), chunk_tokens=chunk_tokens),
        block_size=block_size,
        dtype=torch.bfloat16,
        index_topk=k,
        kv_cache_dtype=kv_cache_dtype,
    )


def call(batch, plan, idx, cache, scale, device):
    to = lambda x: x.to(device)  # noqa: E731
    return mla_prefill(
        to(batch.q).to(plan.dtype),
        to(batch.kv_c).to(plan.dtype),
        to(batch.k_pe).to(plan.dtype),
        to(batch.w).to(plan.dtype),
        to(cache),
        to(batch.block_table),
        plan,
        topk_indices=None if idx is None else to(idx),
        return_lse=True,
        kv_cache_scale=None if scale is None else (scale if isinstance(scale, float) else to(scale)),
    )


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_cuda_bf16_equals_cpu_float32(ref, block_size, fp8, monkeypatch):
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "torch")
    dims = MLADims(**V2_LITE)
    k = 256
    batch = bf16_batch(ref, dims, block_size, seed=block_size)
    idx = indices(k, seed=block_size)
    cache, scale, cpu_cache = batch.cache.to(torch.bfloat16), None, batch.cache
    kind = None
    if fp8:
        cache, scale = quantize_latent_cache(batch.cache)
        scale = float(scale)
        cpu_cache, kind = cache, "fp8"
    gpu_plan = bf16_plan(dims, k, block_size, kv_cache_dtype=kind)
    cpu_plan = PrefillPlan.build(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=dims,
        workspace=Workspace("cpu"),
        block_size=block_size,
        dtype=torch.float32,
        index_topk=k,
        kv_cache_dtype=kind,
    )
    out, lse = call(batch, gpu_plan, idx, cache, scale, dev())
    exp_out, exp_lse = call(batch, cpu_plan, idx, cpu_cache, scale, "cpu")
    torch.testing.assert_close(out.float().cpu(), exp_out, atol=OUT_TOL, rtol=OUT_TOL)
    torch.testing.assert_close(lse.cpu(), exp_lse, atol=LSE_TOL, rtol=0)


def test_triton_and_torch_gather_agree(ref, monkeypatch):
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "torch")  # the gather serves the torch path
    dims = MLADims(**V2_LITE)
    k = 128
    batch = bf16_batch(ref, dims, 16, seed=3)
    idx = indices(k, seed=3)
    plan = bf16_plan(dims, k, 16)
    cache = batch.cache.to(torch.bfloat16)
    auto, auto_lse = call(batch, plan, idx, cache, None, dev())
    monkeypatch.setenv("MLA_BRIDGE_GATHER", "torch")
    forced, forced_lse = call(batch, plan, idx, cache, None, dev())
    assert torch.equal(auto.view(torch.int16), forced.view(torch.int16)) and torch.equal(auto_lse, forced_lse)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_all_keys_equals_dense_on_the_gpu(ref, impl, monkeypatch):
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", impl)
    dims = MLADims(**V2_LITE)
    k = max(q + c for q, c in zip(QUERY_LENS, CONTEXT_LENS))
    batch = bf16_batch(ref, dims, 16, seed=4)
    idx = indices(k, seed=4, fill=1.0)
    ws = Workspace(dev())
    args = dict(dims=dims, workspace=ws, block_size=16, dtype=torch.bfloat16)
    sparse_plan = PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, index_topk=k, **args)
    dense_plan = PrefillPlan.build(QUERY_LENS, CONTEXT_LENS, **args)
    cache = batch.cache.to(torch.bfloat16)
    out, lse = call(batch, sparse_plan, idx, cache, None, dev())
    dense_out, dense_lse = call(batch, dense_plan, None, cache, None, dev())
    torch.testing.assert_close(out.float(), dense_out.float(), atol=OUT_TOL, rtol=OUT_TOL)
    torch.testing.assert_close(lse, dense_lse, atol=LSE_TOL, rtol=0)


# ------------------------------------------------------------------------------------------------ the Triton kernel
V32 = MLADims.preset("deepseek-v3.2")
GLM5 = MLADims.preset("glm-5")
# sequences longer than 2048 (every row of a late token holds K picks) and shorter (fewer picks than K, padding)
LONG_QUERY_LENS = [6, 0, 12, 3, 5]
LONG_CONTEXT_LENS = [2300, 40, 0, 3000, 17]
KERNEL_OUT_TOL, KERNEL_LSE_TOL = 2e-2, 2e-2


def long_indices(k: int, seed: int, fill: float = 1.0) -> torch.Tensor:
    """int32 [T, k] for the long batch: per token min(k, own + 1) * fill distinct causal picks at shuffled places,
    the rest -1; the second token of request 2 gets none."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for q, c in zip(LONG_QUERY_LENS, LONG_CONTEXT_LENS):
        for j in range(q):
            own = c + j
            m = max(1, int(min(k, own + 1) * fill))
            row = torch.full((k,), -1, dtype=torch.int32)
            row[torch.randperm(k, generator=g)[:m]] = torch.randperm(own + 1, generator=g)[:m].to(torch.int32)
            rows.append(row)
    out = torch.stack(rows)
    out[LONG_QUERY_LENS[0] + 1] = -1
    return out


def kernel_case(
    ref,
    monkeypatch,
    dims,
    k,
    block_size,
    *,
    seed,
    fp8=False,
    fill=1.0,
    chunk_tokens=None,
    scale_as_float=False,
    latents=None,
):
    """(kernel out, kernel lse, torch-path out, torch-path lse, float64 out, float64 lse) for the long batch in bf16
    (values bf16 numbers: the float64 reference reads the same inputs), computed on the GPU. ``latents``: whether
    the plan must gather the context (an FP8 one dequantized) into the fused key latents (None: not checked)."""
    from tests.helpers.sparse_cases import sparse_reference

    from mla_bridge.cache import dequantize_latent

    batch = ref.make_mla_batch(dims, LONG_QUERY_LENS, LONG_CONTEXT_LENS, block_size, seed=seed)
    for name in ("q", "kv_c", "k_pe", "w", "cache"):
        setattr(batch, name, getattr(batch, name).to(torch.bfloat16).to(dev()))
    batch.block_table = batch.block_table.to(dev())
    idx = long_indices(k, seed, fill)
    cache, scale, kind = batch.cache, None, None
    if fp8:
        cache, scale = quantize_latent_cache(batch.cache.float())
        kind = "fp8"
        if scale_as_float:
            scale = float(scale)
    ws = Workspace(dev()) if chunk_tokens is None else Workspace(dev(), chunk_tokens=chunk_tokens)
    plan = PrefillPlan.build(
        LONG_QUERY_LENS,
        LONG_CONTEXT_LENS,
        dims=dims,
        workspace=ws,
        block_size=block_size,
        dtype=torch.bfloat16,
        index_topk=k,
        kv_cache_dtype=kind,
        **({} if chunk_tokens is None else dict(fuse_context=False)),
    )
    if latents is not None:
        assert (plan.sparse_latent_meta is not None) == latents
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, cache, batch.block_table, plan)
    gpu_idx = idx.to(dev())
    monkeypatch.delenv("MLA_BRIDGE_SPARSE", raising=False)  # the default on CUDA: the kernel
    kernel = mla_prefill(*args, topk_indices=gpu_idx, return_lse=True, kv_cache_scale=scale)
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "torch")
    torch_path = mla_prefill(*args, topk_indices=gpu_idx, return_lse=True, kv_cache_scale=scale)
    monkeypatch.delenv("MLA_BRIDGE_SPARSE")
    if fp8:  # stored * scale exactly (rounded to bf16 by the torch path and the latents, not by the per-tile kernel)
        batch.cache = dequantize_latent(cache, scale, torch.float64)
    exp_out, exp_lse = sparse_reference(batch, idx)
    return (*kernel, *torch_path, exp_out, exp_lse)


def assert_kernel_close(out, lse, exp_out, exp_lse):
    out, lse = out.float().cpu().double(), lse.cpu().double()
    torch.testing.assert_close(out, exp_out, atol=KERNEL_OUT_TOL, rtol=KERNEL_OUT_TOL)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(exp_lse))
    finite = torch.isfinite(exp_lse)
    torch.testing.assert_close(lse[finite], exp_lse[finite], atol=KERNEL_LSE_TOL, rtol=0)


def check_kernel_case(case):
    out, lse, t_out, t_lse, exp_out, exp_lse = case
    empty = LONG_QUERY_LENS[0] + 1
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and torch.isneginf(lse[empty]).all()
    assert_kernel_close(out, lse, exp_out, exp_lse)
    assert_kernel_close(out, lse, t_out.float().cpu().double(), t_lse.cpu().double())


def test_the_kernel_is_the_default_on_cuda(monkeypatch):
    from mla_bridge.sparse import select_sparse

    monkeypatch.delenv("MLA_BRIDGE_SPARSE", raising=False)
    choice = select_sparse(V32, torch.bfloat16, "cuda")
    assert choice.name == "triton", choice


@pytest.mark.parametrize("k", [2048, 64])
@pytest.mark.parametrize("heads", [128, 16])
def test_kernel_deepseek_dims(ref, monkeypatch, heads, k):
    dims = MLADims(
        num_heads=heads,
        kv_lora_rank=V32.kv_lora_rank,
        qk_nope_head_dim=V32.qk_nope_head_dim,
        qk_rope_head_dim=V32.qk_rope_head_dim,
        v_head_dim=V32.v_head_dim,
        softmax_scale=V32.softmax_scale,
    )
    check_kernel_case(kernel_case(ref, monkeypatch, dims, k, 64, seed=heads + k, fill=0.9))


@pytest.mark.parametrize("chunk_tokens", [None, 64])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_kernel_block_sizes_and_padding(ref, monkeypatch, block_size, chunk_tokens):
    """Both routes: the context gathered once into the fused key latents (the default budget) and read through
    block_table per tile (64 tokens of 16 heads: latents above one chunk's k / v memory)."""
    dims = MLADims(**V2_LITE)
    case = kernel_case(
        ref,
        monkeypatch,
        dims,
        256,
        block_size,
        seed=block_size,
        fill=0.6,
        chunk_tokens=chunk_tokens,
        latents=chunk_tokens is None,
    )
    check_kernel_case(case)


def test_kernel_chunked_context(ref, monkeypatch):
    check_kernel_case(kernel_case(ref, monkeypatch, MLADims(**V2_LITE), 2048, 16, seed=5, chunk_tokens=700))


@pytest.mark.parametrize("scale_as_float", [False, True])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("chunk_tokens", [None, 64])
def test_kernel_fp8_cache(ref, monkeypatch, block_size, scale_as_float, chunk_tokens):
    """The context dequantized once into the fused key latents (the default budget), and converted per tile in the
    kernel where the latents exceed one chunk's k / v memory (64 tokens of 128 heads: 4551 latent rows)."""
    check_kernel_case(
        kernel_case(
            ref,
            monkeypatch,
            V32,
            2048,
            block_size,
            seed=7,
            fp8=True,
            scale_as_float=scale_as_float,
            chunk_tokens=chunk_tokens,
            latents=chunk_tokens is None,
        )
    )


def test_kernel_glm5_dims(ref, monkeypatch):
    assert (GLM5.num_heads, GLM5.kv_lora_rank, GLM5.qk_rope_head_dim) == (64, 512, 64)
    check_kernel_case(kernel_case(ref, monkeypatch, GLM5, 2048, 64, seed=8, fill=0.95))


@pytest.mark.parametrize("rank,rope,heads", [(256, 32, 32), (128, 0, 16), (512, 64, 20)])
def test_kernel_other_dims(ref, monkeypatch, rank, rope, heads):
    """Other dims the project serves: kv_lora_rank 256 / 128, rope 32 / 0 (no k_pe), a head count that is not a
    power of two."""
    dims = MLADims(num_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=64, qk_rope_head_dim=rope, v_head_dim=64)
    check_kernel_case(kernel_case(ref, monkeypatch, dims, 512, 16, seed=rank + rope, fill=0.7))


def test_kernel_skips_a_pick_past_the_sequence(ref):
    """On CUDA the indices are not checked on the host: a pick past its request's sequence is skipped by the kernel
    (never read), so the row equals the row without it."""
    from mla_bridge.prefill import as_prepared
    from mla_bridge.sparse import sparse_prefill

    dims = MLADims(**V2_LITE)
    k = 128
    batch = bf16_batch(ref, dims, 16, seed=9)
    idx = indices(k, seed=9, fill=0.5)
    bad = idx.clone()
    bad[0, (bad[0] < 0).nonzero()[0]] = CONTEXT_LENS[0] + QUERY_LENS[0]  # one past request 0's sequence
    bad[1, (bad[1] < 0).nonzero()[0]] = 10**6
    plan = bf16_plan(dims, k, 16)
    to = lambda x: x.to(dev()).to(torch.bfloat16)  # noqa: E731
    args = (
        to(batch.q),
        to(batch.kv_c),
        to(batch.k_pe),
        as_prepared(to(batch.w), dims, torch.bfloat16, dev()),
        to(batch.cache),
        batch.block_table.to(dev()),
        plan,
    )
    good_out, good_lse = sparse_prefill(*args, idx.to(dev()), return_lse=True, impl="triton")
    bad_out, bad_lse = sparse_prefill(*args, bad.to(dev()), return_lse=True, impl="triton")
    assert torch.equal(good_out.view(torch.int16), bad_out.view(torch.int16)) and torch.equal(good_lse, bad_lse)


def _placed(parts: list, gap: int) -> list:
    """Copies of ``parts`` (bf16 tensors) laid out in one buffer, ``gap`` elements between the first and the rest,
    each starting on a 16-element boundary (the kernel's one-load path needs that alignment)."""
    sizes = [-(-p.numel() // 16) * 16 for p in parts]
    big = torch.empty(sum(sizes) + gap, dtype=torch.bfloat16, device=dev())
    out, at = [], 0
    for i, (p, n) in enumerate(zip(parts, sizes)):
        view = big[at : at + p.numel()].view(p.shape)
        view.copy_(p)
        out.append(view)
        at += n + (gap if i == 0 else 0)
    return out


@pytest.mark.parametrize("chunk_tokens", [None, 1])
@pytest.mark.parametrize("latents_first", [False, True])
def test_kernel_reads_new_latents_far_from_the_cache(ref, latents_first, chunk_tokens):
    """The kernel addresses a new token's latent row from the cache's pointer (one load per tile of context and new
    rows): kv_c and k_pe more than 2**31 elements (4 GiB of bf16) after or before the cache give bitwise the output
    of the same values allocated apart. As a 32-bit product the offset wrapped and the kernel read outside memory.
    Both routes: the context gathered into the fused key latents first (whose gather reads the far rows), and read
    through block_table by the kernel (``chunk_tokens=1``)."""
    dims = MLADims(**V2_LITE)
    k = 128
    batch = bf16_batch(ref, dims, 16, seed=12)
    idx = indices(k, seed=12, fill=0.9).to(dev())
    q, kv_c, k_pe, w, cache = (getattr(batch, n).to(dev(), torch.bfloat16) for n in ("q", "kv_c", "k_pe", "w", "cache"))
    table = batch.block_table.to(dev())
    plan = bf16_plan(dims, k, 16, chunk_tokens=chunk_tokens)
    assert (plan.sparse_latent_meta is not None) == (chunk_tokens is None)
    want = mla_prefill(q, kv_c, k_pe, w, cache, table, plan, topk_indices=idx, return_lse=True)
    gap = 2**31 + 2**20
    if latents_first:
        far_kv_c, far_k_pe, far_cache = _placed([kv_c, k_pe, cache], gap)
    else:
        far_cache, far_kv_c, far_k_pe = _placed([cache, kv_c, k_pe], gap)
    assert abs(far_kv_c.data_ptr() - far_cache.data_ptr()) // 2 > 2**31
    got = mla_prefill(q, far_kv_c, far_k_pe, w, far_cache, table, plan, topk_indices=idx, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_sparse_layer_does_not_wait_for_the_gpu(ref, monkeypatch):
    """In an engine the host issues layer after layer while the GPU works: a sparse call on a busy GPU must return
    before the GPU reaches it (each call copied its per-token table to the device from pageable memory, which waits
    for the stream). Its results equal the call made on an idle GPU. The Triton kernel (the default on CUDA); the
    torch fallback indexes by boolean masks, which read them on the host."""
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", "triton")
    dims, k = MLADims(**V2_LITE), 256
    batch = bf16_batch(ref, dims, 16, seed=3)
    idx = indices(k, seed=3)
    plan = bf16_plan(dims, k, 16)
    cache = batch.cache.to(torch.bfloat16)
    want_out, want_lse = call(batch, plan, idx, cache, None, dev())  # compiles, warms the allocator
    args = [x.to(dev()) for x in (batch.q, batch.kv_c, batch.k_pe, batch.w)]
    q, kv_c, k_pe, w = (x.to(torch.bfloat16) for x in args)
    cache, table, idx = cache.to(dev()), batch.block_table.to(dev()), idx.to(dev())
    torch.cuda.synchronize()
    import time

    done = torch.cuda.Event()
    torch.cuda._sleep(int(2e9))  # about a second of GPU work queued ahead of the layers
    t0 = time.perf_counter()
    outs = [mla_prefill(q, kv_c, k_pe, w, cache, table, plan, topk_indices=idx, return_lse=True) for _ in range(3)]
    issued = time.perf_counter() - t0
    done.record()
    assert not done.query(), "the GPU finished the sleep before the host issued the layers: no test"
    torch.cuda.synchronize()
    assert issued < 0.25, f"issuing 3 sparse layers took {issued:.3f} s: the host waited for the GPU"
    for out, lse in outs:
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def _latent_case(t, c, h, k, dtype, pad, seed, spread=1.0):
    """Tokens ``c .. c + t - 1`` of one request whose fused key latents are ``lat`` (rows 0 .. c + t - 1), random
    causal picks with a share ``pad`` of -1, and the rows the kernels read: sequence length ``own + 1``, first row 0.
    ``spread`` scales the rope queries (wider scores)."""
    g = torch.Generator(device=dev()).manual_seed(seed)
    lat = torch.randn(c + t, 576, device=dev(), generator=g).to(dtype)
    q_lat = (torch.randn(t, h, 512, device=dev(), generator=g) * 0.1).to(dtype)
    q_pe = (torch.randn(t, h, 192, device=dev(), generator=g) * spread).to(dtype)[..., 128:]  # a view of q
    own = c + torch.arange(t, device=dev())
    picks = (torch.rand(t, k, device=dev(), generator=g) * (own[:, None] + 1)).long().clamp(max=own[:, None])
    picks[torch.rand(t, k, device=dev(), generator=g) < pad] = -1
    zero = torch.zeros_like(own)
    meta = torch.stack([zero, zero, own + 1, zero], 1).to(torch.int32)
    return lat, q_lat, q_pe, picks.to(torch.int32), meta


def _latent_reference(lat, q_lat, q_pe, idx, meta, scale):
    """float64 attention of every token over its picks' rows of ``lat`` (-1 and picks past the sequence: none)."""
    ix = idx.long()
    ok = (ix >= 0) & (ix < meta[:, 2:3].long())
    sel = lat[ix.clamp(min=0)].double()  # [t, k, 576]
    s = (
        torch.einsum("thr,tkr->thk", q_lat.double(), sel[..., :512])
        + torch.einsum("thp,tkp->thk", q_pe.double(), sel[..., 512:])
    ) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("thk,tkr->thr", p, sel[..., :512]), lse, s


@pytest.mark.parametrize(
    "t, c, h, k, dtype, pad, spread",
    [
        (64, 300, 128, 256, torch.bfloat16, 0.0, 1.0),
        (64, 300, 64, 256, torch.bfloat16, 0.3, 1.0),
        (50, 1000, 80, 100, torch.bfloat16, 0.5, 1.0),  # heads not a multiple of 64, K not of the tile
        (40, 10, 64, 32, torch.float16, 0.0, 1.0),  # fewer picks than one tile
        (40, 10, 64, 2048, torch.bfloat16, 0.0, 1.0),  # K beyond the sequence: repeated picks
        (33, 5000, 128, 2048, torch.bfloat16, 1.0, 1.0),  # no pick at all: out 0, lse -inf
        (96, 4000, 128, 2048, torch.bfloat16, 0.1, 1.0),
        (48, 3000, 64, 1024, torch.bfloat16, 0.2, 6.0),  # wide scores: rows' maxima grow past 2**8 after tile 0
        (48, 3000, 64, 1024, torch.float16, 0.0, 6.0),
    ],
)
def test_hopper_kernel_against_float64_and_the_portable_kernel(t, c, h, k, dtype, pad, spread):
    """The Hopper kernel (mla_bridge.kernels.sparse_attention_sm90) over the fused key latents, against a float64
    attention from the same inputs and no further from it than the portable Triton kernel is (the same rounding:
    bf16/fp16 probabilities, a float32 online softmax), wide scores included: those cases check that some rows'
    running max grows by more than 8 (base 2) after the first tile while other rows' does not (the rescaling of
    some rows of the accumulator and not others)."""
    from mla_bridge.kernels import triton_version

    if torch.cuda.get_device_capability() != (9, 0) or triton_version() != (3, 6):
        pytest.skip("the Hopper kernel runs on compute capability 9.0 with Triton 3.6")
    from mla_bridge.kernels.sparse_attention import sparse_attention_triton
    from mla_bridge.kernels.sparse_attention_sm90 import sparse_attention_sm90

    lat, q_lat, q_pe, idx, meta = _latent_case(t, c, h, k, dtype, pad, seed=t + h + k, spread=spread)
    scale = 192**-0.5
    outs = []
    for kernel in ("sm90", "portable"):
        o = torch.full((t, h, 512), float("nan"), dtype=dtype, device=dev())
        lse = torch.full((t, h), float("nan"), device=dev())
        if kernel == "sm90":
            sparse_attention_sm90(o, lse, q_lat, q_pe, idx, meta, lat, scale)
        else:
            table = torch.zeros(1, 1, dtype=torch.int32, device=dev())
            sparse_attention_triton(
                o, lse, q_lat, q_pe, idx, meta, lat[:, None], table, lat[:, :512], lat[:, 512:], None, scale
            )
        outs.append((o.double(), lse.double()))
    exp_out, exp_lse, scores = _latent_reference(lat, q_lat, q_pe, idx, meta, scale)
    if spread > 1:  # the premise: after some tile of 64 picks some heads' running max grew by more than 8 (base 2)
        running = torch.cummax(scores.unflatten(-1, (-1, 64)).amax(-1), -1).values  # [t, h, tiles]
        grew = (running[..., 1:] - running[..., :-1]) * 1.4426950408889634 > 8  # [t, h, tiles - 1]
        assert (grew.any(1) & ~grew.all(1)).any()  # on one tile of one token: some heads grew, others did not
    (o9, l9), (op, lp) = outs
    assert not torch.isnan(o9).any() and not torch.isnan(l9).any()
    assert torch.equal(torch.isinf(l9), torch.isinf(exp_lse)) and torch.equal(torch.isinf(exp_lse), torch.isinf(lp))
    fin = torch.isfinite(exp_lse)
    err9, errp = (o9 - exp_out).abs().max().item(), (op - exp_out).abs().max().item()
    assert err9 <= 2 * errp + 1e-3, (err9, errp)
    if fin.any():
        assert (l9 - exp_lse)[fin].abs().max().item() < 1e-3
    if pad == 1.0:
        assert torch.equal(o9, torch.zeros_like(o9))


def test_hopper_kernel_reads_strided_rope_queries_and_picks():
    """q may come with any strides (mla_prefill reads it in place), and its rope part reaches the kernel as a view:
    a rope query and picks whose last stride is not 1 give bitwise the results of contiguous copies."""
    from mla_bridge.kernels import triton_version

    if torch.cuda.get_device_capability() != (9, 0) or triton_version() != (3, 6):
        pytest.skip("the Hopper kernel runs on compute capability 9.0 with Triton 3.6")
    from mla_bridge.kernels.sparse_attention_sm90 import sparse_attention_sm90

    lat, q_lat, q_pe, idx, meta = _latent_case(40, 700, 64, 256, torch.bfloat16, 0.2, seed=7)
    wide_pe = torch.zeros(*q_pe.shape[:2], 2 * q_pe.shape[2], dtype=q_pe.dtype, device=dev())
    wide_pe[..., ::2] = q_pe
    wide_idx = torch.full((idx.shape[0], 2 * idx.shape[1]), -7, dtype=idx.dtype, device=dev())
    wide_idx[:, ::2] = idx
    got, want = [], []
    for pe, ix, into in ((wide_pe[..., ::2], wide_idx[:, ::2], got), (q_pe.contiguous(), idx.contiguous(), want)):
        assert (pe.stride(-1) != 1) == (into is got) and (ix.stride(-1) != 1) == (into is got)
        o = torch.empty(40, 64, 512, dtype=torch.bfloat16, device=dev())
        lse = torch.empty(40, 64, device=dev())
        sparse_attention_sm90(o, lse, q_lat, pe, ix, meta, lat, 192**-0.5)
        into.extend((o, lse))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.isfinite(want[1]).all()


def test_hopper_kernel_is_deterministic_across_launches():
    """The Hopper kernel's warpgroups hand tiles, row maxima and probabilities to each other through shared memory
    and mbarriers: a missing wait would show as results that differ between launches. 8 launches over 2048 tokens
    (every SM busy with many programs), queued behind a sleeping kernel so the host runs ahead: bitwise equal."""
    from mla_bridge.kernels import triton_version

    if torch.cuda.get_device_capability() != (9, 0) or triton_version() != (3, 6):
        pytest.skip("the Hopper kernel runs on compute capability 9.0 with Triton 3.6")
    from mla_bridge.kernels.sparse_attention_sm90 import sparse_attention_sm90

    lat, q_lat, q_pe, idx, meta = _latent_case(2048, 4096, 128, 2048, torch.bfloat16, 0.05, seed=11, spread=3.0)
    outs = []
    torch.cuda._sleep(50_000_000)
    for _ in range(8):
        o = torch.full((2048, 128, 512), float("nan"), dtype=torch.bfloat16, device=dev())
        lse = torch.full((2048, 128), float("nan"), device=dev())
        sparse_attention_sm90(o, lse, q_lat, q_pe, idx, meta, lat, 192**-0.5)
        outs.append((o, lse))
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0][0]).any() and torch.isfinite(outs[0][1]).all()
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])
