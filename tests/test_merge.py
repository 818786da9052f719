"""merge_attn_states / merge_attn_states_: the LSE merge rules, checked against float64 formulas and attention."""

from __future__ import annotations

import math

import pytest
import torch

from mla_bridge import merge_attn_states
from mla_bridge.merge import merge_attn_states_

INF = float("inf")


def merge64(out_a, lse_a, out_b, lse_b):
    """float64 merge written from the definition: weights exp(lse_x) over their sum; empty (+-inf) weighs 0."""
    oa, ob = out_a.double(), out_b.double()
    la, lb = lse_a.double(), lse_b.double()
    la = torch.where(torch.isinf(la), torch.full_like(la, -INF), la)
    lb = torch.where(torch.isinf(lb), torch.full_like(lb, -INF), lb)
    out = torch.zeros_like(oa)
    lse = torch.full_like(la, -INF)
    for t in range(oa.shape[0]):
        for h in range(oa.shape[1]):
            a, b = la[t, h].item(), lb[t, h].item()
            if a == -INF and b == -INF:
                continue
            top = max(a, b)
            wa = math.exp(a - top) if a != -INF else 0.0
            wb = math.exp(b - top) if b != -INF else 0.0
            lse[t, h] = top + math.log(wa + wb)
            acc = torch.zeros_like(oa[t, h])
            if wa:
                acc += oa[t, h] * wa
            if wb:
                acc += ob[t, h] * wb
            out[t, h] = acc / (wa + wb)
    return out, lse


def both(out_a, lse_a, out_b, lse_b):
    """The functional and the in-place merge; they must agree exactly."""
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    o2, l2 = out_a.clone(), lse_a.clone()
    merge_attn_states_(o2, l2, out_b, lse_b)
    assert torch.equal(o2, out)
    assert torch.equal(l2, lse)
    return out, lse


def test_finite(ref):
    g = torch.Generator().manual_seed(0)
    oa, ob = torch.randn(7, 5, 16, generator=g), torch.randn(7, 5, 16, generator=g)
    la, lb = torch.randn(7, 5, generator=g) * 10, torch.randn(7, 5, generator=g) * 10
    out, lse = both(oa, la, ob, lb)
    eo, el = merge64(oa, la, ob, lb)
    ref.assert_out_close(out, eo, atol=1e-6, rtol=1e-6)
    ref.assert_lse_close(lse, el, atol=1e-5, rtol=1e-6)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_two_empties_give_zero_and_minus_inf():
    # The outs of empty partials may hold anything, NaN included: nothing of them may leak.
    oa = torch.full((3, 2, 8), float("nan"))
    ob = torch.full((3, 2, 8), 123.0)
    la = torch.full((3, 2), -INF)
    lb = torch.full((3, 2), -INF)
    out, lse = both(oa, la, ob, lb)
    assert torch.equal(out, torch.zeros(3, 2, 8))
    assert torch.equal(lse, torch.full((3, 2), -INF))


