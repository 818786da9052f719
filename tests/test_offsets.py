"""What the kernels really address, and what a plan's FlashInfer plans hold.

* 32-bit offsets: fa2 (``uint32_t``) and cutlass (``int``) compute ``token * stride_n + head * stride_h + d``; the
  bound is on that extent, through the real strides. mla_prefill hands the kernels k and v as views of one
  ``[N, H, head_dim_qk + head_dim_vo]`` buffer, so a pass reaches ``N x H x 320`` (DeepSeek), not ``N x H x 192``.
  Dispatch, the fused bound, the chunk size and the run-time check are tested on the CPU (fake devices; no 10 GB
  tensors here); tests/gpu/test_gpu_offsets.py runs the fa2 case past 2**32 on the H200.
* Memory: every FlashInfer 0.7.4 wrapper is constructed with an 8 MiB int workspace and 8 MiB of page-locked host
  memory; a chunked plan holds one wrapper per distinct chunk shape. A stand-in modelled on FlashInfer 0.7.4
  (constructor buffers as meta tensors: their sizes without the memory; ``plan()`` allocating its schedule from the
  int workspace as ``scheduler.cuh`` does) measures what a plan holds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import mla_bridge.dispatch as dispatch
import mla_bridge.ragged as ragged_mod
from mla_bridge import MLADims, PrefillPlan, Workspace, plan_ragged, ragged_prefill, select_backend
from mla_bridge.dispatch import OFFSET_LIMITS, BackendChoice, pass_extents, tensor_extent
from mla_bridge.prefill import prefill_memory_bytes, validate_prefill_inputs
from mla_bridge.ragged import RaggedPlan, RaggedSpec
from tests.helpers.fake_device import install_planning

BF16 = torch.bfloat16
V3 = MLADims.deepseek_v3()  # 128 heads, 192 / 128
ROW = 128 * (192 + 128)  # elements per key token of a pass's k/v buffer
MIB = 1 << 20


@pytest.fixture
def fi(monkeypatch):
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    monkeypatch.setattr(dispatch, "_CHOICES", {})


def kv_view_strides(heads=128, d_qk=192, d_vo=128):
    """(q, k, v) strides of mla_prefill's passes: q contiguous, k and v views of one [N, H, d_qk + d_vo] buffer."""
    p = d_qk + d_vo
    return (None, (heads * p, p), (heads * p, p))


def ask(cap, n_kv, *, strides=None, requested=None, n_q=1, causal=False):
    return select_backend(
        capability=cap,
        cuda_version=(12, 8),
        dtype=BF16,
        out_dtype=BF16,
        head_dim_qk=192,
        head_dim_vo=128,
        num_heads=128,
        causal=causal,
        qo_indptr=[0, n_q],
        kv_indptr=[0, n_kv],
        strides=strides,
        requested=requested,
    )


# ---------------------------------------------------------------------------------------------------------------
# extents
# ---------------------------------------------------------------------------------------------------------------


def test_tensor_extent_is_what_a_view_reaches():
    """tensor_extent of a view's (token, head) strides equals one past the largest element offset torch reports for
    that view (both layouts of the [N, H, 320] buffer: k first or v first)."""
    buf = torch.empty(7, 3, 20)
    for view in (buf[..., :12], buf[..., 12:], buf[..., 8:], buf[..., :8], buf, buf.transpose(0, 1)[:2]):
        n, h, d = view.shape
        reach = 1 + sum((s - 1) * st for s, st in zip(view.shape, view.stride()))
        assert tensor_extent(n, h, d, view.stride()[:2]) == reach
    assert tensor_extent(7, 3, 20) == 7 * 3 * 20 and tensor_extent(0, 3, 20, (60, 20)) == 0
    # 105000 keys at 128 heads: a pass over the 320-wide buffer reaches N x H x 320 - 128 (k of the split layout)
    n = 105_000
    assert tensor_extent(n, 128, 192, (ROW, 320)) == n * ROW - 128 >= 2**32 > n * 128 * 192
    names = dict(pass_extents(1, n, 128, 192, 128, kv_view_strides()))
    assert names == {"q": 128 * 192, "k": n * ROW - 128, "v": n * ROW - 192, "out": 128 * 128}


