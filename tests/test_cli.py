"""The ``mla-bridge`` command, in process on the CPU (``--device cpu`` everywhere, also on a GPU machine): prefill (JSON fields, error against the float64 reference,
schedules, checkpoints), info, bench wiring, bad arguments; and mla_bridge.reference against the suite's own
float64 reference."""

from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest
import torch

from mla_bridge import MLADims
from mla_bridge.cli import CLIError, load_kv_b_proj_weight, main
from mla_bridge.reference import reference_request

PREFILL_FIELDS = {
    "model",
    "dims",
    "weight",
    "device",
    "device_name",
    "dtype",
    "backend",
    "backend_reason",
    "passed_over",
    "query_lens",
    "context_lens",
    "block_size",
    "chunk_tokens",
    "schedule",
    "num_chunks",
    "num_merges",
    "num_plans",
    "layers",
    "timing_method",
    "timings_ms",
    "flops",
    "tflops",
    "peak_extra_memory_bytes",
    "check",
    "seed",
    "kernels",
}


def run_json(tmp_path, *argv):
    path = tmp_path / "out.json"
    rc = main(["prefill", "--device", "cpu", *argv, "--json", str(path)])
    return rc, json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("fuse", [True, False])
def test_prefill_counts_only_the_context_its_passes_read(tmp_path, capsys, fuse):
    """A request without new tokens beside one of 1 new token: its 6000 cached tokens are not read (fused) or sit in
    chunks that are skipped (chunked), so they are no up-projection FLOPs. Before, they were counted (251 GFLOP for
    60000 such tokens, an impossible TFLOP/s, and the count skipped the warm-up layer), and the fused schedule
    gathered them."""
    rc, res = run_json(
        tmp_path,
        "--prompt-lens",
        "1,0",
        "--context-lens",
        "0,6000",
        "--chunk-tokens",
        "4096",
        "--layers",
        "1",
        *([] if fuse else ["--no-fuse"]),
    )
    assert rc == 0 and res["check"]["passed"] is True
    assert res["flops"]["up_projection"] == 2 * 1 * 512 * 16 * 256  # the new token alone
    # nothing to fuse or chunk: the only context is unattended (the JSON says what the table says)
    assert res["schedule"] == "main-only" and res["num_chunks"] == 0 and res["num_skipped_chunks"] == 2
    text = " ".join(capsys.readouterr().out.split())
    assert "main pass only (no request with cached context has new tokens" in text


def test_prefill_json_fields_and_error(tmp_path, capsys):
    rc, res = run_json(
        tmp_path,
        "--prompt-lens",
        "5,9,1",
        "--context-lens",
        "0,70,3",
        "--block-size",
        "16",
        "--layers",
        "2",
        "--check-requests",
        "3",
    )
    assert rc == 0
    assert PREFILL_FIELDS <= set(res)
    assert res["device"] == "cpu" and res["dtype"] == "float32" and res["backend"] == "torch"
    assert [name for name, _ in res["passed_over"]] == ["flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2"]
    assert res["query_lens"] == [5, 9, 1] and res["context_lens"] == [0, 70, 3]
    assert res["schedule"] == "fused" and res["num_chunks"] == 0 and res["num_plans"] == 1
    assert res["layers"] == 2 and len(res["timings_ms"]["per_layer"]) == 2
    assert all(t > 0 for t in res["timings_ms"]["per_layer"])
    assert set(res["timings_ms"]["phases"]) == {"gather + up-projection", "main pass"}
    assert res["peak_extra_memory_bytes"] is None  # n/a on the CPU
    # FLOPs: causal pairs counted exactly per request, plus the up-projection GEMM.
    pairs = 5 * 6 // 2 + (9 * 70 + 9 * 10 // 2) + (1 * 3 + 1)
    assert res["flops"]["attention"] == 2 * pairs * 16 * (192 + 128)
    assert res["flops"]["up_projection"] == 2 * (15 + 73) * 512 * 16 * 256
    assert res["tflops"] > 0
    check = res["check"]
    assert [c["request"] for c in check["requests"]] == [0, 1, 2]
    assert check["passed"] is True
    assert check["max_abs_err_out"] < 1e-4 and check["max_abs_err_lse"] < 1e-4
    text = capsys.readouterr().out
    for words in (
        "backend",
        "torch",
        "passed over",
        "schedule",
        "time per layer",
        "TFLOP/s",
        "max abs error out",
        "PASS",
        "n/a on CPU",
    ):
        assert words in text, words
    # the verdict heads the check (it covers out and lse both), not the last error row alone
    (check_line,) = [line for line in text.splitlines() if line.startswith("│ check")]
    assert "PASS" in check_line and not any("PASS" in line for line in text.splitlines() if "max abs error" in line)


def test_prefill_chunked_schedule_merges(tmp_path):
    rc, res = run_json(
        tmp_path,
        "--prompt-lens",
        "4,6",
        "--context-lens",
        "50,23",
        "--block-size",
        "8",
        "--chunk-tokens",
        "32",
        "--check-requests",
        "2",
    )
    assert rc == 0
    assert res["schedule"] == "chunked" and res["num_chunks"] == 3  # 73 context tokens in chunks of <= 32
    assert res["num_merges"] == 3  # every chunk shares a request's rows with the one before: a round each
    assert res["num_plans"] == 4
    assert {"main pass", "context chunks", "merge"} <= set(res["timings_ms"]["phases"])
    assert res["check"]["passed"] and res["check"]["max_abs_err_out"] < 1e-4 and res["check"]["max_abs_err_lse"] < 1e-4


def test_prefill_no_fuse_and_no_context(tmp_path):
    rc, res = run_json(tmp_path, "--prompt-lens", "3,5", "--context-lens", "16", "--block-size", "4", "--no-fuse")
    assert rc == 0 and res["schedule"] == "chunked" and res["num_chunks"] == 1 and res["check"]["passed"]
    rc, res = run_json(tmp_path, "--batch", "2", "--prompt-len", "7", "--no-breakdown")
    assert rc == 0
    assert res["context_lens"] == [0, 0] and res["schedule"] == "main-only"
    assert res["timings_ms"]["phases"] is None and res["check"]["max_abs_err_out"] < 1e-4


def test_prefill_bfloat16_on_cpu(tmp_path):
    rc, res = run_json(
        tmp_path,
        "--prompt-lens",
        "6",
        "--context-lens",
        "10",
        "--block-size",
        "4",
        "--dtype",
        "bfloat16",
        "--check-requests",
        "1",
    )
    assert rc == 0 and res["dtype"] == "bfloat16"
    assert res["check"]["max_abs_err_out"] < 2e-2 and res["check"]["max_abs_err_lse"] < 1e-2


def test_prefill_bfloat16_error_does_not_grow_with_the_chunk_count(tmp_path):
    """bf16, one request of 16 new + 512 cached tokens at 4-token chunks (128 merges of the same rows): the error
    stays within 1.5x the fused schedule's (or 2**-8 x max |ref|), and the check passes. Before, each merge rounded
    the running out to bf16: 3e-2 against 4.8e-3 fused (at 2-token chunks 9.1e-2, and the check failed, exit 1)."""
    common = (
        "--dtype",
        "bfloat16",
        "--prompt-lens",
        "16",
        "--context-lens",
        "512",
        "--check-requests",
        "1",
        "--no-breakdown",
    )
    rc, fused = run_json(tmp_path, *common)
    assert rc == 0 and fused["schedule"] == "fused"
    rc, res = run_json(tmp_path, *common, "--no-fuse", "--chunk-tokens", "4")
    assert res["num_chunks"] == 128 and res["num_merges"] == 128
    err, ref_max = res["check"]["max_abs_err_out"], res["check"]["requests"][0]["max_abs_ref_out"]
    assert err <= max(1.5 * fused["check"]["max_abs_err_out"], 2.0**-8 * ref_max), (err, fused["check"])
    assert rc == 0 and res["check"]["passed"] is True


