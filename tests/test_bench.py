"""``mla-bridge bench`` in its CPU quick mode: it runs in-process through argparse in a few seconds, its JSON holds
every field, the plot is written. No timing value is asserted. The hand-written comparison pipeline and the isolated
phases are checked for computing the same attention as ``mla_prefill`` (with a stand-in FlashInfer on the CPU), so
that the GPU comparison rows compare like with like."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import sys
import time
import types

import pytest
import torch

from mla_bridge import PrefillPlan, Workspace, mla_prefill
from mla_bridge.backends.torch_ref import ragged_attention_reference
from mla_bridge.bench import add_arguments, run
from mla_bridge.bench.common import DEFAULT_SECTIONS
from mla_bridge.bench.common import Ctx, Row, attention_flops, causal_pairs

ROW_FIELDS = {f.name for f in dataclasses.fields(Row)} - {"order"}
ENV_FIELDS = {
    "date",
    "device",
    "gpu",
    "gpu_capability",
    "driver",
    "torch",
    "cuda",
    "flashinfer",
    "python",
    "dtype",
    "mode",
}
FAKE_JAX_ROWS = [
    {
        "case": "tiny 2x32",
        "impl": "torch core (RaggedPlan.run)",
        "backend": "torch",
        "ms": 0.5,
        "tflops": 0.001,
        "flops": 5e5,
        "vs_torch": 1.0,
        "note": "",
    },
    {
        "case": "tiny 2x32",
        "impl": "jax jit (tvm_ffi)",
        "backend": "torch",
        "ms": None,
        "tflops": None,
        "vs_torch": None,
        "note": "skipped: not implemented",
    },
]


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _quiet_console():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def _ctx():
    return Ctx(
        device=torch.device("cpu"),
        quick=True,
        repeats=1,
        warmup=0,
        seed=0,
        backend=None,
        skip=set(),
        budget_s=None,
        console=_quiet_console(),
    )


def _fake_compare(calls: list):
    def compare(cases=(), *, warmup=5, iters=50, seed=0, backend=None):
        calls.append(dict(cases=cases, warmup=warmup, iters=iters, seed=seed, backend=backend))
        return [dict(r) for r in FAKE_JAX_ROWS]

    return compare


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One full CPU quick run of every section (the JAX adapter replaced by a stand-in)."""
    out = tmp_path_factory.mktemp("bench")
    calls: list = []
    console = _quiet_console()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mla_bridge.bench.jax_rows.compare", _fake_compare(calls))
        mp.delenv("MLA_BRIDGE_BACKEND", raising=False)
        # flex_attention's eager set-up costs seconds on a CPU: its own (slow) test below runs it.
        args = _parse(
            ["--device", "cpu", "--skip", "flex", "--json", str(out / "bench.json"), "--plot", str(out / "bench.png")]
        )
        rc = run(args, console=console)
    data = json.loads((out / "bench.json").read_text())
    return types.SimpleNamespace(rc=rc, data=data, png=out / "bench.png", calls=calls, text=console.file.getvalue())


def test_cpu_run_succeeds_and_prints_tables(cpu_run):
    assert cpu_run.rc == 0
    for title in ("1. Main pass", "2. Context pass", "3. Merge", "4. Planning", "6. JAX"):
        assert title in cpu_run.text
    # every row of the memory section needs CUDA: the section is not printed on the CPU
    assert "5. Peak extra" not in cpu_run.text


def text_before_not_shown(text: str) -> str:
    return text.split("Not shown:")[0]


def test_cpu_run_prints_only_rows_and_targets_that_apply(cpu_run):
    """Rows of paths the CPU cannot run (CUDA, FlashInfer, Triton) and the GPU targets stay in the JSON, flagged,
    and are left out of the printed report, which says how many it left out."""
    rows = cpu_run.data["rows"]
    hidden = [r for r in rows if not r["applies"]]
    # skipped rows, and the CUDA-graph rows, which the CPU runs eagerly (the API exercised, no graph to time)
    graph_rows = [r for r in rows if "CUDA graph replay" in r["path"]]
    assert graph_rows and all(not r["applies"] for r in graph_rows)
    assert any(r["status"] == "ok" and r["extra"].get("graphed") is False for r in graph_rows)
    assert hidden and all(r["status"] == "skipped" or r in graph_rows for r in hidden)
    assert "CUDA graph replay" not in text_before_not_shown(cpu_run.text)
    assert {r["section"] for r in hidden} >= {"main", "context", "merge", "memory"}
    assert any("raw FlashInfer" in r["path"] for r in hidden)
    text = cpu_run.text
    for word in ("needs CUDA and FlashInfer", "fused kernel needs CUDA", "n/a here", "missed", "Targets ("):
        assert word not in text.split("Not shown:")[0], word
    assert f"Not shown: {len(hidden)} rows" in text
    checks = cpu_run.data["checks"]
    assert checks and not any(c["applies"] for c in checks)
    assert f"Targets: {len(checks)} recorded in the JSON do not apply here" in text
    # a skip the user asked for is still shown
    assert all(r["applies"] for r in rows if r["note"] == "--skip flex")
    assert "--skip flex" in text


def test_targets_are_named_by_what_they_measure(cpu_run):
    import re

    names = [c["name"] for c in cpu_run.data["checks"]]
    assert names and not [n for n in names if re.search(r"issue", n, re.I)]
    assert not re.search(r"issue \d", cpu_run.text, re.I)


def test_gpu_targets_are_printed_with_their_result():
    from mla_bridge.bench.common import Check
    from mla_bridge.bench.report import render

    console = _quiet_console()
    env = dict(
        gpu="NVIDIA H200",
        torch="2.11",
        cuda="13.0",
        flashinfer="0.7.4",
        dtype="bfloat16",
        mode="full",
        date="2026-12-04T12:00:00+00:00",
    )
    checks = [
        Check("context 4x(8000+2000), 4 chunks: mla_prefill / (attention + GEMM alone)", 1.09, 1.12, "<=", True, True),
        Check("merge 16 heads: merge_attn_states GB/s", 2400.0, 2500.0, ">=", False, True),
        Check("plan: PrefillPlan.build host ms, batch 128", None, 1.0, "<=", None, True),
        Check("quick-mode only", 1.0, 2.0, "<=", True, False),
    ]
    rows = [
        Row("main", "16h 1x10000", "mla_bridge RaggedPlan.run", ms=0.73, tflops=704.0),
        Row("main", "16h 1x10000", "raw FlashInfer wrapper.run", status="skipped", note="needs X", applies=False),
    ]
    render(console, rows, checks, env, {})
    text = console.file.getvalue()
    assert "Targets (GPU, full mode)" in text
    assert "met" in text and "missed" in text and "not measured" in text
    assert "quick-mode only" not in text and "1 recorded in the JSON do not apply here" in text
    assert "raw FlashInfer wrapper.run" not in text and "Not shown: 1 rows" in text


