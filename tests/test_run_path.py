"""The run path's host work: RaggedPlan.validate's one-pass checks and FlashInfer's recorded direct run.

* ``validate`` compares shape tuples, dtypes and devices once per argument; the plan's token counts are read from its
  indptrs once per plan, not per call; every bad input still raises the named error (tests/test_validation.py and
  tests/test_ragged.py hold those cases; here: each failing condition of the fast path reaches the named check).
* :class:`mla_bridge.backends.flashinfer.DirectRun` against a stand-in with FlashInfer 0.7.4's structure
  (``wrapper.run`` builds an argument list and ends in ``self._cached_module.ragged_run(*run_args)``, then converts
  the base-2 LSE): recording launches nothing; a direct call launches once with the call's tensors and the
  wrapper's current buffers and gives bit for bit what ``wrapper.run(..., lse_base="ln")`` gives; a wrapper that does
  not look like that is refused (``None``: the kernel then calls ``wrapper.run``).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from mla_bridge import Workspace, plan_ragged
from mla_bridge.backends.flashinfer import DirectRun
from mla_bridge.ragged import RaggedSpec


def _plan():
    return plan_ragged(
        [0, 4, 8],
        [0, 6, 12],
        num_heads=2,
        head_dim_qk=8,
        head_dim_vo=4,
        causal=False,
        sm_scale=0.3,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )


def _qkv():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 4, generator=g)


def test_validate_reads_the_indptrs_once_per_plan(monkeypatch):
    plan = _plan()
    q, k, v = _qkv()
    out, lse = torch.empty(8, 2, 4), torch.empty(8, 2)
    plan.run(q, k, v, out=out, lse=lse)
    reads = []
    for name in ("num_qo_tokens", "num_kv_tokens"):
        prop = getattr(RaggedSpec, name)
        read = getattr(prop, "fget", None) or prop.func  # a property or a functools.cached_property
        monkeypatch.setattr(RaggedSpec, name, property(lambda s, f=read, n=name: reads.append(n) or f(s)))
    for _ in range(3):
        plan.validate(q, k, v, out, lse)
        plan.run(q, k, v, out=out, lse=lse)
    assert reads == []
    with pytest.raises(ValueError, match="q has 7 tokens but qo_indptr"):  # the named check still runs
        plan.validate(q[:7], k, v)


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        (dict(q="q"), TypeError, "q must be a torch.Tensor"),
        (dict(k=torch.zeros(12, 2, 7)), ValueError, r"k must have shape \[12, 2, 8\]"),
        (dict(v=torch.zeros(12, 2, 4, dtype=torch.float64)), TypeError, "v must have dtype torch.float32"),
        (dict(v=torch.zeros(12, 2, 4, device="meta")), ValueError, "v is on meta"),
        (dict(out=torch.zeros(8, 2, 5)), ValueError, "out must have shape"),
        (dict(out=torch.zeros(8, 2, 4, dtype=torch.float16)), TypeError, "out must have dtype"),
        (dict(lse=torch.zeros(2, 8)), ValueError, r"lse must have shape \[8, 2\]"),
        (dict(lse=torch.zeros(8, 2, dtype=torch.float64)), TypeError, "lse must have dtype torch.float32"),
        (dict(lse=torch.zeros(2, 8).t()), ValueError, "lse must be contiguous"),
        (dict(lse_layout="TN"), ValueError, "lse_layout must be 'NH'"),
        (dict(lse_layout=["NH"]), ValueError, "lse_layout must be 'NH'"),
    ],
)
def test_every_fast_path_condition_reaches_its_named_error(bad, exc, match):
    plan = _plan()
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, out=torch.empty(8, 2, 4), lse=torch.empty(8, 2), lse_layout="NH")
    args.update(bad)
    with pytest.raises(exc, match=match):
        plan.validate(**args)
    with pytest.raises(exc, match=match):
        plan.run(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_validate_accepts_hn_lse():
    plan = _plan()
    q, k, v = _qkv()
    out, lse = plan.run(q, k, v, lse=torch.empty(2, 8), lse_layout="HN")
    ref_out, ref_lse = plan.run(q, k, v)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse.t())


# ------------------------------------------------------------------------------------------- FlashInfer's direct run
class FakeWrapper:
    """FlashInfer 0.7.4's ragged wrapper as far as the direct run depends on it: ``run`` checks, builds
    ``run_args`` (buffers, plan info, q, k, v, indptr buffers, out, lse, mask mode, ...), calls
    ``self._cached_module.ragged_run(*run_args)`` once and finishes the LSE (``lse.mul_(ln 2)`` for "ln")."""

    def __init__(self, calls_per_run: int = 1):
        self._float_workspace_buffer = torch.zeros(16)
        self._int_workspace_buffer = torch.zeros(8, dtype=torch.int32)
        self._plan_info = [7, 8, 9]
        self._qo_indptr_buf = torch.tensor([0, 4, 8], dtype=torch.int32)
        self._kv_indptr_buf = torch.tensor([0, 6, 12], dtype=torch.int32)
        self.launches: list = []
        self.runs = 0
        self.calls_per_run = calls_per_run

        def ragged_run(fw, iw, info, q, k, v, qo, kv, out, lse, mask_mode, layout, window_left, pdl, *rest):
            self.launches.append(dict(fw=fw, iw=iw, info=info, q=q, k=k, v=v, qo=qo, kv=kv, out=out, lse=lse))
            out.copy_(q[..., :4] * 2 + fw[0])
            if lse is not None:  # maybe_lse
                lse.copy_(q[..., 0] * 3 + 0.1)  # "base 2"

        self._cached_module = types.SimpleNamespace(ragged_run=ragged_run, plan=None)

    def run(self, q, k, v, out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH"):
        self.runs += 1
        if out.shape != (q.shape[0], q.shape[1], v.shape[-1]):
            raise ValueError("Invalid shape of out")
        run_args = [
            self._float_workspace_buffer,
            self._int_workspace_buffer,
            self._plan_info,
            q,
            k,
            v,
            self._qo_indptr_buf,
            self._kv_indptr_buf,
            out,
            lse,
            0,
            0,
            -1,
            True,
            None,
            None,
        ]
        for _ in range(self.calls_per_run):
            self._cached_module.ragged_run(*run_args)
        if lse_base == "ln":
            lse.mul_(math.log(2.0))
        return (out, lse) if return_lse else out


SHAPES = ((8, 2, 8), (12, 2, 8), (12, 2, 4), (8, 2, 4), (8, 2))


def test_direct_run_equals_wrapper_run_bitwise():
    w = FakeWrapper()
    direct = DirectRun.record(w, SHAPES, torch.float32, torch.device("cpu"))
    assert direct is not None and w.runs == 1 and w.launches == []  # recording launches nothing
    q, k, v = _qkv()
    out, lse = torch.empty(8, 2, 4), torch.empty(8, 2)
    got = direct(w, q, k, v, out, lse)
    assert got[0] is out and got[1] is lse and len(w.launches) == 1 and w.runs == 1
    call = w.launches[0]
    assert call["q"] is q and call["k"] is k and call["v"] is v and call["out"] is out and call["lse"] is lse
    assert call["fw"] is w._float_workspace_buffer and call["info"] is w._plan_info
    want_out, want_lse = w.run(q, k, v, out=torch.empty(8, 2, 4), lse=torch.empty(8, 2), return_lse=True, lse_base="ln")
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_direct_run_without_lse_passes_none_and_converts_nothing():
    """``RaggedPlan.run(..., return_lse=False)`` hands the kernel lse=None: FlashInfer's ragged_run gets
    ``maybe_lse=None`` and no base conversion runs."""
    w = FakeWrapper()
    direct = DirectRun.record(w, SHAPES, torch.float32, torch.device("cpu"))
    q, k, v = _qkv()
    out = torch.empty(8, 2, 4)
    got, lse = direct(w, q, k, v, out, None)
    assert got is out and lse is None and w.launches[-1]["lse"] is None
    assert torch.equal(out, q[..., :4] * 2 + w._float_workspace_buffer[0])


def test_direct_run_reads_the_wrappers_buffers_at_each_call():
    """fa2's float workspace moves with the stream (Workspace.float_region): never the recorded one."""
    w = FakeWrapper()
    direct = DirectRun.record(w, SHAPES, torch.float32, torch.device("cpu"))
    q, k, v = _qkv()
    w._float_workspace_buffer = torch.full((16,), 5.0)
    w._plan_info = [1]
    out, lse = direct(w, q, k, v, torch.empty(8, 2, 4), torch.empty(8, 2))
    assert w.launches[-1]["fw"] is w._float_workspace_buffer and w.launches[-1]["info"] is w._plan_info
    assert torch.equal(out, q[..., :4] * 2 + 5.0)
    q2 = q + 1  # and a second call with other tensors
    out2, _ = direct(w, q2, k, v, torch.empty(8, 2, 4), torch.empty(8, 2))
    assert w.launches[-1]["q"] is q2 and torch.equal(out2, q2[..., :4] * 2 + 5.0)


