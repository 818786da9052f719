"""PrefillPlan.build's host fast paths: what they skip or remember must not change any answer.

* The CUDA branch of the per-token index expansion (one page-locked table, one copy, then one Triton kernel or four
  torch kernels) runs here on CPU tensors with a fake CUDA device, and must give the index tensors of the CPU
  device's numpy expansion; the Triton kernel itself runs interpreted where Triton is installed.
* Chunk bounds computed with numpy equal the reference loop :func:`schedule_context_chunks`.
* The passes planned through the internal (unvalidated) path equal :func:`plan_ragged`'s on the same indptrs.
* :func:`select_backend` remembers answers only by everything they depend on.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

import mla_bridge.dispatch as dispatch
import mla_bridge.plan as plan_mod
from mla_bridge import MLADims, PrefillPlan, Workspace, plan_ragged, select_backend
from mla_bridge.plan import schedule_context_chunks
from tests.helpers.fake_device import install_planning, page_locked_on_cpu
from tests.helpers.run_tables import expanded, index_tensors, run_table, run_tables

BF16 = torch.bfloat16


class _Wrapper:
    """FlashInfer's ragged wrapper as far as planning goes: records what each plan() was given."""

    def __init__(self, buf, backend):
        self._float_workspace_buffer = buf
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)
        self.planned = []

    def plan(self, qo, kv, *args, **kwargs):
        self.planned.append((qo.tolist(), kv.tolist(), kwargs["causal"]))


@pytest.fixture(params=["triton", "torch"])
def fake_cuda(monkeypatch, request):
    """A fake SM90 device: planning takes every CUDA branch; the device half of the expansion, each of the two
    (the Triton kernel's stand-in and the torch ops), runs on the CPU
    (:func:`tests.helpers.fake_device.install_planning`). Returns the list of tables expanded."""
    tables = []
    install_planning(monkeypatch.setattr, _Wrapper, tables, expand=request.param)
    return tables


CASES = [  # (query_lens, context_lens, chunk_tokens): fused, chunked, requests without context or new tokens
    ([3, 4, 1, 5], [10, 0, 7, 20], 64),
    ([3, 4, 1, 5], [10, 0, 7, 20], 8),
    ([2, 3, 0, 4], [4, 0, 6, 3], 5),
    ([0, 2, 0], [5, 0, 9], 4),
    ([1], [17], 1),
    ([5, 5], [0, 0], 16),
    ([2, 0, 3, 1], [0, 6, 0, 6], 6),
]


@pytest.mark.parametrize("q_lens,c_lens,chunk", CASES)
def test_cuda_expansion_gives_the_cpu_index_tensors(fake_cuda, tiny_dims, q_lens, c_lens, chunk):
    """Every index tensor (fused placements, each chunk's requests and positions) on the CUDA device equals the CPU
    device's numpy one. The fused schedule makes them by ONE device expansion (one host-to-device table per plan);
    the chunked one makes none at all, on either device: each chunk's rows are its pass's kv_indptr (ChunkRows), from
    which its requests and positions follow; hand-checked values for one case."""
    cuda = PrefillPlan.build(
        q_lens, c_lens, dims=tiny_dims, workspace=Workspace("cuda:0", chunk_tokens=chunk), block_size=4, dtype=BF16
    )
    cpu = PrefillPlan.build(
        q_lens, c_lens, dims=tiny_dims, workspace=Workspace("cpu", chunk_tokens=chunk), block_size=4, dtype=BF16
    )
    assert cuda.fused == cpu.fused and len(cuda.chunks) == len(cpu.chunks)
    got, want = index_tensors(cuda), index_tensors(cpu)
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            assert got[name].dtype == torch.int64 and got[name].is_contiguous(), name
            assert torch.equal(got[name], want[name]), name
    assert len(fake_cuda) == (1 if cuda.fused else 0)  # one table (one copy) for a fused plan, none otherwise
    # private: _device_indices (and _pinned_runs) are the only view of the device buffers a plan keeps (the memory
    # guarantee tested here)
    if cuda.fused:  # ONE device buffer, which every index tensor views, and its page-locked table
        assert len(cuda._device_indices) == 1 and cuda._pinned_runs is not None
        buffer = cuda._device_indices[0].untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == buffer for t in got.values() if t is not None)
    else:  # chunked: rows by each chunk's kv_indptr on the device (here the plan's own copy, one per pass and one
        # per chunk without a pass: the stand-in wrapper holds none; a real wrapper's copy is the wrapper's, kept by
        # the workspace's pool, not the plan's); no per-token tensor kept
        for c, host in zip(cuda.chunks, cpu.chunks):
            assert c.rows.indices is None and host.rows.indices is None  # the CPU's too: made per call
            assert (c.rows.req_start, c.rows.first_start, c.rows.num_tokens) == (
                c.req_start,
                c.first_start,
                c.num_tokens,
            )
            assert c.rows.kv_indptr.dtype == torch.int32 and torch.equal(c.rows.kv_indptr, c.kv_indptr)
            assert c.plan is None or torch.equal(c.rows.kv_indptr, c.plan.kv_indptr)
        passes = {id(c.plan) for c in cuda.chunks if c.plan is not None}
        assert len(cuda._device_indices) == len(passes) + sum(c.plan is None for c in cuda.chunks)
        assert len({id(c.rows.kv_indptr) for c in cuda.chunks}) == len(cuda._device_indices)
    if (q_lens, c_lens) == ([3, 4, 1, 5], [10, 0, 7, 20]) and cuda.fused:
        # key rows, context then new: request 0 at 0..12, 1 at 13..16, 2 at 17..24, 3 at 25..49
        assert cuda.ctx_dst.tolist() == list(range(10)) + list(range(17, 24)) + list(range(25, 45))
        assert cuda.new_dst.tolist() == [10, 11, 12, 13, 14, 15, 16, 24, 45, 46, 47, 48, 49]
        assert cuda.ctx_req_ids.tolist() == [0] * 10 + [2] * 7 + [3] * 20
        assert cuda.ctx_positions.tolist() == list(range(10)) + list(range(7)) + list(range(20))


