"""select_backend's capability table, the env override, forced backends, and the SM100 (cutlass) wrapper contract.

No GPU is needed: capabilities and CUDA versions are passed in (or faked), ``flashinfer_version`` is monkeypatched so
that the outcome does not depend on the installed package, and FlashInfer's wrapper class is replaced by a fake
that records its calls and binds them against the real wrapper's signatures.
"""

from __future__ import annotations

import gc
import inspect
import math

import pytest
import torch

import mla_bridge.dispatch as dispatch
from mla_bridge import BackendChoice, Workspace, plan_ragged, select_backend
from mla_bridge.dispatch import BACKEND_NAMES, cutlass_work_items

BF16 = torch.bfloat16
MLA = dict(dtype=BF16, head_dim_qk=192, head_dim_vo=128)


@pytest.fixture
def fi(monkeypatch):
    """FlashInfer 0.7.4 "installed" as far as dispatch can tell."""
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")


@pytest.fixture
def no_fi(monkeypatch):
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: None)


def passed(choice: BackendChoice) -> dict:
    return dict(choice.passed_over)


# --------------------------------------------------------------------------------------------------------------
# the capability rows
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cap,cuda,expected",
    [
        ((10, 0), (12, 8), "flashinfer-cutlass"),
        ((10, 3), (12, 8), "flashinfer-cutlass"),
        ((10, 0), (13, 0), "flashinfer-cutlass"),
        ((11, 0), (13, 0), "flashinfer-cutlass"),
        ((11, 0), (12, 8), "flashinfer-fa2"),  # SM110 needs CUDA 13.0
        ((10, 0), (12, 4), "flashinfer-fa2"),  # SM100 needs CUDA 12.8
        ((9, 0), (12, 8), "flashinfer-fa3"),
        ((9, 0), (12, 4), "flashinfer-fa3"),
        ((8, 0), (12, 8), "flashinfer-fa2"),
        ((8, 6), (12, 8), "flashinfer-fa2"),
        ((8, 9), (12, 8), "flashinfer-fa2"),
        ((12, 0), (12, 8), "flashinfer-fa2"),
        ((7, 5), (12, 8), "torch"),
    ],
)
def test_capability_rows(fi, cap, cuda, expected):
    choice = select_backend(capability=cap, cuda_version=cuda, **MLA)
    assert choice.name == expected
    order = list(BACKEND_NAMES)
    # Every row before the winner was passed over, with a reason, in table order.
    assert [name for name, _ in choice.passed_over] == order[: order.index(expected)]
    assert all(reason for _, reason in choice.passed_over)
    assert choice.reason


def test_table_order_is_sm100_first():
    assert BACKEND_NAMES == ("flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2", "torch")


@pytest.mark.parametrize(
    "cap,cuda,needed", [((11, 0), (12, 8), "13.0"), ((10, 0), (12, 4), "12.8"), ((10, 0), None, "12.8")]
)
def test_cuda_version_reason(fi, cap, cuda, needed):
    choice = select_backend(capability=cap, cuda_version=cuda, **MLA)
    assert needed in passed(choice)["flashinfer-cutlass"]


