"""vLLM's real MLA prefill path (``MLAAttention.forward_impl`` -> ``forward_mha``, paged latent cache, context chunks
including a request split across chunks, requests without context) running on the adapter.

See ``vllm_harness`` for exactly what is vLLM's code and what the harness sets. Compared with a full-sequence float64
SDPA reference and with vLLM's own CPU prefill backend (``CPUSDPAMLAPrefillBackend``) on the same batch.
"""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.v1.attention.backends.mla.prefill.base", reason="needs the vllm package")

import dataclasses  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import vllm_harness as H  # noqa: E402

if not H.HAS_CPU_MLA_PREFILL:
    pytest.skip(f"vLLM {H.vllm_version()} has no CPU MLA prefill path to drive", allow_module_level=True)

from mla_bridge.plan_cache import shared_plan_cache  # noqa: E402
from mla_bridge_vllm.backend import MLABridgePrefillBackend  # noqa: E402

# vLLM's own MLA backend test: rtol = atol = 1e-2 at bf16. float32 here is the torch backend against float64.
TOL = {torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def setup(request):
    dtype = request.param
    batch = H.make_batch(dtype)
    ours = H.build_step(H.make_layer(dtype, batch.w), batch)
    theirs = H.build_step(H.make_layer(dtype, batch.w, H.VLLM_CPU), batch)
    return dtype, batch, ours, theirs


def test_batch_spans_the_cases(setup):
    """The metadata vLLM built: several chunks, a request split across two, requests without context, T != H."""
    _, batch, ours, theirs = setup
    assert isinstance(ours.backend, MLABridgePrefillBackend)
    assert type(theirs.backend).__name__ == "CPUSDPAMLAPrefillBackend"
    chunks = ours.metadata.prefill.chunked_context.chunks
    assert len(chunks) == 3
    assert [c.request_slice for c in chunks] == [slice(0, 2), slice(3, 4), slice(3, 5)]
    assert [c.is_continuation for c in chunks] == [False, False, True]
    assert ours.metadata.prefill.chunked_context.empty_token_slices  # requests 2 and 5
    assert batch.num_tokens != H.HEADS and ours.metadata.num_prefills == len(batch.query_lens)


def test_forward_matches_reference_and_vllm_cpu_backend(setup):
    dtype, batch, ours, theirs = setup
    ref = H.reference(batch)
    out = H.forward(ours, batch)
    out_vllm = H.forward(theirs, batch)
    assert out.dtype == dtype and out.shape == (batch.num_tokens, H.HEADS, H.VDIM)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    torch.testing.assert_close(out.double(), out_vllm.double(), **TOL[dtype])
    # no worse than vLLM's own CPU backend on the same path (bf16 error is the path's rounding, not the kernel's)
    assert _err(out, ref) <= 1.25 * _err(out_vllm, ref) + 1e-6


def _record(backend):
    """Wrap the builder's backend instance so each call's inputs and results are kept."""
    calls = []
    new_tokens, chunk_fn = backend.run_prefill_new_tokens, backend.run_prefill_context_chunk

    def run_new(q, k, v, return_softmax_lse, out=None, output_scale=None):
        res = new_tokens(q=q, k=k, v=v, return_softmax_lse=return_softmax_lse, out=out, output_scale=output_scale)
        calls.append(("new", None, q.clone(), k.clone(), v.clone(), res))
        return res

    def run_chunk(chunk, q, k, v, out=None):
        res = chunk_fn(chunk=chunk, q=q, k=k, v=v, out=out)
        calls.append(("chunk", chunk, q.clone(), k.clone(), v.clone(), res))
        return res

    backend.run_prefill_new_tokens, backend.run_prefill_context_chunk = run_new, run_chunk
    return calls


def test_lse_is_natural_log_heads_by_tokens(setup):
    """Every LSE handed to vLLM: float32, [H, T] (T != H), natural log, equal to vLLM's own CPU backend's."""
    dtype, batch, ours, theirs = setup
    calls, calls_vllm = _record(ours.backend), _record(theirs.backend)
    try:
        H.forward(ours, batch)
        H.forward(theirs, batch)
    finally:
        for step in (ours, theirs):
            for name in ("run_prefill_new_tokens", "run_prefill_context_chunk"):
                vars(step.backend).pop(name, None)
    assert [c[0] for c in calls] == ["new", "chunk", "chunk", "chunk"] == [c[0] for c in calls_vllm]
    tol = dict(rtol=0, atol=2e-3 if dtype == torch.bfloat16 else 1e-5)
    for (kind, chunk, q, k, _, (out, lse)), (*_, (_, lse_vllm)) in zip(calls, calls_vllm):
        t = q.shape[0]
        assert t != H.HEADS
        assert lse.shape == (H.HEADS, t) and lse.dtype == torch.float32, (kind, lse.shape)
        if kind == "new":
            qo = kv = [0] + torch.tensor(batch.query_lens).cumsum(0).tolist()
            expect = H.ragged_lse_reference(q, k, qo, kv, causal=True)
        else:
            expect = H.ragged_lse_reference(
                q, k, chunk.query_start_loc.tolist(), chunk.cu_seq_lens.tolist(), causal=False
            )
        torch.testing.assert_close(lse.double(), expect, **tol)
        torch.testing.assert_close(lse, lse_vllm.float(), **tol)
        # the test tells the conventions apart: base 2 is off by a factor 1/ln 2
        assert _err(lse / math.log(2), expect) > 10 * tol["atol"] + 0.1


class _Log2Lse(MLABridgePrefillBackend):
    """A broken adapter: base-2 LSE (what FlashInfer reports by default)."""

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):
        res = super().run_prefill_new_tokens(q, k, v, return_softmax_lse, out, output_scale)
        return (res[0], res[1] / math.log(2)) if return_softmax_lse else res

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        o, lse = super().run_prefill_context_chunk(chunk, q, k, v, out)
        return o, lse / math.log(2)


