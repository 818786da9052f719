"""mla_prefill with an FP8 e4m3 latent cache (torch backend, CPU) against float64 over the dequantized cache.

The cache of tests.helpers.reference.make_mla_batch (shuffled blocks, NaN in spare blocks and unused slots, -1 table
padding) is quantized with mla_bridge.cache.quantize_latent_cache; the reference reads the same bytes back as
``float64(stored) * scale`` (tests.helpers.reference.mla_reference on that float64 cache, and mla_bridge.reference).
"""

from __future__ import annotations

import copy

import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill
from mla_bridge import reference as R
from mla_bridge.cache import quantize_latent_cache
from mla_bridge.prefill import prefill_memory_bytes

ATOL = 3e-5
F8 = torch.float8_e4m3fn
QUERY_LENS = [3, 4, 1, 0, 5, 2]
CONTEXT_LENS = [0, 37, 5, 9, 70, 0]


def fp8_batch(ref, dims, q_lens, c_lens, block_size, seed=0, dtype=torch.float32, scale=None, gain=3.0):
    """A batch whose cache holds ``gain`` x the random latents, quantized (so the scale is not ~1/448 x 4)."""
    batch = ref.make_mla_batch(dims, q_lens, c_lens, block_size, seed=seed, dtype=dtype)
    batch.latent_cache = batch.cache
    batch.cache, batch.scale = quantize_latent_cache(batch.cache.float() * gain, scale)
    deq = copy.copy(batch)
    deq.cache = batch.cache.double() * float(batch.scale)  # the same bytes, read back in float64
    return batch, deq


def plan_for(dims, q_lens, c_lens, block_size, chunk_tokens, fuse=True, dtype=torch.float32, kv_cache_dtype="fp8"):
    return PrefillPlan.build(
        q_lens,
        c_lens,
        dims=dims,
        workspace=Workspace("cpu", chunk_tokens=chunk_tokens),
        block_size=block_size,
        dtype=dtype,
        fuse_context=fuse,
        kv_cache_dtype=kv_cache_dtype,
    )


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("budget", [1, 23, 121, 100_000])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_fp8_cache_equals_float64_over_the_dequantized_cache(ref, tiny_dims, block_size, budget, fuse):
    batch, deq = fp8_batch(ref, tiny_dims, QUERY_LENS, CONTEXT_LENS, block_size, seed=block_size)
    assert torch.isnan(batch.cache.float()).any()  # the poison survives quantization (e4m3fn has NaN)
    plan = plan_for(tiny_dims, QUERY_LENS, CONTEXT_LENS, block_size, budget, fuse)
    assert plan.fused == (fuse and budget >= sum(CONTEXT_LENS)) and plan.kv_cache_dtype == F8
    out, lse = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        return_lse=True,
        kv_cache_scale=batch.scale,
    )
    exp_out, exp_lse = ref.mla_reference(deq)
    ref.assert_out_close(out, exp_out, atol=ATOL)
    ref.assert_lse_close(lse, exp_lse, atol=ATOL)


def test_scale_forms_and_uint8_view_give_identical_results(ref, tiny_dims):
    batch, deq = fp8_batch(ref, tiny_dims, [3, 2], [13, 6], 4, seed=3)
    s = float(batch.scale)
    plan = plan_for(tiny_dims, [3, 2], [13, 6], 4, 5, fuse=False)
    base = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, kv_cache_scale=batch.scale
    )
    for cache, scale in ((batch.cache, s), (batch.cache, torch.tensor([s])), (batch.cache.view(torch.uint8), s)):
        got = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, cache, batch.block_table, plan, kv_cache_scale=scale
        )
        assert torch.equal(got, base)
    plan_u8 = plan_for(tiny_dims, [3, 2], [13, 6], 4, 5, fuse=False, kv_cache_dtype=torch.uint8)
    assert plan_u8.kv_cache_dtype == F8
    ref.assert_out_close(base, ref.mla_reference(deq)[0], atol=ATOL)


def test_scale_matters(ref, tiny_dims):
    """Guards the tests above: a wrong scale changes the result (so the scale is really applied)."""
    batch, _ = fp8_batch(ref, tiny_dims, [3], [10], 4, seed=6)
    plan = plan_for(tiny_dims, [3], [10], 4, 100)
    a = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, kv_cache_scale=batch.scale
    )
    b = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        plan,
        kv_cache_scale=2 * float(batch.scale),
    )
    assert (a - b).abs().max() > 1e-2


