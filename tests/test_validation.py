"""Every bad input raises the documented error, naming the argument, before anything runs or is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mla_bridge.dispatch as dispatch
from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, plan_ragged, ragged_prefill

D_QK, D_VO, H = 24, 16, 3
SENTINEL = 7.25


def ragged_inputs(q_lens=(2, 3), kv_lens=(4, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(kv_lens)
    q = torch.randn(t, H, D_QK, generator=g)
    k = torch.randn(s, H, D_QK, generator=g)
    v = torch.randn(s, H, D_VO, generator=g)
    qo = [0, q_lens[0], t]
    kv = [0, kv_lens[0], s]
    return q, k, v, qo, kv


def sentinel_out(t=5, h=H, d=D_VO):
    return torch.full((t, h, d), SENTINEL)


def assert_untouched(*bufs):
    for b in bufs:
        assert torch.equal(b, torch.full_like(b, SENTINEL)), "a buffer was written before the error"


def make_plan(qo, kv, causal=False):
    return plan_ragged(
        qo,
        kv,
        num_heads=H,
        head_dim_qk=D_QK,
        head_dim_vo=D_VO,
        causal=causal,
        sm_scale=0.2,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )


# --------------------------------------------------------------------------------------------------------------
# ragged attention
# --------------------------------------------------------------------------------------------------------------


def _bad(name):
    """(q, k, v, qo, kv) with one thing wrong; returns the kwargs for ragged_prefill."""
    q, k, v, qo, kv = ragged_inputs()
    cases = {
        "q_one_more_row": dict(q=torch.randn(6, H, D_QK)),
        "q_one_less_row": dict(q=torch.randn(4, H, D_QK)),
        "k_one_more_row": dict(k=torch.randn(8, H, D_QK)),
        "k_one_less_row": dict(k=torch.randn(6, H, D_QK)),
        "v_one_more_row": dict(v=torch.randn(8, H, D_VO)),
        "v_one_less_row": dict(v=torch.randn(6, H, D_VO)),
        "k_head_dim": dict(k=torch.randn(7, H, D_QK + 8)),
        "k_heads": dict(k=torch.randn(7, H + 1, D_QK)),
        "v_heads": dict(v=torch.randn(7, 1, D_VO)),
        "k_dtype": dict(k=k.double()),
        "v_dtype": dict(v=v.bfloat16()),
        "k_device": dict(k=torch.empty(7, H, D_QK, device="meta")),
        "v_device": dict(v=torch.empty(7, H, D_VO, device="meta")),
        "out_shape": dict(out=torch.full((5, H, D_VO + 1), SENTINEL)),
        "out_dtype": dict(out=torch.full((5, H, D_VO), SENTINEL, dtype=torch.float64)),
        "out_device": dict(out=torch.empty(5, H, D_VO, device="meta")),
        "lse_shape": dict(lse=torch.full((H, 5), SENTINEL)),
        "lse_dtype": dict(lse=torch.full((5, H), SENTINEL, dtype=torch.float64)),
        "q_2d": dict(q=torch.randn(5, H * D_QK)),
        "k_not_tensor": dict(k=k.tolist()),
    }
    args = dict(q=q, k=k, v=v, qo_indptr=qo, kv_indptr=kv)
    args.update(cases[name])
    return args


@pytest.mark.parametrize(
    "case,exc,match",
    [
        ("q_one_more_row", ValueError, r"q has 6 tokens but qo_indptr\[-1\] = 5"),
        ("q_one_less_row", ValueError, r"q has 4 tokens but qo_indptr\[-1\] = 5"),
        ("k_one_more_row", ValueError, r"k has 8 tokens but kv_indptr\[-1\] = 7"),
        ("k_one_less_row", ValueError, r"k has 6 tokens but kv_indptr\[-1\] = 7"),
        ("v_one_more_row", ValueError, r"v has 8 tokens but kv_indptr\[-1\] = 7"),
        ("v_one_less_row", ValueError, r"v has 6 tokens but kv_indptr\[-1\] = 7"),
        ("k_head_dim", ValueError, r"^k must have shape \[7, 3, 24\]"),
        # the heads named together (q's made the plan: k or v was blamed for a head count q set)
        ("k_heads", ValueError, r"^q, k and v must have the same number of heads \(dim 1\), got q 3, k 4, v 3$"),
        ("v_heads", ValueError, r"^q, k and v must have the same number of heads \(dim 1\), got q 3, k 3, v 1$"),
        (
            "k_dtype",
            TypeError,
            r"^q, k and v must share one dtype, got q torch.float32, k torch.float64, v torch.float32",
        ),
        (
            "v_dtype",
            TypeError,
            r"^q, k and v must share one dtype, got q torch.float32, k torch.float32, v torch.bfloat16",
        ),
        ("k_device", ValueError, r"^k is on meta"),
        ("v_device", ValueError, r"^v is on meta"),
        ("out_shape", ValueError, r"^out must have shape"),
        ("out_dtype", TypeError, r"^out must have dtype"),
        ("out_device", ValueError, r"^out is on meta"),
        ("lse_shape", ValueError, r"^lse must have shape \[5, 3\]"),
        ("lse_dtype", TypeError, r"^lse must have dtype torch.float32"),
        ("q_2d", ValueError, r"^q must be 3-D"),
        ("k_not_tensor", TypeError, r"^k must be a torch.Tensor"),
    ],
)
def test_ragged_bad_tensors(case, exc, match):
    args = _bad(case)
    out = args.pop("out", None)
    lse = args.pop("lse", None)
    out = sentinel_out() if out is None else out
    lse = torch.full((5, H), SENTINEL) if lse is None else lse
    with pytest.raises(exc, match=match):
        ragged_prefill(
            args["q"],
            args["k"],
            args["v"],
            args["qo_indptr"],
            args["kv_indptr"],
            causal=True,
            sm_scale=0.2,
            backend="torch",
            out=out,
            lse=lse,
        )
    assert_untouched(*(b for b in (out, lse) if b.device.type == "cpu"))


@pytest.mark.parametrize(
    "case",
    ["q_one_more_row", "q_one_less_row", "k_one_less_row", "v_one_more_row", "k_head_dim", "k_dtype", "k_device"],
)
def test_planned_run_rejects_before_writing(case):
    args = _bad(case)
    plan = make_plan(args["qo_indptr"], args["kv_indptr"])
    out, lse = sentinel_out(), torch.full((5, H), SENTINEL)
    with pytest.raises((ValueError, TypeError)):
        plan.run(args["q"], args["k"], args["v"], out=out, lse=lse)
    assert_untouched(out, lse)


def test_q_head_dim_disagrees_with_plan():
    q, k, v, qo, kv = ragged_inputs()
    plan = make_plan(qo, kv)
    with pytest.raises(ValueError, match=r"^q must have shape \[5, 3, 24\], got \[5, 3, 32\]"):
        plan.run(torch.randn(5, H, 32), k, v)
    with pytest.raises(ValueError, match=r"^q must have shape \[5, 3, 24\], got \[5, 4, 24\]"):
        plan.run(torch.randn(5, 4, D_QK), k, v)
    with pytest.raises(TypeError, match=r"^q must have dtype"):
        plan.run(q.half(), k, v)


def test_lse_layout_and_contiguity():
    q, k, v, qo, kv = ragged_inputs()
    plan = make_plan(qo, kv)
    with pytest.raises(ValueError, match="lse_layout"):
        plan.run(q, k, v, lse_layout="TH")
    with pytest.raises(ValueError, match=r"^lse must have shape \[3, 5\]"):
        plan.run(q, k, v, lse=torch.empty(5, H), lse_layout="HN")
    with pytest.raises(ValueError, match="lse must be contiguous"):
        plan.run(q, k, v, lse=torch.empty(H, 5).t())


def test_q_k_v_of_different_dtypes_are_named_together():
    """The one-shot call plans for q's dtype: a k or v of another dtype is reported with all three dtypes, not as
    "k must have the plan's dtype" when q is the odd one out."""
    q, k, v, qo, kv = ragged_inputs()
    out = sentinel_out()
    with pytest.raises(TypeError, match=r"^q, k and v must share one dtype, got q torch.float64, k torch.float32"):
        ragged_prefill(q.double(), k, v, qo, kv, causal=False, sm_scale=0.2, out=out)
    assert_untouched(out)


def test_qkv_sizes_reads_shapes_and_dtypes_only():
    """mla_bridge.ragged.qkv_sizes, the one-shot call's checks of what planning reads: the sizes plan_ragged takes,
    from any arrays with ``shape`` and ``dtype`` (the JAX adapter hands it traced arrays), with the same errors."""
    from mla_bridge.ragged import qkv_sizes

    q, k, v = np.zeros((5, 3, 24)), np.zeros((7, 3, 24)), np.zeros((7, 3, 16))
    assert qkv_sizes(q, k, v) == dict(num_heads=3, head_dim_qk=24, head_dim_vo=16)
    with pytest.raises(ValueError, match=r"^v must be 3-D \[tokens, heads, head_dim\], got shape \[7, 48\]$"):
        qkv_sizes(q, k, v.reshape(7, 48))
    with pytest.raises(TypeError, match=r"^q, k and v must share one dtype, got q float64, k float32, v float64$"):
        qkv_sizes(q, k.astype(np.float32), v)
    with pytest.raises(ValueError, match=r"^q, k and v must have the same number of heads \(dim 1\), got q 3, k 2"):
        qkv_sizes(q, k[:, :2], v)


@pytest.mark.parametrize(
    "qo,kv,exc,match",
    [
        ([[0, 2, 5]], [0, 4, 7], ValueError, r"qo_indptr must be 1-D"),
        (torch.tensor([[0, 2, 5]]), [0, 4, 7], ValueError, r"qo_indptr must be 1-D"),
        ([0, 2, 5], torch.tensor([0.0, 4.0, 7.0]), TypeError, r"kv_indptr must hold integers"),
        ([0, 2.5, 5], [0, 4, 7], TypeError, r"qo_indptr must hold integers"),
        (torch.tensor([False, True, True]), [0, 4, 7], TypeError, r"qo_indptr must hold integers"),
        ([0, True, 5], [0, 4, 7], TypeError, r"qo_indptr\[1\] must be an integer, got True"),
        ([0, 2, 5], (0, np.bool_(True), 7), TypeError, r"kv_indptr\[1\] must be an integer, got np.True_|True"),
        ([1, 2, 5], [0, 4, 7], ValueError, r"qo_indptr must start at 0"),
        ([0, 2, 5], [2, 4, 7], ValueError, r"kv_indptr must start at 0"),
        ([0, 3, 2, 5], [0, 1, 4, 7], ValueError, r"qo_indptr must be non-decreasing"),
        ([0, 2, 5], [0, 7, 4], ValueError, r"kv_indptr must be non-decreasing"),
        ([], [], ValueError, r"qo_indptr must have at least one entry"),
        ([0, 2, 5], [0, 7], ValueError, r"qo_indptr has 3 entries but kv_indptr has 2"),
        ([0, 2**31], [0, 1], ValueError, r"qo_indptr\[-1\]=2147483648 does not fit in int32"),
    ],
)
def test_bad_indptr(qo, kv, exc, match):
    q, k, v, _, _ = ragged_inputs()
    with pytest.raises(exc, match=match):
        make_plan(qo, kv)
    out = sentinel_out()
    with pytest.raises(exc, match=match):
        ragged_prefill(q, k, v, qo, kv, causal=False, sm_scale=0.2, out=out)
    assert_untouched(out)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_heads=0), ValueError, "num_heads"),
        (dict(num_heads=2.0), ValueError, "num_heads"),
        (dict(head_dim_qk=-1), ValueError, "head_dim_qk"),
        (dict(head_dim_vo=0), ValueError, "head_dim_vo"),
        (dict(sm_scale=0.0), ValueError, "sm_scale"),
        (dict(sm_scale=-0.1), ValueError, "sm_scale"),
        (dict(sm_scale=float("inf")), ValueError, "sm_scale"),
        (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
        (dict(sm_scale="0.1"), ValueError, "sm_scale"),
        (dict(dtype=torch.int32), TypeError, "dtype"),
        (dict(dtype="bfloat16"), TypeError, "dtype"),
        (dict(workspace="cpu"), TypeError, "workspace"),
    ],
)
def test_bad_plan_arguments(kwargs, exc, match):
    args = dict(
        num_heads=H,
        head_dim_qk=D_QK,
        head_dim_vo=D_VO,
        causal=False,
        sm_scale=0.2,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        plan_ragged([0, 2, 5], [0, 4, 7], **args)


def test_float32_for_a_flashinfer_backend(monkeypatch):
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # Workspace checks the device exists
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"flashinfer-fa3.*capability 9\.0.*float16/bfloat16"):
        plan_ragged(
            [0, 2],
            [0, 2],
            num_heads=2,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=True,
            sm_scale=0.1,
            dtype=torch.float32,
            workspace=Workspace("cuda:0"),
            backend="flashinfer-fa3",
        )
    # and on the CPU a FlashInfer backend is refused outright
    with pytest.raises(ValueError, match="flashinfer-fa2.*no CUDA device"):
        plan_ragged(
            [0, 2],
            [0, 2],
            num_heads=2,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=True,
            sm_scale=0.1,
            dtype=torch.bfloat16,
            workspace=Workspace("cpu"),
            backend="flashinfer-fa2",
        )


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(float_workspace_bytes=0), "float_workspace_bytes"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(chunk_tokens=1.5), "chunk_tokens"),
        (dict(chunk_tokens=True), "chunk_tokens"),
        (dict(max_float_workspace_bytes=-1), "max_float_workspace_bytes"),
    ],
)
def test_bad_workspace(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Workspace("cpu", **kwargs)


# --------------------------------------------------------------------------------------------------------------
# mla_prefill
# --------------------------------------------------------------------------------------------------------------

Q_LENS, C_LENS, BS = [2, 3], [9, 5], 4


@pytest.fixture
def prefill(ref, tiny_dims):
    batch = ref.make_mla_batch(tiny_dims, Q_LENS, C_LENS, BS, seed=1)
    plan = PrefillPlan.build(
        Q_LENS, C_LENS, dims=tiny_dims, workspace=Workspace("cpu", chunk_tokens=4), block_size=BS, dtype=torch.float32
    )
    args = dict(
        q=batch.q,
        kv_c=batch.kv_c,
        k_pe=batch.k_pe,
        kv_b_proj_weight=batch.w,
        kv_cache=batch.cache,
        block_table=batch.block_table,
    )
    return plan, args, batch


def _prefill_case(name, args, d, batch):
    t = sum(Q_LENS)
    h, rank, rope = d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim
    bt = batch.block_table
    cases = {
        "q_one_more_row": dict(q=torch.randn(t + 1, h, d.head_dim_qk)),
        "q_one_less_row": dict(q=torch.randn(t - 1, h, d.head_dim_qk)),
        "q_heads": dict(q=torch.randn(t, h + 1, d.head_dim_qk)),
        "q_head_dim": dict(q=torch.randn(t, h, d.head_dim_qk + 8)),
        "kv_c_rows": dict(kv_c=torch.randn(t + 1, rank)),
        "kv_c_rank": dict(kv_c=torch.randn(t, rank + 1)),
        "k_pe_width": dict(k_pe=torch.randn(t, rope + 1)),
        "k_pe_heads": dict(k_pe=torch.randn(t, h, rope)),
        "weight_shape": dict(kv_b_proj_weight=torch.randn(d.kv_b_proj_shape[0] + 1, rank)),
        "weight_transposed": dict(kv_b_proj_weight=args["kv_b_proj_weight"].t()),
        "cache_block_size": dict(kv_cache=torch.randn(20, BS * 2, d.latent_dim)),
        "cache_width": dict(kv_cache=torch.randn(20, BS, rank)),
        "table_short": dict(block_table=bt[:, :2]),
        "table_float": dict(block_table=bt.float()),
        "table_1d": dict(block_table=bt[0]),
        "table_rows": dict(block_table=bt[:1]),
        "table_ids": dict(block_table=torch.where(torch.arange(bt.shape[1]) == 1, 10_000, bt)),
        "table_negative_id": dict(block_table=torch.where(torch.arange(bt.shape[1]) == 0, -1, bt)),
        "cache_too_small": dict(kv_cache=args["kv_cache"][:2]),
        "q_dtype": dict(q=args["q"].bfloat16()),
        "weight_dtype": dict(kv_b_proj_weight=args["kv_b_proj_weight"].double()),
        "cache_dtype": dict(kv_cache=args["kv_cache"].half()),
        "q_device": dict(q=torch.empty(t, h, d.head_dim_qk, device="meta")),
        "cache_device": dict(kv_cache=torch.empty(args["kv_cache"].shape, device="meta")),
        "table_device": dict(block_table=torch.empty(bt.shape, dtype=bt.dtype, device="meta")),
        "kv_c_not_tensor": dict(kv_c=None),
        "table_complex": dict(block_table=bt.to(torch.complex64)),
        "table_uint32": dict(block_table=bt.to(torch.uint32)),
        "table_uint64": dict(block_table=bt.to(torch.uint64)),
        "q_sparse": dict(q=args["q"].to_sparse()),
    }
    new = dict(args)
    new.update(cases[name])
    return new


@pytest.mark.parametrize(
    "case,exc,match",
    [
        ("q_one_more_row", ValueError, r"^q must be \[T=5 \(qo_indptr\[-1\]\)"),
        ("q_one_less_row", ValueError, r"^q must be \[T=5 \(qo_indptr\[-1\]\)"),
        ("q_heads", ValueError, r"^q must be \[T, H=4, head_dim_qk=24\]"),
        ("q_head_dim", ValueError, r"^q must be \[T, H=4, head_dim_qk=24\]"),
        ("kv_c_rows", ValueError, r"^kv_c must be \[T=5, kv_lora_rank=32\]"),
        ("kv_c_rank", ValueError, r"^kv_c must be"),
        ("k_pe_width", ValueError, r"^k_pe must be"),
        ("k_pe_heads", ValueError, r"^k_pe must be"),
        ("weight_shape", ValueError, r"^kv_b_proj_weight must be .*\[128, 32\]"),
        ("weight_transposed", ValueError, r"^kv_b_proj_weight must be"),
        ("cache_block_size", ValueError, r"^kv_cache must be \[num_blocks, block_size=4"),
        ("cache_width", ValueError, r"^kv_cache must be"),
        ("table_short", ValueError, r"^block_table row 0 has 2 blocks, too short for context_lens\[0\] = 9"),
        ("table_float", TypeError, r"^block_table must hold integer"),
        ("table_1d", ValueError, r"^block_table must be \[num_requests=2"),
        ("table_rows", ValueError, r"^block_table must be \[num_requests=2"),
        ("table_ids", ValueError, r"^block_table row 0 holds block ids outside"),
        ("table_negative_id", ValueError, r"block_table row 0 holds block ids outside"),
        ("cache_too_small", ValueError, r"^context_lens\[0\] = 9 tokens is longer than the cache"),
        ("q_dtype", TypeError, r"^q must have dtype torch.float32"),
        ("weight_dtype", TypeError, r"^kv_b_proj_weight must have dtype"),
        ("cache_dtype", TypeError, r"^kv_cache must have dtype"),
        ("q_device", ValueError, r"^q is on meta"),
        ("cache_device", ValueError, r"^kv_cache is on meta"),
        ("table_device", ValueError, r"^block_table is on meta"),
        ("kv_c_not_tensor", TypeError, r"^kv_c must be a torch.Tensor"),
        ("table_complex", TypeError, r"^block_table must hold integer block ids .*got torch.complex64"),
        # torch has no min/max kernels for these: was an unnamed NotImplementedError ('"min_all" not implemented for
        # 'UInt32''), raised from the block-id range check
        ("table_uint32", TypeError, r"^block_table must hold integer block ids .*got torch.uint32"),
        ("table_uint64", TypeError, r"^block_table must hold integer block ids .*got torch.uint64"),
        ("q_sparse", TypeError, r"^q must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ],
)
def test_prefill_bad_inputs(prefill, tiny_dims, case, exc, match):
    plan, args, batch = prefill
    bad = _prefill_case(case, args, tiny_dims, batch)
    out = sentinel_out(5, tiny_dims.num_heads, tiny_dims.v_head_dim)
    with pytest.raises(exc, match=match):
        mla_prefill(**bad, plan=plan, out=out)
    assert_untouched(out)


@pytest.mark.parametrize(
    "out,exc,match",
    [
        (torch.full((5, 4, 17), SENTINEL), ValueError, r"^out must be \[T=5, H=4, v_head_dim=16\]"),
        (torch.full((6, 4, 16), SENTINEL), ValueError, r"^out must be \[T=5"),
        (torch.full((5, 4, 16), SENTINEL, dtype=torch.float64), TypeError, r"^out must have dtype"),
        (torch.empty(5, 4, 16, device="meta"), ValueError, r"^out is on meta"),
        (torch.full((1, 4, 16), SENTINEL).expand(5, 4, 16), ValueError, r"^out must not overlap itself"),
    ],
)
def test_prefill_bad_out(prefill, out, exc, match):
    plan, args, _ = prefill
    with pytest.raises(exc, match=match):
        mla_prefill(**args, plan=plan, out=out)
    if out.device.type == "cpu":
        assert_untouched(out)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_prefill_return_lse_must_be_a_bool(prefill, value):
    plan, args, _ = prefill
    with pytest.raises(TypeError, match="^return_lse must be a bool"):
        mla_prefill(**args, plan=plan, return_lse=value)


def test_prefill_plan_must_be_a_plan(prefill):
    _, args, _ = prefill
    with pytest.raises(TypeError, match="plan must be a PrefillPlan"):
        mla_prefill(**args, plan=object())


def test_prefill_good_inputs_pass(prefill, ref):
    """The fixture itself is valid (so each bad case above fails for its own reason)."""
    plan, args, batch = prefill
    out = mla_prefill(**args, plan=plan)
    ref.assert_out_close(out, ref.mla_reference(batch)[0], atol=3e-5)


@pytest.mark.parametrize(
    "query_lens,context_lens,exc,match",
    [
        ([2, -1], [0, 0], ValueError, r"query_lens\[1\] = -1 is negative"),
        ([2, 1], [0, -3], ValueError, r"context_lens\[1\] = -3 is negative"),
        (torch.tensor([2, -1]), None, ValueError, r"query_lens\[1\] = -1 is negative"),
        ([2, 1.0], None, TypeError, r"query_lens\[1\] must be an int"),
        (torch.tensor([2.0, 1.0]), None, TypeError, r"query_lens must hold integers"),
        (torch.tensor([[2, 1]]), None, ValueError, r"query_lens must be 1-D"),
        ([2, 1], [0], ValueError, r"context_lens has 1 entries but query_lens has 2"),
        ({0: 2, 1: 1}, None, TypeError, r"query_lens must be a sequence of ints \(one per request\), got dict"),
        ([2, 1], {5, 3}, TypeError, r"context_lens must be a sequence of ints \(one per request\), got set"),
    ],
)
def test_bad_lengths(tiny_dims, query_lens, context_lens, exc, match):
    with pytest.raises(exc, match=match):
        PrefillPlan.build(
            query_lens, context_lens, dims=tiny_dims, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32
        )


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=4.0), ValueError, "block_size"),
        (dict(dims=(4, 32, 16, 8, 16)), TypeError, "dims"),
        (dict(workspace=None), TypeError, "workspace"),
        (dict(device="meta"), ValueError, r"device must be 'cpu' or 'cuda"),
        (dict(backend="nope"), ValueError, "unknown backend"),
        (dict(fuse_context="no"), TypeError, "^fuse_context must be a bool \\(True or False\\), got .* of type str"),
    ],
)
def test_bad_plan_build(tiny_dims, kwargs, exc, match):
    args = dict(dims=tiny_dims, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        PrefillPlan.build([2, 1], [3, 0], **args)


def test_prefill_plan_needs_build():
    with pytest.raises(TypeError, match="PrefillPlan.build"):
        PrefillPlan()


def test_int64_and_numpy_lengths_are_fine(tiny_dims):
    import numpy as np

    p1 = PrefillPlan.build(
        np.array([2, 1]),
        torch.tensor([3, 0]),
        dims=tiny_dims,
        workspace=Workspace("cpu"),
        block_size=4,
        dtype=torch.float32,
    )
    assert p1.query_lens == [2, 1] and p1.context_lens == [3, 0]


def test_dims_mismatch_between_plan_and_tensors(prefill):
    """Tensors of another model's dims (V2-Lite real sizes) against a tiny-dims plan: named, not mis-read."""
    plan, args, _ = prefill
    real = MLADims.deepseek_v2_lite()
    bad = dict(args, kv_b_proj_weight=torch.randn(*real.kv_b_proj_shape))
    with pytest.raises(ValueError, match="kv_b_proj_weight"):
        mla_prefill(**bad, plan=plan)


