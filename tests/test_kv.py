"""mla_bridge.kv: the choice between the fused gather + up-projection kernel and the separate path, its refusals, and
the Triton kernel itself (interpreted on CPU tensors where Triton is installed; CI has none, the GPU tests cover the
compiled kernel: tests/gpu/test_gpu_up_project.py)."""

from __future__ import annotations


import pytest
import torch

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill
from mla_bridge import kv as KV


def test_default_is_auto_on_cuda_with_triton_else_separate(monkeypatch):
    import mla_bridge.kernels as K

    monkeypatch.delenv("MLA_BRIDGE_KV", raising=False)
    monkeypatch.setattr(K, "triton_available", lambda: True)
    assert KV.kv_impl(torch.device("cpu")) == "separate"
    assert KV.kv_impl(torch.device("cuda")) == KV.kv_impl(torch.device("cuda"), " AUTO ") == "auto"
    # float32 / float64 batches keep the separate path (float64 is beyond the fused kernel: it accumulates in float32)
    for dtype in (torch.float32, torch.float64):
        assert (
            KV.kv_impl(torch.device("cuda"), None, dtype)
            == KV.kv_impl(torch.device("cuda"), "auto", dtype)
            == "separate"
        )
    assert KV.kv_impl(torch.device("cuda"), None, torch.float16) == "auto"
    monkeypatch.setattr(K, "triton_available", lambda: False)
    assert KV.kv_impl(torch.device("cuda")) == KV.kv_impl(torch.device("cuda"), "auto") == "separate"


def test_fused_refuses_float64(monkeypatch):
    import mla_bridge.kernels as K

    monkeypatch.setattr(K, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="'fused' computes bfloat16, float16 or float32, got torch.float64"):
        KV.kv_impl(torch.device("cuda"), "fused", torch.float64)
    monkeypatch.setenv("MLA_BRIDGE_KV", "fused")
    with pytest.raises(ValueError, match="MLA_BRIDGE_KV 'fused' computes"):
        KV.kv_impl(torch.device("cuda"), None, torch.float64)
    assert KV.kv_impl(torch.device("cuda"), None, torch.float32) == "fused"


def test_auto_takes_the_fused_kernel_only_for_smaller_gathered_passes():
    assert KV.pass_impl("auto", gathered=True, kv_cache_fp8=False) == "fused"
    assert KV.pass_impl("auto", gathered=False, kv_cache_fp8=False) == "fused"  # a pass of 0 rows
    # with a split-layout weight, the large gathered passes go to cuBLAS; the identity layout's GEMM never wins
    big, small = KV.SEPARATE_FROM_ROWS, KV.SEPARATE_FROM_ROWS - 1
    assert KV.pass_impl("auto", True, False, big, "split") == "separate"
    assert KV.pass_impl("auto", True, False, small, "split") == "fused"
    assert KV.pass_impl("auto", True, False, big, "identity") == "fused"
    # a pass gathering from an FP8 cache: cuBLAS from its own bound on, with either layout
    big8, small8 = KV.SEPARATE_FROM_ROWS_FP8, KV.SEPARATE_FROM_ROWS_FP8 - 1
    for layout in ("split", "identity"):
        assert KV.pass_impl("auto", True, True, big8, layout) == "separate"
        assert KV.pass_impl("auto", True, True, small8, layout) == "fused"
        assert KV.pass_impl("auto", True, True, 0, layout) == "fused"
    # new tokens alone (nothing gathered, the cache's dtype does not matter): cuBLAS from a higher bound on
    big_new, small_new = KV.SEPARATE_FROM_ROWS_NEW, KV.SEPARATE_FROM_ROWS_NEW - 1
    assert small_new >= big
    for fp8 in (False, True):
        for layout in ("split", "identity"):
            assert KV.pass_impl("auto", False, fp8, big_new, layout) == "separate"
            assert KV.pass_impl("auto", False, fp8, small_new, layout) == "fused"
    for mode in KV.KV_IMPLS:
        for gathered, fp8 in ((False, False), (False, True), (True, False), (True, True)):
            for rows in (0, small8, big8, big, big_new):
                assert KV.pass_impl(mode, gathered, fp8, rows) == mode


