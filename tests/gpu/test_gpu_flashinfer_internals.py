"""The contract of :mod:`mla_bridge.backends.flashinfer_internals` with the installed FlashInfer, on a GPU.

Marked ``gpu``: skipped unless CUDA is available and FlashInfer imports (tests/conftest.py). Run:
    python -m pytest tests/gpu/test_gpu_flashinfer_internals.py -q -m gpu

For a FlashInfer wrapper made and planned through FlashInfer's public API alone (fa2, and fa3 where the GPU has it;
causal and not), a call recorded by the module and replayed with the real q / k / v / out / lse gives the bits of the
wrapper's public ``run()``: at the level of FlashInfer's Python ``ragged_run`` (what ``DirectRun`` launches), one level
down at the compiled TVM-FFI function (what the JAX adapter's XLA call launches), and through ``DirectRun`` with its
natural-log finish. The installed FlashInfer is one the version gate knows (pyproject pins the same range). The
buffer accessors read what ``plan()`` made.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import select_backend  # noqa: E402
from mla_bridge.backends import flashinfer_internals as internals  # noqa: E402
from mla_bridge.backends.flashinfer import DirectRun, new_wrapper  # noqa: E402

BF16 = torch.bfloat16
HEADS, QK, VO = 4, 192, 128


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def _planned(backend: str, causal: bool):
    """A FlashInfer wrapper planned through FlashInfer's public API, and the inputs of one run."""
    name = f"flashinfer-{backend}"
    try:
        select_backend(
            dev(),
            requested=name,
            dtype=BF16,
            out_dtype=BF16,
            head_dim_qk=QK,
            head_dim_vo=VO,
            causal=causal,
            num_heads=HEADS,
        )
    except ValueError as err:
        pytest.skip(f"{name} cannot serve here: {err}")
    q_lens, kv_lens = [5, 1, 17], ([5, 1, 17] if causal else [9, 30, 4])
    qo, kv = [0], [0]
    for a, b in zip(q_lens, kv_lens):
        qo.append(qo[-1] + a)
        kv.append(kv[-1] + b)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(qo[-1], HEADS, QK, generator=g).to(BF16).to(dev())
    k = torch.randn(kv[-1], HEADS, QK, generator=g).to(BF16).to(dev())
    v = torch.randn(kv[-1], HEADS, VO, generator=g).to(BF16).to(dev())
    wrapper = new_wrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev()), backend)
    wrapper.plan(
        torch.tensor(qo, dtype=torch.int32),
        torch.tensor(kv, dtype=torch.int32),
        HEADS,
        HEADS,
        QK,
        head_dim_vo=VO,
        causal=causal,
        sm_scale=QK**-0.5,
        q_data_type=BF16,
        kv_data_type=BF16,
        o_data_type=BF16,
    )
    return wrapper, q, k, v, torch.tensor(kv, dtype=torch.int32)


def _stand_ins(q, k, v):
    t, n = q.shape[0], k.shape[0]
    shapes = ((t, HEADS, QK), (n, HEADS, QK), (n, HEADS, VO), (t, HEADS, VO), (t, HEADS))
    dtypes = (BF16, BF16, BF16, BF16, torch.float32)
    return [torch.empty((), dtype=d, device=dev()).expand(*s) for s, d in zip(shapes, dtypes)], shapes


def _public_run(wrapper, q, k, v, lse_base="log2"):
    out = torch.empty(q.shape[0], HEADS, VO, dtype=BF16, device=dev())
    lse = torch.empty(q.shape[0], HEADS, dtype=torch.float32, device=dev())
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True, lse_base=lse_base, lse_layout="NH")
    return out, lse


def test_installed_flashinfer_is_a_version_the_recording_knows():
    import flashinfer

    assert internals.version_why_not() is None, internals.version_why_not()
    assert internals.version_why_not(flashinfer.__version__) is None


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_recorded_call_reproduces_public_run_bitwise(backend, causal):
    wrapper, q, k, v, kv_host = _planned(backend, causal)
    want_out, want_lse = _public_run(wrapper, q, k, v)
    assert internals.recording_why_not(wrapper) is None
    stand_ins, _ = _stand_ins(q, k, v)
    fn, args = internals.record_ragged_run(wrapper, *stand_ins)
    # the wrapper's module is restored: its public run still runs, to the same bits
    assert internals.recording_why_not(wrapper) is None
    assert torch.equal(_bits(_public_run(wrapper, q, k, v)[0]), _bits(want_out))
    slots = internals.argument_slots(args, stand_ins)
    fw, live = internals.live_slots(wrapper, args)
    assert fw is not None or backend != "fa2"  # fa2's float workspace is an argument of its call
    out = torch.full_like(want_out, float("nan"))
    lse = torch.full_like(want_lse, float("nan"))

    # Python level (DirectRun's): FlashInfer's ragged_run on the recorded list
    py_args = list(args)
    for i, x in zip(slots, (q, k, v, out, lse)):
        py_args[i] = x
    internals.live_values(wrapper, live, py_args)
    fn(*py_args)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(want_out)) and torch.equal(_bits(lse), _bits(want_lse))

    # compiled level (the JAX adapter's): FlashInfer's compiled function on the list ragged_run hands it (recorded
    # from the real tensors: the JAX adapter records from stand-ins and falls back to real ones the same way)
    out2 = torch.full_like(want_out, float("nan"))
    lse2 = torch.full_like(want_lse, float("nan"))
    py_args2 = list(py_args)
    py_args2[slots[3]], py_args2[slots[4]] = out2, lse2
    compiled, c_args = internals.compiled_call(fn, py_args2)
    assert internals.argument_slots(c_args, (q, k, v, out2, lse2))  # each found exactly once
    assert torch.isnan(out2.float()).all()  # recording the compiled call launched nothing
    compiled(*c_args)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out2), _bits(want_out)) and torch.equal(_bits(lse2), _bits(want_lse))

    # the buffers the module reads are the ones plan() made
    device_bytes, host_bytes = internals.held_bytes(wrapper)
    assert device_bytes > 0 and host_bytes > 0
    indptr = internals.device_kv_indptr(wrapper, kv_host, dev())
    assert indptr is not None and torch.equal(indptr.cpu(), kv_host)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_direct_run_reproduces_public_run_with_natural_log_bitwise(backend):
    wrapper, q, k, v, _ = _planned(backend, True)
    want_out, want_lse = _public_run(wrapper, q, k, v, lse_base="ln")
    _, shapes = _stand_ins(q, k, v)
    direct = DirectRun.record(wrapper, shapes, BF16, dev())
    assert direct is not None
    out = torch.full_like(want_out, float("nan"))
    lse = torch.full_like(want_lse, float("nan"))
    direct(wrapper, q, k, v, out, lse)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(want_out)) and torch.equal(_bits(lse), _bits(want_lse))
