"""GPU tests of the CUDA paths at any shape.

Marked ``gpu`` (skipped without CUDA + FlashInfer). Run on the H200:
    python3 -m pytest tests/gpu/test_gpu_shapes.py -q -m gpu -rs
The merge over 2**32 elements needs about 40 GB of device memory (``test_merge_over_32_bit_elements``, one case).

1. the default ``mla-bridge bench`` finishes (subprocess, timeout, exit 0, complete JSON, a plot);
2. the CLI's phase times add up to its layer time within 5% (GPU-bound shapes);
3. the merge at head dims FlashInfer's merge does not take (32/48/96), and just over 2**32 elements, in place and
   out of place;
4. ragged prefill at head dims no FlashInfer kernel serves (16, 4 heads: vLLM's CPU-backend shape) and across a grid:
   every shape reaches a kernel that gives the right answer;
5. fa2's LSE accuracy at its stated bound (FlashInfer's own precision: see ``test_fa2_lse_accuracy``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, Workspace, merge_attn_states, plan_ragged, select_backend  # noqa: E402
from mla_bridge.merge import merge_attn_states_, select_merge  # noqa: E402

BF16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[2]


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _env() -> dict:
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "adapters")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    return env


def _run(code: str, args: list, timeout: float, tmp_path: Path) -> subprocess.CompletedProcess:
    """``python -c code args`` with every thread's stack printed (faulthandler) if it runs 60 s short of timeout."""
    prog = f"import faulthandler, sys; faulthandler.dump_traceback_later({max(30, timeout - 60)}, exit=True); " + code
    try:
        return subprocess.run(
            [sys.executable, "-c", prog, *args],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        errs = (err.stderr or b"").decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        pytest.fail(f"timed out after {timeout} s\n--- stdout\n{out[-4000:]}\n--- stderr\n{errs[-8000:]}")


# ---------------------------------------------------------------------------------------------------- 1. bench
def test_default_bench_finishes_with_complete_json_and_plot(tmp_path):
    """The full default bench (every section, JAX last among the required jobs) with a short repeat count exits 0
    and leaves a complete JSON and a PNG. Before the fix it measured everything in 21 s and then did not exit."""
    from mla_bridge.bench.common import DEFAULT_SECTIONS as SECTIONS

    js, png = tmp_path / "b.json", tmp_path / "b.png"
    res = _run(
        "from mla_bridge.cli import main; sys.exit(main(sys.argv[1:]))",
        ["bench", "--repeats", "3", "--warmup", "1", "--json", str(js), "--plot", str(png)],
        900,
        tmp_path,
    )
    tail = f"--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-8000:]}"
    assert res.returncode == 0, tail
    data = json.loads(js.read_text())
    assert data["complete"] is True, tail
    assert data["sections"] == list(SECTIONS)
    assert {r["section"] for r in data["rows"]} >= set(SECTIONS)
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench finished" in res.stdout


# ---------------------------------------------------------------------------------------------------- 2. phases
@pytest.mark.parametrize(
    "args,gpu_bound",
    [
        (["--batch", "4", "--prompt-len", "10000"], True),  # phases once summed to 4.17 ms for a 3.26 ms layer
        # fused, 1.61 ms; on the H200 of 2026-12-01 partly host-bound: phases 1.379 ms (GPU time), layer 1.489 ms
        (["--batch", "4", "--prompt-len", "2000", "--context-lens", "8000,8000,8000,8000"], False),
        # 4 chunks, 1.91 ms eager against 1.73 ms from a CUDA graph: partly host-bound
        (
            ["--batch", "4", "--prompt-len", "2000", "--context-lens", "8000,8000,8000,8000", "--chunk-tokens", "8192"],
            False,
        ),
    ],
)
def test_cli_phase_times_add_up_to_the_layer(tmp_path, args, gpu_bound):
    """GPU-bound layers: the phase times (GPU time, the GPU kept ahead of the host) sum to the layer time within 5%.
    A partly host-bound layer: the phases never add up to more than the layer, and with the host gaps reported
    apart they account for it. The JSON says how they were measured."""
    js = tmp_path / "p.json"
    res = _run(
        "from mla_bridge.cli import main; sys.exit(main(sys.argv[1:]))",
        ["prefill", *args, "--layers", "8", "--check-requests", "0", "--json", str(js)],
        600,
        tmp_path,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    t = json.loads(js.read_text())["timings_ms"]
    phases, timing = t["phases"], t["phase_timing"]
    assert timing["host_ran_ahead"] is True
    assert "CUDA events" in timing["method"] and "gap_ms" in timing["method"]
    total = sum(phases.values())
    assert total == pytest.approx(timing["sum_ms"])
    if gpu_bound:
        assert abs(total / t["layer_mean"] - 1) <= 0.05, (phases, t["layer_mean"], timing)
    else:
        assert total <= 1.05 * t["layer_mean"], (phases, t["layer_mean"], timing)
        assert timing["idle_layer_ms"] >= 0.95 * t["layer_mean"], (phases, t["layer_mean"], timing)
    assert set(timing["gap_ms"]) == set(phases) and set(timing["host_ms"]) == set(phases)


# ---------------------------------------------------------------------------------------------------- 3. merge
def merge64(oa, la, ob, lb):
    """float64 merge from the definition (natural-log LSE; -inf empty), vectorised."""
    la, lb = la.double(), lb.double()
    m = torch.maximum(la, lb)
    ms = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - ms), torch.exp(lb - ms)
    tot = wa + wb
    lse = torch.where(tot > 0, ms + torch.log(tot), torch.full_like(tot, -math.inf))
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = oa.double() * (wa / safe).unsqueeze(-1) + ob.double() * (wb / safe).unsqueeze(-1)
    return out, lse


def _partials(t, h, d, dtype, seed):
    g = torch.Generator(device=dev()).manual_seed(seed)
    oa = torch.randn(t, h, d, device=dev(), dtype=dtype, generator=g)
    ob = torch.randn(t, h, d, device=dev(), dtype=dtype, generator=g)
    la = torch.randn(t, h, device=dev(), generator=g) * 4
    lb = torch.randn(t, h, device=dev(), generator=g) * 4
    la[::7, 0] = -math.inf  # some empty partials
    return oa, la, ob, lb


@pytest.mark.parametrize("d", [32, 48, 96, 64, 128])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("heads", [8, 128])
@pytest.mark.parametrize("impl", ["auto", "flashinfer"])
def test_merge_any_head_dim(d, dtype, heads, impl, monkeypatch):
    """32/48/96 raised "MergeState ... Unsupported head_dim" in FlashInfer 0.7.4 (432 cases of vLLM's grid). The
    Triton merge (the default on CUDA) takes every head dim; with MLA_BRIDGE_MERGE=flashinfer, 64/128 stay on
    FlashInfer's kernel and the others on the torch merge. Both in place and out of place, against float64."""
    monkeypatch.setenv("MLA_BRIDGE_MERGE", impl)
    expect = "triton" if impl == "auto" else "flashinfer" if d in (64, 128) else "torch"
    assert select_merge((100, heads, d), dtype, "cuda").name == expect
    oa, la, ob, lb = _partials(100, heads, d, dtype, seed=d + heads)
    eo, el = merge64(oa, la, ob, lb)
    out, lse = merge_attn_states(oa, la, ob, lb)
    o2, l2 = oa.clone(), la.clone()
    merge_attn_states_(o2, l2, ob, lb)
    torch.cuda.synchronize()
    for o, s in ((out, lse), (o2, l2)):
        assert o.dtype == dtype and not torch.isnan(o).any()
        torch.testing.assert_close(o.double(), eo, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(s.double(), el, atol=1e-4, rtol=1e-5)


def test_merge_over_32_bit_elements(monkeypatch):
    """2**32 + 2**20 elements (bf16, 128 heads x 128, 262,208 rows): FlashInfer's merge indexes in 32 bits and
    returned max error 3.25 out of place, 5.11 in place in the last rows; it is now handed pieces below 2**32. The
    Triton merge (the default on CUDA) indexes in int64 and merges all rows in one launch. Both, on the same inputs,
    out of place and in place. Needs about 35 GB (two inputs of 8.6 GB, an output, an in-place copy)."""
    t, h, d = 262_208, 128, 128  # 2**32 + 64 * 16384 elements
    assert t * h * d > 2**32
    oa, la, ob, lb = _partials(t, h, d, BF16, seed=1)
    check = torch.cat([torch.arange(0, 64), torch.arange(262_080, 262_208), torch.arange(t - 256, t)]).to(dev())
    eo, el = merge64(oa[check], la[check], ob[check], lb[check])
    for impl in ("triton", "flashinfer"):
        monkeypatch.setenv("MLA_BRIDGE_MERGE", impl)
        choice = select_merge((t, h, d), BF16, "cuda")
        assert choice.name == impl
        assert choice.rows_per_piece == t if impl == "triton" else choice.rows_per_piece * h * d < 2**32
        out, lse = merge_attn_states(oa, la, ob, lb)
        torch.testing.assert_close(out[check].double(), eo, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(lse[check].double(), el, atol=1e-4, rtol=1e-5)
        del out, lse
        o2, l2 = oa.clone(), la.clone()
        merge_attn_states_(o2, l2, ob, lb)  # in place: o2, l2 become the merge
        torch.cuda.synchronize()
        torch.testing.assert_close(o2[check].double(), eo, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(l2[check].double(), el, atol=1e-4, rtol=1e-5)
        del o2, l2


# ---------------------------------------------------------------------------------------------------- 4. head dims
def _ragged64(q, k, v, lens, sm_scale):
    """float64 causal attention per request (q_len == kv_len): out, natural-log lse."""
    outs, lses, a = [], [], 0
    for n in lens:
        qq, kk, vv = (x[a : a + n].double() for x in (q, k, v))
        s = torch.einsum("qhd,khd->hqk", qq, kk) * sm_scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
        lses.append(torch.logsumexp(s, -1).t())
        a += n
    return torch.cat(outs), torch.cat(lses)


def _ragged_inputs(lens, heads, d_qk, d_vo, dtype=BF16, seed=0):
    g = torch.Generator(device=dev()).manual_seed(seed)
    t = sum(lens)
    mk = lambda d: torch.randn(t, heads, d, device=dev(), generator=g).to(dtype)  # noqa: E731
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + n)
    return mk(d_qk), mk(d_qk), mk(d_vo), indptr


@pytest.mark.parametrize(
    "dims",
    [
        (16, 16),
        (32, 32),
        (48, 48),
        (64, 64),
        (80, 80),
        (96, 96),
        (112, 112),
        (128, 128),
        (160, 160),
        (192, 192),
        (192, 128),
        (72, 72),
    ],
)
def test_ragged_prefill_any_head_dim_is_right(dims):
    """Whatever the dispatch table picks for a head dim, it runs and matches float64 (head dim 16 with 4 heads
    failed in fa2 with "Invalid configuration : NUM_MMA_Q=1 NUM_MMA_D_QK=1"; 72 returned wrong columns)."""
    heads = 4
    lens = [17, 128, 300]
    q, k, v, indptr = _ragged_inputs(lens, heads, *dims, seed=dims[0])
    sm_scale = dims[0] ** -0.5
    plan = plan_ragged(
        indptr,
        indptr,
        num_heads=heads,
        head_dim_qk=dims[0],
        head_dim_vo=dims[1],
        causal=True,
        sm_scale=sm_scale,
        dtype=BF16,
        workspace=Workspace(dev()),
    )
    if dims[0] % 64 or dims[1] % 64:
        assert plan.backend.name == "torch" and "fallback" in plan.backend.reason
    out, lse = plan.run(q, k, v)
    torch.cuda.synchronize()
    eo, el = _ragged64(q, k, v, lens, sm_scale)
    torch.testing.assert_close(out.double(), eo, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), el, atol=1e-2, rtol=0)


def test_head_dim_16_four_heads_runs_on_torch():
    """vLLM's CPU-backend test shape through ragged_prefill's default dispatch."""
    from mla_bridge import ragged_prefill

    q, k, v, indptr = _ragged_inputs([5, 9, 33], 4, 16, 16, seed=3)
    choice = select_backend(dev(), dtype=BF16, head_dim_qk=16, head_dim_vo=16)
    assert choice.name == "torch" and "multiple of 64" in dict(choice.passed_over)["flashinfer-fa2"]
    out, lse = ragged_prefill(q, k, v, indptr, indptr, causal=True, sm_scale=0.25)
    eo, el = _ragged64(q, k, v, [5, 9, 33], 0.25)
    torch.testing.assert_close(out.double(), eo, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), el, atol=1e-2, rtol=0)


# ---------------------------------------------------------------------------------------------------- 5. fa2 LSE
#: fa2's LSE bound at bf16: FlashInfer's fa2 prefill (``compute_sfm_v`` in include/flashinfer/attention/prefill.cuh)
#: rounds the probabilities P = exp2(s - m) to q's dtype and takes the softmax denominator as their row sum on the
#: tensor cores (``mma::m16k16_rowsum_f16f16f32(d, s_frag_f16)``). Each term carries a relative rounding error of at
#: most 2**-8 (bf16's unit roundoff; the max term, exactly 1, carries none), so the denominator is off by a relative
#: 2**-8 at most and the natural-log LSE by ln(1 + 2**-8) = 3.9e-3; float32 arithmetic adds ~1e-5. fa3 sums P in
#: float32 and stays within 1e-3. Errors of independent roundings mostly cancel, so large errors are rare.
FA2_LSE_BOUND_BF16 = math.log1p(2.0**-8) + 1e-4


def test_fa2_lse_accuracy():
    """fa2 vs float64 of the same bf16 inputs, causal, 32 heads, 17..977-token requests: every LSE within the bound
    above (measured on the H200 on 2026-12-01 with the raw wrapper: max 2.6e-3 in base 2, 1% of elements
    beyond 1e-3 in base 2; fa3 3.7e-6); and mla_bridge's fa2 LSE is bitwise FlashInfer's own (raw wrapper,
    same float sm_scale, lse_base="ln"): the error is FlashInfer's precision, not something mla_bridge passes."""
    import flashinfer

    if not _usable("flashinfer-fa2"):
        pytest.skip("fa2 cannot serve here")
    dims = MLADims.deepseek_v2_lite()
    heads, lens = 32, [17, 64, 129, 256, 333, 512, 700, 977]
    q, k, v, indptr = _ragged_inputs(lens, heads, 192, 128, seed=11)
    ws = Workspace(dev())
    plan = plan_ragged(
        indptr,
        indptr,
        num_heads=heads,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=True,
        sm_scale=dims.softmax_scale,
        dtype=BF16,
        workspace=ws,
        backend="flashinfer-fa2",
    )
    assert plan.spec.sm_scale == dims.softmax_scale and type(plan.spec.sm_scale) is float
    out, lse = plan.run(q, k, v)
    torch.cuda.synchronize()
    # the raw wrapper on the same float workspace, so that nothing but what mla_bridge passes can differ
    raw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws.float_workspace, kv_layout="NHD", backend="fa2")
    ip = torch.tensor(indptr, dtype=torch.int32)
    raw.plan(
        ip,
        ip,
        heads,
        heads,
        192,
        head_dim_vo=128,
        causal=True,
        sm_scale=dims.softmax_scale,
        q_data_type=BF16,
        kv_data_type=BF16,
        o_data_type=BF16,
    )
    raw_out, raw_lse = raw.run(q, k, v, return_lse=True, lse_base="ln")
    torch.cuda.synchronize()
    assert torch.equal(lse, raw_lse) and torch.equal(out, raw_out)
    _, el = _ragged64(q, k, v, lens, dims.softmax_scale)
    err = (lse.double() - el).abs()
    assert err.max().item() <= FA2_LSE_BOUND_BF16, err.max().item()


def _usable(backend: str) -> bool:
    try:
        select_backend(dev(), requested=backend, dtype=BF16, head_dim_qk=192, head_dim_vo=128)
        return True
    except ValueError:
        return False
