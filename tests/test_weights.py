"""kv_b_proj prepared once (mla_bridge.weights): the prepared form computes what the raw weight computes (bitwise for
the identity layout on the CPU, within float32 rounding for the split layout), is checked against the plan, and is
never re-prepared inside mla_prefill."""

from __future__ import annotations

import pytest
import torch

import mla_bridge.weights as weights_mod
from mla_bridge import MLADims, PrefillPlan, PreparedKVBProj, Workspace, mla_prefill, prepare_kv_b_proj
from mla_bridge.prefill import prefill_memory_bytes
from mla_bridge.checks import kernel_ready
from mla_bridge.weights import up_projection_weight

QUERY_LENS = [3, 4, 1, 0, 5]
CONTEXT_LENS = [0, 37, 5, 9, 20]


def _plan(dims, fuse, chunk_tokens=16, dtype=torch.float32):
    return PrefillPlan.build(
        QUERY_LENS,
        CONTEXT_LENS,
        dims=dims,
        workspace=Workspace("cpu", chunk_tokens=chunk_tokens if not fuse else 1000),
        block_size=8,
        dtype=dtype,
        fuse_context=fuse,
    )


def _run(batch, plan, weight):
    return mla_prefill(batch.q, batch.kv_c, batch.k_pe, weight, batch.cache, batch.block_table, plan, return_lse=True)


def test_default_layout_is_split(tiny_dims):
    w = torch.randn(tiny_dims.kv_b_proj_shape)
    p = prepare_kv_b_proj(w, tiny_dims)
    d = tiny_dims
    assert weights_mod.DEFAULT_LAYOUT == "split" and p.layout == "split"
    assert list(p.weight.shape) == [d.num_heads, d.v_head_dim + d.qk_nope_head_dim, d.kv_lora_rank]
    per_head = w.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    assert torch.equal(p.weight[:, : d.v_head_dim], per_head[:, d.qk_nope_head_dim :])  # v rows, then k_nope rows
    assert torch.equal(p.weight[:, d.v_head_dim :], per_head[:, : d.qk_nope_head_dim])


def test_identity_layout_is_the_rearranged_weight(tiny_dims):
    w = torch.randn(tiny_dims.kv_b_proj_shape)
    p = prepare_kv_b_proj(w, tiny_dims, layout="identity")
    assert isinstance(p, PreparedKVBProj) and p.layout == "identity"
    assert torch.equal(p.weight, up_projection_weight(w, tiny_dims))
    d = tiny_dims
    assert list(p.weight.shape) == [d.num_heads * (d.head_dim_qk + d.v_head_dim), d.latent_dim]
    assert p.dtype == w.dtype and p.device == w.device and p.nbytes == p.weight.numel() * 4
    w.zero_()  # the prepared copy does not alias the raw weight
    assert p.weight.abs().sum() > 0


def test_up_projection_weight_still_importable_from_prefill(tiny_dims):
    from mla_bridge.prefill import up_projection_weight as old

    assert old is up_projection_weight


@pytest.mark.parametrize("fuse", [True, False])
def test_prepared_equals_raw_bitwise(ref, tiny_dims, fuse):
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=3)
    plan = _plan(tiny_dims, fuse)
    assert plan.fused == fuse and (fuse or len(plan.chunks) > 1)
    raw_out, raw_lse = _run(batch, plan, batch.w)
    out, lse = _run(batch, plan, prepare_kv_b_proj(batch.w, tiny_dims))
    assert torch.equal(out, raw_out) and torch.equal(lse, raw_lse)


