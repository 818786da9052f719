"""examples/bench_transformers_ttft.py runs end to end (CPU smoke: tiny model, one timed run)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "examples",
    "bench_transformers_ttft.py",
)


def _load():
    spec = importlib.util.spec_from_file_location("bench_transformers_ttft", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_ttft_script_quick(tmp_path, two_torch_threads):
    mod = _load()
    out = tmp_path / "ttft.json"
    rows = mod.main(
        [
            "--quick",
            "--layers",
            "1",
            "--prompt-len",
            "8",
            "--batch",
            "1",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert [r["attn_implementation"] for r in rows] == ["sdpa", "mla_bridge"]
    assert all(r["ttft_ms"] > 0 for r in rows)
    assert rows[-1]["same_first_token"] is True and rows[-1]["ratio_sdpa_over_mla_bridge"] > 0
    assert out.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--batch", "0"],
        ["--repeats", "0"],
        ["--prompt-len", "0"],
        ["--layers", "x"],
        ["--json", "/nonexistent-dir/x.json"],
    ],
)
def test_ttft_script_refuses_bad_arguments_before_work(args, capsys, tmp_path):
    """--batch 0 and --repeats 0 gave tracebacks after the model was built, --prompt-len 0 silently ran 64 tokens, and
    an unwritable --json failed only at the end."""
    mod = _load()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--quick", *args])
    assert exc.value.code == 2 and args[0] in capsys.readouterr().err


@pytest.mark.parametrize("name", ["prefill_deepseek_v2_lite.py", "jax_prefill.py"])
def test_examples_answer_help_without_running(name):
    res = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(_EXAMPLE), name), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout.startswith("usage:"), res.stderr[-2000:]
