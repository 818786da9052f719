"""Merge test inputs and comparisons shared by the CPU and GPU merge tests (tests/test_merge.py,
tests/test_chunk_precision.py, tests/gpu/test_gpu_merge.py, tests/gpu/test_gpu_chunk_precision.py): partials with
every kind of row, units in the last place, bit-for-bit and Triton-against-torch comparisons."""

from __future__ import annotations

import torch

INF = float("inf")
BF16 = torch.bfloat16


# (src dtype, dst dtype, in place) of merge_planned_ with a float32 running out: a row's first merge (out in the
# plan's dtype into the float32 running out), a middle one (the running out in place), its last (into out)
RUNNING_FORMS = [
    (BF16, torch.float32, False),
    (torch.float32, torch.float32, True),
    (torch.float32, BF16, False),
    (torch.float16, torch.float32, False),
    (torch.float32, torch.float16, False),
]


_MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}  # with the implicit bit


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at the magnitude of ``x`` (float64; the smallest normal's at 0)."""
    x = x.double().abs()
    _, e = torch.frexp(torch.where(x > 0, x, torch.full_like(x, torch.finfo(dtype).tiny)))
    return torch.ldexp(torch.ones_like(x), (e - _MANTISSA_BITS[dtype]).to(torch.int32))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_merge_matches(got, expect, out_a, lse_a, out_b, lse_b):
    """The Triton merge against the torch merge (:func:`mla_bridge.merge._merge_torch`) on the same inputs.

    Exact where the result does not depend on exp/log rounding: NaN in the same places (out and lse), -inf in the
    same places, rows with one empty partial equal to the other partial bit for bit, two empties (0, -inf).
    Elsewhere the kernel computes the same float32 operations in the same order, but the interpreter's exp/log are
    numpy's and the torch merge's are torch's (SLEEF on the CPU): they differ by about 1 float32 ulp, so the float32
    LSE may differ by a few ulps (atol 1e-6 + rtol 4e-7: ms + log(total) with total in [1, 2]) and out, once
    rounded, by at most 1 ulp of the output dtype plus 1e-6 of the partials' magnitude (only where the float32
    value sits at a rounding boundary of the output dtype). On CUDA the kernel uses libdevice's expf/logf, the
    functions torch's CUDA kernels call: tests/gpu/test_gpu_merge.py checks bitwise equality there."""
    (o, s), (eo, es) = got, expect
    assert o.dtype == eo.dtype and o.shape == eo.shape and s.dtype == torch.float32 and s.shape == es.shape
    assert torch.equal(torch.isnan(s), torch.isnan(es)) and torch.equal(torch.isnan(o), torch.isnan(eo))
    assert torch.equal(torch.isneginf(s), torch.isneginf(es)) and not torch.isposinf(s).any()
    fin = torch.isfinite(es)
    assert (s[fin].double() - es[fin].double()).abs().le(1e-6 + 4e-7 * es[fin].double().abs()).all()
    la, lb = lse_a.clone(), lse_b.clone()
    empty_a, empty_b = torch.isinf(la), torch.isinf(lb)
    both = empty_a & empty_b
    assert torch.equal(o[both], torch.zeros_like(o[both])) and torch.isneginf(s[both]).all()
    for only, other_out, other_lse in ((empty_a & ~empty_b, out_b, lb), (empty_b & ~empty_a, out_a, la)):
        rows = only & ~torch.isnan(other_lse)  # exp(0) = 1, log(1) = 0: the other partial exactly
        assert torch.equal(bits(o[rows]), bits(other_out[rows])) and torch.equal(s[rows], other_lse[rows])
    ok = ~torch.isnan(o)
    a_eff = torch.where(empty_a[..., None], 0.0, out_a.double().nan_to_num(0.0))
    b_eff = torch.where(empty_b[..., None], 0.0, out_b.double().nan_to_num(0.0))
    tol = ulp(eo, o.dtype) + 1e-6 * (a_eff.abs() + b_eff.abs())
    diff = (o.double() - eo.double()).abs()
    assert diff[ok].le(tol[ok]).all(), (o.dtype, diff[ok].max().item())


def bitwise(got, expect) -> int:
    """1 when out and lse are equal bit for bit, NaNs in the same places (whatever their payload), else 0."""
    (o, s), (eo, es) = got, expect
    same_nan = torch.equal(torch.isnan(o), torch.isnan(eo)) and torch.equal(torch.isnan(s), torch.isnan(es))
    return int(
        same_nan
        and torch.equal(bits(o)[~torch.isnan(o)], bits(eo)[~torch.isnan(eo)])
        and torch.equal(bits(s)[~torch.isnan(s)], bits(es)[~torch.isnan(es)])
    )


def merge_cases(d: int, dtype: torch.dtype, seed: int, t: int = 37, h: int = 4):
    """Partials with every kind of row: finite, -inf / +inf on either side or both, NaN lse on either side, NaN and
    huge garbage in the empty partials' outs, lse spreads up to 60 (weights far below 1), one subnormal weight."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([-INF, INF, float("nan"), -3.0, 0.0, 2.5, 40.0, -20.0, 1e4])
    la = choices[torch.randint(0, len(choices), (t, h), generator=g)]
    lb = choices[torch.randint(0, len(choices), (t, h), generator=g)]
    la[: t // 2] = torch.randn(t // 2, h, generator=g) * 6  # half the rows finite on both sides
    lb[: t // 3] = torch.randn(t // 3, h, generator=g) * 6
    la[t // 2 - 1, 0], lb[t // 2 - 1, 0] = 0.0, -95.0  # exp(-95): a subnormal float32 weight
    oa = (torch.randn(t, h, d, generator=g) * 3).to(dtype)
    ob = (torch.randn(t, h, d, generator=g) * 3).to(dtype)
    oa[torch.isinf(la)] = float("nan")
    ob[torch.isinf(lb)] = 6e4 if dtype == torch.float16 else 1e30
    return oa, la, ob, lb