@pytest.mark.parametrize("fuse", [True, False])
def test_split_layout_matches_the_reference(ref, tiny_dims, fuse):
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=4)
    plan = _plan(tiny_dims, fuse)
    out, lse = _run(batch, plan, prepare_kv_b_proj(batch.w, tiny_dims, layout="split"))
    exp_out, exp_lse = ref.mla_reference(batch)
    ref.assert_out_close(out, exp_out, atol=3e-5)
    ref.assert_lse_close(lse, exp_lse, atol=3e-5)
    raw_out, _ = _run(batch, plan, batch.w)
    torch.testing.assert_close(out, raw_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_layout_k_and_v(tiny_dims, dtype):
    d = tiny_dims
    g = torch.Generator().manual_seed(0)
    w = torch.randn(d.kv_b_proj_shape, generator=g).to(dtype)
    latent = torch.randn(11, d.latent_dim + 8, generator=g).to(dtype)[:, 3 : 3 + d.latent_dim]  # strided rows
    k_id, v_id = prepare_kv_b_proj(w, d, layout="identity").up_project(latent)
    k, v = prepare_kv_b_proj(w, d, layout="split").up_project(latent)
    assert k.shape == k_id.shape == (11, d.num_heads, d.head_dim_qk) and v.shape == v_id.shape
    # k_pe is copied exactly into every head, in both layouts
    want_pe = latent[:, d.kv_lora_rank :].unsqueeze(1).expand(-1, d.num_heads, -1)
    assert torch.equal(k[..., d.qk_nope_head_dim :], want_pe) and torch.equal(k_id[..., d.qk_nope_head_dim :], want_pe)
    # k_nope and v: the bare GEMM, within accumulation-order rounding
    kv = (latent[:, : d.kv_lora_rank].double() @ w.double().t()).view(11, d.num_heads, -1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(k[..., : d.qk_nope_head_dim].double(), kv[..., : d.qk_nope_head_dim], **tol)
    torch.testing.assert_close(v.double(), kv[..., d.qk_nope_head_dim :], **tol)
    # one buffer, strided views the kernels read in place
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert kernel_ready(k) and kernel_ready(v)


@pytest.mark.parametrize("layout", ["split", "identity"])
def test_kv_c_and_k_pe_apart_equal_the_latent_rows(tiny_dims, layout):
    """up_project(kv_c, k_pe), the new tokens' form, is up_project(kv_c ++ k_pe)."""
    d = tiny_dims
    g = torch.Generator().manual_seed(1)
    p = prepare_kv_b_proj(torch.randn(d.kv_b_proj_shape, generator=g), d, layout=layout)
    kv_c, k_pe = torch.randn(9, d.kv_lora_rank, generator=g), torch.randn(9, d.qk_rope_head_dim, generator=g)
    k, v = p.up_project(kv_c, k_pe)
    k_cat, v_cat = p.up_project(torch.cat([kv_c, k_pe], dim=-1))
    assert torch.equal(k[..., d.qk_nope_head_dim :], k_cat[..., d.qk_nope_head_dim :])  # k_pe copied exactly
    torch.testing.assert_close(k, k_cat, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v, v_cat, atol=1e-6, rtol=1e-6)


def test_split_gemm_runs_per_row_block(tiny_dims, monkeypatch):
    """The split layout's GEMM runs over blocks of SPLIT_GEMM_ROWS rows (each block stays in L2 for every head):
    ceil(N / rows) batched GEMMs, every row computed, the same k and v as one GEMM."""
    d = tiny_dims
    g = torch.Generator().manual_seed(2)
    p = prepare_kv_b_proj(torch.randn(d.kv_b_proj_shape, generator=g, dtype=torch.float64), d)
    latent = torch.randn(11, d.latent_dim, generator=g, dtype=torch.float64)
    k_one, v_one = p.up_project(latent)
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b, *, out: calls.append(a.shape[1]) or real_bmm(a, b, out=out))
    monkeypatch.setattr(weights_mod, "SPLIT_GEMM_ROWS", 4)
    k, v = p.up_project(latent)
    assert calls == [4, 4, 3]
    kv = (latent[:, : d.kv_lora_rank] @ p.weight.transpose(1, 2)).transpose(0, 1)  # [N, H, v + nope], float64
    torch.testing.assert_close(v, kv[..., : d.v_head_dim], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(k[..., : d.qk_nope_head_dim], kv[..., d.v_head_dim :], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(k, k_one, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(v, v_one, atol=1e-12, rtol=1e-12)
    assert torch.equal(
        k[..., d.qk_nope_head_dim :], latent[:, d.kv_lora_rank :].unsqueeze(1).expand(-1, d.num_heads, -1)
    )


def test_prepared_weight_is_not_prepared_again(ref, tiny_dims, monkeypatch):
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=5)
    plan = _plan(tiny_dims, False)
    prepared = prepare_kv_b_proj(batch.w, tiny_dims)
    calls = []
    real = weights_mod.prepare_kv_b_proj
    monkeypatch.setattr(weights_mod, "prepare_kv_b_proj", lambda *a, **k: calls.append(1) or real(*a, **k))
    _run(batch, plan, prepared)
    assert calls == []
    _run(batch, plan, batch.w)  # the raw weight: prepared inside the call, every call
    _run(batch, plan, batch.w)
    assert len(calls) == 2


def test_bad_inputs_are_named(ref, tiny_dims):
    d = tiny_dims
    batch = ref.make_mla_batch(d, QUERY_LENS, CONTEXT_LENS, 8, seed=6)
    plan = _plan(d, True)
    with pytest.raises(ValueError, match=r"^kv_b_proj_weight must be \[H\*\(qk_nope_head_dim\+v_head_dim\)"):
        prepare_kv_b_proj(batch.w.t(), d)
    with pytest.raises(TypeError, match="^kv_b_proj_weight must be a torch.Tensor"):
        prepare_kv_b_proj(batch.w.numpy(), d)
    with pytest.raises(TypeError, match="^dims must be an MLADims"):
        prepare_kv_b_proj(batch.w, {"num_heads": 4})
    with pytest.raises(ValueError, match="^layout must be one of"):
        prepare_kv_b_proj(batch.w, d, layout="fused")
    other = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    wrong_dims = prepare_kv_b_proj(torch.randn(other.kv_b_proj_shape), other)
    with pytest.raises(ValueError, match="^kv_b_proj_weight was prepared for 2 heads.*the plan has 4 heads"):
        _run(batch, plan, wrong_dims)
    with pytest.raises(
        TypeError,
        match=r"^kv_b_proj_weight must have dtype torch.float32 .*PreparedKVBProj of "
        r"torch.float64",
    ):
        _run(batch, plan, prepare_kv_b_proj(batch.w.double(), d))


def test_memory_budget_leaves_out_a_prepared_weight(tiny_dims):
    plan = _plan(tiny_dims, True)
    d = tiny_dims
    weight_bytes = d.num_heads * (d.v_head_dim + d.qk_nope_head_dim) * d.kv_lora_rank * 4  # the split layout's
    assert prefill_memory_bytes(plan) - prefill_memory_bytes(plan, prepared_weight=True) == weight_bytes
    assert weight_bytes == prepare_kv_b_proj(torch.zeros(d.kv_b_proj_shape), d).nbytes
    assert (
        weights_mod.prepared_weight_elements(d, "identity") * 4
        == prepare_kv_b_proj(torch.zeros(d.kv_b_proj_shape), d, layout="identity").nbytes
    )


def interpreted_broadcast_cases():
    """The Triton k_pe broadcast against torch's copy_ of the expanded view (run under TRITON_INTERPRET=1)."""
    from mla_bridge.kernels.broadcast import broadcast_heads_triton

    n_ok = 0
    for n, heads, rope, dtype in (
        (37, 16, 64, torch.float16),
        (5, 20, 64, torch.bfloat16),
        (3, 3, 8, torch.float32),
        (0, 4, 8, torch.float32),
    ):
        g = torch.Generator().manual_seed(n)
        latent = torch.randn(n, 40 + rope, generator=g).to(dtype)
        buf = torch.randn(n, heads, 2 * rope + 16, generator=g).to(dtype)
        want = buf.clone()
        broadcast_heads_triton(buf[:, :, -rope:], latent[:, 40:])
        want[:, :, -rope:].copy_(latent[:, 40:].unsqueeze(1).expand(n, heads, rope))
        assert torch.equal(buf, want), (n, heads, rope, dtype)
        n_ok += 1
    # strided rows of both: a k_pe with last stride 2 (a caller's view), a destination with last stride 2
    g = torch.Generator().manual_seed(9)
    src = torch.randn(7, 16, generator=g)[:, ::2]
    buf = torch.randn(7, 5, 32, generator=g)
    want = buf.clone()
    broadcast_heads_triton(buf[:, :, 8::2][:, :, :8], src)
    want[:, :, 8::2][:, :, :8].copy_(src.unsqueeze(1).expand(7, 5, 8))
    assert torch.equal(buf, want), "strided source / destination"
    n_ok += 1
    return f"ok {n_ok}"


def test_broadcast_kernel_equals_torch_copy_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_broadcast_cases`."""
    assert "ok 5" in triton_interpreted(
        "tests.test_weights:interpreted_broadcast_cases", "tests/gpu/test_gpu_up_project.py"
    )


def test_up_project_names_a_bad_argument_before_any_work(tiny_dims):
    """PreparedKVBProj.up_project is public: a bad latent / k_pe is refused by name before any GEMM runs."""
    d = tiny_dims
    p = prepare_kv_b_proj(torch.randn(d.kv_b_proj_shape), d)
    with pytest.raises(ValueError, match=rf"^latent must be \[N, kv_lora_rank \+ qk_rope_head_dim={d.latent_dim}\]"):
        p.up_project(torch.randn(3, d.kv_lora_rank))
    with pytest.raises(ValueError, match=rf"^latent must be \[N, kv_lora_rank={d.kv_lora_rank}\] when k_pe is given"):
        p.up_project(torch.randn(3, d.latent_dim), torch.randn(3, d.qk_rope_head_dim))
    with pytest.raises(ValueError, match=rf"^k_pe must be \[N=3, qk_rope_head_dim={d.qk_rope_head_dim}\]"):
        p.up_project(torch.randn(3, d.kv_lora_rank), torch.randn(2, d.qk_rope_head_dim))
    with pytest.raises(TypeError, match=r"^latent must have dtype torch.float32 \(the weight's\), got torch.float64"):
        p.up_project(torch.randn(3, d.latent_dim, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^k_pe must be a torch.Tensor"):
        p.up_project(torch.randn(3, d.kv_lora_rank), [1.0])
    with pytest.raises(ValueError, match=r"^latent is on meta, but the weight is on cpu"):
        p.up_project(torch.empty(3, d.latent_dim, device="meta"))


def test_prepared_weight_checks_its_layout_and_shape(tiny_dims):
    d = tiny_dims
    split = prepare_kv_b_proj(torch.randn(d.kv_b_proj_shape), d).weight
    with pytest.raises(ValueError, match=r"^layout must be one of \('identity', 'split'\), got 'bogus'"):
        PreparedKVBProj(d, "bogus", split)
    with pytest.raises(ValueError, match=r"^a 'identity' weight must be \["):
        PreparedKVBProj(d, "identity", split)
    with pytest.raises(ValueError, match=r"^layout must be one of"):
        weights_mod.prepared_weight_elements(d, "bogus")


def test_raw_weight_is_taken_as_it_is(tiny_dims, monkeypatch):
    """mla_prefill's raw weight is not copied: the checkpoint layout views it; its split form (the separate path's
    GEMM) is made on first use, once per object, and equals prepare_kv_b_proj's."""
    d = tiny_dims
    w = torch.randn(d.kv_b_proj_shape)
    rearranged = []
    real = weights_mod.prepare_kv_b_proj
    monkeypatch.setattr(weights_mod, "prepare_kv_b_proj", lambda *a, **kw: rearranged.append(a) or real(*a, **kw))
    p = weights_mod.as_prepared(w, d, torch.float32, torch.device("cpu"))
    assert p.layout == weights_mod.CHECKPOINT_LAYOUT and p.weight.data_ptr() == w.data_ptr()
    assert p.gemm_layout == "split"
    assert rearranged == []  # nothing rearranged yet
    gemm = p.gemm_form()
    assert gemm.layout == "split" and torch.equal(gemm.weight, prepare_kv_b_proj(w, d).weight)
    assert p.gemm_form() is gemm and len(rearranged) == 1  # made once
    # the fused kernel's addressing: head h's k_nope row j at h * rows + first_nope + j, v rows likewise
    weight, row, per_head, first_nope, first_v = p.kernel_rows()
    flat = weight.reshape(-1)
    for h in range(d.num_heads):
        for j in (0, d.qk_nope_head_dim - 1):
            got = flat[(h * per_head + first_nope + j) * row :][: d.kv_lora_rank]
            assert torch.equal(got, gemm.weight[h, d.v_head_dim + j])
        for j in (0, d.v_head_dim - 1):
            assert torch.equal(flat[(h * per_head + first_v + j) * row :][: d.kv_lora_rank], gemm.weight[h, j])
    for layout in weights_mod.LAYOUTS:  # the prepared layouts' addressing gives the same rows
        q = prepare_kv_b_proj(w, d, layout=layout)
        weight, row, per_head, first_nope, first_v = q.kernel_rows()
        flat = weight.reshape(-1)
        h, j = d.num_heads - 1, 3
        got = flat[(h * per_head + first_nope + j) * row :][: d.kv_lora_rank]
        assert torch.equal(got, gemm.weight[h, d.v_head_dim + j])
        assert torch.equal(flat[(h * per_head + first_v + j) * row :][: d.kv_lora_rank], gemm.weight[h, j])


def test_raw_weight_not_at_unit_stride_is_prepared(tiny_dims):
    d = tiny_dims
    w = torch.randn(d.kv_b_proj_shape[::-1]).t()  # the right shape, rows at stride 1 along the output dim
    p = weights_mod.as_prepared(w, d, torch.float32, torch.device("cpu"))
    assert p.layout == "split" and torch.equal(p.weight, prepare_kv_b_proj(w.contiguous(), d).weight)
    with pytest.raises(ValueError, match="'checkpoint' weight must have unit stride along kv_lora_rank"):
        PreparedKVBProj(d, weights_mod.CHECKPOINT_LAYOUT, w)
    with pytest.raises(ValueError, match=r"^a 'checkpoint' weight must be \["):
        PreparedKVBProj(d, weights_mod.CHECKPOINT_LAYOUT, torch.randn(3, 4))
    with pytest.raises(ValueError, match="^layout must be one of"):  # not a layout prepare_kv_b_proj makes
        prepare_kv_b_proj(w, d, layout=weights_mod.CHECKPOINT_LAYOUT)


def test_raw_weight_requiring_grad_is_read_detached(ref, tiny_dims):
    """A model's nn.Parameter as the raw weight, under torch.no_grad() (inference): the prepared weight's bits; while
    autograd records it is refused (tests/test_validation.py)."""
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=9)
    plan = _plan(tiny_dims, False)
    w = torch.nn.Parameter(batch.w.clone())
    with torch.no_grad():
        out, lse = _run(batch, plan, w)
    assert not out.requires_grad
    want, want_lse = _run(batch, plan, prepare_kv_b_proj(batch.w, tiny_dims))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_split_gemm_reads_latent_views_in_place(tiny_dims, monkeypatch):
    """The split layout's GEMM reads the latent (or kv_c) through its strides and storage offset, row block by row
    block: a view into a wider, offset buffer gives the contiguous rows' bits. Small integers in float32, so that
    every product and sum is exact: the CPU's BLAS may take another kernel (another summation order) for a strided
    operand (seen on an AMD EPYC with AVX-512, 2026-12-02: random normals differed in the last bit), and a misread
    row still changes the values."""
    d = tiny_dims
    g = torch.Generator().manual_seed(4)
    p = prepare_kv_b_proj(torch.randint(-3, 4, d.kv_b_proj_shape, generator=g).float(), d)
    latent = torch.randint(-3, 4, (11, d.latent_dim), generator=g).float()
    wide = torch.randint(-3, 4, (13, d.latent_dim + 7), generator=g).float()
    wide[2:, 3 : 3 + d.latent_dim] = latent
    view = wide[2:, 3 : 3 + d.latent_dim]
    assert view.storage_offset() > 0 and view.stride(0) == d.latent_dim + 7
    monkeypatch.setattr(weights_mod, "SPLIT_GEMM_ROWS", 4)
    k, v = p.up_project(latent)
    kv, vv = p.up_project(view)
    assert torch.equal(k, kv) and torch.equal(v, vv)
    kn, vn = p.up_project(view[:, : d.kv_lora_rank], view[:, d.kv_lora_rank :])  # kv_c and k_pe apart
    assert torch.equal(k, kn) and torch.equal(v, vn)


@pytest.mark.parametrize("fuse", [True, False])
def test_held_checkpoint_weight_sees_an_in_place_update(ref, tiny_dims, fuse):
    """A checkpoint-layout PreparedKVBProj (as_prepared's view of a raw weight) held by the caller and handed to
    several calls reads the weight as it is at each call: the split copy a separate pass makes is not kept past the
    call (it was: the second call up-projected with the weight of the first, while a fused pass read the new one)."""
    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 8, seed=5)
    plan = _plan(tiny_dims, fuse)
    w = batch.w.clone()
    held = weights_mod.as_prepared(w, tiny_dims, torch.float32, torch.device("cpu"))
    assert held.layout == weights_mod.CHECKPOINT_LAYOUT
    first, _ = _run(batch, plan, held)
    w.mul_(-2.0)  # in place: the held object views it
    out, lse = _run(batch, plan, held)
    want, want_lse = _run(batch, plan, w)
    assert not torch.equal(out, first)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    latent = torch.randn(5, tiny_dims.latent_dim)
    k, v = held.up_project(latent)
    w.zero_()
    k0, v0 = held.up_project(latent)
    assert v.abs().max() > 0 and torch.equal(v0, torch.zeros_like(v0))
    assert torch.equal(
        k0[..., tiny_dims.qk_nope_head_dim :],
        latent[:, tiny_dims.kv_lora_rank :].unsqueeze(1).expand(-1, tiny_dims.num_heads, -1),
    )


def _unreadable_prepared_weights(d):
    """Prepared weights of the right shape whose rows the fused kernel cannot address (columns not at unit stride,
    or a split weight's heads not a whole number of rows apart), with the layout of each."""
    split = prepare_kv_b_proj(torch.randn(d.kv_b_proj_shape), d).weight
    ident = prepare_kv_b_proj(torch.randn(d.kv_b_proj_shape), d, layout="identity").weight
    h, rows, r = split.shape
    odd = torch.randn(h * (rows * r + 1)).as_strided(split.shape, (rows * r + 1, r, 1))  # heads 1 element off
    return [
        ("split", split.transpose(1, 2).contiguous().transpose(1, 2)),
        ("split", split.permute(1, 2, 0).contiguous().permute(2, 0, 1)),
        ("split", odd),
        ("split", split[:, :1].expand(h, rows, r)),
        ("identity", ident.t().contiguous().t()),
    ]


def test_prepared_weight_must_be_readable_by_the_fused_kernel(tiny_dims):
    """A PreparedKVBProj built by hand from a weight the fused kernel would misread is refused at construction
    (it was taken: the separate path was right, the fused kernel off by O(1) on every element, seen under
    TRITON_INTERPRET=1); views it reads right are taken."""
    d = tiny_dims
    for layout, w in _unreadable_prepared_weights(d):
        with pytest.raises(ValueError, match=rf"^a '{layout}' weight must have unit stride along its last dim"):
            PreparedKVBProj(d, layout, w)
    split = prepare_kv_b_proj(torch.randn(d.kv_b_proj_shape), d).weight
    padded = torch.randn(d.num_heads, split.shape[1] + 3, d.kv_lora_rank)
    padded[:, : split.shape[1]] = split
    p = PreparedKVBProj(d, "split", padded[:, : split.shape[1]])  # heads 3 rows apart: addressable
    latent = torch.randn(6, d.latent_dim)
    k, v = p.up_project(latent)
    k0, v0 = PreparedKVBProj(d, "split", split).up_project(latent)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert p.kernel_rows()[1:3] == (d.kv_lora_rank, split.shape[1] + 3)


def interpreted_prepared_view_cases() -> str:
    """Under TRITON_INTERPRET=1: the fused kernel reads prepared weights that are views (padded rows, padded heads,
    an offset into a larger buffer) as their contiguous copies, bitwise."""
    from mla_bridge import kv as KV

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(d.kv_b_proj_shape, generator=g) * 0.2
    kv_c, k_pe = torch.randn(9, d.kv_lora_rank, generator=g), torch.randn(9, d.qk_rope_head_dim, generator=g)
    no_cache = (torch.empty(0, 1, d.latent_dim), torch.empty(0, 1, dtype=torch.int32))  # new tokens alone
    n = 0
    for layout in weights_mod.LAYOUTS:
        ref = prepare_kv_b_proj(w, d, layout=layout)
        shape = ref.weight.shape
        views = []
        big = torch.randn(*shape[:-1], shape[-1] + 5, generator=g)
        big[..., 2 : 2 + shape[-1]] = ref.weight
        views.append(big[..., 2 : 2 + shape[-1]])  # padded rows, offset
        if layout == "split":
            heads = torch.randn(shape[0], shape[1] + 3, shape[2], generator=g)
            heads[:, 1 : 1 + shape[1]] = ref.weight
            views.append(heads[:, 1 : 1 + shape[1]])  # padded heads, offset
        want = KV.new_tokens_kv(KV.KVInputs(ref, kv_c, k_pe, *no_cache, impl="fused"))
        for view in views:
            got = KV.new_tokens_kv(KV.KVInputs(PreparedKVBProj(d, layout, view), kv_c, k_pe, *no_cache, impl="fused"))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), layout
            n += 1
    return f"ok {n}"


def test_fused_kernel_reads_prepared_weight_views_interpreted(triton_interpreted):
    out = triton_interpreted("tests.test_weights:interpreted_prepared_view_cases", "tests/gpu/test_gpu_up_project.py")
    assert out.strip() == "ok 3", out


def test_sparse_raw_weight_is_refused_by_name(tiny_dims):
    """prepare_kv_b_proj / as_prepared name a sparse weight (they raised torch's "reshape is not implemented for
    sparse tensors")."""
    w = torch.randn(tiny_dims.kv_b_proj_shape).to_sparse()
    with pytest.raises(
        TypeError,
        match=r"^kv_b_proj_weight must be a dense \(strided\) tensor, got layout "
        r"torch.sparse_coo",
    ):
        prepare_kv_b_proj(w, tiny_dims)
    with pytest.raises(TypeError, match=r"^w must be a dense \(strided\) tensor"):
        weights_mod.as_prepared(w, tiny_dims, torch.float32, torch.device("cpu"), name="w")


def test_prepared_weight_is_freed_when_dropped(tiny_dims):
    """A PreparedKVBProj holds no reference to itself: dropping the last reference frees its weight at once (with the
    garbage collector off, as a serving loop may run), not at the next collection."""
    import gc
    import weakref

    for make in (
        lambda w: prepare_kv_b_proj(w, tiny_dims),
        lambda w: weights_mod.as_prepared(w, tiny_dims, torch.float32, torch.device("cpu")),
    ):
        p = make(torch.randn(tiny_dims.kv_b_proj_shape))
        p.gemm_form()
        ref = weakref.ref(p)
        gc.disable()
        try:
            del p
            assert ref() is None
        finally:
            gc.enable()


@pytest.mark.parametrize("layout", ["split", "identity", weights_mod.CHECKPOINT_LAYOUT])
def test_up_project_refuses_inputs_requiring_grad_while_autograd_records(tiny_dims, layout):
    """PreparedKVBProj.up_project (public) has no backward either: a latent or weight that requires grad while
    autograd records is refused by name. It was not: the split and checkpoint layouts failed inside
    torch.bmm(out=) ("functions with out=... arguments don't support automatic differentiation"), and the identity
    layout differentiated (a torch.mm), unlike the kernels mla_prefill runs on CUDA."""
    d = tiny_dims
    g = torch.Generator().manual_seed(4)
    raw = torch.randn(d.kv_b_proj_shape, generator=g)
    w = (
        PreparedKVBProj(d, layout, raw)
        if layout == weights_mod.CHECKPOINT_LAYOUT
        else prepare_kv_b_proj(raw, d, layout=layout)
    )
    latent = torch.randn(5, d.latent_dim, generator=g)
    want = w.up_project(latent)
    with pytest.raises(ValueError, match=r"^latent requires grad and autograd is recording"):
        w.up_project(latent.clone().requires_grad_(True))
    with pytest.raises(ValueError, match=r"^k_pe requires grad and autograd is recording"):
        w.up_project(latent[:, : d.kv_lora_rank], latent[:, d.kv_lora_rank :].clone().requires_grad_(True))
    trainable = PreparedKVBProj(d, w.layout, w.weight.clone().requires_grad_(True))
    with pytest.raises(ValueError, match=r"^weight requires grad and autograd is recording"):
        trainable.up_project(latent)
    with torch.no_grad():
        got = trainable.up_project(latent.clone().requires_grad_(True))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    "bad,error", [(torch.zeros(3, 3), ValueError), (torch.zeros(4, 4, dtype=torch.int32), TypeError)]
)
def test_up_projection_weight_names_a_bad_weight(tiny_dims, bad, error):
    """up_projection_weight is public: a weight of another shape or dtype gets the error prepare_kv_b_proj gives,
    naming the argument (a bare reshape RuntimeError before)."""
    with pytest.raises(error, match="kv_b_proj_weight"):
        up_projection_weight(bad, tiny_dims)
