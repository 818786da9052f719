"""DLPack across the adapter boundary: views DLPack cannot pass as they are (a last-dim slice
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

SM = 192**-0.5
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


@pytest.mark.parametrize(
    "t", [torch.tensor([2**40, 3]), torch.tensor([1e300, 1.5], dtype=torch.float64)], ids=["int64", "float64"]
)
def test_from_torch_refuses_64_bit_values_jax_would_narrow(t):
    """With JAX's 64-bit types off (its default), DLPack narrows int64 / float64 to 32 bits: 2**40 became 0 and
    1e300 inf, silently. Refused by name; with ``jax_enable_x64`` the values pass unchanged."""
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit types are on in this process")
    with pytest.raises(TypeError, match="jax_enable_x64"):
        mj.from_torch(t)
    with jax.enable_x64(True):
        assert np.array_equal(np.asarray(mj.from_torch(t)), t.numpy())


@pytest.mark.parametrize("entry", ["ragged_prefill", "run_ragged", "mla_prefill"])
def test_eager_calls_order_xla_after_the_torch_work_on_their_views(monkeypatch, entry):
    """DLPack makes torch wait for JAX's writes, nothing makes JAX wait for torch's reads: once an eager call returns,
    its torch views of the inputs are gone and JAX may donate or free them while the queued kernels still read them
    (on the GPU: tests/jax/test_jax_gpu.py). So each eager entry point orders XLA's stream after the torch work it
    queued, on the core's device, after the core call and before returning."""
    from mla_bridge import RaggedPlan
    from mla_bridge_jax import api

    events = []
    monkeypatch.setattr(api, "order_xla_after_torch", lambda device: events.append(("order", device)), raising=False)
    owner, name = {
        "ragged_prefill": (mla_bridge, "ragged_prefill"),
        "run_ragged": (RaggedPlan, "run"),
        "mla_prefill": (mla_bridge, "mla_prefill"),
    }[entry]
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: (events.append("core"), real(*a, **kw))[1])
    if entry == "mla_prefill":
        dims = mla_bridge.MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        rng = np.random.default_rng(3)
        args = [
            jnp.asarray(rng.standard_normal(s), jnp.float32)
            for s in ((5, 4, 24), (5, 32), (5, 8), dims.kv_b_proj_shape, (3, 4, 40))
        ]
        plan = mj.build_plan([2, 3], [5, 0], dims=dims, block_size=4, dtype=jnp.float32)
        mj.mla_prefill(*args, jnp.asarray([[2, 0], [-1, -1]], jnp.int32), plan)
    else:
        q, k, kv = (mj.from_torch(t) for t in _tensors())
        v = k[..., :128]
        if entry == "ragged_prefill":
            mj.ragged_prefill(q, k, v, QO, KV, causal=True, sm_scale=SM)
        else:
            plan = mj.plan_ragged(
                QO, KV, num_heads=H, head_dim_qk=192, head_dim_vo=128, causal=True, sm_scale=SM, dtype=jnp.bfloat16
            )
            mj.run_ragged(plan, q, k, v)
    assert events == ["core", ("order", torch.device("cpu"))]


def test_order_xla_after_torch(monkeypatch):
    """Nothing to order on the CPU (torch's work there has run when the call returns); with JAX's TFRT GPU client,
    which does not launch in stream order, a wait on the host for torch's stream."""
    from mla_bridge_jax import _interop

    monkeypatch.setattr(_interop.jax.dlpack, "from_dlpack", lambda *a, **kw: pytest.fail("no DLPack on the CPU"))
    assert _interop.order_xla_after_torch(torch.device("cpu")) is None
    synced = []

    class Stream:
        def synchronize(self):
            synced.append(True)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setenv("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "1")
    _interop.order_xla_after_torch(torch.device("cuda", 0))
    assert synced == [True]