class _TransposedLse(MLABridgePrefillBackend):
    """A broken adapter: the [T, H] LSE handed over as [H, T] memory (the silent transposition bug)."""

    def _t(self, lse):
        return lse.t().contiguous().view(lse.shape)

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):
        res = super().run_prefill_new_tokens(q, k, v, return_softmax_lse, out, output_scale)
        return (res[0], self._t(res[1])) if return_softmax_lse else res

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        o, lse = super().run_prefill_context_chunk(chunk, q, k, v, out)
        return o, self._t(lse)


@pytest.mark.parametrize("broken", ["_Log2Lse", "_TransposedLse"])
def test_wrong_lse_convention_fails_the_forward_test(setup, broken):
    """A log2 or transposed LSE makes vLLM's merge wrong by far more than the tolerance: the forward test catches it."""
    dtype, batch, _, _ = setup
    layer = H.make_layer(dtype, batch.w, f"{__name__}.{broken}")
    step = H.build_step(layer, batch)
    assert type(step.backend).__name__ == broken
    out = H.forward(step, batch)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.double(), H.reference(batch), **TOL[torch.bfloat16])


def test_plans_once_per_step_from_host_copies(setup, monkeypatch):
    """prepare_metadata plans once per step (1 + one per chunk), never per layer, from host copies that equal vLLM's
    device indptrs; the device indptrs themselves are not read."""
    dtype, batch, ours, _ = setup
    cache = shared_plan_cache()  # every plan the adapter asks for is a miss or a hit of the cache

    def asked() -> int:
        return cache.misses + cache.hits

    before = asked()
    layer = H.make_layer(dtype, batch.w)
    step = H.build_step(layer, batch)
    md = step.metadata.prefill
    assert asked() - before == 1 + len(md.chunked_context.chunks) == 4
    planned = asked()
    out1 = H.forward(step, batch)
    out2 = H.forward(step, batch, layer=layer)  # a second layer's call on the same step's metadata
    assert asked() == planned and torch.equal(out1, out2)

    plans = step.backend._plans
    assert torch.equal(plans.main.qo_indptr, md.query_start_loc.to(torch.int32))
    assert torch.equal(plans.main.kv_indptr, md.query_start_loc.to(torch.int32))
    assert plans.main.spec.causal and not any(p.spec.causal for p in plans.chunks.values())
    for chunk in md.chunked_context.chunks:
        assert torch.equal(plans.chunks[chunk.index].qo_indptr, chunk.query_start_loc.to(torch.int32))
        assert torch.equal(plans.chunks[chunk.index].kv_indptr, chunk.cu_seq_lens.to(torch.int32))

    # Poison every device indptr: plans made from the host copies are unchanged.
    poison = lambda t: torch.full_like(t, -7)  # noqa: E731
    poisoned = dataclasses.replace(
        md,
        query_start_loc=poison(md.query_start_loc),
        chunked_context=dataclasses.replace(
            md.chunked_context,
            chunks=[
                dataclasses.replace(c, query_start_loc=poison(c.query_start_loc), cu_seq_lens=poison(c.cu_seq_lens))
                for c in md.chunked_context.chunks
            ],
        ),
    )
    fresh = step.backend.clone()
    fresh.prepare_metadata(poisoned)
    assert torch.equal(fresh._plans.main.qo_indptr, plans.main.qo_indptr)
    for index, plan in plans.chunks.items():
        assert torch.equal(fresh._plans.chunks[index].qo_indptr, plan.qo_indptr)
        assert torch.equal(fresh._plans.chunks[index].kv_indptr, plan.kv_indptr)