def test_device_expansion_op_sequence_on_cpu_tensors(monkeypatch):
    """_expand_on_device itself: runs of counting and constant values, empty runs skipped, on CPU tensors."""
    monkeypatch.setattr(plan_mod, "_page_locked", page_locked_on_cpu)
    counts = np.array([2, 0, 3, 1, 0, 2], dtype=np.int64)
    firsts = np.array([5, 9, 0, 7, 1, 4], dtype=np.int64)
    counting_runs = 3
    ends = np.cumsum(counts)
    base = firsts - np.where(np.arange(6) < counting_runs, ends - counts, 0)
    out, host = plan_mod._expand_on_device(
        np.stack([ends, base]), int(ends[-1]), int(ends[counting_runs - 1]), torch.device("cpu")
    )
    assert out.tolist() == [5, 6, 0, 1, 2, 7, 4, 4]
    assert host.tolist() == [ends.tolist(), base.tolist()]


def test_context_stream_is_one_expansion_on_cpu_tensors(monkeypatch):
    """The chunked schedule's context stream as _expand_on_device's runs ``counts = [c, c]``, ``firsts = [0..0,
    0..B-1]``, the first B counting: each stream token's position in its request's context, then that request,
    requests with an empty context skipped (the first with a later end holds the token)."""
    monkeypatch.setattr(plan_mod, "_page_locked", page_locked_on_cpu)
    c = [3, 0, 2, 0, 0, 4, 1]
    counts, firsts = np.array(c + c), np.array([0] * len(c) + list(range(len(c))))
    ends, base = run_table(counts, firsts, len(c))
    out, host = plan_mod._expand_on_device(np.stack([ends, base]), int(ends[-1]), sum(c), torch.device("cpu"))
    assert out.dtype == torch.int64
    assert out.tolist() == [p for n in c for p in range(n)] + [r for r, n in enumerate(c) for _ in range(n)]
    assert host.tolist() == [ends.tolist(), base.tolist()]


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_expand_equals_the_runs_written_out(fake_cuda, device):
    """PrefillPlan._expand (its table, then numpy on the CPU device; on the fake CUDA device the Triton kernel's
    stand-in or the torch ops) gives the values of the runs written out, for every run table of run_tables."""
    for counts, firsts, counting_runs in run_tables():
        owner = types.SimpleNamespace(device=torch.device(device), _device_indices=[])
        out = PrefillPlan._expand(owner, counts, firsts, counting_runs)
        assert out.dtype == torch.int64 and out.is_contiguous()
        assert out.tolist() == expanded(counts, firsts, counting_runs), (counts.size, counting_runs)
        assert len(owner._device_indices) == (device != "cpu")


def test_expand_impl_is_chosen_in_one_place(monkeypatch):
    """The Triton kernel on CUDA where Triton imports, the torch ops on CUDA without it; the CPU device never asks
    (numpy)."""
    monkeypatch.setattr(plan_mod, "triton_available", lambda: True)
    assert plan_mod._expand_impl(torch.device("cuda", 0)) == "triton"
    assert plan_mod._expand_impl(torch.device("cpu")) == "torch"
    monkeypatch.setattr(plan_mod, "triton_available", lambda: False)
    assert plan_mod._expand_impl(torch.device("cuda", 1)) == "torch"


