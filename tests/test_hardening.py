"""Failure classes of the core, CPU side: empty partials, NaN-filled buffers, the LSE base and layout, one query over
long keys, zero-length queries, extreme logits, 32-bit offsets, a workspace too small, the merge at any head count, an
off-by-one between q and qo_indptr. Their GPU side lives in tests/gpu/test_gpu_core.py under the same names.
"""

from __future__ import annotations

import gc

import math

import pytest
import torch

import mla_bridge.dispatch as dispatch
from mla_bridge import (
    PrefillPlan,
    Workspace,
    WorkspaceTooSmallError,
    merge_attn_states,
    mla_prefill,
    plan_ragged,
    ragged_prefill,
    select_backend,
)
from mla_bridge.merge import merge_attn_states_

ATOL = 3e-5
NEG_INF = float("-inf")


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


# ---------------------------------------------------------------------------------------------------------------
# both partials empty
# ---------------------------------------------------------------------------------------------------------------


def test_merge_of_two_empties_is_zero_minus_inf():
    out = torch.zeros(2, 3, 8)
    lse = torch.full((2, 3), NEG_INF)
    m_out, m_lse = merge_attn_states(out, lse, out.clone(), lse.clone())
    assert torch.equal(m_out, torch.zeros(2, 3, 8)) and torch.equal(m_lse, lse)
    merge_attn_states_(out, lse, torch.zeros(2, 3, 8), torch.full((2, 3), NEG_INF))
    assert torch.equal(out, torch.zeros(2, 3, 8)) and torch.equal(lse, torch.full((2, 3), NEG_INF))


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


# ---------------------------------------------------------------------------------------------------------------
# rows with no keys in a later chunk, buffers not zeroed (every torch.empty is NaN-filled)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def nan_empty(monkeypatch):
    """Make every floating torch.empty (mla_bridge.prefill / ragged / backends all call it) return NaN."""
    real_empty = torch.empty
    made = []

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
            made.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return made


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


def test_nan_filled_ragged_buffers(ref, nan_empty, monkeypatch):
    """Rows without keys in a ragged pass are written (0, -inf), never left as an uninitialised buffer."""
    q, k, v, qo, kv = ref.make_ragged([2, 3, 1], [4, 0, 0], 2, 24, 16, seed=3)
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=False, sm_scale=0.2, backend="torch")
    out2, lse2 = ragged_prefill(q, k[:0], v[:0], qo, [0, 0, 0, 0], causal=False, sm_scale=0.2, backend="torch")
    assert nan_empty
    monkeypatch.undo()
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=False, sm_scale=0.2)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)
    assert torch.equal(out2, torch.zeros_like(out2)) and torch.equal(lse2, torch.full_like(lse2, NEG_INF))


# ---------------------------------------------------------------------------------------------------------------
# LSE base and layout
# ---------------------------------------------------------------------------------------------------------------


def test_merge_value_is_natural_log():
    """Partition sums 2 and 8 (lse ln 2, ln 8), values 1 and 0, 1 head, d 1: merged value 2 / 10 = 0.2."""
    out_a = torch.ones(1, 1, 1)
    out_b = torch.zeros(1, 1, 1)
    lse_a = torch.tensor([[math.log(2.0)]])
    lse_b = torch.tensor([[math.log(8.0)]])
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert abs(out.item() - 0.2) < 1e-6  # a base-2 / base-e mix-up gives 0.119 or 0.277
    assert abs(lse.item() - math.log(10.0)) < 1e-6
    merge_attn_states_(out_a, lse_a, out_b, lse_b)
    assert abs(out_a.item() - 0.2) < 1e-6 and abs(lse_a.item() - math.log(10.0)) < 1e-6


def test_lse_of_a_pass_is_natural_log(ref):
    """Two keys of logit 0 and value 1, 0: lse is ln 2 (not 1 = log2 2) and out 0.5."""
    q = torch.zeros(1, 1, 4)
    k = torch.zeros(2, 1, 4)
    v = torch.tensor([[[1.0]], [[0.0]]])
    out, lse = ragged_prefill(q, k, v, [0, 1], [0, 2], causal=False, sm_scale=1.0, backend="torch")
    assert out.item() == pytest.approx(0.5, abs=1e-7)
    assert lse.item() == pytest.approx(math.log(2.0), abs=1e-7)


