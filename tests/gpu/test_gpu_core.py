"""GPU tests of the core (FlashInfer fa3 / fa2 against the torch backend and float64 references), bf16.

Marked ``gpu``: skipped (by tests/conftest.py) unless CUDA is available and FlashInfer imports. Run on the H200:
    .venv/bin/python -m pytest tests/gpu -q -m gpu
Tolerances: out within 2e-2, lse within 1e-2. The failure classes tested on the CPU in tests/test_ragged.py,
test_prefill.py, test_merge.py and test_workspace.py (NaN-filled buffers, long keys, zero-length queries, extreme
logits, a small workspace, any head count) have their GPU tests here, under like names.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import (  # noqa: E402
    MLADims,
    PrefillPlan,
    Workspace,
    WorkspaceTooSmallError,
    merge_attn_states,
    mla_prefill,
    plan_ragged,
    select_backend,
)
from mla_bridge.merge import merge_attn_states_  # noqa: E402

BF16 = torch.bfloat16
OUT_TOL, LSE_TOL = 2e-2, 1e-2
# mla_prefill against float64 also carries bf16 roundings of the up-projected k/v and of each merged partial, which
# scale with |out|: those comparisons add a relative 2e-2 to the absolute 2e-2.
PREFILL_RTOL = 2e-2
FLASHINFER = ("flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2")
SCALE = MLADims.deepseek_v2_lite().softmax_scale


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def usable(backend: str, **kwargs) -> bool:
    """Whether ``backend`` can serve on this GPU (the dispatch table's own answer)."""
    try:
        select_backend(dev(), requested=backend, **kwargs)
        return True
    except ValueError:
        return False


def require(backend: str, **kwargs) -> None:
    if not usable(backend, **kwargs):
        pytest.skip(f"{backend} cannot serve on capability {torch.cuda.get_device_capability()}")


def available_backends(**kwargs) -> list[str]:
    return [b for b in FLASHINFER + ("torch",) if usable(b, **kwargs)]


def ragged_inputs(q_lens, kv_lens, heads, seed=0, strided=False):
    """bf16 q [T,H,192], k [S,H,192], v [S,H,128] on the GPU; ``strided``: q a transposed view and v the last
    128 columns of a [S, H, 256] buffer (how mla_prefill hands v over)."""
    g = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(kv_lens)
    q = torch.randn(t, heads, 192, generator=g).to(BF16)
    k = torch.randn(s, heads, 192, generator=g).to(BF16)
    v = torch.randn(s, heads, 128, generator=g).to(BF16)
    q, k, v = q.to(dev()), k.to(dev()), v.to(dev())
    if strided:
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
        kv = torch.empty(s, heads, 256, dtype=BF16, device=dev())
        kv[..., 128:] = v
        kv[..., :128] = float("nan")  # never to be read
        v = kv[..., 128:]
    return q, k, v


def run_ragged(backend, q, k, v, qo, kv, causal, ws=None, lse_layout="NH"):
    plan = plan_ragged(
        qo,
        kv,
        num_heads=q.shape[1],
        head_dim_qk=192,
        head_dim_vo=128,
        causal=causal,
        sm_scale=SCALE,
        dtype=BF16,
        workspace=ws or Workspace(dev()),
        backend=backend,
    )
    assert plan.backend.name == backend
    out, lse = plan.run(q, k, v, lse_layout=lse_layout)
    torch.cuda.synchronize()
    return out, lse


def cumsum0(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


# q_len 0 and 1 included; causal keeps q_len <= kv_len (cutlass's rule); non-causal has a request with no keys.
CAUSAL_LENS = ([0, 1, 17, 128, 300, 0, 1], [5, 1, 40, 128, 300, 0, 33])
NONCAUSAL_LENS = ([0, 1, 17, 128, 4, 300, 1], [5, 1, 40, 128, 0, 257, 1])


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2"])
def test_flashinfer_vs_torch_backend(ref, backend, heads, causal, strided):
    require(backend, dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    q_lens, kv_lens = CAUSAL_LENS if causal else NONCAUSAL_LENS
    qo, kv = cumsum0(q_lens), cumsum0(kv_lens)
    q, k, v = ragged_inputs(q_lens, kv_lens, heads, seed=heads + causal, strided=strided)
    out, lse = run_ragged(backend, q, k, v, qo, kv, causal)
    t_out, t_lse = run_ragged("torch", q.contiguous(), k, v.contiguous(), qo, kv, causal)
    assert out.dtype == BF16 and lse.dtype == torch.float32 and out.shape == (qo[-1], heads, 128)
    ref.assert_out_close(out, t_out.double(), atol=OUT_TOL)
    ref.assert_lse_close(lse, t_lse.double(), atol=LSE_TOL)
    # and both against float64 (a sample of heads keeps it cheap)
    hs = slice(0, 4)
    e_out, e_lse = ref.ragged_reference(q[:, hs], k[:, hs], v[:, hs], qo, kv, causal=causal, sm_scale=SCALE)
    ref.assert_out_close(out[:, hs], e_out, atol=OUT_TOL)
    ref.assert_lse_close(lse[:, hs], e_lse, atol=LSE_TOL)


@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2"])
def test_flashinfer_lse_layout_hn(ref, backend):
    require(backend, dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    q_lens, kv_lens = [3, 9, 1], [7, 9, 12]  # T = 13 != H = 16
    qo, kv = cumsum0(q_lens), cumsum0(kv_lens)
    q, k, v = ragged_inputs(q_lens, kv_lens, 16, seed=3)
    _, lse_nh = run_ragged(backend, q, k, v, qo, kv, True)
    _, lse_hn = run_ragged(backend, q, k, v, qo, kv, True, lse_layout="HN")
    assert lse_hn.shape == (16, 13)
    torch.testing.assert_close(lse_hn, lse_nh.t(), atol=1e-5, rtol=0)
    _, e_lse = ref.ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=SCALE)
    ref.assert_lse_close(lse_hn.t(), e_lse, atol=LSE_TOL)


def test_default_backend_on_this_gpu():
    cap = torch.cuda.get_device_capability()
    choice = select_backend(dev(), dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    expected = {9: "flashinfer-fa3", 10: "flashinfer-cutlass", 11: "flashinfer-cutlass"}.get(cap[0], "flashinfer-fa2")
    if cap[0] in (10, 11) and choice.name != expected:
        pytest.skip(f"cutlass passed over here: {choice.passed_over}")
    assert choice.name == expected


# ---------------------------------------------------------------------------------------------------------------
# mla_prefill with context chunks, real dims (DeepSeek-V2-Lite, 16 heads), bf16
# ---------------------------------------------------------------------------------------------------------------

PREFILL_Q = [5, 0, 17, 1, 9]
PREFILL_C = [40, 3, 0, 250, 33]


@pytest.fixture(scope="module")
def v2_batch(ref):
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, PREFILL_Q, PREFILL_C, 16, dtype=BF16, seed=1, device=dev())
    return batch, ref.mla_reference(batch)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("budget", [16, 100, 326, 100_000])  # one block, splits requests, exactly all, more
def test_mla_prefill_chunks_vs_float64(ref, v2_batch, budget, fuse):
    batch, (e_out, e_lse) = v2_batch
    plan = PrefillPlan.build(
        PREFILL_Q,
        PREFILL_C,
        dims=batch.dims,
        workspace=Workspace(dev(), chunk_tokens=budget),
        block_size=16,
        dtype=BF16,
        fuse_context=fuse,
    )
    assert plan.backend.is_flashinfer
    out, lse = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
    )
    torch.cuda.synchronize()
    ref.assert_out_close(out, e_out, atol=OUT_TOL, rtol=PREFILL_RTOL)
    ref.assert_lse_close(lse, e_lse, atol=LSE_TOL)


@pytest.mark.parametrize("heads", [2, 3])
def test_merge_round_partials_at_odd_rows_vs_float64(ref, heads):
    """Merge rounds put a chunk's partial at a row offset of the shared partial buffer: with 2 or 3 heads (V2-Lite
    tensor-parallel over 8 or so) its LSE then starts 8 or 12 bytes into a 16-byte line. FlashInfer writes it there
    and the round's one merge reads it: the result against float64, the buffers NaN-filled so an unwritten row shows."""
    dims = MLADims(num_heads=heads, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    q_lens, c_lens = [3, 2, 5], [7, 9, 4]
    batch = ref.make_mla_batch(dims, q_lens, c_lens, 4, dtype=BF16, seed=heads, device=dev())
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=16),
        block_size=4,
        dtype=BF16,
        fuse_context=False,
    )
    assert [(c.part_row, c.merge_rows) for c in plan.chunks] == [(0, None), (5, (0, 10))] and plan.num_merges == 1
    torch.cuda._sleep(int(1e8))
    out, lse = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        return_lse=True,
        out=torch.full((10, heads, 128), float("nan"), dtype=BF16, device=dev()),
    )
    torch.cuda.synchronize()
    e_out, e_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, e_out, atol=OUT_TOL, rtol=PREFILL_RTOL)
    ref.assert_lse_close(lse, e_lse, atol=LSE_TOL)


