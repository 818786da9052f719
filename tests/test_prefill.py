"""mla_prefill (torch backend, CPU) equals unchunked float64 attention over each request's whole sequence.

The reference (tests.helpers.reference.mla_reference) reads the context back from the paged cache through block_table
token by token, up-projects it with kv_b_proj, and attends with an explicit mask (all context + causal among new
tokens). Spare cache blocks, the unused tail of each last block and block_table padding are poisoned, block tables
shuffled.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, ragged_prefill
from mla_bridge.plan import schedule_context_chunks

ATOL = 3e-5

# A mixed batch: requests without context, one without new tokens, one whose context spans several blocks of 64.
QUERY_LENS = [3, 4, 1, 0, 5, 2]
CONTEXT_LENS = [0, 37, 5, 9, 70, 0]
TOTAL_CONTEXT = sum(CONTEXT_LENS)  # 121


def run_case(ref, dims, query_lens, context_lens, block_size, chunk_tokens, fuse, seed=0, dtype=torch.float32):
    batch = ref.make_mla_batch(dims, query_lens, context_lens, block_size, seed=seed, dtype=dtype)
    ws = Workspace("cpu", chunk_tokens=chunk_tokens)
    plan = PrefillPlan.build(
        query_lens, context_lens, dims=dims, workspace=ws, block_size=block_size, dtype=dtype, fuse_context=fuse
    )
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    exp_out, exp_lse = ref.mla_reference(batch)
    return plan, batch, out, lse, exp_out, exp_lse


def budgets(block_size):
    return {
        "one_block": block_size,
        "splits_a_request": 23,  # cuts request 1 (37 tokens) and request 4 (70 tokens) in the middle
        "one_token": 1,
        "exactly_all": TOTAL_CONTEXT,
        "larger_than_all": 100_000,
    }


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("budget", ["one_block", "splits_a_request", "one_token", "exactly_all", "larger_than_all"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_chunked_equals_unchunked(ref, tiny_dims, block_size, budget, fuse):
    chunk_tokens = budgets(block_size)[budget]
    plan, batch, out, lse, exp_out, exp_lse = run_case(
        ref, tiny_dims, QUERY_LENS, CONTEXT_LENS, block_size, chunk_tokens, fuse, seed=block_size
    )
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)
    # The schedule that produced it is the one asked for.
    attended = sum(c for c, q in zip(CONTEXT_LENS, QUERY_LENS) if q)  # request 3 has no new tokens: never read
    fused = fuse and attended <= chunk_tokens
    assert plan.fused == fused
    if fused:
        assert plan.chunks == [] and plan.main_kv_indptr.tolist() == ref.cumsum0(
            [(c if q else 0) + q for c, q in zip(CONTEXT_LENS, QUERY_LENS)]
        )
        assert plan.num_gathered_context_tokens == attended == plan.ctx_req_ids.numel()
    else:
        assert len(plan.chunks) == math.ceil(TOTAL_CONTEXT / chunk_tokens)
        assert all(0 < c.num_tokens <= chunk_tokens for c in plan.chunks)
        assert sum(c.num_tokens for c in plan.chunks) == TOTAL_CONTEXT
        assert plan.main_kv_indptr.tolist() == plan.qo_indptr.tolist()
    assert plan.qo_indptr.dtype == torch.int32 and plan.qo_indptr.tolist() == ref.cumsum0(QUERY_LENS)


@pytest.mark.parametrize("fuse", [True, False])
def test_context_of_requests_without_new_tokens_is_never_read(ref, tiny_dims, fuse):
    """No query attends the context of a request without new tokens. The fused schedule gathered it anyway (its
    whole context, and counted it toward the one chunk): a request of 1 new token beside one of 0 new and 20000
    cached took 164x the chunked schedule's time for the same result. Now neither
    schedule reads it: with no other context the call is the main pass alone; beside attended context, only that
    fills the fused pass (and decides whether it fits)."""
    for q_lens, c_lens, budget, want_fused in (([1, 0], [0, 2000], 100_000, False), ([3, 0, 2], [5, 40, 7], 16, fuse)):
        batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=3)
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=tiny_dims,
            workspace=Workspace("cpu", chunk_tokens=budget),
            block_size=4,
            dtype=torch.float32,
            fuse_context=fuse,
        )
        assert plan.fused == want_fused and plan.num_context_tokens == sum(c_lens)
        attended = sum(c for q, c in zip(q_lens, c_lens) if q)
        phases = []
        out, lse = mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            batch.cache,
            batch.block_table,
            plan,
            return_lse=True,
            phase_hook=phases.append,
        )
        exp_out, exp_lse = ref.mla_reference(batch)
        ref.assert_out_close(out, exp_out, atol=ATOL)
        ref.assert_lse_close(lse, exp_lse, atol=ATOL)
        assert plan.out_shapes == (tuple(out.shape), tuple(lse.shape))  # what the JAX adapter's traced call declares
        if plan.fused:
            assert plan.ctx_req_ids.numel() == attended == plan.num_gathered_context_tokens
            assert int(plan.main_kv_indptr[-1]) == attended + sum(q_lens)
        elif attended == 0:
            assert plan.num_gathered_context_tokens == 0 and "gather" not in phases
            assert all(c.plan is None for c in plan.chunks)


def test_reference_reads_the_cache_correctly(ref, tiny_dims):
    """The float64 reference gives the same from the paged cache as from the unpaged latents (guards the builder)."""
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=5)
    a = ref.mla_reference(batch, use_cache=True)
    b = ref.mla_reference(batch, use_cache=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.isnan(batch.cache).any()  # the poison is there
    assert not torch.isnan(a[0]).any()


def test_context_changes_the_result(ref, tiny_dims):
    """Guards against a test that cannot fail: the context keys matter for the expected values."""
    batch = ref.make_mla_batch(tiny_dims, [3], [10], 4, seed=6)
    with_ctx, _ = ref.mla_reference(batch)
    no_ctx = ref.make_mla_batch(tiny_dims, [3], [0], 4, seed=6)
    no_ctx.q, no_ctx.kv_c, no_ctx.k_pe, no_ctx.w = batch.q, batch.kv_c, batch.k_pe, batch.w
    without, _ = ref.mla_reference(no_ctx)
    assert (with_ctx - without).abs().max() > 1e-2


@pytest.mark.parametrize("shuffle", [False, True])
def test_block_table_order(ref, tiny_dims, shuffle):
    q_lens, c_lens = [2, 3], [13, 6]
    batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=7, shuffle=shuffle, spare_blocks=5)
    if shuffle:
        assert batch.block_table[0, :4].tolist() != sorted(batch.block_table[0, :4].tolist())
    for chunk_tokens, fuse in ((5, False), (1000, True), (1000, False)):
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=tiny_dims,
            workspace=Workspace("cpu", chunk_tokens=chunk_tokens),
            block_size=4,
            dtype=torch.float32,
            fuse_context=fuse,
        )
        out, lse = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
        )
        exp_out, exp_lse = ref.mla_reference(batch)
        ref.assert_out_close(out, exp_out, atol=ATOL)
        ref.assert_lse_close(lse, exp_lse, atol=ATOL)


@pytest.mark.parametrize("fuse", [True, False])
def test_no_context_at_all(ref, tiny_dims, fuse):
    plan, batch, out, lse, exp_out, exp_lse = run_case(ref, tiny_dims, [4, 1, 3], [0, 0, 0], 16, 8, fuse)
    assert not plan.fused and plan.chunks == [] and plan.num_plans == 1
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


@pytest.mark.parametrize("fuse", [True, False])
def test_single_token_requests_with_context(ref, tiny_dims, fuse):
    plan, batch, out, lse, exp_out, exp_lse = run_case(ref, tiny_dims, [1, 1, 1, 1], [0, 7, 1, 30], 8, 12, fuse, seed=3)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_plan_is_shared_by_layers(ref, tiny_dims):
    """One plan, several layers (different weights and caches): every layer right, nothing re-planned."""
    q_lens, c_lens = [3, 2, 4], [9, 0, 14]
    ws = Workspace("cpu", chunk_tokens=6)
    plan = PrefillPlan.build(q_lens, c_lens, dims=tiny_dims, workspace=ws, block_size=4, dtype=torch.float32)
    n_plans = plan.num_plans
    assert n_plans == 1 + math.ceil(23 / 6)
    for layer in range(3):
        batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=50 + layer)
        out = mla_prefill(batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan)
        ref.assert_out_close(out, ref.mla_reference(batch)[0], atol=ATOL)
    assert plan.num_plans == n_plans


def test_k_pe_with_head_axis_and_out_buffer(ref, tiny_dims):
    q_lens, c_lens = [3, 2], [5, 11]
    batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=8)
    plan = PrefillPlan.build(
        q_lens, c_lens, dims=tiny_dims, workspace=Workspace("cpu", chunk_tokens=4), block_size=4, dtype=torch.float32
    )
    out = torch.full((5, tiny_dims.num_heads, tiny_dims.v_head_dim), 3.0)
    got = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe.unsqueeze(1), batch.w, batch.cache, batch.block_table, plan, out=out
    )
    assert got is out
    ref.assert_out_close(out, ref.mla_reference(batch)[0], atol=ATOL)


def test_non_contiguous_inputs(ref, tiny_dims):
    """q as a transposed view, kv_c / k_pe as column slices of one fused projection output, a strided out."""
    q_lens, c_lens = [3, 4], [6, 9]
    d = tiny_dims
    batch = ref.make_mla_batch(d, q_lens, c_lens, 4, seed=9)
    t = sum(q_lens)
    q = batch.q.transpose(0, 1).contiguous().transpose(0, 1)
    fused = torch.cat([torch.randn(t, 3), batch.kv_c, batch.k_pe], 1)  # like a q_a/kv_a projection output
    kv_c, k_pe = fused[:, 3 : 3 + d.kv_lora_rank], fused[:, 3 + d.kv_lora_rank :]
    out_t = torch.zeros(d.num_heads, t, d.v_head_dim)
    assert not q.is_contiguous() and not kv_c.is_contiguous() and not k_pe.is_contiguous()
    for fuse, chunk in ((True, 100), (False, 5)):
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=d,
            workspace=Workspace("cpu", chunk_tokens=chunk),
            block_size=4,
            dtype=torch.float32,
            fuse_context=fuse,
        )
        out_t.zero_()
        mla_prefill(q, kv_c, k_pe, batch.w, batch.cache, batch.block_table, plan, out=out_t.transpose(0, 1))
        ref.assert_out_close(out_t.transpose(0, 1), ref.mla_reference(batch)[0], atol=ATOL)


def test_real_dims_deepseek_v2_lite(ref):
    """DeepSeek-V2-Lite's real sizes (16 heads, 512/128/64/128) and its yarn scale, chunked and fused."""
    dims = MLADims.deepseek_v2_lite()
    q_lens, c_lens = [4, 2], [19, 0]
    batch = ref.make_mla_batch(dims, q_lens, c_lens, 16, seed=10)
    exp_out, exp_lse = ref.mla_reference(batch)
    for chunk, fuse in ((16, False), (7, False), (64, True)):
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=dims,
            workspace=Workspace("cpu", chunk_tokens=chunk),
            block_size=16,
            dtype=torch.float32,
            fuse_context=fuse,
        )
        out, lse = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
        )
        assert out.shape == (6, 16, 128)
        ref.assert_out_close(out, exp_out, atol=1e-4)
        ref.assert_lse_close(lse, exp_lse, atol=1e-4)


