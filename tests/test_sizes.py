"""Sizes that cannot fit are refused up front: lengths whose sums leave int32 get a ValueError
naming the argument and the limit, in O(requests) time, before any index tensor or plan is made."""

from __future__ import annotations

import time

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace
from mla_bridge.ragged import indptr_from_lens

INT32_MAX = 2**31 - 1


@pytest.fixture
def dims():
    return MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_indptr_from_lens_refuses_a_sum_beyond_int32_naming_the_argument():
    assert indptr_from_lens([INT32_MAX - 1, 1]).tolist() == [0, INT32_MAX - 1, INT32_MAX]  # the limit itself is fine
    with pytest.raises(ValueError, match=r"query_lens sum to 2147483648 tokens.*2\*\*31 - 1 = 2147483647"):
        indptr_from_lens([INT32_MAX, 1], name="query_lens")
    with pytest.raises(ValueError, match=r"^lens sum to 1000000000000 tokens"):
        indptr_from_lens(torch.tensor([10**12]))


@pytest.mark.parametrize(
    "q_lens,c_lens,name,total",
    [
        ([10**12], [0], "query_lens", 10**12),  # used to say "qo_indptr[1]=-727379968": an argument never passed
        ([5], [2**31], "context_lens", 2**31),  # used to run 50 s, then MemoryError
        ([5], [10**12], "context_lens", 10**12),  # used to be OOM-killed
        ([1] * 3, [2**30, 2**30, 0], "context_lens", 2**31),
    ],
)
@pytest.mark.parametrize("device_fuse", [True, False])
def test_plan_refuses_length_sums_beyond_int32_at_once(dims, q_lens, c_lens, name, total, device_fuse):
    ws = Workspace("cpu")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^{name} sum to {total} tokens.*2147483647"):
        PrefillPlan.build(
            q_lens, c_lens, dims=dims, workspace=ws, block_size=16, dtype=torch.float32, fuse_context=device_fuse
        )
    assert time.perf_counter() - t0 < 1.0  # O(requests): no per-token or per-chunk work before the refusal


def test_plan_at_the_int32_edge_of_query_lens_is_not_refused_by_the_length_check(dims):
    """A sum of exactly 2**31 - 1 passes the length check (whatever happens after it is another matter): the
    check is on the sum, not on a rounder number."""
    from mla_bridge.checks import check_length_sums

    check_length_sums([INT32_MAX], [INT32_MAX])
    with pytest.raises(ValueError, match="context_lens"):
        check_length_sums([0], [INT32_MAX + 1])


