"""sharded_mla_prefill: heads split over 2 and 4 forced CPU devices equal the single-device mla_prefill, dense and
sparse (topk_indices) (on the CPU; the same on several GPUs has not been run). XLA_FLAGS must be set before JAX
starts: each check runs in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

SCRIPT = textwrap.dedent("""
    import os, sys
    n = int(sys.argv[1])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    import numpy as np, jax, jax.numpy as jnp, torch
    torch.set_num_threads(1)
    from jax.sharding import Mesh
    import mla_bridge_jax as mj
    from mla_bridge import MLADims, Workspace

    assert len(jax.devices()) == n, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("heads",))
    dims = MLADims(num_heads=8, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   softmax_scale=0.2)
    ql, cl, bs = [5, 0, 7], [20, 9, 0], 4
    rng = np.random.default_rng(0)
    t, nb = sum(ql), sum(-(-c // bs) for c in cl) + 2
    q = jnp.asarray(rng.standard_normal((t, 8, 24)), jnp.float32)
    kv_c = jnp.asarray(rng.standard_normal((t, 32)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((t, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(dims.kv_b_proj_shape) * 0.2, jnp.float32)
    cache = jnp.asarray(rng.standard_normal((nb, bs, 40)), jnp.float32)
    table = np.full((3, 6), -1, np.int32)
    perm, i = rng.permutation(nb), 0
    for r, c in enumerate(cl):
        for b in range(-(-c // bs)):
            table[r, b] = perm[i]; i += 1
    table = jnp.asarray(table)
    for chunk in (4096, 8):  # fused, then chunked (merges)
        full = mj.build_plan(ql, cl, dims=dims, block_size=bs, dtype=jnp.float32,
                             workspace=Workspace("cpu", chunk_tokens=chunk))
        want_out, want_lse = mj.mla_prefill(q, kv_c, k_pe, w, cache, table, full, return_lse=True)
        plans = mj.build_sharded_plans(ql, cl, dims=dims, mesh=mesh, axis="heads", block_size=bs,
                                       dtype=jnp.float32, chunk_tokens=chunk)
        assert [p.dims.num_heads for p in plans.values()] == [8 // n] and full.fused == (chunk == 4096)
        run = lambda *a: mj.sharded_mla_prefill(*a, plans, mesh=mesh, axis="heads", return_lse=True)
        for name, (out, lse) in (("eager", run(q, kv_c, k_pe, w, cache, table)),
                                 ("jit", jax.jit(run)(q, kv_c, k_pe, w, cache, table))):
            assert len(out.sharding.device_set) == n, (name, out.sharding)
            assert {s.data.shape for s in out.addressable_shards} == {(t, 8 // n, 16)}
            np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6, err_msg=name)
        # without return_lse: out alone (the shard_map has one output), the same values
        run = lambda *a: mj.sharded_mla_prefill(*a, plans, mesh=mesh, axis="heads")
        for name, out in (("eager", run(q, kv_c, k_pe, w, cache, table)),
                          ("jit", jax.jit(run)(q, kv_c, k_pe, w, cache, table))):
            assert isinstance(out, jax.Array) and len(out.sharding.device_set) == n, (name, type(out))
            np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-6, err_msg=name)
    # sparse attention: the same indices (replicated) on every device, plans built with index_topk
    own = [c + j for q_len, c in zip(ql, cl) for j in range(q_len)]
    idx = np.full((t, 6), -1, np.int32)
    for i, o in enumerate(own):
        m = min(6, o + 1) - i % 2  # every other row padded with -1 (the first token of request 2: no key)
        idx[i, :m] = rng.permutation(o + 1)[:m]
    idx = jnp.asarray(idx)
    full = mj.build_plan(ql, cl, dims=dims, block_size=bs, dtype=jnp.float32, index_topk=6)
    want_out, want_lse = mj.mla_prefill(q, kv_c, k_pe, w, cache, table, full, return_lse=True, topk_indices=idx)
    plans = mj.build_sharded_plans(ql, cl, dims=dims, mesh=mesh, axis="heads", block_size=bs, dtype=jnp.float32,
                                   index_topk=6)
    assert [p.index_topk for p in plans.values()] == [6]
    run = lambda *a: mj.sharded_mla_prefill(*a[:6], plans, mesh=mesh, axis="heads", return_lse=True,
                                            topk_indices=a[6])
    for name, (out, lse) in (("sparse eager", run(q, kv_c, k_pe, w, cache, table, idx)),
                             ("sparse jit", jax.jit(run)(q, kv_c, k_pe, w, cache, table, idx))):
        assert len(out.sharding.device_set) == n, (name, out.sharding)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.isneginf(np.asarray(want_lse)[5]).all()  # the row without keys
    try:
        mj.sharded_mla_prefill(q, kv_c, k_pe, mj.prepare_kv_b_proj(w, dims), cache, table, plans, mesh=mesh,
                               axis="heads")
        raise SystemExit("a prepared weight was accepted")
    except TypeError as err:
        assert "raw kv_b_proj_weight" in str(err)
    # one plan of all H heads where per-device plans belong: named as plans (it was a q shape error from inside)
    for wrong, kind in ((full, TypeError), ({torch.device("cpu"): full}, ValueError)):
        try:
            mj.sharded_mla_prefill(q, kv_c, k_pe, w, cache, table, wrong, mesh=mesh, axis="heads")
            raise SystemExit("a plan of all heads was accepted")
        except kind as err:
            assert str(err).startswith("plans must be"), err
            assert kind is TypeError or f"H / {n} = {8 // n} heads per device" in str(err), err
    print("OK", n)
""")


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_mla_prefill_equals_one_device(n, tmp_path):
    script = tmp_path / "sharded_mla.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, str(script), str(n)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0 and f"OK {n}" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