def test_quantization_error_against_the_unquantized_cache(ref, tiny_dims):
    """The FP8 cache's error against the unquantized cache is the quantization error: e4m3 keeps 3 mantissa bits
    (relative step 2**-4), so it is far above the kernel error and of a few percent here."""
    q_lens, c_lens = [4, 3], [40, 25]
    batch, deq = fp8_batch(ref, tiny_dims, q_lens, c_lens, 16, seed=11)
    plan = plan_for(tiny_dims, q_lens, c_lens, 16, 100)
    out = mla_prefill(
        batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, kv_cache_scale=batch.scale
    )
    unq = copy.copy(batch)
    unq.cache = batch.latent_cache * 3.0
    exp_unq = ref.mla_reference(unq)[0]
    err = float((out.double() - exp_unq).abs().max() / exp_unq.abs().max())
    assert 1e-4 < err < 0.1, err
    assert float((out.double() - ref.mla_reference(deq)[0]).abs().max()) < ATOL


def test_bf16_plan_with_fp8_cache(ref, tiny_dims):
    q_lens, c_lens = [3, 5], [12, 7]
    batch, deq = fp8_batch(ref, tiny_dims, q_lens, c_lens, 4, seed=12, dtype=torch.bfloat16, gain=1.0)
    for chunk, fuse in ((8, False), (100, True)):
        plan = plan_for(tiny_dims, q_lens, c_lens, 4, chunk, fuse, dtype=torch.bfloat16)
        out, lse = mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            batch.cache,
            batch.block_table,
            plan,
            return_lse=True,
            kv_cache_scale=batch.scale,
        )
        assert out.dtype == torch.bfloat16
        exp_out, exp_lse = ref.mla_reference(deq)
        ref.assert_out_close(out, exp_out, atol=3e-2)  # the bf16 tolerance of tests/test_prefill.py
        ref.assert_lse_close(lse, exp_lse, atol=3e-2)


def test_reference_request_dequantizes_the_same_bytes(ref, tiny_dims):
    q_lens, c_lens = [4], [21]
    batch, deq = fp8_batch(ref, tiny_dims, q_lens, c_lens, 8, seed=13)
    exp_out, exp_lse = ref.mla_reference(deq)
    for cache in (batch.cache, batch.cache.view(torch.uint8)):
        out, lse = R.reference_request(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            cache,
            batch.block_table[0],
            21,
            tiny_dims,
            kv_cache_scale=batch.scale,
        )
        torch.testing.assert_close(out, exp_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, exp_lse, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="kv_cache_scale is required"):
        R.reference_request(batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table[0], 21, tiny_dims)
    with pytest.raises(ValueError, match="only FP8"):
        R.gather_context_latent(deq.cache, batch.block_table[0], 21, 0.5)


@pytest.mark.parametrize("context_len", [-1, 8 * 3 + 1])
def test_reference_gather_refuses_a_context_beyond_the_block_table_row(context_len):
    """A context longer than the row's blocks hold (or negative) is named (before: a bare
    IndexError from the block loop, or an empty gather for a negative length)."""
    cache = torch.zeros(5, 8, 4)
    row = torch.tensor([4, 0, 2])
    assert R.gather_context_latent(cache, row, 8 * 3).shape == (24, 4)
    with pytest.raises(ValueError, match="context_len"):
        R.gather_context_latent(cache, row, context_len)


def test_real_dims_deepseek_v2_lite_fp8(ref):
    dims = MLADims.deepseek_v2_lite()
    q_lens, c_lens = [4, 2], [19, 0]
    batch, deq = fp8_batch(ref, dims, q_lens, c_lens, 16, seed=10)
    exp_out, exp_lse = ref.mla_reference(deq)
    for chunk, fuse in ((7, False), (64, True)):
        plan = plan_for(dims, q_lens, c_lens, 16, chunk, fuse)
        out, lse = mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            batch.cache,
            batch.block_table,
            plan,
            return_lse=True,
            kv_cache_scale=batch.scale,
        )
        ref.assert_out_close(out, exp_out, atol=1e-4)
        ref.assert_lse_close(lse, exp_lse, atol=1e-4)


