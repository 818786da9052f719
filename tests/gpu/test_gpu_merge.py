"""GPU tests of the Triton merge (mla_bridge.kernels.merge): the compiled kernel against the torch merge.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run on the H200:
    python -m pytest tests/gpu/test_gpu_merge.py -q -m gpu
(the case past 2**32 elements, for both the Triton and FlashInfer merges, is ``test_merge_over_32_bit_elements`` in
tests/gpu/test_gpu_shapes.py). Every merge here is queued behind ``torch.cuda._sleep`` so that the host runs ahead
of the GPU.

* the merge chosen on CUDA is Triton's, for bf16/fp16/float32 and head dims 64/128/96/48;
* against the torch merge on the same GPU (:func:`mla_bridge.merge._merge_torch`), out of place, in place into
  row/head-strided views, with a non-unit last stride and a non-contiguous lse_b, on rows with every kind of
  partial (finite, -inf/+inf on either side or both, NaN lse, NaN/huge garbage in empty partials, a subnormal
  weight): NaN and -inf in the same places, one-empty rows exactly the other partial, two empties (0, -inf), else
  within 1 ulp of the output dtype (``assert_merge_matches`` in tests/helpers/merge_cases.py);
* bit for bit equal to the torch merge (same float32 operations in the same order, libdevice expf/logf, IEEE
  division, no FMA contraction): a separate test, so that a failure says which promise broke;
* chunked ``mla_prefill``: the Triton merge gives bitwise the torch merge's result (MLA_BRIDGE_MERGE=torch) and is
  within bf16 tolerance of FlashInfer's merge and of float64. (CUDA-graph replay of the chunked schedule, now with
  the Triton merge, is tests/gpu/test_gpu_graphs.py.)
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, merge_attn_states, mla_prefill  # noqa: E402
from mla_bridge import merge as M  # noqa: E402
from mla_bridge.merge import merge_attn_states_, select_merge  # noqa: E402
from tests.helpers.merge_cases import assert_merge_matches, bitwise, merge_cases  # noqa: E402

BF16 = torch.bfloat16
DTYPES = [BF16, torch.float16, torch.float32]


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def _no_merge_env(monkeypatch):
    monkeypatch.delenv(M.MERGE_ENV, raising=False)


def _inputs(d, dtype, seed, t=37, h=4):
    return tuple(x.to(dev()) for x in merge_cases(d, dtype, seed=seed, t=t, h=h))


def _all_forms(oa, la, ob, lb):
    """(name, (out, lse)) of every form of the merge, each queued behind a GPU sleep: out of place; in place into
    rows 2..t+1 of a [t+4, h, d+16] buffer with a head-major out_b; out of place with out_b's last dim strided 2
    and a non-contiguous lse_b. Also returns the guard buffers to check they were not touched outside the view."""
    t, h, d = oa.shape
    forms = []
    torch.cuda._sleep(int(1e8))
    forms.append(("out of place", merge_attn_states(oa, la, ob, lb)))
    big = torch.full((t + 4, h, d + 16), 5.0, device=dev()).to(oa.dtype)
    big_l = torch.full((t + 4, h), 5.0, device=dev())
    view, view_l = big[2 : t + 2, :, :d], big_l[2 : t + 2]
    view.copy_(oa)
    view_l.copy_(la)
    ob_hm = ob.transpose(0, 1).contiguous().transpose(0, 1)
    torch.cuda._sleep(int(1e8))
    merge_attn_states_(view, view_l, ob_hm, lb)
    forms.append(("in place, strided", (view, view_l)))
    wide = torch.zeros(t, h, 2 * d, device=dev()).to(oa.dtype)
    wide[..., ::2] = ob
    torch.cuda._sleep(int(1e8))
    forms.append(("last dim strided", merge_attn_states(oa, la, wide[..., ::2], lb.t().contiguous().t())))
    return forms, big, big_l


@pytest.mark.parametrize("d", [64, 128, 96, 48])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [4, 128])
def test_triton_merge_matches_torch_merge(d, dtype, h):
    oa, la, ob, lb = _inputs(d, dtype, seed=d + h + dtype.itemsize, t=37 if h == 4 else 9, h=h)
    assert select_merge(tuple(oa.shape), dtype, "cuda").name == "triton"
    expect = M._merge_torch(oa, la, ob, lb)
    forms, big, big_l = _all_forms(oa, la, ob, lb)
    torch.cuda.synchronize()
    for name, got in forms:
        assert_merge_matches(got, expect, oa, la, ob, lb)
    t = oa.shape[0]
    assert (big[:2] == 5.0).all() and (big[t + 2 :] == 5.0).all() and (big[2 : t + 2, :, d:] == 5.0).all()
    assert (big_l[:2] == 5.0).all() and (big_l[t + 2 :] == 5.0).all()


@pytest.mark.parametrize("d", [64, 128, 96, 48])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_merge_bitwise_equal_to_torch_merge(d, dtype):
    """The same float32 operations in the same order as the torch merge on the same GPU: equal bit for bit."""
    oa, la, ob, lb = _inputs(d, dtype, seed=3 * d + dtype.itemsize, t=300, h=16)
    expect = M._merge_torch(oa, la, ob, lb)
    forms, _, _ = _all_forms(oa, la, ob, lb)
    torch.cuda.synchronize()
    for name, got in forms:
        assert bitwise(got, expect), (
            name,
            (got[0].float() - expect[0].float()).nan_to_num().abs().max().item(),
            (got[1] - expect[1]).nan_to_num().abs().max().item(),
        )


def test_nan_lse_stays_nan_on_cuda():
    """FlashInfer's merge drops a NaN LSE (it takes max()); the Triton merge keeps it, as the torch merge does."""
    out = torch.ones(2, 1, 64, dtype=BF16, device=dev())
    lse = torch.tensor([[float("nan")], [0.0]], device=dev())
    torch.cuda._sleep(int(1e8))
    merged, merged_lse = merge_attn_states(out, lse, out * 2, torch.zeros(2, 1, device=dev()))
    torch.cuda.synchronize()
    assert torch.isnan(merged_lse[0]).all() and torch.isnan(merged[0]).all()
    assert torch.equal(merged[1], torch.full((1, 64), 1.5, dtype=BF16, device=dev()))


def _chunked_case(ref):
    dims = MLADims.deepseek_v2_lite()
    q_lens, c_lens = [5, 0, 17, 3, 40], [40, 9, 100, 0, 77]
    batch = ref.make_mla_batch(dims, q_lens, c_lens, 16, seed=4, dtype=BF16, device=dev())
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=48),
        block_size=16,
        dtype=BF16,
        fuse_context=False,
    )
    assert len([c for c in plan.chunks if c.plan is not None]) >= 3
    return batch, plan


def _run(batch, plan):
    torch.cuda._sleep(int(1e8))
    return mla_prefill(batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True)


def test_chunked_prefill_with_the_triton_merge(ref, monkeypatch):
    batch, plan = _chunked_case(ref)
    out, lse = _run(batch, plan)
    results = {}
    for impl in ("torch", "flashinfer"):
        monkeypatch.setenv(M.MERGE_ENV, impl)
        results[impl] = _run(batch, plan)
    torch.cuda.synchronize()
    assert bitwise((out, lse), results["torch"])
    ref.assert_out_close(out, results["flashinfer"][0].double(), atol=2e-2, rtol=2e-2)
    ref.assert_lse_close(lse, results["flashinfer"][1].double(), atol=1e-4, rtol=1e-5)
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=2e-2, rtol=2e-2)
    ref.assert_lse_close(lse, exp_lse, atol=1e-2, rtol=2e-2)
