"""Sizes that cannot fit are refused up front (issue 9, item 3): lengths whose sums leave int32 get a ValueError
naming the argument and the limit, in O(requests) time, before any index tensor or plan is made."""

from __future__ import annotations

import time

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace
from mla_bridge.ragged import indptr_from_lens

INT32_MAX = 2 ** 31 - 1


@pytest.fixture
def dims():
    return MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_indptr_from_lens_refuses_a_sum_beyond_int32_naming_the_argument():
    assert indptr_from_lens([INT32_MAX - 1, 1]).tolist() == [0, INT32_MAX - 1, INT32_MAX]  # the limit itself is fine
    with pytest.raises(ValueError, match=r"query_lens sum to 2147483648 tokens.*2\*\*31 - 1 = 2147483647"):
        indptr_from_lens([INT32_MAX, 1], name="query_lens")
    with pytest.raises(ValueError, match=r"^lens sum to 1000000000000 tokens"):
        indptr_from_lens(torch.tensor([10 ** 12]))


@pytest.mark.parametrize("q_lens,c_lens,name,total", [
    ([10 ** 12], [0], "query_lens", 10 ** 12),  # used to say "qo_indptr[1]=-727379968": an argument never passed
    ([5], [2 ** 31], "context_lens", 2 ** 31),  # used to run 50 s, then MemoryError
    ([5], [10 ** 12], "context_lens", 10 ** 12),  # used to be OOM-killed
    ([1] * 3, [2 ** 30, 2 ** 30, 0], "context_lens", 2 ** 31),
])
@pytest.mark.parametrize("device_fuse", [True, False])
def test_plan_refuses_length_sums_beyond_int32_at_once(dims, q_lens, c_lens, name, total, device_fuse):
    ws = Workspace("cpu")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^{name} sum to {total} tokens.*2147483647"):
        PrefillPlan.build(q_lens, c_lens, dims=dims, workspace=ws, block_size=16, dtype=torch.float32,
                          fuse_context=device_fuse)
    assert time.perf_counter() - t0 < 1.0  # O(requests): no per-token or per-chunk work before the refusal


def test_plan_at_the_int32_edge_of_query_lens_is_not_refused_by_the_length_check(dims):
    """A sum of exactly 2**31 - 1 passes the length check (whatever happens after it is another matter): the
    check is on the sum, not on a rounder number."""
    from mla_bridge.plan import _check_length_sums

    _check_length_sums([INT32_MAX], [INT32_MAX])
    with pytest.raises(ValueError, match="context_lens"):
        _check_length_sums([0], [INT32_MAX + 1])


@pytest.mark.gpu
def test_cuda_plan_host_memory_stays_per_chunk_for_a_long_context():
    """On CUDA a chunked plan makes no per-token index tensor (the gathers read each pass's device kv_indptr): planning
    10**8 context tokens (1526 chunks of 65536) holds O(requests + chunks) host memory (the CPU device holds 16 bytes
    per context token by design)."""
    import tracemalloc

    dims = MLADims.deepseek_v2_lite()
    ws = Workspace("cuda")
    tracemalloc.start()
    try:
        plan = PrefillPlan.build([5], [10 ** 8], dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(plan.chunks) == -(-10 ** 8 // ws.chunk_tokens)
    assert plan.chunks[-1].positions.device.type == "cuda"
    assert peak < 64 * 2 ** 20, f"{peak / 2**20:.1f} MiB of host memory while planning"