# -------------------------------------------------------------------------------------------------- refusals
def _refused(ref, dims, exc, match, *, plan_dtype="fp8", cache=None, scale="ok"):
    batch, _ = fp8_batch(ref, dims, [2, 1], [5, 3], 4, seed=1)
    plan = plan_for(dims, [2, 1], [5, 3], 4, 100, kv_cache_dtype=plan_dtype)
    out = torch.full((3, dims.num_heads, dims.v_head_dim), 7.0)
    with pytest.raises(exc, match=match):
        mla_prefill(
            batch.q,
            batch.kv_c,
            batch.k_pe,
            batch.w,
            batch.cache if cache is None else cache,
            batch.block_table,
            plan,
            out=out,
            kv_cache_scale=batch.scale if scale == "ok" else scale,
        )
    assert (out == 7.0).all()  # nothing written


def test_refusals(ref, tiny_dims):
    d = tiny_dims
    f32_cache = torch.zeros(6, 4, d.latent_dim)
    _refused(ref, d, ValueError, "kv_cache_scale is required", scale=None)
    _refused(ref, d, ValueError, "only an FP8 cache takes a scale", plan_dtype=None, cache=f32_cache, scale=0.5)
    _refused(ref, d, TypeError, "kv_cache_dtype='fp8'", plan_dtype=None, scale=None)  # fp8 cache, unquantized plan
    _refused(ref, d, TypeError, "kv_cache_dtype=None", cache=f32_cache)  # unquantized cache, fp8 plan
    for bad in (0.0, -0.5, float("inf"), float("nan"), torch.tensor(float("inf"))):
        _refused(ref, d, ValueError, "finite and > 0", scale=bad)
    _refused(ref, d, ValueError, "fp8_ds_mla", cache=torch.zeros(6, 4, 656, dtype=torch.uint8))
    _refused(ref, d, ValueError, "not supported", cache=torch.zeros(6, 4, d.latent_dim, dtype=torch.float8_e5m2))
    _refused(ref, d, ValueError, r"kv_cache must be \[num_blocks", cache=torch.zeros(6, 4, 3, dtype=F8))
    with pytest.raises(ValueError, match="not supported"):
        plan_for(d, [1], [1], 4, 100, kv_cache_dtype="fp8_e5m2")


# ---------------------------------------------------------------------------------------------------- memory
def test_prefill_memory_bytes_counts_the_fp8_gather():
    """torch gather with an FP8 cache: per context row the fp8 rows (1 byte), their float32 product (4) and the
    rounded rows (e) plus 24 bytes of indices, instead of the bf16 path's e + 24 (V2-Lite dims, hand-computed)."""
    d = MLADims.deepseek_v2_lite()
    e, lat, p, h = 2, 576, 320, 16
    fixed = h * 256 * 512 * e + 150 * h * (128 * e + 4)  # the split-layout weight (prepared per call), out, lse
    ws = Workspace("cpu", chunk_tokens=1000)
    kw = dict(dims=d, workspace=ws, block_size=16, dtype=torch.bfloat16)
    bf16 = PrefillPlan.build([100, 50], [300, 0], **kw)
    fp8 = PrefillPlan.build([100, 50], [300, 0], kv_cache_dtype="fp8", **kw)
    assert prefill_memory_bytes(bf16) == fixed + 450 * lat * e + 300 * (lat * e + 24) + 450 * h * p * e
    assert prefill_memory_bytes(fp8) == fixed + 450 * lat * e + 300 * (lat * (1 + 4 + e) + 24) + 450 * h * p * e


def test_prefill_memory_bytes_does_not_depend_on_the_gather_implementation(monkeypatch):
    """The budget is the torch path's upper bound whichever gather runs (the Triton one allocates less)."""
    d = MLADims.deepseek_v2_lite()
    kw = dict(dims=d, workspace=Workspace("cpu", chunk_tokens=1000), block_size=16, dtype=torch.bfloat16)
    for kv in (None, "fp8"):
        torch_path = prefill_memory_bytes(PrefillPlan.build([100, 50], [300, 0], kv_cache_dtype=kv, **kw))
        monkeypatch.setenv("MLA_BRIDGE_GATHER", "triton")
        assert prefill_memory_bytes(PrefillPlan.build([100, 50], [300, 0], kv_cache_dtype=kv, **kw)) == torch_path
        monkeypatch.delenv("MLA_BRIDGE_GATHER")


