"""The README's Python quick starts run as a user would paste them: each block in a fresh process, from a folder
outside the checkout, on the CPU. A block needing a framework that is not installed is skipped."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _needs(block: str) -> list[str]:
    return [name for name in ("jax", "transformers") if re.search(rf"^\s*(import|from) {name}\b", block, re.M)]


def test_the_readme_has_a_quick_start_for_pytorch_jax_and_transformers():
    assert len(BLOCKS) == 3
    assert [_needs(b) for b in BLOCKS] == [[], ["jax"], ["transformers"]]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_quick_start_runs_on_the_cpu(index, tmp_path):
    block = BLOCKS[index]
    missing = [name for name in _needs(block) if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    script = tmp_path / "quick_start.py"
    script.write_text(block)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "adapters")]),
        CUDA_VISIBLE_DEVICES="",
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.strip().splitlines()[-1]
    expected = {
        0: "torch.Size([387, 16, 128]) torch.Size([387, 16])",
        1: "(137, 16, 128) (137, 16) 0.0",
        2: "torch.Size([2, 16])",
    }[index]
    assert printed == expected
