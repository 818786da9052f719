"""Sparse attention (DeepSeek Sparse Attention) through the JAX adapter: ``mla_bridge_jax.mla_prefill(...,
topk_indices=)`` over a plan from ``build_plan(..., index_topk=K)``, eagerly and under ``jax.jit``, equal bit for bit
to the torch core's ``mla_prefill`` on the same inputs, and close to a float64 sparse attention written here from the
indices in the unabsorbed form; and its refusals, by name."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims, Workspace  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402
from tests.helpers.reference import make_mla_batch  # noqa: E402

#: DeepSeek-like (v_head_dim == qk_nope_head_dim) and GLM-5-like (qk_nope 192 / rope 64 / v 256, scaled down: v wider
#: than the nope part) tiny dims.
DIMS = {
    "deepseek": MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "glm5": MLADims(num_heads=4, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32),
}
# requests without context, one whose context spans several blocks, one without new tokens
QUERY_LENS, CONTEXT_LENS, BLOCK = [3, 4, 0, 5], [0, 11, 6, 2], 4
K = 6
JAX_DTYPE = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}


def random_indices(query_lens, context_lens, k, seed):
    """int32 [T, k]: per new token between 0 and min(k, own + 1) distinct causal picks at shuffled places in the row,
    -1 elsewhere; the second token has none (a row of -1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for q, c in zip(query_lens, context_lens):
        for j in range(q):
            own = c + j
            m = int(rng.integers(1, min(k, own + 1) + 1))
            row = np.full(k, -1, np.int32)
            row[rng.permutation(k)[:m]] = rng.permutation(own + 1)[:m]
            rows.append(row)
    out = np.stack(rows)
    out[1] = -1
    return out


def sparse_reference(batch, indices):
    """float64, unabsorbed: each request's sequence latents (context read from the paged cache through block_table,
    then the new tokens' kv_c ++ k_pe), up-projected into per-head k = [k_nope, k_pe] and v; row t attends the
    positions its indices name. Returns out [T, H, v], lse [T, H] (natural log; out 0 and lse -inf without keys)."""
    d = batch.dims
    h, nope, vd, rank = d.num_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    w, cache = batch.w.double(), batch.cache.double()
    t = sum(batch.query_lens)
    out = torch.zeros(t, h, vd, dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    row = 0
    for r, (n, c) in enumerate(zip(batch.query_lens, batch.context_lens)):
        bs = batch.block_size
        ctx = [cache[int(batch.block_table[r, p // bs]), p % bs] for p in range(c)]
        new = torch.cat([batch.kv_c[row : row + n].double(), batch.k_pe[row : row + n].double()], 1)
        latent = torch.cat([torch.stack(ctx) if ctx else new[:0], new])
        kv = (latent[:, :rank] @ w.t()).view(-1, h, nope + vd)
        k = torch.cat([kv[..., :nope], latent[:, rank:, None].transpose(1, 2).expand(-1, h, -1)], -1)
        for j in range(n):
            picks = [int(p) for p in indices[row + j] if p >= 0]
            if picks:
                s = torch.einsum("hd,mhd->hm", batch.q[row + j].double(), k[picks]) * d.softmax_scale
                lse[row + j] = torch.logsumexp(s, -1)
                out[row + j] = torch.einsum("hm,mhv->hv", torch.softmax(s, -1), kv[picks][..., nope:])
        row += n
    return out, lse


def setup(name="deepseek", dtype=torch.float32, k=K, seed=0, chunk_tokens=None):
    """(batch (torch), the JAX inputs (q, kv_c, k_pe, w, cache, table), indices (numpy), sparse plan)."""
    dims = DIMS[name]
    batch = make_mla_batch(dims, QUERY_LENS, CONTEXT_LENS, BLOCK, dtype=dtype, seed=seed)
    args = tuple(mj.from_torch(x) for x in (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table))
    ws = None if chunk_tokens is None else Workspace("cpu", chunk_tokens=chunk_tokens)
    plan = mj.build_plan(
        QUERY_LENS, CONTEXT_LENS, dims=dims, block_size=BLOCK, dtype=JAX_DTYPE[dtype], workspace=ws, index_topk=k
    )
    return batch, args, random_indices(QUERY_LENS, CONTEXT_LENS, k, seed), plan


def core_call(batch, plan, indices):
    return mla_bridge.mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        return_lse=True,
        topk_indices=torch.from_numpy(indices),
    )


def same_bits(jx, tx) -> bool:
    return torch.equal(torch.from_dlpack(jx), tx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["deepseek", "glm5"])
def test_eager_and_jit_equal_the_core_bit_for_bit(name, dtype):
    batch, args, indices, plan = setup(name, dtype, seed=1 if dtype == torch.float32 else 2)
    assert plan.index_topk == K
    want_out, want_lse = core_call(batch, plan, indices)
    idx = jnp.asarray(indices)
    out, lse = mj.mla_prefill(*args, plan, return_lse=True, topk_indices=idx)
    assert out.dtype == JAX_DTYPE[dtype] and out.shape == (sum(QUERY_LENS), 4, DIMS[name].v_head_dim)
    assert same_bits(out, want_out) and same_bits(lse, want_lse)
    assert same_bits(mj.mla_prefill(*args, plan, topk_indices=idx), want_out)  # out alone
    jout, jlse = jax.jit(lambda *a: mj.mla_prefill(*a[:6], plan, return_lse=True, topk_indices=a[6]))(*args, idx)
    assert same_bits(jout, want_out) and same_bits(jlse, want_lse)
    # the row without keys: out 0, lse -inf (the dense passes' convention)
    assert not np.asarray(jout[1], np.float32).any() and np.all(np.isneginf(np.asarray(jlse[1])))
    # a real value: the float64 sparse attention (unabsorbed), at the precision of the dtype
    exp_out, exp_lse = sparse_reference(batch, indices)
    tol = 3e-5 if dtype == torch.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(jout, np.float64), exp_out.numpy(), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(jlse, np.float64), exp_lse.numpy(), atol=tol, rtol=tol)


def test_jit_with_a_prepared_weight_and_chunked_context_plan():
    """A prepared weight closed over under jit, a plan whose dense schedule is chunked (the sparse pass ignores it),
    and indices closed over as a constant of the compiled function."""
    batch, (q, kv_c, k_pe, w, cache, table), indices, plan = setup(seed=3, chunk_tokens=4)
    assert not plan.fused
    prepared = mj.prepare_kv_b_proj(w, plan.dims, layout="split")
    want_out, want_lse = mla_bridge.mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        mla_bridge.prepare_kv_b_proj(batch.w, plan.dims, layout="split"),
        batch.cache,
        batch.block_table,
        plan,
        return_lse=True,
        topk_indices=torch.from_numpy(indices),
    )
    idx = jnp.asarray(indices)
    out, lse = jax.jit(
        lambda q, c, p, kc, bt: mj.mla_prefill(q, c, p, prepared, kc, bt, plan, return_lse=True, topk_indices=idx)
    )(q, kv_c, k_pe, cache, table)
    assert same_bits(out, want_out) and same_bits(lse, want_lse)
    assert same_bits(mj.mla_prefill(q, kv_c, k_pe, prepared, cache, table, plan, topk_indices=idx), want_out)


@pytest.mark.parametrize("scale_as", ["float", "array"])
def test_fp8_cache_with_the_scale_as_a_float_or_a_traced_array(scale_as):
    """An FP8 e4m3 cache: the scale a Python float (closed over) or a jax.Array (under jit the buffer after the
    indices): eager and jit bitwise the core's."""
    batch, (q, kv_c, k_pe, w, _, table), indices, _ = setup(seed=5)
    cache8, scale = mla_bridge.quantize_latent_cache(batch.cache)
    scale = float(scale)
    plan = mj.build_plan(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=DIMS["deepseek"],
        block_size=BLOCK,
        dtype=jnp.float32,
        kv_cache_dtype="fp8",
        index_topk=K,
    )
    jcache = jax.lax.bitcast_convert_type(jnp.asarray(cache8.view(torch.uint8).numpy()), jnp.float8_e4m3fn)
    want_out, want_lse = mla_bridge.mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        cache8,
        batch.block_table,
        plan,
        return_lse=True,
        kv_cache_scale=scale,
        topk_indices=torch.from_numpy(indices),
    )
    s = scale if scale_as == "float" else jnp.asarray([scale], jnp.float32)
    idx = jnp.asarray(indices)
    out, lse = mj.mla_prefill(
        q, kv_c, k_pe, w, jcache, table, plan, return_lse=True, kv_cache_scale=s, topk_indices=idx
    )
    assert same_bits(out, want_out) and same_bits(lse, want_lse)
    if scale_as == "float":
        f = jax.jit(lambda *a: mj.mla_prefill(*a[:6], plan, return_lse=True, kv_cache_scale=scale, topk_indices=a[6]))
        jout, jlse = f(q, kv_c, k_pe, w, jcache, table, idx)
    else:
        f = jax.jit(lambda *a: mj.mla_prefill(*a[:6], plan, return_lse=True, kv_cache_scale=a[7], topk_indices=a[6]))
        jout, jlse = f(q, kv_c, k_pe, w, jcache, table, idx, s)
    assert same_bits(jout, want_out) and same_bits(jlse, want_lse)


def test_every_causal_key_selected_equals_dense_prefill():
    """Indices naming every position up to each token's own (K = the longest sequence, -1 padded): the sparse call
    equals the dense one through the adapter, eagerly and under jit."""
    batch, args, _, plan = setup(k=16)
    own = [c + j for q, c in zip(QUERY_LENS, CONTEXT_LENS) for j in range(q)]
    every = np.full((len(own), 16), -1, np.int32)
    for t, o in enumerate(own):
        every[t, : o + 1] = np.arange(o + 1)
    dense_plan = mj.build_plan(QUERY_LENS, CONTEXT_LENS, dims=plan.dims, block_size=BLOCK, dtype=jnp.float32)
    dense_out, dense_lse = mj.mla_prefill(*args, dense_plan, return_lse=True)
    jitted = jax.jit(lambda *a: mj.mla_prefill(*a[:6], plan, return_lse=True, topk_indices=a[6]))
    for out, lse in (
        mj.mla_prefill(*args, plan, return_lse=True, topk_indices=jnp.asarray(every)),
        jitted(*args, jnp.asarray(every)),
    ):
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense_out), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(dense_lse), atol=2e-5, rtol=2e-5)