def test_sm_scale_accepts_real_scalars_and_refuses_the_rest():
    import numpy as np

    q, k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    ref, _ = ragged_prefill(q, k, v, [0, 3], [0, 3], causal=True, sm_scale=0.25)
    for scale in (np.float32(0.25), np.float64(0.25), torch.tensor(0.25)):
        out, _ = ragged_prefill(q, k, v, [0, 3], [0, 3], causal=True, sm_scale=scale)
        assert torch.equal(out, ref)
    for bad in (True, "0.25", 1e39, torch.tensor([0.25, 0.5])):
        with pytest.raises(ValueError, match="sm_scale must be a positive finite float"):
            ragged_prefill(q, k, v, [0, 3], [0, 3], causal=True, sm_scale=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cuda_workspace_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="device cuda.*CUDA is not available"):
        Workspace("cuda")


def test_lengths_must_be_a_sequence():
    with pytest.raises(TypeError, match="query_lens must be a sequence of ints"):
        PrefillPlan.build(
            5,
            dims=MLADims(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
            workspace=Workspace("cpu"),
            block_size=4,
        )


@pytest.mark.parametrize("source", ["q", "kv_cache", "kv_c"])
def test_prefill_refuses_an_out_sharing_memory_with_an_input(prefill, tiny_dims, source):
    """An ``out`` that shares memory with an input mla_prefill reads (q is read again by every context chunk after
    the main pass wrote out) is refused before any work; it once gave silently wrong values (with
    out=q, max error 1.64 on the chunked schedule)."""
    plan, args, batch = prefill
    d = tiny_dims
    t, h, vd = sum(Q_LENS), d.num_heads, d.v_head_dim
    value = {"q": batch.q, "kv_cache": batch.cache, "kv_c": batch.kv_c}[source]
    big = torch.full((value.numel() + t * h * vd,), SENTINEL)
    args = dict(args, **{source: big[: value.numel()].view_as(value).copy_(value)})
    before = big.clone()
    out = big[: t * h * vd].view(t, h, vd)  # starts where the input starts
    with pytest.raises(ValueError, match=rf"^out shares memory with {source}"):
        mla_prefill(**args, plan=plan, out=out)
    torch.testing.assert_close(big, before, rtol=0, atol=0, equal_nan=True)  # nothing written


@pytest.mark.parametrize("prepared", [False, True])
def test_prefill_refuses_an_out_sharing_memory_with_the_weight(prefill, tiny_dims, prepared):
    """The weight is read by every pass, the context chunks' after the main pass wrote out: an out inside it is
    refused before any work. It was taken: a prepared weight gave max error 5.2 on the CPU (separate path), a raw one
    7.0 with kv_impl="fused" under TRITON_INTERPRET=1 (the fused kernel reads the raw weight in place)."""
    from mla_bridge import prepare_kv_b_proj

    plan, args, batch = prefill
    d = tiny_dims
    t, h, vd = sum(Q_LENS), d.num_heads, d.v_head_dim
    n = batch.w.numel()
    big = torch.full((n + t * h * vd,), SENTINEL)
    if prepared:
        weight = prepare_kv_b_proj(batch.w, d)
        flat = weight.weight.view(-1)
        out = flat[: t * h * vd].view(t, h, vd)
    else:
        weight = big[:n].view_as(batch.w).copy_(batch.w)
        flat = big
        out = big[n - 3 : n - 3 + t * h * vd].view(t, h, vd)  # overlaps the weight's last 3 elements
    before = flat.clone()
    with pytest.raises(ValueError, match=r"^out shares memory with kv_b_proj_weight"):
        mla_prefill(**dict(args, kv_b_proj_weight=weight), plan=plan, out=out)
    assert torch.equal(flat, before)  # nothing written


def test_prefill_accepts_an_out_next_to_its_inputs_in_one_buffer(prefill, tiny_dims, ref):
    """Disjoint parts of one buffer are no overlap: q and out side by side."""
    plan, args, batch = prefill
    d = tiny_dims
    t, h, vd = sum(Q_LENS), d.num_heads, d.v_head_dim
    big = torch.empty(t * h * (d.head_dim_qk + vd))
    q = big[: t * h * d.head_dim_qk].view(t, h, d.head_dim_qk).copy_(batch.q)
    out = big[t * h * d.head_dim_qk :].view(t, h, vd)
    got = mla_prefill(**dict(args, q=q), plan=plan, out=out)
    want = mla_prefill(**args, plan=plan)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("name", ["q", "kv_c", "k_pe", "kv_b_proj_weight", "kv_cache"])
def test_prefill_refuses_inputs_requiring_grad_while_autograd_records(ref, name):
    """mla_bridge has no backward: an input that requires grad while autograd records is refused by name before
    anything is written (on CUDA its gradient was lost silently: FlashInfer and the Triton kernels write outside
    autograd; on the CPU a kv_c requiring grad failed inside torch.bmm(out=) after out was allocated, and a q requiring
    grad was differentiated). Under torch.no_grad() and torch.inference_mode() the same tensors run and give the
    plain result."""
    from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    batch = ref.make_mla_batch(d, [3, 4], [5, 9], 4, seed=3)
    plan = PrefillPlan.build(
        [3, 4], [5, 9], dims=d, workspace=Workspace("cpu", chunk_tokens=6), block_size=4, dtype=torch.float32
    )
    args = dict(q=batch.q, kv_c=batch.kv_c, k_pe=batch.k_pe, kv_b_proj_weight=batch.w, kv_cache=batch.cache)
    want = mla_prefill(*args.values(), batch.block_table, plan)
    args[name] = args[name].clone().requires_grad_(True)
    out = torch.full_like(want, 7.0)
    with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording.*torch.no_grad\(\)"):
        mla_prefill(*args.values(), batch.block_table, plan, out=out)
    assert bool((out == 7.0).all())
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = mla_prefill(*args.values(), batch.block_table, plan)
        assert not got.requires_grad and torch.equal(got, want), mode.__name__


def _small_ragged():
    """``(q/k/v dict, indptr, plan)`` of a small causal CPU batch (2 requests, 2 heads) for the autograd tests."""
    g = torch.Generator().manual_seed(1)
    x = dict(
        q=torch.randn(6, 2, 24, generator=g), k=torch.randn(6, 2, 24, generator=g), v=torch.randn(6, 2, 16, generator=g)
    )
    ind = torch.tensor([0, 2, 6], dtype=torch.int32)
    plan = plan_ragged(
        ind,
        ind,
        num_heads=2,
        head_dim_qk=24,
        head_dim_vo=16,
        causal=True,
        sm_scale=0.2,
        dtype=torch.float32,
        workspace=Workspace("cpu"),
    )
    return x, ind, plan


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_ragged_run_refuses_inputs_requiring_grad_while_autograd_records(name):
    x, ind, plan = _small_ragged()
    want = plan.run(**x)
    x[name] = x[name].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording"):
        plan.run(**x)
    with pytest.raises(ValueError, match=rf"^{name} requires grad"):
        ragged_prefill(x["q"], x["k"], x["v"], ind, ind, causal=True, sm_scale=0.2)
    with torch.inference_mode():
        got = plan.run(**x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("name", ["kv_cache_scale", "kv_b_proj_weight.weight"])
def test_prefill_refuses_a_scale_or_prepared_weight_requiring_grad(ref, name):
    """The inputs past the five tensors: an FP8 cache's kv_cache_scale tensor and a PreparedKVBProj whose weight
    requires grad (one made directly over a Parameter) are refused by name too while autograd records. They were
    not: on the CPU both failed inside torch.bmm(out=) ("functions with out=... arguments don't support automatic
    differentiation"), the scale after the main pass had written out (the chunked schedule), and the identity layout
    was refused as "k" (an internal name); on CUDA the gradient was lost."""
    from mla_bridge import MLADims, PrefillPlan, PreparedKVBProj, Workspace, mla_prefill, prepare_kv_b_proj
    from mla_bridge.cache import quantize_latent_cache

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    batch = ref.make_mla_batch(d, [3, 4], [5, 9], 4, seed=3)
    plan = PrefillPlan.build(
        [3, 4],
        [5, 9],
        dims=d,
        workspace=Workspace("cpu", chunk_tokens=6),
        block_size=4,
        dtype=torch.float32,
        kv_cache_dtype="fp8",
    )
    assert plan.chunks  # main pass first, then the context chunks (which read the scale)
    cache, scale = quantize_latent_cache(torch.nan_to_num(batch.cache))
    weights = [prepare_kv_b_proj(batch.w, d), prepare_kv_b_proj(batch.w, d, layout="identity")]
    want = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, weights[0], cache, batch.block_table, plan, kv_cache_scale=scale
    )
    if name == "kv_cache_scale":
        calls = [(weights[0], scale.clone().requires_grad_(True))]
    else:
        calls = [(PreparedKVBProj(d, w.layout, w.weight.clone().requires_grad_(True)), scale) for w in weights]
    for weight, s in calls:
        out = torch.full_like(want, 7.0)
        with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording"):
            mla_prefill(
                batch.q, batch.kv_c, batch.k_pe, weight, cache, batch.block_table, plan, out=out, kv_cache_scale=s
            )
        assert bool((out == 7.0).all()), "out was written before the error"
        with torch.no_grad():
            got = mla_prefill(batch.q, batch.kv_c, batch.k_pe, weight, cache, batch.block_table, plan, kv_cache_scale=s)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["out", "lse"])
