"""The tvm_ffi jit route's machinery on CPU: the C++ shim substitutes XLA's buffers into a recorded argument list and
calls a compiled TVM-FFI function (here a stand-in kernel with FlashInfer's argument kinds) with no Python in the
call; the recorder clones FlashInfer's Python ragged_run with a recording compiled function. Needs jax-tvm-ffi and a
C++ compiler (skipped otherwise); FlashInfer itself is exercised by the GPU tests."""

from __future__ import annotations

import types

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
tvm_ffi = pytest.importorskip("tvm_ffi")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from mla_bridge.backends.flashinfer_internals import compiled_call  # noqa: E402
from mla_bridge_jax import tvm_ffi as route  # noqa: E402

KERNEL = r"""
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
// FlashInfer's ragged_run argument kinds: workspace tensor, plan info (Array<int64>), q, k, v, out, optional lse,
// flags, floats. out = q[..., :D] * scale + ws[0] + k[0]; lse = len(info) + 100 * flag.
void stand_in(tvm::ffi::TensorView ws, tvm::ffi::Array<int64_t> info, tvm::ffi::TensorView q, tvm::ffi::TensorView k,
              tvm::ffi::TensorView v, tvm::ffi::TensorView out, tvm::ffi::Optional<tvm::ffi::TensorView> lse,
              bool flag, double scale) {
  const float* w = static_cast<const float*>(ws.data_ptr());
  const float* qp = static_cast<const float*>(q.data_ptr());
  const float* kp = static_cast<const float*>(k.data_ptr());
  float* op = static_cast<float*>(out.data_ptr());
  int64_t rows = out.size(0) * out.size(1), d = out.size(2), dq = q.size(2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < d; ++j) op[r * d + j] = qp[r * dq + j] * scale + w[0] + kp[0];
  float* lp = static_cast<float*>(lse.value().data_ptr());
  for (int64_t r = 0; r < rows; ++r) lp[r] = static_cast<float>(info.size()) + (flag ? 100.f : 0.f);
}
"""


@pytest.fixture(scope="module")
def stand_in():
    try:
        return tvm_ffi.cpp.load_inline(name="mla_bridge_jax_test_stand_in", cpp_sources=KERNEL, functions=["stand_in"])
    except Exception as err:  # noqa: BLE001 - no compiler
        pytest.skip(f"cannot build a TVM-FFI module here: {err}")


def test_shim_runs_compiled_function_under_jit(stand_in):
    ws = torch.full((4,), 10.0)
    pid = route.set_entry(
        stand_in.stand_in,
        [ws, [1, 2, 3], None, None, None, None, None, True, 0.5],
        [2, 3, 4, 5, 6],
        torch.device("cpu"),
    )
    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    q, k = jnp.asarray(x), jnp.asarray(x + 1)
    out_types = (jax.ShapeDtypeStruct((2, 3, 4), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32))
    call = route.ffi_call(pid, out_types, platform="cpu", name="mla_bridge_jax_test_cpu")
    for fn in (call, jax.jit(call)):
        out, lse = fn(q, k, q)
        np.testing.assert_array_equal(np.asarray(out), x[..., :4] * 0.5 + 10 + 1)
        np.testing.assert_array_equal(np.asarray(lse), np.full((2, 3), 103.0, np.float32))
    route.shim().drop_plan(pid)
    with pytest.raises(Exception, match=rf"plan {pid} was released"):
        jax.block_until_ready(call(q, k, q))


def test_shim_refuses_another_device(stand_in):
    pid = route.set_entry(
        stand_in.stand_in,
        [torch.zeros(1), [], None, None, None, None, None, False, 1.0],
        [2, 3, 4, 5, 6],
        torch.device("cuda", 3),
    )
    q = jnp.zeros((1, 1, 8), jnp.float32)
    out_types = (jax.ShapeDtypeStruct((1, 1, 4), jnp.float32), jax.ShapeDtypeStruct((1, 1), jnp.float32))
    with pytest.raises(Exception, match="was made for device 3"):
        jax.block_until_ready(route.ffi_call(pid, out_types, platform="cpu", name="mla_bridge_jax_test_cpu")(q, q, q))
    route.shim().drop_plan(pid)


def _flashinfer_like_module(compiled):
    """The shape of FlashInfer 0.7's get_batch_prefill_module: ragged_run reorders its arguments for the compiled
    ragged_run_func it closes over."""
    backend = "fa3"
    ragged_run_func = compiled

    def ragged_run(
        ws, iws, info, q, k, v, qo, kv, o, lse, mask_mode, layout, window_left, enable_pdl, logits_soft_cap, sm_scale
    ):
        if backend == "fa3":
            ragged_run_func(
                ws,
                iws,
                info,
                q,
                k,
                v,
                qo,
                kv,
                o,
                lse,
                mask_mode,
                layout,
                window_left,
                enable_pdl,
                None,
                logits_soft_cap,
                sm_scale,
                1.0,
            )
        return o

    return types.SimpleNamespace(ragged_run=ragged_run)


def test_recorder_clones_ragged_run_without_touching_it():
    launched = []
    module = _flashinfer_like_module(lambda *a: launched.append(a))
    q, out = object(), object()
    compiled, args = compiled_call(
        module.ragged_run, ["ws", "iws", [7], q, "k", "v", "qo", "kv", out, "lse", 1, 0, -1, False, 0.0, 0.25]
    )
    assert launched == []  # the real compiled function never ran
    assert args[3] is q and args[8] is out and args[-3:] == [0.0, 0.25, 1.0] and len(args) == 18
    compiled("x")
    assert launched == [("x",)]  # and it is the one FlashInfer closes over
    module.ragged_run("ws", "iws", [7], q, "k", "v", "qo", "kv", out, "lse", 1, 0, -1, False, 0.0, 0.25)
    assert len(launched) == 2  # the original is untouched


def test_why_not_on_cpu_plans():
    import mla_bridge

    plan = mla_bridge.plan_ragged(
        [0, 2],
        [0, 2],
        num_heads=1,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=True,
        sm_scale=0.1,
        dtype=torch.bfloat16,
        workspace=mla_bridge.Workspace("cpu"),
    )
    assert "CUDA" in route.why_not(plan)
    assert "RaggedPlan" in route.why_not(object())
