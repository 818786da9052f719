"""Sparse attention through the JAX adapter on a CUDA GPU: ``mla_bridge_jax.mla_prefill(..., topk_indices=)``
eagerly (DLPack views, the core's sparse pass on torch's stream) and under ``jax.jit`` (the buffer_callback route on
XLA's stream), at DeepSeek-V2-Lite dims, bf16 and FP8 caches:
* both bitwise equal to the torch core's ``mla_prefill`` on CUDA with the same inputs (whichever sparse implementation
  the core chooses there), and close to the core's CPU float32 call (itself checked against float64 in
  tests/test_sparse.py) at bf16 tolerances;
* indices produced inside the same jitted function (``jax.lax.top_k`` over causally masked scores, as an indexer
  would) are read after XLA wrote them.

Marked ``gpu``: skipped without CUDA (and without JAX's GPU backend). Run on the GPU machine:
    .venv/bin/python -m pytest tests/jax/test_jax_gpu_sparse.py -q -m gpu
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims, Workspace, quantize_latent_cache  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402
from mla_bridge_jax._interop import torch_device_of  # noqa: E402
from tests.helpers.reference import make_mla_batch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DIMS = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# a request longer than K (sparse for real), one without context, one shorter than K (rows padded with -1)
QUERY_LENS, CONTEXT_LENS, BLOCK, K = [300, 1, 77], [1000, 0, 64], 64, 256
OUT_TOL, LSE_TOL = 2e-2, 1e-2


@pytest.fixture(scope="module")
def gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


def causal_indices(seed: int, fill: float = 0.8) -> np.ndarray:
    """int32 [T, K]: per new token ``fill`` of min(K, own + 1) distinct causal picks (at least one) at shuffled places,
    -1 elsewhere."""
    rng = np.random.default_rng(seed)
    rows = []
    for q, c in zip(QUERY_LENS, CONTEXT_LENS):
        for j in range(q):
            own = c + j
            m = max(1, int(min(K, own + 1) * fill))
            row = np.full(K, -1, np.int32)
            row[rng.permutation(K)[:m]] = rng.permutation(own + 1)[:m]
            rows.append(row)
    return np.stack(rows)


def as_jax(x: torch.Tensor) -> jax.Array:
    """A CPU tensor as a JAX array of the same values (FP8 through its bytes)."""
    if x.dtype == torch.float8_e4m3fn:
        return jax.lax.bitcast_convert_type(jnp.asarray(x.view(torch.uint8).numpy()), jnp.float8_e4m3fn)
    return mj.from_torch(x)


def inputs(gpu, fp8: bool, seed: int = 0):
    """(torch CUDA tensors of the six inputs, the same as JAX arrays on ``gpu`` (XLA's own buffers), the scale, the
    torch CPU float32 inputs): values that are bf16 numbers, the cache FP8 e4m3 with a per-tensor scale when ``fp8``."""
    batch = make_mla_batch(DIMS, QUERY_LENS, CONTEXT_LENS, BLOCK, dtype=torch.bfloat16, seed=seed)
    cache, scale = batch.cache, None
    if fp8:
        cache, s = quantize_latent_cache(batch.cache)
        scale = float(s)
    host = [batch.q, batch.kv_c, batch.k_pe, batch.w, cache, batch.block_table]
    arrays = [jax.device_put(as_jax(x), gpu) for x in host]
    dev = torch_device_of(gpu)
    cpu = [x.float() for x in host[:4]] + [cache if fp8 else cache.float(), batch.block_table]
    return [x.to(dev) for x in host], arrays, scale, cpu, dev


def plan_for(dev, dtype, fp8: bool):
    return mj.build_plan(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=DIMS,
        block_size=BLOCK,
        dtype=dtype,
        device=dev,
        workspace=Workspace(dev),
        kv_cache_dtype="fp8" if fp8 else None,
        index_topk=K,
    )


def same_bits(jx, tx) -> bool:
    return torch.equal(torch.from_dlpack(jx), tx)


@pytest.mark.parametrize("fp8", [False, True])
def test_eager_and_jit_equal_the_core_on_gpu(gpu, fp8):
    tensors, arrays, scale, cpu, dev = inputs(gpu, fp8, seed=int(fp8))
    plan = plan_for(dev, jnp.bfloat16, fp8)
    idx = causal_indices(seed=1)
    t_idx, j_idx = torch.from_numpy(idx).to(dev), jax.device_put(jnp.asarray(idx), gpu)
    want_out, want_lse = mla_bridge.mla_prefill(
        *tensors, plan, return_lse=True, kv_cache_scale=scale, topk_indices=t_idx
    )
    out, lse = mj.mla_prefill(*arrays, plan, return_lse=True, kv_cache_scale=scale, topk_indices=j_idx)
    assert out.devices() == {gpu}
    assert same_bits(out, want_out) and same_bits(lse, want_lse)
    jitted = jax.jit(lambda *a: mj.mla_prefill(*a[:6], plan, return_lse=True, kv_cache_scale=scale, topk_indices=a[6]))
    jout, jlse = jitted(*arrays, j_idx)
    assert same_bits(jout, want_out) and same_bits(jlse, want_lse)
    # the values: the core's CPU float32 call on the same (bf16-valued) inputs
    cpu_plan = mj.build_plan(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=DIMS,
        block_size=BLOCK,
        dtype=jnp.float32,
        device="cpu",
        kv_cache_dtype="fp8" if fp8 else None,
        index_topk=K,
    )
    exp_out, exp_lse = mla_bridge.mla_prefill(
        *cpu, cpu_plan, return_lse=True, kv_cache_scale=scale, topk_indices=torch.from_numpy(idx)
    )
    torch.testing.assert_close(torch.from_dlpack(jout).float().cpu(), exp_out, atol=OUT_TOL, rtol=OUT_TOL)
    torch.testing.assert_close(torch.from_dlpack(jlse).cpu(), exp_lse, atol=LSE_TOL, rtol=0)


def test_indices_made_in_the_same_jit_are_read_after_xla_wrote_them(gpu):
    """The indices come out of ``jax.lax.top_k`` inside the jitted function (causally masked random scores, -1 where
    fewer than K keys exist): the callback runs on XLA's stream after them, and with the same indices the torch core
    gives the same bits."""
    tensors, arrays, _, _, dev = inputs(gpu, fp8=False, seed=2)
    plan = plan_for(dev, jnp.bfloat16, fp8=False)
    own = np.concatenate([c + np.arange(q) for q, c in zip(QUERY_LENS, CONTEXT_LENS)])
    span = max(q + c for q, c in zip(QUERY_LENS, CONTEXT_LENS))
    visible = jax.device_put(jnp.asarray(np.arange(span)[None, :] <= own[:, None]), gpu)

    @jax.jit
    def layer(key, *a):
        scores = jnp.where(visible, jax.random.uniform(key, visible.shape), -jnp.inf)
        vals, picks = jax.lax.top_k(scores, K)
        picks = jnp.where(jnp.isfinite(vals), picks, -1).astype(jnp.int32)
        return mj.mla_prefill(*a, plan, return_lse=True, topk_indices=picks), picks

    (out, lse), picks = layer(jax.random.key(7), *arrays)
    got = np.array(picks)  # a writable copy (torch.from_numpy below)
    assert (got <= own[:, None]).all() and (got >= -1).all()
    assert sorted(got[300]) == [-1] * (K - 1) + [0]  # request 1's only token sees one key: itself
    want_out, want_lse = mla_bridge.mla_prefill(
        *tensors, plan, return_lse=True, topk_indices=torch.from_numpy(got).to(dev)
    )
    assert same_bits(out, want_out) and same_bits(lse, want_lse)
