"""The tvm_ffi route's registry on the CPU without FlashInfer: a stand-in compiled kernel (``out = q[..., :D] +
ws[0]``, lse 0), a plan with only what the registry reads of one, and a jitted call of a registered plan. Used by
tests/jax/test_jax_plan_lifetime.py and by the script it runs in a fresh interpreter."""

from __future__ import annotations

import types
import weakref

import jax
import jax.numpy as jnp
import torch

KERNEL = r"""
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
// out = q[..., :D] + ws[0]; lse = 0.
void stand_in(tvm::ffi::TensorView ws, tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v,
              tvm::ffi::TensorView out, tvm::ffi::TensorView lse) {
  const float* w = static_cast<const float*>(ws.data_ptr());
  const float* qp = static_cast<const float*>(q.data_ptr());
  float* op = static_cast<float*>(out.data_ptr());
  int64_t rows = out.size(0) * out.size(1), d = out.size(2), dq = q.size(2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < d; ++j) op[r * d + j] = qp[r * dq + j] + w[0];
  float* lp = static_cast<float*>(lse.data_ptr());
  for (int64_t r = 0; r < rows; ++r) lp[r] = 0.f;
}
"""


class FakePlan:
    """What the registry needs of a RaggedPlan: its device; "planning" is the value the stand-in adds."""

    made: list = []

    def __init__(self, value: float):
        self.value = value
        self.spec = types.SimpleNamespace(device=torch.device("cpu"))
        FakePlan.made.append(weakref.ref(self))


def call(route, pid):
    out_types = (jax.ShapeDtypeStruct((2, 1, 4), jnp.float32), jax.ShapeDtypeStruct((2, 1), jnp.float32))
    q = jnp.arange(16, dtype=jnp.float32).reshape(2, 1, 8)
    return jax.jit(route.ffi_call(pid, out_types, platform="cpu", name="mla_bridge_jax_test_lifetime_cpu"))(q, q, q)