def test_auto_while_capturing_takes_the_gpu_faster_path_of_every_pass():
    """A pass captured into a CUDA graph pays no host time per launch at replay: "auto" then takes gather + cuBLAS
    whatever its size (the eager rule takes the fused kernel below its bounds), except that an identity-layout weight
    keeps the fused kernel (its GEMM has no FLOPs on the identity block), FP8 cache or not: every pass of a graph
    takes one implementation, so that it is bitwise eager "separate" or "fused" (the new tokens' pass was once
    fused while the FP8 chunks were separate)."""
    sizes = (0, 1, KV.SEPARATE_FROM_ROWS_FP8 - 1, KV.SEPARATE_FROM_ROWS - 1, KV.SEPARATE_FROM_ROWS_NEW)
    for rows in sizes:
        for gathered in (False, True):
            for fp8 in (False, True):
                assert KV.pass_impl("auto", gathered, fp8, rows, "split", capturing=True) == "separate"
                # one kernel for every pass of a graph: a new-token pass is never told the cache is FP8
                assert KV.pass_impl("auto", gathered, fp8, rows, "identity", capturing=True) == "fused"
                for mode in KV.KV_IMPLS:  # an explicit choice is captured as given
                    assert KV.pass_impl(mode, gathered, fp8, rows, "split", capturing=True) == mode
    assert KV.pass_impl("auto", False, False, 1024, "split") == "fused"  # eager: the same small pass, fused
    with pytest.raises(TypeError, match="capturing must be a bool, got 1"):
        KV.pass_impl("auto", True, False, 0, "split", capturing=1)
    with pytest.raises(TypeError, match=r"got np.True_ \(numpy.bool"):  # its type is named "bool" too
        KV.pass_impl("auto", True, False, 0, "split", capturing=__import__("numpy").bool_(True))


def test_a_raw_weight_is_chosen_for_as_the_split_layout():
    """A raw kv_b_proj (weights.CHECKPOINT_LAYOUT, read in place by the fused kernel) takes the split form on the
    separate path: pass_impl answers for it as for "split" (it was refused by name)."""
    from mla_bridge.weights import CHECKPOINT_LAYOUT

    for capturing in (False, True):
        for gathered, fp8 in ((False, False), (True, False), (True, True)):
            for rows in (0, 1024, KV.SEPARATE_FROM_ROWS, KV.SEPARATE_FROM_ROWS_NEW):
                assert KV.pass_impl("auto", gathered, fp8, rows, CHECKPOINT_LAYOUT, capturing) == KV.pass_impl(
                    "auto", gathered, fp8, rows, "split", capturing
                )
    with pytest.raises(ValueError, match="layout must be one of"):
        KV.pass_impl("auto", True, False, 0, "packed")