def test_bf16_on_cpu(ref, tiny_dims):
    q_lens, c_lens = [3, 5], [12, 7]
    batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=12, dtype=torch.bfloat16)
    exp_out, exp_lse = ref.mla_reference(batch)
    for chunk, fuse in ((8, False), (100, True)):
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=tiny_dims,
            workspace=Workspace("cpu", chunk_tokens=chunk),
            block_size=4,
            dtype=torch.bfloat16,
            fuse_context=fuse,
        )
        out, lse = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
        )
        assert out.dtype == torch.bfloat16
        ref.assert_out_close(out, exp_out, atol=3e-2)  # bf16 up-projection and output roundings
        ref.assert_lse_close(lse, exp_lse, atol=3e-2)


@pytest.mark.parametrize(
    "context_lens,budget,expected",
    [
        ([8, 0], 4, [[(0, 0, 4)], [(0, 4, 8)]]),
        ([3, 9], 4, [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)], [(1, 5, 9)]]),
        ([0, 0], 4, []),
        ([2, 0, 2], 4, [[(0, 0, 2), (2, 0, 2)]]),
        ([5], 100, [[(0, 0, 5)]]),
    ],
)
def test_schedule_context_chunks(context_lens, budget, expected):
    assert schedule_context_chunks(context_lens, budget) == expected