def test_json_has_environment_config_and_peaks(cpu_run):
    d = cpu_run.data
    assert d["complete"] is True
    assert ENV_FIELDS <= set(d["environment"])
    assert d["environment"]["mode"] == "quick" and d["environment"]["torch"] == torch.__version__
    assert d["environment"]["date"]
    assert d["config"]["device"] == "cpu" and d["config"]["quick"] is True
    assert d["config"]["repeats"] >= 1 and d["config"]["statistic"] == "median"
    assert d["peaks"]["matmul_tflops"] > 0 and d["peaks"]["copy_gbps"] > 0
    assert d["sections"] == list(DEFAULT_SECTIONS)
    assert isinstance(d["jobs"], list) and d["jobs"]


def test_every_section_has_rows_and_every_row_every_field(cpu_run):
    rows = cpu_run.data["rows"]
    assert {r["section"] for r in rows} == set(DEFAULT_SECTIONS) | {"peak"}
    for r in rows:
        assert set(r) == ROW_FIELDS, r
        assert r["status"] in ("ok", "skipped")
        if r["status"] == "skipped":
            assert r["note"], r
    measured = [r for r in rows if r["status"] == "ok" and r["section"] in ("main", "context", "merge", "peak")]
    assert measured
    for r in measured:
        assert r["ms"] is not None and r["ms"] > 0, r
        assert (r["tflops"] is not None) or (r["gbps"] is not None), r
        assert r["fraction"] is not None and r["fraction_of"] in ("matmul_peak", "copy_bandwidth"), r


def test_main_section_paths(cpu_run):
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "main"]
    by_path: dict = {}
    for r in rows:
        by_path.setdefault(r["path"], []).append(r)
    assert set(by_path) == {
        "mla_bridge RaggedPlan.run",
        "raw FlashInfer wrapper.run",
        "torch SDPA (dense)",
        "flex_attention (doc-causal)",
        "mla_bridge torch backend",
    }
    assert all(r["status"] == "ok" for r in by_path["mla_bridge RaggedPlan.run"])
    assert all(r["status"] == "skipped" for r in by_path["raw FlashInfer wrapper.run"])  # no CUDA here
    ragged = [r for r in by_path["torch SDPA (dense)"] if "mixed" in r["case"]]
    assert ragged and all("equal lengths" in r["note"] for r in ragged)
    assert all(r["note"] == "--skip flex" for r in by_path["flex_attention (doc-causal)"])
    # on the CPU mla_bridge's plan runs the torch backend: the reference row would time the same call again
    assert all(r["status"] == "skipped" and not r["applies"] for r in by_path["mla_bridge torch backend"])
    for r in by_path["mla_bridge RaggedPlan.run"]:
        assert r["seq_len"] > 0 and r["heads"] > 0 and r["flops"] > 0


def test_context_section_splits_phases(cpu_run):
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "context"]
    paths = {r["path"] for r in rows}
    for p in (
        "mla_prefill",
        "hand-written pipeline",
        "phase: gather by block_table",
        "phase: up-projection GEMM alone",
        "phase: attention kernels alone",
        "phase: merge",
        "attention + GEMM alone",
        "context pass: RaggedPlan.run",
    ):
        assert p in paths
    full = [r for r in rows if r["path"] == "mla_prefill"]
    assert len(full) == 8  # 2 long cases x 2 chunk budgets + 2 host-bound cases + the GLM-5 case x 2 budgets
    assert {r["extra"]["chunks"] for r in full} >= {0, 4, 8}
    assert all("vs_attention_plus_gemm" in r["extra"] for r in full if r["extra"]["chunks"] != 0 or r["extra"]["fused"])


def test_in_layer_gather_counts_the_bytes_the_gather_moves(cpu_run):
    """The gather timed inside the layer moves what the same gather timed alone moves (context rows read and written,
    and on the fused schedule the new rows too): one count of bytes, so one bandwidth for one gather. Before, the
    in-layer row counted 4 x context + 2 x new rows (fused) and 2 x (context + new) rows (chunked)."""
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "context" and r["status"] == "ok"]
    alone = {r["case"]: r["bytes"] for r in rows if r["path"] == "phase: gather by block_table"}
    in_layer = {r["case"]: r["bytes"] for r in rows if r["path"] == "in mla_prefill: gather"}
    both = set(alone) & set(in_layer)
    assert len(both) >= 4
    for case in both:
        assert in_layer[case] == alone[case], case


def test_cpu_denominator_rows_do_not_claim_cuda_events(cpu_run):
    """On the CPU the attention + GEMM rows are wall-clock times: their note must not say CUDA events."""
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "context" and r["path"] == "attention + GEMM alone"]
    assert rows and all("CUDA" not in r["note"] and "wall clock" in r["note"] for r in rows)


def test_context_section_prepared_split_and_graphed_paths(cpu_run):
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "context"]
    for path in (
        "mla_prefill, raw weight (read in place; rearranged per call for cuBLAS passes)",
        "mla_prefill, identity layout (one GEMM with an identity block)",
        "mla_prefill, CUDA graph replay",
        "mla_prefill, identity layout, CUDA graph replay",
    ):
        got = [r for r in rows if r["path"] == path]
        assert len(got) == 8 and all(r["status"] == "ok" and r["ms"] > 0 and r["tflops"] for r in got), path
    graphed = [r for r in rows if r["path"] == "mla_prefill, CUDA graph replay"]
    for r in graphed:  # the CPU runs the same API eagerly; the capture fields are there, zero
        assert r["extra"]["graphed"] is False and r["extra"]["capture_ms"] == r["extra"]["graph_memory_bytes"] == 0
        assert "speedup_vs_eager" in r["extra"]
    names = {c["name"] for c in cpu_run.data["checks"]}
    assert "context 4h 2x(96+32), all context: mla_prefill, CUDA graph replay / (attention + GEMM alone)" in names
    assert not any(n.startswith("context 4h 8x16 new") and "attention + GEMM" in n for n in names)  # no phases
    # the kv_impl-forced paths need CUDA and Triton: a skipped row each per case, the graphed separate one included
    for path in (
        "mla_prefill, gather + cuBLAS GEMM on every pass (kv_impl='separate')",
        "mla_prefill, gather + cuBLAS GEMM on every pass, CUDA graph replay",
    ):
        got = [r for r in rows if r["path"] == path]
        assert len(got) == 8 and all(r["status"] == "skipped" for r in got), path


