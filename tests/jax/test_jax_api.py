"""mla_bridge_jax API on CPU: zero-copy eager calls, the jit route, plans, bad input, grad and vmap."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax.extend.core import jaxprs_in_params  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402

SM = 192**-0.5
QO, KV = [0, 3, 3, 4, 9], [0, 5, 5, 6, 11]  # lengths q [3, 0, 1, 5], kv [5, 0, 1, 5]: kv_len >= q_len


def _qkv(t=9, s=11, h=4, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((t, h, 192)), dtype),
        jnp.asarray(rng.standard_normal((s, h, 192)), dtype),
        jnp.asarray(rng.standard_normal((s, h, 128)), dtype),
    )


def _core(q, k, v, qo=QO, kv=KV, causal=True):
    return mla_bridge.ragged_prefill(
        torch.from_dlpack(q), torch.from_dlpack(k), torch.from_dlpack(v), qo, kv, causal=causal, sm_scale=SM
    )


def _equal(jx, tx) -> bool:
    return torch.equal(torch.from_dlpack(jx), tx)


class _RunSpy:
    """Records what RaggedPlan.run receives (pointers, whether out/lse were given) and how often it runs."""

    def __init__(self, monkeypatch):
        self.calls = []
        orig = mla_bridge.RaggedPlan.run

        def run(plan, q, k, v, *, out=None, lse=None, lse_layout="NH"):
            self.calls.append(
                dict(
                    q=q.data_ptr(),
                    k=k.data_ptr(),
                    v=v.data_ptr(),
                    out=None if out is None else out.data_ptr(),
                    lse=None if lse is None else lse.data_ptr(),
                )
            )
            return orig(plan, q, k, v, out=out, lse=lse, lse_layout=lse_layout)

        monkeypatch.setattr(mla_bridge.RaggedPlan, "run", run)


# --------------------------------------------------------------------------------------------------------------
# values and zero copy
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_eager_and_jit_bitwise_equal_core(causal):
    q, k, v = _qkv()
    core_out, core_lse = _core(q, k, v, causal=causal)
    out, lse = mj.ragged_prefill(q, k, v, QO, KV, causal=causal, sm_scale=SM)
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16 and out.shape == (9, 4, 128)
    assert lse.dtype == jnp.float32 and lse.shape == (9, 4)
    assert _equal(out, core_out) and _equal(lse, core_lse)
    jout, jlse = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=causal, sm_scale=SM))(q, k, v)
    assert _equal(jout, core_out) and _equal(jlse, core_lse)


def test_eager_is_zero_copy_both_ways(monkeypatch):
    q, k, v = _qkv()
    seen = {}
    orig = mla_bridge.ragged_prefill

    def spy(tq, tk, tv, *args, **kwargs):
        out, lse = orig(tq, tk, tv, *args, **kwargs)
        seen.update(q=tq.data_ptr(), k=tk.data_ptr(), v=tv.data_ptr(), out=out.data_ptr(), lse=lse.data_ptr())
        return out, lse

    monkeypatch.setattr(mla_bridge, "ragged_prefill", spy)
    out, lse = mj.ragged_prefill(q, k, v, QO, KV, causal=True, sm_scale=SM)
    assert seen["q"] == q.unsafe_buffer_pointer()
    assert seen["k"] == k.unsafe_buffer_pointer()
    assert seen["v"] == v.unsafe_buffer_pointer()
    assert seen["out"] == out.unsafe_buffer_pointer()
    assert seen["lse"] == lse.unsafe_buffer_pointer()


def test_jit_reads_and_writes_xla_buffers_in_place(monkeypatch):
    spy = _RunSpy(monkeypatch)
    q, k, v = _qkv()
    out, lse = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM))(q, k, v)
    (call,) = spy.calls
    assert call["q"] == q.unsafe_buffer_pointer() and call["k"] == k.unsafe_buffer_pointer()
    assert call["out"] == out.unsafe_buffer_pointer() and call["lse"] == lse.unsafe_buffer_pointer()


def test_jit_plans_once_per_trace():
    """The plan of a traced call is made once (a miss of the plan cache the adapters share) and found there by every
    call of the compiled function; a second function of the same batch finds it too (no new plan)."""
    from mla_bridge.plan_cache import shared_plan_cache

    cache = shared_plan_cache()
    cache.clear()
    misses, hits = cache.misses, cache.hits
    f = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM))
    for seed in range(3):
        q, k, v = _qkv(seed=seed)
        out, _ = f(q, k, v)
        assert _equal(out, _core(q, k, v)[0])
    assert cache.misses - misses == 1 and cache.hits - hits == 3
    g = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM) + (1,))
    assert _equal(g(q, k, v)[0], _core(q, k, v)[0]) and cache.misses - misses == 1


def test_a_dropped_compiled_function_keeps_the_plan_another_one_uses():
    """Two compiled functions of the same batch share one plan of the shared cache. When one of them was garbage
    collected its finalizer dropped that plan from the cache, and the other planned it again on its next call (a
    miss: test_jit_plans_once_per_trace failed at random, as the collector ran). The plan stays while a live compiled
    function uses it."""
    import gc

    from mla_bridge.plan_cache import shared_plan_cache

    cache = shared_plan_cache()
    cache.clear()
    f = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM))
    g = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM) + (2,))
    q, k, v = _qkv(seed=4)
    want = _core(q, k, v)[0]
    assert _equal(f(q, k, v)[0], want) and _equal(g(q, k, v)[0], want)
    misses = cache.misses
    del g
    gc.collect()
    assert _equal(f(q, k, v)[0], want)
    assert cache.misses == misses, "the plan f uses was dropped when g died"
    del f
    gc.collect()
    assert len(cache) == 0  # the last user gone: the plan goes too


def test_plan_ragged_run_ragged_eager_and_jit(monkeypatch):
    plan = mj.plan_ragged(
        QO, KV, num_heads=4, head_dim_qk=192, head_dim_vo=128, causal=True, sm_scale=SM, dtype=jnp.bfloat16
    )
    assert isinstance(plan, mla_bridge.RaggedPlan) and plan.spec.device == torch.device("cpu")
    made = []
    monkeypatch.setattr(mla_bridge, "plan_ragged", lambda *a, **kw: made.append(1))
    f = jax.jit(lambda a, b, c: mj.run_ragged(plan, a, b, c))
    for seed in range(2):
        q, k, v = _qkv(seed=seed)
        core_out, core_lse = _core(q, k, v)
        for out, lse in (mj.run_ragged(plan, q, k, v), f(q, k, v)):
            assert _equal(out, core_out) and _equal(lse, core_lse)
    assert made == []  # running never re-plans


def test_indptrs_as_numpy_torch_and_concrete_jax_arrays():
    q, k, v = _qkv()
    core_out, _ = _core(q, k, v)
    for qo, kv in (
        (np.array(QO, np.int32), np.array(KV, np.int64)),
        (torch.tensor(QO), torch.tensor(KV)),
        (jnp.asarray(QO), jnp.asarray(KV)),
    ):
        out, _ = mj.ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=SM)
        assert _equal(out, core_out)
        out, _ = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, qo, kv, causal=True, sm_scale=SM))(q, k, v)
        assert _equal(out, core_out)


def test_empty_batch_and_no_keys():
    q, k, v = _qkv(t=3, s=0)
    for fn in (
        mj.ragged_prefill,
        jax.jit(mj.ragged_prefill, static_argnums=(3, 4), static_argnames=("causal", "sm_scale")),
    ):
        out, lse = fn(q, k, v, (0, 3), (0, 0), causal=False, sm_scale=SM)
        assert np.array_equal(np.asarray(out, np.float32), np.zeros((3, 4, 128), np.float32))
        assert np.all(np.isneginf(np.asarray(lse)))
    q, k, v = _qkv(t=0, s=0)
    out, lse = mj.ragged_prefill(q, k, v, [0], [0], causal=True, sm_scale=SM)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4)


def _mla_case(seed: int):
    """q, kv_c, k_pe, the raw weight and a cache (float32 JAX arrays), the block table and the lengths of a two-request
    batch (2 new tokens after 5 cached, then 3 new) of 4 small heads."""
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    rng = np.random.default_rng(seed)
    ql, cl, bs = [2, 3], [5, 0], 4
    t = sum(ql)
    args = [
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((t, 4, 24), (t, 32), (t, 8), dims.kv_b_proj_shape, (3, bs, 40))
    ]
    return dims, args, jnp.asarray([[2, 0], [-1, -1]], jnp.int32), ql, cl, bs


def test_mla_prefill_eager_and_jit():
    dims, args, table, ql, cl, bs = _mla_case(3)
    plan = mj.build_plan(jnp.asarray(ql), np.asarray(cl), dims=dims, block_size=bs, dtype=jnp.float32)
    targs = [torch.from_dlpack(a) for a in args] + [torch.from_dlpack(table)]
    core_out, core_lse = mla_bridge.mla_prefill(*targs, plan, return_lse=True)
    out = mj.mla_prefill(*args, table, plan)
    assert isinstance(out, jax.Array) and _equal(out, core_out)
    jout, jlse = jax.jit(lambda *a: mj.mla_prefill(*a, plan, return_lse=True))(*args, table)
    assert _equal(jout, core_out) and _equal(jlse, core_lse)


def _callback_outputs(fn, *args) -> list:
    """The number of outputs of each buffer callback in ``fn``'s jaxpr (the XLA custom calls it compiles to)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if "callback" in eqn.primitive.name:
                found.append(len(eqn.outvars))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_mla_prefill_under_jit_writes_an_lse_only_when_asked():
    """Under jax.jit the custom call had an lse output (and the core computed and copied it) even where the caller
    did not ask for it; now the call has ``out`` alone unless ``return_lse=True``, with the same values."""
    dims, args, table, ql, cl, bs = _mla_case(5)
    plan = mj.build_plan(ql, cl, dims=dims, block_size=bs, dtype=jnp.float32)
    core_out, core_lse = mla_bridge.mla_prefill(
        *(torch.from_dlpack(a) for a in args), torch.from_dlpack(table), plan, return_lse=True
    )
    without = lambda *a: mj.mla_prefill(*a, plan)  # noqa: E731
    with_lse = lambda *a: mj.mla_prefill(*a, plan, return_lse=True)  # noqa: E731
    assert _callback_outputs(without, *args, table) == [1]
    assert _callback_outputs(with_lse, *args, table) == [2]
    assert _equal(jax.jit(without)(*args, table), core_out)
    jout, jlse = jax.jit(with_lse)(*args, table)
    assert _equal(jout, core_out) and _equal(jlse, core_lse)