def test_cuda_version_read_from_torch(fi, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert select_backend(capability=(10, 0), **MLA).name == "flashinfer-cutlass"
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    assert select_backend(capability=(10, 0), **MLA).name == "flashinfer-fa2"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert select_backend(capability=(10, 0), **MLA).name == "flashinfer-fa2"


@pytest.mark.parametrize(
    "name,fi_name",
    [("flashinfer-cutlass", "cutlass"), ("flashinfer-fa3", "fa3"), ("flashinfer-fa2", "fa2"), ("torch", None)],
)
def test_flashinfer_backend_strings(name, fi_name):
    choice = BackendChoice(name, "test")
    assert choice.flashinfer_backend == fi_name
    assert choice.is_flashinfer == (fi_name is not None)


def test_no_device_is_torch(fi, monkeypatch):
    choice = select_backend("cpu", **MLA)
    assert choice.name == "torch"
    assert "CUDA device" in passed(choice)["flashinfer-fa2"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_backend(**MLA).name == "torch"  # device=None and no GPU


def test_device_capability_is_queried(fi, monkeypatch):
    seen = []

    def fake_capability(dev=None):
        seen.append(torch.device(dev))
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", fake_capability)
    assert select_backend("cuda:0", cuda_version=(12, 8), **MLA).name == "flashinfer-fa3"
    assert select_backend(0, cuda_version=(12, 8), **MLA).name == "flashinfer-fa3"
    assert seen == [torch.device("cuda", 0)] * 2


@pytest.mark.parametrize("cap", [(10, 0), (9, 0), (8, 0)])
def test_no_flashinfer_is_torch(no_fi, cap):
    choice = select_backend(capability=cap, cuda_version=(12, 8), **MLA)
    assert choice.name == "torch"
    assert "not installed" in passed(choice)["flashinfer-fa2"]
    assert "fallback" in choice.reason


@pytest.mark.parametrize("cap", [(10, 0), (9, 0), (8, 0)])
def test_float32_is_not_flashinfer(fi, cap):
    choice = select_backend(capability=cap, cuda_version=(12, 8), dtype=torch.float32, head_dim_qk=192, head_dim_vo=128)
    assert choice.name == "torch"
    assert "float16/bfloat16" in passed(choice)["flashinfer-fa2"]


def test_fp16_is_flashinfer(fi):
    assert select_backend(capability=(9, 0), cuda_version=(12, 8), dtype=torch.float16).name == "flashinfer-fa3"


# --------------------------------------------------------------------------------------------------------------
# cutlass passed over
# --------------------------------------------------------------------------------------------------------------


def test_cutlass_passed_over_for_256_head_dims(fi):
    choice = select_backend(capability=(10, 0), cuda_version=(12, 8), dtype=BF16, head_dim_qk=256, head_dim_vo=256)
    assert choice.name == "flashinfer-fa2"
    assert "256/256" in passed(choice)["flashinfer-cutlass"]


@pytest.mark.parametrize("dims", [(192, 128), (128, 128), (64, 64)])
def test_cutlass_head_dims_served(fi, dims):
    choice = select_backend(
        capability=(10, 0), cuda_version=(12, 8), dtype=BF16, head_dim_qk=dims[0], head_dim_vo=dims[1]
    )
    assert choice.name == "flashinfer-cutlass"


def test_cutlass_passed_over_for_out_dtype(fi):
    choice = select_backend(capability=(10, 0), cuda_version=(12, 8), out_dtype=torch.float16, **MLA)
    assert choice.name != "flashinfer-cutlass"
    assert "output dtype" in passed(choice)["flashinfer-cutlass"]


def test_cutlass_passed_over_for_causal_q_longer_than_kv(fi):
    common = dict(capability=(10, 0), cuda_version=(12, 8), num_heads=16, **MLA)
    choice = select_backend(causal=True, qo_indptr=[0, 2, 6], kv_indptr=[0, 5, 7], **common)
    assert choice.name == "flashinfer-fa2"
    reason = passed(choice)["flashinfer-cutlass"]
    assert "request 1" in reason and "q_len 4 > kv_len 2" in reason
    # The same lengths non-causal, or causal with q_len <= kv_len, are served by cutlass.
    assert select_backend(causal=False, qo_indptr=[0, 2, 6], kv_indptr=[0, 5, 7], **common).name == "flashinfer-cutlass"
    assert select_backend(causal=True, qo_indptr=[0, 2, 6], kv_indptr=[0, 5, 9], **common).name == "flashinfer-cutlass"
    # the boundary: q_len == kv_len + 1 is passed over, q_len == kv_len is served
    assert select_backend(causal=True, qo_indptr=[0, 3], kv_indptr=[0, 2], **common).name == "flashinfer-fa2"
    assert select_backend(causal=True, qo_indptr=[0, 3], kv_indptr=[0, 3], **common).name == "flashinfer-cutlass"


@pytest.mark.parametrize(
    "num_requests,q_len,heads",
    [(1024, 1, 128), (1025, 1, 128), (1, 256 * 1024, 1), (1, 256 * 1024 + 1, 1), (4, 300, 16384)],
)
def test_cutlass_work_items(fi, num_requests, q_len, heads):
    qo = [i * q_len for i in range(num_requests + 1)]
    items = num_requests * math.ceil(q_len / 256) * heads
    assert cutlass_work_items(qo, heads) == items
    choice = select_backend(
        capability=(10, 0),
        cuda_version=(12, 8),
        num_heads=heads,
        causal=False,
        qo_indptr=qo,
        kv_indptr=qo,
        dtype=BF16,
        head_dim_qk=64,
        head_dim_vo=64,
    )
    if items > 131072:
        assert choice.name == "flashinfer-fa2"
        assert str(items) in passed(choice)["flashinfer-cutlass"] and "131072" in passed(choice)["flashinfer-cutlass"]
    else:
        assert choice.name == "flashinfer-cutlass"


def test_work_items_count_empty_requests_as_zero_tiles():
    assert cutlass_work_items([0, 256, 257, 257, 1000], 3) == (1 + 1 + 0 + math.ceil(743 / 256)) * 3


# --------------------------------------------------------------------------------------------------------------
# head dims: what each kernel really supports (flashinfer#4299 / PR #4312, is_fa3_prefill_head_dim_supported)
# --------------------------------------------------------------------------------------------------------------


def test_head_dim_16_four_heads_is_torch_with_reason(fi):
    """vLLM's CPU-backend test shape: fa2 failed inside FlashInfer ("Invalid configuration : NUM_MMA_Q=1
    NUM_MMA_D_QK=1"); no FlashInfer row may take it."""
    for cap in [(8, 0), (9, 0), (10, 0)]:
        choice = select_backend(
            capability=cap,
            cuda_version=(12, 8),
            dtype=BF16,
            head_dim_qk=16,
            head_dim_vo=16,
            num_heads=4,
            causal=True,
            qo_indptr=[0, 5, 9],
            kv_indptr=[0, 5, 9],
        )
        assert choice.name == "torch", cap
        assert "multiple of 64" in passed(choice)["flashinfer-fa2"]
        assert "fallback" in choice.reason and "flashinfer-fa2: head_dim_qk 16" in choice.reason


@pytest.mark.parametrize(
    "dims,sm90,sm80",
    [
        ((192, 128), "flashinfer-fa3", "flashinfer-fa2"),
        ((128, 128), "flashinfer-fa3", "flashinfer-fa2"),
        ((64, 64), "flashinfer-fa3", "flashinfer-fa2"),
        ((256, 256), "flashinfer-fa3", "flashinfer-fa2"),
        ((192, 192), "torch", "torch"),  # fa3 takes only 192/128 at 192; fa2's split-KV merge has no v head dim 192
        ((128, 64), "flashinfer-fa2", "flashinfer-fa2"),
        ((16, 16), "torch", "torch"),
        ((32, 32), "torch", "torch"),
        ((48, 48), "torch", "torch"),
        ((80, 80), "torch", "torch"),
        ((96, 96), "torch", "torch"),
        ((72, 72), "torch", "torch"),  # not a multiple of 16: fa2 silently returned wrong columns (flashinfer#4299)
        ((160, 160), "torch", "torch"),
        ((320, 320), "torch", "torch"),
        ((512, 512), "torch", "torch"),
        ((192, 96), "torch", "torch"),
    ],
)
def test_head_dim_rows(fi, dims, sm90, sm80):
    kw = dict(cuda_version=(12, 8), dtype=BF16, head_dim_qk=dims[0], head_dim_vo=dims[1])
    assert select_backend(capability=(9, 0), **kw).name == sm90
    assert select_backend(capability=(8, 0), **kw).name == sm80
    assert select_backend(capability=(8, 9), **kw).name == sm80


@pytest.mark.parametrize("dims", [(96, 96), (16, 16), (192, 96)])
def test_forced_fa2_refuses_head_dims_it_gets_wrong(fi, dims):
    with pytest.raises(ValueError, match="multiple of 64.*4299"):
        select_backend(
            capability=(8, 0),
            cuda_version=(12, 8),
            requested="flashinfer-fa2",
            dtype=BF16,
            head_dim_qk=dims[0],
            head_dim_vo=dims[1],
        )


def test_head_dims_why_not_table():
    from mla_bridge.dispatch import head_dims_why_not

    assert head_dims_why_not("fa2", 192, 128) is None and head_dims_why_not("fa2", 64, 256) is None
    assert "head_dim_vo 96" in head_dims_why_not("fa2", 128, 96)
    assert "split-KV merge" in head_dims_why_not("fa2", 192, 192)
    assert head_dims_why_not("fa2", 320, 320) is not None
    assert head_dims_why_not("fa3", 192, 128) is None and head_dims_why_not("fa3", 192, 192) is not None
    assert head_dims_why_not("cutlass", 256, 256) is not None and head_dims_why_not("cutlass", 64, 64) is None
    assert head_dims_why_not("fa2", None, None) is None and head_dims_why_not("fa3", None, 128) is None


# --------------------------------------------------------------------------------------------------------------
# forcing a backend
# --------------------------------------------------------------------------------------------------------------


def test_env_override(fi, monkeypatch):
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")
    choice = select_backend(capability=(9, 0), cuda_version=(12, 8), **MLA)
    assert choice.name == "torch" and "MLA_BRIDGE_BACKEND" in choice.reason
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "flashinfer-fa2")
    assert select_backend(capability=(9, 0), cuda_version=(12, 8), **MLA).name == "flashinfer-fa2"
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "auto")
    assert select_backend(capability=(9, 0), cuda_version=(12, 8), **MLA).name == "flashinfer-fa3"
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "")
    assert select_backend(capability=(9, 0), cuda_version=(12, 8), **MLA).name == "flashinfer-fa3"
    # An explicit request wins over the environment.
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")
    assert (
        select_backend(capability=(9, 0), cuda_version=(12, 8), requested="flashinfer-fa3", **MLA).name
        == "flashinfer-fa3"
    )
    assert select_backend(capability=(9, 0), cuda_version=(12, 8), requested="auto", **MLA).name == "flashinfer-fa3"