def test_eager_indices_reach_the_core_without_a_copy(monkeypatch):
    batch, args, indices, plan = setup()
    idx = jnp.asarray(indices)
    seen = {}
    orig = mla_bridge.mla_prefill

    def spy(*a, **kw):
        seen["ptr"] = kw["topk_indices"].data_ptr()
        return orig(*a, **kw)

    monkeypatch.setattr(mla_bridge, "mla_prefill", spy)
    mj.mla_prefill(*args, plan, topk_indices=idx)
    assert seen["ptr"] == idx.unsafe_buffer_pointer()


def test_vmap_runs_each_set_of_indices():
    batch, args, indices, plan = setup(seed=4)
    other = random_indices(QUERY_LENS, CONTEXT_LENS, K, seed=9)
    both = jnp.stack([jnp.asarray(indices), jnp.asarray(other)])
    outs = jax.vmap(lambda i: mj.mla_prefill(*args, plan, topk_indices=i))(both)
    assert same_bits(outs[0], core_call(batch, plan, indices)[0])
    assert same_bits(outs[1], core_call(batch, plan, other)[0])


# --------------------------------------------------------------------------------------------------------------
# refusals, by name, before anything runs (at trace time under jit)
# --------------------------------------------------------------------------------------------------------------


def _both(args, plan, **kw):
    """The call eagerly, then under jit (every array traced)."""
    arrays = [x for x in kw.values() if isinstance(x, jax.Array)]
    keys = [k for k, x in kw.items() if isinstance(x, jax.Array)]
    rest = {k: x for k, x in kw.items() if k not in keys}

    def traced(*a):
        return mj.mla_prefill(*a[:6], plan, **dict(zip(keys, a[6:])), **rest)

    return (lambda: mj.mla_prefill(*args, plan, **kw)), (lambda: jax.jit(traced)(*args, *arrays))


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.uint32, jnp.float32, jnp.uint8, jnp.bool_])
def test_indices_that_are_not_int32_are_refused_naming_the_jax_dtype(dtype):
    _, args, indices, plan = setup()
    name = jnp.dtype(dtype).name
    for call in _both(args, plan, topk_indices=jnp.asarray(indices).astype(dtype)):
        with pytest.raises(TypeError, match=rf"^topk_indices must be int32 \(positions, -1 for none\), got {name}\b"):
            call()