@pytest.mark.parametrize(
    "strides, err",
    [
        ((1, 2), TypeError),
        (((1, 2), None), TypeError),
        ((None, (1, 2, 3), None), TypeError),
        ((None, (1.5, 2), None), TypeError),
        ((None, (-1, 2), None), ValueError),
        ("abc", TypeError),
    ],
)
def test_bad_strides_are_refused_by_name(fi, strides, err):
    with pytest.raises(err, match="strides"):
        ask((8, 0), 10, strides=strides)


# ---------------------------------------------------------------------------------------------------------------
# dispatch: k/v views of the 320-wide buffer
# ---------------------------------------------------------------------------------------------------------------


def test_fa2_refused_where_the_320_wide_views_cross_2_32(fi):
    """110000 keys x 128 heads: 2.7e9 elements of 192 (below 2**32) but 4.5e9 through the 320-wide buffer's strides:
    fa2 would wrap its uint32 offsets. Counted through the strides, fa2 is passed over (SM80: the torch backend) and
    refused when forced; a contiguous k/v of the same size is still fa2's."""
    n = 110_000
    assert n * 128 * 192 < 2**32 <= n * ROW
    assert ask((8, 0), n).name == "flashinfer-fa2"  # contiguous k/v: 192 wide
    choice = ask((8, 0), n, strides=kv_view_strides())
    assert choice.name == "torch"
    reason = dict(choice.passed_over)["flashinfer-fa2"]
    assert f"a q/k/v tensor of {n * ROW - 128} elements" in reason and str(2**32) in reason and "k" in reason
    with pytest.raises(ValueError, match=r"flashinfer-fa2.*offset limit"):
        ask((8, 0), n, strides=kv_view_strides(), requested="flashinfer-fa2")


def test_cutlass_routed_to_fa2_where_the_views_cross_2_31(fi):
    """60000 keys: below 2**31 at 192 wide, past it at 320: on SM100 the pass goes to fa2 (still below 2**32)."""
    n = 60_000
    assert n * 128 * 192 < 2**31 <= n * ROW < 2**32
    assert ask((10, 0), n).name == "flashinfer-cutlass"
    choice = ask((10, 0), n, strides=kv_view_strides())
    assert choice.name == "flashinfer-fa2" and str(2**31) in dict(choice.passed_over)["flashinfer-cutlass"]


def test_fa3_takes_what_its_64_bit_offsets_allow(fi):
    assert ask((9, 0), 200_000, strides=kv_view_strides()).name == "flashinfer-fa3"  # 8.2e9 elements


def test_remembered_answers_are_keyed_by_the_strides(fi):
    """On SM80 answers are remembered: the same lengths with and without the wide strides are two answers."""
    n = 110_000
    first = ask((8, 0), n)
    assert ask((8, 0), n, strides=kv_view_strides()).name == "torch"
    assert ask((8, 0), n) is first and first.name == "flashinfer-fa2"


# ---------------------------------------------------------------------------------------------------------------
# PrefillPlan: every pass within the offsets of its backend
# ---------------------------------------------------------------------------------------------------------------


class PlanOnly:
    """FlashInfer's ragged wrapper as far as planning goes."""

    def __init__(self, buf, backend):
        self._float_workspace_buffer = buf
        self.backend = backend

    def plan(self, *args, **kwargs):
        pass


@pytest.fixture
def fake(monkeypatch):
    """A fake CUDA device of the capability set in the returned dict (SM90 by default)."""
    install_planning(monkeypatch.setattr, PlanOnly)
    cap = {"now": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: cap["now"])
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    return cap


def passes(plan):
    return [plan.main] + list({id(c.plan): c.plan for c in plan.chunks if c.plan is not None}.values())


def assert_within_offsets(plan, dims=V3):
    """Each pass's q/k/v/out, k and v as views of its [N, H, 320] buffer, reach below its backend's limit."""
    for p in passes(plan):
        s = p.spec
        reach = max(
            e
            for _, e in pass_extents(
                s.num_qo_tokens,
                s.num_kv_tokens,
                dims.num_heads,
                dims.head_dim_qk,
                dims.head_dim_vo,
                kv_view_strides(dims.num_heads),
            )
        )
        limit = OFFSET_LIMITS.get(p.backend.name)
        assert limit is None or reach < limit, (p, reach, limit)


