"""mla_bridge.cache: cache dtypes and FP8 scale rules, vLLM's e4m3 rounding, the gather (torch; Triton interpreted).

The rounding oracle here is independent of torch's float8 cast: the nearest of the 254 finite e4m3fn values
(enumerated from their bytes), ties to the even encoding, saturated to +-448.
"""

from __future__ import annotations


import pytest
import torch

from mla_bridge import cache as C

F8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ dtype rules
@pytest.mark.parametrize(
    "given,expected",
    [
        (None, torch.bfloat16),
        ("auto", torch.bfloat16),
        ("fp8", F8),
        ("fp8_e4m3", F8),
        (F8, F8),
        (torch.uint8, F8),
        (torch.bfloat16, torch.bfloat16),
        ("bfloat16", torch.bfloat16),
    ],
)
def test_resolve_kv_cache_dtype(given, expected):
    assert C.resolve_kv_cache_dtype(given, torch.bfloat16) == expected


@pytest.mark.parametrize("given", ["fp8_e5m2", torch.float8_e5m2, "fp8_ds_mla"])
def test_unsupported_fp8_formats_say_what_is_supported(given):
    with pytest.raises(ValueError, match="not supported.*float8_e4m3fn"):
        C.resolve_kv_cache_dtype(given, torch.bfloat16)


def test_unquantized_cache_must_be_the_compute_dtype():
    with pytest.raises(ValueError, match="differs from the compute dtype"):
        C.resolve_kv_cache_dtype(torch.float16, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown"):
        C.resolve_kv_cache_dtype("int4", torch.bfloat16)
    with pytest.raises(TypeError, match="kv_cache_dtype must be"):
        C.resolve_kv_cache_dtype(3, torch.bfloat16)


def test_scale_rules():
    fp8 = torch.zeros(2, 4, 8, dtype=F8)
    f32 = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="kv_cache_scale is required"):
        C.check_kv_cache(fp8, None, F8)
    with pytest.raises(ValueError, match="only an FP8 cache takes a scale"):
        C.check_kv_cache(f32, 0.5, torch.float32)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-50, torch.tensor(float("nan")), torch.tensor([-2.0])):
        with pytest.raises(ValueError, match="finite and > 0|positive finite float32"):
            C.check_kv_cache(fp8, bad, F8)
    with pytest.raises(TypeError, match="float32 tensor"):
        C.check_kv_cache(fp8, torch.tensor(0.5, dtype=torch.float64), F8)
    with pytest.raises(ValueError, match="1 element"):
        C.check_kv_cache(fp8, torch.tensor([0.5, 0.5]), F8)
    with pytest.raises(TypeError, match="Python float"):
        C.check_kv_cache(fp8, "0.5", F8)
    with pytest.raises(TypeError, match="plan's kv_cache_dtype.*kv_cache_dtype='fp8'"):
        C.check_kv_cache(fp8, 0.5, torch.float32)
    with pytest.raises(TypeError, match="kv_cache_dtype=None"):
        C.check_kv_cache(f32, None, F8)
    cache, s = C.check_kv_cache(fp8, torch.tensor([0.25]), F8)
    assert cache is fp8 and s.shape == () and float(s) == 0.25
    assert C.check_kv_cache(fp8, 0.1, F8)[1] == float(torch.tensor(0.1, dtype=torch.float32))  # float32-rounded
    assert C.check_kv_cache(f32, None, torch.float32) == (f32, None)


def test_uint8_view_is_the_same_bytes_and_ds_mla_is_refused():
    raw = torch.arange(2 * 4 * 8, dtype=torch.int64).remainder(120).to(torch.uint8).view(2, 4, 8)
    cache, _ = C.check_kv_cache(raw, 1.0, F8)
    assert cache.dtype == F8 and cache.data_ptr() == raw.data_ptr()
    assert torch.equal(cache.view(torch.uint8), raw)
    with pytest.raises(ValueError, match="fp8_ds_mla.*not supported"):
        C.check_kv_cache(torch.zeros(2, 4, 656, dtype=torch.uint8), 1.0, F8)
    with pytest.raises(ValueError, match="not supported"):
        C.check_kv_cache(torch.zeros(2, 4, 8, dtype=torch.float8_e5m2), 1.0, F8)