@pytest.mark.parametrize("value", ["no", 1, 0, None])
def test_mla_prefill_return_lse_must_be_a_bool_under_jit_too(value):
    """Eagerly the core refused a non-bool return_lse; under jax.jit (and in sharded_mla_prefill, eagerly too)
    it was taken for its truthiness ("no" returned (out, lse), None returned out)."""
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    rng = np.random.default_rng(3)
    args = [
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((2, 4, 24), (2, 32), (2, 8), dims.kv_b_proj_shape, (1, 4, 40))
    ]
    table = jnp.zeros((1, 1), jnp.int32)
    plan = mj.build_plan([2], [0], dims=dims, block_size=4, dtype=jnp.float32)
    with pytest.raises(TypeError, match="^return_lse must be a bool"):
        mj.mla_prefill(*args, table, plan, return_lse=value)
    with pytest.raises(TypeError, match="^return_lse must be a bool"):
        jax.jit(lambda *a: mj.mla_prefill(*a, plan, return_lse=value))(*args, table)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("heads",))
    plans = mj.build_sharded_plans([2], [0], dims=dims, mesh=mesh, axis="heads", block_size=4, dtype=jnp.float32)
    with pytest.raises(TypeError, match="^return_lse must be a bool"):
        mj.sharded_mla_prefill(*args, table, plans, mesh=mesh, axis="heads", return_lse=value)