def test_without_query_lens_cpu_falls_back_to_query_start_loc(setup):
    """vLLM 0.28 leaves query_lens_cpu unset: the adapter copies query_start_loc to the host once per step."""
    _, batch, ours, _ = setup
    md = dataclasses.replace(ours.metadata.prefill, query_lens_cpu=None)
    fresh = ours.backend.clone()
    fresh.prepare_metadata(md)
    assert torch.equal(fresh._plans.main.qo_indptr, ours.backend._plans.main.qo_indptr)


def test_errors_are_clear(setup):
    dtype, batch, ours, _ = setup
    fresh = ours.backend.clone()
    q = batch.q[:3]
    with pytest.raises(RuntimeError, match="prepare_metadata"):
        fresh.run_prefill_new_tokens(q, q, q[..., : H.VDIM], return_softmax_lse=False)
    with pytest.raises(NotImplementedError, match="FP8"):
        ours.backend.run_prefill_new_tokens(q, q, q, False, output_scale=torch.ones(1))
    md = dataclasses.replace(ours.metadata.prefill, q_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8"):
        fresh.prepare_metadata(md)


@pytest.mark.parametrize(
    "query_lens,context_lens,workspace",
    [
        ((5, 3, 4, 6, 3, 2), (20, 30, 0, 100, 10, 0), 64),
        ((37, 5, 30, 64, 2, 9), (500, 0, 1200, 33, 0, 70), 1024),
        ((3, 2, 2), (33, 64, 1), 32),
        ((2, 2), (0, 0), 64),
    ],
)
def test_kernel_path_chunk_layout_is_vllms(query_lens, context_lens, workspace):
    """tests/vllm/kernel_path.py (the vLLM-free GPU test's driver) packs chunks exactly as vLLM's builder does."""
    import kernel_path

    batch = H.make_batch(torch.bfloat16, query_lens, context_lens)
    step = H.build_step(H.make_layer(torch.bfloat16, batch.w), batch, workspace_tokens=workspace)
    ctx = step.metadata.prefill.chunked_context
    theirs = (
        [] if ctx is None else [(c.request_slice, tuple(c.seq_lens.tolist()), c.is_continuation) for c in ctx.chunks]
    )
    ours = [
        (c.request_slice, c.seq_lens, c.is_continuation)
        for c in kernel_path.chunk_layout(context_lens, workspace, H.BLOCK)
    ]
    assert ours == theirs