# ---------------------------------------------------------------------------------------------- quantization
def _e4m3_oracle(x: torch.Tensor) -> torch.Tensor:
    """Nearest finite e4m3fn value (ties to the even byte), saturating; NaN stays NaN. Returns the bytes."""
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    vals = codes.view(F8).double()
    finite = ~torch.isnan(vals)
    codes, vals = codes[finite].long(), vals[finite]
    xd = x.double().clamp(-448.0, 448.0).reshape(-1, 1)
    dist = (xd - vals).abs()
    best = dist.min(dim=1, keepdim=True).values
    cand = dist == best
    # among ties (two neighbours of one sign) the even byte; between +0 and -0 the sign of x
    sign_match = (codes >= 128) == torch.signbit(xd)
    score = cand.double() * 4 + sign_match.double() * 2 + (codes % 2 == 0).double()
    out = codes[score.argmax(dim=1)].to(torch.uint8)
    out[torch.isnan(x.reshape(-1))] = 0x7F
    return out.view(x.shape)


def test_quantize_rounds_as_vllms_cache_write():
    g = torch.Generator().manual_seed(0)
    scale = 0.03125 * 1.37
    x = torch.randn(4000, generator=g) * 4
    # exact ties between two e4m3 neighbours (1.0 and 1.125: 1.0625; 1.125 and 1.25: 1.1875), beyond 448, inf
    special = torch.tensor([1.0625, 1.1875, -1.0625, 500.0, -1e9, float("inf"), float("-inf"), 0.0, 2**-10]) * scale
    x = torch.cat([x, special.float()])
    q, s = C.quantize_latent_cache(x, scale)
    assert s == scale and q.dtype == F8
    want = _e4m3_oracle((x / torch.tensor(scale, dtype=torch.float32)).float())
    assert torch.equal(q.view(torch.uint8), want)
    ties = q[-9:-7].float().tolist()
    assert ties == [1.0, 1.25]  # ties to even: 1.0 (mantissa 000) and 1.25 (mantissa 010)
    assert q[-6:-4].float().tolist() == [448.0, -448.0] and q[-4:-2].float().tolist() == [448.0, -448.0]


def test_quantize_computed_scale_is_amax_over_448_ignoring_nan():
    x = torch.randn(3, 16, 40, dtype=torch.bfloat16)
    x[1] = float("nan")
    q, s = C.quantize_latent_cache(x)
    assert isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.shape == ()
    amax = x.float().nan_to_num(0).abs().max()
    assert float(s) == float(amax / 448)
    assert float(q.float().nan_to_num(0).abs().max()) == 448.0
    assert torch.isnan(q[1].float()).all() and not torch.isnan(q[0].float()).any()
    assert float(C.quantize_latent_cache(torch.zeros(5))[1]) == 1.0


def test_dequantize_is_one_float32_product_rounded_once():
    g = torch.Generator().manual_seed(1)
    q, s = C.quantize_latent_cache(torch.randn(1000, generator=g) * 10, 0.0123456789)  # not a bf16 value
    want = (q.float() * float(s)).to(torch.bfloat16)
    assert torch.equal(C.dequantize_latent(q, s, torch.bfloat16), want)
    assert torch.equal(C.dequantize_latent(q.view(torch.uint8), float(s), torch.bfloat16), want)
    # one rounding, not two: rounding fp8 to bf16 first (exact) then multiplying in bf16 differs somewhere
    two = q.to(torch.bfloat16) * torch.tensor(float(s), dtype=torch.bfloat16)
    assert not torch.equal(two, want)