@pytest.mark.parametrize("layout", ["identity", "split"])
def test_mla_prefill_with_prepared_weight_eager_and_jit(layout):
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    rng = np.random.default_rng(4)
    ql, cl, bs = [2, 3], [5, 0], 4
    t = sum(ql)
    q, kv_c, k_pe, w, cache = [
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((t, 4, 24), (t, 32), (t, 8), dims.kv_b_proj_shape, (3, bs, 40))
    ]
    table = jnp.asarray([[2, 0], [-1, -1]], jnp.int32)
    plan = mj.build_plan(ql, cl, dims=dims, block_size=bs, dtype=jnp.float32)
    prepared = mj.prepare_kv_b_proj(w, dims, layout=layout)
    assert isinstance(prepared, mla_bridge.PreparedKVBProj) and prepared.layout == layout
    targs = [torch.from_dlpack(a) for a in (q, kv_c, k_pe)]
    core_out, core_lse = mla_bridge.mla_prefill(
        *targs,
        mla_bridge.prepare_kv_b_proj(torch.from_dlpack(w), dims, layout=layout),
        torch.from_dlpack(cache),
        torch.from_dlpack(table),
        plan,
        return_lse=True,
    )
    out = mj.mla_prefill(q, kv_c, k_pe, prepared, cache, table, plan)
    assert _equal(out, core_out)
    jout, jlse = jax.jit(lambda q, c, p, kc, bt: mj.mla_prefill(q, c, p, prepared, kc, bt, plan, return_lse=True))(
        q, kv_c, k_pe, cache, table
    )
    assert _equal(jout, core_out) and _equal(jlse, core_lse)
    if layout == "identity":  # the raw jax weight gives the same bits
        assert _equal(mj.mla_prefill(q, kv_c, k_pe, w, cache, table, plan), core_out)
    with pytest.raises(TypeError, match="traced; prepare the weight once"):
        jax.jit(lambda w: mj.prepare_kv_b_proj(w, dims))(w)


