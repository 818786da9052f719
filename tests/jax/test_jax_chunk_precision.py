"""mla_bridge_jax.mla_prefill in bf16 on the CPU: the error against float64 does not grow with the number of context
chunks (the adapter runs the core's mla_prefill, whose merges carry a row merged more than once in float32)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from mla_bridge import MLADims, Workspace  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402


def _jax(x: torch.Tensor, dtype) -> jax.Array:
    return jnp.asarray(x.float().numpy() if x.is_floating_point() else x.numpy(), dtype)


def test_bf16_error_does_not_grow_with_the_chunk_count():
    """32 new + 512 cached tokens, 4 heads: at 4-token chunks (128 merges of the same rows), eagerly and under
    jax.jit, the error is at most 1.5x the fused schedule's or 2**-8 x max |reference| (1.5e-3 against 1.4e-3 fused;
    before, 9.7e-3)."""
    from tests.helpers.reference import make_mla_batch, mla_reference

    dims = MLADims(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    batch = make_mla_batch(dims, [32], [512], 16, dtype=torch.bfloat16, seed=3)
    ref_out = mla_reference(batch)[0].numpy()
    args = [_jax(x, jnp.bfloat16) for x in (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache)]
    table = _jax(batch.block_table, jnp.int32)
    errs = {}
    for name, chunk_tokens, fuse in (("fused", 100_000, True), ("chunked", 4, False)):
        plan = mj.build_plan(
            [32],
            [512],
            dims=dims,
            block_size=16,
            fuse_context=fuse,
            workspace=Workspace("cpu", chunk_tokens=chunk_tokens),
        )
        assert plan.fused == fuse and len(plan.chunks) == (0 if fuse else 128)
        out = np.asarray(mj.mla_prefill(*args, table, plan).astype(jnp.float32), np.float64)
        jitted = jax.jit(lambda *a: mj.mla_prefill(*a, plan))(*args, table)
        assert np.array_equal(np.asarray(jitted.astype(jnp.float32)), out.astype(np.float32))
        errs[name] = float(np.abs(out - ref_out).max())
    bound = max(1.5 * errs["fused"], 2.0**-8 * float(np.abs(ref_out).max()))
    assert errs["chunked"] <= bound, (errs, bound)
