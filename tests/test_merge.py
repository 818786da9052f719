"""merge_attn_states / merge_attn_states_: the LSE merge rules, checked against float64 formulas and attention."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from mla_bridge import merge_attn_states
from mla_bridge.merge import merge_attn_states_
from tests.helpers.merge_cases import INF, RUNNING_FORMS, assert_merge_matches, bitwise, merge_cases


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


@pytest.mark.parametrize(
    "bad,exc,name",
    [
        (dict(out_b=torch.zeros(2, 3, 5)), ValueError, "out_b"),
        (dict(lse_a=torch.zeros(3, 2)), ValueError, "lse_a"),
        (dict(lse_b=torch.zeros(2, 3, 1)), ValueError, "lse_b"),
        (dict(lse_a=torch.zeros(2, 3, dtype=torch.float64)), TypeError, "lse_a"),
        (dict(out_b=torch.zeros(2, 3, 4, dtype=torch.float64)), TypeError, "out_b"),
        (dict(out_a=torch.zeros(2, 3)), ValueError, "out_a"),
        (dict(out_b=[0.0]), TypeError, "out_b"),
        (dict(lse_b=torch.zeros(2, 3, device="meta")), ValueError, "lse_b"),
    ],
)
def test_bad_inputs(bad, exc, name):
    args = dict(
        out_a=torch.zeros(2, 3, 4), lse_a=torch.zeros(2, 3), out_b=torch.zeros(2, 3, 4), lse_b=torch.zeros(2, 3)
    )
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


@pytest.mark.parametrize("name", ["out_a", "lse_a", "out_b", "lse_b"])
def test_merge_refuses_inputs_requiring_grad_while_autograd_records(name):
    """The merges have no backward on CUDA (the Triton and FlashInfer kernels write outside autograd): an input that
    requires grad while autograd records is refused by name, as by the attention
    (mla_bridge.inference.refuse_autograd), and nothing is written. It was not: on the CPU the torch merge
    differentiated it, on CUDA the gradient was lost. Under torch.no_grad() the same tensors merge to the plain result."""
    g = torch.Generator().manual_seed(2)
    args = dict(
        out_a=torch.randn(2, 3, 4, generator=g),
        lse_a=torch.randn(2, 3, generator=g),
        out_b=torch.randn(2, 3, 4, generator=g),
        lse_b=torch.randn(2, 3, generator=g),
    )
    want = merge_attn_states(**args)
    args[name] = args[name].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording.*torch.no_grad\(\)"):
        merge_attn_states(**args)
    in_place = {"out_a": "out", "lse_a": "lse"}.get(name, name)
    out, lse = (
        (args["out_a"] * 1, args["lse_a"] * 1)
        if name in ("out_a", "lse_a")
        else (args["out_a"].clone(), args["lse_a"].clone())
    )
    before = out.detach().clone(), lse.detach().clone()
    with pytest.raises(ValueError, match=rf"^{in_place} requires grad and autograd is recording"):
        merge_attn_states_(out, lse, args["out_b"], args["lse_b"])
    assert torch.equal(out.detach(), before[0]) and torch.equal(lse.detach(), before[1])
    with torch.no_grad():
        got = merge_attn_states(**args)
        merge_attn_states_(out, lse, args["out_b"], args["lse_b"])
    assert not got[0].requires_grad and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(out.detach(), want[0]) and torch.equal(lse.detach(), want[1])


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
    assert torch.allclose(merged[1], torch.full((1, 4), 1.5)) and torch.allclose(
        merged_lse[1], torch.log(torch.tensor(2.0))
    )


# --------------------------------------------------------------------------------------------------------------
# routing: which merge a shape gets (select_merge), and the pieces it is cut into
# --------------------------------------------------------------------------------------------------------------
from mla_bridge import merge as merge_mod  # noqa: E402
from mla_bridge.merge import FLASHINFER_MERGE_ELEMENT_LIMIT, MERGE_IMPLS, MergeChoice, select_merge  # noqa: E402

BF16 = torch.bfloat16


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_merge_for_its_head_dims(d, dtype):
    c = select_merge((1000, 16, d), dtype, "cuda", flashinfer=True, triton=False)
    assert c.name == "flashinfer" and c.rows_per_piece == 1000
    assert c.heads_per_row * (d // max(16 // dtype.itemsize, d // 32)) <= 1024


@pytest.mark.parametrize("d", [8, 16, 32, 48, 80, 96, 192, 320, 576])
def test_torch_merge_for_other_head_dims(d):
    """FlashInfer 0.7.4's DISPATCH_HEAD_DIM takes 64/128/256/512 only: 32, 48, 96 raised 'Unsupported head_dim'."""
    c = select_merge((10, 8, d), BF16, "cuda", flashinfer=True, triton=False)
    assert c.name == "torch"
    assert f"head_dim {d}" in c.reason and "64, 128, 256, 512" in c.reason