def test_chunk_rows_and_plans(tiny_dims):
    plan = PrefillPlan.build(
        [2, 3, 0, 4],
        [4, 0, 6, 3],
        dims=tiny_dims,
        workspace=Workspace("cpu", chunk_tokens=5),
        block_size=2,
        dtype=torch.float32,
    )
    # chunks: [(0,0,4),(2,0,1)], [(2,1,6)], [(3,0,3)]
    assert [c.spans for c in plan.chunks] == [((0, 0, 4), (2, 0, 1)), ((2, 1, 6),), ((3, 0, 3),)]
    c0, c1, c2 = plan.chunks
    assert (c0.req_start, c0.req_end, c0.q_start, c0.q_end) == (0, 3, 0, 5)
    assert c0.plan.kv_indptr.tolist() == [0, 4, 4, 5] and c0.plan.qo_indptr.tolist() == [0, 2, 5, 5]
    assert not c0.plan.spec.causal
    assert c1.plan is None  # request 2 has no new tokens: nothing to compute
    assert (c2.q_start, c2.q_end) == (5, 9) and c2.plan.kv_indptr.tolist() == [0, 3]
    assert c0.req_ids.tolist() == [0, 0, 0, 0, 2] and c0.positions.tolist() == [0, 1, 2, 3, 0]
    assert plan.num_plans == 3 and plan.main.spec.causal