# --------------------------------------------------------------------------------------------------------------
# bad input: clear errors naming the argument, raised before anything runs
# --------------------------------------------------------------------------------------------------------------


def test_non_jax_inputs_are_named():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q must be a jax\.Array.*from_torch"):
        mj.ragged_prefill(torch.from_dlpack(q), k, v, QO, KV, causal=True, sm_scale=SM)
    with pytest.raises(TypeError, match=r"k must be a jax\.Array.*jnp\.asarray"):
        mj.ragged_prefill(q, np.asarray(k), v, QO, KV, causal=True, sm_scale=SM)
    with pytest.raises(TypeError, match=r"v must be a jax\.Array"):
        mj.ragged_prefill(q, k, [1.0], QO, KV, causal=True, sm_scale=SM)


@pytest.mark.parametrize("name", ["qo_indptr", "kv_indptr"])
def test_traced_indptr_is_refused_by_name(name):
    q, k, v = _qkv()

    def f(a, b, c, indptr):
        kw = dict(qo_indptr=QO, kv_indptr=KV)
        kw[name] = indptr
        return mj.ragged_prefill(a, b, c, **kw, causal=True, sm_scale=SM)

    with pytest.raises(TypeError, match=rf"{name} is a traced JAX value.*host"):
        jax.jit(f)(q, k, v, jnp.asarray(QO if name == "qo_indptr" else KV))


def test_traced_lengths_refused_by_build_plan():
    dims = MLADims(num_heads=4)
    with pytest.raises(TypeError, match=r"query_lens is a traced JAX value"):
        jax.jit(lambda n: mj.build_plan(n, dims=dims, block_size=4))(jnp.asarray([1, 2]))
    with pytest.raises(TypeError, match=r"context_lens is a traced JAX value"):
        jax.jit(lambda c: mj.build_plan([1, 2], c, dims=dims, block_size=4))(jnp.asarray([1, 2]))


@pytest.mark.parametrize("delta", [-1, 1])
@pytest.mark.parametrize("jit", [False, True])
def test_off_by_one_rows_raise_before_running(monkeypatch, delta, jit):
    """An off-by-one through the adapter: q has one row more/less than qo_indptr[-1] -> the core's error."""
    spy = _RunSpy(monkeypatch)
    q, k, v = _qkv(t=9 + delta)
    call = lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM)  # noqa: E731
    with pytest.raises(ValueError, match=rf"q has {9 + delta} tokens but qo_indptr\[-1\] = 9"):
        (jax.jit(call) if jit else call)(q, k, v)
    assert all(c["out"] is None for c in spy.calls)  # under jit: raised at trace time, the kernel never ran
    if jit:
        assert spy.calls == []


