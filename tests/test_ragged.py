"""The torch backend (ragged_prefill / plan_ragged on the CPU) against a float64 dense loop
(tests/helpers/reference.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mla_bridge import Workspace, plan_ragged, ragged_prefill
from mla_bridge.backends.torch_ref import ragged_attention_reference

D_QK, D_VO = 24, 16
ATOL = 2e-5

# (q_lens, kv_lens): kv_len > q_len, single-token requests, zero new tokens, zero keys, q_len > kv_len.
BATCHES = {
    "equal": ([5, 7, 3], [5, 7, 3]),
    "kv_longer": ([3, 1, 6, 2], [10, 4, 6, 17]),
    "single_token": ([1, 1, 1, 1], [1, 5, 9, 2]),
    "zero_new_tokens": ([0, 4, 0, 2], [6, 9, 0, 3]),
    "zero_keys": ([3, 2, 4], [0, 5, 0]),
    "q_longer": ([6, 4], [3, 4]),  # causal: the first rows of request 0 see no key
}


def plan(qo, kv, heads, causal, scale, dtype=torch.float32, d_qk=D_QK, d_vo=D_VO):
    return plan_ragged(
        qo,
        kv,
        num_heads=heads,
        head_dim_qk=d_qk,
        head_dim_vo=d_vo,
        causal=causal,
        sm_scale=scale,
        dtype=dtype,
        workspace=Workspace("cpu"),
    )


@pytest.mark.parametrize("heads", [1, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_torch_backend_vs_float64(ref, heads, causal, batch):
    q_lens, kv_lens = BATCHES[batch]
    q, k, v, qo, kv = ref.make_ragged(q_lens, kv_lens, heads, D_QK, D_VO, seed=len(batch) + heads)
    scale = D_QK**-0.5
    out, lse = ragged_prefill(
        q, k, v, qo, kv, causal=causal, sm_scale=scale, backend="torch", workspace=Workspace("cpu")
    )
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=scale)
    assert out.shape == (sum(q_lens), heads, D_VO) and out.dtype == torch.float32
    assert lse.shape == (sum(q_lens), heads) and lse.dtype == torch.float32
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_bottom_right_causal_by_hand(ref):
    """One request, q_len 2, kv_len 4, 1 head, d 1: query 0 sees keys 0..2, query 1 sees keys 0..3."""
    q = torch.tensor([[[1.0]], [[1.0]]])
    k = torch.tensor([[[0.0]], [[0.0]], [[0.0]], [[0.0]]])
    v = torch.tensor([[[1.0]], [[2.0]], [[3.0]], [[100.0]]])
    out, lse = ragged_prefill(q, k, v, [0, 2], [0, 4], causal=True, sm_scale=1.0, backend="torch")
    assert out[0, 0, 0].item() == pytest.approx(2.0, abs=1e-6)  # mean of 1, 2, 3
    assert out[1, 0, 0].item() == pytest.approx(26.5, abs=1e-5)  # mean of 1, 2, 3, 100
    assert lse[0, 0].item() == pytest.approx(torch.log(torch.tensor(3.0)).item(), abs=1e-6)
    assert lse[1, 0].item() == pytest.approx(torch.log(torch.tensor(4.0)).item(), abs=1e-6)


def test_rows_without_keys(ref):
    q, k, v, qo, kv = ref.make_ragged([2, 3], [0, 2], 3, D_QK, D_VO)
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.2, backend="torch")
    # request 0: no keys at all; request 1 (3 queries over 2 keys, causal): query 0 sees none.
    assert torch.equal(out[:3], torch.zeros(3, 3, D_VO))
    assert torch.equal(lse[:3], torch.full((3, 3), float("-inf")))
    assert torch.isfinite(lse[3:]).all()


def test_all_empty_batches():
    q = torch.randn(3, 2, D_QK)
    out, lse = ragged_prefill(
        q, torch.zeros(0, 2, D_QK), torch.zeros(0, 2, D_VO), [0, 3], [0, 0], causal=False, sm_scale=0.3, backend="torch"
    )
    assert torch.equal(out, torch.zeros(3, 2, D_VO)) and torch.equal(lse, torch.full((3, 2), float("-inf")))
    out, lse = ragged_prefill(
        torch.zeros(0, 2, D_QK),
        torch.randn(4, 2, D_QK),
        torch.randn(4, 2, D_VO),
        [0, 0, 0],
        [0, 1, 4],
        causal=True,
        sm_scale=0.3,
        backend="torch",
    )
    assert out.shape == (0, 2, D_VO) and lse.shape == (0, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_layout_hn_is_the_transpose(ref, causal):
    q_lens, kv_lens = [2, 5, 4], [6, 5, 9]  # T = 11 != H = 3
    q, k, v, qo, kv = ref.make_ragged(q_lens, kv_lens, 3, D_QK, D_VO, seed=3)
    p = plan(qo, kv, 3, causal, 0.2)
    out_nh, lse_nh = p.run(q, k, v)
    out_hn, lse_hn = p.run(q, k, v, lse_layout="HN")
    assert lse_hn.shape == (3, 11) and lse_nh.shape == (11, 3)
    assert torch.equal(lse_hn, lse_nh.t())
    assert torch.equal(out_hn, out_nh)
    _, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=0.2)
    ref.assert_lse_close(lse_hn.t(), exp_lse, atol=ATOL)
    # A caller-provided [H, T] buffer is filled in place.
    buf = torch.full((3, 11), 5.0)
    _, got = p.run(q, k, v, lse=buf, lse_layout="HN")
    assert got is buf and torch.equal(buf, lse_hn)


def test_plan_once_run_per_layer(ref):
    q_lens, kv_lens = [3, 0, 5], [7, 2, 5]
    p = plan(ref.cumsum0(q_lens), ref.cumsum0(kv_lens), 4, True, 0.25)
    for layer in range(3):
        q, k, v, qo, kv = ref.make_ragged(q_lens, kv_lens, 4, D_QK, D_VO, seed=100 + layer)
        out, lse = p.run(q, k, v)
        exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=0.25)
        ref.assert_out_close(out, exp_out, atol=ATOL)
        ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_out_and_lse_destinations(ref):
    q, k, v, qo, kv = ref.make_ragged([3, 2], [4, 2], 2, D_QK, D_VO, seed=9)
    out = torch.full((5, 2, D_VO), 9.0)
    lse = torch.full((5, 2), 9.0)
    got_out, got_lse = plan(qo, kv, 2, False, 0.2).run(q, k, v, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=False, sm_scale=0.2)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_indptr_forms(ref):
    """Python lists, int32/int64 tensors and numpy arrays give the same plan and values."""
    import numpy as np

    q, k, v, qo, kv = ref.make_ragged([2, 3], [4, 3], 2, D_QK, D_VO, seed=4)
    exp_out, _ = ref.ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=0.2)
    for qo_f, kv_f in (
        (qo, kv),
        (torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int64)),
        (np.array(qo, dtype=np.int32), np.array(kv, dtype=np.int64)),
        (tuple(qo), tuple(kv)),
    ):
        p = plan(qo_f, kv_f, 2, True, 0.2)
        assert p.qo_indptr.dtype == torch.int32 and p.qo_indptr.device.type == "cpu"
        assert p.qo_indptr.tolist() == qo and p.kv_indptr.tolist() == kv
        ref.assert_out_close(p.run(q, k, v)[0], exp_out, atol=ATOL)


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_online_softmax(ref, causal):
    """Several query blocks (> 256 rows) and many small key blocks exercise the online-softmax recurrence."""
    q_lens, kv_lens = [300, 7], [333, 20]
    q, k, v, qo, kv = ref.make_ragged(q_lens, kv_lens, 2, D_QK, D_VO, seed=11, scale=2.0)
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=causal, sm_scale=0.3)
    for block_elems in (1, 2 * 256 * 5, 1 << 22):
        out, lse = ragged_attention_reference(q, k, v, qo, kv, causal=causal, sm_scale=0.3, block_elems=block_elems)
        ref.assert_out_close(out, exp_out, atol=5e-5)
        ref.assert_lse_close(lse, exp_lse, atol=5e-5)


def test_bf16_inputs(ref):
    q, k, v, qo, kv = ref.make_ragged([4, 1, 6], [9, 3, 6], 8, D_QK, D_VO, dtype=torch.bfloat16, seed=5)
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.2, backend="torch")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=0.2)
    ref.assert_out_close(out, exp_out, atol=1e-2)  # one bf16 rounding of the result
    ref.assert_lse_close(lse, exp_lse, atol=1e-4)  # lse is accumulated in float32 from the bf16 inputs


def test_non_contiguous_inputs(ref):
    """q as a transposed view, k as a strided slice, v as kv[..., nope:] of an up-projection: right values."""
    heads, t, s = 3, 9, 14
    g = torch.Generator().manual_seed(21)
    q_t = torch.randn(heads, t, D_QK, generator=g)
    q = q_t.transpose(0, 1)  # [T, H, D] with strides (D, T*D, 1)
    k_big = torch.randn(s, heads, 2 * D_QK, generator=g)
    k = k_big[..., ::2]  # last stride 2
    kv = torch.randn(s, heads, D_QK + D_VO, generator=g)
    v = kv[..., D_QK:]  # last-dim slice, as prefill's up-projection hands it over
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    qo, kvp = [0, 4, 9], [0, 6, 14]
    for causal in (False, True):
        out, lse = ragged_prefill(q, k, v, qo, kvp, causal=causal, sm_scale=0.2, backend="torch")
        exp_out, exp_lse = ref.ragged_reference(
            q.contiguous(), k.contiguous(), v.contiguous(), qo, kvp, causal=causal, sm_scale=0.2
        )
        ref.assert_out_close(out, exp_out, atol=ATOL)
        ref.assert_lse_close(lse, exp_lse, atol=ATOL)
    # A non-contiguous out buffer is written through its strides.
    out_t = torch.zeros(heads, t, D_VO)
    got, _ = ragged_prefill(q, k, v, qo, kvp, causal=False, sm_scale=0.2, backend="torch", out=out_t.transpose(0, 1))
    exp_out, _ = ref.ragged_reference(q, k, v, qo, kvp, causal=False, sm_scale=0.2)
    ref.assert_out_close(out_t.transpose(0, 1), exp_out, atol=ATOL)


def test_default_workspace_and_backend_on_cpu(ref):
    q, k, v, qo, kv = ref.make_ragged([2, 2], [3, 2], 2, D_QK, D_VO, seed=2)
    p = plan(qo, kv, 2, True, 0.2)
    assert p.backend.name == "torch" and "fallback" in p.backend.reason
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.2)  # no backend, no workspace
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=0.2)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_reference_is_not_trivial(ref):
    """Guards the reference itself: causal differs from non-causal, and the mask is bottom-right."""
    m = ref.bottom_right_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    q, k, v, qo, kv = ref.make_ragged([4], [4], 1, D_QK, D_VO, seed=1)
    a, _ = ref.ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=0.2)
    b, _ = ref.ragged_reference(q, k, v, qo, kv, causal=False, sm_scale=0.2)
    assert not torch.allclose(a[:3], b[:3]) and torch.allclose(a[3], b[3])
    torch.testing.assert_close(a[0], v[0].double())  # the first query sees only the first key


@pytest.mark.parametrize("causal", [None, 0, 1, "yes"])
def test_causal_must_be_a_bool(causal):
    """None or 0/1 were read for truthiness: causal=None silently planned a non-causal pass."""
    from mla_bridge import Workspace, plan_ragged

    with pytest.raises(TypeError, match="causal must be a bool"):
        plan_ragged(
            [0, 4],
            [0, 4],
            num_heads=2,
            head_dim_qk=8,
            head_dim_vo=4,
            causal=causal,
            sm_scale=0.3,
            dtype=torch.float32,
            workspace=Workspace("cpu"),
        )


def test_run_without_lse_returns_out_alone(ref):
    """``return_lse=False`` (FlashInfer's convention): ``out`` alone, equal to the out of a run with the LSE; an
    empty plan too; a non-bool flag or an ``lse`` with it is refused before any work."""
    q, k, v, qo, kv = ref.make_ragged([3, 2], [4, 2], 2, D_QK, D_VO, seed=10)
    p = plan(qo, kv, 2, True, 0.2)
    with_lse, _ = p.run(q, k, v)
    out = torch.full((5, 2, D_VO), 9.0)
    got = p.run(q, k, v, out=out, return_lse=False)
    assert got is out and torch.equal(out, with_lse)
    assert torch.equal(p.run(q, k, v, return_lse=False), with_lse)
    empty = plan([0, 3], [0, 0], 2, False, 0.2)
    assert torch.equal(empty.run(q[:3], k[:0], v[:0], return_lse=False), torch.zeros(3, 2, D_VO))
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        p.run(q, k, v, return_lse=0)
    import numpy as np

    with pytest.raises(TypeError, match=r"of type numpy\.bool"):  # numpy 2 names its bool type "bool" too
        p.run(q, k, v, return_lse=np.bool_(False))
    lse = torch.full((5, 2), 9.0)
    with pytest.raises(ValueError, match="return_lse=False"):
        p.run(q, k, v, lse=lse, return_lse=False)
    assert bool((lse == 9.0).all())


# ---------------------------------------------------------------------------------------------------------------
# rows without keys in NaN-filled buffers, the LSE base and layout, long keys, zero-length queries, extreme
# logits, q/k/v off by one row
# ---------------------------------------------------------------------------------------------------------------


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
    assert torch.equal(out2, torch.zeros_like(out2)) and torch.equal(lse2, torch.full_like(lse2, float("-inf")))


def test_lse_of_a_pass_is_natural_log(ref):
    """Two keys of logit 0 and value 1, 0: lse is ln 2 (not 1 = log2 2) and out 0.5."""
    q = torch.zeros(1, 1, 4)
    k = torch.zeros(2, 1, 4)
    v = torch.tensor([[[1.0]], [[0.0]]])
    out, lse = ragged_prefill(q, k, v, [0, 1], [0, 2], causal=False, sm_scale=1.0, backend="torch")
    assert out.item() == pytest.approx(0.5, abs=1e-7)
    assert lse.item() == pytest.approx(math.log(2.0), abs=1e-7)


@pytest.mark.parametrize("causal", [False, True])
def test_hn_lse_with_t_not_h_and_a_buffer_of_the_wrong_layout(ref, causal):
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


def test_single_query_over_long_keys(ref):
    kv_lens = [1, 2899, 17, 1290, 3000, 640, 2, 2048, 999, 1500, 2600, 504]  # 15500 keys
    assert sum(kv_lens) == 15500
    q, k, v, qo, kv = ref.make_ragged([1] * 12, kv_lens, 8, 24, 16, seed=5)
    assert qo == list(range(13))
    out, lse = ragged_prefill(q, k, v, qo, kv, causal=False, sm_scale=24**-0.5, backend="torch")
    exp_out, exp_lse = ref.ragged_reference(q, k, v, qo, kv, causal=False, sm_scale=24**-0.5)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


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
