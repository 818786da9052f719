"""DLPack across the adapter boundary, issue 6 case 10: views DLPack cannot pass as they are (a last-dim slice
``t[..., :128]``, a transposed tensor, a misaligned pointer) give correct values through one device copy, or a clear
error -- never values read at the wrong strides."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402

SM = 192 ** -0.5
T, H = 6, 4
QO = KV = [0, 2, 6]


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 192, generator=g).to(torch.bfloat16)
    k = torch.randn(T, H, 192, generator=g).to(torch.bfloat16)
    kv = torch.randn(T, H, 192, generator=g).to(torch.bfloat16)  # v is a view of its first 128 dims
    return q, k, kv


def test_to_torch_and_from_torch_are_zero_copy_when_they_can_be():
    x = jnp.arange(T * H * 192, dtype=jnp.float32).reshape(T, H, 192).astype(jnp.bfloat16)
    t = mj.to_torch(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer() and t.dtype == torch.bfloat16 and t.is_contiguous()
    dense = torch.randn(T, H, 128).to(torch.bfloat16)
    y = mj.from_torch(dense)
    assert y.unsafe_buffer_pointer() == dense.data_ptr() and y.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(y.astype(jnp.float32)), dense.float().numpy())


def test_last_dim_slice_is_copied_once_with_right_values():
    _, _, kv = _tensors()
    view = kv[..., :128]
    assert not view.is_contiguous()
    # JAX itself refuses this view (or, should a version take it, it must read the right values):
    try:
        raw = jax.dlpack.from_dlpack(view)
    except Exception as err:  # JAX 0.10: "Only DLPack tensors with trivial (compact) striding are supported"
        assert "strid" in str(err).lower()
    else:
        assert np.array_equal(np.asarray(raw.astype(jnp.float32)), view.float().numpy())
    v = mj.from_torch(view)
    assert v.shape == (T, H, 128)
    assert np.array_equal(np.asarray(v.astype(jnp.float32)), view.float().numpy())
    assert v.unsafe_buffer_pointer() != kv.data_ptr()  # a copy, not an alias at the wrong strides


def test_transposed_tensor_values_are_right_either_way():
    base = torch.randn(H, T, 192).to(torch.bfloat16)
    q_t = base.transpose(0, 1)  # [T, H, 192], not contiguous
    q = mj.from_torch(q_t)
    assert np.array_equal(np.asarray(q.astype(jnp.float32)), q_t.float().numpy())
    # JAX's own DLPack import keeps the transposition as a layout (zero-copy); the adapter's view of it must come
    # back with the right strides.
    raw = jax.dlpack.from_dlpack(q_t)
    assert np.array_equal(np.asarray(raw.astype(jnp.float32)), q_t.float().numpy())
    back = mj.to_torch(raw)
    assert torch.equal(back, q_t)


@pytest.mark.parametrize("jit", [False, True])
def test_attention_on_views_matches_the_core_on_the_same_views(jit):
    q_base, k, kv = _tensors(1)
    q_t = q_base.clone().reshape(H, T, 192).transpose(0, 1)  # some transposed q
    v_view = kv[..., :128]
    core_out, core_lse = mla_bridge.ragged_prefill(q_t, k, v_view, QO, KV, causal=True, sm_scale=SM)
    call = lambda a, b, c: mj.ragged_prefill(a, b, c, QO, KV, causal=True, sm_scale=SM)  # noqa: E731
    fn = jax.jit(call) if jit else call
    for q in (mj.from_torch(q_t), jax.dlpack.from_dlpack(q_t)):  # copied to row-major / JAX layout view
        out, lse = fn(q, mj.from_torch(k), mj.from_torch(v_view))
        assert torch.equal(torch.from_dlpack(out), core_out) and torch.equal(torch.from_dlpack(lse), core_lse)


def test_misaligned_pointer_is_copied():
    flat = torch.randn(T * H * 128 + 1).to(torch.bfloat16)
    view = flat[1:].view(T, H, 128)  # contiguous, but the data pointer is 2 bytes off 16-byte alignment
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    y = mj.from_torch(view)
    assert y.unsafe_buffer_pointer() % 16 == 0
    assert np.array_equal(np.asarray(y.astype(jnp.float32)), view.float().numpy())


def test_from_torch_wants_a_tensor():
    with pytest.raises(TypeError, match="from_torch expects a torch.Tensor"):
        mj.from_torch(np.zeros(3))