def build(q_lens, c_lens, chunk_tokens=65536, backend=None, dims=V3):
    ws = Workspace("cuda:0", chunk_tokens=chunk_tokens)
    return PrefillPlan.build(q_lens, c_lens, dims=dims, workspace=ws, block_size=64, dtype=BF16, backend=backend)


def test_sm100_default_chunk_stays_with_cutlass(fake):
    """SM100, 128 heads: a 65536-token chunk's k/v buffer reaches 2.68e9 elements, past cutlass's int offsets. Chunks
    are cut at 52428 tokens instead, so each is cutlass's and within 2**31."""
    fake["now"] = (10, 0)
    plan = build([4, 4], [60_000, 10_000])
    assert not plan.fused
    assert max(c.num_tokens for c in plan.chunks) == (2**31 - 1) // ROW == 52428
    assert {p.backend.name for p in passes(plan)} == {"flashinfer-cutlass"}
    assert_within_offsets(plan)


def test_sm100_fused_bound_counts_the_320_wide_buffer(fake):
    """The fused pass's keys: 52428 x 128 x 320 < 2**31 <= 52429 x 128 x 320. From 52429 keys the context goes to the
    chunked schedule (before: fused up to 87381 keys, its k/v past cutlass's int offsets)."""
    fake["now"] = (10, 0)
    fits, crosses = build([1], [52_427]), build([1], [52_428])
    assert fits.fused and not crosses.fused
    for plan in (fits, crosses):
        assert {p.backend.name for p in passes(plan)} == {"flashinfer-cutlass"}
        assert_within_offsets(plan)


def test_forced_fa2_chunks_stay_below_2_32(fake):
    """fa2 forced, a 120000-token chunk budget over contexts of 105000 + 15000: one chunk's k/v would reach 4.9e9
    elements (the second request starting at element offset 105000 x 40960 = 4,300,800,000). Chunks are cut at
    104857 tokens: every pass fa2 and within 2**32."""
    plan = build([8, 8], [105_000, 15_000], chunk_tokens=120_000, backend="flashinfer-fa2")
    assert max(c.num_tokens for c in plan.chunks) == (2**32 - 1) // ROW == 104857
    assert {p.backend.name for p in passes(plan)} == {"flashinfer-fa2"}
    assert_within_offsets(plan)


def test_fa3_chunks_keep_the_budget(fake):
    """fa3 has 64-bit offsets: the chunk budget is kept as given."""
    plan = build([8, 8], [105_000, 15_000], chunk_tokens=120_000)
    assert [c.num_tokens for c in plan.chunks] == [120_000]
    assert {p.backend.name for p in passes(plan)} == {"flashinfer-fa3"}


def test_forced_fa2_main_pass_past_2_32_is_refused_at_plan_time(fake):
    """The chunked main pass reads the new tokens' k/v through the same 320-wide buffer: 110000 new tokens cannot be
    fa2's; forced, the plan is refused (named) before any kernel."""
    with pytest.raises(ValueError, match=r"flashinfer-fa2.*offset limit.*k, counted through its strides"):
        build([110_000], [0], backend="flashinfer-fa2")


# ---------------------------------------------------------------------------------------------------------------
# run time: tensors the plan has not seen
# ---------------------------------------------------------------------------------------------------------------


class RunRecorder(PlanOnly):
    runs: list = []

    def run(self, q, k, v, out=None, lse=None, **kwargs):
        RunRecorder.runs.append((q, k, v))
        out.fill_(1.0)
        return out, lse


@pytest.fixture
def fake_sm80(monkeypatch):
    """A fake SM80 device whose fa2 offsets end at 4096 elements (small tensors cross it)."""
    install_planning(monkeypatch.setattr, RunRecorder)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    monkeypatch.setitem(OFFSET_LIMITS, "flashinfer-fa2", 4096)
    RunRecorder.runs = []