def test_direct_run_refuses_what_it_does_not_know():
    cpu = torch.device("cpu")
    assert DirectRun.record(FakeWrapper(calls_per_run=2), SHAPES, torch.float32, cpu) is None
    assert DirectRun.record(FakeWrapper(calls_per_run=0), SHAPES, torch.float32, cpu) is None
    w = FakeWrapper()
    w._cached_module = object()  # not FlashInfer 0.7's SimpleNamespace module
    assert DirectRun.record(w, SHAPES, torch.float32, cpu) is None
    w = FakeWrapper()
    module = w._cached_module
    bad = ((8, 2, 8), (12, 2, 8), (12, 2, 4), (8, 2, 5), (8, 2))  # run raises on the stand-ins
    assert DirectRun.record(w, bad, torch.float32, cpu) is None
    assert w._cached_module is module  # restored


def _compiled_wrapper(refuse=None):
    """A FakeWrapper whose module's ragged_run, as FlashInfer 0.7's, hands its arguments to a compiled
    ``ragged_run_func`` it closes over (here a recorder of launches); ``refuse(q)``: run raises for such a q."""
    w = FakeWrapper()
    launched: list = []

    def ragged_run_func(*args):
        launched.append(args)

    def ragged_run(*args):
        ragged_run_func(*args)

    w._cached_module = types.SimpleNamespace(ragged_run=ragged_run, plan=None)
    if refuse is not None:
        run = w.run

        def checked_run(q, *a, **kw):
            if refuse(q):
                raise ValueError("refused")
            return run(q, *a, **kw)

        w.run = checked_run
    return w, launched