@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2"])
def test_mla_prefill_each_backend(ref, v2_batch, backend):
    require(backend, dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    batch, (e_out, e_lse) = v2_batch
    for budget, fuse in ((50, False), (100_000, True)):
        plan = PrefillPlan.build(
            PREFILL_Q,
            PREFILL_C,
            dims=batch.dims,
            workspace=Workspace(dev(), chunk_tokens=budget),
            block_size=16,
            dtype=BF16,
            fuse_context=fuse,
            backend=backend,
        )
        out, lse = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
        )
        ref.assert_out_close(out, e_out, atol=OUT_TOL, rtol=PREFILL_RTOL)
        ref.assert_lse_close(lse, e_lse, atol=LSE_TOL)


# ---------------------------------------------------------------------------------------------------------------
# failure classes on the GPU (their CPU side: tests/test_ragged.py, test_prefill.py, test_merge.py, test_workspace.py)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_lens,c_lens,budget,fuse",
    [([2, 2], [3, 9], 4, False), ([2, 2, 2], [3, 0, 9], 4, False), ([2, 2], [3, 9], 100, True)],
)
def test_nan_filled_buffers_gpu(ref, monkeypatch, q_lens, c_lens, budget, fuse):
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, q_lens, c_lens, 4, dtype=BF16, seed=2, device=dev())
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=budget),
        block_size=4,
        dtype=BF16,
        fuse_context=fuse,
    )
    real_empty = torch.empty
    made = []

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
            made.append(tuple(t.shape))
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", nan_empty)
        out, lse = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
        )
        torch.cuda.synchronize()
    assert made, "the NaN-filled torch.empty was never used"
    e_out, e_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, e_out, atol=OUT_TOL, rtol=PREFILL_RTOL)
    ref.assert_lse_close(lse, e_lse, atol=LSE_TOL)