def test_context_section_has_a_sparse_row_beside_dense_on_the_same_batch(cpu_run):
    """The quick run's sparse case (context 96 > index_topk 32): the sparse pass, its FP8-cache twin, the reference
    indexer followed by the sparse pass, and dense mla_prefill on the same batch, timed (finite ms), the sparse FLOPs
    counted over the selected pairs, and the sparse output within the float64 tolerance of a sparse attention over the
    same picks."""
    from mla_bridge.bench.cases import sparse_cases
    from mla_bridge.bench.sparse_rows import VARIANTS, indexer_flops
    from mla_bridge.indexer import DEEPSEEK_V32_INDEXER

    (case,) = sparse_cases(True)
    assert case.context > case.index_topk
    rows = {r["path"]: r for r in cpu_run.data["rows"] if r["section"] == "context" and r["case"] == case.name}
    assert set(rows) == {v.label for v in VARIANTS.values()}
    for r in rows.values():
        assert r["status"] == "ok" and math.isfinite(r["ms"]) and r["ms"] > 0 and r["tflops"] > 0, r
        assert r["seq_len"] == case.batch * (case.context + case.new) and r["heads"] == case.heads
    sparse = rows[VARIANTS["sparse"].label]
    extra = sparse["extra"]
    # each of the 2 x 16 new tokens (positions 96..111) sees more than 32 keys: it picks exactly 32
    assert extra["index_topk"] == 32 and extra["selected_pairs"] == case.batch * case.new * 32
    assert sparse["flops"] == 2 * extra["selected_pairs"] * case.heads * (512 + 64 + 512)
    dense = rows[VARIANTS["dense"].label]
    assert dense["flops"] > sparse["flops"] and extra["vs_dense"] == pytest.approx(dense["ms"] / sparse["ms"])
    check = extra["check"]
    assert check["passed"] is True and check["max_abs_err_out"] < 1e-4 and check["max_abs_err_lse"] < 1e-4
    fp8 = rows[VARIANTS["sparse fp8"].label]
    assert 0 < fp8["extra"]["rel_err_vs_unquantized"] < 0.1  # e4m3 rounding, not a wrong cache
    indexed = rows[VARIANTS["indexer"].label]
    q_lens, c_lens = [case.new] * case.batch, [case.context] * case.batch
    assert indexed["flops"] == sparse["flops"] + indexer_flops(q_lens, c_lens, DEEPSEEK_V32_INDEXER)
    assert indexed["extra"]["vs_dense"] == pytest.approx(dense["ms"] / indexed["ms"])
    names = {c["name"]: c for c in cpu_run.data["checks"]}
    mine = names[f"context sparse {case.name}: sparse mla_prefill within the float64 tolerance"]
    assert mine["passed"] is True and mine["applies"] is False  # a GPU target; recorded in quick mode


def test_glm5_rows_beside_the_deepseek_rows(cpu_run):
    """GLM-5's dims (64 heads, q/k 192 + 64, v 256) in the main pass and in the context section, in quick mode too:
    measured, their FLOPs counted with 256 + 256 per pair, and the same targets as the DeepSeek rows recorded."""
    from mla_bridge import MLADims
    from mla_bridge.bench.cases import GLM5, context_cases, main_shapes

    glm = MLADims.preset(GLM5)
    assert (glm.num_heads, glm.head_dim_qk, glm.head_dim_vo, glm.kv_lora_rank) == (64, 256, 256, 512)
    (shape,) = [s for s in main_shapes(True) if s.preset == GLM5]
    (case,) = [c for c in context_cases(True) if c.preset == GLM5]
    rows = cpu_run.data["rows"]
    core = [r for r in rows if r["case"] == shape.name and r["path"] == "mla_bridge RaggedPlan.run"]
    assert len(core) == 1 and core[0]["status"] == "ok" and core[0]["heads"] == 64
    pairs = sum(n * (n + 1) // 2 for n in shape.lens)
    assert core[0]["flops"] == 2 * pairs * 64 * (256 + 256)
    sdpa = [r for r in rows if r["case"] == shape.name and r["path"] == "torch SDPA (dense)"]
    assert len(sdpa) == 1 and sdpa[0]["status"] == "ok"  # equal lengths: dense SDPA runs at 256/256 too
    full = [
        r for r in rows if r["section"] == "context" and r["path"] == "mla_prefill" and r["case"].startswith(case.name)
    ]
    assert len(full) == len(case.budgets) and all(r["status"] == "ok" and r["heads"] == 64 for r in full)
    pairs = case.batch * (case.new * case.context + case.new * (case.new + 1) // 2)
    tokens = case.batch * (case.context + case.new)
    assert full[0]["flops"] == 2 * pairs * 64 * 512 + 2 * tokens * 512 * 64 * (192 + 256)
    assert all("vs_attention_plus_gemm" in r["extra"] for r in full)
    names = {c["name"] for c in cpu_run.data["checks"]}
    assert f"main {shape.name}: mla_bridge / raw FlashInfer throughput" not in names  # no raw wrapper on the CPU
    for label, _ in case.budgets:  # the DeepSeek long cases' targets, at GLM-5's dims
        for path in ("mla_prefill", "mla_prefill, CUDA graph replay"):
            assert f"context {case.name}, {label}: {path} / (attention + GEMM alone)" in names


@pytest.mark.gpu
def test_sparse_rows_on_the_gpu_time_both_paths_and_pass_the_bf16_check():
    """A mid-sized sparse case on the GPU (128 heads, K 2048, 1 x (4096 + 512)): the sparse pass, its FP8-cache twin
    and dense mla_prefill timed; the sparse output within the bf16 tolerance of the float64 sparse attention."""
    from mla_bridge.bench.cases import SparseCase
    from mla_bridge.bench.sparse_rows import VARIANTS, _case_job

    ctx = dataclasses.replace(_ctx(), device=torch.device("cuda"), quick=False, repeats=2, warmup=1)
    case = SparseCase("128h 1x(4096+512), K 2048", 1, 4096, 512, 2048, heads=128)
    rows = {r.path: r for r in _case_job(ctx, case, 0)}
    assert {v.label for v in VARIANTS.values()} == set(rows)
    assert all(r.status == "ok" and r.ms > 0 for r in rows.values()), [r.note for r in rows.values()]
    assert rows[VARIANTS["indexer"].label].extra["vs_dense"] > 0
    sparse = rows[VARIANTS["sparse"].label]
    assert sparse.extra["check"]["passed"] is True and sparse.extra["vs_dense"] > 0
    assert sparse.extra["selected_pairs"] == 512 * 2048 and sparse.heads == 128


def test_plan_section_counts_plans_per_loop(cpu_run):
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "plan"]
    builds = [r for r in rows if r["path"] == "PrefillPlan.build host time"]
    assert sorted(r["case"].split(":")[0] for r in builds) == sorted(["batch 1", "batch 16", "batch 128"] * 2)
    for r in builds:  # the host-time split: the torch backend of the CPU makes no FlashInfer plans
        assert r["extra"]["flashinfer_plans"] == 0 and r["extra"]["flashinfer_plan_ms"] == 0
        assert r["extra"]["own_host_ms"] > 0 and r["extra"]["own_over_flashinfer"] is None
    for path in ("PrefillPlan.build: FlashInfer plan() calls", "PrefillPlan.build: our own host work"):
        assert len([r for r in rows if r["path"] == path]) == 6
    loops = [r for r in rows if "layer loop" in r["path"]]
    assert len(loops) == 3
    for r in loops:
        assert r["extra"]["plans_in_loop"] == 0
        assert r["extra"]["layers_run"] >= 61
        assert r["extra"]["plans_at_build"] == r["extra"]["expected_plans"]  # 0 on the torch backend


def test_checks_are_recorded_but_do_not_apply_on_cpu(cpu_run):
    checks = cpu_run.data["checks"]
    assert checks
    for c in checks:
        assert set(c) == {"name", "value", "target", "op", "passed", "applies", "note"}
        assert c["applies"] is False
    names = " ".join(c["name"] for c in checks)
    for part in ("attention + GEMM alone", "merge 16 heads", "merge 128 heads", "PrefillPlan.build", "61-layer loop"):
        assert part in names


def test_memory_section_skips_without_cuda(cpu_run):
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "memory"]
    assert rows and all(r["status"] == "skipped" and "CUDA" in r["note"] for r in rows)
    assert all(r["extra"]["budget_bytes"]["total"] > 0 for r in rows)


