"""mla_bridge_jax.mla_prefill with an FP8 e4m3 cache (jnp.float8_e4m3fn or a uint8 view) on CPU, eager and jit:
equal to the torch core on the same bytes, DLPack zero-copy, refusals at trace time."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims, Workspace  # noqa: E402
from mla_bridge.cache import quantize_latent_cache  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402

DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def _inputs(seed=3):
    rng = np.random.default_rng(seed)
    ql, cl, bs = [2, 3], [5, 6], 4
    t = sum(ql)
    args = [
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((t, 4, 24), (t, 32), (t, 8), DIMS.kv_b_proj_shape)
    ]
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
    plan = mj.build_plan(
        ql,
        cl,
        dims=DIMS,
        block_size=bs,
        dtype=jnp.float32,
        workspace=ws,
        kv_cache_dtype=jnp.uint8 if as_uint8 else jnp.float8_e4m3fn,
    )
    assert plan.kv_cache_dtype == torch.float8_e4m3fn and plan.fused == (not chunked)
    jcache = jnp.asarray(cache8.view(torch.uint8).numpy())
    if not as_uint8:
        jcache = jax.lax.bitcast_convert_type(jcache, jnp.float8_e4m3fn)
    targs = [torch.from_dlpack(a) for a in args]
    core = mla_bridge.mla_prefill(*targs, cache8, torch.from_dlpack(table), plan, return_lse=True, kv_cache_scale=scale)
    for s in (scale, jnp.float32(scale), jnp.asarray([scale], jnp.float32)):
        out, lse = mj.mla_prefill(*args, jcache, table, plan, return_lse=True, kv_cache_scale=s)
        assert torch.equal(torch.from_dlpack(out), core[0]) and torch.equal(torch.from_dlpack(lse), core[1])
        f = jax.jit(lambda *a: mj.mla_prefill(*a[:-1], plan, return_lse=True, kv_cache_scale=a[-1]))
        jout, jlse = (
            f(*args, jcache, table, s)
            if not isinstance(s, float)
            else jax.jit(lambda *a: mj.mla_prefill(*a, plan, return_lse=True, kv_cache_scale=s))(*args, jcache, table)
        )
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
        jax.jit(lambda *a: mj.mla_prefill(*a[:-1], plan, kv_cache_scale=a[-1]))(*args, jcache, table, jnp.int32(1))
    plan32 = mj.build_plan(ql, cl, dims=DIMS, block_size=bs, dtype=jnp.float32)
    with pytest.raises(TypeError, match="kv_cache_dtype='fp8'"):
        jax.jit(lambda *a: mj.mla_prefill(*a, plan32, kv_cache_scale=scale))(*args, jcache, table)
    with pytest.raises(ValueError, match="not supported"):
        mj.build_plan(ql, cl, dims=DIMS, block_size=bs, dtype=jnp.float32, kv_cache_dtype=jnp.float8_e5m2)


# ---------------------------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("as_uint8", [False, True])
def test_mla_prefill_fp8_on_gpu_zero_copy_eager_and_jit(as_uint8, monkeypatch):
    """On the GPU: the FP8 cache reaches the core without a copy (same pointer), eager and jit (scale as a device
    array) bitwise equal to the torch core on the same bytes, fused and chunked."""
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    dims = MLADims.deepseek_v2_lite()
    ql, cl, bs = [37, 0, 5], [100, 64, 0], 16
    rng = np.random.default_rng(0)
    t = sum(ql)
    nb = sum(-(-c // bs) for c in cl) + 1
    host = [rng.standard_normal(s).astype(np.float32) for s in ((t, 16, 192), (t, 512), (t, 64), dims.kv_b_proj_shape)]
    host[3] *= 512**-0.5
    cache8, scale = quantize_latent_cache(torch.from_numpy(rng.standard_normal((nb, bs, 576)).astype(np.float32)))
    table = np.full((3, 8), -1, np.int32)
    perm, i = rng.permutation(nb), 0
    for r, c in enumerate(cl):
        for b in range(-(-c // bs)):
            table[r, b] = perm[i]
            i += 1
    args = [jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu) for x in host]
    jcache = jax.device_put(jnp.asarray(cache8.view(torch.uint8).numpy()), gpu)
    if not as_uint8:
        jcache = jax.lax.bitcast_convert_type(jcache, jnp.float8_e4m3fn)
    jtable = jax.device_put(table, gpu)
    jscale = jax.device_put(jnp.float32(float(scale)), gpu)
    dev = mj._interop.torch_device_of(gpu)
    seen = {}
    orig = mla_bridge.mla_prefill

    def spy(*a, **kw):
        seen["cache"] = a[4].data_ptr()
        return orig(*a, **kw)

    for chunk in (4096, 64):
        plan = mj.build_plan(
            ql,
            cl,
            dims=dims,
            block_size=bs,
            dtype=jnp.bfloat16,
            kv_cache_dtype="fp8",
            workspace=Workspace(dev, chunk_tokens=chunk),
        )
        core = orig(
            *(torch.from_dlpack(a) for a in args),
            torch.from_dlpack(jcache),
            torch.from_dlpack(jtable),
            plan,
            return_lse=True,
            kv_cache_scale=torch.from_dlpack(jscale),
        )
        monkeypatch.setattr(mla_bridge, "mla_prefill", spy)
        out, lse = mj.mla_prefill(*args, jcache, jtable, plan, return_lse=True, kv_cache_scale=jscale)
        monkeypatch.setattr(mla_bridge, "mla_prefill", orig)
        assert seen["cache"] == jcache.unsafe_buffer_pointer()
        assert torch.equal(torch.from_dlpack(out), core[0]) and torch.equal(torch.from_dlpack(lse), core[1])
        f = jax.jit(lambda *a: mj.mla_prefill(*a[:-1], plan, return_lse=True, kv_cache_scale=a[-1]))
        jout, jlse = f(*args, jcache, jtable, jscale)
        assert torch.equal(torch.from_dlpack(jout), core[0]) and torch.equal(torch.from_dlpack(jlse), core[1])