@pytest.mark.parametrize("causal", [False, True])
def test_hn_layout_with_t_not_h(ref, causal):
    q, k, v, qo, kv = ref.make_ragged([3, 4], [5, 4], 5, 24, 16, seed=4)  # T = 7, H = 5
    plan = plan_ragged(
        qo,
        kv,
        num_heads=5,
        head_dim_qk=24,
        head_dim_vo=16,
        causal=causal,
        sm_scale=0.2,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )
    _, lse_hn = plan.run(q, k, v, lse_layout="HN")
    assert lse_hn.shape == (5, 7)
    _, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=0.2)
    ref.assert_lse_close(lse_hn.t(), exp_lse, atol=ATOL)
    with pytest.raises(ValueError, match="lse"):
        plan.run(q, k, v, lse=torch.empty(7, 5), lse_layout="HN")  # an [T, H] buffer for an [H, T] layout


# ---------------------------------------------------------------------------------------------------------------
# one query per request over long keys (CPU sized; the GPU test runs 128 heads at 192/128)
# ---------------------------------------------------------------------------------------------------------------


def test_single_query_long_keys_cpu(ref):
    kv_lens = [1, 2899, 17, 1290, 3000, 640, 2, 2048, 999, 1500, 2600, 504]  # 15500 keys
    assert sum(kv_lens) == 15500
    q, k, v, qo, kv = ref.make_ragged([1] * 12, kv_lens, 8, 24, 16, seed=5)
    assert qo == list(range(13))
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=False, sm_scale=24**-0.5, backend="torch")
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=False, sm_scale=24**-0.5)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


# ---------------------------------------------------------------------------------------------------------------
# zero-length queries in a batch
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo,kv", [([0, 1, 1, 2], [0, 3, 3, 8]), ([0, 0, 0, 0, 1], [0, 2, 2, 5, 6])])
def test_zero_length_queries(ref, qo, kv, causal):
    q_lens = [b - a for a, b in zip(qo[:-1], qo[1:])]
    kv_lens = [b - a for a, b in zip(kv[:-1], kv[1:])]
    q, k, v, _, _ = ref.make_ragged(q_lens, kv_lens, 3, 24, 16, seed=6)
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=causal, sm_scale=0.2, backend="torch")
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=0.2)
    assert out.shape == (qo[-1], 3, 16)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("fuse,budget", [(True, 100), (False, 2), (False, 100)])
@pytest.mark.parametrize("q_lens,c_lens", [([1, 0, 1], [2, 0, 4]), ([0, 0, 0, 1], [2, 0, 3, 0])])
def test_zero_length_queries_in_mla_prefill(ref, tiny_dims, q_lens, c_lens, fuse, budget):
    """The same key lengths as MLA batches (keys = context + new): [3, 0, 5] and [2, 0, 3, 1]."""
    batch, plan, out, lse = run_prefill(ref, tiny_dims, q_lens, c_lens, 4, budget, fuse, seed=7)
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


# ---------------------------------------------------------------------------------------------------------------
# extreme logits
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [1, 4])
def test_extreme_logit(dtype, heads):
    """q.k = -524288 exactly (128 x (-64 * 64), exact in fp32 and bf16), sm_scale 192**-0.5, v = 1."""
    q = torch.zeros(1, heads, 192)
    k = torch.zeros(1, heads, 192)
    q[..., :128] = -64.0
    k[..., :128] = 64.0
    v = torch.ones(1, heads, 128)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    assert (q[0, 0].double() @ k[0, 0].double()).item() == -524288.0
    out, lse = ragged_prefill(q, k, v, [0, 1], [0, 1], causal=True, sm_scale=192**-0.5, backend="torch")
    assert torch.equal(out, torch.ones_like(out))  # exactly v: a finite "-inf" sentinel would give 0
    expected = -524288.0 * 192**-0.5  # -37837.23 (-37837.6 was the first estimate, within 1e-3 relative)
    assert torch.allclose(lse.double(), torch.full((1, heads), -37837.6, dtype=torch.float64), rtol=1e-3, atol=0)
    assert torch.allclose(lse.double(), torch.full((1, heads), expected, dtype=torch.float64), rtol=1e-5, atol=0)