def interpreted_expand_cases() -> str:
    """The Triton expansion kernel (interpreted on CPU tensors) == the torch ops of _expand_on_device == the runs
    written out, on every table of run_tables (a block of 1024 tokens and one of 16, so that long runs span many)."""
    import mla_bridge.kernels.expand as expand_mod
    from mla_bridge.kernels.expand import expand_runs_triton

    plan_mod._page_locked = page_locked_on_cpu  # a subprocess of its own: not undone
    n = 0
    assert expand_mod.BLOCK == 1024
    for block in (1024, 16):
        expand_mod.BLOCK = block
        for counts, firsts, counting_runs in run_tables(seed=block, block=block):
            ends, base = run_table(counts, firsts, counting_runs)
            table = np.stack([ends, base]).reshape(2, counts.size)
            total = int(ends[-1]) if ends.size else 0
            counting = int(ends[counting_runs - 1]) if counting_runs else 0
            got = expand_runs_triton(torch.from_numpy(table), total, counting)
            torch_ops, _ = plan_mod._expand_on_device(table, total, counting, torch.device("cpu"))
            assert got.dtype == torch.int64 and got.shape == (total,)
            assert torch.equal(got, torch_ops), (block, counts.size, counting_runs)
            assert got.tolist() == expanded(counts, firsts, counting_runs)
            n += 1
    expand_mod.BLOCK = 1024
    return f"ok {n}"


