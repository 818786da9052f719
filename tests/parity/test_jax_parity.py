"""JAX adapter parity: the same inputs (tests/parity/inputs.py) through the torch core, the JAX adapter (eager and
under jax.jit) and the pure-JAX float32 reference.

* adapter vs core on the same backend: bitwise equal (out and lse);
* core and adapter vs the JAX reference: out within 2e-2 (bf16) / 1e-5 (float32), lse within 1e-2 / 1e-5, with -inf
  exactly where the reference has -inf.
CPU always; the ``gpu`` variants (FlashInfer on CUDA, JAX with CUDA) run on the GPU machine.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims, PrefillPlan, Workspace  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402
from tests.helpers import jax_reference as reference  # noqa: E402

from .inputs import (  # noqa: E402
    DTYPES,
    PREFILL_CASES,
    RAGGED_CASES,
    TOLERANCES,
    prefill_inputs,
    ragged_inputs,
    to_torch,
)

PLATFORMS = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    yield


def _devices(platform: str):
    if platform == "cpu":
        return jax.devices("cpu")[0], torch.device("cpu")
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    return dev, mj._interop.torch_device_of(dev)


def _jax(array: np.ndarray, dtype: str, device) -> jax.Array:
    x = jnp.asarray(array, dtype=dtype) if np.issubdtype(array.dtype, np.floating) else jnp.asarray(array)
    return jax.device_put(x, device)


def _as_torch(x: jax.Array) -> torch.Tensor:
    return torch.from_dlpack(x)


def _assert_bitwise(adapter, core, what: str) -> None:
    a = _as_torch(adapter)
    assert a.shape == core.shape and a.dtype == core.dtype, (what, a.shape, core.shape, a.dtype, core.dtype)
    assert torch.equal(a, core), (
        f"{what}: adapter and core differ (max |diff| "
        f"{(a.double() - core.double()).abs().nan_to_num(0).max().item():.3g})"
    )


def _assert_close_to_reference(out, lse, ref_out, ref_lse, dtype: str, what: str) -> None:
    tol = TOLERANCES[dtype]
    out = np.asarray(_as_torch(out).float().cpu()) if isinstance(out, jax.Array) else out.float().cpu().numpy()
    lse = np.asarray(_as_torch(lse).cpu()) if isinstance(lse, jax.Array) else lse.cpu().numpy()
    ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), f"{what}: NaN"
    assert np.abs(out - ref_out).max(initial=0.0) <= tol["out"], (
        f"{what}: out max |diff| {np.abs(out - ref_out).max():.3g} > {tol['out']}"
    )
    inf = np.isinf(ref_lse)
    assert np.array_equal(np.isinf(lse), inf) and np.array_equal(lse[inf], ref_lse[inf]), f"{what}: lse -inf pattern"
    diff = np.abs(lse[~inf] - ref_lse[~inf]).max(initial=0.0)
    assert diff <= tol["lse"], f"{what}: lse max |diff| {diff:.3g} > {tol['lse']}"


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
def test_ragged_prefill_parity(case, dtype, platform):
    jdev, tdev = _devices(platform)
    x = ragged_inputs(case)
    qo, kv = case.qo_indptr, case.kv_indptr
    kw = dict(causal=case.causal, sm_scale=case.sm_scale)
    tq, tk, tv = (to_torch(x[n], dtype, tdev) for n in ("q", "k", "v"))
    jq, jk, jv = (_jax(x[n], dtype, jdev) for n in ("q", "k", "v"))
    assert torch.equal(_as_torch(jq), tq), "float32 -> dtype rounding differs between torch and JAX"

    core_out, core_lse = mla_bridge.ragged_prefill(tq, tk, tv, qo, kv, **kw)
    eager = mj.ragged_prefill(jq, jk, jv, qo, kv, **kw)
    jitted = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, qo, kv, **kw))(jq, jk, jv)
    ref = jax.jit(functools.partial(reference.ragged_attention, qo_indptr=qo, kv_indptr=kv, **kw))(jq, jk, jv)

    for what, (out, lse) in (("eager", eager), ("jit", jitted)):
        _assert_bitwise(out, core_out, f"{case} {what} out")
        _assert_bitwise(lse, core_lse, f"{case} {what} lse")
    _assert_close_to_reference(core_out, core_lse, *ref, dtype, f"{case} core vs JAX reference")
    _assert_close_to_reference(*jitted, *ref, dtype, f"{case} adapter vs JAX reference")


_MLA_NAMES = ("q", "kv_c", "k_pe", "kv_b_proj_weight", "kv_cache", "block_table")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_mla_prefill_parity(case, dtype, platform):
    jdev, tdev = _devices(platform)
    x = prefill_inputs(case)
    dims = MLADims(num_heads=case.heads)
    tdtype = getattr(torch, dtype)
    plan = PrefillPlan.build(
        case.query_lens,
        case.context_lens,
        dims=dims,
        block_size=case.block_size,
        dtype=tdtype,
        workspace=Workspace(tdev, chunk_tokens=case.chunk_tokens),
    )
    assert plan.fused == case.fused
    targs = [to_torch(x[n], dtype, tdev) for n in _MLA_NAMES]
    jargs = [_jax(x[n], dtype, jdev) for n in _MLA_NAMES]
    core_out, core_lse = mla_bridge.mla_prefill(*targs, plan, return_lse=True)

    jplan = mj.build_plan(
        case.query_lens,
        case.context_lens,
        dims=dims,
        block_size=case.block_size,
        dtype=dtype,
        workspace=Workspace(tdev, chunk_tokens=case.chunk_tokens),
    )
    assert (jplan.fused, len(jplan.chunks)) == (plan.fused, len(plan.chunks))
    eager = mj.mla_prefill(*jargs, jplan, return_lse=True)
    jitted = jax.jit(lambda *a: mj.mla_prefill(*a, jplan, return_lse=True))(*jargs)
    ref = reference.mla_attention(
        *jargs[:5], x["block_table"], case.query_lens, case.context_lens, sm_scale=dims.softmax_scale
    )
    for what, (out, lse) in (("eager", eager), ("jit", jitted)):
        _assert_bitwise(out, core_out, f"{case} {what} out")
        _assert_bitwise(lse, core_lse, f"{case} {what} lse")
    _assert_close_to_reference(core_out, core_lse, *ref, dtype, f"{case} core vs JAX reference")
    _assert_close_to_reference(*jitted, *ref, dtype, f"{case} adapter vs JAX reference")