@pytest.mark.parametrize(
    "kw,why",
    [
        (dict(dtype=torch.float32), "float16/bfloat16"),
        (dict(device_type="cpu"), "CUDA"),
        (dict(flashinfer=False), "not installed"),
        (dict(contiguous=False), "contiguous"),
    ],
)
def test_torch_merge_reasons(kw, why):
    args = dict(shape=(10, 8, 128), dtype=BF16, device_type="cuda", flashinfer=True, triton=False)
    args.update(kw)
    c = select_merge(**args)
    assert c.name == "torch" and why in c.reason


def test_flashinfer_default_follows_the_installed_package(monkeypatch):
    monkeypatch.setattr(merge_mod, "triton_available", lambda: False)
    monkeypatch.setattr(merge_mod, "flashinfer_version", lambda: None)
    assert select_merge((4, 2, 128), BF16, "cuda").name == "torch"
    monkeypatch.setattr(merge_mod, "flashinfer_version", lambda: "0.7.4")
    assert select_merge((4, 2, 128), BF16, "cuda").name == "flashinfer"


@pytest.mark.parametrize("t,pieces", [(262_143, 1), (262_144, 2), (262_208, 2), (2 * 262_144, 3)])
def test_flashinfer_pieces_stay_below_32_bit_offsets(t, pieces):
    """128 heads x 128: 2**32 elements is 262,144 rows; every piece must hold fewer than 2**32 elements."""
    c = select_merge((t, 128, 128), BF16, "cuda", flashinfer=True, triton=False)
    assert c.name == "flashinfer"
    assert c.rows_per_piece * 128 * 128 < FLASHINFER_MERGE_ELEMENT_LIMIT
    assert -(-t // c.rows_per_piece) == pieces
    assert c.heads_per_row == 64  # 128 heads fold into rows of 64 (a block of 16 x 64 = 1024 threads)


def test_torch_merge_pieces_bound_memory_on_cuda():
    c = select_merge((300_000, 128, 96), BF16, "cuda", flashinfer=True, triton=False)
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

    limit = 3 * 2**14
    fake = _FakeCascade(limit)
    mod = types.ModuleType("flashinfer.cascade")
    mod.merge_state, mod.merge_state_in_place = fake.merge_state, fake.merge_state_in_place
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.cascade", mod)
    monkeypatch.setattr(merge_mod, "FLASHINFER_MERGE_ELEMENT_LIMIT", limit)
    monkeypatch.setattr(
        merge_mod,
        "_choice",
        lambda a, b: select_merge(
            tuple(a.shape),
            a.dtype,
            "cuda",
            contiguous=a.is_contiguous() and b.is_contiguous(),
            flashinfer=True,
            triton=False,
        ),
    )
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


# --------------------------------------------------------------------------------------------------------------
# routing to the Triton merge: select_merge's rules, MLA_BRIDGE_MERGE, one kernel call per merge
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_merge_env(monkeypatch):
    monkeypatch.delenv(merge_mod.MERGE_ENV, raising=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1000, 16, 128), (7, 128, 48), (3, 1, 576), (262_208, 128, 128)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_triton_merge_first_on_cuda(dtype, shape, contiguous):
    """Any head dim, head count, size (int64 offsets: one piece even past 2**32 elements) and strides."""
    c = select_merge(shape, dtype, "cuda", contiguous=contiguous, flashinfer=True, triton=True)
    assert c.name == "triton" and c.rows_per_piece == shape[0], c


@pytest.mark.parametrize(
    "kw,name,why",
    [
        (dict(device_type="cpu"), "torch", "CUDA"),
        (dict(dtype=torch.float64), "torch", "float16/bfloat16"),
        (dict(shape=(0, 16, 128)), "torch", "nothing to merge"),
        (dict(triton=False), "flashinfer", "Triton does not import"),
        (dict(triton=False, shape=(10, 16, 96)), "torch", "Triton does not import; head_dim 96"),
        (dict(triton=False, flashinfer=False), "torch", "Triton does not import; flashinfer-python"),
    ],
)
def test_triton_merge_fallbacks(kw, name, why):
    args = dict(shape=(10, 16, 128), dtype=BF16, device_type="cuda", flashinfer=True, triton=True)
    args.update(kw)
    c = select_merge(**args)
    assert c.name == name and why in c.reason, c


def test_triton_default_follows_triton_available(monkeypatch):
    asked = []
    monkeypatch.setattr(merge_mod, "flashinfer_version", lambda: "0.7.4")
    monkeypatch.setattr(merge_mod, "triton_available", lambda: asked.append(1) or True)
    assert select_merge((4, 2, 128), BF16, "cuda").name == "triton" and asked
    asked.clear()
    assert select_merge((4, 2, 128), BF16, "cpu").name == "torch" and not asked  # not even asked on the CPU
    monkeypatch.setattr(merge_mod, "triton_available", lambda: False)
    assert select_merge((4, 2, 128), BF16, "cuda").name == "flashinfer"


@pytest.mark.parametrize(
    "env,device,triton,name",
    [
        ("torch", "cuda", True, "torch"),
        ("flashinfer", "cuda", True, "flashinfer"),
        ("triton", "cuda", True, "triton"),
        ("triton", "cpu", True, "triton"),  # for TRITON_INTERPRET=1 on CPU tensors
        (" Auto ", "cuda", True, "triton"),
        ("", "cuda", False, "flashinfer"),
    ],
)
def test_merge_env_forces_one(monkeypatch, env, device, triton, name):
    monkeypatch.setenv(merge_mod.MERGE_ENV, env)
    monkeypatch.setenv("TRITON_INTERPRET", "1" if device == "cpu" else "0")
    c = select_merge((10, 16, 128), BF16, device, flashinfer=True, triton=triton)
    assert c.name == name, c
    if env.strip() in MERGE_IMPLS:
        assert f"MLA_BRIDGE_MERGE={env.strip()}" in c.reason


def test_merge_env_flashinfer_falls_back_where_flashinfer_cannot_serve(monkeypatch):
    monkeypatch.setenv(merge_mod.MERGE_ENV, "flashinfer")
    c = select_merge((10, 16, 96), BF16, "cuda", flashinfer=True, triton=True)
    assert c.name == "torch" and "head_dim 96" in c.reason


def test_merge_env_flashinfer_is_refused_where_flashinfer_can_never_serve(monkeypatch):
    """Off CUDA, or without flashinfer-python, the forced FlashInfer merge is refused by the variable's name (as a forced
    Triton merge is), not silently run as torch; a shape FlashInfer does not take still falls back (above)."""
    monkeypatch.setenv(merge_mod.MERGE_ENV, "flashinfer")
    with pytest.raises(ValueError, match="MLA_BRIDGE_MERGE=flashinfer.*CUDA device.*cpu"):
        select_merge((10, 16, 128), BF16, "cpu", flashinfer=True, triton=False)
    with pytest.raises(ValueError, match="MLA_BRIDGE_MERGE=flashinfer.*flashinfer-python is not installed"):
        select_merge((10, 16, 128), BF16, "cuda", flashinfer=False, triton=True)
    with pytest.raises(ValueError, match="MLA_BRIDGE_MERGE=flashinfer"):  # through the public merge, on the CPU
        merge_attn_states(torch.zeros(2, 1, 4), torch.zeros(2, 1), torch.zeros(2, 1, 4), torch.zeros(2, 1))


def test_merge_env_errors(monkeypatch):
    monkeypatch.setenv(merge_mod.MERGE_ENV, "cutlass")
    with pytest.raises(ValueError, match="MLA_BRIDGE_MERGE='cutlass'.*triton, flashinfer, torch"):
        select_merge((10, 16, 128), BF16, "cuda", flashinfer=True, triton=True)
    monkeypatch.setenv(merge_mod.MERGE_ENV, "triton")
    with pytest.raises(RuntimeError, match="Triton does not import"):
        select_merge((10, 16, 128), BF16, "cuda", flashinfer=True, triton=False)
    with pytest.raises(ValueError, match="float16/bfloat16/float32.*float64"):
        select_merge((10, 16, 128), torch.float64, "cuda", flashinfer=True, triton=True)
    monkeypatch.setattr(merge_mod, "triton_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device.*TRITON_INTERPRET=1"):  # not Triton's "0 active drivers"
        merge_attn_states(torch.zeros(2, 1, 4), torch.zeros(2, 1), torch.zeros(2, 1, 4), torch.zeros(2, 1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="Triton does not import"):  # the default asks, even for the CPU
        merge_attn_states(torch.zeros(2, 1, 4), torch.zeros(2, 1), torch.zeros(2, 1, 4), torch.zeros(2, 1))


def test_empty_head_dim_goes_to_torch_even_when_triton_is_forced(monkeypatch):
    """head_dim 0 (or no rows, no heads) has nothing to merge: the torch path, never a kernel launch (the Triton
    merge's block size would be next_power_of_2(0) = 0)."""
    monkeypatch.setenv(merge_mod.MERGE_ENV, "triton")
    for shape in ((10, 16, 0), (0, 16, 128), (10, 0, 128)):
        c = select_merge(shape, BF16, "cuda", flashinfer=True, triton=True)
        assert c.name == "torch" and "nothing to merge" in c.reason
    monkeypatch.delenv(merge_mod.MERGE_ENV)
    out, lse = merge_attn_states(torch.zeros(3, 2, 0), torch.zeros(3, 2), torch.zeros(3, 2, 0), torch.zeros(3, 2))
    assert out.shape == (3, 2, 0) and torch.allclose(lse, torch.full((3, 2), math.log(2.0)))


def test_in_place_merge_refuses_an_expanded_out_before_writing():
    x = torch.zeros(1, 2, 8)
    out = x.expand(3, 2, 8)
    lse = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="out must not overlap itself"):
        merge_attn_states_(out, lse, torch.ones(3, 2, 8), torch.zeros(3, 2))
    assert torch.equal(x, torch.zeros(1, 2, 8)) and torch.equal(lse, torch.zeros(3, 2))


def test_select_merge_is_decided_once_per_shape():
    a = select_merge((123, 16, 128), BF16, "cuda", flashinfer=True, triton=True)
    b = select_merge((123, 16, 128), BF16, "cuda", flashinfer=True, triton=True)
    assert a is b  # the remembered choice itself, not an equal one made again
    assert select_merge((124, 16, 128), BF16, "cuda", flashinfer=True, triton=True) is not a


@pytest.fixture
def fake_triton_merge(monkeypatch):
    """A stand-in for mla_bridge.kernels.merge on the CPU: records each call and merges with the torch merge into
    the destination it is handed; the merges route to it as if on CUDA with Triton."""
    import types

    calls = []

    def merge_triton(dst, dst_lse, out_a, lse_a, out_b, lse_b, lse_b_log2=False, inf_empty=True):
        calls.append((dst, dst_lse, out_a, lse_a, out_b, lse_b, lse_b_log2, inf_empty))
        o, s = merge_mod._merge_torch(
            out_a, lse_a, out_b, lse_b * math.log(2.0) if lse_b_log2 else lse_b, inf_empty=inf_empty
        )
        dst.copy_(o)
        dst_lse.copy_(s)

    mod = types.ModuleType("mla_bridge.kernels.merge")
    mod.merge_triton = merge_triton
    monkeypatch.setitem(sys.modules, "mla_bridge.kernels.merge", mod)
    import mla_bridge.kernels as kernels_pkg

    monkeypatch.setattr(kernels_pkg, "merge", mod, raising=False)
    monkeypatch.setattr(
        merge_mod,
        "_choice",
        lambda a, b: select_merge(
            tuple(a.shape),
            a.dtype,
            "cuda",
            contiguous=a.is_contiguous() and b.is_contiguous(),
            flashinfer=True,
            triton=True,
        ),
    )
    return calls


def test_triton_route_is_one_kernel_call(fake_triton_merge):
    """In place: one call writing out/lse themselves (no copies, no conversions); out of place: one call into new
    contiguous tensors. Strided (non-contiguous) outs are handed over as they are."""
    oa, la, ob, lb = merge_cases(64, BF16, seed=9)
    expect = merge_mod._merge_torch(oa, la, ob, lb)
    out, lse = merge_attn_states(oa, la, ob, lb)
    assert len(fake_triton_merge) == 1
    dst, dst_lse, a, sa, b, sb, log2, _ = fake_triton_merge[0]
    assert dst is out and dst_lse is lse and a is oa and sa is la and b is ob and sb is lb
    assert out.is_contiguous() and lse.is_contiguous() and out.dtype == BF16
    assert bitwise((out, lse), expect)
    big = torch.zeros(41, 4, 80).to(BF16)
    big_l = torch.zeros(41, 4)
    view, view_l = big[2:39, :, :64], big_l[2:39]
    view.copy_(oa)
    view_l.copy_(la)
    merge_attn_states_(view, view_l, ob, lb)
    assert len(fake_triton_merge) == 2
    dst, dst_lse, a, sa, b, sb, log2, _ = fake_triton_merge[1]
    assert dst is view and a is view and dst_lse is view_l and sa is view_l and b is ob and sb is lb and not log2
    assert bitwise((view, view_l), expect)
    o3, l3 = oa.clone(), la.clone()
    merge_attn_states_(o3, l3, ob, lb * LOG2E, lse_b_base="log2")  # handed on to the kernel, still one call
    assert len(fake_triton_merge) == 3 and fake_triton_merge[2][6] is True


LOG2E = 1.0 / math.log(2.0)


def test_base2_lse_b_equals_natural(ref, fake_flashinfer_merge, monkeypatch):
    """lse_b in base 2 (as FlashInfer writes it), converted as it is read: the merge of its float32 natural-log
    form ``b2 * ln 2`` (what FlashInfer's own conversion gives) bit for bit in the torch merge; within the merge's
    tolerance in FlashInfer's (base 2 throughout there, one rounding fewer)."""
    oa, la, ob, lb = merge_cases(128, BF16, seed=11)
    b2 = lb * LOG2E
    natural = b2 * math.log(2.0)
    want = merge_mod._merge_torch(oa, la, ob, natural)
    got_o, got_l = oa.clone(), la.clone()
    monkeypatch.setenv(merge_mod.MERGE_ENV, "torch")  # the torch merge, chosen through its switch
    merge_attn_states_(got_o, got_l, ob, b2, lse_b_base="log2")
    monkeypatch.delenv(merge_mod.MERGE_ENV)
    assert bitwise((got_o, got_l), want)
    # FlashInfer's merge (fake, float64 inside) on finite rows
    g = torch.Generator().manual_seed(12)
    oa, ob = torch.randn(6, 128, 128, generator=g).to(BF16), torch.randn(6, 128, 128, generator=g).to(BF16)
    la, lb = torch.randn(6, 128, generator=g) * 3, torch.randn(6, 128, generator=g) * 3
    lb[0, :4] = INF
    o1, l1 = oa.clone(), la.clone()
    merge_attn_states_(o1, l1, ob, lb * LOG2E, lse_b_base="log2")
    assert fake_flashinfer_merge.calls
    eo, el = merge64(oa.float(), la, ob.float(), lb)
    ref.assert_out_close(o1.float(), eo, atol=1.6e-2)
    ref.assert_lse_close(l1, el, atol=1e-5, rtol=1e-6)


def test_bad_lse_b_base_is_refused_before_anything_is_written():
    out, lse = torch.full((2, 3, 4), 7.0), torch.full((2, 3), 7.0)
    with pytest.raises(ValueError, match="lse_b_base must be 'ln'.*'log2', got 'log10'"):
        merge_attn_states_(out, lse, torch.zeros(2, 3, 4), torch.zeros(2, 3), lse_b_base="log10")
    assert torch.equal(out, torch.full((2, 3, 4), 7.0)) and torch.equal(lse, torch.full((2, 3), 7.0))


def test_triton_route_checks_before_the_kernel(fake_triton_merge):
    out, lse = torch.full((2, 3, 4), 7.0), torch.full((2, 3), 7.0)
    with pytest.raises(ValueError, match="lse_b"):
        merge_attn_states_(out, lse, torch.zeros(2, 3, 4), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="lse must be contiguous"):
        merge_attn_states_(out, torch.zeros(3, 2).t(), torch.zeros(2, 3, 4), torch.zeros(2, 3))
    assert not fake_triton_merge and torch.equal(out, torch.full((2, 3, 4), 7.0))


@pytest.mark.parametrize("src,dst_dtype,in_place", RUNNING_FORMS)
@pytest.mark.parametrize("impl", ["torch", "flashinfer"])
def test_merge_planned_into_another_dtype_rounds_once(src, dst_dtype, in_place, impl):
    """merge_planned_ with ``dst``: out (``src``) and a half-precision partial merged in float32 and rounded once
    into dst's dtype, the lse in place (base-2 lse_b converted as read): bitwise the float32 torch merge rounded to
    dst's dtype. The FlashInfer choice (one dtype only) hands such merges to the torch merge (nothing imported).
    A +inf LSE is an infinite logit there, not an empty partial (mla_prefill's passes mark empty rows with -inf)."""
    from mla_bridge.merge import merge_planned_

    half = src if src != torch.float32 else (torch.float16 if dst_dtype == torch.float16 else BF16)
    oa, la, ob, lb = merge_cases(64, half, seed=31)
    oa = (oa.float() * 1.0001).to(src) if src == torch.float32 else oa  # float32 values off the half grid
    b2 = lb * LOG2E
    want_o, want_l = merge_mod._merge_torch(oa, la, ob, b2 * math.log(2.0), dtype=torch.float32, inf_empty=False)
    assert not bitwise((want_o, want_l), merge_mod._merge_torch(oa, la, ob, b2 * math.log(2.0), dtype=torch.float32))
    a, lse = oa.clone(), la.clone()
    dst = a if in_place else torch.full(oa.shape, 7.0, dtype=dst_dtype)
    choice = MergeChoice(impl, "test", 10**9, 4 if impl == "flashinfer" else 0)
    merge_planned_(choice, a, lse, ob, b2, lse_b_base="log2", dst=dst)
    assert dst.dtype == dst_dtype and bitwise((dst, lse), (want_o.to(dst_dtype), want_l))
    if not in_place:
        assert bitwise((a, la), (oa, la))  # the source is only read


def test_merge_planned_hands_dst_to_the_triton_kernel(fake_triton_merge):
    """The Triton choice: one kernel call writing dst (another dtype) from out and the partial, lse in place."""
    from mla_bridge.merge import merge_planned_

    oa, la, ob, lb = merge_cases(64, BF16, seed=32)
    dst = torch.empty(oa.shape, dtype=torch.float32)
    choice = select_merge((1, 4, 64), BF16, "cuda", flashinfer=True, triton=True)
    merge_planned_(choice, oa, la, ob, lb, lse_b_base="log2", dst=dst)
    assert len(fake_triton_merge) == 1
    d, d_lse, a, sa, b, sb, log2, inf_empty = fake_triton_merge[0]
    assert d is dst and a is oa and d_lse is la and sa is la and b is ob and sb is lb and log2 is True
    assert inf_empty is False  # mla_prefill's partials mark an empty row with -inf: +inf is an infinite logit


# --------------------------------------------------------------------------------------------------------------
# the Triton merge (mla_bridge.kernels.merge), interpreted on CPU tensors, against the torch merge
# --------------------------------------------------------------------------------------------------------------


def interpreted_merge_cases() -> str:
    """Run under TRITON_INTERPRET=1 with MLA_BRIDGE_MERGE=triton: the public merges route to the Triton kernel on
    CPU tensors; each case is compared with :func:`_merge_torch` (:func:`assert_merge_matches`): head dims
    64/128/96/48, bf16/fp16/float32, in place and out of place, contiguous and strided outs, a base-2 lse_b."""
    from mla_bridge.merge import _choice, _merge_torch

    def numpy_math_merge(*args):
        """The torch merge with numpy's exp/log (the interpreter's): the same float32 operations in the same order
        as the kernel, so the kernel must equal it bit for bit."""
        import numpy as np

        exp, log = torch.exp, torch.log
        torch.exp = lambda x: torch.from_numpy(np.exp(x.numpy()))
        torch.log = lambda x: torch.from_numpy(np.log(x.numpy()))
        try:
            return _merge_torch(*args)
        finally:
            torch.exp, torch.log = exp, log

    n = exact = 0
    for d in (64, 128, 96, 48):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            oa, la, ob, lb = merge_cases(d, dtype, seed=d + dtype.itemsize)
            assert _choice(oa, ob).name == "triton"
            expect = _merge_torch(oa, la, ob, lb)
            same_math = numpy_math_merge(oa, la, ob, lb)
            got = merge_attn_states(oa, la, ob, lb)
            assert_merge_matches(got, expect, oa, la, ob, lb)
            exact += bitwise(got, same_math)
            # in place, into row/head-strided views: rows 2..t+1 of a [t+4, h, d+16] buffer, out_b head-major
            t, h = la.shape
            big = torch.full((t + 4, h, d + 16), 5.0).to(dtype)
            big_l = torch.full((t + 4, h), 5.0)
            view, view_l = big[2 : t + 2, :, :d], big_l[2 : t + 2]
            view.copy_(oa)
            view_l.copy_(la)
            ob_strided = ob.transpose(0, 1).contiguous().transpose(0, 1)
            assert not view.is_contiguous() and not ob_strided.is_contiguous()
            assert _choice(view, ob_strided).name == "triton"
            merge_attn_states_(view, view_l, ob_strided, lb)
            assert_merge_matches((view, view_l), expect, oa, la, ob, lb)
            exact += bitwise((view, view_l), same_math)
            assert torch.equal(big[:2], torch.full_like(big[:2], 5.0)) and torch.equal(big[t + 2 :], big[: 4 - 2])
            assert torch.equal(big[2 : t + 2, :, d:], torch.full_like(big[2 : t + 2, :, d:], 5.0))
            assert torch.equal(big_l[:2], torch.full((2, h), 5.0)) and torch.equal(big_l[t + 2 :], big_l[:2])
            # a last dim that is not unit-stride (every other element) and a non-contiguous lse_b
            wide = torch.zeros(t, h, 2 * d).to(dtype)
            wide[..., ::2] = ob
            lb_t = lb.t().contiguous().t()
            got = merge_attn_states(oa, la, wide[..., ::2], lb_t)
            assert_merge_matches(got, expect, oa, la, ob, lb)
            exact += bitwise(got, same_math)
            # lse_b in base 2, converted in the kernel: bitwise the merge of its float32 natural-log form
            o4, l4 = oa.clone(), la.clone()
            b2 = lb * (1.0 / math.log(2.0))
            merge_attn_states_(o4, l4, ob, b2, lse_b_base="log2")
            exact += bitwise((o4, l4), numpy_math_merge(oa, la, ob, b2 * math.log(2.0)))
            n += 4
    return f"ok {n} exact {exact}"


def interpreted_running_merge_cases() -> str:
    """Run under TRITON_INTERPRET=1 with MLA_BRIDGE_MERGE=triton: merge_planned_ with the Triton choice and a dst of
    another dtype (:data:`RUNNING_FORMS`: the kernel reads a float32 or half out, a half partial, and writes float32
    or half) against the float32 torch merge rounded into dst's dtype (:func:`assert_merge_matches`)."""
    from mla_bridge.merge import merge_planned_

    n = 0
    for src, dst_dtype, in_place in RUNNING_FORMS:
        half = src if src != torch.float32 else (torch.float16 if dst_dtype == torch.float16 else BF16)
        oa, la, ob, lb = merge_cases(64, half, seed=33)
        oa = (oa.float() * 1.0001).to(src) if src == torch.float32 else oa
        choice = select_merge((1, 4, 64), half, "cpu")
        assert choice.name == "triton"
        a, lse = oa.clone(), la.clone()
        dst = a if in_place else torch.full(oa.shape, 7.0, dtype=dst_dtype)
        merge_planned_(choice, a, lse, ob, lb, dst=dst)
        want = merge_mod._merge_torch(oa, la, ob, lb, dtype=torch.float32)
        assert_merge_matches((dst, lse), (want[0].to(dst_dtype), want[1]), oa.to(dst_dtype), la, ob.to(dst_dtype), lb)
        n += 1
    return f"ok {n}"


def test_triton_merge_into_another_dtype_interpreted(triton_interpreted):
    """Where Triton is installed: :func:`interpreted_running_merge_cases` under the interpreter."""
    words = triton_interpreted(
        "tests.test_merge:interpreted_running_merge_cases", "tests/gpu/test_gpu_merge.py", MLA_BRIDGE_MERGE="triton"
    ).split()
    assert words == ["ok", str(len(RUNNING_FORMS))], words


def test_triton_merge_equals_torch_merge_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_merge_cases` under the interpreter
    with ``MLA_BRIDGE_MERGE=triton``. tests/gpu/test_gpu_merge.py covers the compiled kernel."""
    words = triton_interpreted(
        "tests.test_merge:interpreted_merge_cases", "tests/gpu/test_gpu_merge.py", MLA_BRIDGE_MERGE="triton"
    ).split()
    assert words[0] == "ok" and int(words[1]) == 48, words
    assert words[2] == "exact" and int(words[3]) == 48, words  # bitwise equal to the same math in torch


def test_triton_merge_compiles_for_sm90_with_exact_arithmetic():
    """Where Triton is installed (no GPU needed): the kernel compiled for SM90 with the launch's own options rounds
    every float32 product and sum on its own (``mul.rn`` / ``add.rn``, no ``fma.rn.f32`` of our operations: with
    FMA contraction on there are some), divides with IEEE ``div.rn.f32`` (no approximate division) and takes its log
    from libdevice's ``logf`` (no ``lg2.approx``, which ``tl.log`` lowers to)."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mla_bridge.kernels.merge import LAUNCH_OPTIONS, _merge_kernel

    def ptx(dtype: str, options: dict) -> str:
        sig = {
            "dst_ptr": dtype,
            "dst_lse_ptr": "*fp32",
            "a_ptr": dtype,
            "a_lse_ptr": "*fp32",
            "b_ptr": dtype,
            "b_lse_ptr": "*fp32",
            "n_pairs": "i32",
            "num_heads": "i32",
        }
        sig.update({n: "i64" for n in ("a_st", "a_sh", "a_sd", "b_st", "b_sh", "b_sd", "d_st", "d_sh", "d_sd")})
        consts = {
            "HEAD_DIM": 96,
            "BLOCK_D": 128,
            "BLOCK_P": 32,
            "EXACT": True,
            "OUT_BF16": dtype == "*bf16",
            "LSE_B_LOG2": True,
        }
        sig.update({k: "constexpr" for k in consts})
        from triton.compiler.errors import CompilationError

        try:
            src = ASTSource(
                fn=_merge_kernel, signature=sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()}
            )
            return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        except CompilationError:
            raise  # the kernel itself does not compile: a failure
        except Exception as err:  # noqa: BLE001 - another Triton's ASTSource API, no ptxas in this build
            pytest.skip(f"cannot compile for sm_90 here: {type(err).__name__}: {str(err)[:200]}")

    for dtype in ("*bf16", "*fp32"):
        code = ptx(dtype, dict(LAUNCH_OPTIONS))
        assert "mul.rn.f32" in code and "add.rn.f32" in code and "div.rn.f32" in code
        assert not re.search(r"\bfma\.rn\.f32", code) and "div.approx" not in code and "div.full" not in code
        assert "lg2.approx" not in code
    fused = ptx("*fp32", dict(LAUNCH_OPTIONS, enable_fp_fusion=True))  # the check can fail: contraction shows
    assert re.search(r"\bfma\.rn\.f32", fused)


# ---------------------------------------------------------------------------------------------------------------
# the LSE base; any head count (the GPU test covers FlashInfer's merge_state)
# ---------------------------------------------------------------------------------------------------------------


def test_merge_value_is_natural_log():
    """Partition sums 2 and 8 (lse ln 2, ln 8), values 1 and 0, 1 head, d 1: merged value 2 / 10 = 0.2."""
    out_a = torch.ones(1, 1, 1)
    out_b = torch.zeros(1, 1, 1)
    lse_a = torch.tensor([[math.log(2.0)]])
    lse_b = torch.tensor([[math.log(8.0)]])
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert abs(out.item() - 0.2) < 1e-6  # a base-2 / base-e mix-up gives 0.119 or 0.277
    assert abs(lse.item() - math.log(10.0)) < 1e-6
    merge_attn_states_(out_a, lse_a, out_b, lse_b)
    assert abs(out_a.item() - 0.2) < 1e-6 and abs(lse_a.item() - math.log(10.0)) < 1e-6


@pytest.mark.parametrize("heads", [1, 16, 64, 128, 256])
def test_merge_any_head_count(heads):
    g = torch.Generator().manual_seed(heads)
    oa = torch.randn(3, heads, 128, generator=g).bfloat16()
    ob = torch.randn(3, heads, 128, generator=g).bfloat16()
    la, lb = torch.randn(3, heads, generator=g) * 3, torch.randn(3, heads, generator=g) * 3
    la[0, 0] = -INF
    out, lse = merge_attn_states(oa, la, ob, lb)
    # the float32 formula, written out
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    exp_out = (oa.float() * wa[..., None] + ob.float() * wb[..., None]) / (wa + wb)[..., None]
    exp_lse = m + torch.log(wa + wb)
    assert out.dtype == torch.bfloat16 and out.shape == (3, heads, 128)
    torch.testing.assert_close(out.float(), exp_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, exp_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 0].float(), ob[0, 0].float(), atol=0, rtol=0)
