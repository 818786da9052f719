"""GPU tests of the run path's host-time work: FlashInfer's recorded direct run.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run on the H200:
    python -m pytest tests/gpu/test_gpu_run_path.py -q -m gpu
* a planned fa3 / fa2 run (causal and not) takes the direct route (``DirectRun`` recorded on the first run) and is
  bit for bit what ``wrapper.run(..., lse_base="ln")`` gives (a plan made with MLA_BRIDGE_FLASHINFER_DIRECT=0), on
  the current stream and on a side stream (fa2's float workspace region moves with the stream), GPU kept busy;
* ``lse_layout="HN"`` and a strided ``out`` on fa2 still go through ``wrapper.run`` and agree with the direct NH run;
* a chunked mla_prefill is bitwise the same with and without the direct route.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, plan_ragged, select_backend  # noqa: E402
from mla_bridge.backends.flashinfer import DIRECT_ENV, DirectRun  # noqa: E402

BF16 = torch.bfloat16


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _usable(backend: str, causal: bool) -> bool:
    try:
        select_backend(
            dev(),
            requested=backend,
            dtype=BF16,
            out_dtype=BF16,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=causal,
            num_heads=16,
        )
        return True
    except ValueError:
        return False


def _bits(x):
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def _case(causal, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [100, 7, 300, 1], ([100, 7, 300, 1] if causal else [400, 9, 1000, 33])
    qo = [0]
    kv = [0]
    for a, b in zip(q_lens, kv_lens):
        qo.append(qo[-1] + a)
        kv.append(kv[-1] + b)
    q = torch.randn(qo[-1], 16, 192, generator=g).to(BF16).to(dev())
    k = torch.randn(kv[-1], 16, 192, generator=g).to(BF16).to(dev())
    v = torch.randn(kv[-1], 16, 128, generator=g).to(BF16).to(dev())
    return qo, kv, q, k, v


def _plan(qo, kv, causal, backend, ws):
    return plan_ragged(
        qo,
        kv,
        num_heads=16,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=causal,
        sm_scale=0.1147,
        dtype=BF16,
        workspace=ws,
        backend=backend,
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2"])
def test_direct_run_equals_wrapper_run_bitwise(backend, causal, monkeypatch):
    if not _usable(backend, causal):
        pytest.skip(f"{backend} cannot serve here")
    qo, kv, q, k, v = _case(causal)
    ws = Workspace(dev())
    plan = _plan(qo, kv, causal, backend, ws)
    torch.cuda._sleep(int(1e8))
    out, lse = plan.run(q, k, v)
    assert isinstance(plan._kernel._direct, DirectRun)  # the direct route was taken
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(1e8))
        out_s, lse_s = plan.run(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    monkeypatch.setenv(DIRECT_ENV, "0")
    plain = _plan(qo, kv, causal, backend, ws)
    torch.cuda._sleep(int(1e8))
    want_out, want_lse = plain.run(q, k, v)
    assert plain._kernel._direct is False
    hn_out, hn_lse = plan.run(q, k, v, lse_layout="HN")  # "HN" goes through wrapper.run
    torch.cuda.synchronize()
    for o, s in ((out, lse), (out_s, lse_s)):
        assert torch.equal(_bits(o), _bits(want_out)) and torch.equal(_bits(s), _bits(want_lse))
    assert torch.equal(_bits(hn_out), _bits(out)) and torch.equal(_bits(hn_lse), _bits(lse.t().contiguous()))


def test_strided_out_on_fa2_goes_through_the_copy(monkeypatch):
    if not _usable("flashinfer-fa2", False):
        pytest.skip("fa2 cannot serve here")
    qo, kv, q, k, v = _case(False, seed=1)
    plan = _plan(qo, kv, False, "flashinfer-fa2", Workspace(dev()))
    want_out, want_lse = plan.run(q, k, v)
    big = torch.zeros(qo[-1], 16, 256, dtype=BF16, device=dev())
    torch.cuda._sleep(int(1e8))
    out, lse = plan.run(q, k, v, out=big[..., :128])
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(want_out)) and torch.equal(_bits(lse), _bits(want_lse))
    assert torch.equal(big[..., 128:], torch.zeros_like(big[..., 128:]))


def test_chunked_prefill_same_with_and_without_the_direct_run(ref, monkeypatch):
    dims = MLADims.deepseek_v2_lite()
    q_lens, c_lens = [5, 0, 17, 3, 40], [40, 9, 100, 0, 77]
    batch = ref.make_mla_batch(dims, q_lens, c_lens, 16, seed=4, dtype=BF16, device=dev())
    results = []
    for direct in ("1", "0"):
        monkeypatch.setenv(DIRECT_ENV, direct)
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=dims,
            workspace=Workspace(dev(), chunk_tokens=48),
            block_size=16,
            dtype=BF16,
            fuse_context=False,
        )
        torch.cuda._sleep(int(1e8))
        results.append(
            mla_prefill(batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True)
        )
    torch.cuda.synchronize()
    (o1, l1), (o2, l2) = results
    assert torch.equal(_bits(o1), _bits(o2)) and torch.equal(_bits(l1), _bits(l2))


@pytest.mark.parametrize("direct", ["1", "0"])
def test_base2_lse_and_the_merge_reading_it(direct, monkeypatch):
    """run(lse_base="log2") is FlashInfer's base-2 LSE (times ln 2 in float32: bitwise the natural-log run), and
    the Triton merge reading it (lse_b_base="log2") gives bitwise the merge of the natural-log partial."""
    from mla_bridge.merge import merge_attn_states_

    monkeypatch.setenv(DIRECT_ENV, direct)
    qo, kv, q, k, v = _case(False, seed=2)
    plan = _plan(qo, kv, False, None, Workspace(dev()))
    torch.cuda._sleep(int(1e8))
    out, lse = plan.run(q, k, v)
    out2, lse2 = plan.run(q, k, v, lse_base="log2")
    acc = torch.randn(out.shape, device=dev()).to(BF16)
    acc_l = torch.randn(lse.shape, device=dev()) * 3
    a1, l1 = acc.clone(), acc_l.clone()
    merge_attn_states_(a1, l1, out, lse)
    a2, l2 = acc.clone(), acc_l.clone()
    merge_attn_states_(a2, l2, out2, lse2, lse_b_base="log2")
    torch.cuda.synchronize()
    assert torch.equal(_bits(out2), _bits(out)) and torch.equal(_bits(lse2 * 0.6931471805599453), _bits(lse))
    assert torch.equal(_bits(a1), _bits(a2)) and torch.equal(_bits(l1), _bits(l2))


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2"])
def test_run_without_lse_gives_the_same_out(backend, direct, ref, monkeypatch):
    """return_lse=False (no LSE buffer, maybe_lse=None, no base conversion) gives bitwise the out of a run with the
    LSE, on the direct route and through wrapper.run; so does mla_prefill without context (which then allocates
    no LSE), GPU kept busy."""
    if not _usable(backend, True):
        pytest.skip(f"{backend} cannot serve here")
    monkeypatch.setenv(DIRECT_ENV, direct)
    qo, kv, q, k, v = _case(True, seed=3)
    plan = _plan(qo, kv, True, backend, Workspace(dev()))
    want, _ = plan.run(q, k, v)
    torch.cuda._sleep(int(1e8))
    got = plan.run(q, k, v, return_lse=False)
    dims = MLADims.deepseek_v2_lite()
    q_lens = [64, 1, 200]
    batch = ref.make_mla_batch(dims, q_lens, [0, 0, 0], 16, seed=5, dtype=BF16, device=dev())
    pp = PrefillPlan.build(q_lens, dims=dims, workspace=Workspace(dev()), block_size=16, dtype=BF16, backend=backend)
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, pp)
    with_lse, _ = mla_prefill(*args, return_lse=True)
    torch.cuda._sleep(int(1e8))
    without = mla_prefill(*args)
    torch.cuda.synchronize()
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(without), _bits(with_lse))
