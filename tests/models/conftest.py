"""Fixtures of the model tests: small random DeepSeek checkpoints written by transformers (once per session)."""

from __future__ import annotations

import pytest
import torch

from . import hf_deepseek


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(name)`` -> folder of a 1-layer random model at the published attention dims of ``name``
    ("v2-lite" or "v3"), written once per session by transformers' ``save_pretrained``."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = hf_deepseek.write_checkpoint(name, tmp_path_factory.mktemp(f"ckpt-{name}"), seed=1)
        return made[name]

    return get


@pytest.fixture
def two_torch_threads():
    """At most 2 torch threads (the CI machine has 2 cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)