# ------------------------------------------------------------------------------------------------ the gather
def _table_case(block_size, seed=0, fp8=True, strided=False):
    g = torch.Generator().manual_seed(seed)
    nb, lat = 9, 40
    full = torch.randn(nb, block_size, 2 * lat if strided else lat, generator=g)
    latent = full[..., :lat] if strided else full
    table = torch.randperm(nb, generator=g)[:6].view(2, 3).to(torch.int32)
    lens = [min(3 * block_size, 2 * block_size + 1), block_size]
    req = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    if fp8:
        q, s = C.quantize_latent_cache(latent)
        if strided:
            buf = torch.zeros(nb, block_size, 2 * lat, dtype=F8)
            buf[..., :lat] = q
            q = buf[..., :lat]
        return q, s, table, req, pos
    return latent, None, table, req, pos


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_gather_reads_through_block_table(block_size, strided):
    cache, s, table, req, pos = _table_case(block_size, fp8=True, strided=strided)
    assert cache.is_contiguous() == (not strided)
    got = C.gather_latent(
        cache, table, req, pos, dtype=torch.bfloat16, kv_cache_scale=C._scale_value(s, cache.device), impl="torch"
    )
    want = torch.stack(
        [
            (cache[int(table[r, p // block_size]), p % block_size].float() * float(s)).to(torch.bfloat16)
            for r, p in zip(req.tolist(), pos.tolist())
        ]
    )
    assert torch.equal(got, want)


def test_gather_impl_is_chosen_in_one_place(monkeypatch):
    import mla_bridge.kernels as K

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert C.gather_impl(torch.device("cpu")) == "torch"
    monkeypatch.setenv("MLA_BRIDGE_GATHER", "torch")
    assert C.gather_impl(torch.device("cuda")) == "torch"
    monkeypatch.setenv("MLA_BRIDGE_GATHER", "Auto")
    assert C.gather_impl(torch.device("cpu")) == "torch"
    # forcing Triton: refused with a reason where it cannot run, taken where it can
    monkeypatch.setenv("MLA_BRIDGE_GATHER", "triton")
    monkeypatch.setattr(K, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="Triton does not import"):
        C.gather_impl(torch.device("cuda"))
    monkeypatch.setattr(K, "triton_available", lambda: True)
    assert C.gather_impl(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        C.gather_impl(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert C.gather_impl(torch.device("cpu")) == "triton"
    monkeypatch.setenv("MLA_BRIDGE_GATHER", "cuda")
    with pytest.raises(ValueError, match="expected torch, triton or auto"):
        C.gather_impl(torch.device("cpu"))


def interpreted_gather_cases() -> str:
    """Triton (interpreted on CPU tensors) == torch gather, bitwise: bf16/fp16/float32 outputs, FP8 and unquantized
    caches, gather-only and fused, block sizes 1/16/64, strided caches, float and tensor scales."""
    from types import SimpleNamespace

    n = 0
    for block_size in (1, 16, 64):
        for fp8 in (True, False):
            for strided in (False, True):
                cache, s, table, req, pos = _table_case(block_size, seed=block_size, fp8=fp8, strided=strided)
                for dtype in (torch.bfloat16, torch.float32) if fp8 else (torch.float32,):
                    c = cache if fp8 else cache.to(dtype)
                    for scale in (C._scale_value(s, c.device), float(s)) if fp8 else (None,):
                        a = C.gather_latent(c, table, req, pos, dtype=dtype, kv_cache_scale=scale, impl="torch")
                        b = C.gather_latent(c, table, req, pos, dtype=dtype, kv_cache_scale=scale, impl="triton")
                        assert torch.equal(a, b), (block_size, fp8, strided, dtype)
                        # fused: context rows interleaved with new rows
                        t, lat, rank = 5, c.shape[-1], 32
                        n_ctx = req.shape[0]
                        perm = torch.randperm(n_ctx + t, generator=torch.Generator().manual_seed(n))
                        plan = SimpleNamespace(
                            dims=SimpleNamespace(latent_dim=lat, kv_lora_rank=rank),
                            dtype=dtype,
                            device=c.device,
                            main_kv_indptr=[0, n_ctx + t],
                            ctx_req_ids=req,
                            ctx_positions=pos,
                            ctx_dst=perm[:n_ctx],
                            new_dst=perm[n_ctx:],
                        )
                        kv_c = torch.randn(t, rank).to(dtype)
                        k_pe = torch.randn(t, 1, lat - rank).to(dtype)[:, 0]
                        a = C.fused_latent(plan, kv_c, k_pe, c, table, scale, impl="torch")
                        b = C.fused_latent(plan, kv_c, k_pe, c, table, scale, impl="triton")
                        assert torch.equal(a, b), ("fused", block_size, fp8, strided, dtype)
                        # with k_pe_out: the kv_c columns returned, k_pe in every head of a strided buffer
                        for fused in (False, True):
                            rows = n_ctx + t if fused else n_ctx
                            got = {}
                            for impl in ("torch", "triton"):
                                buf = torch.full((rows, 3, 2 * (lat - rank) + 5), 7.0, dtype=dtype)
                                k_pe_out = buf[:, :, 3 : 3 + lat - rank]
                                got[impl] = (
                                    C.fused_latent(plan, kv_c, k_pe, c, table, scale, impl=impl, k_pe_out=k_pe_out)
                                    if fused
                                    else C.gather_latent(
                                        c,
                                        table,
                                        req,
                                        pos,
                                        dtype=dtype,
                                        kv_cache_scale=scale,
                                        impl=impl,
                                        k_pe_out=k_pe_out,
                                    ),
                                    buf,
                                )
                            (la, ba), (lb, bb) = got["torch"], got["triton"]
                            full = (
                                a
                                if fused
                                else C.gather_latent(
                                    c, table, req, pos, dtype=dtype, kv_cache_scale=scale, impl="torch"
                                )
                            )
                            assert la.shape == lb.shape == (rows, rank) and torch.equal(la, lb), ("kv_c", fused)
                            assert torch.equal(lb, full[:, :rank]) and torch.equal(ba, bb), ("k_pe_out", fused)
                            assert torch.equal(
                                bb[:, :, 3 : 3 + lat - rank], full[:, None, rank:].expand(rows, 3, lat - rank)
                            )
                            assert (bb[:, :, :3] == 7).all() and (bb[:, :, 3 + lat - rank :] == 7).all()
                        n += 1
    return f"ok {n}"


def test_triton_gather_equals_torch_gather_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_gather_cases` under the interpreter."""
    out = triton_interpreted("tests.test_cache:interpreted_gather_cases", "tests/gpu/test_gpu_gather.py")
    assert out.strip().startswith("ok ") and int(out.split()[-1]) > 20, out


def test_quantize_scale_of_tiny_values_is_positive():
    """amax / 448 underflows float32 for amax below about 6e-43: the computed scale was 0, which every kernel and
    check_kv_cache refuse. It is now at least float32's smallest normal (values that small quantize to 0)."""
    for amax in (1e-45, 1e-42, 5e-39):
        cache, scale = C.quantize_latent_cache(torch.full((2, 3), amax))
        assert float(scale) >= torch.finfo(torch.float32).tiny
        C.check_kv_cache(cache, scale, C.FP8_DTYPE)  # accepted
        assert torch.isfinite(cache.float()).all()
    assert float(C.quantize_latent_cache(torch.zeros(4))[1]) == 1.0
    assert float(C.quantize_latent_cache(torch.full((4,), 448.0))[1]) == 1.0


# ------------------------------------------------------------------------------------- chunk rows by kv_indptr
def _chunk_plans():
    """CPU plans whose chunks cover what ChunkRows must name: a request split across chunks (first_start > 0),
    requests without context inside a chunk (repeated kv_indptr entries), 1 to 9 requests per chunk."""
    from mla_bridge import MLADims, PrefillPlan, Workspace

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    cases = [
        ([1, 2, 1, 3, 1, 2, 1, 1, 2, 1], [3, 0, 5, 0, 0, 7, 2, 0, 4, 1], 19),
        ([2, 3, 1], [17, 4, 9], 5),
        ([1] * 12, [1, 0] * 6, 64),
        ([4], [33], 8),
    ]
    return d, [
        PrefillPlan.build(
            q,
            c,
            dims=d,
            workspace=Workspace("cpu", chunk_tokens=k),
            block_size=4,
            dtype=torch.float32,
            fuse_context=False,
        )
        for q, c, k in cases
    ]


def _rows_of(chunk) -> "C.ChunkRows":
    return C.ChunkRows(chunk.kv_indptr, chunk.req_start, chunk.first_start, chunk.num_tokens)


def test_chunk_rows_name_the_tokens_of_the_chunk_schedule():
    """ChunkRows.token_indices (the torch path's per-call indices of a chunk) gives, for every chunk, the (request,
    position) pairs the reference schedule's spans name, in order; a CPU plan holds no per-token tensor of its own."""
    _, plans = _chunk_plans()
    seen = set()
    for plan in plans:
        for c in plan.chunks:
            req, pos = _rows_of(c).token_indices()
            assert req.dtype == pos.dtype == torch.int64
            assert req.tolist() == [r for r, s, e in c.spans for _ in range(s, e)]
            assert pos.tolist() == [p for r, s, e in c.spans for p in range(s, e)]
            assert c.rows.indices is None and torch.equal(c.rows.kv_indptr, c.kv_indptr)
            seen.add((c.first_start > 0, len(c.kv_indptr) - 1 > len(c.spans)))
    assert seen >= {(True, False), (False, True)}  # both hard parts occur
    assert max(len(c.kv_indptr) for p in plans for c in p.chunks) - 1 >= 9


def interpreted_chunk_rows_cases() -> str:
    """Under the interpreter: the gather and the fused up-projection kernel reading a chunk's rows from its
    kv_indptr (ChunkRows) give exactly what they give from the per-token indices of the same chunk, for an FP8 and a
    float32 cache, with and without k_pe_out (the gather) and both weight layouts (the up-projection)."""
    from mla_bridge import prepare_kv_b_proj
    from mla_bridge.kernels.gather import gather_latent_triton
    from mla_bridge.kernels.up_project import up_project_triton

    d, plans = _chunk_plans()
    n = 0
    for fp8 in (False, True):
        g = torch.Generator().manual_seed(3)
        nb, bs = 24, 4
        lat = torch.randn(nb, bs, d.latent_dim, generator=g)
        cache, s = C.quantize_latent_cache(lat) if fp8 else (lat, None)
        scale = C._scale_value(s, cache.device) if fp8 else None
        for plan in plans:
            table = torch.randint(0, nb, (plan.batch_size, 9), generator=g, dtype=torch.int32)
            for c in plan.chunks:
                rows, (req, pos) = _rows_of(c), c.token_indices()
                want = C.gather_latent(cache, table, req, pos, dtype=torch.float32, kv_cache_scale=scale, impl="torch")
                assert torch.equal(
                    C.gather_rows(cache, table, rows, dtype=torch.float32, kv_cache_scale=scale, impl="triton"), want
                )
                k_pe_out = torch.full((c.num_tokens, 3, d.qk_rope_head_dim), 7.0)
                out = torch.empty(c.num_tokens, d.kv_lora_rank)
                gather_latent_triton(out, cache, table, None, None, scale, k_pe_out, d.kv_lora_rank, rows=rows)
                assert torch.equal(out, want[:, : d.kv_lora_rank])
                assert torch.equal(k_pe_out, want[:, None, d.kv_lora_rank :].expand_as(k_pe_out))
                for layout in ("identity", "split"):
                    w = prepare_kv_b_proj(torch.randn(*d.kv_b_proj_shape, generator=g) * 0.2, d, layout=layout)
                    got = {}
                    for by_rows in (False, True):
                        buf = torch.full((c.num_tokens, d.num_heads, d.head_dim_qk + d.v_head_dim), 7.0)
                        up_project_triton(
                            buf,
                            w,
                            kv_cache=cache,
                            block_table=table,
                            req_ids=None if by_rows else req,
                            positions=None if by_rows else pos,
                            rows=rows if by_rows else None,
                            kv_cache_scale=scale,
                        )
                        got[by_rows] = buf
                    assert torch.equal(got[True], got[False]) and not (got[True] == 7.0).any()
                n += 1
    # rows named twice, or without the cache they index: refused before any launch
    import pytest

    c = plans[0].chunks[0]
    buf = torch.empty(c.num_tokens, d.num_heads, d.head_dim_qk + d.v_head_dim)
    with pytest.raises(ValueError, match="not both"):
        up_project_triton(
            buf,
            w,
            kv_cache=cache,
            block_table=table,
            req_ids=c.token_indices()[0],
            positions=c.token_indices()[1],
            rows=_rows_of(c),
        )
    with pytest.raises(ValueError, match="need kv_cache and block_table"):
        up_project_triton(buf, w, rows=_rows_of(c))
    with pytest.raises(ValueError, match="not both"):
        gather_latent_triton(
            torch.empty(c.num_tokens, d.latent_dim), cache, table, *c.token_indices(), rows=_rows_of(c)
        )
    return f"ok {n}"


def test_chunk_rows_kernels_equal_per_token_indices_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_chunk_rows_cases`."""
    out = triton_interpreted("tests.test_cache:interpreted_chunk_rows_cases", "tests/gpu/test_gpu_gather.py")
    assert out.strip().startswith("ok ") and int(out.split()[-1]) >= 20, out


def interpreted_strided_chunk_rows() -> str:
    """Under the interpreter: a ChunkRows whose kv_indptr is a strided view (its values every other element) names the
    rows its values say in both kernels, as the torch path reads them, not the elements in between."""
    from mla_bridge import MLADims, prepare_kv_b_proj
    from mla_bridge.kernels.up_project import up_project_triton

    d = MLADims(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(8, 4, d.latent_dim, generator=g)
    table = torch.randperm(8, generator=g).view(2, 4).to(torch.int32)
    rows = C.ChunkRows(torch.tensor([0, 99, 5, 99, 9], dtype=torch.int32)[::2], 0, 2, 9)
    assert not rows.kv_indptr.is_contiguous()
    want = C.gather_rows(cache, table, rows, dtype=torch.float32, impl="torch")
    assert torch.equal(C.gather_rows(cache, table, rows, dtype=torch.float32, impl="triton"), want)
    dense = C.ChunkRows(rows.kv_indptr.contiguous(), 0, 2, 9)
    w = prepare_kv_b_proj(torch.randn(*d.kv_b_proj_shape, generator=g) * 0.2, d)
    got = []
    for r in (rows, dense):
        buf = torch.full((9, d.num_heads, d.head_dim_qk + d.v_head_dim), 7.0)
        up_project_triton(buf, w, kv_cache=cache, block_table=table, rows=r)
        got.append(buf)
    assert torch.equal(got[0], got[1])
    return "ok"


def test_strided_chunk_rows_indptr_interpreted(triton_interpreted):
    """Where Triton is installed (a dev venv; CI has none): :func:`interpreted_strided_chunk_rows`."""
    out = triton_interpreted("tests.test_cache:interpreted_strided_chunk_rows", "tests/gpu/test_gpu_gather.py")
    assert out.strip() == "ok", out