@pytest.mark.gpu
def test_cuda_plan_host_memory_stays_per_chunk_for_a_long_context():
    """On CUDA a chunked plan makes no per-token index tensor (the gathers read each pass's device kv_indptr): planning
    10**8 context tokens (1526 chunks of 65536) holds O(requests + chunks) host memory (as the CPU device's plan:
    test_cpu_plan_holds_no_host_memory_per_context_token)."""
    import tracemalloc

    dims = MLADims.deepseek_v2_lite()
    ws = Workspace("cuda")
    tracemalloc.start()
    try:
        plan = PrefillPlan.build([5], [10**8], dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(plan.chunks) == -(-(10**8) // ws.chunk_tokens)
    assert plan.chunks[-1].positions.device.type == "cuda"
    assert peak < 64 * 2**20, f"{peak / 2**20:.1f} MiB of host memory while planning"


def test_cpu_plan_holds_no_host_memory_per_context_token(dims):
    """A chunked plan on the CPU device made 16 bytes of host indices per context token at build time (one numpy
    expansion of the whole context): ``PrefillPlan.build([1], [2**30])`` and ``([0], [2**30])`` -- a request with no
    new tokens, whose context is never read -- died in numpy with "Unable to allocate 16.0 GiB". Now a chunk's rows are
    its host kv_indptr, the per-token indices made per chunk in each call (as on CUDA): planning 2**24 context tokens
    traces O(chunks) host memory (it traced 384 MiB), and both plans of 2**30 tokens build."""
    import tracemalloc

    ws = Workspace("cpu")
    tracemalloc.start()
    try:
        plan = PrefillPlan.build([1], [2**24], dims=dims, workspace=ws, block_size=64, dtype=torch.float32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(plan.chunks) == 2**24 // ws.chunk_tokens == 256
    assert peak < 16 * 2**20, f"{peak / 2**20:.1f} MiB of host memory while planning"
    for q_lens in ([1], [0]):
        plan = PrefillPlan.build(q_lens, [2**30], dims=dims, workspace=ws, block_size=64, dtype=torch.float32)
        assert len(plan.chunks) == 2**30 // ws.chunk_tokens and not plan.fused
        assert all(c.rows.indices is None for c in plan.chunks)
        assert plan.num_gathered_context_tokens == (2**30 if q_lens[0] else 0)
        last = plan.chunks[-1]  # its rows, made on request from its kv_indptr
        assert last.req_ids.tolist() == [0] * ws.chunk_tokens
        assert last.positions.tolist() == list(range(2**30 - ws.chunk_tokens, 2**30))


def test_cpu_call_of_a_plan_whose_context_is_never_read_allocates_nothing_for_it(dims):
    """mla_prefill of ``PrefillPlan.build([0], [2**30])`` on the CPU: no pass reads the context, so the call gathers
    nothing (a cache of 2**30 tokens that holds no memory: an expanded view), returns an empty out, and its peak by
    prefill_memory_bytes is that of the weight alone."""
    from mla_bridge import mla_prefill
    from mla_bridge.prefill import prefill_memory_bytes

    plan = PrefillPlan.build([0], [2**30], dims=dims, workspace=Workspace("cpu"), block_size=64, dtype=torch.float32)
    blocks = 2**30 // 64
    cache = torch.zeros(1, 64, dims.latent_dim).expand(blocks, 64, dims.latent_dim)
    table = torch.zeros(1, 1, dtype=torch.int32).expand(1, blocks)
    q = torch.empty(0, dims.num_heads, dims.head_dim_qk)
    out, lse = mla_prefill(
        q,
        torch.empty(0, dims.kv_lora_rank),
        torch.empty(0, dims.qk_rope_head_dim),
        torch.randn(*dims.kv_b_proj_shape),
        cache,
        table,
        plan,
        return_lse=True,
    )
    assert out.shape == (0, dims.num_heads, dims.v_head_dim) and lse.shape == (0, dims.num_heads)
    from mla_bridge.weights import prepared_weight_elements

    assert prefill_memory_bytes(plan) == prepared_weight_elements(dims) * 4


def test_a_plan_of_more_context_chunks_than_it_may_hold_is_refused_up_front(dims, monkeypatch):
    """Each context chunk is host bookkeeping (about 1 KiB) and a few kernels per layer, so the chunk count is
    bounded (plan.MAX_CONTEXT_CHUNKS): beyond it build and PlanCache.get refuse at once, naming context_lens, the
    chunk budget, the chunk count and the host bytes it would need, before any chunk or plan is made (the limit
    lowered here to 4; then the default with 2**31 - 1 tokens in chunks of 1, on the CPU and a fake CUDA device). A
    context that fits one chunk is fused and never refused."""
    import mla_bridge.plan as plan_mod
    from mla_bridge import PlanCache

    monkeypatch.setattr(plan_mod, "MAX_CONTEXT_CHUNKS", 4)
    ws = Workspace("cpu", chunk_tokens=4)
    kw = dict(dims=dims, workspace=ws, block_size=4, dtype=torch.float32)
    assert len(PrefillPlan.build([1, 2], [9, 7], **kw).chunks) == 4  # 16 tokens: 4 chunks, the limit itself
    match = (
        r"^context_lens sum to 17 tokens: 5 context chunks of at most chunk_tokens=4 tokens, more than a plan "
        r"holds \(4, MAX_CONTEXT_CHUNKS\); they would take about 5120 bytes of host memory.*chunk_tokens >= 5"
    )
    for build in (PrefillPlan.build, PlanCache().get):
        with pytest.raises(ValueError, match=match):
            build([1, 2], [9, 8], **kw)
    assert PrefillPlan.build([1, 2], [0, 4], **kw).fused  # one chunk's worth: fused, no chunk at all
    monkeypatch.undo()
    for device in ("cpu", "fake cuda"):
        if device == "fake cuda":
            from tests.helpers.fake_device import install_planning

            install_planning(monkeypatch.setattr, object, [], expand="torch")
        ws = Workspace("cuda:0" if device == "fake cuda" else "cpu", chunk_tokens=1)
        t0 = time.perf_counter()
        with pytest.raises(
            ValueError,
            match=r"^context_lens sum to 2147483647 tokens: 2147483647 context chunks .*"
            r"about 2048.0 GiB of host memory",
        ):
            PrefillPlan.build([1], [INT32_MAX], dims=dims, workspace=ws, block_size=16, dtype=torch.float32)
        assert time.perf_counter() - t0 < 1.0  # refused before any per-chunk work


@pytest.mark.gpu
def test_cuda_plans_of_2_to_the_30_context_tokens_build_and_a_context_never_read_costs_nothing():
    """``PrefillPlan.build([1], [2**30])`` and ``([0], [2**30])`` on CUDA: O(chunks) host memory while planning, no
    per-token tensor; mla_prefill of the second (no new tokens, its context never read) over a cache of 2**30 tokens
    that holds no memory (an expanded view) gathers nothing and returns an empty out."""
    import tracemalloc

    from mla_bridge import mla_prefill

    dims = MLADims.deepseek_v2_lite()
    ws = Workspace("cuda")
    for q_lens in ([1], [0]):
        tracemalloc.start()
        try:
            plan = PrefillPlan.build(q_lens, [2**30], dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(plan.chunks) == 2**30 // ws.chunk_tokens and plan.ctx_req_ids is None
        assert all(c.rows.indices is None for c in plan.chunks)
        assert peak < 64 * 2**20, f"{peak / 2**20:.1f} MiB of host memory while planning"
    dev = ws.device
    blocks = 2**30 // 64
    cache = torch.zeros(1, 64, dims.latent_dim, dtype=torch.bfloat16, device=dev).expand(blocks, 64, dims.latent_dim)
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev).expand(1, blocks)
    w = torch.randn(*dims.kv_b_proj_shape, device=dev).to(torch.bfloat16)
    out = mla_prefill(
        torch.empty(0, dims.num_heads, dims.head_dim_qk, dtype=torch.bfloat16, device=dev),
        torch.empty(0, dims.kv_lora_rank, dtype=torch.bfloat16, device=dev),
        torch.empty(0, dims.qk_rope_head_dim, dtype=torch.bfloat16, device=dev),
        w,
        cache,
        table,
        plan,
    )
    torch.cuda.synchronize()
    assert out.shape == (0, dims.num_heads, dims.v_head_dim)