def test_jax_section_uses_compare_rows(cpu_run):
    assert len(cpu_run.calls) == 1
    call = cpu_run.calls[0]
    assert call["iters"] >= 1 and call["cases"]  # quick mode asks for a tiny case
    rows = [r for r in cpu_run.data["rows"] if r["section"] == "jax"]
    assert [r["path"] for r in rows] == [d["impl"] for d in FAKE_JAX_ROWS]
    assert rows[0]["status"] == "ok" and rows[0]["ms"] == 0.5 and rows[0]["fraction"] is not None
    assert rows[0]["extra"]["vs_torch"] == 1.0
    assert rows[1]["status"] == "skipped" and "not implemented" in rows[1]["note"]


def test_plot_png_written(cpu_run):
    data = cpu_run.png.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def _h200_like_rows() -> list:
    """Rows shaped as a full-mode GPU run writes them (paths from the bench's own tables)."""
    from mla_bridge.bench import context as C, main_pass as M

    rows = []
    for i, case in enumerate(("16h 1x10000", "16h 4x10000", "128h 1x10000", "16h mixed 24 (37..9000, 111057 tok)")):
        for j, path in enumerate(v.label for v in M.VARIANTS.values()):
            rows.append(Row("main", case, path, ms=1.0, tflops=700.0 - 50 * j, order=(0, i, j)))
        rows.append(
            Row(
                "main",
                case,
                M.VARIANTS["raw"].label + " x",
                status="skipped",
                note="needs CUDA",
                applies=False,
                order=(0, i, 9),
            )
        )
    names = ("eager", "graph", "handwritten", "fused kv", "fused kv graph", "separate kv", "separate kv graph")
    names += ("gather", "up-projection", "gemm", "attention", "merge")
    for i, case in enumerate(("4x(8000+2000), all context", "4x(8000+2000), 4 chunks", "64x128 new, no context")):
        for j, path in enumerate(map(C.path, names)):
            rows.append(
                Row(
                    "context",
                    case,
                    path,
                    ms=1.0 + j / 10,
                    order=(1, i, j),
                    extra={"vs_attention_plus_gemm": 1.0 + j / 100},
                )
            )
    return rows


def test_plot_panels_are_small_multiples_with_few_series():
    """One panel per question, each with at most 6 series: the main pass (mla_bridge, raw FlashInfer, the peers),
    the layer against attention + GEMM (eager, graphed, with the two GPU targets), each k/v path, the ms against
    the hand-written pipeline. The phases and skipped rows are not series."""
    from mla_bridge.bench.report import _panels

    env = dict(gpu="NVIDIA H200", mode="full")
    panels = _panels(_h200_like_rows(), {"matmul_tflops": 790.0}, env)
    titles = [p["title"] for p in panels]
    assert len(panels) == 4, titles
    assert titles[0].startswith("Main pass") and "attention + GEMM" in titles[1] and "k/v path" in titles[2]
    assert "hand-written" in titles[3]
    assert [len(p["series"]) for p in panels] == [5, 2, 4, 3]
    assert [label for label, _ in panels[0]["series"]][:2] == [
        "mla_bridge (RaggedPlan.run)",
        "raw FlashInfer (wrapper.run)",
    ]
    assert [label for label, _ in panels[1]["series"]] == ["eager", "CUDA graph replay"]
    assert [t for t, _ in panels[1]["targets"]] == [1.12, 1.05]
    assert panels[0]["cases"][0] == "16h 1x10000" and len(panels[0]["cases"]) == 4
    # a CPU or quick run draws no GPU target
    assert not _panels(_h200_like_rows(), {}, dict(gpu=None, mode="quick"))[1]["targets"]
    # without the hand-written pipeline (it needs CUDA) the panel's title does not promise the comparison
    from mla_bridge.bench import context

    rows = [r for r in _h200_like_rows() if r.path != context.path("handwritten")]
    title = _panels(rows, {}, dict(gpu=None, mode="quick"))[3]["title"]
    assert "against" not in title and "needs CUDA" in title, title


def test_plot_draws_the_time_to_first_token_section():
    """A bench of the ttft section alone drew "no measured rows": its model rows carry ms, not TFLOP/s. They get a
    panel of ms per forward by case, one series per framework and attention, the no-op and the layer-alone rows
    left out."""
    from mla_bridge.bench.report import _panels

    paths = (
        "transformers sdpa",
        "transformers mla_bridge",
        "transformers, attention a no-op",
        "attention alone x layers: mla_bridge_attention",
        "JAX model, jax.nn.dot_product_attention cuDNN",
        "JAX model, mla_bridge_jax",
    )
    rows = [
        Row("ttft", case, path, ms=10.0 * (i + 1) + j, order=(6, i, j))
        for i, case in enumerate(("1 x 10000", "4 x (8000 cached + 2000 new)"))
        for j, path in enumerate(paths)
    ]
    xla = "JAX model, jax.nn.dot_product_attention XLA"
    rows += [
        Row("ttft", "1 x 10000", xla, ms=40.0, order=(6, 0, 9)),
        Row("ttft", "4 x (8000 cached + 2000 new)", xla, status="skipped", order=(6, 1, 9),
            note="failed: JaxRuntimeError: RESOURCE_EXHAUSTED: Failed to get configs", error="JaxRuntimeError"),
    ]  # fmt: skip
    (panel,) = _panels(rows, {}, dict(gpu="NVIDIA H100", mode="full"))
    assert panel["title"].startswith("Time to first token") and panel["xlabel"] == "ms per forward"
    assert panel["cases"] == ["1 x 10000", "4 x (8000 cached + 2000 new)"]
    assert panel["series"] == [
        ("transformers, sdpa", [10.0, 20.0]),
        ("transformers, mla_bridge", [11.0, 21.0]),
        ("JAX, cuDNN", [14.0, 24.0]),
        ("JAX, XLA", [40.0, None]),
        ("JAX, mla_bridge_jax", [15.0, 25.0]),
    ]
    # the path that ran out of memory is said so where its bar would be, not left as a bar never drawn
    assert panel["gaps"] == {("4 x (8000 cached + 2000 new)", "JAX, XLA"): "out of memory"}
    import matplotlib.pyplot as plt

    from mla_bridge.bench.report import plot_figure

    fig = plot_figure(rows, {}, dict(gpu="NVIDIA H100", mode="full"))
    try:
        texts = [t.get_text() for t in fig.axes[0].texts]  # the bars' value labels and the gap's reason
        assert [t for t in texts if not t.replace(".", "").isdigit()] == ["JAX, XLA: out of memory"], texts
    finally:
        plt.close(fig)


