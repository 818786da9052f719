"""JAX adapter tests: make ``adapters/`` importable, skip the folder cleanly when JAX is absent, and keep torch to
one CPU thread (torch's OpenMP threads and XLA's thread pool thrash a small CPU machine: 100x slowdowns)."""

import importlib.util
import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ADAPTERS = os.path.join(_ROOT, "adapters")
if _ADAPTERS not in sys.path:
    sys.path.insert(0, _ADAPTERS)

if importlib.util.find_spec("jax") is None:  # every module here also does pytest.importorskip("jax")
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    yield


@pytest.fixture(scope="session")
def repo_root():
    return _ROOT