def test_env_override_reaches_plan_ragged(monkeypatch):
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "flashinfer-fa2")
    with pytest.raises(ValueError, match="MLA_BRIDGE_BACKEND.*flashinfer-fa2.*no CUDA device"):
        plan_ragged(
            [0, 1],
            [0, 1],
            num_heads=1,
            head_dim_qk=16,
            head_dim_vo=16,
            causal=False,
            sm_scale=0.25,
            dtype=torch.float32,
            workspace=Workspace("cpu"),
        )


def test_env_override_invalid(fi, monkeypatch):
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "flashinfer-cutlass")
    with pytest.raises(ValueError, match=r"MLA_BRIDGE_BACKEND.*capability 9\.0.*SM100"):
        select_backend(capability=(9, 0), cuda_version=(12, 8), **MLA)
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "flash-attn")
    with pytest.raises(ValueError, match="MLA_BRIDGE_BACKEND.*unknown backend 'flash-attn'"):
        select_backend(capability=(9, 0), cuda_version=(12, 8), **MLA)


@pytest.mark.parametrize(
    "requested,cap,kwargs,says",
    [
        ("flashinfer-fa3", (8, 0), {}, r"capability 8\.0.*SM90"),
        ("flashinfer-fa3", (10, 0), {}, r"capability 10\.0.*SM90"),
        ("flashinfer-cutlass", (9, 0), {}, r"capability 9\.0.*SM100"),
        ("flashinfer-fa2", (7, 5), {}, r"capability 7\.5.*SM80"),
        ("flashinfer-fa2", (9, 0), {"dtype": torch.float32}, r"capability 9\.0.*float16/bfloat16.*supports"),
        (
            "flashinfer-cutlass",
            (10, 0),
            {"head_dim_qk": 256, "head_dim_vo": 256},
            r"capability 10\.0.*256/256.*supports",
        ),
    ],
)
def test_forced_backend_that_cannot_serve(fi, requested, cap, kwargs, says):
    args = dict(MLA, **kwargs)
    with pytest.raises(ValueError, match=says):
        select_backend(capability=cap, cuda_version=(12, 8), requested=requested, **args)