@pytest.mark.parametrize("jit", [False, True])
def test_core_validation_errors_come_through(jit):
    q, k, v = _qkv()
    wrap = (lambda f: jax.jit(f)) if jit else (lambda f: f)
    with pytest.raises(TypeError, match=r"q, k and v must share one dtype, got q bfloat16, k float32, v bfloat16"):
        wrap(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM))(q, k.astype(jnp.float32), v)
    with pytest.raises(ValueError, match=r"qo_indptr must be non-decreasing"):
        wrap(lambda a, b, c: mj.ragged_prefill(a, b, c, [0, 5, 3, 4, 9], KV, causal=True, sm_scale=SM))(q, k, v)
    with pytest.raises(ValueError, match=r"q, k and v must have the same number of heads \(dim 1\), got q 4, k 2, v 4"):
        wrap(lambda a, b, c: mj.ragged_prefill(a, b[:, :2], c, QO, KV, causal=True, sm_scale=SM))(q, k, v)
    with pytest.raises(ValueError, match=r"q must be 3-D"):
        wrap(lambda a, b, c: mj.ragged_prefill(a[:, 0], b, c, QO, KV, causal=True, sm_scale=SM))(q, k, v)
    with pytest.raises(ValueError, match=r"sm_scale must be a positive"):
        wrap(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=-1.0))(q, k, v)


@pytest.mark.parametrize("jit", [False, True])
def test_mla_prefill_validation_is_the_cores(jit):
    dims = MLADims(num_heads=4)
    plan = mj.build_plan([2], dims=dims, block_size=4, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    args = [
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((2, 4, 192), (2, 500), (2, 64), dims.kv_b_proj_shape, (1, 4, 576))
    ]
    table = jnp.zeros((1, 1), jnp.int32)
    call = lambda *a: mj.mla_prefill(*a, plan)  # noqa: E731
    with pytest.raises(ValueError, match=r"kv_c must be \[T=2, kv_lora_rank=512\], got \[2, 500\]"):
        (jax.jit(call) if jit else call)(*args, table)
    with pytest.raises(TypeError, match=r"block_table must be a jax\.Array"):
        mj.mla_prefill(*args, np.zeros((1, 1), np.int32), plan)
    with pytest.raises(TypeError, match=r"plan must be a mla_bridge\.PrefillPlan"):
        mj.mla_prefill(*args, table, "plan")


def test_run_ragged_wants_a_plan():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"plan must be a mla_bridge\.RaggedPlan"):
        mj.run_ragged(None, q, k, v)


def test_unknown_jit_route():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"jit_route must be one of"):
        jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM, jit_route="x"))(q, k, v)


# --------------------------------------------------------------------------------------------------------------
# transformations
# --------------------------------------------------------------------------------------------------------------


def test_grad_raises_inference_only():
    q, k, v = _qkv(dtype=jnp.float32)
    loss = lambda a: mj.ragged_prefill(a, k, v, QO, KV, causal=True, sm_scale=SM)[0].sum()  # noqa: E731
    with pytest.raises(mj.InferenceOnlyError, match="inference only"):
        jax.grad(loss)(q)
    with pytest.raises(mj.InferenceOnlyError, match="inference only"):
        jax.jit(jax.grad(loss))(q)
    with pytest.raises(mj.InferenceOnlyError, match="inference only"):
        jax.jvp(lambda a: mj.ragged_prefill(a, k, v, QO, KV, causal=True, sm_scale=SM), (q,), (q,))