def test_capture_rule_makes_auto_choose_as_under_capture():
    """graphs.capture runs its warm-up calls and the capture under kv.capture_rule(), so that the warm-up launches the
    kernels the capture records: inside it an "auto" pass on CUDA chooses as for a graph; an explicit choice and the
    CPU do not change, and the rule ends with the context (also on an error)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    small = 1024
    # private: _pass_impl is where a pass reads the rule; on a CPU-only machine no public call runs an "auto" CUDA pass
    with KV.capture_rule():
        assert KV._pass_impl("auto", cuda, torch.bfloat16, True, False, small, "split") == "separate"
        assert KV._pass_impl("auto", cuda, torch.bfloat16, False, False, small, "split") == "separate"
        assert KV._pass_impl("auto", cuda, torch.bfloat16, True, False, small, "identity") == "fused"
        assert KV._pass_impl("auto", cuda, torch.bfloat16, True, True, small, "identity") == "fused"  # FP8 chunk
        assert KV._pass_impl("auto", cuda, torch.bfloat16, False, False, small, "identity") == "fused"  # new tokens
        assert KV._pass_impl("fused", cuda, torch.bfloat16, True, False, small, "split") == "fused"
        assert KV._pass_impl("separate", cpu, torch.float32, True, False, small, "split") == "separate"
    assert KV._CAPTURE_RULE.get() is False
    # outside it the eager rule, whatever a stream captures: nothing of torch.cuda is asked (on this CPU-only torch
    # torch.cuda.is_current_stream_capturing() raises), so a capture of one's own launches what its warm-up ran
    assert KV._pass_impl("auto", cuda, torch.bfloat16, True, False, small, "split") == "fused"
    assert KV._pass_impl("auto", cuda, torch.bfloat16, False, False, small, "split") == "fused"
    with pytest.raises(RuntimeError, match="inside"):
        with KV.capture_rule():
            raise RuntimeError("inside")
    assert KV._CAPTURE_RULE.get() is False


def test_env_and_argument_choose_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("MLA_BRIDGE_KV", "separate")
    assert KV.kv_impl(torch.device("cuda")) == "separate"
    monkeypatch.setenv("MLA_BRIDGE_KV", "cublas")
    with pytest.raises(ValueError, match="MLA_BRIDGE_KV must be one of"):
        KV.kv_impl(torch.device("cpu"))
    with pytest.raises(ValueError, match="kv_impl must be one of"):
        KV.kv_impl(torch.device("cpu"), "Fused!")
    monkeypatch.delenv("MLA_BRIDGE_KV")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        KV.kv_impl(torch.device("cpu"), "fused")


def test_auto_case_and_type_rules(monkeypatch):
    import mla_bridge.kernels as K

    monkeypatch.delenv("MLA_BRIDGE_KV", raising=False)
    monkeypatch.setattr(K, "triton_available", lambda: False)
    assert KV.kv_impl(torch.device("cuda"), "auto") == KV.kv_impl(torch.device("cuda"), " Separate ") == "separate"
    monkeypatch.setenv("MLA_BRIDGE_KV", "AUTO")
    assert KV.kv_impl(torch.device("cuda")) == "separate"
    for bad in ("", "0"):
        with pytest.raises(ValueError, match="kv_impl must be one of"):
            KV.kv_impl(torch.device("cpu"), bad)
    with pytest.raises(TypeError, match="kv_impl must be a string"):
        KV.kv_impl(torch.device("cpu"), 0)
    # the interpreter's bfloat16 tl.dot is wrong: "fused" on the CPU refuses bfloat16, takes float16/float32
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(K, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="cannot run bfloat16"):
        KV.kv_impl(torch.device("cpu"), "fused", torch.bfloat16)
    assert KV.kv_impl(torch.device("cpu"), "FUSED", torch.float16) == "fused"
    monkeypatch.setattr(K, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton"):
        KV.kv_impl(torch.device("cuda"), "fused")


@pytest.mark.parametrize(
    "env,value,match",
    [
        ("MLA_BRIDGE_GATHER", "cuda", "MLA_BRIDGE_GATHER"),
        ("MLA_BRIDGE_MERGE", "bogus", "MLA_BRIDGE_MERGE"),
        ("MLA_BRIDGE_MERGE", "triton", "needs a CUDA device"),
        ("MLA_BRIDGE_KV", "cublas", "MLA_BRIDGE_KV"),
        ("MLA_BRIDGE_TRITON_LAUNCH", "fast", "MLA_BRIDGE_TRITON_LAUNCH"),
        ("MLA_BRIDGE_FLASHINFER_DIRECT", "off", "MLA_BRIDGE_FLASHINFER_DIRECT"),
    ],
)
def test_mla_prefill_refuses_a_switch_that_cannot_serve_before_writing(monkeypatch, tiny_dims, ref, env, value, match):
    """The chunked schedule writes out in its main pass before the first chunk gathers and merges: a bad gather or
    merge switch must be refused before that, not after (the output would be half-written)."""
    b = ref.make_mla_batch(tiny_dims, [3, 2], [9, 7], 4)
    plan = PrefillPlan.build(
        b.query_lens,
        b.context_lens,
        dims=tiny_dims,
        workspace=Workspace("cpu", chunk_tokens=4),
        block_size=4,
        dtype=torch.float32,
    )
    assert plan.chunks and not plan.fused
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(env, value)
    out = torch.full((plan.num_tokens, tiny_dims.num_heads, tiny_dims.v_head_dim), 7.0)
    with pytest.raises(ValueError, match=match):
        mla_prefill(b.q, b.kv_c, b.k_pe, b.w, b.cache, b.block_table, plan, out=out)
    assert bool((out == 7.0).all())


def test_mla_prefill_refuses_a_bad_kv_impl_before_writing(tiny_dims, ref, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # interpreted, "fused" runs on the CPU (a developer's run)
    b = ref.make_mla_batch(tiny_dims, [3, 2], [5, 0], 4)
    plan = PrefillPlan.build(
        b.query_lens, b.context_lens, dims=tiny_dims, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32
    )
    out = torch.full((plan.num_tokens, tiny_dims.num_heads, tiny_dims.v_head_dim), 7.0)
    with pytest.raises(ValueError, match="kv_impl must be one of"):
        mla_prefill(b.q, b.kv_c, b.k_pe, b.w, b.cache, b.block_table, plan, out=out, kv_impl="triton")
    assert bool((out == 7.0).all())
    with pytest.raises(ValueError, match="needs a CUDA device"):
        mla_prefill(b.q, b.kv_c, b.k_pe, b.w, b.cache, b.block_table, plan, out=out, kv_impl="fused")
    assert bool((out == 7.0).all())
    # the explicit default gives what no argument gives
    a = mla_prefill(b.q, b.kv_c, b.k_pe, b.w, b.cache, b.block_table, plan)
    assert torch.equal(a, mla_prefill(b.q, b.kv_c, b.k_pe, b.w, b.cache, b.block_table, plan, kv_impl="separate"))


def interpreted_cases() -> str:
    """fused == separate for every pass (fused schedule; chunked: new tokens + each chunk), both weight layouts,
    float32 and float16, shuffled block tables with NaN in every unused slot; and mla_prefill(kv_impl="fused")
    against "separate"; float32 also with an FP8 cache (float scale and tensor scale). The interpreter's bfloat16
    tl.dot is wrong (triton 3.9), so bfloat16 is left to the GPU tests."""
    from mla_bridge import prepare_kv_b_proj
    from mla_bridge.cache import check_kv_cache, quantize_latent_cache

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    q_lens, c_lens, bs = [5, 0, 7], [9, 20, 3], 4
    n = 0
    for dtype in (torch.float32, torch.float16):
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        for layout in ("identity", "split"):
            for fp8 in (False, True) if dtype == torch.float32 else (False,):
                g = torch.Generator().manual_seed(n)
                nb = 22
                lat = torch.randn(nb, bs, d.latent_dim, generator=g)
                table = torch.randperm(nb, generator=g)[:18].view(3, 6).int()
                used = torch.zeros(nb, bs, dtype=torch.bool)
                for r, c in enumerate(c_lens):
                    for p in range(c):
                        used[table[r, p // bs], p % bs] = True
                lat[~used] = float("nan")
                raw, s = quantize_latent_cache(lat) if fp8 else (lat.to(dtype), None)
                w = prepare_kv_b_proj((torch.randn(*d.kv_b_proj_shape, generator=g) * 0.2).to(dtype), d, layout=layout)
                t = sum(q_lens)
                kv_c = torch.randn(t, d.kv_lora_rank, generator=g).to(dtype)
                k_pe = torch.randn(t, d.qk_rope_head_dim, generator=g).to(dtype)
                q = torch.randn(t, d.num_heads, d.head_dim_qk, generator=g).to(dtype)
                for fuse in (True, False):
                    plan = PrefillPlan.build(
                        q_lens,
                        c_lens,
                        dims=d,
                        workspace=Workspace("cpu", chunk_tokens=40 if fuse else 5),
                        block_size=bs,
                        dtype=dtype,
                        fuse_context=fuse,
                        kv_cache_dtype="fp8" if fp8 else None,
                    )
                    assert plan.fused == fuse
                    cache, scale = check_kv_cache(raw, s, plan.kv_cache_dtype)
                    for sc in (scale, float(scale)) if fp8 else (None,):
                        got = {}
                        for impl in ("separate", "fused"):
                            x = KV.KVInputs(w, kv_c, k_pe, cache, table, kv_cache_scale=sc, impl=impl)
                            if plan.fused:
                                got[impl] = [KV.fused_schedule_kv(plan, x)]
                            else:
                                got[impl] = [KV.new_tokens_kv(x)] + [KV.chunk_kv(c, x) for c in plan.chunks]
                        assert len(got["fused"]) == (1 if fuse else 1 + len(plan.chunks)) >= (1 if fuse else 3)
                        for i, ((ka, va), (kb, vb)) in enumerate(zip(got["separate"], got["fused"])):
                            assert not torch.isnan(kb).any() and not torch.isnan(vb).any(), "an unused slot was read"
                            nope = d.qk_nope_head_dim
                            assert torch.equal(ka[..., nope:], kb[..., nope:]), "k_pe must be copied exactly"
                            for a, b in ((ka[..., :nope], kb[..., :nope]), (va, vb)):
                                err = (a.float() - b.float()).abs().max().item()
                                assert err <= tol * max(1.0, a.float().abs().max().item()), (dtype, layout, fp8, err)
                        n += 1
                    if dtype == torch.float32:
                        o = {
                            i: mla_prefill(q, kv_c, k_pe, w, raw, table, plan, kv_cache_scale=s, kv_impl=i)
                            for i in ("separate", "fused")
                        }
                        torch.testing.assert_close(o["fused"], o["separate"], atol=1e-5, rtol=1e-5)
    return f"ok {n}"


def test_fused_kernel_equals_separate_path_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_cases` under the interpreter."""
    out = triton_interpreted("tests.test_kv:interpreted_cases", "tests/gpu/test_gpu_up_project.py")
    assert out.strip().startswith("ok ") and int(out.split()[-1]) == 16, out