@pytest.mark.parametrize(
    "rows,expected",
    [
        ([(0, 5), (5, 5), (5, 9)], [(0, None), (0, None), (5, (0, 9))]),  # tiling rows, an empty chunk between: 1 round
        ([(0, 4), (2, 6)], [(0, (0, 4)), (0, (2, 6))]),  # a request's rows in both: a new round
        ([(0, 4), (0, 4), (0, 4)], [(0, (0, 4))] * 3),  # one request's context over three chunks: a merge each
        ([(0, 3), (5, 8), (8, 9)], [(0, (0, 3)), (0, None), (3, (5, 9))]),  # a gap of rows no chunk writes: a new round
        ([(3, 3)], [(0, None)]),
        ([], []),
    ],
)
def test_merge_rounds(rows, expected):
    from mla_bridge.plan import _merge_rounds

    assert _merge_rounds(rows) == expected


def test_chunk_merge_rounds_in_a_plan(tiny_dims):
    """The chunks of test_chunk_rows_and_plans tile rows 0..9 (request 2, split between chunks 0 and 1, has no new
    tokens): one merge round, one merge; a request with new tokens split between chunks starts a new round."""
    plan = PrefillPlan.build(
        [2, 3, 0, 4],
        [4, 0, 6, 3],
        dims=tiny_dims,
        workspace=Workspace("cpu", chunk_tokens=5),
        block_size=2,
        dtype=torch.float32,
    )
    assert [(c.part_row, c.merge_rows) for c in plan.chunks] == [(0, None), (0, None), (5, (0, 9))]
    assert plan.num_merges == 1 and plan.partial_rows == 9
    plan = PrefillPlan.build(
        [2, 3, 1],
        [4, 7, 0],
        dims=tiny_dims,
        workspace=Workspace("cpu", chunk_tokens=5),
        block_size=2,
        dtype=torch.float32,
    )  # chunks: [(0,0,4),(1,0,1)], [(1,1,6)], [(1,6,7)]
    assert [(c.q_start, c.q_end, c.part_row, c.merge_rows) for c in plan.chunks] == [
        (0, 5, 0, (0, 5)),
        (2, 5, 0, (2, 5)),
        (2, 5, 0, (2, 5)),
    ]
    assert plan.num_merges == 3 and plan.partial_rows == 5