def test_ragged_run_refuses_an_out_or_lse_requiring_grad_while_autograd_records(name):
    """out / lse are written outside autograd (FlashInfer): one that requires grad is refused by name, as
    mla_prefill refuses its out. It was not: a leaf failed inside the torch backend ("a view of a leaf Variable that
    requires grad is being used in an in-place operation", naming nothing), and a non-leaf was written with a
    stale autograd history (on CUDA nothing at all recorded). Under torch.no_grad() it is written."""
    x, ind, plan = _small_ragged()
    want = plan.run(**x)
    shape = (6, 2, 16) if name == "out" else (6, 2)
    for buf in (
        torch.full(shape, SENTINEL, requires_grad=True),  # a leaf
        torch.full(shape, SENTINEL, requires_grad=True) * 1,
    ):  # a non-leaf
        with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording"):
            plan.run(**x, **{name: buf})
        with pytest.raises(ValueError, match=rf"^{name} requires grad"):
            ragged_prefill(x["q"], x["k"], x["v"], ind, ind, causal=True, sm_scale=0.2, **{name: buf})
        assert bool((buf == SENTINEL).all()), "written before the error"
        with torch.no_grad():
            got = plan.run(**x, **{name: buf})
        assert torch.equal(got[0 if name == "out" else 1], want[0 if name == "out" else 1])


