"""The pure-JAX float32 reference: masks from indptrs, bottom-right causal, empty rows, jit with static or traced
indptrs, and agreement with an independent float64 loop and with the torch core (float32)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402

from tests.helpers import jax_reference as reference  # noqa: E402

SM = 0.3


def _loop_reference(q, k, v, qo, kv, causal, sm):
    """float64, one request at a time, mask written as an explicit double loop."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    t, h = q.shape[:2]
    out = np.zeros((t, h, v.shape[-1]))
    lse = np.full((t, h), -np.inf)
    for r in range(len(qo) - 1):
        lq, lk = qo[r + 1] - qo[r], kv[r + 1] - kv[r]
        for i in range(lq):
            for hh in range(h):
                s = np.array(
                    [q[qo[r] + i, hh] @ k[kv[r] + j, hh] * sm for j in range(lk) if not causal or j <= i + lk - lq]
                )
                if s.size:
                    m = s.max()
                    p = np.exp(s - m)
                    lse[qo[r] + i, hh] = m + np.log(p.sum())
                    out[qo[r] + i, hh] = (p / p.sum()) @ v[kv[r] : kv[r] + s.size, hh]
    return out, lse


CASES = [
    ([3, 0, 1, 4], [3, 0, 1, 4], True),
    ([2, 3, 1], [5, 3, 0], True),  # kv longer (bottom-right), and a request with queries but no keys
    ([4, 1], [2, 0], True),  # q longer than kv: the first rows see no key
    ([1, 0, 2], [4, 3, 0], False),
]


@pytest.mark.parametrize("q_lens,kv_lens,causal", CASES)
def test_matches_float64_loop(q_lens, kv_lens, causal):
    rng = np.random.default_rng(0)
    qo, kv = np.cumsum([0] + q_lens).tolist(), np.cumsum([0] + kv_lens).tolist()
    q = rng.standard_normal((qo[-1], 2, 24)).astype(np.float32)
    k = rng.standard_normal((kv[-1], 2, 24)).astype(np.float32)
    v = rng.standard_normal((kv[-1], 2, 8)).astype(np.float32)
    out, lse = reference.ragged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), qo, kv, causal=causal, sm_scale=SM
    )
    want_out, want_lse = _loop_reference(q, k, v, qo, kv, causal, SM)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-5)
    assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=1e-5)
    assert np.all(np.asarray(out)[~fin] == 0)  # empty rows: out 0, lse -inf


@pytest.mark.parametrize("q_lens,kv_lens,causal", CASES)
def test_matches_torch_core_float32(q_lens, kv_lens, causal):
    rng = np.random.default_rng(1)
    qo, kv = np.cumsum([0] + q_lens).tolist(), np.cumsum([0] + kv_lens).tolist()
    q, k = (rng.standard_normal((n, 4, 192)).astype(np.float32) for n in (qo[-1], kv[-1]))
    v = rng.standard_normal((kv[-1], 4, 128)).astype(np.float32)
    core_out, core_lse = mla_bridge.ragged_prefill(
        *(torch.from_numpy(x) for x in (q, k, v)), qo, kv, causal=causal, sm_scale=192**-0.5
    )
    out, lse = reference.ragged_attention(
        *(jnp.asarray(x) for x in (q, k, v)), qo, kv, causal=causal, sm_scale=192**-0.5
    )
    np.testing.assert_allclose(np.asarray(out), core_out.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), core_lse.numpy(), atol=1e-5, rtol=0)


def test_jit_with_static_or_traced_indptrs():
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.standard_normal((7, 2, 16)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((7, 2, 8)), jnp.float32)
    eager = reference.ragged_attention(q, k, v, [0, 3, 7], [0, 3, 7], causal=True, sm_scale=SM)
    static = jax.jit(
        lambda a, b, c: reference.ragged_attention(a, b, c, (0, 3, 7), (0, 3, 7), causal=True, sm_scale=SM)
    )(q, k, v)
    traced_fn = jax.jit(lambda a, b, c, qo, kv: reference.ragged_attention(a, b, c, qo, kv, causal=True, sm_scale=SM))
    traced = traced_fn(q, k, v, jnp.asarray([0, 3, 7]), jnp.asarray([0, 3, 7]))
    for got in (static, traced):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(eager[0]), atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(eager[1]), atol=1e-6)
    # new lengths with the same totals reuse the compiled function (only T and S fix the shapes)
    other = traced_fn(q, k, v, jnp.asarray([0, 5, 7]), jnp.asarray([0, 1, 7]))
    want = reference.ragged_attention(q, k, v, [0, 5, 7], [0, 1, 7], causal=True, sm_scale=SM)
    np.testing.assert_allclose(np.asarray(other[0]), np.asarray(want[0]), atol=1e-6)
    assert traced_fn._cache_size() == 1


def test_static_indptrs_are_checked():
    q = jnp.zeros((4, 1, 8))
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\] = 5 but q has 4 rows"):
        reference.ragged_attention(q, q, q, [0, 5], [0, 4], causal=False, sm_scale=SM)
    with pytest.raises(ValueError, match=r"kv_indptr must be 1-D non-decreasing"):
        reference.ragged_attention(q, q, q, [0, 4], [0, 3, 1, 4], causal=False, sm_scale=SM)