# ------------------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("extra,schedule", [([], "fused"), (["--chunk-tokens", "32"], "chunked")])
def test_cli_kv_cache_dtype_fp8(tmp_path, capsys, extra, schedule):
    import json

    from mla_bridge.cli import main

    path = tmp_path / "out.json"
    argv = [
        "prefill",
        "--device",
        "cpu",
        "--prompt-lens",
        "4,6",
        "--context-lens",
        "50,23",
        "--block-size",
        "8",
        "--check-requests",
        "2",
        "--kv-cache-dtype",
        "fp8",
        "--json",
        str(path),
        *extra,
    ]
    assert main(argv) == 0
    res = json.loads(path.read_text())
    kv = res["kv_cache"]
    assert res["schedule"] == schedule and kv["dtype"] == "fp8_e4m3" and 0 < kv["scale"] < 1
    blocks = -(-50 // 8) + -(-23 // 8) + 1
    assert kv["bytes"] == blocks * 8 * 576  # one byte per value
    check = res["check"]
    assert check["passed"] and check["max_abs_err_out"] < 1e-4  # kernels vs float64 over the dequantized bytes
    q_err = max(c["max_abs_err_out_vs_unquantized"] for c in check["requests"])
    assert 100 * check["max_abs_err_out"] < q_err < 0.5  # the quantization error, reported beside the check
    text = capsys.readouterr().out
    for words in ("fp8_e4m3", "kv_cache_scale", "fp8 quantization error", "PASS", "dequantized"):
        assert words in text, words
    assert (
        main(
            [
                "prefill",
                "--device",
                "cpu",
                "--prompt-lens",
                "4",
                "--context-lens",
                "8",
                "--block-size",
                "8",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    res = json.loads(path.read_text())
    assert res["kv_cache"] == {"dtype": "float32", "scale": None, "bytes": 2 * 8 * 576 * 4, "quantization": None}


# ----------------------------------------------------------------------------------------------------- bench
def test_bench_context_section_has_fp8_rows(tmp_path):
    """FP8-cache rows beside the bf16 ones (same cases), with their ratio to the bf16 row of the same run and the
    quantization error; the torch-gather rows are skipped where the default gather is the torch one (the CPU)."""
    import json

    from mla_bridge.bench import main as bench_main

    path = tmp_path / "b.json"
    bench_main(["--device", "cpu", "--sections", "context", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    by = lambda p: [r for r in rows if r["path"] == p]  # noqa: E731
    bf16, fp8 = by("mla_prefill"), by("mla_prefill, FP8 cache")
    assert len(fp8) == len(bf16) and {r["case"] for r in fp8} == {r["case"] for r in bf16}
    no_context = [r for r in fp8 if "no context" in r["case"]]
    assert no_context and all(r["status"] == "skipped" and "cache is not read" in r["note"] for r in no_context)
    fp8 = [r for r in fp8 if r not in no_context]
    assert len(fp8) >= 4
    for r in fp8:
        assert r["status"] == "ok" and r["extra"]["vs_bf16_cache"] > 0
        assert 1e-3 < r["extra"]["rel_err_vs_unquantized"] < 0.2 and r["extra"]["kv_cache_scale"] > 0
        assert r["extra"]["fused"] == next(b for b in bf16 if b["case"] == r["case"])["extra"]["fused"]
    assert all(r["status"] == "ok" for r in by("phase: gather by block_table, FP8 cache"))
    assert all(r["status"] == "skipped" for r in by("phase: gather by block_table, torch gather"))


def test_cli_memory_estimate_counts_the_fp8_cache():
    """The CLI's estimate holds the 1-byte FP8 copy beside the unquantized cache (kept for the quantization error)
    and the quantization's float32 temporaries as a peak."""
    from mla_bridge.cli.memory import estimate_run_memory

    d = MLADims.deepseek_v2_lite()
    kw = dict(dims=d, workspace=Workspace("cpu", chunk_tokens=1000), block_size=16, dtype=torch.float32)
    blocks = -(-300 // 16) + 1
    for kv, extra in ((None, 0), ("fp8", blocks * 16 * 576)):
        plan = PrefillPlan.build([100, 50], [300, 0], kv_cache_dtype=kv, **kw)
        est = estimate_run_memory(d, [100, 50], [300, 0], 16, torch.float32, "cpu", [0], plan=plan)
        assert est.held["device"].get("FP8 paged cache", 0) == extra
        assert est.peaks["device"].get("quantizing the cache", 0) == 9 * extra