@pytest.mark.parametrize(
    "value,interpreting",
    [("1", True), ("true", True), ("Yes", True), ("on", True), ("0", False), ("", False), ("false", False)],
)
def test_triton_interpret_read_as_triton_reads_it(monkeypatch, value, interpreting):
    """TRITON_INTERPRET=true interprets in Triton (getenv_bool); the choosers used to accept only "1"."""
    import mla_bridge.kernels as K

    monkeypatch.setenv("TRITON_INTERPRET", value)
    monkeypatch.setattr(K, "triton_available", lambda: True)
    assert K.triton_interpreting() is interpreting
    if interpreting:
        assert KV.kv_impl(torch.device("cpu"), "fused", torch.float32) == "fused"
    else:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            KV.kv_impl(torch.device("cpu"), "fused", torch.float32)


def test_pass_impl_names_a_bad_mode_or_layout():
    bad_mode = r"^mode must be one of \('auto', 'fused', 'separate'\) \(what kv_impl answers\), got 'bogus'"
    with pytest.raises(ValueError, match=bad_mode):
        KV.pass_impl("bogus", True, False)
    with pytest.raises(
        ValueError,
        match=r"^layout must be one of \('identity', 'split'\) "
        r"\(or 'checkpoint', taken as 'split'\), got 'splt'",
    ):
        KV.pass_impl("auto", True, False, 10, "splt")
    # the layout left out is the default one (split): a large gathered pass goes to cuBLAS
    assert KV.pass_impl("auto", True, False, KV.SEPARATE_FROM_ROWS) == "separate"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gathered="no"), "gathered must be a bool"),
        (dict(kv_cache_fp8=1), "kv_cache_fp8 must be a bool"),
        (dict(rows=-5), "rows must be an int >= 0"),
        (dict(rows="100"), "rows must be an int >= 0"),
        (dict(rows=2.0), "rows must be an int >= 0"),
    ],
)
def test_pass_impl_names_a_bad_argument(kwargs, match):
    args = dict(mode="auto", gathered=True, kv_cache_fp8=False, rows=10)
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        KV.pass_impl(**args)


