"""bf16 mla_prefill on the GPU: no rounding between the merges of a row, whatever the number of context chunks.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run on the H200:
    python3 -m pytest tests/gpu/test_gpu_chunk_precision.py -q -m gpu
A row whose request's context is split over chunks is carried in float32 between its merges (the Triton merge reads
a float32 or bf16 out and writes float32 or bf16; FlashInfer's merge, which takes one dtype, hands those merges to
the torch merge) and rounded to bf16 once, by its last merge. For each attention backend that serves here (fa3,
fa2, the torch backend on CUDA) and each merge (Triton, MLA_BRIDGE_MERGE=flashinfer, =torch), at 8 and 512 chunks:
out is the float64 merge of the plan's own partials rounded once (within one bf16 ulp; before, a row was rounded at
each of its 512 merges: 9.4e-2 off float64 where the fused schedule is 2.6e-3 off), within the suite's bf16
tolerance of float64, and the Triton merge gives the torch merge's bits. Every run is queued behind
``torch.cuda._sleep`` so that the host runs ahead of the GPU.
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, prepare_kv_b_proj, select_backend  # noqa: E402
from mla_bridge import merge as M  # noqa: E402
from tests.helpers.chunk_precision import assert_rounded_once, partials_merged_once  # noqa: E402
from tests.helpers.merge_cases import RUNNING_FORMS, bitwise, merge_cases  # noqa: E402

BF16 = torch.bfloat16
OUT_TOL, PREFILL_RTOL = 2e-2, 2e-2  # tests/gpu/test_gpu_core.py's bf16 tolerance of mla_prefill against float64
BACKENDS = ["flashinfer-fa3", "flashinfer-fa2", "torch"]


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def _no_merge_env(monkeypatch):
    monkeypatch.delenv(M.MERGE_ENV, raising=False)


def require(backend: str) -> None:
    try:
        select_backend(dev(), requested=backend, dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    except ValueError as err:
        pytest.skip(f"{backend} cannot serve here: {err}")


@pytest.fixture(scope="module")
def long_request():
    """The CLI's case: one request of 64 new + 4096 cached tokens, V2-Lite dims, bf16, and its float64 reference."""
    from tests.helpers.reference import make_mla_batch, mla_reference

    batch = make_mla_batch(MLADims.deepseek_v2_lite(), [64], [4096], 64, dtype=BF16, seed=0, device=dev())
    batch.weight = prepare_kv_b_proj(batch.w, batch.dims)
    return batch, mla_reference(batch)[0]


def _run(batch, backend, chunk_tokens, fuse):
    """mla_prefill with the weight prepared once (``batch.weight``) on the separate k/v path: the k/v bits
    partials_merged_once makes for its partials."""
    plan = PrefillPlan.build(
        batch.query_lens,
        batch.context_lens,
        dims=batch.dims,
        block_size=batch.block_size,
        workspace=Workspace(dev(), chunk_tokens=chunk_tokens),
        dtype=BF16,
        fuse_context=fuse,
        backend=backend,
    )
    assert plan.backend.name == backend and plan.fused == fuse
    torch.cuda._sleep(int(1e8))
    out, lse = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.weight,
        batch.cache,
        batch.block_table,
        plan,
        return_lse=True,
        kv_impl="separate",
    )
    return plan, out, lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_rounded_once_at_8_and_512_chunks(ref, long_request, backend, monkeypatch):
    require(backend)
    batch, ref_out = long_request
    results = {}
    for merge in ("auto", "flashinfer", "torch"):
        monkeypatch.setenv(M.MERGE_ENV, merge)
        for chunk_tokens in (512, 8):  # 8 and 512 chunks
            plan, out, lse = _run(batch, backend, chunk_tokens, False)
            assert len(plan.chunks) == 4096 // chunk_tokens and plan.running_rows == 64
            results[merge, chunk_tokens] = plan, out, lse
    torch.cuda.synchronize()
    merged = {}  # the partials do not depend on the merge: made once per chunk count
    for (merge, chunk_tokens), (plan, out, lse) in results.items():
        if chunk_tokens not in merged:
            merged[chunk_tokens] = partials_merged_once(batch, plan, batch.weight)
        want, want_lse = merged[chunk_tokens]
        assert_rounded_once(out, want)
        torch.testing.assert_close(lse.double().cpu(), want_lse, atol=1e-5, rtol=1e-6)
        ref.assert_out_close(out, ref_out, atol=OUT_TOL, rtol=PREFILL_RTOL)
    for chunk_tokens in (512, 8):  # the Triton merge: the torch merge's bits, float32 running rows included
        assert bitwise(results["auto", chunk_tokens][1:], results["torch", chunk_tokens][1:])


def test_bf16_requests_split_between_chunks(ref, monkeypatch):
    """Requests whose contexts straddle chunk edges (a merge round reads the running rows of the request it
    continues, rounds the rows it finishes, starts the running rows of the one that goes on): rounded once, and the
    Triton merge gives the torch merge's bits."""
    dims = MLADims.deepseek_v2_lite()
    q_lens, c_lens = [24, 8, 0, 16, 32], [200, 0, 40, 150, 120]
    batch = ref.make_mla_batch(dims, q_lens, c_lens, 16, dtype=BF16, seed=5, device=dev())
    batch.weight = prepare_kv_b_proj(batch.w, dims)
    backend = PrefillPlan.build(
        q_lens, c_lens, dims=dims, block_size=16, workspace=Workspace(dev()), dtype=BF16
    ).backend.name
    plan, out, lse = _run(batch, backend, 7, False)
    assert plan.running_rows == 32 and any(len(s) == 3 for s in plan.merge_steps if s is not None)
    monkeypatch.setenv(M.MERGE_ENV, "torch")
    _, out_t, lse_t = _run(batch, backend, 7, False)
    torch.cuda.synchronize()
    assert_rounded_once(out, partials_merged_once(batch, plan, batch.weight)[0])
    assert bitwise((out, lse), (out_t, lse_t))
    ref.assert_out_close(out, ref.mla_reference(batch)[0], atol=OUT_TOL, rtol=PREFILL_RTOL)


def test_triton_merge_into_another_dtype_bitwise():
    """The compiled kernel reading a float32 or half out and writing float32 or half (the float32 running rows):
    bitwise the float32 torch merge on the same GPU rounded into dst's dtype, in place and not (a +inf LSE read as an
    infinite logit, as mla_prefill's merges read it)."""
    from mla_bridge.merge import merge_planned_, select_merge

    for src, dst_dtype, in_place in RUNNING_FORMS:
        half = src if src != torch.float32 else (torch.float16 if dst_dtype == torch.float16 else BF16)
        oa, la, ob, lb = (x.to(dev()) for x in merge_cases(128, half, seed=41, t=300, h=16))
        oa = (oa.float() * 1.0001).to(src) if src == torch.float32 else oa
        choice = select_merge((1, 16, 128), half, "cuda")
        assert choice.name == "triton"
        a, lse = oa.clone(), la.clone()
        dst = a if in_place else torch.full(oa.shape, 7.0, dtype=dst_dtype, device=dev())
        torch.cuda._sleep(int(1e8))
        merge_planned_(choice, a, lse, ob, lb * M._LOG2E, lse_b_base="log2", dst=dst)
        want_o, want_l = M._merge_torch(oa, la, ob, (lb * M._LOG2E) * M._LN2, dtype=torch.float32, inf_empty=False)
        torch.cuda.synchronize()
        assert dst.dtype == dst_dtype and bitwise((dst, lse), (want_o.to(dst_dtype), want_l)), (src, dst_dtype)