def test_forced_backend_without_flashinfer(no_fi):
    with pytest.raises(ValueError, match="not installed"):
        select_backend(capability=(9, 0), cuda_version=(12, 8), requested="flashinfer-fa3", **MLA)
    assert select_backend(capability=(9, 0), requested="torch", **MLA).name == "torch"


def test_unknown_backend_name(fi):
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        select_backend(capability=(10, 0), cuda_version=(12, 8), requested="cudnn", **MLA)
    with pytest.raises(ValueError, match="unknown backend"):
        plan_ragged(
            [0, 1],
            [0, 1],
            num_heads=1,
            head_dim_qk=16,
            head_dim_vo=16,
            causal=False,
            sm_scale=0.25,
            dtype=torch.float32,
            workspace=Workspace("cpu"),
            backend="fa3",
        )


def test_torch_forced_on_any_capability(fi):
    for cap in [(10, 0), (9, 0), (8, 0), (7, 0)]:
        choice = select_backend(capability=cap, cuda_version=(12, 8), requested="torch", **MLA)
        assert choice.name == "torch" and choice.passed_over == ()


# --------------------------------------------------------------------------------------------------------------
# the SM100 wrapper contract (FlashInfer's wrapper replaced by a recording fake)
# --------------------------------------------------------------------------------------------------------------