def interpreted_raw_weight_cases() -> str:
    """The fused kernel reads a raw (checkpoint-layout) weight in place: bitwise what it computes from the
    split-prepared copy, for every pass of the fused and chunked schedules, float32 and float16; and
    ``mla_prefill(kv_impl="fused")`` with the raw weight rearranges nothing and returns the prepared weight's bits."""
    import mla_bridge.weights as W
    from mla_bridge import prepare_kv_b_proj

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    q_lens, c_lens, bs = [5, 0, 7], [9, 20, 3], 4
    n = 0
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(n)
        cache = torch.randn(24, bs, d.latent_dim, generator=g).to(dtype)
        table = torch.randperm(24, generator=g)[:18].view(3, 6).int()
        w = (torch.randn(*d.kv_b_proj_shape, generator=g) * 0.2).to(dtype)
        raw = W.as_prepared(w, d, dtype, torch.device("cpu"))
        split = prepare_kv_b_proj(w, d)
        assert raw.layout == W.CHECKPOINT_LAYOUT
        t = sum(q_lens)
        kv_c = torch.randn(t, d.kv_lora_rank, generator=g).to(dtype)
        k_pe = torch.randn(t, d.qk_rope_head_dim, generator=g).to(dtype)
        q = torch.randn(t, d.num_heads, d.head_dim_qk, generator=g).to(dtype)
        for fuse in (True, False):
            ws = Workspace("cpu", chunk_tokens=40 if fuse else 16)
            plan = PrefillPlan.build(
                q_lens, c_lens, dims=d, workspace=ws, block_size=bs, dtype=dtype, fuse_context=fuse
            )
            got = []
            for weight in (raw, split):
                x = KV.KVInputs(weight, kv_c, k_pe, cache, table, impl="fused")
                if plan.fused:
                    got.append([KV.fused_schedule_kv(plan, x)])
                else:
                    got.append([KV.new_tokens_kv(x)] + [KV.chunk_kv(c, x) for c in plan.chunks])
            assert len(got[0]) == (1 if fuse else 1 + len(plan.chunks)) >= (1 if fuse else 3)
            for (ka, va), (kb, vb) in zip(*got):
                assert torch.equal(ka, kb) and torch.equal(va, vb), (dtype, fuse)
                n += 1
            assert raw._gemm is None, "a fused pass rearranged the raw weight"
            want = mla_prefill(q, kv_c, k_pe, split, cache, table, plan, kv_impl="fused")
            real = W.prepare_kv_b_proj
            W.prepare_kv_b_proj = None  # any rearrangement inside the call fails
            try:
                out = mla_prefill(q, kv_c, k_pe, w, cache, table, plan, kv_impl="fused")
            finally:
                W.prepare_kv_b_proj = real
            assert torch.equal(out, want), (dtype, fuse)
    return f"ok {n}"