def test_forward_mode_tangents_are_refused_too(ref):
    """Forward-mode AD (torch.func.jvp / jacfwd, torch.autograd.forward_ad) is not stopped by torch.no_grad() and
    sets no requires_grad: a q carrying a tangent was run, differentiated by the CPU's torch ops (on CUDA the
    tangent would be lost: FlashInfer and the Triton kernels write outside autograd). mla_prefill, RaggedPlan.run and
    merge_attn_states now refuse it by name, with and without torch.no_grad(); the primal alone runs."""
    import torch.autograd.forward_ad as fwAD
    from mla_bridge import merge_attn_states

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    batch = ref.make_mla_batch(d, [3, 4], [5, 9], 4, seed=3)
    plan = PrefillPlan.build(
        [3, 4], [5, 9], dims=d, workspace=Workspace("cpu", chunk_tokens=6), block_size=4, dtype=torch.float32
    )
    rest = (batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan)
    want = mla_prefill(batch.q, *rest)
    q, k, v, qo, kv = ragged_inputs()
    rplan = make_plan(qo, kv)
    match = r"^q carries a forward-mode tangent .*unpack_dual\(q\)\.primal"
    for mode in (torch.enable_grad, torch.no_grad):
        with mode():
            with pytest.raises(ValueError, match=match):
                torch.func.jvp(lambda x: mla_prefill(x, *rest), (batch.q,), (torch.ones_like(batch.q),))
            with pytest.raises(ValueError, match=match):
                torch.func.jvp(lambda x: rplan.run(x, k, v)[0], (q,), (torch.ones_like(q),))
            with fwAD.dual_level():
                dual = fwAD.make_dual(batch.q, torch.ones_like(batch.q))
                out = torch.full_like(want, SENTINEL)
                with pytest.raises(ValueError, match=match):
                    mla_prefill(dual, *rest, out=out)
                assert_untouched(out)
                with pytest.raises(ValueError, match=r"^lse_b carries a forward-mode tangent"):
                    merge_attn_states(
                        want, torch.zeros(7, 2), want, fwAD.make_dual(torch.zeros(7, 2), torch.ones(7, 2))
                    )
                assert torch.equal(mla_prefill(fwAD.unpack_dual(dual).primal, *rest), want)