def test_plot_legends_sit_outside_the_axes_and_the_title_names_machine_date_versions():
    import matplotlib.pyplot as plt

    from mla_bridge.bench.report import plot_figure

    env = dict(
        gpu="NVIDIA H200",
        gpu_capability="9.0",
        mode="full",
        dtype="bfloat16",
        date="2026-12-04T12:34:56+00:00",
        mla_bridge="0.1.0",
        torch="2.11.0+cu130",
        cuda="13.0",
        flashinfer="0.7.4",
        driver="580.159.04",
    )
    fig = plot_figure(_h200_like_rows(), {"matmul_tflops": 790.0}, env)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        axes = [ax for ax in fig.axes if ax.get_legend() is not None]
        assert len(axes) == 4
        for ax in axes:
            box, legend = ax.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
            assert legend.x0 >= box.x1, (ax.get_title(), legend, box)
            assert len(ax.get_legend().get_texts()) <= 8
            labels = [t.get_text() for t in ax.get_yticklabels()]
            assert labels and all(labels)
        title = fig._suptitle.get_text()
        for part in (
            "NVIDIA H200",
            "2026-12-04 12:34 UTC",
            "torch 2.11.0+cu130",
            "CUDA 13.0",
            "FlashInfer 0.7.4",
            "mla_bridge 0.1.0",
            "bfloat16",
        ):
            assert part in title, part
    finally:
        plt.close(fig)


