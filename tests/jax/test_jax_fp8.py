"""mla_bridge_jax.mla_prefill with an FP8 e4m3 cache (jnp.float8_e4m3fn or a uint8 view) on CPU, eager and jit:
equal to the torch core on the same bytes, DLPack zero-copy, refusals at trace time."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims  # noqa: E402
from mla_bridge.cache import quantize_latent_cache  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402

DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def _inputs(seed=3):
    rng = np.random.default_rng(seed)
    ql, cl, bs = [2, 3], [5, 6], 4
    t = sum(ql)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
            ((t, 4, 24), (t, 32), (t, 8), DIMS.kv_b_proj_shape)]
    latent = torch.from_numpy(rng.standard_normal((5, bs, 40)).astype(np.float32)) * 2
    cache8, scale = quantize_latent_cache(latent)
    table = jnp.asarray([[2, 0], [4, 1]], jnp.int32)
    return ql, cl, bs, args, cache8, float(scale), table


def test_torch_from_dlpack_takes_jax_float8_zero_copy():
    x = jnp.asarray(np.linspace(-3, 3, 64, dtype=np.float32)).astype(jnp.float8_e4m3fn)
    t = torch.from_dlpack(x)
    assert t.dtype == torch.float8_e4m3fn
    assert np.array_equal(np.asarray(x.astype(jnp.float32)), t.float().numpy())
    assert t.data_ptr() == torch.from_dlpack(x).data_ptr()  # a view of JAX's buffer, not a copy


@pytest.mark.parametrize("as_uint8", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_mla_prefill_fp8_eager_and_jit(as_uint8, chunked):
    ql, cl, bs, args, cache8, scale, table = _inputs()
    ws = mla_bridge.Workspace("cpu", chunk_tokens=4 if chunked else 1000)
    plan = mj.build_plan(ql, cl, dims=DIMS, block_size=bs, dtype=jnp.float32, workspace=ws,
                         kv_cache_dtype=jnp.uint8 if as_uint8 else jnp.float8_e4m3fn)
    assert plan.kv_cache_dtype == torch.float8_e4m3fn and plan.fused == (not chunked)
    jcache = jnp.asarray(cache8.view(torch.uint8).numpy())
    if not as_uint8:
        jcache = jax.lax.bitcast_convert_type(jcache, jnp.float8_e4m3fn)
    targs = [torch.from_dlpack(a) for a in args]
    core = mla_bridge.mla_prefill(*targs, cache8, torch.from_dlpack(table), plan, return_lse=True,
                                  kv_cache_scale=scale)
    for s in (scale, jnp.float32(scale), jnp.asarray([scale], jnp.float32)):
        out, lse = mj.mla_prefill(*args, jcache, table, plan, return_lse=True, kv_cache_scale=s)
        assert torch.equal(torch.from_dlpack(out), core[0]) and torch.equal(torch.from_dlpack(lse), core[1])
        f = jax.jit(lambda *a: mj.mla_prefill(*a[:-1], plan, return_lse=True, kv_cache_scale=a[-1]))
        jout, jlse = f(*args, jcache, table, s) if not isinstance(s, float) else \
            jax.jit(lambda *a: mj.mla_prefill(*a, plan, return_lse=True, kv_cache_scale=s))(*args, jcache, table)
        assert torch.equal(torch.from_dlpack(jout), core[0]) and torch.equal(torch.from_dlpack(jlse), core[1])


def test_fp8_refusals_at_trace_time():
    ql, cl, bs, args, cache8, scale, table = _inputs()
    plan = mj.build_plan(ql, cl, dims=DIMS, block_size=bs, dtype=jnp.float32, kv_cache_dtype="fp8")
    jcache = jax.lax.bitcast_convert_type(jnp.asarray(cache8.view(torch.uint8).numpy()), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_scale is required"):
        jax.jit(lambda *a: mj.mla_prefill(*a, plan))(*args, jcache, table)
    with pytest.raises(ValueError, match="finite and > 0"):
        jax.jit(lambda *a: mj.mla_prefill(*a, plan, kv_cache_scale=-1.0))(*args, jcache, table)
    with pytest.raises(TypeError, match="float32 tensor"):
        jax.jit(lambda *a: mj.mla_prefill(*a[:-1], plan, kv_cache_scale=a[-1]))(*args, jcache, table,
                                                                                  jnp.int32(1))
    plan32 = mj.build_plan(ql, cl, dims=DIMS, block_size=bs, dtype=jnp.float32)
    with pytest.raises(TypeError, match="kv_cache_dtype='fp8'"):
        jax.jit(lambda *a: mj.mla_prefill(*a, plan32, kv_cache_scale=scale))(*args, jcache, table)
    with pytest.raises(ValueError, match="not supported"):
        mj.build_plan(ql, cl, dims=DIMS, block_size=bs, dtype=jnp.float32, kv_cache_dtype=jnp.float8_e5m2)
