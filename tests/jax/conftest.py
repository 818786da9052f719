"""JAX adapter tests: skip the folder cleanly when JAX is absent, and keep torch to one CPU thread (torch's OpenMP
threads and XLA's thread pool thrash a small CPU machine: 100x slowdowns). ``adapters/`` is importable through
pytest's ``pythonpath`` (pyproject.toml)."""

import importlib.util
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if importlib.util.find_spec("jax") is None:  # every module here also does pytest.importorskip("jax")
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    yield


@pytest.fixture(scope="session")
def repo_root():
    return _ROOT