def test_ragged_prefill_refuses_autograd_before_planning(monkeypatch):
    """ragged_prefill plans, then runs: an input that requires grad was refused by RaggedPlan.run only after
    plan_ragged had planned (on CUDA FlashInfer's plan, host-to-device copies and a pooled wrapper). Now it is
    refused before."""
    import mla_bridge.ragged as ragged_mod

    def no_plan(*args, **kwargs):
        raise AssertionError("planned before the autograd refusal")

    q, k, v, qo, kv = ragged_inputs()
    monkeypatch.setattr(ragged_mod, "plan_ragged", no_plan)
    for name in ("q", "v", "out"):
        args = dict(q=q, k=k, v=v, out=sentinel_out())
        args[name] = args[name].clone().requires_grad_(True)
        with pytest.raises(ValueError, match=rf"^{name} requires grad and autograd is recording"):
            ragged_prefill(**args, qo_indptr=qo, kv_indptr=kv, causal=False, sm_scale=0.2)


@pytest.mark.parametrize("hook", [3, "gather", [print]])
def test_mla_prefill_refuses_a_phase_hook_that_is_not_callable(ref, tiny_dims, hook):
    """A phase_hook that cannot be called was found only at the first phase, after out and lse were allocated, with
    "'int' object is not callable"; now a TypeError naming it, before anything is
    allocated or written. A falsy non-callable (0, "") is refused too, not taken for None."""
    q_lens, c_lens = [3, 2], [5, 9]
    batch = ref.make_mla_batch(tiny_dims, q_lens, c_lens, 4, seed=2)
    plan = PrefillPlan.build(
        q_lens, c_lens, dims=tiny_dims, workspace=Workspace("cpu", chunk_tokens=4), block_size=4, dtype=torch.float32
    )
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan)
    for bad in (hook, 0, ""):
        out = sentinel_out(5, tiny_dims.num_heads, tiny_dims.v_head_dim)
        with pytest.raises(TypeError, match="phase_hook must be callable"):
            mla_prefill(*args, out=out, phase_hook=bad)
        assert_untouched(out)
    seen = []
    mla_prefill(*args, phase_hook=seen.append)
    assert seen[-1] == "end" and "main pass" in seen