@pytest.mark.parametrize("empty", [-INF, INF])
def test_one_empty_returns_the_other(empty):
    g = torch.Generator().manual_seed(1)
    ob = torch.randn(4, 3, 8, generator=g)
    lb = torch.randn(4, 3, generator=g)
    oa = torch.full((4, 3, 8), float("nan"))
    la = torch.full((4, 3), empty)
    for args, expect in (((oa, la, ob, lb), (ob, lb)), ((ob, lb, oa, la), (ob, lb))):
        out, lse = both(*args)
        torch.testing.assert_close(out, expect[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, expect[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pair", [(INF, INF), (INF, -INF), (-INF, INF)])
def test_plus_inf_is_empty(pair):
    oa, ob = torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0)
    out, lse = both(oa, torch.full((2, 1), pair[0]), ob, torch.full((2, 1), pair[1]))
    assert torch.equal(out, torch.zeros(2, 1, 4))
    assert torch.equal(lse, torch.full((2, 1), -INF))


def test_mixed_rows(ref):
    """Finite, -inf and +inf lse values mixed element by element, with garbage in the empty partials' outs."""
    g = torch.Generator().manual_seed(2)
    choices = torch.tensor([-INF, INF, -3.0, 0.0, 2.5, 40.0, -40.0])
    la = choices[torch.randint(0, len(choices), (9, 6), generator=g)]
    lb = choices[torch.randint(0, len(choices), (9, 6), generator=g)]
    oa, ob = torch.randn(9, 6, 8, generator=g), torch.randn(9, 6, 8, generator=g)
    oa[torch.isinf(la)] = float("nan")
    ob[torch.isinf(lb)] = 1e30
    out, lse = both(oa, la, ob, lb)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert not (lse == INF).any()
    eo, el = merge64(oa, la, ob, lb)
    ref.assert_out_close(out, eo, atol=1e-6, rtol=1e-6)
    ref.assert_lse_close(lse, el, atol=1e-5, rtol=1e-6)


def test_extreme_lse_no_overflow(ref):
    oa, ob = torch.ones(1, 2, 4), torch.full((1, 2, 4), 3.0)
    la = torch.tensor([[1e4, -1e4]])
    lb = torch.tensor([[1e4, -1e4 + math.log(3.0)]])
    out, lse = both(oa, la, ob, lb)
    torch.testing.assert_close(out[0, 0], torch.full((4,), 2.0))
    torch.testing.assert_close(out[0, 1], torch.full((4,), (1 + 3 * 3) / 4.0))
    assert lse[0, 0].item() == pytest.approx(1e4 + math.log(2.0), rel=1e-7)
    assert lse[0, 1].item() == pytest.approx(-1e4 + math.log(4.0), rel=1e-7)


def test_merging_partials_equals_attention_over_all_keys(ref):
    """Attention split into three disjoint key sets and merged equals attention over the union."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 3, 12, generator=g)
    k = torch.randn(17, 3, 12, generator=g)
    v = torch.randn(17, 3, 8, generator=g)
    full_out, full_lse = ref.dense_attention(q, k, v, 0.4)
    parts = [ref.dense_attention(q, k[a:b], v[a:b], 0.4) for a, b in ((0, 6), (6, 6), (6, 17))]  # middle: empty
    out, lse = parts[0][0].float(), parts[0][1].float()
    for o, s in parts[1:]:
        out, lse = merge_attn_states(out, lse, o.float(), s.float())
    ref.assert_out_close(out, full_out, atol=1e-6)
    ref.assert_lse_close(lse, full_lse, atol=1e-5)
    # in place, on row views of bigger buffers (as mla_prefill merges a chunk's rows)
    big_out = torch.zeros(8, 3, 8)
    big_lse = torch.zeros(8, 3)
    big_out[2:7], big_lse[2:7] = parts[0][0].float(), parts[0][1].float()
    for o, s in parts[1:]:
        merge_attn_states_(big_out[2:7], big_lse[2:7], o.float(), s.float())
    ref.assert_out_close(big_out[2:7], full_out, atol=1e-6)
    ref.assert_lse_close(big_lse[2:7], full_lse, atol=1e-5)
    assert torch.equal(big_out[:2], torch.zeros(2, 3, 8)) and torch.equal(big_out[7:], torch.zeros(1, 3, 8))


@pytest.mark.parametrize("bad,exc,name", [
    (dict(out_b=torch.zeros(2, 3, 5)), ValueError, "out_b"),
    (dict(lse_a=torch.zeros(3, 2)), ValueError, "lse_a"),
    (dict(lse_b=torch.zeros(2, 3, 1)), ValueError, "lse_b"),
    (dict(lse_a=torch.zeros(2, 3, dtype=torch.float64)), TypeError, "lse_a"),
    (dict(out_b=torch.zeros(2, 3, 4, dtype=torch.float64)), TypeError, "out_b"),
    (dict(out_a=torch.zeros(2, 3)), ValueError, "out_a"),
    (dict(out_b=[0.0]), TypeError, "out_b"),
    (dict(lse_b=torch.zeros(2, 3, device="meta")), ValueError, "lse_b"),
])
def test_bad_inputs(bad, exc, name):
    args = dict(out_a=torch.zeros(2, 3, 4), lse_a=torch.zeros(2, 3), out_b=torch.zeros(2, 3, 4), lse_b=torch.zeros(2, 3))
    args.update(bad)
    with pytest.raises(exc, match=name):
        merge_attn_states(**args)
    if name != "out_a":
        out = torch.full((2, 3, 4), 7.0)
        lse = torch.full((2, 3), 7.0)
        args.update(out_a=out, lse_a=args["lse_a"] if name == "lse_a" else lse)
        with pytest.raises(exc, match=name):
            merge_attn_states_(args["out_a"], args["lse_a"], args["out_b"], args["lse_b"])
        assert torch.equal(out, torch.full((2, 3, 4), 7.0)) and torch.equal(lse, torch.full((2, 3), 7.0))


def test_in_place_needs_contiguous_lse():
    lse = torch.zeros(3, 2).t()  # [2, 3], not contiguous
    with pytest.raises(ValueError, match="lse"):
        merge_attn_states_(torch.zeros(2, 3, 4), lse, torch.zeros(2, 3, 4), torch.zeros(2, 3))


def test_nan_partial_stays_nan_in_the_torch_merge():
    """A NaN LSE is never read as an empty partial (which would silently drop it)."""
    out = torch.ones(2, 1, 4)
    lse = torch.tensor([[float("nan")], [0.0]])
    merged, merged_lse = merge_attn_states(out, lse, out * 2, torch.zeros(2, 1))
    assert torch.isnan(merged_lse[0]).all() and torch.isnan(merged[0]).all()
    assert torch.allclose(merged[1], torch.full((1, 4), 1.5)) and torch.allclose(merged_lse[1], torch.log(torch.tensor(2.0)))


# --------------------------------------------------------------------------------------------------------------
# routing: which merge a shape gets (select_merge), and the pieces it is cut into
# --------------------------------------------------------------------------------------------------------------
from mla_bridge import merge as merge_mod  # noqa: E402
from mla_bridge.merge import FLASHINFER_MERGE_ELEMENT_LIMIT, MergeChoice, select_merge  # noqa: E402

BF16 = torch.bfloat16


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_merge_for_its_head_dims(d, dtype):
    c = select_merge((1000, 16, d), dtype, "cuda", flashinfer=True)
    assert c.name == "flashinfer" and c.rows_per_piece == 1000
    assert c.heads_per_row * (d // max(16 // dtype.itemsize, d // 32)) <= 1024


@pytest.mark.parametrize("d", [8, 16, 32, 48, 80, 96, 192, 320, 576])
def test_torch_merge_for_other_head_dims(d):
    """FlashInfer 0.7.4's DISPATCH_HEAD_DIM takes 64/128/256/512 only: 32, 48, 96 raised 'Unsupported head_dim'."""
    c = select_merge((10, 8, d), BF16, "cuda", flashinfer=True)
    assert c.name == "torch"
    assert f"head_dim {d}" in c.reason and "64, 128, 256, 512" in c.reason


@pytest.mark.parametrize("kw,why", [
    (dict(dtype=torch.float32), "float16/bfloat16"),
    (dict(device_type="cpu"), "CUDA"),
    (dict(flashinfer=False), "not installed"),
    (dict(contiguous=False), "contiguous"),
])
def test_torch_merge_reasons(kw, why):
    args = dict(shape=(10, 8, 128), dtype=BF16, device_type="cuda", flashinfer=True)
    args.update(kw)
    c = select_merge(**args)
    assert c.name == "torch" and why in c.reason


def test_flashinfer_default_follows_the_installed_package(monkeypatch):
    monkeypatch.setattr(merge_mod, "flashinfer_version", lambda: None)
    assert select_merge((4, 2, 128), BF16, "cuda").name == "torch"
    monkeypatch.setattr(merge_mod, "flashinfer_version", lambda: "0.7.4")
    assert select_merge((4, 2, 128), BF16, "cuda").name == "flashinfer"


@pytest.mark.parametrize("t,pieces", [(262_143, 1), (262_144, 2), (262_208, 2), (2 * 262_144, 3)])
def test_flashinfer_pieces_stay_below_32_bit_offsets(t, pieces):
    """128 heads x 128: 2**32 elements is 262,144 rows; every piece must hold fewer than 2**32 elements."""
    c = select_merge((t, 128, 128), BF16, "cuda", flashinfer=True)
    assert c.name == "flashinfer"
    assert c.rows_per_piece * 128 * 128 < FLASHINFER_MERGE_ELEMENT_LIMIT
    assert -(-t // c.rows_per_piece) == pieces
    assert c.heads_per_row == 64  # 128 heads fold into rows of 64 (a block of 16 x 64 = 1024 threads)


def test_torch_merge_pieces_bound_memory_on_cuda():
    c = select_merge((300_000, 128, 96), BF16, "cuda", flashinfer=True)
    assert c.name == "torch" and c.rows_per_piece * 128 * 96 <= merge_mod.TORCH_MERGE_PIECE_ELEMENTS
    assert select_merge((300_000, 128, 96), torch.float32, "cpu").rows_per_piece == 300_000


class _FakeCascade:
    """Stands in for flashinfer.cascade on the CPU: base-2 merge in float64, refusing what FlashInfer 0.7.4 cannot
    take (other head dims, 2**32 elements or more at the patched limit, blocks above 1024 threads)."""

    def __init__(self, limit):
        self.limit, self.calls = limit, []

    def _check(self, v, s):
        t, g, d = v.shape
        assert d in (64, 128, 256, 512), d
        assert v.numel() < self.limit, (v.numel(), self.limit)
        assert v.is_contiguous() and s.is_contiguous() and s.shape == (t, g)
        assert g * (d // max(16 // v.element_size(), d // 32)) <= 1024
        self.calls.append(tuple(v.shape))

    @staticmethod
    def _merge(va, sa, vb, sb):
        m = torch.maximum(sa, sb).double()
        wa, wb = torch.exp2(sa.double() - m), torch.exp2(sb.double() - m)
        tot = wa + wb
        v = (va.double() * (wa / tot).unsqueeze(-1) + vb.double() * (wb / tot).unsqueeze(-1)).to(va.dtype)
        return v, (torch.log2(tot) + m).float()

    def merge_state(self, va, sa, vb, sb):
        self._check(va, sa)
        return self._merge(va, sa, vb, sb)

    def merge_state_in_place(self, v, s, vo, so):
        self._check(v, s)
        nv, ns = self._merge(v, s, vo, so)
        v.copy_(nv)
        s.copy_(ns)


@pytest.fixture
def fake_flashinfer_merge(monkeypatch):
    """CPU tensors routed as if on CUDA with FlashInfer, the 32-bit limit patched down to 3 * 2**14 elements."""
    import sys
    import types

    limit = 3 * 2 ** 14
    fake = _FakeCascade(limit)
    mod = types.ModuleType("flashinfer.cascade")
    mod.merge_state, mod.merge_state_in_place = fake.merge_state, fake.merge_state_in_place
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.cascade", mod)
    monkeypatch.setattr(merge_mod, "FLASHINFER_MERGE_ELEMENT_LIMIT", limit)
    monkeypatch.setattr(merge_mod, "_choice", lambda a, b: select_merge(
        tuple(a.shape), a.dtype, "cuda", contiguous=a.is_contiguous() and b.is_contiguous(), flashinfer=True))
    return fake


@pytest.mark.parametrize("t", [1, 2, 3, 4, 7])
def test_pieces_merge_every_row(ref, fake_flashinfer_merge, t):
    """128 heads x 128 dims at a patched limit of 3 * 2**14 elements: 2 rows per piece, heads folded by 64."""
    g = torch.Generator().manual_seed(5)
    oa, ob = torch.randn(t, 128, 128, generator=g).to(BF16), torch.randn(t, 128, 128, generator=g).to(BF16)
    la, lb = torch.randn(t, 128, generator=g) * 3, torch.randn(t, 128, generator=g) * 3
    la[-1, :3] = -INF  # an empty partial in the last piece
    out, lse = merge_attn_states(oa, la, ob, lb)
    o2, l2 = oa.clone(), la.clone()
    merge_attn_states_(o2, l2, ob, lb)
    calls = fake_flashinfer_merge.calls
    assert len(calls) == 2 * -(-t // 2) and all(c[0] <= 2 * 2 and c[1] == 64 for c in calls)
    eo, el = merge64(oa.float(), la, ob.float(), lb)
    for o, s in ((out, lse), (o2, l2)):
        ref.assert_out_close(o.float(), eo, atol=1.6e-2)
        ref.assert_lse_close(s, el, atol=1e-5, rtol=1e-6)


def test_torch_merge_in_pieces(ref, monkeypatch):
    """The torch merge cut into row pieces (as on CUDA) gives what one piece gives, in and out of place."""
    g = torch.Generator().manual_seed(6)
    oa, ob = torch.randn(11, 3, 48, generator=g), torch.randn(11, 3, 48, generator=g)
    la, lb = torch.randn(11, 3, generator=g), torch.randn(11, 3, generator=g)
    whole = merge_attn_states(oa, la, ob, lb)
    monkeypatch.setattr(merge_mod, "_choice", lambda a, b: MergeChoice("torch", "test", 4))
    out, lse = both(oa, la, ob, lb)
    assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1])