def test_triton_expansion_equals_torch_ops_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_expand_cases` under the interpreter."""
    out = triton_interpreted("tests.test_plan_host:interpreted_expand_cases", "tests/gpu/test_gpu_expand.py")
    assert out.strip().startswith("ok ") and int(out.split()[-1]) >= 36, out


@pytest.mark.parametrize("seed", range(40))
def test_chunks_follow_the_reference_schedule(seed):
    """Chunk bounds from numpy (PrefillPlan._plan_chunks) = the reference loop schedule_context_chunks, for random
    batches with empty contexts, empty queries and budgets from 1 token to more than the whole context."""
    rng = random.Random(seed)
    batch = rng.randint(1, 12)
    c_lens = [rng.choice([0, 0, 1, 2, 5, 16, 33]) for _ in range(batch)]
    q_lens = [rng.choice([0, 1, 3]) for _ in range(batch)]
    chunk = rng.choice([1, 2, 3, 7, 16, 64, 1000])
    dims = MLADims(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace("cpu", chunk_tokens=chunk),
        block_size=4,
        dtype=torch.float32,
        fuse_context=False,
    )
    want = schedule_context_chunks(c_lens, chunk)
    assert [list(c.spans) for c in plan.chunks] == want
    qo = [0] + list(np.cumsum(q_lens))
    for c, spans in zip(plan.chunks, want):
        assert (c.req_start, c.req_end) == (spans[0][0], spans[-1][0] + 1)
        assert (c.q_start, c.q_end) == (qo[c.req_start], qo[c.req_end])
        kv_lens = [0] * (c.req_end - c.req_start)
        for r, s, e in spans:
            kv_lens[r - c.req_start] = e - s
        assert c.kv_indptr.tolist() == [0] + list(np.cumsum(kv_lens)) and c.kv_indptr.dtype == torch.int32
        assert c.num_tokens == sum(kv_lens) == c.req_ids.numel() == c.positions.numel()
        assert c.req_ids.tolist() == [r for r, s, e in spans for _ in range(s, e)]
        assert c.positions.tolist() == [p for r, s, e in spans for p in range(s, e)]
        if c.q_end > c.q_start:
            assert c.plan.kv_indptr.tolist() == c.kv_indptr.tolist()
            assert c.plan.qo_indptr.tolist() == [x - c.q_start for x in qo[c.req_start : c.req_end + 1]]
        else:
            assert c.plan is None


@pytest.mark.parametrize("q_lens,c_lens,chunk", CASES)
def test_internal_plans_equal_plan_ragged(fake_cuda, tiny_dims, q_lens, c_lens, chunk):
    """Every pass PrefillPlan plans without re-validating its own indptrs is the RaggedPlan plan_ragged makes from the
    same indptrs: equal spec, equal backend choice, and the same FlashInfer plan() call."""
    ws = Workspace("cuda:0", chunk_tokens=chunk)
    plan = PrefillPlan.build(q_lens, c_lens, dims=tiny_dims, workspace=ws, block_size=4, dtype=BF16)
    passes = [(plan.main, True)] + [(c.plan, False) for c in plan.chunks if c.plan is not None]
    for mine, causal in passes:
        public = plan_ragged(
            mine.qo_indptr.tolist(),
            mine.kv_indptr.tolist(),
            num_heads=tiny_dims.num_heads,
            head_dim_qk=tiny_dims.head_dim_qk,
            head_dim_vo=tiny_dims.head_dim_vo,
            causal=causal,
            sm_scale=tiny_dims.softmax_scale,
            dtype=BF16,
            workspace=ws,
        )
        for field in (
            "num_heads",
            "head_dim_qk",
            "head_dim_vo",
            "causal",
            "sm_scale",
            "dtype",
            "device",
            "num_qo_tokens",
            "num_kv_tokens",
        ):
            assert getattr(mine.spec, field) == getattr(public.spec, field), field
        for name in ("qo_indptr", "kv_indptr"):
            a, b = getattr(mine.spec, name), getattr(public.spec, name)
            assert a.dtype == b.dtype == torch.int32 and a.device.type == "cpu" and torch.equal(a, b), name
        assert mine.backend == public.backend
        if mine.flashinfer_wrapper is not None:
            assert mine.flashinfer_wrapper.planned[-1] == public.flashinfer_wrapper.planned[-1]


def test_build_checks_sizes_and_dtype_before_any_index_tensor(fake_cuda, tiny_dims):
    """A dtype or scale no pass can take is refused by name before the device expansion runs (it used to be found
    by the first pass's plan_ragged, after the index tensors had been queued)."""
    ws = Workspace("cuda:0", chunk_tokens=8)
    with pytest.raises(TypeError, match=r"dtype \(of q, k, v and out\) must be one of bfloat16"):
        PrefillPlan.build([3, 4], [10, 20], dims=tiny_dims, workspace=ws, block_size=4, dtype=torch.int32)
    huge = MLADims(
        num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, softmax_scale=1e300
    )
    with pytest.raises(ValueError, match="sm_scale must be a positive finite float"):
        PrefillPlan.build([3, 4], [10, 20], dims=huge, workspace=ws, block_size=4, dtype=BF16)
    assert fake_cuda == []


# ---------------------------------------------------------------------------------------------------------------
# select_backend remembers answers by everything they depend on
# ---------------------------------------------------------------------------------------------------------------

MLA = dict(head_dim_qk=192, head_dim_vo=128, num_heads=16)


def _ask(**over):
    kw = dict(dtype=BF16, out_dtype=BF16, causal=True, qo_indptr=[0, 4, 9], kv_indptr=[0, 8, 20], **MLA)
    kw.update(over)
    return select_backend(over.pop("device", "cuda:0"), **{k: v for k, v in kw.items() if k != "device"})


@pytest.fixture
def sm90(monkeypatch):
    caps = {"now": (9, 0)}
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: caps["now"])
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    return caps


def test_remembered_choice_follows_env_dtype_capability_and_flashinfer(sm90, monkeypatch):
    first = _ask()
    assert first.name == "flashinfer-fa3" and _ask() is first  # remembered
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "flashinfer-fa2")  # read at every call
    assert _ask().name == "flashinfer-fa2" and _ask().reason == "forced by MLA_BRIDGE_BACKEND"
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")
    assert _ask().name == "torch"
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "nope")
    for _ in range(2):  # errors are never remembered
        with pytest.raises(ValueError, match="MLA_BRIDGE_BACKEND: unknown backend 'nope'"):
            _ask()
    monkeypatch.delenv("MLA_BRIDGE_BACKEND")
    assert _ask() is first
    assert _ask(dtype=torch.float32, out_dtype=torch.float32).name == "torch"  # fp32: no FlashInfer row
    assert _ask(head_dim_qk=96, head_dim_vo=96).name == "torch"
    sm90["now"] = (8, 0)  # the capability is read at every call
    assert _ask().name == "flashinfer-fa2"
    sm90["now"] = (9, 0)
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: None)
    assert _ask().name == "torch" and "not installed" in _ask().reason
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    assert _ask() is first and _ask(requested="flashinfer-fa2").name == "flashinfer-fa2"
    assert _ask(device="cpu").name == "torch"


def test_remembered_choice_keeps_exact_reasons_at_the_offset_limits(sm90):
    """Tensor sizes below every offset limit share one answer; at a limit the reason names the exact size."""
    sm90["now"] = (8, 0)  # fa2: 2**32 elements
    small = _ask(qo_indptr=[0, 10], kv_indptr=[0, 10])
    assert _ask(qo_indptr=[0, 1000], kv_indptr=[0, 5000]) is small
    per_token = 16 * 192
    for tokens in (2**32 // per_token + 1, 2**32 // per_token + 7):
        choice = _ask(qo_indptr=[0, tokens], kv_indptr=[0, tokens])
        assert choice.name == "torch"
        assert f"a q/k/v tensor of {tokens * per_token} elements" in dict(choice.passed_over)["flashinfer-fa2"]


def test_no_choice_is_remembered_where_cutlass_reads_each_request(sm90):
    sm90["now"] = (10, 0)
    assert _ask(qo_indptr=[0, 4], kv_indptr=[0, 8]).name == "flashinfer-cutlass"
    late = _ask(qo_indptr=[0, 9], kv_indptr=[0, 8])  # causal q_len > kv_len: cutlass refuses this one
    assert late.name == "flashinfer-fa2" and "causal request 0 has q_len 9 > kv_len 8" in late.passed_over[0][1]
    assert not any(k[1] == (10, 0) for k in dispatch._CHOICES)


@pytest.mark.parametrize("capability", [None, (8, 0), (8, 9), (9, 0), (10, 0), (11, 0), (12, 0)])
def test_remembered_choices_equal_the_table(sm90, monkeypatch, capability):
    """A grid of requests, each asked twice (the second may be remembered) and once with the memory cleared."""
    for dtype in (BF16, torch.float16, torch.float32):
        for causal in (True, False):
            for dims in ((192, 128), (128, 128), (64, 64), (96, 96)):
                for qo, kv in (([0, 4, 9], [0, 8, 20]), ([0, 300, 900], [0, 200, 900]), ([0, 2**22], [0, 2**22])):
                    kw = dict(
                        capability=capability,
                        dtype=dtype,
                        out_dtype=dtype,
                        causal=causal,
                        num_heads=16,
                        head_dim_qk=dims[0],
                        head_dim_vo=dims[1],
                        qo_indptr=qo,
                        kv_indptr=kv,
                    )
                    dev = "cpu" if capability is None else None
                    a, b = select_backend(dev, **kw), select_backend(dev, **kw)
                    monkeypatch.setattr(dispatch, "_CHOICES", {})
                    assert a == b == select_backend(dev, **kw), kw


# ---------------------------------------------------------------------------------------------------------------
# build's host values: made once from the checked lengths, equal to what the public helpers give
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_build_host_values_equal_the_public_helpers(fake_cuda, tiny_dims, seed, device):
    """qo_indptr, main_kv_indptr, num_tokens, num_context_tokens and every pass's token counts, made once at build
    from the checked lengths, equal indptr_from_lens / sums / the indptrs' last entries on random batches (fused and
    chunked, empty contexts and empty queries)."""
    from mla_bridge.ragged import indptr_from_lens

    rng = random.Random(seed)
    batch = rng.randint(1, 9)
    q_lens = [rng.choice([0, 1, rng.randint(1, 40)]) for _ in range(batch)]
    c_lens = [rng.choice([0, rng.randint(1, 90)]) for _ in range(batch)]
    chunk = rng.choice([1, 7, 64, 1000])
    plan = PrefillPlan.build(
        q_lens,
        c_lens,
        dims=tiny_dims,
        workspace=Workspace(device, chunk_tokens=chunk),
        block_size=4,
        dtype=BF16 if device != "cpu" else torch.float32,
    )
    assert plan.qo_indptr.dtype == plan.main_kv_indptr.dtype == torch.int32
    assert torch.equal(plan.qo_indptr, indptr_from_lens(q_lens))
    keys = [q + (c if q else 0) for q, c in zip(q_lens, c_lens)] if plan.fused else q_lens  # unattended: not read
    assert torch.equal(plan.main_kv_indptr, indptr_from_lens(keys))
    assert plan.num_tokens == sum(q_lens) == int(plan.qo_indptr[-1])
    assert plan.num_context_tokens == sum(c_lens)
    assert plan.num_gathered_context_tokens == (
        sum(c for q, c in zip(q_lens, c_lens) if q)
        if plan.fused
        else sum(c.num_tokens for c in plan.chunks if c.plan is not None)
    )
    passes = [plan.main] + [c.plan for c in plan.chunks if c.plan is not None]
    for p in passes:  # counts given at build = what the spec's properties read from the tensors
        assert p.spec.num_qo_tokens == int(p.spec.qo_indptr[-1])
        assert p.spec.num_kv_tokens == int(p.spec.kv_indptr[-1])
        assert p.spec.batch_size == p.spec.qo_indptr.numel() - 1


def test_build_indptr_at_the_int32_edge(fake_cuda, tiny_dims):
    """Lengths summing to exactly 2**31 - 1 give the exact int32 indptr (accumulated in int32 after the sum check)."""
    top = 2**31 - 1
    plan = PrefillPlan.build([top - 3, 0, 3], dims=tiny_dims, workspace=Workspace("cuda:0"), block_size=4, dtype=BF16)
    assert plan.qo_indptr.tolist() == [0, top - 3, top - 3, top] and plan.num_tokens == top


def test_build_refuses_a_block_size_beyond_int32(tiny_dims):
    """A block of 2**40 tokens was accepted by the plan (no cache can hold one, and the kernels address a slot of a
    block with 32-bit positions); refused by name, a block of 2**31 - 1 still planned."""
    ws = Workspace("cpu")
    with pytest.raises(ValueError, match=r"^block_size must be at most 2147483647 tokens, got 1099511627776$"):
        PrefillPlan.build([3], [5], dims=tiny_dims, workspace=ws, block_size=2**40, dtype=torch.float32)
    assert PrefillPlan.build([3], [5], dims=tiny_dims, workspace=ws, block_size=2**31 - 1, dtype=torch.float32)


@pytest.mark.parametrize("bad", [True, 0, -4, 2.0, "4"])
def test_build_still_refuses_bad_block_sizes_and_head_counts(fake_cuda, tiny_dims, bad):
    """The int fast paths of the argument checks refuse what the full checks refused (bools, non-positive, floats,
    strings), and numpy ints still pass."""
    ws = Workspace("cuda:0")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PrefillPlan.build([3], [5], dims=tiny_dims, workspace=ws, block_size=bad, dtype=BF16)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        plan_ragged(
            [0, 3],
            [0, 3],
            num_heads=bad,
            head_dim_qk=24,
            head_dim_vo=16,
            causal=True,
            sm_scale=0.5,
            dtype=BF16,
            workspace=ws,
        )
    plan = PrefillPlan.build([3], [5], dims=tiny_dims, workspace=ws, block_size=np.int64(4), dtype=BF16)
    assert plan.block_size == 4 and type(plan.block_size) is int
    assert (
        plan_ragged(
            [0, 3],
            [0, 3],
            num_heads=np.int32(4),
            head_dim_qk=24,
            head_dim_vo=16,
            causal=True,
            sm_scale=0.5,
            dtype=BF16,
            workspace=ws,
        ).spec.num_heads
        == 4
    )


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (10, 0)])
def test_select_backend_reads_numpy_indptrs_as_lists(sm90, monkeypatch, capability):
    """Planning hands select_backend numpy views of its host indptrs (an element read there is cheaper than a tensor's):
    every answer equals the one for the same indptrs as lists, including SM100's cutlass row, which reads each
    request (a causal q_len > kv_len and the plan's work items), and answers computed afresh."""
    sm90["now"] = capability
    cases = [
        ([0, 4, 9], [0, 8, 20], True),
        ([0, 9], [0, 8], True),
        ([0, 9], [0, 8], False),
        ([0] + [256 * (i + 1) for i in range(600)], [0] + [256 * (i + 1) for i in range(600)], True),
        ([0, 2**22], [0, 2**22], True),
    ]
    for qo, kv, causal in cases:
        for dtype in (np.int32, np.int64):
            monkeypatch.setattr(dispatch, "_CHOICES", {})
            want = _ask(qo_indptr=qo, kv_indptr=kv, causal=causal)
            monkeypatch.setattr(dispatch, "_CHOICES", {})
            got = _ask(qo_indptr=np.asarray(qo, dtype=dtype), kv_indptr=np.asarray(kv, dtype=dtype), causal=causal)
            assert got == want and got == _ask(
                qo_indptr=np.asarray(qo, dtype=dtype), kv_indptr=np.asarray(kv, dtype=dtype), causal=causal
            ), (qo, kv, causal)


@pytest.mark.parametrize("seed", range(25))
def test_cuda_plans_equal_cpu_plans_on_random_batches(fake_cuda, seed):
    """On random batches (fused and chunked, empty contexts and queries, budgets of 1 token to all of it), the fake
    CUDA device's plan equals the CPU device's: chunk bounds, first_start, indptrs, every index tensor, and one
    FlashInfer plan per distinct (qo_indptr, kv_indptr) pair of the chunks (no more, none shared wrongly)."""
    rng = random.Random(1000 + seed)
    batch = rng.randint(1, 10)
    c_lens = [rng.choice([0, 0, 1, 2, 5, 16, 33, 100]) for _ in range(batch)]
    q_lens = [rng.choice([0, 1, 3, 8]) for _ in range(batch)]
    chunk = rng.choice([1, 2, 3, 7, 16, 64, 1000])
    fuse = rng.random() < 0.5
    dims = MLADims(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=56, qk_rope_head_dim=8, v_head_dim=64)
    made = [
        PrefillPlan.build(
            q_lens,
            c_lens,
            dims=dims,
            workspace=Workspace(dev, chunk_tokens=chunk),
            block_size=4,
            dtype=BF16,
            fuse_context=fuse,
        )
        for dev in ("cuda:0", "cpu")
    ]
    cuda, cpu = made
    assert cuda.fused == cpu.fused and len(cuda.chunks) == len(cpu.chunks)
    got, want = index_tensors(cuda), index_tensors(cpu)
    for name in want:
        assert (got[name] is None) == (want[name] is None) and (
            want[name] is None or torch.equal(got[name], want[name])
        ), name
    for a, b in zip(cuda.chunks, cpu.chunks):
        assert (a.req_start, a.req_end, a.q_start, a.q_end, a.first_start) == (
            b.req_start,
            b.req_end,
            b.q_start,
            b.q_end,
            b.first_start,
        )
        assert torch.equal(a.kv_indptr, b.kv_indptr) and a.spans == b.spans
        assert (a.plan is None) == (b.plan is None) == (a.q_end == a.q_start)
    shapes = {(tuple(c.plan.qo_indptr.tolist()), tuple(c.kv_indptr.tolist())) for c in cuda.chunks if c.plan}
    assert cuda.num_plans == 1 + len(shapes)
    for c in cuda.chunks:
        if c.plan is not None:
            assert c.plan.qo_indptr.tolist() == [x - c.q_start for x in cuda.qo_indptr[c.req_start : c.req_end + 1]]
            assert c.plan.flashinfer_wrapper.planned[-1][:2] == (c.plan.qo_indptr.tolist(), c.kv_indptr.tolist())


def test_chunks_share_a_plan_only_with_equal_keys_and_query_lengths(fake_cuda):
    """Chunks are matched to a plan by their keys and their requests' query lengths: equal keys with other query
    lengths get their own plan, equal both share one (and its host indptrs); no query rows, no plan."""
    dims = MLADims(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=56, qk_rope_head_dim=8, v_head_dim=64)
    ws = Workspace("cuda:0", chunk_tokens=4)
    plan = PrefillPlan.build(
        [1, 2, 1, 3, 0], [4, 4, 4, 4, 4], dims=dims, workspace=ws, block_size=4, dtype=BF16, fuse_context=False
    )
    c = plan.chunks
    assert [x.kv_indptr.tolist() for x in c] == [[0, 4]] * 5
    assert c[0].plan is c[2].plan and len({id(c[0].plan), id(c[1].plan), id(c[3].plan)}) == 3 and c[4].plan is None
    assert [x.plan.qo_indptr.tolist() for x in c[:4]] == [[0, 1], [0, 2], [0, 1], [0, 3]]
    assert all(x.plan.kv_indptr.tolist() == [0, 4] for x in c[:4]) and plan.num_plans == 4


def test_build_reads_the_device_capability_once_per_device(fake_cuda, monkeypatch):
    """A plan's passes share one read of the device's capability (each select_backend call read it before: a CUDA
    property query per pass on the GPU), and later builds on that device read it no more (a device's capability is
    fixed for the process: dispatch.device_capability remembers it); their choices equal select_backend's own
    reading. A stand-in monkeypatched over torch.cuda.get_device_capability is asked afresh."""
    dims = MLADims.deepseek_v2_lite()  # 192/128: FlashInfer rows serve it
    reads = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: reads.append(dev) or (9, 0))
    ws = Workspace("cuda:0", chunk_tokens=8)
    plan = PrefillPlan.build([3, 4, 1, 5], [10, 0, 7, 20], dims=dims, workspace=ws, block_size=4, dtype=BF16)
    assert plan.num_plans >= 3 and reads == [torch.device("cuda", 0)]
    for p in [plan.main] + [c.plan for c in plan.chunks if c.plan is not None]:
        assert p.backend == select_backend(
            "cuda:0",
            dtype=BF16,
            out_dtype=BF16,
            head_dim_qk=dims.head_dim_qk,
            head_dim_vo=dims.head_dim_vo,
            causal=p.spec.causal,
            num_heads=dims.num_heads,
            qo_indptr=p.qo_indptr.tolist(),
            kv_indptr=p.kv_indptr.tolist(),
        )
    del reads[:]
    for _ in range(3):
        again = PrefillPlan.build([3, 4, 1, 5], [10, 0, 7, 20], dims=dims, workspace=ws, block_size=4, dtype=BF16)
        assert again.backend == plan.backend
    assert reads == []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: reads.append(dev) or (8, 0))
    other = PrefillPlan.build([3, 4, 1, 5], [10, 0, 7, 20], dims=dims, workspace=ws, block_size=4, dtype=BF16)
    assert other.backend.name == "flashinfer-fa2" and len(reads) == 1


def test_plan_host_time_script_runs():
    """scripts/plan_host_time.py (the CPU measurement of this item) runs on the fake device of these tests: it broke
    silently once when planning gained a device half it did not stub."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run(
        [sys.executable, "scripts/plan_host_time.py", "--repeats", "2", "--count"],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 12 and "B=128 C=2048" in lines[5] and "4 chunks, 2 plan(s), flashinfer-fa3" in lines[5]
    # --count: the fused cases make one device expansion (one copy, one allocation, ONE Triton launch, no torch
    # kernel); the chunked one none at all (its gathers read the passes' device kv_indptrs: no copy, no tensor, no
    # kernel of its own) and records one event per plan
    assert "B=128 C=2048 CUDA-side calls per build: 9 " in lines[-1]
    for line in lines[-3:-1]:
        assert "Triton launch 1," in line and "Tensor.to 1," in line and "aten.empty 1," in line, line
    for line in lines[-3:]:
        assert "aten.searchsorted" not in line and "aten.index_select" not in line, line
    for what in ("Triton launch", "Tensor.to", "aten.", "page-locked"):
        assert what not in lines[-1], lines[-1]
    assert "Event.record 2," in lines[-1], lines[-1]
    assert "Triton launch" not in lines[6] and "Event.record 1," in lines[6], lines[6]  # B=1, no context
    res = subprocess.run(
        [sys.executable, "scripts/plan_host_time.py", "--repeats", "2", "--count", "--expand", "torch"],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    fused = res.stdout.splitlines()[-2]  # the torch fallback of the fused cases' expansion: four kernels
    assert "aten.searchsorted 1," in fused and "aten.add_ 1," in fused and "Triton launch" not in fused, fused


@pytest.mark.parametrize("budget", [0, -1, 2.5, True, "4"])
def test_reference_schedule_refuses_a_budget_that_is_not_a_positive_int(budget):
    """schedule_context_chunks with a budget of 0 or below never filled a chunk and never ended (it
    appended empty spans forever); a float made fractional spans. An alarm turns the old hang
    into a failure."""
    import signal

    def hang(signum, frame):
        raise TimeoutError("schedule_context_chunks did not return")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(5)
    try:
        with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
            schedule_context_chunks([5, 3], budget)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert schedule_context_chunks([5, 0, 3], np.int64(4)) == [[(0, 0, 4)], [(0, 4, 5), (2, 0, 3)]]


@pytest.mark.parametrize("q_lens,c_lens,chunk", [([3, 4], [10, 7], 4), ([3, 4], [10, 7], 64)])
def test_torch_backend_plan_orders_another_stream_after_its_copies(fake_cuda, monkeypatch, q_lens, c_lens, chunk):
    """float32 on CUDA runs the torch backend, which plans nothing on the device: no FlashInfer plan event covers the
    copies the build queued (the chunks' kv_indptrs, or the fused schedule's expansion). A stream other than the
    build stream waits for the plan's own event, once, and marks the device tensors used there; a FlashInfer plan
    (bf16) records no event of its own (its plan events cover them)."""
    from tests.helpers.fake_device import Stream

    waits, marks = [], []

    class Other(Stream):
        cuda_stream = 2

        def wait_event(self, event):
            waits.append(event)

    dims = MLADims(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=56, qk_rope_head_dim=8, v_head_dim=64)
    ws = Workspace("cuda:0", chunk_tokens=chunk)
    plan = PrefillPlan.build(q_lens, c_lens, dims=dims, workspace=ws, block_size=4, dtype=torch.float32)
    # private: the build's event and device tensors are the only view of what another stream must wait for (a race)
    assert plan.backend.name == "torch" and plan._ready is not None and plan._device_indices
    assert plan.fused == (chunk == 64)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: marks.append(s), raising=False)
    other = Other()
    monkeypatch.setattr(plan_mod, "current_stream", lambda device: (2, other))
    plan.order_on_current_stream()
    plan.order_on_current_stream()
    assert waits == [plan._ready] and marks == [other] * len(plan._device_indices)
    bf16 = PrefillPlan.build(q_lens, c_lens, dims=dims, workspace=ws, block_size=4, dtype=BF16)
    assert bf16.backend.is_flashinfer and bf16._ready is None


def test_plan_without_new_tokens_orders_another_stream_after_its_chunk_copies(fake_cuda, monkeypatch):
    """No request has new tokens: the main pass is empty (no FlashInfer plan, so no plan event, even in bf16) and no
    chunk has a pass, yet each chunk's kv_indptr was copied to the device (mla_bridge.kv.chunk_kv takes any chunk).
    The build records its own event, and a stream other than the build stream waits for it before reading them."""
    from tests.helpers.fake_device import Stream

    waits = []

    class Other(Stream):
        cuda_stream = 2

        def wait_event(self, event):
            waits.append(event)

    dims = MLADims(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=56, qk_rope_head_dim=8, v_head_dim=64)
    plan = PrefillPlan.build(
        [0, 0], [5, 9], dims=dims, workspace=Workspace("cuda:0", chunk_tokens=4), block_size=4, dtype=BF16
    )
    assert plan.main.flashinfer_wrapper is None and plan.chunks and all(c.plan is None for c in plan.chunks)
    assert plan._device_indices and plan._ready is not None  # private: as above, what another stream waits for
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None, raising=False)
    monkeypatch.setattr(plan_mod, "current_stream", lambda device: (2, Other()))
    plan.order_on_current_stream()
    assert waits == [plan._ready]