@pytest.mark.parametrize("shape", [(12, K - 1), (12, K + 1), (11, K), (12,), (1, 12, K)])
def test_a_shape_other_than_t_by_k_is_refused(shape):
    _, args, _, plan = setup()
    assert plan.num_tokens == 12
    for call in _both(args, plan, topk_indices=jnp.zeros(shape, jnp.int32)):
        with pytest.raises(ValueError, match=rf"^topk_indices must be \[T=12 \(new tokens\), index_topk={K}"):
            call()


def test_indices_with_a_dense_plan_and_a_sparse_plan_without_them_are_refused():
    _, args, indices, plan = setup()
    dense = mj.build_plan(QUERY_LENS, CONTEXT_LENS, dims=plan.dims, block_size=BLOCK, dtype=jnp.float32)
    for call in _both(args, dense, topk_indices=jnp.asarray(indices)):
        with pytest.raises(ValueError, match=r"^topk_indices was given, but the plan was built for dense prefill"):
            call()
    for call in _both(args, plan):
        with pytest.raises(ValueError, match=rf"^topk_indices is required: the plan was built with index_topk={K}"):
            call()


def test_non_jax_indices_are_named():
    _, args, indices, plan = setup()
    with pytest.raises(TypeError, match=r"^topk_indices must be a jax\.Array.*from_torch"):
        mj.mla_prefill(*args, plan, topk_indices=torch.from_numpy(indices))
    with pytest.raises(TypeError, match=r"^topk_indices must be a jax\.Array.*jnp\.asarray"):
        mj.mla_prefill(*args, plan, topk_indices=indices)