def test_prefill_check_catches_a_wrong_result(tmp_path, monkeypatch, capsys):
    import mla_bridge

    real = mla_bridge.mla_prefill

    def off_by_a_bit(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out + 1e-2, lse

    monkeypatch.setattr(mla_bridge, "mla_prefill", off_by_a_bit)
    rc, res = run_json(tmp_path, "--prompt-lens", "4", "--no-breakdown", "--check-requests", "1")
    assert rc == 1 and res["check"]["passed"] is False
    assert "check FAILED" in capsys.readouterr().err


def test_defaults_are_the_demo_batch_and_seed_workloads_in_help(capsys):
    from mla_bridge.cli import DEMO_CONTEXT_LENS, resolve_workload, build_parser

    parser = build_parser()
    w = resolve_workload(parser.parse_args(["prefill"]))
    assert w.query_lens == [256] * 4 and w.context_lens == list(DEMO_CONTEXT_LENS)
    w = resolve_workload(parser.parse_args(["prefill", "--batch", "4", "--prompt-len", "10000"]))
    assert w.query_lens == [10000] * 4 and w.context_lens == [0] * 4
    w = resolve_workload(parser.parse_args(["prefill", "--context-lens", "8000", "--prompt-len", "2000"]))
    assert w.query_lens == [2000] * 4 and w.context_lens == [8000] * 4
    assert main(["prefill", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--batch 4 --prompt-len 10000" in text and "--context-lens 8000 --prompt-len 2000" in text


# ----------------------------------------------------------------------------------------------------- bad args


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["prefill", "--block-size", "0"], "--block-size"),
        (["prefill", "--prompt-lens", "a,b"], "--prompt-lens"),
        (["prefill", "--prompt-lens", "4,-1"], "--prompt-lens"),
        (["prefill", "--prompt-lens", "4", "--batch", "2"], "--prompt-lens"),
        (["prefill", "--context-lens", "1,2,3"], "--context-lens"),
        (["prefill", "--prompt-len", "0"], "--prompt-len"),
        (["prefill", "--model", "llama"], "--model"),
        (["prefill", "--dtype", "float8"], "--dtype"),
        (["prefill", "--layers", "0"], "--layers"),
        (["prefill", "--device", "cpu", "--backend", "flashinfer-fa2", "--prompt-lens", "4"], "--backend"),
        (["prefill", "--backend", "cudnn"], "--backend"),
        (["prefill", "--device", "tpu"], "--device"),
        (["prefill", "--layer", "3"], "--layer"),
        (["prefill", "--checkpoint", "/nonexistent/ckpt", "--layer", "0"], "--checkpoint"),
        (["prefill", "--checkpoint", "/nonexistent/ckpt"], "--layer"),
        (["frobnicate"], "frobnicate"),
        (["prefill", "--json", "/"], "--json"),  # a folder: refused when parsed, not after the run
        (["prefill", "--json", "/nonexistent-folder/out.json"], "--json"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["bench", "--layers", "0"], "--layers"),
        (["bench", "--budget-s", "-5"], "--budget-s"),
        (["bench", "--json", "/"], "--json"),
    ],
)
def test_bad_arguments_exit_nonzero_naming_the_flag(argv, flag, capsys):
    rc = main(argv)
    assert rc != 0
    assert flag in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda(capsys):
    assert main(["prefill", "--device", "cuda"]) == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["flashinfer-fa3", "bogus"])
def test_env_backend_that_cannot_serve(monkeypatch, capsys, value):
    """Exit 2 naming MLA_BRIDGE_BACKEND, before planning starts (an unknown name used to be refused by the plan, after
    the "planning" line had been printed)."""
    import mla_bridge.plan as plan_mod

    monkeypatch.setenv("MLA_BRIDGE_BACKEND", value)
    monkeypatch.setattr(plan_mod.PrefillPlan, "build", classmethod(lambda cls, *a, **k: pytest.fail("planned")))
    assert main(["prefill", "--device", "cpu", "--prompt-lens", "4"]) == 2
    captured = capsys.readouterr()
    assert "MLA_BRIDGE_BACKEND" in captured.err and "planning" not in captured.out + captured.err


@pytest.mark.parametrize(
    "env,value",
    [
        ("MLA_BRIDGE_KV", "bogus"),
        ("MLA_BRIDGE_KV", "fused"),
        ("MLA_BRIDGE_MERGE", "bogus"),
        ("MLA_BRIDGE_MERGE", "triton"),
        ("MLA_BRIDGE_GATHER", "bogus"),
        ("MLA_BRIDGE_TRITON_LAUNCH", "bogus"),
        ("MLA_BRIDGE_FLASHINFER_DIRECT", "false"),
    ],
)
def test_env_kernel_switch_that_cannot_serve_exits_2_before_work(monkeypatch, capsys, env, value):
    """Exit 2 naming the switch, before planning (was a traceback and exit 1, the exit code of a failed check)."""
    import mla_bridge.plan as plan_mod

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(env, value)
    monkeypatch.setattr(plan_mod.PrefillPlan, "build", classmethod(lambda cls, *a, **k: pytest.fail("planned")))
    assert (
        main(["prefill", "--device", "cpu", "--prompt-lens", "3,4", "--context-lens", "5,100", "--chunk-tokens", "32"])
        == 2
    )
    err = capsys.readouterr().err
    assert env in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["bogus", "triton"])  # triton: no CUDA here, and TRITON_INTERPRET unset