def test_grad_of_mla_prefill_raises():
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    plan = mj.build_plan([2], dims=dims, block_size=4, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    args = [
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((2, 4, 24), (2, 32), (2, 8), dims.kv_b_proj_shape, (1, 4, 40))
    ]
    table = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(mj.InferenceOnlyError, match="inference only"):
        jax.grad(lambda w: mj.mla_prefill(args[0], args[1], args[2], w, args[4], table, plan).sum())(args[3])


def test_grad_through_other_inputs_still_works():
    """Only a gradient that must flow through the attention is refused; stop_gradient and unrelated inputs work."""
    q, k, v = _qkv(dtype=jnp.float32)
    out, _ = mj.ragged_prefill(q, k, v, QO, KV, causal=True, sm_scale=SM)

    def loss(scale, q):
        o, _ = mj.ragged_prefill(jax.lax.stop_gradient(q), k, v, QO, KV, causal=True, sm_scale=SM)
        return (o * scale).sum()

    g = jax.grad(loss)(2.0, q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(out).sum(), rtol=1e-6)


def test_vmap_runs_each_batch_element():
    qs = jnp.stack([_qkv(seed=s, dtype=jnp.float32)[0] for s in range(3)])
    _, k, v = _qkv(seed=7, dtype=jnp.float32)
    f = lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM)  # noqa: E731
    outs, lses = jax.vmap(f, in_axes=(0, None, None))(qs, k, v)
    jouts, _ = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(qs, k, v)
    assert outs.shape == (3, 9, 4, 128) and lses.shape == (3, 9, 4)
    for i in range(3):
        core_out, core_lse = _core(qs[i], k, v)
        assert _equal(outs[i], core_out) and _equal(lses[i], core_lse) and _equal(jouts[i], core_out)


def test_tvm_ffi_route_is_refused_on_cpu_and_auto_falls_back(monkeypatch):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"jit_route='tvm_ffi' cannot serve this call: needs a CUDA device"):
        jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM, jit_route="tvm_ffi"))(
            q, k, v
        )
    monkeypatch.setenv(mj.ENV_JIT_ROUTE, "auto")
    out, _ = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM))(q, k, v)
    assert _equal(out, _core(q, k, v)[0])


def test_out_of_range_block_table_under_jit_surfaces_the_real_message():
    """Block ids are traced: the core checks them when the call runs, inside XLA's buffer callback. The error used
    to be XLA's prefix, then 12 lines of jax's dispatch stack, then the ValueError on the 13th; now the
    stack is one frame and the message names the call and the argument."""
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    rng = np.random.default_rng(3)
    ql, cl, bs = [2, 3], [5, 0], 4
    t = sum(ql)
    args = [
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((t, 4, 24), (t, 32), (t, 8), dims.kv_b_proj_shape, (3, bs, 40))
    ]
    table = jnp.asarray([[7, 0], [-1, -1]], jnp.int32)  # block 7 of a 3-block cache
    plan = mj.build_plan(ql, cl, dims=dims, block_size=bs, dtype=jnp.float32)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.jit(lambda *a: mj.mla_prefill(*a, plan))(*args, table))
    lines = str(info.value).splitlines()
    assert len(lines) <= 3, lines
    assert lines[-1] == "ValueError: mla_bridge_jax.mla_prefill: block_table row 0 holds block ids outside [0, 3)"
    with pytest.raises(ValueError, match=r"^block_table row 0 holds block ids outside \[0, 3\)"):
        mj.mla_prefill(*args, table, plan)  # eagerly: the core's own error, unchanged


def test_a_bad_jit_route_from_the_environment_is_named(monkeypatch):
    """A bad $MLA_BRIDGE_JAX_JIT_ROUTE was reported as "jit_route must be one of ...", naming an argument the
    caller never gave; the message now names the variable."""
    q, k, v = _qkv()
    monkeypatch.setenv(mj.ENV_JIT_ROUTE, "AUTO")
    with pytest.raises(
        ValueError, match=r"^\$MLA_BRIDGE_JAX_JIT_ROUTE \(jit_route not given\) must be one of .*'AUTO'"
    ):
        mj.ragged_prefill(q, k, v, QO, KV, causal=True, sm_scale=SM)
    with pytest.raises(ValueError, match=r"^\$MLA_BRIDGE_JAX_JIT_ROUTE"):
        jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM))(q, k, v)
    with pytest.raises(ValueError, match=r"^jit_route must be one of .*'x'"):  # the argument wins, and is named
        mj.ragged_prefill(q, k, v, QO, KV, causal=True, sm_scale=SM, jit_route="x")


