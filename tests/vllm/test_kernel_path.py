"""The vLLM adapter's kernel path without vLLM (``kernel_path``): CPU with the torch backend everywhere, and on a
GPU (marked ``gpu``) FlashInfer fa3 / fa2 / cutlass, each where the dispatch table says it can serve, against the
torch backend and a float64 full-sequence reference.

Needs no vLLM: runs in the core suite and on the H200, e.g.
    .venv/bin/python -m pytest tests/vllm/test_kernel_path.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

import kernel_path as K
from mla_bridge import MLADims, Workspace, select_backend
from mla_bridge_vllm.plans import host_indptr_from_lens, servable

V2_LITE = MLADims.deepseek_v2_lite().softmax_scale
# bf16 against float64: out 2e-2 absolute plus 2e-2 relative (the path rounds the up-projected k/v and each merged
# partial to bf16); lse 1e-2 against the torch backend on the same inputs.
OUT_TOL = dict(atol=2e-2, rtol=2e-2)
LSE_TOL = dict(atol=1e-2, rtol=0)

# (query lens, context lens, heads, workspace tokens, block size): every batch has several chunks, a request split
# across two chunks (a continuation) and requests without context.
GPU_CASES = {
    "v2lite_h16": ([37, 5, 300, 64, 2, 9], [500, 0, 1200, 33, 0, 70], 16, 1024, 16),
    "v3_h128": ([19, 3, 40, 7], [90, 0, 300, 17], 128, 256, 16),
    "long_h16": ([1000, 1], [4000, 3000], 16, 4096, 64),
}
CPU_CASE = ([5, 3, 4, 6, 3, 2], [20, 30, 0, 100, 10, 0], 4, 64, 16)


def test_chunk_layout_cases():
    chunks = K.chunk_layout([20, 30, 0, 100, 10, 0], 64, 16)
    assert [(c.request_slice, c.starts, c.seq_lens) for c in chunks] == [
        (slice(0, 2), (0, 0), (20, 30)),
        (slice(3, 4), (0,), (64,)),
        (slice(3, 5), (64, 0), (36, 10)),
    ]
    assert [c.is_continuation for c in chunks] == [False, False, True]
    assert K.chunk_layout([0, 0], 64, 16) == []
    for ctx, ws, bs in ((GPU_CASES["v2lite_h16"][1], 1024, 16), ([4000, 3000], 4096, 64), ([33, 64, 1], 32, 16)):
        chunks = K.chunk_layout(ctx, ws, bs)
        assert all(sum(c.seq_lens) <= ws for c in chunks)
        covered = [0] * len(ctx)
        for c in chunks:
            for r, s, n in zip(range(c.request_slice.start, c.request_slice.stop), c.starts, c.seq_lens):
                assert s == covered[r] and n > 0 and s % bs == 0
                covered[r] += n
        assert covered == list(ctx)


def test_host_indptr_from_lens():
    assert host_indptr_from_lens(torch.tensor([3, 0, 2], dtype=torch.int32)).tolist() == [0, 3, 3, 5]
    assert host_indptr_from_lens([]).tolist() == [0]
    assert host_indptr_from_lens([4]).dtype == torch.int32


def test_servable_answers_on_cpu():
    ok, why = servable(None, dtype=torch.float32, head_dim_qk=192, head_dim_vo=128)
    assert ok and why.startswith("torch")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.complex64])
@pytest.mark.parametrize("capability", [None, (9, 0)])
def test_servable_refuses_dtypes_no_plan_takes(dtype, capability):
    """vLLM's supports_dtype(torch.int8) on its CPU platform said True, though plan_ragged refuses every
    non-floating dtype ("dtype must be a floating torch.dtype")."""
    ok, why = servable(capability, dtype=dtype, head_dim_qk=192, head_dim_vo=128)
    assert not ok and "not a floating dtype" in why


def _check(x, chunks, backend, workspace=None):
    res = K.run_like_vllm(x, chunks, V2_LITE, backend=backend, workspace=workspace)
    assert res.plans.main.backend.name == backend
    assert all(p.backend.name == backend for p in res.plans.chunks.values())
    ref = K.reference(x, V2_LITE)
    assert torch.isfinite(res.out).all()
    torch.testing.assert_close(
        res.out.double(), ref, **(OUT_TOL if x.q.dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5))
    )
    return res


def test_kernel_path_cpu_torch_backend():
    q_lens, ctx_lens, heads, ws, bs = CPU_CASE
    for dtype in (torch.bfloat16, torch.float32):
        x = K.make_inputs(q_lens, ctx_lens, heads, dtype, "cpu")
        res = _check(x, K.chunk_layout(ctx_lens, ws, bs), "torch")
        assert [p[0] for p in res.passes] == ["new", "chunk0", "chunk1", "chunk2"]
        for _, out, lse in res.passes:
            assert lse.shape == (heads, out.shape[0]) and lse.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2", "flashinfer-cutlass"])
@pytest.mark.parametrize("case", list(GPU_CASES), ids=str)
def test_kernel_path_gpu(case, backend):
    q_lens, ctx_lens, heads, ws, bs = GPU_CASES[case]
    dev = torch.device("cuda", torch.cuda.current_device())
    try:
        select_backend(dev, requested=backend, dtype=torch.bfloat16, head_dim_qk=192, head_dim_vo=128)
    except ValueError as err:
        pytest.skip(f"{backend} cannot serve here: {err}")
    x = K.make_inputs(q_lens, ctx_lens, heads, torch.bfloat16, dev, seed=7)
    chunks = K.chunk_layout(ctx_lens, ws, bs)
    assert len(chunks) >= 2 and any(c.is_continuation for c in chunks)
    workspace = Workspace(dev)
    res = _check(x, chunks, backend, workspace)
    torch_res = K.run_like_vllm(x, chunks, V2_LITE, backend="torch")
    for (name, out, lse), (_, t_out, t_lse) in zip(res.passes, torch_res.passes):
        assert lse.shape == (heads, out.shape[0]) and lse.is_contiguous(), name
        torch.testing.assert_close(out.double(), t_out.double(), **OUT_TOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(lse, t_lse, **LSE_TOL, msg=lambda m: f"{name}: {m}")
    # a second layer on the same step's plans: no re-planning, the same result bit for bit
    plans_made = workspace.plans_made
    k, v = K.up_project(x, x.kv_c, x.k_pe)
    again, lse = res.plans.run_new_tokens(x.q, k, v, return_softmax_lse=True)
    assert workspace.plans_made == plans_made
    assert torch.equal(again, res.passes[0][1]) and torch.equal(lse, res.passes[0][2])


@pytest.mark.gpu
def test_default_dispatch_on_this_gpu():
    """With no backend forced, the plans take what mla_bridge's dispatch picks for this GPU (fa3 on the H200)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    q_lens, ctx_lens, heads, ws, bs = GPU_CASES["v2lite_h16"]
    x = K.make_inputs(q_lens, ctx_lens, heads, torch.bfloat16, dev, seed=1)
    res = K.run_like_vllm(x, K.chunk_layout(ctx_lens, ws, bs), V2_LITE)
    expected = select_backend(dev, dtype=torch.bfloat16, head_dim_qk=192, head_dim_vo=128).name
    assert res.plans.main.backend.name == expected and expected.startswith("flashinfer")
    torch.testing.assert_close(res.out.double(), K.reference(x, V2_LITE), **OUT_TOL)
    cap = torch.cuda.get_device_capability(dev)
    assert servable(cap, dtype=torch.bfloat16, head_dim_qk=192, head_dim_vo=128)[0]