# --------------------------------------------------------------------------------------------------------------
# ragged attention: destinations that share memory with what the kernel reads
# --------------------------------------------------------------------------------------------------------------


def _aliased(case):
    """(q, k, v, qo, kv, out, lse) of a self-attention batch (T = S, so out=v fits) with the destinations of
    ``case``: an out or lse that views an input, or an lse inside out."""
    q, k, v, qo, kv = ragged_inputs(q_lens=(2, 3), kv_lens=(2, 3))
    out = lse = None
    if case == "out=q[..., :D_VO]":
        out = q[..., :D_VO]
    elif case == "out=v":
        out = v
    elif case == "out=k[..., D_QK - D_VO:]":
        out = k[..., D_QK - D_VO :]
    elif case == "lse in q":
        lse = q.view(-1)[5 * H : 10 * H].view(5, H)
    elif case == "lse in out":
        out = torch.zeros(5, H, D_VO)
        lse = out.view(-1)[-5 * H :].view(5, H)
    elif case == "out overlaps itself":
        out = torch.zeros(1, H, D_VO).expand(5, H, D_VO)
    return q, k, v, qo, kv, out, lse


ALIAS_CASES = [
    ("out=q[..., :D_VO]", r"^out shares memory with q"),
    ("out=v", r"^out shares memory with v"),
    ("out=k[..., D_QK - D_VO:]", r"^out shares memory with k"),
    ("lse in q", r"^lse shares memory with q"),
    ("lse in out", r"^lse shares memory with out"),
    ("out overlaps itself", r"^out must not overlap itself"),
]