def test_bad_jit_route_and_deleted_arrays_are_refused_eagerly_too():
    """A bad jit_route was accepted by eager calls (only traced calls checked it); a deleted array gave
    "TypeError: object of type 'NoneType' has no len()"."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="jit_route must be one of"):
        mj.ragged_prefill(q, k, v, QO, KV, causal=True, sm_scale=SM, jit_route="bogus")
    # run_ragged too: its eager call took any jit_route
    plan = mj.plan_ragged(
        QO, KV, num_heads=4, head_dim_qk=192, head_dim_vo=128, causal=True, sm_scale=SM, dtype=q.dtype
    )
    with pytest.raises(ValueError, match="jit_route must be one of"):
        mj.run_ragged(plan, q, k, v, jit_route="bogus")
    gone = jnp.array(q)
    gone.delete()
    with pytest.raises(ValueError, match="q has been deleted"):
        mj.ragged_prefill(gone, k, v, QO, KV, causal=True, sm_scale=SM)


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "2.5"])
def test_a_bad_max_plans_variable_is_refused_by_name(raw, monkeypatch):
    """``$MLA_BRIDGE_JAX_MAX_PLANS`` (read at import): anything but a positive int is refused with the variable
    named. Before, "abc" broke ``import mla_bridge_jax`` with int()'s bare message and 0 / -5 were taken as 1."""
    import subprocess
    import sys

    from mla_bridge.switches import jax_max_plans as max_plans_from_env  # what mla_bridge_jax.tvm_ffi reads

    monkeypatch.setenv("MLA_BRIDGE_JAX_MAX_PLANS", raw)
    with pytest.raises(ValueError, match=r"MLA_BRIDGE_JAX_MAX_PLANS=.*expected a positive int"):
        max_plans_from_env()
    if raw == "abc":  # what a user sees: the import fails naming the variable
        env = dict(os.environ, MLA_BRIDGE_JAX_MAX_PLANS=raw, JAX_PLATFORMS="cpu")
        done = subprocess.run(
            [sys.executable, "-c", "import mla_bridge_jax"], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode != 0 and "MLA_BRIDGE_JAX_MAX_PLANS='abc': expected a positive int" in done.stderr


def test_max_plans_variable_takes_positive_ints_and_defaults(monkeypatch):
    from mla_bridge.switches import jax_max_plans as max_plans_from_env  # what mla_bridge_jax.tvm_ffi reads

    monkeypatch.delenv("MLA_BRIDGE_JAX_MAX_PLANS", raising=False)
    assert max_plans_from_env() == 16 and max_plans_from_env(default=3) == 3
    monkeypatch.setenv("MLA_BRIDGE_JAX_MAX_PLANS", " 4 ")
    assert max_plans_from_env() == 4
    monkeypatch.setenv("MLA_BRIDGE_JAX_MAX_PLANS", "")
    assert max_plans_from_env() == 16


@pytest.mark.parametrize("dtype", [None, "bogus", 3])
def test_a_dtype_that_is_not_one_is_refused_by_name_at_plan_time(dtype):
    """dtype=None planned float64 (numpy reads None as float64), refused only at run time ("q must have dtype
    torch.float64 (the plan's)"); "bogus" raised numpy's "data type 'bogus' not understood", naming no argument."""
    dims = MLADims(
        num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, softmax_scale=0.3
    )
    with pytest.raises(TypeError, match="^dtype must be a JAX, numpy or torch dtype"):
        mj.plan_ragged([0, 2], [0, 2], num_heads=2, head_dim_qk=8, head_dim_vo=8, causal=True, sm_scale=SM, dtype=dtype)
    with pytest.raises(TypeError, match="^dtype must be a JAX, numpy or torch dtype"):
        mj.build_plan([2], [3], dims=dims, block_size=4, dtype=dtype)
    if not isinstance(dtype, (str, type(None))):  # None: the compute dtype; strings are the core's ("fp8", "auto")
        with pytest.raises(TypeError, match="^kv_cache_dtype must be a JAX, numpy or torch dtype"):
            mj.build_plan([2], [3], dims=dims, block_size=4, dtype=jnp.float32, kv_cache_dtype=dtype)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_an_fp8_qkv_dtype_points_at_kv_cache_dtype_eagerly_and_under_jit(name):
    """An FP8 q/k/v was refused as "dtype float8_e4m3fn has no torch counterpart" by plan_ragged and under jit (torch
    has one; the eager call gave the core's reason, which points at kv_cache_dtype)."""
    dt = getattr(jnp, name)
    with pytest.raises(TypeError, match="must be one of bfloat16.*kv_cache_dtype"):
        mj.plan_ragged([0, 2], [0, 2], num_heads=2, head_dim_qk=8, head_dim_vo=8, causal=True, sm_scale=SM, dtype=dt)
    q = jnp.ones((2, 2, 8), jnp.float32).astype(dt)
    with pytest.raises(TypeError, match="must be one of bfloat16.*kv_cache_dtype"):
        jax.jit(lambda a: mj.ragged_prefill(a, a, a, [0, 2], [0, 2], causal=True, sm_scale=SM))(q)


@pytest.mark.parametrize("name", ["float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz"])
def test_a_cache_dtype_torch_lacks_is_a_type_error_naming_kv_cache_dtype(name):
    """build_plan(kv_cache_dtype=jnp.float8_e3m4) raised AttributeError: module 'torch' has no attribute ..."""
    if not hasattr(jnp, name):
        pytest.skip(f"this JAX has no {name}")
    dims = MLADims(
        num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, softmax_scale=0.3
    )
    with pytest.raises(TypeError, match=f"^kv_cache_dtype {name} has no torch counterpart"):
        mj.build_plan([2], [3], dims=dims, block_size=4, dtype=jnp.float32, kv_cache_dtype=getattr(jnp, name))


@pytest.mark.parametrize("device", ["gpu", "tpu:0", "nonsense"])
def test_a_device_torch_cannot_parse_is_refused_by_name(device):
    """A device string torch cannot parse ("gpu" is JAX's platform name): a ValueError naming ``device``. Before,
    torch's own RuntimeError ("Expected one of cpu, cuda, ...") came through."""
    with pytest.raises(ValueError, match=r"^device must be"):
        mj.build_plan([2], [0], dims=MLADims(num_heads=4), block_size=4, dtype=jnp.float32, device=device)


@pytest.mark.parametrize("how", ["eager", "jit", "run_ragged"])
def test_dtype_errors_name_jax_dtypes(how):
    """A k of another dtype than q: a TypeError with the dtypes named as JAX names them ("bfloat16"). Before, the JAX
    user read torch's ("k must have dtype torch.bfloat16 (the plan's), got torch.float32")."""
    import jax

    q, k, v = _qkv()
    k = k.astype(jnp.float32)
    call = {
        "eager": lambda: mj.ragged_prefill(q, k, v, QO, KV, causal=True, sm_scale=0.1),
        "jit": lambda: jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=0.1))(q, k, v),
        "run_ragged": lambda: mj.run_ragged(
            mj.plan_ragged(
                QO,
                KV,
                num_heads=4,
                head_dim_qk=192,
                head_dim_vo=128,
                causal=True,
                sm_scale=0.1,
                dtype=jnp.bfloat16,
                device="cpu",
            ),
            q,
            k,
            v,
        ),
    }[how]
    if how == "run_ragged":
        want = r"^k must have dtype bfloat16 \(the plan's\), got float32\b"
    else:  # the one-shot call plans for q's dtype: all three named rather than blaming k
        want = r"^q, k and v must share one dtype, got q bfloat16, k float32, v bfloat16\b"
    with pytest.raises(TypeError, match=want):
        call()


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_dtype_the_kernels_lack_is_named_as_jax_names_it(how):
    """int32 q, k and v: refused when planning, the dtype named "int32" under jit as eagerly (under jit it read
    "torch.int32": the traced call planned outside the renaming)."""
    import jax

    q, k, v = (x.astype(jnp.int32) for x in _qkv())
    fn = lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=0.1)  # noqa: E731
    with pytest.raises(TypeError, match=r"must be one of bfloat16, .*, got int32\b"):
        (jax.jit(fn) if how == "jit" else fn)(q, k, v)