def test_plot_is_drawn_again_from_a_json(cpu_run, tmp_path):
    from mla_bridge.bench.report import main as report_main, rows_from_payload

    rows = rows_from_payload(cpu_run.data)
    assert len(rows) == len(cpu_run.data["rows"]) and rows[0].section == cpu_run.data["rows"][0]["section"]
    out = tmp_path / "again.png"
    assert report_main([str(cpu_run.png.with_suffix(".json")), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report_main([]) == 2


@pytest.mark.slow
def test_flex_attention_row_on_cpu(tmp_path):
    path = tmp_path / "b.json"
    assert (
        run(
            _parse(["--device", "cpu", "--sections", "main", "--skip", "sdpa,torch", "--json", str(path)]),
            console=_quiet_console(),
        )
        == 0
    )
    rows = [r for r in json.loads(path.read_text())["rows"] if r["path"] == "flex_attention (doc-causal)"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 1 and "mixed" in ok[0]["case"] and ok[0]["tflops"] > 0  # the ragged shape; others noted
    assert all("ragged shape only" in r["note"] for r in rows if r["status"] != "ok")


def test_sections_flag_picks_sections(tmp_path):
    path = tmp_path / "b.json"
    rc = run(
        _parse(["--device", "cpu", "--sections", "merge,4", "--layers", "2", "--json", str(path)]),
        console=_quiet_console(),
    )
    assert rc == 0
    d = json.loads(path.read_text())
    assert d["sections"] == ["merge", "plan"]
    assert {r["section"] for r in d["rows"]} == {"peak", "merge", "plan"}


def test_missing_jax_adapter_skips_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mla_bridge_jax", None)  # import raises ImportError
    path = tmp_path / "b.json"
    assert run(_parse(["--device", "cpu", "--sections", "jax", "--json", str(path)]), console=_quiet_console()) == 0
    rows = [r for r in json.loads(path.read_text())["rows"] if r["section"] == "jax"]
    assert len(rows) == 1 and rows[0]["status"] == "skipped"
    assert "not importable" in rows[0]["note"] and rows[0]["error"]


@pytest.mark.parametrize("argv", [["--sections", "nope"], ["--skip", "everything"], ["--repeats", "-1"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)


def test_cuda_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run(_parse(["--device", "cuda"]), console=_quiet_console()) == 2


def test_a_failing_path_becomes_a_skipped_row_and_the_others_are_timed():
    ctx = _ctx()
    calls = {"good": 0}

    def good():
        calls["good"] += 1

    def bad():
        raise RuntimeError("kernel failed to launch")

    rows = ctx.measure_many(
        "main",
        "case",
        [("good", good, dict(flops=1e9, note="n")), ("bad", bad, dict(flops=1e9, note="n", heads=4))],
        repeats=3,
        warmup=1,
    )
    assert [r.path for r in rows] == ["good", "bad"]
    assert rows[0].status == "ok" and rows[0].repeats == 3 and rows[0].tflops > 0 and calls["good"] == 4
    assert rows[1].status == "skipped" and "kernel failed to launch" in rows[1].error and rows[1].heads == 4
    assert rows[1].note.startswith("failed: RuntimeError")


@pytest.mark.parametrize("q_len,kv_len", [(0, 5), (5, 0), (1, 1), (7, 7), (3, 10), (10, 3), (64, 200), (200, 64)])
def test_causal_pairs_exact(q_len, kv_len):
    brute = sum(1 for i in range(q_len) for j in range(kv_len) if j <= i + kv_len - q_len)
    assert causal_pairs(q_len, kv_len) == brute


def test_attention_flops_counts_each_request():
    assert attention_flops([10000], [10000], causal=True, heads=16) == 2 * (10000 * 10001 // 2) * 16 * 320
    assert attention_flops([2, 3], [5, 7], causal=False, heads=1) == 2 * (10 + 21) * 320


# ---------------------------------------------------------------------------------------------------------------
# The comparison rows compute what mla_prefill computes (a stand-in FlashInfer made of the torch reference).
# ---------------------------------------------------------------------------------------------------------------

LOG2E = 1.0 / math.log(2.0)


class _FakeWrapper:
    def __init__(self, float_ws, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD"
        self.backend = backend

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo=None,
        causal=False,
        sm_scale=None,
        q_data_type=None,
        kv_data_type=None,
        o_data_type=None,
    ):
        assert qo_indptr.device.type == "cpu" and qo_indptr.dtype == torch.int32
        self.qo, self.kv = qo_indptr.tolist(), kv_indptr.tolist()
        self.causal, self.sm_scale = causal, sm_scale
        self.head_dims = (head_dim_qk, head_dim_qk if head_dim_vo is None else head_dim_vo)

    def run(self, q, k, v, return_lse=False):
        # FlashInfer's kernels are compiled for the planned head dims: another q / v width is an error there
        assert (q.shape[-1], v.shape[-1]) == self.head_dims, ((q.shape[-1], v.shape[-1]), self.head_dims)
        out, lse = ragged_attention_reference(q, k, v, self.qo, self.kv, causal=self.causal, sm_scale=self.sm_scale)
        return (out, lse * LOG2E) if return_lse else out  # FlashInfer's default: base-2 lse


def _fake_merge_state(v_a, s_a, v_b, s_b):
    for x in (v_a, s_a, v_b, s_b):
        assert x.is_contiguous()
    s = torch.logaddexp2(s_a, s_b)
    return v_a * torch.exp2(s_a - s).unsqueeze(-1) + v_b * torch.exp2(s_b - s).unsqueeze(-1), s


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithRaggedKVCacheWrapper = _FakeWrapper
    fi.merge_state = _fake_merge_state
    utils = types.ModuleType("flashinfer.utils")
    utils.is_sm90a_supported = lambda device: False
    fi.utils = utils
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.utils", utils)
    return fi


@pytest.mark.parametrize("model", ["deepseek", "glm-5"])
@pytest.mark.parametrize("budget_index", [0, 1])
def test_handwritten_pipeline_matches_mla_prefill(fake_flashinfer, budget_index, model):
    from mla_bridge.bench.cases import context_cases
    from mla_bridge.bench.context import handwritten_backend, handwritten_pipeline, make_inputs

    ctx = _ctx()
    case = next(c for c in context_cases(True) if (c.preset or "deepseek") == model)
    label, budget = case.budgets[budget_index]
    x = make_inputs(ctx, case, 0)
    assert handwritten_backend(ctx) == "fa2"  # not SM90
    layer = handwritten_pipeline(ctx, x, budget)
    plan = PrefillPlan.build(
        x.q_lens,
        x.c_lens,
        dims=x.dims,
        workspace=Workspace("cpu", chunk_tokens=budget),
        block_size=case.block_size,
        dtype=ctx.dtype,
    )
    want = mla_prefill(x.q, x.kv_c, x.k_pe, x.w, x.kv_cache, x.block_table, plan)
    torch.testing.assert_close(layer(), want, atol=2e-5, rtol=2e-5)


def test_raw_wrapper_is_planned_with_the_shapes_head_dims(fake_flashinfer):
    """beside_raw plans the raw FlashInfer wrapper with the plan's head dims (GLM-5's 256/256, not DeepSeek's
    192/128): the stand-in wrapper refuses q / v of another width, as FlashInfer's compiled kernels do."""
    from mla_bridge.bench import main_pass
    from mla_bridge.bench.cases import GLM5, main_shapes
    from mla_bridge.bench.common import Case, beside_raw

    ctx = _ctx()
    (shape,) = [s for s in main_shapes(True) if s.preset == GLM5]
    plan = main_pass._plan(ctx, shape, "torch")
    fake = types.SimpleNamespace(
        backend=types.SimpleNamespace(name="flashinfer-fa2", flashinfer_backend="fa2"), spec=plan.spec, run=plan.run
    )
    q, k, v = main_pass._tensors(ctx, shape, 0)
    c = Case(ctx, "main", shape.name, main_pass.VARIANTS, 0, dict(seq_len=shape.tokens, heads=shape.heads))
    core, raw = beside_raw(c, "core", "raw", fake, q, k, v, flops=1.0)
    assert raw.status == "ok", raw.note
    assert core.status == "ok" and core.extra["vs_raw"] > 0
    assert ctx.raw_wrapper("fa2", 0).head_dims == (256, 256)


@pytest.mark.parametrize("budget_index", [0, 1])
def test_phases_alone_are_the_phases_mla_prefill_reports(budget_index):
    """The bench times mla_prefill's phases alone through its own phase_hook (no copy of the pipeline): every phase
    the layer reports gets a timing of each timed layer, and the layer's result is mla_prefill's."""
    from mla_bridge.bench.cases import context_cases
    from mla_bridge.bench.context import make_inputs

    ctx = _ctx()
    case = context_cases(True)[1]
    _, budget = case.budgets[budget_index]
    x = make_inputs(ctx, case, 1)
    plan = PrefillPlan.build(
        x.q_lens,
        x.c_lens,
        dims=x.dims,
        workspace=Workspace("cpu", chunk_tokens=budget),
        block_size=case.block_size,
        dtype=ctx.dtype,
    )
    want = mla_prefill(x.q, x.kv_c, x.k_pe, x.w, x.kv_cache, x.block_table, plan)
    seen, outs = [], []

    def layer(hook):
        def spy(name):
            seen.append(name)
            hook(name)

        outs.append(mla_prefill(x.q, x.kv_c, x.k_pe, x.wp, x.kv_cache, x.block_table, plan, phase_hook=spy))

    times = ctx.phases_alone(layer)
    reported = [n for n in dict.fromkeys(seen) if n != "end"]
    assert list(times) == reported
    assert {"gather", "up-projection", "main pass"} <= set(times)
    assert ("merge" in times) == (not plan.fused) and plan.fused == (budget_index == 0)
    for t in times.values():
        assert t.repeats == ctx.repeats and len(t.samples) == ctx.repeats and t.ms >= 0
    torch.testing.assert_close(outs[-1], want, atol=1e-5, rtol=1e-5)


def test_backend_auto_is_accepted_like_prefill(tmp_path):
    """`mla-bridge prefill --backend auto` worked but `bench --backend auto` was an argparse error."""
    import json

    from mla_bridge.bench import main as bench_main

    path = tmp_path / "b.json"
    assert bench_main(["--quick", "--sections", "merge", "--backend", "auto", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["complete"] is True


def test_a_gpu_sample_is_never_less_than_the_host_time_of_its_call():
    """On a GPU a call's events can fire late when the GPU still runs work queued before it, covering only part of the
    call's host time (a host-bound path then looks faster than any loop of it runs): each sample is the larger of the
    events' time and the host time, the events' own kept apart."""
    from mla_bridge.bench.common import _event_samples

    class Start:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return self.ms

    events = [(Start(1.45), None), (Start(0.8), None), (Start(2.0), None)]
    samples, gpu = _event_samples(events, [2.78, 0.05, 1.0])
    assert gpu == [1.45, 0.8, 2.0]
    assert samples == [2.78, 0.8, 2.0]


def test_interleaved_rounds_rotate_so_every_path_takes_every_place():
    from mla_bridge.bench.common import _rotated

    rounds = [_rotated([4, 7, 9], rep) for rep in range(6)]
    assert rounds[:3] == [[4, 7, 9], [7, 9, 4], [9, 4, 7]] and rounds[3:] == rounds[:3]
    for place in range(3):
        assert sorted(r[place] for r in rounds[:3]) == [4, 7, 9]
    assert _rotated([], 3) == []


def _median_gap(a: dict, b: dict) -> float:
    """The median over rounds of two JSON rows' per-round difference (ms), written out here apart from the bench's
    helper."""
    diffs = sorted(x - y for x, y in zip(a["extra"]["ms_samples"], b["extra"]["ms_samples"]))
    n = len(diffs)
    return diffs[n // 2] if n % 2 else (diffs[n // 2 - 1] + diffs[n // 2]) / 2


def test_paired_gap_pairs_samples_by_round():
    """Two paths timed in the same rounds: their difference is the median of the per-round differences, which drift
    shared by a round cancels from, not the difference of the two medians (here 1.0 against 0.5)."""
    from mla_bridge.bench.common import Row, paired_gap

    a = Row("s", "c", "a", ms=20.0, extra={"ms_samples": [10.0, 20.0, 30.0]})
    b = Row("s", "c", "b", ms=19.5, extra={"ms_samples": [9.0, 19.5, 28.0]})
    assert paired_gap(a, b) == pytest.approx(1.0)
    assert paired_gap(b, a) == pytest.approx(-1.0)
    assert paired_gap(a, None) is None
    assert paired_gap(a, Row("s", "c", "b", status="skipped", note="out of memory")) is None
    assert paired_gap(a, Row("s", "c", "b", ms=1.0, extra={"ms_samples": [1.0, 2.0]})) is None  # other rounds


def test_attention_note_says_a_negative_difference_is_noise():
    """On a busy CPU a forward with attention timed faster than the no-op forward: the note read "attention -2.11 ms,
    -7% of the TTFT"; it says the difference is within the timing noise."""
    from mla_bridge.bench.common import attention_note

    assert attention_note(30.0, 22.5) == "attention 7.50 ms, 25% of the TTFT"
    assert attention_note(31.11, 33.22) == "attention within the timing noise (forward - no-op = -2.11 ms)"


def test_ttft_section_quick_on_the_cpu(tmp_path):
    """``--sections ttft`` on the CPU: every case has the transformers model timed with sdpa, mla_bridge and a no-op
    attention, attention alone per path, the ratio and attention's share on the rows, and a JAX row per case
    (measured, or skipped with its reason); the JSON is written."""
    from mla_bridge.bench.ttft import ttft_cases

    path = tmp_path / "ttft.json"
    assert (
        run(
            _parse(["--device", "cpu", "--sections", "ttft", "--repeats", "3", "--warmup", "0", "--json", str(path)]),
            console=_quiet_console(),
        )
        == 0
    )
    d = json.loads(path.read_text())
    assert d["sections"] == ["ttft"] and d["complete"] is True
    rows = [r for r in d["rows"] if r["section"] == "ttft"]
    for case in ttft_cases(quick=True):
        mine = {r["path"]: r for r in rows if r["case"] == case.name}
        for p in (
            "transformers sdpa",
            "transformers mla_bridge",
            "transformers, attention a no-op",
            "attention alone x layers: transformers sdpa_attention_forward",
            "attention alone x layers: mla_bridge_attention",
            "attention alone x layers: kernel calls only",
        ):
            assert mine[p]["status"] == "ok" and mine[p]["ms"] > 0, (case, p, mine.get(p))
            # a time to first token is a latency from an idle device: a forward that reads its mask on the host
            # must not be charged the overlapped timer's spin
            assert mine[p]["extra"]["timing"] == "latency", (case, p)
        ours = mine["transformers mla_bridge"]
        # kept = (sdpa - mla_bridge) / (sdpa alone - kernel calls alone), each difference paired by round
        saved = _median_gap(mine["transformers sdpa"], ours)
        win = _median_gap(
            mine["attention alone x layers: transformers sdpa_attention_forward"],
            mine["attention alone x layers: kernel calls only"],
        )
        want = saved / win if win > 0 else None
        assert ours["extra"]["kept_of_kernel_win"] == (pytest.approx(want) if want is not None else None)
        assert ours["extra"]["ratio_sdpa_over_mla_bridge"] == pytest.approx(
            mine["transformers sdpa"]["ms"] / ours["ms"]
        )
        assert ours["extra"]["attention_ms"] == pytest.approx(
            ours["ms"] - mine["transformers, attention a no-op"]["ms"]
        )
        jax_rows = [r for p, r in mine.items() if "JAX" in p]
        assert jax_rows and all(r["status"] == "ok" or r["note"] for r in jax_rows)
        alone = mine.get("JAX attention alone x layers: mla_bridge_jax")
        if mine.get("JAX model, mla_bridge_jax", {}).get("status") == "ok":  # JAX runs here: its attention is timed
            assert alone["status"] == "ok" and alone["ms"] > 0 and alone["extra"]["timing"] == "latency", alone
            assert "attention_ms" not in alone["extra"]  # a share of the model's time only on model rows


def test_bench_sits_on_top_of_the_import_graph():
    """The core never imports the bench, the CLI or an adapter; the bench never imports the CLI, and imports JAX and
    mla_bridge_jax only when its jax section runs."""
    import subprocess

    code = (
        "import sys, mla_bridge, mla_bridge.prefill, mla_bridge.profiling\n"
        "bad = [m for m in sys.modules if m.startswith(('mla_bridge.bench', 'mla_bridge.cli', 'mla_bridge_'))]\n"
        "assert not bad, bad\n"
        "import mla_bridge.bench, mla_bridge.bench.context, mla_bridge.bench.jax_rows\n"
        "bad = [m for m in sys.modules if m.startswith(('mla_bridge.cli', 'mla_bridge_', 'jax'))]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_handwritten_pipeline_merges_in_torch_where_merge_state_cannot_launch():
    """FlashInfer's merge_state puts every head of a row in one block of head_dim / vec threads each: at GLM-5's
    dims (64 heads of 256, bf16) that is 2048 threads and its launch fails, which left the bench's GLM-5 context rows
    without their hand-written baseline. There the pipeline merges with torch ops, equal to the LSE formula."""
    from mla_bridge.bench.context import _torch_merge, merge_state_threads

    assert merge_state_threads(16, 128, 2) == 256
    assert merge_state_threads(64, 128, 2) == 1024  # the largest that launches at DeepSeek's v_head_dim
    assert merge_state_threads(128, 128, 2) == 2048 and merge_state_threads(64, 256, 2) == 2048
    g = torch.Generator().manual_seed(0)
    o_a, o_b = (torch.randn(5, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    s_a, s_b = (torch.randn(5, 3, generator=g, dtype=torch.float64) * 4 for _ in range(2))
    s_b[0, 0] = float("-inf")  # an empty partial weighs nothing
    out, lse = _torch_merge(o_a, s_a, o_b, s_b)
    want_lse = torch.log2(torch.exp2(s_a) + torch.exp2(s_b))
    w_a = torch.exp2(s_a - want_lse)[..., None]
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(out, o_a * w_a + o_b * (1 - w_a))
    torch.testing.assert_close(out[0, 0], o_a[0, 0])


def test_ttft_alone_rows_run_on_the_tensors_the_model_hands_its_attention():
    """The alone rows time the attention on what transformers hands its first layer, as it hands it: q/k/v of
    [B, H, L, D] shapes and the mask of the case (none without a cache; bottom-right causal over the prefix with
    one), whatever layout the installed transformers builds them in."""
    pytest.importorskip("transformers")
    from mla_bridge.bench import ttft

    model = ttft.build_transformers_model(_ctx(), quick=True)
    heads = model.config.num_attention_heads
    ids = torch.randint(3, model.config.vocab_size, (2, 8))
    model.config._attn_implementation = "eager"
    q, k, v, mask = ttft._model_attention_inputs(model, ids, None)
    assert model.config._attn_implementation == "eager"  # the probe leaves the model as it found it
    assert q.shape == (2, heads, 8, 192) and k.shape == (2, heads, 8, 192) and v.shape == (2, heads, 8, 128)
    assert mask is None or bool(mask.all().logical_not())  # transformers' causal mask, if it builds one
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(3, model.config.vocab_size, (2, 24)), past_key_values=cache)
    prefix = [(layer.keys, layer.values) for layer in cache.layers]
    q, k, v, mask = ttft._model_attention_inputs(model, ids, prefix)
    assert q.shape == (2, heads, 8, 192) and k.shape == (2, heads, 32, 192) and v.shape == (2, heads, 32, 128)
    want = torch.ones(8, 32, dtype=torch.bool).tril(24)
    assert mask is not None and torch.equal(mask[0, 0], want) and torch.equal(mask[1, 0], want)
    assert not ttft._PROBED  # nothing kept past the probe


def test_a_path_skipped_on_purpose_is_not_drawn_as_failed():
    """Where a tried path has no bar the plot says why: "failed" for one that raised (its row carries the error),
    "out of memory" for one that ran out; a path the bench does not run on purpose (dense SDPA on a ragged batch,
    flex_attention on one shape) is left blank: a newcomer's CPU plot read "failed" on every case."""
    from mla_bridge.bench import main_pass
    from mla_bridge.bench.report import _panels

    core, _, sdpa, flex, _ = (v.label for v in main_pass.VARIANTS.values())
    rows = [
        Row("main", "16h 1x128", core, tflops=1.0, order=(1, 0, 0)),
        Row("main", "16h 1x128", sdpa, tflops=2.0, order=(1, 0, 2)),
        Row("main", "16h 1x128", flex, status="skipped", note="run on the ragged shape only", order=(1, 0, 3)),
        Row("main", "16h mixed", core, tflops=1.0, order=(1, 1, 0)),
        Row("main", "16h mixed", sdpa, status="skipped", note="ragged batch: dense SDPA needs equal lengths",
            order=(1, 1, 2)),
        Row("main", "16h mixed", flex, status="skipped", note="failed: RuntimeError: boom", error="RuntimeError: boom",
            order=(1, 1, 3)),
        Row("main", "16h mixed 2", flex, tflops=0.5, order=(1, 2, 3)),
    ]  # fmt: skip
    (panel,) = _panels(rows, {}, dict(gpu=None, mode="quick"))
    assert panel["gaps"] == {("16h mixed", "flex_attention (document mask)"): "failed"}


def test_a_throughput_panel_leaves_out_a_case_too_small_to_see():
    """The JAX panel drew a 16-token case (the per-call overhead, 0.001-0.02 TFLOP/s) beside cases at 650: its bars
    were invisible and only their labels showed. A case whose every bar is under 1% of the panel's largest is left
    out of the throughput panels (its time stays in the table)."""
    from mla_bridge.bench.report import _panels

    rows = [
        Row("jax", case, path, tflops=t, order=(5, i, j))
        for i, (case, ts) in enumerate((("causal 1x10000", (689.0, 662.0)), ("tiny 1x16", (0.02, 0.004))))
        for j, (path, t) in enumerate(zip(("torch core (RaggedPlan.run)", "jax jit (tvm_ffi)"), ts))
    ]
    (panel,) = _panels(rows, {}, dict(gpu="NVIDIA H200", mode="full"))
    assert panel["cases"] == ["causal 1x10000"] and panel["series"][0] == ("torch core (RaggedPlan.run)", [689.0])


def test_latency_calls_rest_untimed_before_each_timed_call():
    """measure_many(latency=True, rest_s=...) leaves the device idle rest_s before every timed call (a GPU at its
    power cap clocks down after a power-hungry call: the ttft section rests so that a call's time does not depend on
    the one before it), and the rest is not in the call's time."""
    ctx = _ctx()
    starts: list = []

    def call():
        starts.append(time.perf_counter())

    rows = ctx.measure_many(
        "ttft", "case", [("a", call, {}), ("b", call, {})], repeats=3, warmup=1, latency=True, rest_s=0.05
    )
    timed = starts[2:]  # after one warm-up call each
    assert len(timed) == 6
    assert min(b - a for a, b in zip(timed, timed[1:])) >= 0.05
    assert all(r.status == "ok" and r.ms < 50 and r.extra["rest_s"] == 0.05 for r in rows)
    rows = ctx.measure_many("ttft", "case", [("a", call, {}), ("b", call, {})], repeats=3, warmup=1, latency=True)
    assert "rest_s" not in rows[0].extra and rows[0].extra["timing"] == "latency"


def test_rows_timed_apart_after_a_failed_round_are_not_paired():
    """When a path fails during the timed rounds, the others are timed again each on its own: their samples no
    longer share rounds, so their round-paired difference (the ttft section's "kept") is not reported as one."""
    from mla_bridge.bench.common import paired_gap

    ctx = _ctx()
    calls = {"c": 0}

    def fails_in_round_two() -> None:
        calls["c"] += 1
        if calls["c"] == 3:  # one warm-up call, then the timed rounds
            raise RuntimeError("out of memory")

    items = [("a", lambda: None, {}), ("b", lambda: None, {}), ("c", fails_in_round_two, {})]
    rows = {r.path: r for r in ctx.measure_many("ttft", "case", items, repeats=4, warmup=1, latency=True)}
    assert rows["a"].status == "ok" and rows["b"].status == "ok" and calls["c"] >= 3
    assert len(rows["a"].extra["ms_samples"]) == len(rows["b"].extra["ms_samples"]) == 4
    assert paired_gap(rows["a"], rows["b"]) is None
    together = {r.path: r for r in ctx.measure_many("ttft", "case", items[:2], repeats=4, warmup=1, latency=True)}
    assert paired_gap(together["a"], together["b"]) is not None


def test_default_budget_leaves_the_ttft_section_its_time():
    """The ttft section's rows are not optional, but its jobs stop once the budget is spent: on a GPU in full mode
    its time (each forward after a rest of the GPU) is added to the default budget, or its last case's JAX rows were
    skipped."""
    from mla_bridge.bench import DEFAULT_BUDGET_S, default_budget_s
    from mla_bridge.bench.ttft import MAX_REPEATS, REST_S, ttft_cases

    assert default_budget_s(["main", "context"], cuda=True, quick=False) == DEFAULT_BUDGET_S
    with_ttft = default_budget_s(["main", "ttft"], cuda=True, quick=False)
    rests = len(ttft_cases(False)) * 12 * MAX_REPEATS * REST_S  # 12 timed paths a case, each after a rest
    assert with_ttft is not None and with_ttft - DEFAULT_BUDGET_S > rests
    assert default_budget_s(["ttft"], cuda=False, quick=True) is None
    assert default_budget_s(["ttft"], cuda=True, quick=True) is None
