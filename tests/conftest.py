"""Shared test set-up for the core suite.

* The ``gpu`` marker: tests marked ``@pytest.mark.gpu`` are skipped unless CUDA is available and FlashInfer imports.
* ``MLA_BRIDGE_BACKEND`` is cleared for every test so that a developer's shell cannot change what is tested.
* ``triton_interpreted``: runs a test module's function under ``TRITON_INTERPRET=1`` in a subprocess (Triton kernels
  on CPU tensors), skipped where Triton is missing (CI) or CUDA is present (the GPU tests cover compiled kernels).
* ``fake_cuda_runtime``: makes torch report one CUDA device with stand-in streams and events, and
  ``mla_bridge.workspace`` allocate its "device" buffers on the CPU, so that the CUDA branches of planning and running
  can be exercised on a CPU-only machine.
* ``ref``: independent float64 references (dense attention with an explicit mask, MLA prefill over the whole
  sequence rebuilt from the paged cache) and builders of random inputs, from :mod:`tests.helpers.reference`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from typing import Optional

import pytest
import torch

from tests.helpers.reference import (
    TINY,
    assert_lse_close,
    assert_out_close,
    bottom_right_mask,
    cumsum0,
    dense_attention,
    make_mla_batch,
    make_ragged,
    mla_reference,
    ragged_reference,
)


def _gpu_skip_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import flashinfer  # noqa: F401
    except Exception as err:  # pragma: no cover - depends on the machine
        return f"needs FlashInfer (import flashinfer failed: {err})"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv("MLA_BRIDGE_BACKEND", raising=False)


@pytest.fixture(scope="session")
def ref():
    """The float64 references and input builders, as one namespace."""
    return types.SimpleNamespace(
        TINY=TINY,
        cumsum0=cumsum0,
        dense_attention=dense_attention,
        bottom_right_mask=bottom_right_mask,
        ragged_reference=ragged_reference,
        make_ragged=make_ragged,
        make_mla_batch=make_mla_batch,
        mla_reference=mla_reference,
        assert_lse_close=assert_lse_close,
        assert_out_close=assert_out_close,
        log=math.log,
    )


@pytest.fixture
def tiny_dims():
    from mla_bridge import MLADims

    return MLADims(**TINY)


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test: on a small CPU machine torch's OpenMP threads and XLA's thread pool fight
    over the cores (100x slowdowns seen); the JAX and parity suites use it for every test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_INTERPRETED = r"""
import importlib, os, sys
os.environ["TRITON_INTERPRET"] = "1"
os.environ.update(dict(a.split("=", 1) for a in sys.argv[2:]))
module, func = sys.argv[1].split(":")
print(getattr(importlib.import_module(module), func)())
"""


@pytest.fixture
def triton_interpreted():
    """``run("tests.test_x:func", gpu_tests="tests/gpu/...", **env) -> stdout``: ``func()`` run under
    ``TRITON_INTERPRET=1`` in a subprocess (so the variable is set before Triton is imported and nothing leaks into
    this process), with ``env`` added to its environment; the test is skipped where Triton is not installed (CI)
    and on a CUDA machine (where ``gpu_tests`` cover the compiled kernel). Fails with the subprocess's stderr."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001
        pytest.skip("Triton is not installed (the GPU tests cover the compiled kernel)")

    def run(target: str, gpu_tests: str, **env: str) -> str:
        if torch.cuda.is_available():
            pytest.skip(f"on a GPU machine the compiled kernel is tested in {gpu_tests}")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join([root, os.path.join(root, "adapters"), *filter(None, [os.environ.get("PYTHONPATH")])])
        res = subprocess.run(
            [sys.executable, "-c", _INTERPRETED, target, *(f"{k}={v}" for k, v in env.items())],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, PYTHONPATH=path),  # the checkout, as pytest's pythonpath gives this process
        )
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    return run


@pytest.fixture
def fake_cuda_runtime(monkeypatch):
    """``install(capability, current_stream, event_class, capturing)``: torch reports one CUDA device of
    ``capability()`` (CUDA 12.8), ``torch.cuda.current_stream`` returns ``current_stream()``, ``torch.cuda.Event`` is
    ``event_class``, ``is_current_stream_capturing`` returns ``capturing()``, and mla_bridge.workspace allocates on the
    CPU (:func:`tests.helpers.fake_device.install_runtime`, undone after the test). The callers add their own FlashInfer
    wrapper stand-in."""
    from tests.helpers.fake_device import install_runtime

    def install(capability, current_stream, event_class, capturing=lambda: False):
        install_runtime(monkeypatch.setattr, capability, current_stream, event_class, capturing)

    return install


@pytest.fixture
def nan_empty(monkeypatch):
    """Make every floating torch.empty (mla_bridge.prefill / ragged / backends all call it) return NaN; the list of the
    shapes made, so a test can check the NaN-filled buffers were used (tests/test_prefill.py, tests/test_ragged.py)."""
    real_empty = torch.empty
    made = []

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
            made.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return made