def test_record_compiled_run_finds_the_compiled_call_and_its_slots():
    """flashinfer_internals.record_compiled_run (the JAX adapter's XLA call): the compiled function and its argument
    list, q / k / v / out / lse located and cleared, nothing launched; expanded stand-ins first, real ones where
    FlashInfer refuses those; what it does not know is a LookupError."""
    from mla_bridge.backends import flashinfer_internals as internals

    cpu = torch.device("cpu")
    w, launched = _compiled_wrapper()
    module = w._cached_module
    compiled, args, slots = internals.record_compiled_run(w, SHAPES, torch.float32, cpu)
    assert launched == [] and w._cached_module is module
    compiled("x")
    assert launched == [("x",)]  # the function ragged_run closes over
    assert slots == [3, 4, 5, 8, 9] and all(args[i] is None for i in slots)
    assert args[0] is w._float_workspace_buffer and args[2] is w._plan_info
    w, _ = _compiled_wrapper(refuse=lambda q: q.stride(0) == 0)  # expanded stand-ins refused: real ones
    assert internals.record_compiled_run(w, SHAPES, torch.float32, cpu)[2] == [3, 4, 5, 8, 9]
    w, _ = _compiled_wrapper(refuse=lambda q: True)
    with pytest.raises(LookupError, match="recording FlashInfer's run failed: ValueError: refused"):
        internals.record_compiled_run(w, SHAPES, torch.float32, cpu)
    with pytest.raises(LookupError, match="no longer calls a compiled ragged_run_func"):
        internals.record_compiled_run(FakeWrapper(), SHAPES, torch.float32, cpu)
    w = FakeWrapper()
    w._cached_module = object()
    with pytest.raises(LookupError, match="has no module with a ragged_run"):
        internals.record_compiled_run(w, SHAPES, torch.float32, cpu)
    stand_ins = internals.stand_ins(SHAPES, torch.bfloat16, cpu)
    assert [tuple(t.shape) for t in stand_ins] == list(SHAPES) and stand_ins[0].stride() == (0, 0, 0)
    assert [t.dtype for t in stand_ins] == [torch.bfloat16] * 4 + [torch.float32]


