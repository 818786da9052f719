"""bf16 mla_prefill (torch backend, CPU): the error against float64 does not grow with the number of context chunks.

A row whose request's context is split over several chunks is merged once per chunk; its running out is held in
float32 between those merges and rounded to the plan's dtype once, by its last merge (the plan's
:attr:`mla_bridge.PrefillPlan.merge_steps`). Before, it was rounded to bf16 at every merge and the error grew with
the chunk count (64 new + 512 cached tokens: 7.1e-3 fused, 2.4e-2 at 16-token chunks). Asserted here: on those
cases the worst error at any chunk count is at most 1.5x the fused schedule's, or at most 2**-8 x max |reference|;
and for any chunk count out is its own partials merged in float64 and rounded once, within one ulp. (What remains
beyond the fused error is the rounding of each chunk's partial out to bf16, which the attention kernels do: at most
half an ulp of that partial each, weighted by its share, however many chunks there are.)
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, prepare_kv_b_proj
from tests.helpers.chunk_precision import assert_rounded_once, partials_merged_once

BF16 = torch.bfloat16
V2 = MLADims.deepseek_v2_lite()


def bound(fused_err: float, ref_out: torch.Tensor) -> float:
    return max(1.5 * fused_err, 2.0**-8 * float(ref_out.abs().max()))


def max_err(out: torch.Tensor, ref_out: torch.Tensor) -> float:
    return float((out.double() - ref_out).abs().max())


def run(batch, chunk_tokens: int, fuse: bool, dtype=BF16):
    plan = PrefillPlan.build(
        batch.query_lens,
        batch.context_lens,
        dims=batch.dims,
        block_size=batch.block_size,
        workspace=Workspace("cpu", chunk_tokens=chunk_tokens),
        dtype=dtype,
        fuse_context=fuse,
    )
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    return plan, out, lse


@pytest.fixture(scope="module")
def long_request():
    """One request of 64 new + 512 cached tokens, V2-Lite dims, bf16, with its float64 reference and the fused
    schedule's error."""
    from tests.helpers.reference import make_mla_batch, mla_reference

    batch = make_mla_batch(V2, [64], [512], 16, dtype=BF16, seed=0)
    ref_out, ref_lse = mla_reference(batch)
    plan, out, _ = run(batch, 100_000, True)
    assert plan.fused
    return batch, ref_out, ref_lse, max_err(out, ref_out)


@pytest.mark.parametrize("chunk_tokens,num_chunks", [(512, 1), (128, 4), (16, 32)])
def test_bf16_error_does_not_grow_with_the_chunk_count(long_request, chunk_tokens, num_chunks):
    batch, ref_out, ref_lse, fused_err = long_request
    plan, out, lse = run(batch, chunk_tokens, False)
    assert len(plan.chunks) == num_chunks and plan.num_merges == num_chunks
    err = max_err(out, ref_out)
    assert err <= bound(fused_err, ref_out), (num_chunks, err, fused_err)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=0)
    # one float32 running out for the request's 64 rows, only where a row is merged more than once
    assert plan.running_rows == (64 if num_chunks > 1 else 0)


def test_bf16_error_with_requests_split_between_chunks():
    """Several requests whose contexts straddle chunk edges (a round's first rows continue the previous round's last
    request, its last rows go on in the next), one without context, one without new tokens: every row within the
    bound, and the float32 running rows are one request's rows at most."""
    from tests.helpers.reference import make_mla_batch, mla_reference

    dims = MLADims(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    q_lens, c_lens = [24, 8, 0, 16, 32], [200, 0, 40, 150, 120]
    batch = make_mla_batch(dims, q_lens, c_lens, 16, dtype=BF16, seed=5)
    ref_out, _ = mla_reference(batch)
    _, fused, _ = run(batch, 100_000, True)
    limit = bound(max_err(fused, ref_out), ref_out)
    for chunk_tokens in (2, 48):
        plan, out, _ = run(batch, chunk_tokens, False)
        assert max_err(out, ref_out) <= limit, chunk_tokens
        assert plan.running_rows == 32 and plan.num_merges > 4


@pytest.mark.parametrize("chunk_tokens", [2, 16, 512])
def test_chunked_out_is_its_partials_merged_and_rounded_once(chunk_tokens):
    """Whatever the chunk count (256, 32 or 1 chunks of one request; and requests split between chunks), out is the
    float64 merge of the same partials rounded once, within one ulp: no rounding between the merges of a row.
    Before, at 256 chunks, a row's out was rounded 256 times (off by up to 8 ulps of bf16)."""
    from tests.helpers.reference import make_mla_batch

    dims = MLADims(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    for q_lens, c_lens in (([64], [512]), ([24, 8, 0, 16, 32], [200, 0, 40, 150, 120])):
        batch = make_mla_batch(dims, q_lens, c_lens, 16, dtype=BF16, seed=7)
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=dims,
            block_size=16,
            dtype=BF16,
            fuse_context=False,
            workspace=Workspace("cpu", chunk_tokens=chunk_tokens),
        )
        weight = prepare_kv_b_proj(batch.w, dims)
        out, lse = mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            weight,
            batch.cache,
            batch.block_table,
            plan,
            return_lse=True,
            kv_impl="separate",
        )
        want, want_lse = partials_merged_once(batch, plan, weight)
        assert_rounded_once(out, want)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)


