"""CUDA-graph replay of the prefill layers (mla_bridge.graphs) on the GPU: bitwise equal to eager mla_prefill for the
fused and the chunked schedule (both weight layouts) and to eager RaggedPlan.run, with the GPU kept busy
(``torch.cuda._sleep``) so that the host runs ahead of the replay; still right after other plans were made and run on
the same workspace once the user dropped the plan.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports. Run on the H200:
    python -m pytest tests/gpu/test_gpu_graphs.py -q -m gpu
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, plan_ragged, prepare_kv_b_proj  # noqa: E402
from mla_bridge.graphs import PrefillLayer, capture, capture_prefill  # noqa: E402

BF16 = torch.bfloat16
Q_LENS = [37, 120, 1, 64, 200]
C_LENS = [300, 0, 77, 513, 150]
BLOCK = 16
LAYERS = 3
SLEEP = int(1e8)  # about 50-100 ms of GPU time: the host enqueues the replay long before the GPU gets to it


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _layers(ref, dims, layout, seed):
    batch = ref.make_mla_batch(dims, Q_LENS, C_LENS, BLOCK, dtype=BF16, seed=seed, device=dev())
    g = torch.Generator(device=dev()).manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        cache = batch.cache.clone()
        live = ~torch.isnan(cache)
        cache[live] = torch.randn(int(live.sum()), generator=g, device=dev()).to(BF16)
        w = (torch.randn(dims.kv_b_proj_shape, generator=g, device=dev()) * dims.kv_lora_rank**-0.5).to(BF16)
        rnd = lambda x: torch.randn(x.shape, generator=g, device=dev()).to(BF16)  # noqa: E731
        layers.append(
            PrefillLayer(
                rnd(batch.q), rnd(batch.kv_c), rnd(batch.k_pe), prepare_kv_b_proj(w, dims, layout=layout), cache
            )
        )
    return layers, batch.block_table


def _eager(layers, table, plan, kv_impl=None):
    return [
        tuple(
            t.clone()
            for t in mla_prefill(
                x.q, x.kv_c, x.k_pe, x.kv_b_proj, x.kv_cache, table, plan, return_lse=True, kv_impl=kv_impl
            )
        )
        for x in layers
    ]


def _new_inputs(layers, seed):
    g = torch.Generator(device=dev()).manual_seed(seed)
    for x in layers:
        for t in (x.q, x.kv_c, x.k_pe):
            t.copy_(torch.randn(t.shape, generator=g, device=dev()).to(BF16))


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for (o, s), (eo, es) in zip(got, want):
        assert torch.equal(o, eo), f"out differs: max {(o.float() - eo.float()).abs().max().item()}"
        assert torch.equal(s, es), "lse differs"


@pytest.mark.parametrize("kv_impl", [None, "separate", "fused"])
@pytest.mark.parametrize("layout", ["identity", "split"])
@pytest.mark.parametrize("fuse,budget", [(True, 100_000), (False, 256)])
def test_graphed_prefill_equals_eager_bitwise(ref, fuse, budget, layout, kv_impl):
    """A replay is bitwise the eager calls on the same kernels: an explicit kv_impl as given; the default ("auto")
    captures the GPU-faster path of each pass (mla_bridge.kv.pass_impl), the separate path, or the fused kernel for
    the identity layout, whatever the eager default would choose for the pass."""
    dims = MLADims.deepseek_v2_lite()
    layers, table = _layers(ref, dims, layout, seed=1)
    plan = PrefillPlan.build(
        Q_LENS,
        C_LENS,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=budget),
        block_size=BLOCK,
        dtype=BF16,
        fuse_context=fuse,
    )
    assert plan.backend.is_flashinfer and plan.fused == fuse and (fuse or len(plan.chunks) >= 3)
    graph = capture_prefill(plan, layers, table, return_lse=True, kv_impl=kv_impl)
    assert graph.graphed and graph.capture_ms > 0 and graph.memory_bytes > 0
    for step in range(2):  # two batches of values through the same buffers
        _new_inputs(layers, seed=10 + step)
        want = _eager(layers, table, plan, kv_impl or ("fused" if layout == "identity" else "separate"))
        torch.cuda._sleep(SLEEP)
        got = graph.replay()
        torch.cuda.synchronize()
        _assert_bitwise(got, want)
    assert graph.replays == 2


def test_warm_up_launches_the_kernels_the_capture_records(ref, monkeypatch):
    """capture() warms up under kv.capture_rule(): every pass of the warm-up call takes the implementation its
    captured twin takes (before, the warm-up ran the eager rule's fused kernel on the small passes, and the gather
    and cuBLAS GEMM the capture records were launched, and compiled, for the first time inside the capture)."""
    from mla_bridge import kv as KV

    dims = MLADims.deepseek_v2_lite()
    layers, table = _layers(ref, dims, "split", seed=5)
    plan = PrefillPlan.build(
        Q_LENS, C_LENS, dims=dims, workspace=Workspace(dev(), chunk_tokens=256), block_size=BLOCK, dtype=BF16
    )
    assert not plan.fused and KV.pass_impl("auto", True, False, 256, "split") == "fused"  # eager: the small passes
    seen = []
    real = KV.pass_impl

    def spy(*args, **kwargs):
        choice = real(*args, **kwargs)
        seen.append((torch.cuda.is_current_stream_capturing(), choice))
        return choice

    monkeypatch.setattr(KV, "pass_impl", spy)
    graph = capture_prefill(plan, layers[:1], table, warmup=1)
    warm = [choice for capturing, choice in seen if not capturing]
    captured = [choice for capturing, choice in seen if capturing]
    assert graph.graphed and len(warm) == len(captured) == 1 + sum(c.plan is not None for c in plan.chunks)
    assert warm == captured == ["separate"] * len(captured)


@pytest.mark.parametrize("layout", ["identity", "split"])
def test_graphed_fp8_cache_takes_one_implementation_for_every_pass(ref, layout):
    """An FP8 cache through capture() and through capture_prefill (``PrefillLayer.kv_cache_scale``, which it lacked
    before): the default graph is bitwise eager "fused" for the identity layout and
    "separate" for the split one on every pass, the new tokens' pass included (it was fused while the FP8 chunks were
    separate)."""
    from mla_bridge.cache import quantize_latent_cache

    dims = MLADims.deepseek_v2_lite()
    layers, table = _layers(ref, dims, layout, seed=7)
    x = layers[0]
    cache8, scale = quantize_latent_cache(x.kv_cache.float())
    plan = PrefillPlan.build(
        Q_LENS,
        C_LENS,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=256),
        block_size=BLOCK,
        dtype=BF16,
        kv_cache_dtype="fp8",
    )
    assert not plan.fused and len(plan.chunks) >= 3

    def call(kv_impl=None):
        return mla_prefill(
            x.q,
            x.kv_c,
            x.k_pe,
            x.kv_b_proj,
            cache8,
            table,
            plan,
            return_lse=True,
            kv_cache_scale=scale,
            kv_impl=kv_impl,
        )

    graph = capture(call, plans=[plan])
    layer = PrefillLayer(x.q, x.kv_c, x.k_pe, x.kv_b_proj, cache8, kv_cache_scale=scale)
    per_layer = capture_prefill(plan, [layer], table, return_lse=True)
    _new_inputs([x], seed=21)
    want = tuple(t.clone() for t in call("fused" if layout == "identity" else "separate"))
    torch.cuda._sleep(SLEEP)
    got = graph.replay()
    torch.cuda.synchronize()
    _assert_bitwise([got], [want])
    torch.cuda._sleep(SLEEP)
    got = per_layer.replay()
    torch.cuda.synchronize()
    _assert_bitwise(got, [want])


def test_graphed_ragged_plan_run_equals_eager_bitwise():
    g = torch.Generator(device=dev()).manual_seed(3)
    q_lens, kv_lens = [100, 7, 300], [400, 7, 1000]
    q = torch.randn(sum(q_lens), 16, 192, generator=g, device=dev()).to(BF16)
    k = torch.randn(sum(kv_lens), 16, 192, generator=g, device=dev()).to(BF16)
    v = torch.randn(sum(kv_lens), 16, 128, generator=g, device=dev()).to(BF16)
    qo = [0, 100, 107, 407]
    kv = [0, 400, 407, 1407]
    plan = plan_ragged(
        qo,
        kv,
        num_heads=16,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=True,
        sm_scale=0.1147,
        dtype=BF16,
        workspace=Workspace(dev()),
    )
    out = torch.empty(sum(q_lens), 16, 128, dtype=BF16, device=dev())
    lse = torch.empty(sum(q_lens), 16, dtype=torch.float32, device=dev())
    graph = capture(lambda: plan.run(q, k, v, out=out, lse=lse), plans=[plan])
    q.copy_(torch.randn(q.shape, generator=g, device=dev()).to(BF16))
    want_out, want_lse = (t.clone() for t in plan.run(q, k, v))
    out.zero_()
    torch.cuda._sleep(SLEEP)
    got_out, got_lse = graph.replay()
    torch.cuda.synchronize()
    assert got_out is out and torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("layout", ["identity", "split"])
@pytest.mark.parametrize("fuse,budget", [(True, 100_000), (False, 256)])
def test_prepared_layouts_vs_float64(ref, fuse, budget, layout):
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, Q_LENS, C_LENS, BLOCK, dtype=BF16, seed=7, device=dev())
    plan = PrefillPlan.build(
        Q_LENS,
        C_LENS,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=budget),
        block_size=BLOCK,
        dtype=BF16,
        fuse_context=fuse,
    )
    prepared = prepare_kv_b_proj(batch.w, dims, layout=layout)
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, prepared, batch.cache, batch.block_table, plan, return_lse=True
    )
    raw_out, raw_lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    torch.cuda.synchronize()
    e_out, e_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, e_out, atol=2e-2, rtol=2e-2)
    ref.assert_lse_close(lse, e_lse, atol=1e-2)
    if layout == "identity":  # the raw weight is prepared the same way inside the call: the same bits
        assert torch.equal(out, raw_out) and torch.equal(lse, raw_lse)


@pytest.mark.parametrize("fuse,budget", [(True, 100_000), (False, 256)])
def test_replay_after_other_plans_on_the_same_workspace(ref, fuse, budget):
    dims = MLADims.deepseek_v2_lite()
    layers, table = _layers(ref, dims, "identity", seed=4)
    ws = Workspace(dev(), chunk_tokens=budget)
    plan = PrefillPlan.build(Q_LENS, C_LENS, dims=dims, workspace=ws, block_size=BLOCK, dtype=BF16, fuse_context=fuse)
    want = _eager(layers, table, plan)
    graph = capture_prefill(plan, layers, table, return_lse=True)
    del plan  # the graph alone holds it now
    gc.collect()
    # other batches planned and run on the same workspace (they take other pooled wrappers)
    for i, (q_lens, c_lens) in enumerate((([5, 9], [40, 0]), ([300], [700]), (Q_LENS[::-1], C_LENS[::-1]))):
        other = ref.make_mla_batch(dims, q_lens, c_lens, BLOCK, dtype=BF16, seed=20 + i, device=dev())
        p = PrefillPlan.build(q_lens, c_lens, dims=dims, workspace=ws, block_size=BLOCK, dtype=BF16, fuse_context=fuse)
        mla_prefill(other.q, other.kv_c, other.k_pe, other.w, other.cache, other.block_table, p)
        del p
        gc.collect()
    torch.cuda._sleep(SLEEP)
    got = graph.replay()
    torch.cuda.synchronize()
    _assert_bitwise(got, want)


@pytest.mark.parametrize(
    "dtype,fuse,budget", [(BF16, True, 100_000), (torch.float32, True, 100_000), (torch.float32, False, 256)]
)
def test_replay_on_another_stream_released_there_keeps_the_index_block(ref, dtype, fuse, budget):
    """Captured on the default stream, replayed on a side stream kept busy, released on that stream as
    PrefillGraph.release allows, plan dropped: the plan's device index block (bf16 fused: the expansion's buffer;
    float32, the torch backend: that buffer, or the chunks' kv_indptr copy) must not be handed to a new allocation
    on the build stream while the side stream's replay is still queued. PrefillGraph.replay marks it used on each
    stream it replays on; before, only eager runs did (the graph's warm-up stream, long idle), so the next allocation
    of that size on the default stream got the block at once and the replay read what was written there."""
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, Q_LENS, C_LENS, BLOCK, dtype=dtype, seed=11, device=dev())
    layer = PrefillLayer(batch.q, batch.kv_c, batch.k_pe, prepare_kv_b_proj(batch.w, dims), batch.cache)
    plan = PrefillPlan.build(
        Q_LENS,
        C_LENS,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=budget),
        block_size=BLOCK,
        dtype=dtype,
        fuse_context=fuse,
    )
    assert plan.fused == fuse and plan.backend.is_flashinfer == (dtype == BF16)
    want = _eager([layer], batch.block_table, plan, "separate")
    graph = capture_prefill(plan, [layer], batch.block_table, return_lse=True, kv_impl="separate")
    index = plan.ctx_req_ids if fuse else plan.chunks[0].rows.kv_indptr
    index = index if index._base is None else index._base
    assert any(index is t or index is t._base for t in plan._device_indices)
    ptr, numel, index_dtype = index.data_ptr(), index.numel(), index.dtype
    del plan, index
    gc.collect()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10 * SLEEP)  # the replay below stays queued while the host goes on
        got = graph.replay()
        graph.release()
    del graph
    gc.collect()
    assert not side.query(), "the side stream finished too early for this test to mean anything"
    fresh = [torch.zeros(numel, dtype=index_dtype, device=dev()) for _ in range(8)]  # in-range values: no fault
    reused = any(f.data_ptr() == ptr for f in fresh)
    still_queued = not side.query()
    torch.cuda.synchronize()
    assert still_queued and not reused, "the plan's index block was reused while a replay on another stream read it"
    _assert_bitwise(got, want)