@pytest.mark.parametrize("case,match", ALIAS_CASES)
def test_ragged_refuses_an_out_or_lse_sharing_memory_with_what_it_reads(case, match):
    """An out / lse that shares memory with q, k or v (or with each other) is refused by name before any work, by
    RaggedPlan.run and by ragged_prefill (before it plans), as mla_prefill refuses its out. They were taken:
    ``ragged_prefill(..., out=q[..., :128])`` and ``out=v`` ran and overwrote their input (right on the CPU by luck of
    the torch backend's order, a race on CUDA, where each tile reads q / k / v while others write out). Nothing is
    written."""
    import mla_bridge.ragged as ragged_mod

    q, k, v, qo, kv, out, lse = _aliased(case)
    before = [x.clone() for x in (q, k, v)]
    plan = make_plan(qo, kv, causal=True)
    with pytest.raises(ValueError, match=match):
        plan.run(q, k, v, out=out, lse=lse)
    with pytest.raises(ValueError, match=match):
        ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.2, out=out, lse=lse)
    with pytest.MonkeyPatch.context() as m:  # refused before planning (on CUDA: FlashInfer's plan, copies, a wrapper)
        m.setattr(ragged_mod, "plan_ragged", lambda *a, **k: pytest.fail("planned before the refusal"))
        with pytest.raises(ValueError, match=match):
            ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.2, out=out, lse=lse)
    for x, b in zip((q, k, v), before):
        assert torch.equal(x, b), "an input was written before the error"