def test_merge_rounds_cover_every_chunk_row_once_random(tiny_dims):
    """Random batches and budgets: within a round the chunks' partial rows tile the round's rows exactly, and every
    query row is merged as many times as chunks cover it (what one merge per chunk did)."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        b = rng.randint(1, 8)
        q_lens = [rng.choice([0, 0, 1, 3, 7]) for _ in range(b)]
        c_lens = [rng.choice([0, 0, 1, 5, 13]) for _ in range(b)]
        if not sum(c_lens):
            continue
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=tiny_dims,
            block_size=2,
            dtype=torch.float32,
            workspace=Workspace("cpu", chunk_tokens=rng.randint(1, 20)),
            fuse_context=False,
        )
        covered, merged = [0] * plan.num_tokens, [0] * plan.num_tokens
        round_parts = []
        for c in plan.chunks:
            if c.plan is None:
                assert c.merge_rows is None
                continue
            round_parts.append((c.part_row, c.q_end - c.q_start, c.q_start))
            for r in range(c.q_start, c.q_end):
                covered[r] += 1
            if c.merge_rows is not None:
                start, stop = c.merge_rows
                assert stop - start <= plan.partial_rows
                # the round's partials tile [0, stop - start), each at its rows' offset from the round's start
                assert sorted((p, p + n) for p, n, _ in round_parts) == [
                    (q - start, q - start + n) for p, n, q in sorted(round_parts, key=lambda x: x[2])
                ]
                assert sum(n for _, n, _ in round_parts) == stop - start
                for r in range(start, stop):
                    merged[r] += 1
                round_parts = []
        assert round_parts == [] and covered == merged, (q_lens, c_lens)


@pytest.mark.parametrize(
    "block_size,budget",
    [(1, "one_block"), (16, "one_block"), (16, "splits_a_request"), (64, "one_token"), (1, "splits_a_request")],
)
def test_merge_rounds_equal_one_merge_per_chunk_bitwise(ref, tiny_dims, block_size, budget):
    """mla_prefill with merge rounds gives the bits of the same kernels with one merge per chunk (the pipeline before
    rounds, written out here): every row is merged once per chunk that covers it either way."""
    from mla_bridge import kv as KV
    from mla_bridge.merge import merge_planned_, select_merge

    chunk_tokens = budgets(block_size)[budget]
    plan, batch, out, lse, _, _ = run_case(
        ref, tiny_dims, QUERY_LENS, CONTEXT_LENS, block_size, chunk_tokens, False, seed=block_size
    )
    planned = [c for c in plan.chunks if c.plan is not None]
    weight = __import__("mla_bridge").prepare_kv_b_proj(batch.w, tiny_dims)
    k_pe = batch.k_pe.reshape(batch.kv_c.shape[0], -1)
    inputs = KV.KVInputs(weight, batch.kv_c, k_pe, batch.cache, batch.block_table, impl="separate")
    k, v = KV.new_tokens_kv(inputs)
    want_out, want_lse = plan.main.run(batch.q, k, v)
    merge = select_merge((1, tiny_dims.num_heads, tiny_dims.v_head_dim), plan.dtype, "cpu")
    for c in planned:
        k, v = KV.chunk_kv(c, inputs)
        part_out, part_lse = c.plan.run(batch.q[c.q_start : c.q_end], k, v, lse_base="log2")
        merge_planned_(
            merge, want_out[c.q_start : c.q_end], want_lse[c.q_start : c.q_end], part_out, part_lse, lse_b_base="log2"
        )
    assert plan.num_merges < len(planned) or budget == "splits_a_request"
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_prefill_memory_bytes_follows_the_schedule():
    """The documented peak-memory formula: one pass over context + new keys when fused; the largest of the main
    pass and each chunk pass otherwise (hand-computed here for V2-Lite dims, bf16)."""
    from mla_bridge import MLADims, PrefillPlan, Workspace
    from mla_bridge.prefill import prefill_memory_bytes

    d = MLADims.deepseek_v2_lite()
    e, lat, p, h = 2, 576, 320, 16
    q_lens, c_lens = [100, 50], [300, 0]
    fixed = h * 256 * 512 * e + 150 * h * (128 * e + 4)  # the split-layout weight (prepared per call), out, lse
    fused = PrefillPlan.build(
        q_lens, c_lens, dims=d, workspace=Workspace("cpu", chunk_tokens=1000), block_size=16, dtype=torch.bfloat16
    )
    assert prefill_memory_bytes(fused) == fixed + 450 * lat * e + 300 * (lat * e + 24) + 450 * h * p * e
    chunked = PrefillPlan.build(
        q_lens, c_lens, dims=d, workspace=Workspace("cpu", chunk_tokens=128), block_size=16, dtype=torch.bfloat16
    )
    # request 0's context is split over 3 chunks: its 100 rows are carried in float32 between their merges; a chunk's
    # torch gather makes its per-token indices in the call (ChunkRows.INDEX_BYTES = 32 a row)
    assert chunked.running_rows == 100
    chunk = 128 * lat * e + 128 * (lat * e + 24 + 32) + 128 * h * p * e + 100 * h * (128 * e + 12) + 100 * h * 128 * 4
    assert prefill_memory_bytes(chunked) == fixed + max(150 * lat * e + 150 * h * p * e, chunk)
    assert prefill_memory_bytes(chunked) < prefill_memory_bytes(fused)
    # each request's context in a chunk of its own: one merge round, every row merged once, no float32 running rows
    each = PrefillPlan.build(
        q_lens, [128, 128], dims=d, workspace=Workspace("cpu", chunk_tokens=128), block_size=16, dtype=torch.bfloat16
    )
    assert each.running_rows == 0 and each.num_merges == 1
    chunk = 128 * lat * e + 128 * (lat * e + 24 + 32) + 128 * h * p * e + 150 * h * (128 * e + 12)
    assert prefill_memory_bytes(each) == fixed + max(150 * lat * e + 150 * h * p * e, chunk)


def test_nan_in_q_is_not_hidden_by_either_schedule():
    """NaN in a query row gives NaN in that row's out and lse, fused or chunked (never out 0 / lse -inf)."""
    d = MLADims(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 2, 16, generator=g)
    q[0, 0, 0] = float("nan")
    kv_c, k_pe = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
    w = torch.randn(*d.kv_b_proj_shape, generator=g) * 0.1
    cache = torch.randn(8, 4, d.latent_dim, generator=g)
    block_table = torch.arange(8).view(2, 4)
    for chunk_tokens in (64, 4):
        plan = PrefillPlan.build(
            [5, 3],
            [12, 0],
            dims=d,
            workspace=Workspace("cpu", chunk_tokens=chunk_tokens),
            block_size=4,
            dtype=torch.float32,
        )
        out, lse = mla_prefill(q, kv_c, k_pe, w, cache, block_table, plan, return_lse=True)
        assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0]), (plan, out[0, 0], lse[0, 0])
        assert torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all()