def test_extreme_logits_mixed_with_normal_ones(ref):
    """One key at logit -37837.6 next to keys at ordinary logits: the extreme one weighs nothing, nothing NaNs."""
    q = torch.zeros(1, 1, 192)
    q[..., :128] = -64.0
    k = torch.zeros(3, 1, 192)
    k[0, :, :128] = 64.0
    v = torch.tensor([100.0, 1.0, 3.0]).view(3, 1, 1).expand(3, 1, 128).contiguous()
    out, lse = ragged_prefill(q, k, v, [0, 1], [0, 3], causal=False, sm_scale=192**-0.5, backend="torch")
    torch.testing.assert_close(out, torch.full((1, 1, 128), 2.0))
    assert lse.item() == pytest.approx(math.log(2.0), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# 32-bit offsets (dispatch level on the CPU; no 14 GB tensors here)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fi(monkeypatch):
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")


MLA7 = dict(dtype=torch.bfloat16, head_dim_qk=192, head_dim_vo=128, num_heads=128, causal=True)


def test_int32_offsets_element_counts():
    assert 87382 * 128 * 192 == 2_147_500_032 >= 2**31
    assert 87381 * 128 * 192 < 2**31
    assert 174763 * 128 * 192 >= 2**32 > 174762 * 128 * 192


@pytest.mark.parametrize(
    "t,cap,expected,limit",
    [
        (87381, (10, 0), "flashinfer-cutlass", None),
        (87382, (10, 0), "flashinfer-fa2", str(2**31)),  # cutlass is held to 2**31 (int strides)
        (87382, (8, 0), "flashinfer-fa2", None),  # fa2: measured correct up to 2**32 elements
        (174763, (8, 0), "torch", str(2**32)),  # fa2 wrong past 2**32: refused
        (174763, (10, 0), "torch", str(2**31)),
        (87382, (9, 0), "flashinfer-fa3", None),  # fa3: measured correct at 6.4e9 elements
    ],
)
def test_int32_offset_limits_in_dispatch(fi, t, cap, expected, limit):
    choice = select_backend(capability=cap, cuda_version=(12, 8), qo_indptr=[0, t], kv_indptr=[0, t], **MLA7)
    assert choice.name == expected
    if limit is not None:
        reasons = " ".join(r for _, r in choice.passed_over)
        assert limit in reasons and str(t * 128 * 192) in reasons


@pytest.mark.parametrize(
    "t,cap,forced",
    [(87382, (10, 0), "flashinfer-cutlass"), (174763, (8, 0), "flashinfer-fa2"), (174763, (9, 0), "flashinfer-fa2")],
)
def test_int32_offsets_forced_backend_refused_before_any_kernel(fi, t, cap, forced):
    with pytest.raises(ValueError, match=rf"{forced}.*offset limit"):
        select_backend(
            capability=cap, cuda_version=(12, 8), qo_indptr=[0, t], kv_indptr=[0, t], requested=forced, **MLA7
        )


@pytest.mark.parametrize("cap,limit,name", [((10, 0), 2**31, "flashinfer-cutlass"), ((8, 0), 2**32, "flashinfer-fa2")])
def test_int32_offset_limit_is_exclusive(fi, cap, limit, name):
    """128/128 dims and 128 heads hit the limits exactly: a tensor of exactly the limit is refused, one row less
    is served."""
    t = limit // (128 * 128)
    common = dict(
        capability=cap,
        cuda_version=(12, 8),
        dtype=torch.bfloat16,
        head_dim_qk=128,
        head_dim_vo=128,
        num_heads=128,
        causal=False,
    )
    assert select_backend(qo_indptr=[0, t - 1], kv_indptr=[0, t - 1], **common).name == name
    choice = select_backend(qo_indptr=[0, t], kv_indptr=[0, t], **common)
    assert choice.name != name and str(limit) in dict(choice.passed_over)[name]


def test_int32_offsets_kv_side_counts_too(fi):
    """A short q over a long k: the k tensor is what crosses the limit."""
    choice = select_backend(
        capability=(10, 0), cuda_version=(12, 8), qo_indptr=[0, 1], kv_indptr=[0, 87382], **dict(MLA7, causal=False)
    )
    assert choice.name == "flashinfer-fa2"
    assert str(2**31) in dict(choice.passed_over)["flashinfer-cutlass"]


def test_fused_schedule_stays_under_2_31(tiny_dims):
    """The fused schedule (context + new keys in one tensor) is not chosen when its keys' k/v buffer would reach
    2**31 elements, so fusing never changes the backend; the chunked schedule bounds each pass by chunk_tokens. k and
    v are views of one [keys, H, 192 + 128] buffer: 320 elements per head and key, not 192."""
    from mla_bridge import MLADims

    dims = MLADims.deepseek_v3()  # 128 heads x (192 + 128)
    per_token = 128 * 320
    limit_tokens = -(-(2**31) // per_token)  # 52429
    ws = Workspace("cpu", chunk_tokens=200_000)
    small = PrefillPlan.build([1], [limit_tokens - 2], dims=dims, workspace=ws, block_size=64, dtype=torch.float32)
    big = PrefillPlan.build([1], [limit_tokens - 1], dims=dims, workspace=ws, block_size=64, dtype=torch.float32)
    assert small.fused and not big.fused
    assert (limit_tokens - 1) * per_token < 2**31 <= limit_tokens * per_token


# ---------------------------------------------------------------------------------------------------------------
# workspace too small (FlashInfer's "Buffer overflow" must never reach the user)
# ---------------------------------------------------------------------------------------------------------------

OVERFLOW = (
    "Buffer overflow when allocating memory for batch_prefill_tmp_v with size {size} and alignment 16, "
    "but only {avail} bytes available in AlignedAllocator. Increase the workspace buffer size."
)


class GrowWrapper:
    def __init__(self):
        self._int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self.resets = []

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self.resets.append((float_workspace_buffer, int_workspace_buffer))


def failing_plan(times, size=123, avail=45):
    calls = []

    def plan():
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError(OVERFLOW.format(size=size, avail=avail))
        return "planned"

    return plan, calls


def test_workspace_grows_on_overflow():
    ws = Workspace("cpu", float_workspace_bytes=1024, max_float_workspace_bytes=1 << 20)

    class Owner:
        pass

    live, gone = Owner(), Owner()
    wrappers = [ws.acquire_wrapper("fa2", owner, lambda buf, b: GrowWrapper()) for owner in (live, gone)]
    old_buf = ws.float_workspace
    del gone
    gc.collect()
    plan, calls = failing_plan(1)
    assert ws.plan_with_growth(plan) == "planned"
    assert len(calls) == 2 and ws.plans_made == 1
    needed = 1024 + (123 - 45) + 4096
    assert ws.float_workspace_bytes == max(needed, 2 * 1024) == 5198
    assert ws.float_workspace.numel() == 5198
    # Growth under a live plan: only the free wrapper is re-buffered (keeping its own int buffer); the live plan's
    # wrapper keeps the buffers its queued work reads until it is free again.
    assert wrappers[0].resets == [] and old_buf.numel() == 1024
    ((buf, int_buf),) = wrappers[1].resets
    assert buf is ws.float_workspace and int_buf is wrappers[1]._int_workspace_buffer


def test_workspace_doubles_and_retries():
    ws = Workspace("cpu", float_workspace_bytes=100_000, max_float_workspace_bytes=1 << 30)
    plan, calls = failing_plan(3, size=10, avail=5)
    assert ws.plan_with_growth(plan) == "planned"
    assert len(calls) == 4 and ws.float_workspace_bytes == 800_000  # doubled three times


def test_workspace_growth_is_clamped_to_the_maximum():
    ws = Workspace("cpu", float_workspace_bytes=5500, max_float_workspace_bytes=10_000)
    plan, _ = failing_plan(1, size=100, avail=90)  # needs 5500 + 10 + 4096 = 9606 <= 10000 < 2 * 5500
    assert ws.plan_with_growth(plan) == "planned"
    assert ws.float_workspace_bytes == 10_000


def test_workspace_too_small_raises_our_error_naming_the_size():
    ws = Workspace("cpu", float_workspace_bytes=1024, max_float_workspace_bytes=4096)
    plan, calls = failing_plan(100)
    with pytest.raises(WorkspaceTooSmallError) as info:
        ws.plan_with_growth(plan)
    err = info.value
    needed = 1024 + (123 - 45) + 4096
    assert err.needed_bytes == needed and err.limit_bytes == 4096
    msg = str(err)
    assert str(needed) in msg and "max_float_workspace_bytes=4096" in msg and "batch_prefill_tmp_v" in msg
    assert "Buffer overflow" not in msg and "AlignedAllocator" not in msg
    assert err.__cause__ is None and err.__suppress_context__
    assert isinstance(err, RuntimeError)


def test_workspace_grows_until_the_limit_then_raises():
    ws = Workspace("cpu", float_workspace_bytes=8192, max_float_workspace_bytes=20_000)
    plan, calls = failing_plan(100, size=10, avail=5)
    with pytest.raises(WorkspaceTooSmallError, match="20000"):
        ws.plan_with_growth(plan)
    assert ws.float_workspace_bytes == 16384 and len(calls) == 2


def test_workspace_growth_lets_other_errors_pass_through():
    ws = Workspace("cpu", float_workspace_bytes=1024)

    def plan():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        ws.plan_with_growth(plan)
    assert ws.float_workspace_bytes == 1024 and ws.plans_made == 0


def test_flashinfer_kernel_plans_through_growth(monkeypatch):
    """FlashInferRaggedKernel's plan goes through Workspace.plan_with_growth (fake FlashInfer wrapper)."""
    from mla_bridge import BackendChoice
    from mla_bridge.backends import flashinfer as fi_backend
    from mla_bridge.ragged import RaggedSpec

    made = []

    class Wrapper(GrowWrapper):
        def __init__(self, buf, backend):
            super().__init__()
            self.backend, self.failures = backend, 1
            made.append(self)

        def plan(self, *args, **kwargs):
            if self.failures:
                self.failures -= 1
                raise RuntimeError(OVERFLOW.format(size=5000, avail=100))

    monkeypatch.setattr(fi_backend, "new_wrapper", lambda buf, backend: Wrapper(buf, backend))
    ws = Workspace("cpu", float_workspace_bytes=2048, max_float_workspace_bytes=1 << 20)
    spec = RaggedSpec(
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        128,
        192,
        128,
        True,
        0.1,
        torch.bfloat16,
        torch.device("cpu"),
    )
    fi_backend.FlashInferRaggedKernel(BackendChoice("flashinfer-fa2", "test"), ws, spec)
    (w,) = made
    assert w.backend == "fa2" and len(w.resets) == 1 and ws.float_workspace_bytes == 2048 + 4900 + 4096
    ws_small = Workspace("cpu", float_workspace_bytes=2048, max_float_workspace_bytes=4096)
    with pytest.raises(WorkspaceTooSmallError, match=str(2048 + 4900 + 4096)):
        fi_backend.FlashInferRaggedKernel(BackendChoice("flashinfer-fa2", "test"), ws_small, spec)


# ---------------------------------------------------------------------------------------------------------------
# merge at any head count (CPU; the GPU test covers FlashInfer's merge_state)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [1, 16, 64, 128, 256])
def test_merge_any_head_count_cpu(heads):
    g = torch.Generator().manual_seed(heads)
    oa = torch.randn(3, heads, 128, generator=g).bfloat16()
    ob = torch.randn(3, heads, 128, generator=g).bfloat16()
    la, lb = torch.randn(3, heads, generator=g) * 3, torch.randn(3, heads, generator=g) * 3
    la[0, 0] = NEG_INF
    out, lse = merge_attn_states(oa, la, ob, lb)
    # the float32 formula, written out
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    exp_out = (oa.float() * wa[..., None] + ob.float() * wb[..., None]) / (wa + wb)[..., None]
    exp_lse = m + torch.log(wa + wb)
    assert out.dtype == torch.bfloat16 and out.shape == (3, heads, 128)
    torch.testing.assert_close(out.float(), exp_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, exp_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 0].float(), ob[0, 0].float(), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# off-by-one between q's rows and qo_indptr[-1], either direction: clear error, nothing runs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [-1, 1])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_ragged_off_by_one_rows_are_refused(ref, which, delta):
    q, k, v, qo, kv = ref.make_ragged([3, 2], [4, 3], 2, 24, 16, seed=11)
    tensors = dict(q=q, k=k, v=v)
    x = tensors[which]
    tensors[which] = torch.randn(x.shape[0] + delta, *x.shape[1:])
    out = torch.full((5, 2, 16), 7.0)
    lse = torch.full((5, 2), 7.0)
    indptr = "qo_indptr" if which == "q" else "kv_indptr"
    want = 5 if which == "q" else 7
    with pytest.raises(ValueError, match=rf"^{which} has {want + delta} tokens but {indptr}\[-1\] = {want}"):
        ragged_prefill(
            tensors["q"],
            tensors["k"],
            tensors["v"],
            qo,
            kv,
            causal=True,
            sm_scale=0.2,
            backend="torch",
            out=out,
            lse=lse,
        )
    assert torch.equal(out, torch.full((5, 2, 16), 7.0)) and torch.equal(lse, torch.full((5, 2), 7.0))


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