def test_sparse_switch_that_cannot_serve_exits_2_before_work(monkeypatch, capsys, value):
    """A bad or unusable MLA_BRIDGE_SPARSE with --index-topk: exit 2 naming it, before planning (it surfaced at the
    first layer as an unexpected error, exit 3)."""
    import mla_bridge.plan as plan_mod

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MLA_BRIDGE_SPARSE", value)
    monkeypatch.setattr(plan_mod.PrefillPlan, "build", classmethod(lambda cls, *a, **k: pytest.fail("planned")))
    args = ["prefill", "--device", "cpu", "--prompt-lens", "4", "--index-topk", "2", "--indices", "random"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "MLA_BRIDGE_SPARSE" in err and "unexpected" not in err and "Traceback" not in err


def test_prefill_reports_its_kernels_and_times_plans_without_gc(tmp_path, monkeypatch):
    import gc

    import mla_bridge.plan as plan_mod

    real = plan_mod.PrefillPlan.build.__func__
    seen = []

    def build(cls, *a, **k):
        seen.append(gc.isenabled())
        return real(cls, *a, **k)

    monkeypatch.setattr(plan_mod.PrefillPlan, "build", classmethod(build))
    rc, data = run_json(tmp_path, "--prompt-lens", "3,4", "--context-lens", "5,100", "--chunk-tokens", "32")
    from mla_bridge.dispatch import flashinfer_version

    direct = True if flashinfer_version() else None  # None where FlashInfer is not installed: no fa2/fa3 run
    assert rc == 0 and data["kernels"] == {
        "kv": "separate",
        "gather": "torch",
        "merge": "torch",
        "triton_launch": None,
        "flashinfer_direct": direct,
    }
    assert seen == [False, False] and gc.isenabled()  # a collection inside a timed build read as planning time


# ----------------------------------------------------------------------------------------------------- info, bench


def test_info(tmp_path, capsys, monkeypatch):
    from mla_bridge.prefill import ENV_SWITCHES

    monkeypatch.setenv("MLA_BRIDGE_MERGE", "torch")
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(path.read_text())
    assert info["MLA_BRIDGE_MERGE"] == "torch" and all(name in info for name in ENV_SWITCHES)
    assert info["torch"] == torch.__version__
    assert info["flashinfer_jit_cache"].endswith(".cache/flashinfer")
    if not torch.cuda.is_available():
        assert info["backend"]["name"] == "torch" and info["backend"]["passed_over"]
    text = capsys.readouterr().out
    assert "FlashInfer" in text and "backend" in text and "torch" in text
    from mla_bridge.dispatch import flashinfer_version

    assert info["kernels"]["merge"] == "torch"
    assert info["kernels"]["flashinfer_direct"] is (True if flashinfer_version() else None)


def test_info_names_a_switch_that_cannot_serve(tmp_path, capsys, monkeypatch):
    """info reports, it does not refuse (exit 0); the switch's error is shown where the kernels would be."""
    monkeypatch.setenv("MLA_BRIDGE_TRITON_LAUNCH", "bogus")
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(path.read_text())
    assert "MLA_BRIDGE_TRITON_LAUNCH='bogus'" in info["kernels"]["error"]
    assert "MLA_BRIDGE_TRITON_LAUNCH" in capsys.readouterr().out


def _env_names_in_source() -> set:
    """Every ``MLA_BRIDGE_*`` string literal in the library and its adapters (outside the info command itself)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = set()
    for path in list((root / "mla_bridge").rglob("*.py")) + list((root / "adapters").rglob("*.py")):
        if path.name == "info.py" and path.parent.name == "cli":
            continue
        names |= set(re.findall(r"[\"'](MLA_BRIDGE_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def test_info_lists_every_environment_variable_the_library_reads(tmp_path, capsys, monkeypatch):
    from mla_bridge.cli.info import ENV_VARIABLES

    in_source = _env_names_in_source()
    assert len(in_source) >= 8 and {"MLA_BRIDGE_JAX_JIT_ROUTE", "MLA_BRIDGE_JAX_MAX_PLANS"} <= in_source
    assert {name for name, *_ in ENV_VARIABLES} == in_source
    monkeypatch.setenv("MLA_BRIDGE_JAX_MAX_PLANS", "4")
    monkeypatch.delenv("MLA_BRIDGE_JAX_JIT_ROUTE", raising=False)
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(path.read_text())
    assert [e["name"] for e in info["environment"]] == [name for name, *_ in ENV_VARIABLES]
    env = {e["name"]: e for e in info["environment"]}
    assert env["MLA_BRIDGE_JAX_MAX_PLANS"]["value"] == "4" and env["MLA_BRIDGE_JAX_MAX_PLANS"]["default"] == "16"
    assert env["MLA_BRIDGE_JAX_JIT_ROUTE"]["value"] is None and info["MLA_BRIDGE_JAX_JIT_ROUTE"] is None
    text = capsys.readouterr().out
    for name in in_source:
        assert name in text, name
    assert "MLA_BRIDGE_JAX_MAX_PLANS" in text and "'4'" in text


def test_info_reports_the_dtype_each_path_uses(tmp_path, capsys, monkeypatch):
    """On the CPU the command's default dtype is float32 (not bf16): the backend is chosen for it, and the compute
    dtype of each path is listed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("MLA_BRIDGE_BACKEND", raising=False)
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(path.read_text())
    assert info["dtype"] == "float32" and info["backend"]["dtype"] == "float32"
    assert info["backend"]["name"] == "torch"
    assert "float32" in info["compute_dtypes"]["torch backend"]
    assert "bfloat16" in info["compute_dtypes"]["FlashInfer backends (fa2, fa3, cutlass)"]
    text = capsys.readouterr().out
    assert "torch for float32, head dims 192/128" in text and "for bf16" not in text
    from mla_bridge.cli.info import default_dtype

    assert default_dtype("cuda") == "bfloat16" and default_dtype("cpu") == "float32"


@pytest.mark.parametrize(
    "argv,module",
    [
        (["info"], "rich"),
        (["prefill", "--device", "cpu"], "rich"),
        (["bench", "--plot", "x.png"], "matplotlib"),
        (["prefill", "--checkpoint", "/nowhere", "--layer", "0"], "safetensors"),
    ],
)
def test_a_missing_cli_extra_is_named_before_any_work(argv, module, monkeypatch, capsys):
    """Without the cli extra the command stops with exit 2 and one line naming the package and the extra (no
    traceback); --help still works."""
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, find_spec finds nothing
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"needs {module}" in err and "pip install 'mla-bridge[cli]'" in err and "Traceback" not in err
    assert main([argv[0], "--help"]) == 0


def test_info_jit_cache_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["flashinfer_jit_cache"] == str(tmp_path / ".cache" / "flashinfer")


def test_bench_is_wired_lazily(monkeypatch):
    calls = []
    fake = types.ModuleType("mla_bridge.bench")
    fake.add_arguments = lambda parser: parser.add_argument("--repeat", type=int, default=1)
    fake.run = lambda args: calls.append(args.repeat) or 0
    monkeypatch.setitem(sys.modules, "mla_bridge.bench", fake)
    assert main(["bench", "--repeat", "3"]) == 0
    assert calls == [3]


def test_bench_missing_module(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mla_bridge.bench", None)  # import raises ModuleNotFoundError
    assert main(["bench"]) == 2
    assert "mla_bridge.bench" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- checkpoints

TINY_CONFIG = {
    "model_type": "deepseek_v2",
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707},
}
WEIGHT = "model.layers.{}.self_attn.kv_b_proj.weight"


def write_checkpoint(root, tensors_per_shard, config=TINY_CONFIG, index=True):
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for i, tensors in enumerate(tensors_per_shard):
        name = f"model-{i + 1:05d}-of-{len(tensors_per_shard):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / name))
        weight_map.update({k: name for k in tensors})
    if index:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def tiny_weight(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * (16 + 16), 32, generator=g) * 32**-0.5


def test_checkpoint_bf16_sharded_through_index(tmp_path):
    w0, w1 = tiny_weight(0).bfloat16(), tiny_weight(1).bfloat16()
    ckpt = write_checkpoint(
        tmp_path / "ckpt",
        [
            {WEIGHT.format(0): w0, "model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16)},
            {WEIGHT.format(1): w1},
        ],
    )
    dims = MLADims.from_hf_config(TINY_CONFIG)
    loaded, where = load_kv_b_proj_weight(ckpt, 1, dims, TINY_CONFIG)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, w1)
    assert "model-00002-of-00002.safetensors" in where
    rc, res = run_json(
        tmp_path,
        "--checkpoint",
        str(ckpt),
        "--layer",
        "1",
        "--prompt-lens",
        "6,3",
        "--context-lens",
        "5,0",
        "--block-size",
        "4",
    )
    assert rc == 0
    assert res["dims"]["num_heads"] == 2 and res["dims"]["kv_lora_rank"] == 32
    assert res["dims"]["softmax_scale"] == pytest.approx(dims.softmax_scale)
    assert "model.layers.1.self_attn.kv_b_proj.weight" in res["weight"]
    assert res["check"]["passed"] and res["check"]["max_abs_err_out"] < 1e-4


def test_checkpoint_fp8_dequantized_with_block_scales(tmp_path):
    w8 = tiny_weight(2).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 2, generator=torch.Generator().manual_seed(3)) + 0.5  # [64/16, 32/16] blocks of 16x16
    config = {**TINY_CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    ckpt = write_checkpoint(
        tmp_path / "ckpt", [{WEIGHT.format(0): w8, WEIGHT.format(0) + "_scale_inv": scale}], config=config, index=False
    )
    loaded, where = load_kv_b_proj_weight(ckpt, 0, MLADims.from_hf_config(config), config)
    expected = w8.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert loaded.dtype == torch.float32 and torch.equal(loaded, expected)
    assert "dequantized" in where and "16x16" in where
    rc, res = run_json(
        tmp_path,
        "--checkpoint",
        str(ckpt),
        "--layer",
        "0",
        "--prompt-lens",
        "5",
        "--context-lens",
        "7",
        "--block-size",
        "4",
    )
    assert rc == 0 and res["check"]["passed"] and "dequantized" in res["weight"]


def test_checkpoint_fp8_default_128_blocks(tmp_path):
    w8 = tiny_weight(4).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.25]])  # one 128x128 block covers the whole [64, 32] weight
    ckpt = write_checkpoint(tmp_path / "ckpt", [{WEIGHT.format(1): w8, WEIGHT.format(1) + "_scale_inv": scale}])
    loaded, where = load_kv_b_proj_weight(ckpt, 1, None, TINY_CONFIG)
    assert torch.equal(loaded, w8.float() * 0.25) and "128x128" in where