def test_a_non_causal_pick_is_refused_eagerly_and_when_the_jitted_call_runs():
    """On a CPU plan the core checks the picks on the host: eagerly before anything runs; under jit the values are
    traced, so when the call runs (inside XLA's error, the message last, as for block ids)."""
    _, args, indices, plan = setup()
    bad = indices.copy()
    bad[4, 0] = 13  # the fifth new token is request 1's second (own position 12): 13 is after it
    msg = "topk_indices[4, 0] = 13 is after the query's own position 12 in request 1 (a non-causal pick)"
    with pytest.raises(ValueError, match=r"^" + msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        mj.mla_prefill(*args, plan, topk_indices=jnp.asarray(bad))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(
            jax.jit(lambda *a: mj.mla_prefill(*a[:6], plan, topk_indices=a[6]))(*args, jnp.asarray(bad))
        )
    assert str(info.value).splitlines()[-1] == f"ValueError: mla_bridge_jax.mla_prefill: {msg}"


def test_build_plan_index_topk_is_checked_by_the_core():
    dims = DIMS["deepseek"]
    for bad in (0, -2, 2.5, True):
        with pytest.raises((TypeError, ValueError), match="index_topk"):
            mj.build_plan([2], [0], dims=dims, block_size=4, dtype=jnp.float32, index_topk=bad)
    assert mj.build_plan([2], [0], dims=dims, block_size=4, dtype=jnp.float32).index_topk is None