@pytest.mark.parametrize(
    "version,known",
    [
        ("0.7.2", True),
        ("0.7.4", True),
        ("0.7.10.post1", True),
        ("0.7.1", False),
        ("0.6.9", False),
        ("0.8.0", False),
        ("0.8.0rc1", False),
        ("1.0", False),
        ("unknown", False),
    ],
)
def test_direct_run_is_recorded_only_for_known_flashinfer_versions(monkeypatch, version, known):
    """The version gate of mla_bridge.backends.flashinfer_internals: outside flashinfer-python 0.7.2..0.7.x the
    recording is refused as for any wrapper it does not know (DirectRun.record gives None: the kernel calls
    wrapper.run), with the reason in words; no distribution found (a stand-in): the structure alone decides."""
    from mla_bridge import dispatch
    from mla_bridge.backends import flashinfer_internals as internals

    reason = internals.version_why_not(version)
    assert (reason is None) == known
    if not known:
        assert version in reason and "public run()" in reason
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: version)
    w = FakeWrapper()
    direct = DirectRun.record(w, SHAPES, torch.float32, torch.device("cpu"))
    assert (direct is not None) == known and w.runs == int(known)
    assert internals.recording_why_not(w) == reason
    if not known:
        with pytest.raises(LookupError, match="outside the versions"):
            internals.record_ragged_run(w, *(torch.empty(s) for s in SHAPES))
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: None)
    assert internals.version_why_not() is None


def test_run_lse_base_log2():
    """lse_base="log2": the natural-log LSE times log2(e) (the torch backend converts; FlashInfer skips its own
    conversion, tests/gpu/test_gpu_run_path.py); empty rows stay -inf; out unchanged; unknown bases refused first."""
    plan = plan_ragged(
        [0, 4, 8, 9],
        [0, 6, 12, 12],
        num_heads=2,
        head_dim_qk=8,
        head_dim_vo=4,
        causal=False,
        sm_scale=0.3,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(9, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 4, generator=g)
    out, lse = plan.run(q, k, v)
    out2, lse2 = plan.run(q, k, v, lse_base="log2")
    assert torch.equal(out2, out) and torch.equal(lse2, lse * (1.0 / math.log(2.0)))
    assert torch.isneginf(lse2[8]).all()  # the request with no keys
    dest = torch.full((9, 2), 7.0)
    with pytest.raises(ValueError, match="lse_base must be 'ln'.*'log2', got 'e'"):
        plan.run(q, k, v, lse=dest, lse_base="e")
    assert torch.equal(dest, torch.full((9, 2), 7.0))


def test_device_kv_indptr_is_the_copy_plan_made_or_none():
    """RaggedPlan.device_kv_indptr (what a chunk's gather reads) is the wrapper's own ``_kv_indptr_buf`` only when it
    has the plan's kind: int32, the plan's length, on the workspace's device; anything else gives None (then the
    plan makes its own copy)."""
    from mla_bridge.backends.flashinfer_internals import device_kv_indptr

    host = torch.tensor([0, 3, 5], dtype=torch.int32)
    cpu = torch.device("cpu")
    good = types.SimpleNamespace(_kv_indptr_buf=host.clone())
    assert device_kv_indptr(good, host, cpu) is good._kv_indptr_buf
    for buf in (None, host.long(), host[:2].clone(), [0, 3, 5]):
        assert device_kv_indptr(types.SimpleNamespace(_kv_indptr_buf=buf), host, cpu) is None
    assert device_kv_indptr(types.SimpleNamespace(), host, cpu) is None
    assert device_kv_indptr(good, host, torch.device("meta")) is None
    plan = plan_ragged(
        [0, 2],
        [0, 3],
        num_heads=2,
        head_dim_qk=8,
        head_dim_vo=8,
        causal=False,
        sm_scale=0.5,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )
    assert plan.device_kv_indptr is None  # the torch backend copies nothing
