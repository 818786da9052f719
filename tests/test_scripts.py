"""scripts/test.sh: its arguments reach both suites, test paths reach the suite they belong to, and "no test
selected" (pytest exit 5) in one suite is a success only when the other suite ran tests.

The two virtual environments are stand-ins: a ``bin/python`` that answers every set-up probe with success and, for
``-m pytest``, records its arguments and exits with the code the test asks for. So this runs the real scripts in
milliseconds, without pip or vLLM.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTEST = ["-q", "-W", "ignore::DeprecationWarning:torch.jit._script"]  # scripts/test_vllm.sh's own options

STUB = """#!/usr/bin/env bash
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pytest" ]; then
    shift 2
    printf '%s\\n' "$*" > "$STUB_LOG_DIR/@SUITE@.args"
    exit "${STUB_@SUITE@_RC:-0}"
fi
exit 0
"""


def _venv(tmp_path: Path, suite: str) -> Path:
    venv = tmp_path / f"venv-{suite}"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    py = venv / "bin" / "python"
    py.write_text(STUB.replace("@SUITE@", suite))
    py.chmod(0o755)
    return venv


def run_test_sh(tmp_path: Path, *args: str, core_rc: int = 0, vllm_rc: int = 0, skip_vllm: bool = False):
    """Run scripts/test.sh with stand-in venvs; returns (rc, output, core args or None, vLLM args or None)."""
    core, vllm = _venv(tmp_path, "core"), _venv(tmp_path, "vllm")
    (vllm / ".mla-bridge-vllm-stamp").write_text("vllm==0.32.0 lean-v1\n")
    for name in ("core.args", "vllm.args"):
        (tmp_path / name).unlink(missing_ok=True)
    env = dict(
        os.environ,
        MLA_BRIDGE_VENV=str(core),
        VLLM_VENV=str(vllm),
        VLLM_VERSION="0.32.0",
        STUB_LOG_DIR=str(tmp_path),
        STUB_core_RC=str(core_rc),
        STUB_vllm_RC=str(vllm_rc),
        MLA_BRIDGE_SKIP_VLLM="1" if skip_vllm else "0",
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh"), *args], env=env, capture_output=True, text=True, timeout=60
    )
    got = [(tmp_path / n).read_text().split() if (tmp_path / n).exists() else None for n in ("core.args", "vllm.args")]
    return proc.returncode, proc.stdout + proc.stderr, got[0], got[1]


@pytest.fixture(autouse=True)
def _bash():
    if subprocess.run(["bash", "-c", "true"]).returncode != 0:  # pragma: no cover
        pytest.skip("needs bash")


def test_arguments_reach_both_suites(tmp_path):
    rc, out, core, vllm = run_test_sh(tmp_path, "-k", "cli", "-x")
    assert rc == 0, out
    assert core == ["-q", "tests", "--ignore=tests/vllm", "-k", "cli", "-x"]
    assert vllm == VLLM_PYTEST + [
        "-m",
        "not",
        "gpu",
        "tests/vllm",
        "tests/parity/test_vllm_parity.py",
        "-k",
        "cli",
        "-x",
    ]


def test_a_keyword_value_that_names_a_folder_is_not_a_path(tmp_path):
    rc, out, core, vllm = run_test_sh(tmp_path, "-k", "tests")
    assert rc == 0, out
    assert core[-2:] == ["-k", "tests"] and "tests/vllm" in vllm


@pytest.mark.parametrize(
    "core_rc,vllm_rc,want", [(0, 5, 0), (5, 0, 0), (5, 5, 5), (1, 5, 1), (5, 1, 1), (0, 1, 1), (2, 0, 2)]
)
def test_exit_five_in_one_suite_is_fine_only_when_the_other_ran_tests(tmp_path, core_rc, vllm_rc, want):
    rc, out, _, _ = run_test_sh(tmp_path, "-k", "cli", core_rc=core_rc, vllm_rc=vllm_rc)
    assert rc == want, out
    if want == 5:
        assert "no test ran in either suite" in out
    if want:
        assert "FAILED" in out


def test_no_test_and_no_vllm_suite_fails(tmp_path):
    rc, out, core, vllm = run_test_sh(tmp_path, "-k", "nothing", core_rc=5, skip_vllm=True)
    assert rc == 5 and vllm is None and core is not None, out


def test_paths_go_to_their_own_suite(tmp_path):
    rc, out, core, vllm = run_test_sh(tmp_path, "tests/test_cli.py", "-x")
    assert rc == 0, out
    assert core == ["-q", "tests/test_cli.py", "--ignore=tests/vllm", "-x"] and vllm is None, out
    rc, out, core, vllm = run_test_sh(tmp_path, "tests/vllm/test_vllm_forward.py::test_batch_spans_the_cases")
    assert rc == 0, out
    assert core is None
    assert vllm == VLLM_PYTEST + ["-m", "not", "gpu", "tests/vllm/test_vllm_forward.py::test_batch_spans_the_cases"]


FLAKY_PIP = """#!/usr/bin/env bash
# a stand-in python whose "-m pip" fails its first $FAILS calls (a download cut short), then succeeds
n=$(cat "$COUNT" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$COUNT"
if [ "$n" -le "$FAILS" ]; then echo "Download failed: not enough bytes were received" >&2; exit 1; fi
exit 0
"""


@pytest.mark.parametrize(
    "script,call", [("test.sh", "pip_install some-package"), ("test_vllm.sh", "quiet_pip install -q some-package")]
)
@pytest.mark.parametrize("fails,rc,calls", [(0, 0, 1), (2, 0, 3), (3, 1, 3)])
def test_pip_installs_are_tried_three_times(tmp_path, script, call, fails, rc, calls):
    """Both scripts' pip helpers try an install 3 times: a CI run failed on a vLLM download cut short (2026-12-01).
    The helper is taken from the script as it stands and run with a stand-in python whose pip fails ``fails``
    times: it succeeds within 3 attempts, else fails with pip's output shown."""
    py = tmp_path / "python"
    py.write_text(FLAKY_PIP)
    py.chmod(0o755)
    text = (ROOT / "scripts" / script).read_text()
    function = call.split()[0]
    start = text.index(f"{function}() {{")
    body = text[start : text.index("\n}\n", start) + 3]
    proc = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{body}\n{call}"],
        env={**os.environ, "PY": str(py), "COUNT": str(tmp_path / "n"), "FAILS": str(fails)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == rc, proc.stderr
    assert int((tmp_path / "n").read_text()) == calls
    # test.sh shows pip's output as it comes (every failed attempt's), test_vllm.sh only when it gives up
    shown = min(fails, 3) if script == "test.sh" else int(rc != 0)
    assert (proc.stdout + proc.stderr).count("not enough bytes") == shown
    assert proc.stderr.count("trying again") == min(fails, 2)