def test_fused_kernel_reads_the_raw_weight_in_place_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_raw_weight_cases`."""
    out = triton_interpreted("tests.test_kv:interpreted_raw_weight_cases", "tests/gpu/test_gpu_up_project.py")
    assert out.strip().startswith("ok ") and int(out.split()[-1]) == 8, out


def test_auto_bounds_scale_with_the_up_projection_work_per_row():
    """The row bounds were measured at DeepSeek-V2-Lite's dims (16 heads x (128 + 128) columns of rank 512 per row).
    A row of GLM-5 (64 heads x (192 + 256)) is 7x that GEMM work: its 4-chunk context pass of 8000 rows ran the fused
    kernel at 1.21x the attention + GEMM time, gather + cuBLAS at 1.02x; "auto" must take cuBLAS there."""
    from mla_bridge.dims import MLADims

    v2_lite = MLADims(num_heads=16)
    glm5 = MLADims(num_heads=64, qk_nope_head_dim=192, v_head_dim=256)
    assert KV.pass_impl("auto", True, False, 8000, "split", dims=v2_lite) == "fused"
    assert KV.pass_impl("auto", True, False, 8000, "split", dims=glm5) == "separate"
    # the bounds move by the work ratio exactly, for every kind of pass
    quad = MLADims(num_heads=64)  # 4x DeepSeek-V2-Lite's work per row
    for gathered, fp8, bound in (
        (True, False, KV.SEPARATE_FROM_ROWS),
        (True, True, KV.SEPARATE_FROM_ROWS_FP8),
        (False, False, KV.SEPARATE_FROM_ROWS_NEW),
    ):
        assert KV.pass_impl("auto", gathered, fp8, bound, "split", dims=v2_lite) == "separate"
        assert KV.pass_impl("auto", gathered, fp8, bound - 1, "split", dims=v2_lite) == "fused"
        assert KV.pass_impl("auto", gathered, fp8, -(-bound // 4), "split", dims=quad) == "separate"
        assert KV.pass_impl("auto", gathered, fp8, -(-bound // 4) - 1, "split", dims=quad) == "fused"
        assert KV.pass_impl("auto", gathered, fp8, bound - 1, "split") == "fused"  # no dims: DeepSeek-V2-Lite's
    # auto_bounds says where pass_impl switches, at any dims
    for dims in (
        None,
        v2_lite,
        glm5,
        quad,
        MLADims(num_heads=40, qk_nope_head_dim=64, v_head_dim=64, kv_lora_rank=256),
    ):
        for (gathered, fp8), bound in zip(((True, False), (True, True), (False, False)), KV.auto_bounds(dims)):
            assert KV.pass_impl("auto", gathered, fp8, bound, "split", dims=dims) == "separate"
            assert KV.pass_impl("auto", gathered, fp8, bound - 1, "split", dims=dims) == "fused"