def test_prefill_memory_bytes_checks_its_arguments():
    from mla_bridge import MLADims, PrefillPlan, Workspace
    from mla_bridge.prefill import prefill_memory_bytes

    with pytest.raises(TypeError, match="^plan must be a PrefillPlan, got NoneType"):
        prefill_memory_bytes(None)
    plan = PrefillPlan.build(
        [4], [0], dims=MLADims.deepseek_v2_lite(), workspace=Workspace("cpu"), block_size=16, dtype=torch.bfloat16
    )
    with pytest.raises(TypeError, match="^prepared_weight must be a bool \\(True or False\\), got .* of type str"):
        prefill_memory_bytes(plan, prepared_weight="no")


# ---------------------------------------------------------------------------------------------------------------
# rows without keys in a pass, NaN-filled buffers, zero-length queries, q/kv_c/k_pe off by one row
# ---------------------------------------------------------------------------------------------------------------


def run_prefill(ref, dims, q_lens, c_lens, block_size, chunk_tokens, fuse, seed=0):
    batch = ref.make_mla_batch(dims, q_lens, c_lens, block_size, seed=seed)
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace("cpu", chunk_tokens=chunk_tokens),
        block_size=block_size,
        dtype=torch.float32,
        fuse_context=fuse,
    )
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    return batch, plan, out, lse


def main_pass_alone(batch, rows):
    """The causal main pass of some requests' new tokens alone (float32 up-projection in the test, torch backend)."""
    d = batch.dims
    q, kv_c, k_pe = batch.q[rows], batch.kv_c[rows], batch.k_pe[rows]
    kv = (kv_c @ batch.w.t()).view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
    k = torch.cat([kv[..., : d.qk_nope_head_dim], k_pe.unsqueeze(1).expand(-1, d.num_heads, -1)], -1)
    v = kv[..., d.qk_nope_head_dim :].contiguous()
    n = q.shape[0]
    return ragged_prefill(q, k, v, [0, n], [0, n], causal=True, sm_scale=d.softmax_scale, backend="torch")