def test_an_out_sharing_memory_with_q_k_or_v_is_refused_on_the_kernel_path():
    """vLLM hands ``out`` through (``run_prefill_new_tokens`` / ``run_prefill_context_chunk``): an out inside q, k or v
    is refused by name by the core before any kernel, not run over its own input (a race on CUDA); an out of its own
    runs."""
    from mla_bridge_vllm.plans import ChunkIndptrs, PrefillStepPlans

    g = torch.Generator().manual_seed(0)
    h, dqk, dvo = 2, 24, 16
    qo = host_indptr_from_lens([3, 2])
    plans = PrefillStepPlans(
        qo,
        [ChunkIndptrs(0, qo, host_indptr_from_lens([4, 5]))],
        num_heads=h,
        head_dim_qk=dqk,
        head_dim_vo=dvo,
        sm_scale=0.2,
        dtype=torch.float32,
        device="cpu",
    )
    q, k, v = (
        torch.randn(5, h, dqk, generator=g),
        torch.randn(5, h, dqk, generator=g),
        torch.randn(5, h, dvo, generator=g),
    )
    kc, vc = torch.randn(9, h, dqk, generator=g), torch.randn(9, h, dvo, generator=g)
    saved = [x.clone() for x in (q, k, v, kc, vc)]
    for out, name in ((q[..., :dvo], "q"), (v, "v"), (k[..., :dvo], "k")):
        with pytest.raises(ValueError, match=rf"^out shares memory with {name}"):
            plans.run_new_tokens(q, k, v, True, out=out)
    for out, name in ((q[..., dqk - dvo :], "q"), (kc[:5, :, :dvo], "k"), (vc[4:], "v")):
        with pytest.raises(ValueError, match=rf"^out shares memory with {name}"):
            plans.run_context_chunk(0, q, kc, vc, out=out)
    assert all(torch.equal(x, s) for x, s in zip((q, k, v, kc, vc), saved))
    want, _ = plans.run_new_tokens(q, k, v, True)
    out = torch.empty(5, h, dvo)
    assert plans.run_new_tokens(q, k, v, False, out=out) is out and torch.equal(out, want)