def test_ragged_accepts_destinations_next_to_its_inputs_in_one_buffer():
    """Disjoint parts of one buffer are no overlap: q, k, v, out and lse side by side, each run equal to the run
    with destinations of their own."""
    q0, k0, v0, qo, kv = ragged_inputs()
    parts = [q0.numel(), k0.numel(), v0.numel(), 5 * H * D_VO, 5 * H]
    big = torch.empty(sum(parts))
    q, k, v, out, lse = big.split(parts)
    q, k, v = q.view_as(q0).copy_(q0), k.view_as(k0).copy_(k0), v.view_as(v0).copy_(v0)
    out, lse = out.view(5, H, D_VO), lse.view(5, H)
    plan = make_plan(qo, kv, causal=True)
    want_out, want_lse = plan.run(q0, k0, v0)
    got_out, got_lse = plan.run(q, k, v, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out.fill_(SENTINEL)
    ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=0.2, out=out, lse=lse)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_sizes_that_cannot_fit_are_refused_naming_the_argument():
    """A batch whose outputs alone exceed all the memory of the device (here 2**30 tokens x 16 heads: terabytes) is
    refused with a ValueError naming the argument that sets the size, before anything is allocated; before, the
    allocator's error came from deep in the call and named nothing."""
    n = 2**30
    one = torch.zeros(1)
    q, k, v = one.expand(n, 16, 192), one.expand(n, 16, 192), one.expand(n, 16, 128)
    with pytest.raises(ValueError, match=r"^qo_indptr: out and lse of 1073741824 tokens x 16 heads need .* GiB, more"):
        ragged_prefill(q, k, v, [0, n], [0, n], causal=True, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"^qo_indptr: out and lse of 1073741824 tokens"):
        plan_ragged(
            [0, n],
            [0, n],
            num_heads=16,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=True,
            sm_scale=0.1,
            dtype=torch.float32,
            workspace=Workspace("cpu"),
        )
    ws = Workspace("cpu")
    dims = MLADims(num_heads=16)
    with pytest.raises(ValueError, match=r"^query_lens: out, lse and k / v of 1073741824 new tokens x 16 heads"):
        PrefillPlan.build([n], [0], dims=dims, workspace=ws, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^query_lens: out and lse of 1073741824 new tokens"):
        PrefillPlan.build([n], [0], dims=dims, workspace=ws, block_size=16, dtype=torch.float32, index_topk=2048)
    # what fits is planned as before
    assert PrefillPlan.build([8], [0], dims=dims, workspace=ws, block_size=16, dtype=torch.float32).num_tokens == 8


def test_a_dtype_given_by_its_name_is_refused_with_the_torch_dtype_to_pass():
    """``dtype="float32"`` read "must be one of bfloat16, float16, float32, float64, got 'float32'": the message
    listed the name it refused. It now says to pass the torch.dtype."""
    from mla_bridge import Workspace, plan_ragged

    with pytest.raises(TypeError, match=r"got 'float32' \(a str: pass the torch\.dtype torch\.float32\)$"):
        plan_ragged([0, 2], [0, 2], num_heads=2, head_dim_qk=8, head_dim_vo=8, causal=True, sm_scale=0.5,
                    dtype="float32", workspace=Workspace("cpu"))  # fmt: skip