def test_run_refuses_a_strided_k_past_the_plans_offsets(fake_sm80):
    """Planned for contiguous tensors (8 keys x 2 heads x 64: 1024 elements), fa2. Handed k and v as views of a
    [8, 2, 512] buffer (k reaches 7 x 1024 + 512 + 64 = 7744 elements), the run refuses k by name before any kernel,
    out untouched; the same values contiguous run. (The plan is made on the CPU device with fa2's choice, so that
    the CPU tensors pass the device check and reach the kernel's stand-in.)"""
    spec = RaggedSpec(
        torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([0, 8], dtype=torch.int32),
        2,
        64,
        64,
        True,
        0.125,
        BF16,
        torch.device("cpu"),
    )
    plan = RaggedPlan(spec, BackendChoice("flashinfer-fa2", "stand-in"), Workspace("cpu"))
    q = torch.randn(8, 2, 64).to(BF16)
    buf = torch.randn(8, 2, 512).to(BF16)
    k, v = buf[..., :64], buf[..., 64:128]
    out = torch.full((8, 2, 64), 7.0, dtype=BF16)
    with pytest.raises(ValueError, match=r"k reaches 7744 elements through its strides.*flashinfer-fa2.*4096"):
        plan.run(q, k, v, out=out)
    assert RunRecorder.runs == [] and bool((out == 7.0).all())
    plan.run(q, k.contiguous(), v.contiguous(), out=out)
    assert len(RunRecorder.runs) == 1 and bool((out == 1.0).all())


def test_strides_declared_at_plan_time_route_the_pass(fake_sm80):
    """The same views declared to plan_ragged: fa2 is passed over (the torch backend serves), naming k's reach."""
    plan = plan_ragged(
        [0, 8],
        [0, 8],
        num_heads=2,
        head_dim_qk=64,
        head_dim_vo=64,
        causal=True,
        sm_scale=0.125,
        dtype=BF16,
        workspace=Workspace("cuda:0"),
        strides=(None, (1024, 512), (1024, 512)),
    )
    assert plan.backend.name == "torch"
    assert "a q/k/v tensor of 7744 elements" in dict(plan.backend.passed_over)["flashinfer-fa2"]


def test_ragged_prefill_plans_with_its_tensors_strides(monkeypatch, ref):
    """ragged_prefill sees its tensors before planning: it hands their strides to the dispatch (views read in place),
    and its result is the float64 reference's."""
    seen = []
    real = ragged_mod.plan_ragged

    def spy(*args, **kwargs):
        seen.append(kwargs.get("strides"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ragged_mod, "plan_ragged", spy)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, 24, generator=g)
    buf = torch.randn(9, 2, 40, generator=g)
    k, v = buf[..., 16:], buf[..., :16]
    out, lse = ragged_prefill(q, k, v, [0, 2, 5], [0, 4, 9], causal=True, sm_scale=0.2)
    assert seen == [(None, (80, 40), (80, 40))]
    want_out, want_lse = ref.ragged_reference(q, k, v, [0, 2, 5], [0, 4, 9], causal=True, sm_scale=0.2)
    ref.assert_out_close(out, want_out, atol=1e-5)
    ref.assert_lse_close(lse, want_lse, atol=1e-5)


def test_mla_prefill_refuses_a_strided_q_past_a_pass_offsets(tiny_dims, ref, monkeypatch):
    """mla_prefill's passes are planned for a contiguous q; a strided q that reaches past the smallest offset limit
    among them is refused by name with the other input checks, before any kernel (the limit stands in for fa2's on
    this CPU plan)."""
    batch = ref.make_mla_batch(tiny_dims, [3, 2], [5, 0], 4)
    plan = PrefillPlan.build(
        [3, 2], [5, 0], dims=tiny_dims, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32
    )
    assert plan.offset_limit == (None, None)  # the torch backend: no limit
    wide = torch.zeros(5, tiny_dims.num_heads, 64)
    wide[..., : tiny_dims.head_dim_qk] = batch.q
    q = wide[..., : tiny_dims.head_dim_qk]  # reaches 4 x 256 + 3 x 64 + 24 = 1240 elements
    args = (batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan)
    validate_prefill_inputs(q, *args)
    monkeypatch.setattr(PrefillPlan, "offset_limit", property(lambda self: (1200, "flashinfer-fa2")))
    with pytest.raises(ValueError, match=r"q reaches 1240 elements through its strides.*flashinfer-fa2"):
        validate_prefill_inputs(q, *args)
    validate_prefill_inputs(q.contiguous(), *args)  # 480 elements