def test_checkpoint_fp8_without_scale_is_refused(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", [{WEIGHT.format(0): tiny_weight(5).to(torch.float8_e4m3fn)}])
    with pytest.raises(CLIError, match="weight_scale_inv"):
        load_kv_b_proj_weight(ckpt, 0, None, TINY_CONFIG)
    assert main(["prefill", "--checkpoint", str(ckpt), "--layer", "0", "--prompt-lens", "4"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint" in err and "weight_scale_inv" in err and "FP8" in err


def test_checkpoint_errors_name_the_flag(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", [{WEIGHT.format(0): tiny_weight(6).bfloat16()}])
    assert main(["prefill", "--checkpoint", str(ckpt), "--layer", "5"]) == 2  # config: 2 layers
    assert "--layer 5" in capsys.readouterr().err
    assert main(["prefill", "--checkpoint", str(ckpt), "--layer", "1"]) == 2  # not in the index
    assert "model.layers.1.self_attn.kv_b_proj.weight" in capsys.readouterr().err
    assert main(["prefill", "--checkpoint", str(ckpt), "--layer", "0", "--model", "deepseek-v3"]) == 2
    assert "--model" in capsys.readouterr().err
    bad = {**TINY_CONFIG, "num_attention_heads": 4}  # weight is [64, 32], dims want [128, 32]
    ckpt2 = write_checkpoint(tmp_path / "ckpt2", [{WEIGHT.format(0): tiny_weight(7).bfloat16()}], config=bad)
    assert main(["prefill", "--checkpoint", str(ckpt2), "--layer", "0"]) == 2
    assert "[128, 32]" in capsys.readouterr().err
    (tmp_path / "nocfg").mkdir()
    assert main(["prefill", "--checkpoint", str(tmp_path / "nocfg"), "--layer", "0"]) == 2
    assert "config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("score_elems", [1 << 25, 37])  # one block, and many small query blocks
def test_reference_matches_the_suites_float64_reference(ref, tiny_dims, score_elems):
    batch = ref.make_mla_batch(tiny_dims, [7, 1, 12, 5], [0, 9, 33, 16], 8)
    out_ref, lse_ref = ref.mla_reference(batch)
    qo = ref.cumsum0(batch.query_lens)
    for r in range(4):
        a, b = qo[r], qo[r + 1]
        out, lse = reference_request(
            batch.q[a:b],
            batch.kv_c[a:b],
            batch.k_pe[a:b],
            batch.w,
            batch.cache,
            batch.block_table[r],
            batch.context_lens[r],
            tiny_dims,
            score_elems=score_elems,
        )
        assert out.dtype == torch.float64 and lse.shape == (b - a, tiny_dims.num_heads)
        torch.testing.assert_close(out, out_ref[a:b], atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, lse_ref[a:b], atol=1e-12, rtol=0)


def test_max_excess_error():
    from mla_bridge.reference import max_abs_error, max_excess_error

    ref = torch.tensor([1.0, -4.0, 0.0], dtype=torch.float64)
    got = torch.tensor([1.01, -4.03, 0.0])
    assert max_abs_error(got, ref) == pytest.approx(0.03, abs=1e-6)
    assert max_excess_error(got, ref, 0.0) == pytest.approx(0.03, abs=1e-6)
    assert max_excess_error(got, ref, 0.01) == pytest.approx(0.0, abs=1e-6)  # 0.01 - 0.01 x 1, 0.03 - 0.01 x 4, 0
    assert math.isnan(max_excess_error(torch.tensor([float("nan")]), torch.zeros(1), 0.1))


def test_info_without_flashinfer_shows_the_extra_literally(monkeypatch, capsys):
    import mla_bridge.dispatch as dispatch

    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: None)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "pip install 'mla-bridge[flashinfer]'" in out  # not eaten as rich markup


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_bench_refuses_a_forced_backend_this_machine_cannot_run(capsys):
    assert main(["bench", "--backend", "flashinfer-fa3", "--sections", "plan"]) == 2
    assert "--backend flashinfer-fa3" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
@pytest.mark.parametrize("value", ["flashinfer-fa3", "bogus"])
def test_bench_refuses_an_env_backend_that_cannot_serve(monkeypatch, capsys, value):
    """Only --backend was checked: with MLA_BRIDGE_BACKEND=bogus the bench ran every section, each mla_bridge row
    "skipped: plan failed", and exited 0 (prefill exits 2 for the same value)."""
    import mla_bridge.bench.report as report

    monkeypatch.setenv("MLA_BRIDGE_BACKEND", value)
    monkeypatch.setattr(report, "environment", lambda ctx: pytest.fail("ran"))
    assert main(["bench", "--sections", "main"]) == 2
    assert "MLA_BRIDGE_BACKEND" in capsys.readouterr().out


# --------------------------------------------------------------------------------------- sizes that cannot fit

TOO_BIG = [
    (["--prompt-len", "100000000"], "needs about"),
    (["--batch", "100000000", "--prompt-len", "1"], "--batch"),
    (["--context-lens", "10000000000"], "--context-lens"),
    (["--prompt-len", "2000000", "--batch", "1"], "needs about"),  # was OOM-killed at 24 GB
]


@pytest.mark.parametrize("argv, words", TOO_BIG)
def test_sizes_that_cannot_fit_are_refused_before_anything_is_allocated(argv, words, capsys, monkeypatch):
    import mla_bridge.cli.prefill as prefill_cmd

    def no_inputs(*a, **k):
        raise AssertionError("inputs were allocated")

    monkeypatch.setattr(prefill_cmd, "make_inputs", no_inputs)
    assert main(["prefill", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    if words == "needs about":
        assert "available" in err and "--no-memory-check" in err and "GiB" in err


def test_memory_estimate_refuses_with_the_estimate_and_what_is_available(monkeypatch, capsys, tmp_path):
    import mla_bridge.cli.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda place, device: (5 << 20, "free in this test"))
    built = []
    import mla_bridge

    monkeypatch.setattr(mla_bridge.PrefillPlan, "build", classmethod(lambda cls, *a, **k: built.append(1)))
    path = tmp_path / "out.json"
    assert main(["prefill", "--device", "cpu", "--prompt-lens", "512", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    # q 512 x 16 x 192 x 4 bytes = 6 MiB alone: refused before the plan (whose index tensors are allocations).
    assert "needs about" in err and "5.0 MiB is free in this test" in err and "inputs" in err
    assert built == [] and not path.exists() and list(tmp_path.iterdir()) == []


def test_memory_check_can_be_overridden(monkeypatch, tmp_path):
    import mla_bridge.cli.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda place, device: (1 << 20, "free in this test"))
    rc, res = run_json(tmp_path, "--prompt-lens", "5", "--no-memory-check")
    assert rc == 0 and res["check"]["passed"] is True


def test_memory_estimate_parts(tiny_dims):
    """The parts of the estimate against their own formulas: the cache, the plan's index tensors counted from the
    plan (twice: the command builds it again), and the prefill peak from prefill_memory_bytes."""
    from mla_bridge import PrefillPlan, Workspace
    from mla_bridge.prefill import prefill_memory_bytes
    from mla_bridge.cli.memory import estimate_run_memory

    q_lens, c_lens, bs = [5, 9, 1], [0, 70, 300], 16
    for budget, fused in ((4096, True), (64, False)):
        plan = PrefillPlan.build(
            q_lens,
            c_lens,
            dims=tiny_dims,
            workspace=Workspace("cpu", chunk_tokens=budget),
            block_size=bs,
            dtype=torch.float32,
        )
        assert plan.fused is fused
        est = estimate_run_memory(tiny_dims, q_lens, c_lens, bs, torch.float32, "cpu", [1], plan=plan)
        held = est.held["device"]
        assert held["paged cache"] == (5 + 19 + 1) * bs * tiny_dims.latent_dim * 4
        per_build = (24 * 370 + 8 * 15) if fused else 0  # chunked: no per-token tensor (made per call, per chunk)
        assert held["plan index tensors"] == 2 * per_build
        assert est.peaks["device"]["mla_prefill"] >= prefill_memory_bytes(plan)
        assert est.total("device") == sum(held.values()) + max(est.peaks["device"].values())
        assert "host" not in est.held  # a CPU run: the host is the device
    before = estimate_run_memory(tiny_dims, q_lens, c_lens, bs, torch.float32, "cpu", [1])
    assert before.held["device"]["plan index tensors"] == 2 * (24 * 370 + 8 * 15)  # the fused bound


OUTPUT_FLAGS = [
    ["prefill", "--device", "cpu", "--prompt-lens", "4", "--json"],
    ["info", "--json"],
    ["bench", "--json"],
    ["bench", "--plot"],
]


@pytest.mark.parametrize("argv", OUTPUT_FLAGS, ids=lambda a: " ".join(a[:1] + a[-1:]))
@pytest.mark.parametrize("where", ["proc", "missing folder"])
def test_output_flags_are_checked_before_any_work_the_same_way(argv, where, tmp_path, capsys):
    # /proc: os.access says yes to root there, but no file can be created.
    path = "/proc/mla_bridge_test.json" if where == "proc" else str(tmp_path / "missing" / "out.json")
    assert main([*argv, path]) == 2
    captured = capsys.readouterr()
    assert argv[-1] in captured.err and "Traceback" not in captured.err
    assert captured.out == ""  # no table: nothing ran
    assert not os.path.exists(path)


@pytest.mark.parametrize("name", ["p.txt", "p.json"])
def test_bench_plot_format_is_checked_before_any_work(name, tmp_path, capsys):
    """A --plot suffix matplotlib cannot write is refused when the flags are parsed (exit 2, nothing run, nothing
    written). Before, it was accepted and the plot failed after the whole benchmark, exit 1."""
    path = tmp_path / name
    assert main(["bench", "--sections", "merge", "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert (
        "--plot" in captured.err and f"cannot write '{path.suffix}' images" in captured.err and ".svg" in captured.err
    )
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_bench_plot_takes_the_formats_matplotlib_writes():
    from mla_bridge.bench import plot_file

    for name in ("out.png", "out.SVG", "out.pdf", "out"):
        assert str(plot_file(name)) == name


def test_output_file_leaves_nothing_behind(tmp_path):
    """The check writes and removes a sibling temporary file; an existing file is opened for append, unchanged."""
    from mla_bridge.cli.args import output_file, write_output

    target = tmp_path / "out.json"
    assert output_file(str(target)) == target and list(tmp_path.iterdir()) == []
    target.write_text("old")
    assert output_file(str(target)) == target and target.read_text() == "old"
    write_output(target, "new\n")
    assert target.read_text() == "new\n" and list(tmp_path.iterdir()) == [target]


def test_a_run_refused_after_parsing_leaves_no_output_file(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert (
        main(["prefill", "--device", "cpu", "--backend", "flashinfer-fa2", "--prompt-lens", "4", "--json", str(path)])
        == 2
    )
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_prints_one_line_exits_130_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import mla_bridge

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mla_bridge, "mla_prefill", interrupted)
    path = tmp_path / "out.json"
    assert main(["prefill", "--device", "cpu", "--prompt-lens", "4", "--json", str(path)]) == 130
    assert capsys.readouterr().err == "mla-bridge prefill: interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_on_the_real_command(tmp_path):
    """A real SIGINT in the middle of a run: one line on stderr, exit 130, no JSON, no temporary file."""
    import signal
    import subprocess

    path = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mla_bridge.cli",
            "prefill",
            "--device",
            "cpu",
            "--prompt-len",
            "3000",
            "--batch",
            "1",
            "--layers",
            "50",
            "--no-breakdown",
            "--json",
            str(path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    for line in proc.stdout:  # stdout is a pipe: the command logs a line per phase
        if "layer 1/50" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err == "mla-bridge prefill: interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_piped_output_logs_a_line_per_phase_and_layer_group(capsys):
    assert (
        main(
            [
                "prefill",
                "--device",
                "cpu",
                "--prompt-lens",
                "8,4",
                "--context-lens",
                "16",
                "--layers",
                "30",
                "--check-requests",
                "1",
                "--block-size",
                "16",
            ]
        )
        == 0
    )
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("mla-bridge prefill: ") and line.endswith(" s)")
    ]
    names = [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in lines]
    layers = [n for n in names if n.startswith("layer ")]
    assert names[0].startswith("planning 2 request(s), 12 new + 32 context tokens")
    assert "making the inputs and the paged cache" in names and "warm-up layer" in names
    assert layers[0] == "layer 1/30" and layers[-1] == "layer 30/30" and 3 <= len(layers) <= 12
    assert names[-2:] == ["instrumented layer (phase times)", "float64 check, request 1"]


@pytest.mark.gpu
def test_cuda_run_that_cannot_fit_is_refused_against_the_gpus_free_memory(capsys):
    """2M new tokens on the GPU: the float64 check alone needs ~200 GiB of device memory, more than an H200's."""
    assert main(["prefill", "--device", "cuda", "--prompt-len", "2000000", "--batch", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs about" in err and "torch.cuda.mem_get_info" in err and "cuda:" in err


# --------------------------------------------------------------------------- inputs that once crashed or were misread


def test_device_cpu_with_an_index_is_the_cpu(tmp_path):
    """--device cpu:0 crashed with 'kv_b_proj_weight is on cpu, but the plan is on cpu:0' (exit 1)."""
    rc, res = run_json(tmp_path, "--prompt-lens", "4", "--layers", "1")
    rc0 = main(["prefill", "--device", "cpu:0", "--prompt-lens", "4", "--layers", "1"])
    assert rc == 0 and rc0 == 0
    from mla_bridge import Workspace

    assert Workspace("cpu:3").device == torch.device("cpu")


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("command", [["prefill", "--prompt-lens", "4"], ["bench", "--quick", "--sections", "merge"]])
def test_seed_out_of_range_is_refused_by_name(command, capsys):
    """A seed torch cannot take crashed inside torch.Generator.manual_seed (exit 1)."""
    assert _exit_code([*command, "--seed", "99999999999999999999999"]) == 2
    assert "--seed" in capsys.readouterr().err


@pytest.mark.parametrize("lens", ["1,,2", ",5,", "5,"])
def test_empty_items_in_a_length_list_are_refused(lens, capsys):
    """'1,,2' silently ran two requests."""
    assert _exit_code(["prefill", "--device", "cpu", "--prompt-lens", lens]) == 2
    assert "--prompt-lens" in capsys.readouterr().err


def test_float32_check_is_relative_for_large_outputs():
    """The float32 check was absolute only: outputs of about 50 with a relative error of 2.6e-6 failed it."""
    from mla_bridge.cli.prefill import TOLERANCE
    from mla_bridge.reference import max_excess_error

    (atol, rtol), _ = TOLERANCE["float32"]
    ref = torch.full((4, 2), 51.7, dtype=torch.float64)
    assert max_excess_error(ref * (1 + 2.6e-6), ref, rtol) <= atol
    assert max_excess_error(ref * (1 + 1e-4), ref, rtol) > atol  # a real error still fails


def test_corrupt_safetensors_is_a_clear_error(tmp_path, capsys):
    """A model.safetensors that is not safetensors raised SafetensorError with a traceback (exit 1)."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": 16,
                "kv_lora_rank": 512,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "num_hidden_layers": 1,
            }
        )
    )
    (ckpt / "model.safetensors").write_text("garbage")
    assert main(["prefill", "--device", "cpu", "--checkpoint", str(ckpt), "--layer", "0", "--prompt-lens", "4"]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_json_write_failure_is_one_line_and_a_link_is_followed(tmp_path, capsys):
    """--json /dev/full raised OSError with a traceback after the run; a --json symlink was replaced by a file."""
    assert _exit_code(["prefill", "--device", "cpu", "--prompt-lens", "4", "--json", "/dev/full"]) == 2
    assert "could not write" in capsys.readouterr().err
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert _exit_code(["prefill", "--device", "cpu", "--prompt-lens", "4", "--json", str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["query_lens"] == [4]


# ----------------------------------------------------------------------------------------------------- exit codes


def _crash(*args, **kwargs):
    raise RuntimeError("index 7 is out of bounds\nsecond line of the message")


@pytest.mark.parametrize("debug", ["", "--debug", "MLA_BRIDGE_DEBUG=1"])
def test_an_unexpected_error_has_its_own_exit_code_and_one_line(tmp_path, monkeypatch, capsys, debug):
    """A crash inside a command (here mla_prefill raising) exited 1, the code of a failed float64 check, with a
    traceback. It is exit 3 with one line on stderr naming the command and the error (its first line), and the
    way to the traceback; with --debug or MLA_BRIDGE_DEBUG=1 the traceback comes first. Nothing is written."""
    import mla_bridge

    monkeypatch.setattr(mla_bridge, "mla_prefill", _crash)
    monkeypatch.delenv("MLA_BRIDGE_DEBUG", raising=False)
    if debug.startswith("MLA_BRIDGE_DEBUG"):
        monkeypatch.setenv("MLA_BRIDGE_DEBUG", "1")
    path = tmp_path / "out.json"
    argv = ["prefill", "--device", "cpu", "--prompt-lens", "4", "--json", str(path)]
    assert main(argv + ([debug] if debug == "--debug" else [])) == 3
    err = capsys.readouterr().err
    line = "mla-bridge prefill: unexpected error: RuntimeError: index 7 is out of bounds"
    if not debug:
        assert err.count("\n") == 1 and err.startswith(line)
        assert "--debug" in err and "MLA_BRIDGE_DEBUG=1" in err and "Traceback" not in err
    else:
        assert err.startswith("Traceback (most recent call last):") and "second line of the message" in err
        assert err.splitlines()[-1].startswith(line) and "in _crash" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["false", "0", "no", "off"])
def test_mla_bridge_debug_set_to_a_false_word_prints_one_line(monkeypatch, capsys, value):
    """MLA_BRIDGE_DEBUG=false (or 0, no, off) keeps the one-line report: before, any value but "" and "0" turned the
    traceback on."""
    import mla_bridge

    monkeypatch.setattr(mla_bridge, "mla_prefill", _crash)
    monkeypatch.setenv("MLA_BRIDGE_DEBUG", value)
    assert main(["prefill", "--device", "cpu", "--prompt-lens", "4"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_exit_codes_are_distinct_and_documented(tmp_path, monkeypatch, capsys):
    """0 success, 1 the float64 check failed, 2 a usage error or a refused request, 3 an unexpected error: each as
    the help says (prefill's epilog and the top-level help)."""
    import mla_bridge

    assert main(["prefill", "--device", "cpu", "--prompt-lens", "4", "--no-breakdown", "--check-requests", "1"]) == 0
    assert main(["prefill", "--device", "cpu", "--prompt-lens", "4", "--context-lens", "-1"]) == 2
    assert main(["prefill", "--device", "cpu", "--backend", "flashinfer-fa2", "--prompt-lens", "4"]) == 2
    real = mla_bridge.mla_prefill
    monkeypatch.setattr(mla_bridge, "mla_prefill", lambda *a, **k: (lambda o: (o[0] + 1.0, o[1]))(real(*a, **k)))
    assert main(["prefill", "--device", "cpu", "--prompt-lens", "4", "--no-breakdown", "--check-requests", "1"]) == 1
    monkeypatch.setattr(mla_bridge, "mla_prefill", _crash)
    assert main(["prefill", "--device", "cpu", "--prompt-lens", "4"]) == 3
    capsys.readouterr()
    for argv in (["prefill", "--help"], ["--help"]):
        assert main(argv) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "exit codes: 0 success; 1 " in text and "; 2 " in text and "; 130 interrupted" in text
        assert (
            "3 an unexpected error (a bug or a failure of the environment: one line; the traceback with --debug "
            "or MLA_BRIDGE_DEBUG=1)" in text
        )


@pytest.mark.parametrize("command", [["info"], ["bench", "--quick", "--sections", "merge"]])
def test_every_command_takes_debug_and_reports_a_crash_as_exit_3(command, monkeypatch, capsys):
    """info and bench crash the same way as prefill: exit 3, one line naming the command."""
    import mla_bridge.cli as cli

    monkeypatch.setattr(cli, "cmd_info", _crash)
    monkeypatch.setattr("mla_bridge.bench.run", _crash)
    assert main(command) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"mla-bridge {command[0]}: unexpected error: RuntimeError: index 7") and err.count("\n") == 1
    assert main(command + ["--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_info_flags_an_invalid_switch_value(tmp_path, capsys, monkeypatch):
    """A value a switch's reader refuses (``MLA_BRIDGE_JAX_MAX_PLANS=bogus``) is flagged in the listing, with the
    reader's message, and as ``invalid`` in the JSON; a valid one has ``invalid: null``. Before, it was listed as if
    it were taken."""
    monkeypatch.setenv("MLA_BRIDGE_JAX_MAX_PLANS", "bogus")
    monkeypatch.setenv("MLA_BRIDGE_KV", "auto")
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    env = {e["name"]: e for e in json.loads(path.read_text())["environment"]}
    assert "expected a positive int" in env["MLA_BRIDGE_JAX_MAX_PLANS"]["invalid"]
    assert env["MLA_BRIDGE_KV"]["invalid"] is None
    text = capsys.readouterr().out  # a table: long cells wrap
    assert "'bogus' INVALID: MLA_BRIDGE_JAX_MAX_PLANS='bogus'" in text and "expected a positive" in text


# ----------------------------------------------------------------------------------------------------- sparse


SPARSE_ARGS = ("--prompt-lens", "5,9,1", "--context-lens", "0,70,3", "--block-size", "16", "--check-requests", "3")


def picks_per_token(query_lens, context_lens, k):
    """The keys an indexer's top-k (or the random picks) select for each new token: all it may see, up to k."""
    return [min(k, c + j + 1) for q, c in zip(query_lens, context_lens) for j in range(q)]


@pytest.mark.parametrize("indices", ["indexer", "random"])
def test_prefill_sparse_passes_its_float64_check_and_reports_the_sparse_figures(tmp_path, capsys, indices):
    """--index-topk 8 over requests of 1 to 79 positions: early tokens pick fewer than 8 keys (-1 padding), later ones
    8 of up to 79; the float64 sparse attention over the same picks agrees, and the JSON and the table carry the
    sparse figures (selected pairs, FLOPs over them, where the picks came from)."""
    argv = SPARSE_ARGS + ("--index-topk", "8", "--layers", "2")
    rc, res = run_json(tmp_path, *argv, *(() if indices == "indexer" else ("--indices", "random")))
    assert rc == 0 and PREFILL_FIELDS <= set(res)
    assert res["schedule"] == "sparse" and res["kernels"] == {"sparse": "torch"}
    sparse = res["sparse"]
    assert sparse["index_topk"] == 8 and sparse["indices"] == indices and sparse["indices_ms"] > 0
    assert (sparse["indexer_shape"] is None) == (indices == "random")
    pairs = sum(picks_per_token([5, 9, 1], [0, 70, 3], 8))
    assert sparse["selected_pairs"] == pairs and pairs < sparse["causal_pairs"]
    assert sparse["causal_pairs"] == 5 * 6 // 2 + (9 * 70 + 9 * 10 // 2) + (1 * 3 + 1)
    assert res["flops"]["attention"] == 2 * pairs * 16 * (512 + 64 + 512)
    assert res["flops"]["absorption"] == 2 * 15 * 16 * 512 * (128 + 128)
    assert set(res["timings_ms"]["phases"]) == {"sparse attention"}
    check = res["check"]
    assert [c["request"] for c in check["requests"]] == [0, 1, 2] and check["passed"] is True
    assert check["max_abs_err_out"] < 1e-4 and check["max_abs_err_lse"] < 1e-4
    assert "reference_sparse_request" in check["reference"]
    text = " ".join(capsys.readouterr().out.split())
    for words in ("index_topk 8", f"{pairs} (query, key) pairs of", "float64 sparse attention over the same picks"):
        assert words in text, words
    assert ("reference indexer" in text) == (indices == "indexer")


def test_prefill_sparse_fp8_cache_and_k_beyond_every_sequence(tmp_path):
    """An FP8 cache (the check dequantizes the same bytes) and K larger than any sequence: every token picks its
    whole causal sequence, which is dense prefill, so the sparse check's reference is the dense one."""
    rc, res = run_json(tmp_path, *SPARSE_ARGS, "--index-topk", "200", "--indices", "random", "--kv-cache-dtype", "fp8")
    assert rc == 0 and res["check"]["passed"] is True
    assert res["sparse"]["selected_pairs"] == res["sparse"]["causal_pairs"]
    assert res["kv_cache"]["dtype"] == "fp8_e4m3" and res["kv_cache"]["scale"] > 0
    assert all("max_abs_err_out_vs_unquantized" in c for c in res["check"]["requests"])


def test_prefill_sparse_check_catches_a_wrong_result(tmp_path, monkeypatch, capsys):
    import mla_bridge

    real = mla_bridge.mla_prefill

    def off_by_a_bit(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out, lse + 1e-2

    monkeypatch.setattr(mla_bridge, "mla_prefill", off_by_a_bit)
    rc, res = run_json(tmp_path, *SPARSE_ARGS, "--index-topk", "4", "--indices", "random", "--no-breakdown")
    assert rc == 1 and res["check"]["passed"] is False and res["schedule"] == "sparse"
    assert "check FAILED" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, flag",
    [
        (("--index-topk", "4", "--no-fuse"), "--no-fuse"),
        (("--index-topk", "4", "--chunk-tokens", "64"), "--chunk-tokens"),
        (("--index-topk", "4", "--backend", "torch"), "--backend"),
        (("--indices", "random"), "--index-topk"),
        (("--index-topk", "0"), "--index-topk"),
        (("--index-topk", "4", "--indices", "nearest"), "--indices"),
    ],
)
def test_prefill_sparse_refuses_options_it_cannot_honour_by_name(tmp_path, capsys, extra, flag):
    rc, res = run_json(tmp_path, "--prompt-lens", "4", *extra)
    assert rc == 2 and res is None
    assert flag in capsys.readouterr().err


def test_prefill_sparse_indexer_refuses_a_model_without_rope_by_name(tmp_path, capsys, monkeypatch):
    """The indexer's RoPE part is the model's qk_rope_head_dim: a model without one is refused naming --indices,
    random picks still serve it."""
    from mla_bridge import MLADims

    no_rope = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16)
    monkeypatch.setattr(MLADims, "preset", classmethod(lambda cls, name: no_rope))
    rc, _ = run_json(tmp_path, "--prompt-lens", "4", "--index-topk", "2")
    assert rc == 2 and "--indices indexer" in capsys.readouterr().err
    rc, res = run_json(tmp_path, "--prompt-lens", "4", "--index-topk", "2", "--indices", "random")
    assert rc == 0 and res["check"]["passed"] is True


def test_make_topk_indices_are_valid_causal_picks_and_seeded():
    """Both sources: int32 [T, K]; each row holds min(K, position + 1) distinct positions at most the token's own
    (the indexer's and random picks alike select that many), -1 after them; the same seed gives the same picks."""
    from mla_bridge.cli.indices import make_topk_indices

    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    q_lens, c_lens, k = [3, 0, 6], [0, 5, 20], 7
    shape = {"index_n_heads": 4, "index_head_dim": 16, "q_lora_rank": 24, "hidden_size": 40}
    own = [c + j for q, c in zip(q_lens, c_lens) for j in range(q)]
    for source in ("indexer", "random"):
        kw = dict(device="cpu", dtype=torch.float32, seed=3, shape=shape)
        idx = make_topk_indices(source, dims, q_lens, c_lens, k, **kw)
        assert idx.dtype == torch.int32 and idx.shape == (9, k)
        for row, p in zip(idx.tolist(), own):
            n = min(k, p + 1)
            assert all(0 <= x <= p for x in row[:n]) and len(set(row[:n])) == n and row[n:] == [-1] * (k - n)
        assert torch.equal(idx, make_topk_indices(source, dims, q_lens, c_lens, k, **kw))
        other = make_topk_indices(source, dims, q_lens, c_lens, k, **dict(kw, seed=4))
        assert not torch.equal(idx, other)


def test_sparse_memory_estimate_counts_the_indices_and_the_sparse_pass(tiny_dims):
    from mla_bridge import PrefillPlan, Workspace
    from mla_bridge.cli.indices import INDEXER_SHAPE, indices_bytes, sparse_pass_bytes
    from mla_bridge.cli.memory import estimate_run_memory

    q_lens, c_lens, bs, k = [5, 9, 1], [0, 70, 300], 16, 32
    plan = PrefillPlan.build(
        q_lens, c_lens, dims=tiny_dims, workspace=Workspace("cpu"), block_size=bs, dtype=torch.float32, index_topk=k
    )
    sparse = dict(index_topk=k, source="indexer", shape=dict(INDEXER_SHAPE))
    est = estimate_run_memory(tiny_dims, q_lens, c_lens, bs, torch.float32, "cpu", [1], plan=plan, sparse=sparse)
    assert est.held["device"]["topk_indices"] == 15 * k * 4
    # the larger of the torch path's and the kernel's, which first gathers the attended context and the new tokens
    # into the fused key latents (70 + 300 context rows of the requests with new tokens, 15 new rows)
    assert plan.sparse_latent_meta is not None
    assert est.peaks["device"]["mla_prefill"] == sparse_pass_bytes(tiny_dims, 15, k, 4, latent_rows=385)
    assert sparse_pass_bytes(tiny_dims, 15, k, 4, latent_rows=1 << 20) >= (1 << 20) * tiny_dims.latent_dim * 4
    assert sparse_pass_bytes(tiny_dims, 15, k, 4, latent_rows=385) >= sparse_pass_bytes(tiny_dims, 15, k, 4)
    made = est.peaks["device"]["making topk_indices"]
    assert made == indices_bytes(q_lens, c_lens, k, "indexer", dict(INDEXER_SHAPE), 4)
    # the indexer's scores of one chunk of the longest sequence's queries: 3 copies of [n, 64 heads, S] float32
    assert made >= 3 * 9 * 64 * 301 * 4
    assert indices_bytes(q_lens, c_lens, k, "random", None, 4) < made


@pytest.mark.parametrize("score_elems", [1 << 25, 37])
def test_sparse_reference_matches_the_suites_sparse_reference(ref, tiny_dims, score_elems):
    """mla_bridge.reference.reference_sparse_request (scores of every key, the picks gathered and scattered back)
    against tests/helpers/sparse_cases.py's (per token, per pick): -1 padding, rows without keys, a repeated pick."""
    from mla_bridge.reference import reference_sparse_request
    from tests.helpers.sparse_cases import CONTEXT_LENS, QUERY_LENS, random_indices, sparse_reference

    batch = ref.make_mla_batch(tiny_dims, QUERY_LENS, CONTEXT_LENS, 16, seed=4)
    indices = random_indices(QUERY_LENS, CONTEXT_LENS, 12, seed=6, fill=0.5, allow_empty=True)
    indices[2] = -1
    indices[0, :3] = 0  # token 0 of request 0 picks position 0 three times
    want_out, want_lse = sparse_reference(batch, indices)
    qo = ref.cumsum0(QUERY_LENS)
    for r, c in enumerate(CONTEXT_LENS):
        a, b = qo[r], qo[r + 1]
        out, lse = reference_sparse_request(
            batch.q[a:b],
            batch.kv_c[a:b],
            batch.k_pe[a:b],
            batch.w,
            batch.cache,
            batch.block_table[r],
            c,
            tiny_dims,
            indices[a:b],
            score_elems=score_elems,
        )
        assert out.dtype == torch.float64 and out.shape == (b - a, tiny_dims.num_heads, tiny_dims.v_head_dim)
        torch.testing.assert_close(out, want_out[a:b], atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, want_lse[a:b], atol=1e-12, rtol=0)  # -inf where a row has no key


def test_sparse_reference_refuses_a_non_causal_pick(ref, tiny_dims):
    from mla_bridge.reference import reference_sparse_request

    batch = ref.make_mla_batch(tiny_dims, [2], [3], 4)
    args = (batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table[0], 3, tiny_dims)
    with pytest.raises(ValueError, match=r"topk_indices\[0, 1\] = 4"):
        reference_sparse_request(*args, torch.tensor([[0, 4], [4, -1]]))
    with pytest.raises(ValueError, match="topk_indices must be"):
        reference_sparse_request(*args, torch.tensor([0, 1]))


@pytest.mark.gpu
@pytest.mark.parametrize("indices", ["indexer", "random"])
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_prefill_sparse_on_cuda_in_bf16_passes_its_check(tmp_path, indices, cache):
    """DeepSeek-V3.2's dims at its index_topk (2048), context longer than K, bf16 on the GPU (the default dtype
    there), bf16 and FP8 caches: the sparse pass within the bf16 tolerance of the float64 sparse attention over the
    same picks, every request checked."""
    path = tmp_path / "out.json"
    argv = ["prefill", "--device", "cuda", "--model", "deepseek-v3.2", "--batch", "2", "--prompt-len", "512"]
    argv += ["--context-lens", "4096,1000", "--index-topk", "2048", "--indices", indices, "--kv-cache-dtype", cache]
    assert main(argv + ["--check-requests", "2", "--layers", "2", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["dtype"] == "bfloat16" and res["schedule"] == "sparse" and res["check"]["passed"] is True
    picks = sum(min(2048, c + j + 1) for c in (4096, 1000) for j in range(512))
    assert res["sparse"]["selected_pairs"] == picks and res["tflops"] > 0
    assert [c["request"] for c in res["check"]["requests"]] == [0, 1]


def test_random_indexer_weights_and_rope_feed_the_reference_indexer():
    """The random indexer's shape and scale (N(0, 1/fan_in), LayerNorm 1 / 0), and the half-split RoPE table (cos of
    position x frequency, the frequencies repeated): what the CLI and the bench hand indexer_topk."""
    from mla_bridge.indexer import DEEPSEEK_V32_INDEXER, random_indexer_weights, rope_cos_sin

    g = torch.Generator().manual_seed(0)
    w = random_indexer_weights(64, generator=g)
    s = DEEPSEEK_V32_INDEXER
    assert w.wq_b.shape == (s["index_n_heads"] * s["index_head_dim"], s["q_lora_rank"])
    assert w.wk.shape == (s["index_head_dim"], s["hidden_size"]) and w.weights_proj.shape == (64, s["hidden_size"])
    assert w.wk.std().item() == pytest.approx(s["hidden_size"] ** -0.5, rel=0.02)
    assert torch.equal(w.k_norm_weight, torch.ones(128)) and torch.equal(w.k_norm_bias, torch.zeros(128))
    cos, sin = rope_cos_sin(5, 8)
    freqs = 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    want = torch.arange(5.0)[:, None] * freqs[None, :]
    torch.testing.assert_close(cos, torch.cat([want.cos(), want.cos()], -1))
    torch.testing.assert_close(sin, torch.cat([want.sin(), want.sin()], -1))
    with pytest.raises(ValueError, match="rope_dim"):
        random_indexer_weights(7, generator=g, n_heads=2, head_dim=16, q_lora_rank=8, hidden_size=8)


def test_check_says_why_it_checked_fewer_requests_than_asked(capsys):
    """A request without new tokens has no output to check: the check row says why it checked fewer than asked."""
    argv = ["prefill", "--device", "cpu", "--prompt-lens", "1,0,5", "--context-lens", "0,7,30", "--no-breakdown"]
    assert main(argv + ["--check-requests", "3"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "requests [0, 2] (1 request without new tokens: nothing to check)" in text
    assert main(argv + ["--check-requests", "1"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "requests [2] against" in text and "without new tokens" not in text