def test_request_without_context_keeps_its_main_pass(ref, tiny_dims):
    """new [3, 3], context [8, 0], chunk budget 4, block size 4: request 1 has no key in any chunk."""
    batch, plan, out, lse = run_prefill(ref, tiny_dims, [3, 3], [8, 0], 4, 4, fuse=False)
    assert not plan.fused and len(plan.chunks) == 2
    alone_out, alone_lse = main_pass_alone(batch, slice(3, 6))
    torch.testing.assert_close(out[3:], alone_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[3:], alone_lse, atol=1e-6, rtol=1e-6)
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_request_with_no_keys_inside_a_chunk(ref, tiny_dims):
    """context [2, 0, 2], budget 4: the one chunk spans requests 0..2, request 1 has zero keys in it."""
    batch, plan, out, lse = run_prefill(ref, tiny_dims, [3, 3, 2], [2, 0, 2], 4, 4, fuse=False)
    (chunk,) = plan.chunks
    assert chunk.plan.kv_indptr.tolist() == [0, 2, 2, 4]
    alone_out, alone_lse = main_pass_alone(batch, slice(3, 6))
    torch.testing.assert_close(out[3:6], alone_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[3:6], alone_lse, atol=1e-6, rtol=1e-6)
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


@pytest.mark.parametrize(
    "q_lens,c_lens,budget,fuse",
    [
        ([2, 2], [3, 9], 4, False),  # request 0 has keys only in the first chunk
        ([2, 2, 2], [3, 0, 9], 4, False),  # request 1 has no key inside the first chunk
        ([2, 2], [3, 9], 100, True),  # fused schedule: one NaN-filled latent buffer for context + new
    ],
)
def test_nan_filled_buffers(ref, tiny_dims, nan_empty, monkeypatch, q_lens, c_lens, budget, fuse):
    batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=2)
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=tiny_dims,
        workspace=Workspace("cpu", chunk_tokens=budget),
        block_size=4,
        dtype=torch.float32,
        fuse_context=fuse,
    )
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    assert len(nan_empty) >= 3, "the NaN-filled torch.empty was not used: the test would prove nothing"
    monkeypatch.undo()
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


@pytest.mark.parametrize("fuse,budget", [(True, 100), (False, 2), (False, 100)])
@pytest.mark.parametrize("q_lens,c_lens", [([1, 0, 1], [2, 0, 4]), ([0, 0, 0, 1], [2, 0, 3, 0])])
def test_zero_length_queries_in_mla_prefill(ref, tiny_dims, q_lens, c_lens, fuse, budget):
    """The same key lengths as MLA batches (keys = context + new): [3, 0, 5] and [2, 0, 3, 1]."""
    batch, plan, out, lse = run_prefill(ref, tiny_dims, q_lens, c_lens, 4, budget, fuse, seed=7)
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


@pytest.mark.parametrize("delta", [-1, 1])
@pytest.mark.parametrize("which", ["q", "kv_c", "k_pe"])
def test_prefill_off_by_one_rows_are_refused(ref, tiny_dims, which, delta, monkeypatch):
    q_lens, c_lens = [3, 2], [5, 6]
    batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=12)
    plan = PrefillPlan.build(
        q_lens, c_lens, dims=tiny_dims, workspace=Workspace("cpu", chunk_tokens=4), block_size=4, dtype=torch.float32
    )
    args = dict(q=batch.q, kv_c=batch.kv_c, k_pe=batch.k_pe)
    x = args[which]
    args[which] = torch.randn(x.shape[0] + delta, *x.shape[1:])
    out = torch.full((5, tiny_dims.num_heads, tiny_dims.v_head_dim), 7.0)
    ran = []
    monkeypatch.setattr(type(plan.main), "run", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError, match=rf"^{which} must be \[T=5"):
        mla_prefill(args["q"], args["kv_c"], args["k_pe"], batch.w, batch.cache, batch.block_table, plan, out=out)
    assert ran == [] and torch.equal(out, torch.full_like(out, 7.0))
