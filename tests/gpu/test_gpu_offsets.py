"""32-bit offsets through real strides, and what a chunked plan's FlashInfer plans hold, on the GPU.

* fa2 computes ``token * stride_n + head * stride_h`` in ``uint32_t``: k and v of mla_prefill are views of one
  ``[N, H, 320]`` buffer, so with 128 heads a pass of more than 104857 keys wraps, while the 192-wide count said
  174762: a request whose keys start at element offset 4,300,800,000 came back wrong from fa2 (forced; max error
  3.11 on the H200), which a chunk of 120000 keys over contexts 105000 + 15000 does. Chunks are now cut below fa2's
  limit, and ragged calls on such views are routed past fa2 or refused before any kernel.
* A chunked plan's FlashInfer wrappers each came with an 8 MiB int workspace and 8 MiB of page-locked memory (115
  plans: 1.8 GiB); their int workspaces are now sized to each plan's schedule.

Each test keeps the GPU busy (``torch.cuda._sleep``) before it plans and runs, as an engine's host runs ahead. About
10 GB of device memory for the largest case. On the H200:
    python3 -m pytest tests/gpu/test_gpu_offsets.py -q -m gpu
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import (  # noqa: E402
    MLADims,
    PrefillPlan,
    Workspace,
    mla_prefill,
    plan_ragged,
    ragged_prefill,
    select_backend,
)
from mla_bridge.prefill import prefill_memory_bytes  # noqa: E402

BF16 = torch.bfloat16
SLEEP = int(2e8)  # GPU cycles (about 0.1 s on the H200)
OUT_TOL, LSE_TOL, RTOL = 2e-2, 1e-2, 2e-2
V3 = MLADims.deepseek_v3()  # 128 heads, 192 / 128
ROW = 128 * 320  # elements per key token of a pass's k/v buffer
Q_LENS, C_LENS = [8, 8], [105_000, 15_000]  # request 1's keys start at 105000 x 40960 = 4,300,800,000 elements


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def require_fa2() -> None:
    try:
        select_backend(dev(), requested="flashinfer-fa2", dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    except ValueError as err:
        pytest.skip(f"fa2 cannot serve here: {err}")


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def mla_inputs(block_size=64, seed=0):
    """DeepSeek-V3 inputs for Q_LENS / C_LENS on the GPU: request 1's cached latents are shifted along one direction,
    so its rows' out (about the mean of its v) differs clearly from request 0's: a pass that reads request 0's keys
    for it shows."""
    g = torch.Generator(device=dev()).manual_seed(seed)
    blocks = [-(-c // block_size) for c in C_LENS]
    cache = torch.randn(sum(blocks), block_size, V3.latent_dim, generator=g, device=dev(), dtype=BF16)
    u = torch.randn(V3.kv_lora_rank, generator=g, device=dev())
    cache[blocks[0] :, :, : V3.kv_lora_rank] += (2.0 * u).to(BF16)
    table = torch.zeros(2, max(blocks), dtype=torch.int32, device=dev())
    table[0, : blocks[0]] = torch.arange(blocks[0], dtype=torch.int32, device=dev())
    table[1, : blocks[1]] = torch.arange(blocks[0], sum(blocks), dtype=torch.int32, device=dev())
    t = sum(Q_LENS)
    q = torch.randn(t, 128, 192, generator=g, device=dev(), dtype=BF16)
    kv_c = torch.randn(t, V3.kv_lora_rank, generator=g, device=dev(), dtype=BF16)
    k_pe = torch.randn(t, V3.qk_rope_head_dim, generator=g, device=dev(), dtype=BF16)
    w = (torch.randn(V3.kv_b_proj_shape, generator=g, device=dev()) * V3.kv_lora_rank**-0.5).to(BF16)
    return q, kv_c, k_pe, w, cache, table


def test_fa2_forced_chunk_past_2_32_is_split_and_right(ref):
    """fa2 forced with a 120000-token chunk budget: the chunk is cut at 104857 keys (its k/v reach < 2**32), every
    pass is fa2, no int workspace had to grow, and out / lse equal the torch backend's on the same inputs, the second
    request's rows included (its out about 2 where a read of request 0's keys gives about 0)."""
    require_fa2()
    x = mla_inputs()
    ws = Workspace(dev(), chunk_tokens=120_000)
    torch.cuda._sleep(SLEEP)
    plan = PrefillPlan.build(Q_LENS, C_LENS, dims=V3, workspace=ws, block_size=64, dtype=BF16, backend="flashinfer-fa2")
    assert not plan.fused and [c.num_tokens for c in plan.chunks] == [104_857, 15_143]
    assert {c.plan.backend.name for c in plan.chunks} == {"flashinfer-fa2"} == {plan.main.backend.name}
    assert max(c.num_tokens for c in plan.chunks) * ROW < 2**32
    out, lse = mla_prefill(*x, plan, return_lse=True)
    torch.cuda.synchronize()
    assert ws.int_workspace_growths == 0
    out, lse = out.cpu(), lse.cpu()
    del plan
    gc.collect()
    torch.cuda.empty_cache()
    expect_plan = PrefillPlan.build(
        Q_LENS,
        C_LENS,
        dims=V3,
        workspace=Workspace(dev(), chunk_tokens=120_000),
        block_size=64,
        dtype=BF16,
        backend="torch",
    )
    want_out, want_lse = mla_prefill(*x, expect_plan, return_lse=True)
    want_out, want_lse = want_out.double().cpu(), want_lse.double().cpu()
    assert want_out[8:].abs().mean() > 0.5 > want_out[:8].abs().mean()  # the rows a wrapped read would get wrong
    ref.assert_out_close(out, want_out, atol=OUT_TOL, rtol=RTOL)
    ref.assert_lse_close(lse, want_lse, atol=LSE_TOL)


def test_ragged_views_past_2_32_are_routed_or_refused(ref):
    """k and v as views of one [120000, 128, 320] buffer (k the first 192 columns, v the last 128), the second
    request's keys from element offset 4,300,800,000: ragged_prefill with fa2 forced is refused (k, named) before
    any kernel; a plan made for contiguous tensors refuses those views at run time, out untouched; left to the
    dispatch, the call is served past fa2 and equals the torch backend."""
    require_fa2()
    n = sum(C_LENS)
    g = torch.Generator(device=dev()).manual_seed(1)
    buf = torch.randn(n, 128, 320, generator=g, device=dev(), dtype=BF16)
    buf[C_LENS[0] :, :, 192:] += 2.0
    k, v = buf[..., :192], buf[..., 192:]
    q = torch.randn(sum(Q_LENS), 128, 192, generator=g, device=dev(), dtype=BF16)
    qo, kv = [0, 8, 16], [0, C_LENS[0], n]
    scale = V3.softmax_scale
    torch.cuda._sleep(SLEEP)
    with pytest.raises(ValueError, match=r"flashinfer-fa2.*offset limit.*k, counted through its strides"):
        ragged_prefill(q, k, v, qo, kv, causal=False, sm_scale=scale, backend="flashinfer-fa2")
    plan = plan_ragged(
        qo,
        kv,
        num_heads=128,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=False,
        sm_scale=scale,
        dtype=BF16,
        workspace=Workspace(dev()),
        backend="flashinfer-fa2",
    )
    out = torch.full((16, 128, 128), 7.0, dtype=BF16, device=dev())
    with pytest.raises(ValueError, match=r"k reaches .* elements through its strides.*flashinfer-fa2"):
        plan.run(q, k, v, out=out)
    assert bool((out == 7.0).all())
    got_out, got_lse = ragged_prefill(q, k, v, qo, kv, causal=False, sm_scale=scale)
    want_out, want_lse = ragged_prefill(q, k, v, qo, kv, causal=False, sm_scale=scale, backend="torch")
    torch.cuda.synchronize()
    assert want_out[8:].float().abs().mean() > 1.0
    ref.assert_out_close(got_out, want_out.double(), atol=OUT_TOL)
    ref.assert_lse_close(got_lse, want_lse.double(), atol=LSE_TOL)


@pytest.mark.parametrize("backend", [None, "flashinfer-fa2"])
def test_chunked_plan_holds_megabytes_not_gigabytes(ref, backend):
    """64 requests with 2000 to 8000 cached tokens at chunk_tokens=2048: 115 FlashInfer plans. Building the plan
    allocates a few MiB of device memory (before: 8 MiB per plan, 920 MiB), the plan's flashinfer_bytes say what it
    holds, prefill_memory_bytes counts it, no int workspace grew (the estimate covers FlashInfer's schedule), and the
    result equals the torch backend's."""
    if backend is not None:
        require_fa2()
    dims = MLADims.deepseek_v2_lite()
    r = random.Random(2)
    c_lens = [r.randint(2000, 8000) for _ in range(64)]
    q_lens = [r.randint(1, 256) for _ in range(64)]
    batch = ref.make_mla_batch(dims, q_lens, c_lens, 64, dtype=BF16, seed=4, device=dev(), spare_blocks=1)
    ws = Workspace(dev(), chunk_tokens=2048)
    _ = ws.float_workspace  # allocated first: not the plans'
    # a throwaway plan first: its acquisition sweeps what earlier tests left (wrappers of dropped workspaces), whose
    # frees would otherwise hide this build's allocations
    PrefillPlan.build([1], [1], dims=dims, workspace=ws, block_size=64, dtype=BF16, backend=backend)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda._sleep(SLEEP)
    plan = PrefillPlan.build(q_lens, c_lens, dims=dims, workspace=ws, block_size=64, dtype=BF16, backend=backend)
    # held: what the build keeps; peak: what it needed at once (each new FlashInfer wrapper allocates its 8 MiB int
    # workspace before it is replaced by one of its plan's size, freed and reused by the next wrapper)
    grown = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    device_bytes, host_bytes = plan.flashinfer_bytes
    print(
        f"\n{plan.backend.name}: {plan.num_plans} plans, {grown / 2**20:.2f} MiB held after the build (peak "
        f"{peak / 2**20:.2f} MiB), "
        f"flashinfer_bytes {device_bytes / 2**20:.2f} MiB device + {host_bytes / 2**20:.2f} MiB page-locked"
    )
    assert plan.num_plans == 115 and plan.backend.is_flashinfer
    assert peak < 24 * 2**20 and grown < 16 * 2**20 and host_bytes < 16 * 2**20
    assert device_bytes <= grown + 2**20  # what the plans say they hold is what the build kept (indptr copies aside)
    assert prefill_memory_bytes(plan) >= device_bytes
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    torch.cuda.synchronize()
    assert ws.int_workspace_growths == 0
    expect = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=2048),
        block_size=64,
        dtype=BF16,
        backend="torch",
    )
    want_out, want_lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, expect, return_lse=True
    )
    ref.assert_out_close(out, want_out.double(), atol=OUT_TOL, rtol=RTOL)
    ref.assert_lse_close(lse, want_lse.double(), atol=LSE_TOL)