def test_new_tokens_compute_an_lse_only_when_asked(monkeypatch):
    """vLLM's ``return_softmax_lse=False`` (a prefill without context): ``out`` alone comes back and the core is asked
    for no LSE (FlashInfer's ``return_lse=False``: no LSE buffer, no base conversion); asked, ``(out, lse [H, T])``."""
    from mla_bridge import RaggedPlan
    from mla_bridge.plan_cache import PlanCache
    from mla_bridge_vllm.plans import PrefillStepPlans

    asked = []
    real_run = RaggedPlan.run

    def run(self, *args, **kwargs):
        asked.append(kwargs.get("return_lse", True))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(RaggedPlan, "run", run)
    h, dqk, dvo = 2, 24, 16
    qo = host_indptr_from_lens([3, 2])
    plans = PrefillStepPlans(
        qo, [], num_heads=h, head_dim_qk=dqk, head_dim_vo=dvo, sm_scale=0.2, dtype=torch.float32, device="cpu",
        cache=PlanCache(),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(5, h, dqk, generator=g),
        torch.randn(5, h, dqk, generator=g),
        torch.randn(5, h, dvo, generator=g),
    )
    out = plans.run_new_tokens(q, k, v, False)
    assert isinstance(out, torch.Tensor) and out.shape == (5, h, dvo) and asked == [False]
    want, lse = plans.run_new_tokens(q, k, v, True)
    assert asked == [False, True] and lse.shape == (h, 5) and torch.equal(out, want)


def test_equal_steps_share_their_plans():
    """Two steps of equal lengths and sizes get the same plans from the cache the adapter uses; a step that differs
    in anything (here: the scale) gets plans of its own."""
    from mla_bridge.plan_cache import PlanCache
    from mla_bridge_vllm.plans import ChunkIndptrs, PrefillStepPlans

    cache = PlanCache()
    qo = host_indptr_from_lens([3, 2])

    def step(scale):
        return PrefillStepPlans(
            qo, [ChunkIndptrs(0, qo, host_indptr_from_lens([4, 5]))], num_heads=2, head_dim_qk=24, head_dim_vo=16,
            sm_scale=scale, dtype=torch.float32, device="cpu", cache=cache,
        )  # fmt: skip

    a, b, c = step(0.2), step(0.2), step(0.3)
    assert a.main is b.main and a.chunks[0] is b.chunks[0] and a.main is not a.chunks[0]
    assert c.main is not a.main and c.chunks[0] is not a.chunks[0]
    assert (cache.hits, cache.misses) == (2, 4)


def test_step_plans_come_from_the_shared_cache_by_default():
    """Without a cache of its own, a step's plans are the shared cache's: the plan the cache keeps for the step's
    main pass is the one the step runs, and an equal step makes no new plan."""
    from mla_bridge.plan_cache import shared_plan_cache
    from mla_bridge_vllm.plans import PrefillStepPlans

    cache = shared_plan_cache()
    qo = host_indptr_from_lens([4, 1])
    args = dict(num_heads=2, head_dim_qk=24, head_dim_vo=16, sm_scale=0.123, dtype=torch.float32, device="cpu")
    first = PrefillStepPlans(qo, [], **args)
    misses = cache.misses
    again = PrefillStepPlans(qo, [], **args)
    assert again.main is first.main and cache.misses == misses
    key = cache.ragged_key(
        qo, qo, num_heads=2, head_dim_qk=24, head_dim_vo=16, causal=True, sm_scale=0.123, dtype=torch.float32,
        workspace=first.main.workspace,
    )  # fmt: skip
    assert cache.lookup(key) is first.main
