"""Heads sharded across 4 (forced host) CPU devices with shard_map equal the single-device call.

XLA_FLAGS must be set before JAX starts, so the check runs in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np, jax, jax.numpy as jnp, torch
    torch.set_num_threads(1)
    from jax.sharding import Mesh, PartitionSpec as P
    import mla_bridge_jax as mj

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("heads",))
    qo, kv = [0, 3, 3, 4, 9], [0, 5, 5, 6, 11]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((9, 16, 192)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((11, 16, 192)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((11, 16, 128)), jnp.bfloat16)
    single = mj.ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=192 ** -0.5)
    sharded = lambda a, b, c: mj.sharded_ragged_prefill(a, b, c, qo, kv, mesh=mesh, axis="heads", causal=True,
                                                          sm_scale=192 ** -0.5)
    for name, (out, lse) in (("eager", sharded(q, k, v)), ("jit", jax.jit(sharded)(q, k, v))):
        want_out, want_lse = mj.head_shardings(mesh, "heads")
        assert out.sharding.is_equivalent_to(want_out, 3), (name, out.sharding)
        assert lse.sharding.is_equivalent_to(want_lse, 2), (name, lse.sharding)
        assert len(out.sharding.device_set) == 4
        shards = {s.device.id: s.data.shape for s in out.addressable_shards}
        assert shards == {i: (9, 4, 128) for i in range(4)}, shards
        assert np.array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(single[0].astype(jnp.float32))), name
        assert np.array_equal(np.asarray(lse), np.asarray(single[1])), name
    try:
        mj.ragged_prefill(jax.device_put(q, jax.sharding.NamedSharding(mesh, P(None, "heads", None))), k, v, qo, kv,
                          causal=True, sm_scale=0.1)
    except ValueError as err:
        assert "q is spread over 4 devices" in str(err), err
    else:
        raise AssertionError("a sharded array passed to the eager call must be refused")
    try:
        mj.sharded_ragged_prefill(q[:, :6], k[:, :6], v[:, :6], qo, kv, mesh=mesh, axis="heads", causal=True,
                                  sm_scale=0.1)
    except ValueError as err:
        assert "divisible" in str(err), err
    else:
        raise AssertionError("6 heads over 4 devices must be refused")
    print("OK")
""")


def test_head_sharding_matches_single_device(repo_root):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([repo_root, os.path.join(repo_root, "adapters"), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr


def test_an_axis_the_mesh_lacks_is_named_with_the_mesh_axes():
    """Was a bare ``KeyError: 'dp'``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import mla_bridge_jax as mj

    mesh = Mesh(np.array(jax.devices()[:1]), ("heads",))
    q = jnp.zeros((4, 4, 192), jnp.bfloat16)
    k = jnp.zeros((4, 4, 192), jnp.bfloat16)
    v = jnp.zeros((4, 4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"axis 'dp' is not an axis of the mesh; its axes are \['heads'\]"):
        mj.sharded_ragged_prefill(q, k, v, [0, 4], [0, 4], mesh=mesh, axis="dp", causal=True, sm_scale=0.1)


def test_a_mesh_that_is_not_a_mesh_is_refused_by_name():
    """``mesh=None`` (anything not a ``jax.sharding.Mesh``): a TypeError naming ``mesh``, before any work. Before, an
    AttributeError ('NoneType' object has no attribute 'shape')."""
    import jax.numpy as jnp

    import mla_bridge_jax as mj
    from mla_bridge import MLADims

    q = jnp.zeros((4, 4, 192), jnp.bfloat16)
    with pytest.raises(TypeError, match=r"^mesh must be a jax.sharding.Mesh, got NoneType"):
        mj.sharded_ragged_prefill(
            q, q, q[..., :128], [0, 4], [0, 4], mesh=None, axis="heads", causal=True, sm_scale=0.1
        )
    with pytest.raises(TypeError, match=r"^mesh must be a jax.sharding.Mesh, got NoneType"):
        mj.build_sharded_plans([4], dims=MLADims(num_heads=4), mesh=None, axis="heads", block_size=4)