class FakeWrapper:
    """Stands in for flashinfer.BatchPrefillWithRaggedKVCacheWrapper; records calls bound to the real signatures."""

    instances: list = []

    def __init__(self, *args, **kwargs):
        import flashinfer

        real = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper
        self.init = inspect.signature(real.__init__).bind(self, *args, **kwargs)
        self.init.apply_defaults()
        self.plans = []
        self.runs = []
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)
        self.reset_calls = []
        FakeWrapper.instances.append(self)

    def plan(self, *args, **kwargs):
        import flashinfer

        bound = inspect.signature(flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper.plan).bind(
            self, *args, **kwargs
        )
        self.plans.append((bound.arguments, dict(kwargs)))

    def run(self, q, k, v, *args, **kwargs):
        import flashinfer

        bound = inspect.signature(flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper.run).bind(
            self, q, k, v, *args, **kwargs
        )
        self.runs.append(bound.arguments)
        return kwargs.get("out"), kwargs.get("lse")

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self.reset_calls.append((float_workspace_buffer, int_workspace_buffer))


@pytest.fixture
def fake_flashinfer(monkeypatch, fi):
    flashinfer = pytest.importorskip("flashinfer")
    FakeWrapper.instances = []
    monkeypatch.setattr(flashinfer, "BatchPrefillWithRaggedKVCacheWrapper", FakeWrapper)
    return FakeWrapper