def test_float32_plans_merge_in_out_itself():
    """float32 gains nothing from a float32 running copy: no running rows, out merged in place, as before."""
    from tests.helpers.reference import make_mla_batch, mla_reference

    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    batch = make_mla_batch(dims, [9], [100], 4, seed=2)
    plan, out, _ = run(batch, 8, False, dtype=torch.float32)
    assert plan.running_rows == 0 and len(plan.chunks) == 13
    torch.testing.assert_close(out.double(), mla_reference(batch)[0], atol=3e-5, rtol=0)


def test_merge_steps_random_schedules():
    """Random batches and budgets: following :attr:`PrefillPlan.merge_steps` merge by merge, every row's first merge
    reads out (the main pass), each later one reads the float32 running row its previous merge wrote (the same
    running row), its last merge writes out, and the others write a running row below ``running_rows``; every merge's
    steps tile its rows in order."""
    rng = random.Random(11)
    dims = MLADims(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    for _ in range(300):
        b = rng.randint(1, 7)
        q_lens = [rng.choice([0, 1, 2, 5]) for _ in range(b)]
        c_lens = [rng.choice([0, 1, 6, 17, 40]) for _ in range(b)]
        if not sum(c_lens):
            continue
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=dims,
            block_size=4,
            dtype=BF16,
            fuse_context=False,
            workspace=Workspace("cpu", chunk_tokens=rng.randint(1, 30)),
        )
        merges_of = [0] * plan.num_tokens
        for c in plan.chunks:
            if c.merge_rows is not None:
                for r in range(*c.merge_rows):
                    merges_of[r] += 1
        where = [None] * plan.num_tokens  # None: out; else the running row holding it
        seen = [0] * plan.num_tokens
        assert len(plan.merge_steps) == len(plan.chunks)
        for c, steps in zip(plan.chunks, plan.merge_steps):
            if c.merge_rows is None:
                assert steps is None
                continue
            start, stop = c.merge_rows
            assert steps[0][0] == start and steps[-1][1] == stop
            assert all(a[1] == b[0] for a, b in zip(steps, steps[1:])) and all(s[0] < s[1] for s in steps)
            for row0, row1, src, dst in steps:
                assert src is None or dst is None or src == dst  # in place: each row read and written by one program
                for i, r in enumerate(range(row0, row1)):
                    seen[r] += 1
                    read = None if src is None else src + i
                    assert read == where[r], (q_lens, c_lens, r)
                    if seen[r] == merges_of[r]:
                        assert dst is None
                    else:
                        assert dst is not None and 0 <= dst + i < plan.running_rows
                    where[r] = None if dst is None else dst + i
        assert seen == merges_of and all(w is None for w in where), (q_lens, c_lens)


def test_merge_steps_of_a_split_request_and_the_bench_bytes():
    """A request whose context fills three chunks: its rows go into the running out, stay there, and come back;
    the bench's merge phase counts the float32 bytes they move."""
    from mla_bridge.bench.context import merge_phase_bytes

    plan = PrefillPlan.build(
        [100, 50],
        [300, 0],
        dims=V2,
        workspace=Workspace("cpu", chunk_tokens=128),
        block_size=16,
        dtype=BF16,
        fuse_context=False,
    )
    assert plan.merge_steps == (((0, 100, None, 0),), ((0, 100, 0, 0),), ((0, 100, 0, None),))
    assert plan.running_rows == 100
    row = 16 * 128
    assert merge_phase_bytes(plan, 2) == 100 * (row * (2 + 2 + 4) + row * (4 + 2 + 4) + row * (4 + 2 + 2) + 3 * 16 * 12)