def test_single_query_long_keys(ref):
    """12 requests of one query over keys summing to 15500, 128 heads, 192/128, bf16, non-causal."""
    kv_lens = [1, 2899, 17, 1290, 3000, 640, 2, 2048, 999, 1500, 2600, 504]
    assert sum(kv_lens) == 15500
    qo, kv = list(range(13)), cumsum0(kv_lens)
    q, k, v = ragged_inputs([1] * 12, kv_lens, 128, seed=4)
    e_out, e_lse = ref.ragged_reference(q, k, v, qo, kv, causal=False, sm_scale=SCALE)  # float64 on the GPU
    backends = available_backends(dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    assert any(b.startswith("flashinfer") for b in backends)
    for backend in backends:
        out, lse = run_ragged(backend, q, k, v, qo, kv, False)
        ref.assert_out_close(out, e_out, atol=OUT_TOL)
        ref.assert_lse_close(lse, e_lse, atol=LSE_TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo,kv", [([0, 1, 1, 2], [0, 3, 3, 8]), ([0, 0, 0, 0, 1], [0, 2, 2, 5, 6])])
def test_zero_length_queries_gpu(ref, qo, kv, causal):
    q_lens = [b - a for a, b in zip(qo[:-1], qo[1:])]
    kv_lens = [b - a for a, b in zip(kv[:-1], kv[1:])]
    q, k, v = ragged_inputs(q_lens, kv_lens, 16, seed=5)
    e_out, e_lse = ref.ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=SCALE)
    for backend in available_backends(
        dtype=BF16, head_dim_qk=192, head_dim_vo=128, causal=causal, num_heads=16, qo_indptr=qo, kv_indptr=kv
    ):
        out, lse = run_ragged(backend, q, k, v, qo, kv, causal)
        ref.assert_out_close(out, e_out, atol=OUT_TOL)
        ref.assert_lse_close(lse, e_lse, atol=LSE_TOL)


@pytest.mark.parametrize("heads", [1, 16])
def test_extreme_logit_gpu(heads):
    """q.k = -524288 from 128 x (-64 * 64) (exact in bf16), sm_scale 192**-0.5, v = 1: out exactly 1."""
    q = torch.zeros(1, heads, 192, dtype=BF16, device=dev())
    k = torch.zeros(1, heads, 192, dtype=BF16, device=dev())
    q[..., :128] = -64.0
    k[..., :128] = 64.0
    v = torch.ones(1, heads, 128, dtype=BF16, device=dev())
    expected = -524288.0 * 192**-0.5  # -37837.2
    for backend in available_backends(dtype=BF16, head_dim_qk=192, head_dim_vo=128):
        plan = plan_ragged(
            [0, 1],
            [0, 1],
            num_heads=heads,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=True,
            sm_scale=192**-0.5,
            dtype=BF16,
            workspace=Workspace(dev()),
            backend=backend,
        )
        out, lse = plan.run(q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, torch.ones_like(out)), backend  # a finite "-inf" sentinel gives 0
        assert torch.allclose(
            lse.double().cpu(), torch.full((1, heads), expected, dtype=torch.float64), rtol=1e-3, atol=0
        ), (backend, lse)


@pytest.mark.parametrize("form", ["mla_prefill", "ragged"])
def test_small_workspace_fa2(ref, form):
    """128 heads, 64 requests of 16 new tokens over 4096 context tokens each, a 16 MiB float workspace, fa2:
    either it grows and runs right (against the torch backend), or WorkspaceTooSmallError; never FlashInfer's
    "Buffer overflow"."""
    require("flashinfer-fa2", dtype=BF16, head_dim_qk=192, head_dim_vo=128)
    n_req, new, ctx = 64, 16, 4096
    ws = Workspace(dev(), float_workspace_bytes=16 * 1024 * 1024)
    try:
        if form == "ragged":
            # one context chunk's pass of that batch (16 requests x 4096 keys = the default 65536-token chunk); all
            # 64 requests' keys at once would be 6.4e9 elements, past fa2's offset limit (refused by dispatch)
            n_req = 16
            qo, kv = cumsum0([new] * n_req), cumsum0([ctx] * n_req)
            q, k, v = ragged_inputs([new] * n_req, [ctx] * n_req, 128, seed=8)
            out, lse = run_ragged("flashinfer-fa2", q, k, v, qo, kv, False, ws=ws)
            expect = run_ragged("torch", q, k, v, qo, kv, False)
        else:
            dims = MLADims.deepseek_v3()
            q_lens, c_lens = [new] * n_req, [ctx] * n_req
            batch = ref.make_mla_batch(dims, q_lens, c_lens, 64, dtype=BF16, seed=8, device=dev(), spare_blocks=1)
            outs = []
            for backend, workspace in (("flashinfer-fa2", ws), ("torch", Workspace(dev()))):
                plan = PrefillPlan.build(
                    q_lens, c_lens, dims=dims, workspace=workspace, block_size=64, dtype=BF16, backend=backend
                )
                outs.append(
                    mla_prefill(
                        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
                    )
                )
            (out, lse), expect = outs
    except WorkspaceTooSmallError as err:
        assert "Buffer overflow" not in str(err) and "bytes" in str(err)
        return
    except Exception as err:  # pragma: no cover - the failure this test exists for
        assert "Buffer overflow" not in str(err), f"FlashInfer's message reached the user: {err}"
        raise
    torch.cuda.synchronize()
    assert ws.float_workspace_bytes >= 16 * 1024 * 1024
    ref.assert_out_close(out, expect[0].double(), atol=OUT_TOL)
    ref.assert_lse_close(lse, expect[1].double(), atol=LSE_TOL)


@pytest.mark.parametrize("heads", [1, 16, 64, 128, 256])
def test_merge_any_head_count_gpu(heads):
    g = torch.Generator().manual_seed(heads)
    t = 37
    oa = torch.randn(t, heads, 128, generator=g).to(BF16).to(dev())
    ob = torch.randn(t, heads, 128, generator=g).to(BF16).to(dev())
    la = (torch.randn(t, heads, generator=g) * 4).to(dev())
    lb = (torch.randn(t, heads, generator=g) * 4).to(dev())
    la[0], lb[0] = float("-inf"), float("-inf")  # both empty -> (0, -inf)
    la[1] = float("inf")  # +inf reads as empty -> (ob, lb)
    la[2] = float("-inf")  # one empty -> (ob, lb)
    out, lse = merge_attn_states(oa, la, ob, lb)
    torch.cuda.synchronize()
    # the float32 torch formula, written out
    la_e = torch.where(torch.isinf(la), float("-inf"), la)
    m = torch.maximum(la_e, lb)
    m = torch.where(torch.isinf(m), 0.0, m)
    wa, wb = torch.exp(la_e - m), torch.exp(lb - m)
    tot = wa + wb
    e_out = (oa.float() * wa[..., None] + ob.float() * wb[..., None]) / torch.where(tot > 0, tot, 1.0)[..., None]
    e_lse = torch.where(tot > 0, m + torch.log(torch.where(tot > 0, tot, 1.0)), float("-inf"))
    assert out.shape == (t, heads, 128) and out.dtype == BF16 and lse.shape == (t, heads)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    torch.testing.assert_close(out.float(), e_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[1:], e_lse[1:], atol=1e-4, rtol=1e-5)
    # in place, on a row slice of a bigger buffer
    big_o = torch.zeros(t + 3, heads, 128, dtype=BF16, device=dev())
    big_l = torch.zeros(t + 3, heads, device=dev())
    big_o[1 : t + 1], big_l[1 : t + 1] = oa, la
    merge_attn_states_(big_o[1 : t + 1], big_l[1 : t + 1], ob, lb)
    torch.cuda.synchronize()
    torch.testing.assert_close(big_o[1 : t + 1].float(), e_out, atol=1e-2, rtol=1e-2)
    assert torch.isneginf(big_l[1]).all() and not torch.isnan(big_l).any()
    torch.testing.assert_close(big_l[2 : t + 1], e_lse[1:], atol=1e-4, rtol=1e-5)
    assert torch.equal(big_o[0], torch.zeros_like(big_o[0])) and torch.equal(
        big_o[t + 1 :], torch.zeros_like(big_o[t + 1 :])
    )


@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2", "flashinfer-cutlass"])
def test_ragged_out_sharing_memory_with_an_input_is_refused_on_the_gpu(backend):
    """On CUDA an out inside q or v (``out=q[..., :128]``, ``out=v``) was run: the kernel's tiles read q / v while
    others wrote out (a race). Each FlashInfer backend that serves here refuses it by name before any kernel (q and v
    unchanged), through plan.run and ragged_prefill; an out beside q in one buffer runs and equals an out of its
    own."""
    require(backend, dtype=BF16, head_dim_qk=192, head_dim_vo=128, causal=True)
    from mla_bridge import ragged_prefill

    lens = [37, 300, 64]
    q, k, v = ragged_inputs(lens, lens, 16, seed=4)
    qo = cumsum0(lens)
    plan = plan_ragged(
        qo,
        qo,
        num_heads=16,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=True,
        sm_scale=SCALE,
        dtype=BF16,
        workspace=Workspace(dev()),
        backend=backend,
    )
    want, _ = plan.run(q, k, v)
    saved = q.clone(), v.clone()
    for out, name in ((q[..., :128], "q"), (v, "v"), (k[..., 64:], "k")):
        with pytest.raises(ValueError, match=rf"^out shares memory with {name}"):
            plan.run(q, k, v, out=out)
        with pytest.raises(ValueError, match=rf"^out shares memory with {name}"):
            ragged_prefill(q, k, v, qo, qo, causal=True, sm_scale=SCALE, backend=backend, out=out)
    torch.cuda.synchronize()
    assert torch.equal(q, saved[0]) and torch.equal(v, saved[1])
    t = sum(lens)
    big = torch.empty(t * 16 * (192 + 128), dtype=BF16, device=dev())
    q2 = big[: t * 16 * 192].view(t, 16, 192).copy_(q)
    out = big[t * 16 * 192 :].view(t, 16, 128)
    assert plan.run(q2, k, v, out=out)[0] is out
    torch.cuda.synchronize()
    assert torch.equal(out, want)