@pytest.fixture
def fake_sm100(monkeypatch, fake_flashinfer):
    """A CUDA device of capability 10.0 with CUDA 12.8, as far as mla_bridge can tell (no tensor goes there)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # Workspace checks the device exists
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    buf = torch.empty(1024, dtype=torch.uint8)
    monkeypatch.setattr(Workspace, "float_workspace", property(lambda self: buf))
    return buf


def plan_mla(ws, qo, kv, causal=True, heads=16, scale=0.1147):
    return plan_ragged(
        qo,
        kv,
        num_heads=heads,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=causal,
        sm_scale=scale,
        dtype=BF16,
        workspace=ws,
    )


def test_sm100_wrapper_built_and_planned_for_cutlass(fake_sm100):
    ws = Workspace("cuda:0")
    plan = plan_mla(ws, [0, 3, 3, 8], [0, 5, 5, 12], causal=True, heads=16, scale=0.1147)
    assert plan.backend.name == "flashinfer-cutlass"
    (w,) = FakeWrapper.instances
    assert w.init.arguments["backend"] == "cutlass"
    assert w.init.arguments["kv_layout"] == "NHD"
    assert w.init.arguments["float_workspace_buffer"] is fake_sm100
    assert w.init.arguments["use_cuda_graph"] is False
    ((args, kwargs),) = w.plans
    for name, values in (("qo_indptr", [0, 3, 3, 8]), ("kv_indptr", [0, 5, 5, 12])):
        t = args[name]
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu", name
        assert t.tolist() == values
    assert args["num_qo_heads"] == args["num_kv_heads"] == 16
    assert args["head_dim_qk"] == 192 and args["head_dim_vo"] == 128
    assert args["causal"] is True
    assert args["sm_scale"] == pytest.approx(0.1147, rel=1e-12)
    assert args["q_data_type"] == BF16 and args["kv_data_type"] == BF16 and args["o_data_type"] == BF16
    # Explicit cutlass silently ignores a window and a soft cap: none may be asked for.
    assert args.get("window_left", -1) < 0
    assert args.get("logits_soft_cap") is None
    assert args.get("custom_mask") is None and args.get("packed_custom_mask") is None
    assert ws.plans_made == 1


def test_sm100_causal_q_longer_than_kv_builds_fa2(fake_sm100):
    plan = plan_mla(Workspace("cuda:0"), [0, 4], [0, 2], causal=True)
    assert plan.backend.name == "flashinfer-fa2"
    assert FakeWrapper.instances[0].init.arguments["backend"] == "fa2"


def test_sm100_run_contract(fake_flashinfer):
    from mla_bridge.backends.flashinfer import FlashInferRaggedKernel
    from mla_bridge.ragged import RaggedSpec

    ws = Workspace("cpu", float_workspace_bytes=4096)
    spec = RaggedSpec(
        torch.tensor([0, 2, 5], dtype=torch.int32),
        torch.tensor([0, 4, 9], dtype=torch.int32),
        16,
        192,
        128,
        False,
        0.1352,
        BF16,
        torch.device("cpu"),
    )
    kernel = FlashInferRaggedKernel(BackendChoice("flashinfer-cutlass", "test"), ws, spec)
    (w,) = FakeWrapper.instances
    assert w.init.arguments["backend"] == "cutlass" and w.init.arguments["kv_layout"] == "NHD"
    ((args, _),) = w.plans
    assert args["causal"] is False and args["sm_scale"] == pytest.approx(0.1352)
    q = torch.zeros(5, 16, 192, dtype=BF16)
    k = torch.zeros(9, 16, 192, dtype=BF16)
    v = torch.zeros(9, 16, 128, dtype=BF16)
    out = torch.empty(5, 16, 128, dtype=BF16)
    for layout, lse in (("NH", torch.empty(5, 16)), ("HN", torch.empty(16, 5))):
        got = kernel.run(q, k, v, out, lse, layout)
        r = w.runs[-1]
        assert r["q"] is q and r["k"] is k and r["v"] is v
        kw = r["kwargs"] if "kwargs" in r else r
        assert kw["out"] is out and kw["lse"] is lse
        assert kw["return_lse"] is True
        assert kw["lse_base"] == "ln"
        assert kw["lse_layout"] == layout
        assert got[0] is out and got[1] is lse


def test_wrappers_are_pooled_and_reused(fake_sm100):
    ws = Workspace("cuda:0")
    p1 = plan_mla(ws, [0, 4], [0, 4])
    p2 = plan_mla(ws, [0, 4], [0, 4])
    assert ws.wrappers_created == 2 and len(FakeWrapper.instances) == 2
    w1 = FakeWrapper.instances[0]
    del p1
    gc.collect()
    p3 = plan_mla(ws, [0, 2, 6], [0, 3, 9])
    assert ws.wrappers_created == 2 and len(FakeWrapper.instances) == 2  # no new wrapper: p1's was reused
    assert len(w1.plans) == 2 and w1.plans[-1][0]["qo_indptr"].tolist() == [0, 2, 6]
    del p2, p3
    gc.collect()
    plan_mla(ws, [0, 1], [0, 1])
    assert ws.wrappers_created == 2
    # Different FlashInfer backends use different pools.
    keep = plan_mla(ws, [0, 4], [0, 2], causal=True)  # q_len > kv_len: fa2
    assert keep.backend.name == "flashinfer-fa2" and ws.wrappers_created == 3


def test_acquire_wrapper_pool():
    ws = Workspace("cpu", float_workspace_bytes=64)
    made = []

    def factory(buf, backend):
        made.append((buf, backend))
        return object()

    class Owner:
        pass

    a, b = Owner(), Owner()
    wa = ws.acquire_wrapper("fa2", a, factory)
    wb = ws.acquire_wrapper("fa2", b, factory)
    assert wa is not wb and ws.wrappers_created == 2
    assert made[0][0] is ws.float_workspace and made[0][1] == "fa2"
    del a
    gc.collect()
    c = Owner()
    assert ws.acquire_wrapper("fa2", c, factory) is wa
    assert ws.acquire_wrapper("fa3", Owner(), factory) not in (wa, wb)
    assert ws.wrappers_created == 3


def test_empty_problem_never_reaches_flashinfer(fake_sm100):
    plan = plan_mla(Workspace("cuda:0"), [0, 0, 0], [0, 4, 6], causal=False)
    assert FakeWrapper.instances == []
    assert plan.backend.name == "flashinfer-cutlass"


def test_env_backend_is_read_case_insensitively(monkeypatch):
    """MLA_BRIDGE_BACKEND=TORCH was refused as an unknown backend; the other environment switches ignore case."""
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", " TORCH ")
    assert select_backend(torch.device("cpu"), dtype=torch.float32, head_dim_qk=192, head_dim_vo=128).name == "torch"
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "Torch-ish")
    with pytest.raises(ValueError, match="MLA_BRIDGE_BACKEND: unknown backend 'torch-ish'"):
        select_backend(torch.device("cpu"), dtype=torch.float32, head_dim_qk=192, head_dim_vo=128)


@pytest.mark.parametrize("device", ["cuda:0", torch.device("cuda"), torch.device("cpu", 0), 0])
def test_device_capability_wants_an_indexed_cuda_device(device):
    """The per-process cache is keyed by the device index: a string, an index-less or a non-CUDA device would be
    keyed wrongly, so they are refused."""
    from mla_bridge.dispatch import device_capability

    with pytest.raises((TypeError, ValueError), match="^device must be a torch.device"):
        device_capability(device)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2])
def test_no_backend_serves_a_dtype_nothing_computes(dtype):
    """select_backend used to answer "torch" for any dtype (the torch row served "any device and dtype"), so the CPU
    and a GPU without a FlashInfer row said yes to int8 or an FP8 q/k/v that no run computes; plan_ragged
    refused them only by its own check, which let float8 through. Now the torch row names the dtypes it computes, the
    table refuses the rest, and plan_ragged refuses them before any plan is made."""
    from mla_bridge import Workspace, plan_ragged

    for kw in (dict(device="cpu"), dict(capability=(9, 0))):
        with pytest.raises(
            ValueError,
            match=r"no backend serves this request \(.*torch: computes bfloat16, "
            r"float16, float32 or float64 q/k/v, got " + str(dtype).replace(".", r"\."),
        ):
            select_backend(dtype=dtype, **kw)
    with pytest.raises(ValueError, match="backend 'torch' cannot serve"):
        select_backend("cpu", dtype=dtype, requested="torch")
    with pytest.raises(TypeError, match="dtype .* must be one of bfloat16, float16, float32, float64") as err:
        plan_ragged(
            [0, 2],
            [0, 2],
            num_heads=2,
            head_dim_qk=8,
            head_dim_vo=8,
            causal=True,
            sm_scale=0.5,
            dtype=dtype,
            workspace=Workspace("cpu"),
        )
    assert ("kv_cache_dtype" in str(err.value)) == (dtype.itemsize == 1 and dtype.is_floating_point)
    for ok in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        assert select_backend("cpu", dtype=ok).name == "torch"


def test_backend_argument_takes_the_spellings_the_variable_takes(monkeypatch):
    """``backend=" TORCH "`` was refused as unknown while ``MLA_BRIDGE_BACKEND=" TORCH "`` was taken: the argument now
    takes the same spellings (spaces stripped, any case), through select_backend and PrefillPlan.build alike."""
    from mla_bridge import MLADims, PrefillPlan, Workspace

    monkeypatch.delenv("MLA_BRIDGE_BACKEND", raising=False)
    for name in ("TORCH", " Torch ", "AUTO"):
        choice = select_backend(
            torch.device("cpu"), dtype=torch.float32, head_dim_qk=192, head_dim_vo=128, requested=name
        )
        assert choice.name == "torch"
    plan = PrefillPlan.build(
        [2], dims=MLADims(num_heads=4), block_size=4, dtype=torch.float32, workspace=Workspace("cpu"), backend="TORCH"
    )
    assert plan.backend.name == "torch"
    with pytest.raises(ValueError, match="requested: unknown backend 'torch-ish'"):
        select_backend(
            torch.device("cpu"), dtype=torch.float32, head_dim_qk=192, head_dim_vo=128, requested="Torch-ish"
        )