# ---------------------------------------------------------------------------------------------------------------
# memory a chunked plan's FlashInfer plans hold
# ---------------------------------------------------------------------------------------------------------------


class FlashInferLike:
    """FlashInfer 0.7.4's BatchPrefillWithRaggedKVCacheWrapper as far as memory goes (see the module docstring):
    ``plan()`` allocates the schedule of ``scheduler.cuh`` (``PrefillPlanImpl`` for fa2, ``PrefillSM90Plan`` for fa3,
    on a device of 132 SMs, MHA) from its int workspace, raising FlashInfer's "Buffer overflow" where it does not fit,
    copies the indptrs to the "device", and for cutlass keeps ``fmha_varlen_plan``'s four work buffers."""

    SMS = 132
    instances: list = []

    def __init__(self, float_workspace, backend):
        self.backend = backend
        self._float_workspace_buffer = float_workspace
        self._int_workspace_buffer = torch.empty(8 * MIB, dtype=torch.uint8, device="meta")
        self._pin_memory_int_workspace_buffer = torch.empty(8 * MIB, dtype=torch.uint8, device="meta")
        self.used = []
        FlashInferLike.instances.append(self)

    def plan(
        self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, causal=False, **kwargs
    ):
        q, kv = np.diff(qo_indptr.numpy()).astype(np.int64), np.diff(kv_indptr.numpy()).astype(np.int64)
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr.clone(), kv_indptr.clone()
        if self.backend == "cutlass":
            self._plan_info = tuple(
                torch.empty(n, dtype=torch.int32, device="meta") for n in (self.SMS + 1, 131072, 131072, 131072)
            )
            return
        allocations = (
            self._fa2(q, kv, num_qo_heads, head_dim_vo)
            if self.backend == "fa2"
            else self._fa3(q, num_qo_heads, head_dim_vo)
        )
        have, used = self._int_workspace_buffer.numel(), 0
        for name, size, align in allocations:
            start = -(-used // align) * align
            if start + size > have:
                raise RuntimeError(
                    f"Buffer overflow when allocating memory for {name} with size {size} and alignment "
                    f"{align}, but only {have - used} bytes available in AlignedAllocator. Increase the "
                    f"workspace buffer size."
                )
            used = start + size
        self.used.append(used)
        self._plan_info = [0] * 15

    def _fa2(self, q, kv, heads, d_vo):
        b, t = q.size, int(q.sum())
        avg = t // b
        cta = 128 if avg > 64 and d_vo < 256 else (64 if avg > 16 else 16)  # FA2DetermineCtaTileQ, SM80+
        tiles = -(-q // cta)
        kv1 = np.maximum(kv, 1)
        low, high = 128, int(kv1.max())
        while low < high:  # PrefillBinarySearchKVChunkSize
            mid = (low + high) // 2
            if int((tiles * -(-kv1 // mid)).sum()) > 2 * self.SMS // heads:
                low = mid + 1
            else:
                high = mid
        split = low < int(kv1.max())
        work = int((tiles * -(-kv1 // low)).sum())
        names = ("request_indices", "qo_tile_indices", "kv_tile_indices")
        out = [(f"batch_prefill_{n}", 4 * work, 16) for n in names]
        out += [("batch_prefill_o_indptr", 4 * (b + 1), 16), ("batch_prefill_kv_chunk_size_ptr", 4, 1)]
        return out + ([("batch_prefill_merge_indptr", 4 * (t + 1), 16)] if split else [])

    def _fa3(self, q, heads, d_vo):
        b, t = q.size, int(q.sum())
        cta = 192 if d_vo == 64 else 128
        per_head = int((-(-q // cta)).sum())
        works = per_head * (1 if -(-t // cta) + b - 1 > 4096 else heads)
        names = ("qo_tile_indices", "qo_offset", "kv_offset", "qo_len", "kv_len", "head_indices")
        out = [(f"batch_prefill_sm90_{n}", 4 * works, 16) for n in names]
        return out + [
            ("batch_prefill_sm90_work_indptr", 4 * (self.SMS + 1), 16),
            ("batch_prefill_sm90_batch_indices", 4 * works, 16),
        ]


def held_by_wrappers(plan):
    """(device, page-locked host) bytes held by the plan's wrappers, read off the stand-ins themselves."""
    device = host = 0
    for p in passes(plan):
        w = p.flashinfer_wrapper
        device += w._int_workspace_buffer.nbytes + w._qo_indptr_buf.nbytes + w._kv_indptr_buf.nbytes
        device += sum(t.nbytes for t in w._plan_info if isinstance(t, torch.Tensor))
        host += w._pin_memory_int_workspace_buffer.nbytes
    return device, host


def many_shapes():
    """64 requests with 2000 to 8000 cached tokens and 1 to 256 new ones: at chunk_tokens=2048, 160 chunks of 114
    distinct shapes."""
    r = random.Random(2)
    c_lens = [r.randint(2000, 8000) for _ in range(64)]
    q_lens = [r.randint(1, 256) for _ in range(64)]
    return q_lens, c_lens


@pytest.fixture
def flashinfer_like(monkeypatch):
    install_planning(monkeypatch.setattr, FlashInferLike)
    cap = {"now": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: cap["now"])
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    FlashInferLike.instances = []
    return cap


@pytest.mark.parametrize(
    "cap, backend, limit_mib",
    [((9, 0), "flashinfer-fa3", 12), ((8, 0), "flashinfer-fa2", 2), ((10, 0), "flashinfer-cutlass", 200)],
)
def test_chunk_plans_hold_what_their_schedules_need(flashinfer_like, monkeypatch, cap, backend, limit_mib):
    """115 FlashInfer plans (the main pass + 114 chunk shapes). Each wrapper came with 16 MiB (8 device + 8
    page-locked): 1.8 GiB for the plan. Now each int workspace is sized to its schedule: fa3 and fa2 hold a few
    MiB in all, cutlass FlashInfer's own 1.5 MiB of work buffers per plan (which mla_bridge cannot size). No plan
    overflowed (FlashInfer's allocations fit the estimate), none grew; what is held is flashinfer_bytes, and
    prefill_memory_bytes counts it."""
    flashinfer_like["now"] = cap
    q_lens, c_lens = many_shapes()
    ws = Workspace("cuda:0", chunk_tokens=2048)
    plan = PrefillPlan.build(q_lens, c_lens, dims=V3, workspace=ws, block_size=64, dtype=BF16)
    assert plan.num_plans == 115 and {p.backend.name for p in passes(plan)} == {backend}
    device, host = held_by_wrappers(plan)
    print(f"\n{backend}: {plan.num_plans} plans hold {device / MIB:.2f} MiB device + {host / MIB:.2f} MiB page-locked")
    assert device + host < limit_mib * MIB, (device, host)
    assert ws.int_workspace_growths == 0 and len(FlashInferLike.instances) == plan.num_plans
    assert plan.flashinfer_bytes == (device, host)
    if backend == "flashinfer-fa3":  # fa3's bound is its schedule's (fa2's reserves split-KV's arrays too)
        for w in FlashInferLike.instances:
            assert w._int_workspace_buffer.nbytes <= max(8192, 4 * w.used[-1])
    total = prefill_memory_bytes(plan)
    monkeypatch.setattr(PrefillPlan, "flashinfer_bytes", property(lambda self: (0, 0)))
    assert total - prefill_memory_bytes(plan) == device


def test_int_workspace_grows_where_flashinfer_reports_it_small(flashinfer_like, monkeypatch):
    """An estimate below what FlashInfer's schedule allocates (here: none at all) costs one growth of that
    wrapper's int workspace and a plan again, never FlashInfer's "Buffer overflow" nor a larger float workspace."""
    import mla_bridge.backends.flashinfer as fi_backend

    monkeypatch.setattr(fi_backend, "int_workspace_bytes", lambda backend, spec: 0)
    ws = Workspace("cuda:0")
    float_bytes = ws.float_workspace_bytes
    plan = plan_ragged(
        [0, 3000, 6000],
        [0, 3000, 6000],
        num_heads=128,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=True,
        sm_scale=0.1,
        dtype=BF16,
        workspace=ws,
    )
    w = plan.flashinfer_wrapper
    assert plan.backend.name == "flashinfer-fa3" and ws.int_workspace_growths >= 1
    assert w.used and w._int_workspace_buffer.nbytes >= w.used[-1] > 4096
    assert w._pin_memory_int_workspace_buffer.nbytes == w._int_workspace_buffer.nbytes
    assert ws.float_workspace_bytes == float_bytes


def test_a_pooled_wrapper_keeps_buffers_that_fit(flashinfer_like):
    """A wrapper handed to a second plan of a similar schedule keeps its int workspace (no new buffers); one of a
    much smaller schedule gets a smaller one."""
    import gc

    ws = Workspace("cuda:0")
    common = dict(num_heads=128, head_dim_qk=192, head_dim_vo=128, causal=True, sm_scale=0.1, dtype=BF16, workspace=ws)
    first = plan_ragged([0, 3000], [0, 3000], **common)
    w = first.flashinfer_wrapper
    buf = w._int_workspace_buffer
    del first
    gc.collect()
    second = plan_ragged([0, 2900], [0, 2900], **common)
    assert second.flashinfer_wrapper is w and w._int_workspace_buffer is buf
    del second
    gc.collect()
    third = plan_ragged([0, 10], [0, 10], **common)
    assert third.flashinfer_wrapper is w and w._int_workspace_buffer.nbytes == 8192 < buf.nbytes // 4


def test_vllm_adapter_declares_vllms_v_view(fake):
    """vLLM hands v as a view into the up-projected [S, H, 256] buffer: declared at plan time (vllm_strides), a
    60000-token chunk on SM100 (v reaching 60000 x 128 x 256 = 1.97e9, k 1.47e9 contiguous: below 2**31) stays with
    cutlass, and a 70000-token one (v at 2.29e9) goes to fa2 at plan time, where before it was planned for cutlass and
    its v run through cutlass's int offsets."""
    from mla_bridge_vllm.plans import ChunkIndptrs, PrefillStepPlans, vllm_strides

    fake["now"] = (10, 0)
    assert vllm_strides(128, 128, 128) == (None, None, (128 * 256, 256))
    qo = torch.tensor([0, 4], dtype=torch.int32)
    chunks = [
        ChunkIndptrs(0, qo, torch.tensor([0, 60_000], dtype=torch.int32)),
        ChunkIndptrs(1, qo, torch.tensor([0, 70_000], dtype=torch.int32)),
    ]
    plans = PrefillStepPlans(
        qo,
        chunks,
        num_heads=128,
        head_dim_qk=192,
        head_dim_vo=128,
        sm_scale=0.1,
        dtype=BF16,
        device="cuda:0",
        workspace=Workspace("cuda:0"),
        strides=vllm_strides(128, 128, 128),
    )
    assert plans.chunks[0].backend.name == "flashinfer-cutlass"
    assert plans.chunks[1].backend.name == "flashinfer-fa2"
    assert "v, counted through its strides" in dict(plans.chunks[1].backend.passed_over)["flashinfer-cutlass"]


# ---------------------------------------------------------------------------------------------------------------
# contiguous q/k/v at the 32-bit limits (dispatch), and the fused schedule's bound on the CPU
# ---------------------------------------------------------------------------------------------------------------


MLA_128_HEADS = dict(dtype=torch.bfloat16, head_dim_qk=192, head_dim_vo=128, num_heads=128, causal=True)


@pytest.mark.parametrize(
    "t,limit,name",
    [
        (87382, dispatch.CUTLASS_ELEMENT_LIMIT, "flashinfer-cutlass"),
        (174763, dispatch.FA2_ELEMENT_LIMIT, "flashinfer-fa2"),
    ],
)
def test_int32_offset_token_counts_are_the_first_past_each_limit(t, limit, name):
    """The token counts of the dispatch cases below are the first whose contiguous q and k (128 heads, 192 wide) reach
    each backend's limit: pass_extents' value, against the product written out, on either side of the limit."""
    at, below = dict(pass_extents(t, t, 128, 192, 128)), dict(pass_extents(t - 1, t - 1, 128, 192, 128))
    assert at["q"] == at["k"] == t * 128 * 192 >= limit == OFFSET_LIMITS[name]
    assert below["q"] == below["k"] == (t - 1) * 128 * 192 < limit


@pytest.mark.parametrize(
    "t,cap,expected,limit",
    [
        (87381, (10, 0), "flashinfer-cutlass", None),
        (87382, (10, 0), "flashinfer-fa2", str(2**31)),  # cutlass is held to 2**31 (int strides)
        (87382, (8, 0), "flashinfer-fa2", None),  # fa2: measured correct up to 2**32 elements
        (174763, (8, 0), "torch", str(2**32)),  # fa2 wrong past 2**32: refused
        (174763, (10, 0), "torch", str(2**31)),
        (87382, (9, 0), "flashinfer-fa3", None),  # fa3: measured correct at 6.4e9 elements
    ],
)
def test_int32_offset_limits_in_dispatch(fi, t, cap, expected, limit):
    choice = select_backend(capability=cap, cuda_version=(12, 8), qo_indptr=[0, t], kv_indptr=[0, t], **MLA_128_HEADS)
    assert choice.name == expected
    if limit is not None:
        reasons = " ".join(r for _, r in choice.passed_over)
        assert limit in reasons and str(t * 128 * 192) in reasons


@pytest.mark.parametrize(
    "t,cap,forced",
    [(87382, (10, 0), "flashinfer-cutlass"), (174763, (8, 0), "flashinfer-fa2"), (174763, (9, 0), "flashinfer-fa2")],
)
def test_int32_offsets_forced_backend_refused_before_any_kernel(fi, t, cap, forced):
    with pytest.raises(ValueError, match=rf"{forced}.*offset limit"):
        select_backend(
            capability=cap, cuda_version=(12, 8), qo_indptr=[0, t], kv_indptr=[0, t], requested=forced, **MLA_128_HEADS
        )


@pytest.mark.parametrize("cap,limit,name", [((10, 0), 2**31, "flashinfer-cutlass"), ((8, 0), 2**32, "flashinfer-fa2")])
def test_int32_offset_limit_is_exclusive(fi, cap, limit, name):
    """128/128 dims and 128 heads hit the limits exactly: a tensor of exactly the limit is refused, one row less
    is served."""
    t = limit // (128 * 128)
    common = dict(
        capability=cap,
        cuda_version=(12, 8),
        dtype=torch.bfloat16,
        head_dim_qk=128,
        head_dim_vo=128,
        num_heads=128,
        causal=False,
    )
    assert select_backend(qo_indptr=[0, t - 1], kv_indptr=[0, t - 1], **common).name == name
    choice = select_backend(qo_indptr=[0, t], kv_indptr=[0, t], **common)
    assert choice.name != name and str(limit) in dict(choice.passed_over)[name]


def test_int32_offsets_kv_side_counts_too(fi):
    """A short q over a long k: the k tensor is what crosses the limit."""
    choice = select_backend(
        capability=(10, 0),
        cuda_version=(12, 8),
        qo_indptr=[0, 1],
        kv_indptr=[0, 87382],
        **dict(MLA_128_HEADS, causal=False),
    )
    assert choice.name == "flashinfer-fa2"
    assert str(2**31) in dict(choice.passed_over)["flashinfer-cutlass"]


def test_fused_schedule_stays_under_2_31(tiny_dims):
    """The fused schedule (context + new keys in one tensor) is not chosen when its keys' k/v buffer would reach
    2**31 elements, so fusing never changes the backend; the chunked schedule bounds each pass by chunk_tokens. k and
    v are views of one [keys, H, 192 + 128] buffer: 320 elements per head and key, not 192."""
    from mla_bridge import MLADims

    dims = MLADims.deepseek_v3()  # 128 heads x (192 + 128)
    per_token = 128 * 320
    limit_tokens = -(-(2**31) // per_token)  # 52429
    ws = Workspace("cpu", chunk_tokens=200_000)
    small = PrefillPlan.build([1], [limit_tokens - 2], dims=dims, workspace=ws, block_size=64, dtype=torch.float32)
    big = PrefillPlan.build([1], [limit_tokens - 1], dims=dims, workspace=ws, block_size=64, dtype=torch.float32)
    assert small.fused and not big.fused
    assert (limit_tokens - 1) * per_token < 2**31 <= limit_tokens * per_token
