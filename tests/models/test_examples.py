"""examples/bench_transformers_ttft.py runs end to end (CPU smoke: tiny model, one timed run)."""

from __future__ import annotations

import importlib.util
import os
import sys

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                        "bench_transformers_ttft.py")


def test_ttft_script_quick(tmp_path, two_torch_threads):
    spec = importlib.util.spec_from_file_location("bench_transformers_ttft", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "ttft.json"
    rows = mod.main(["--quick", "--layers", "1", "--prompt-len", "8", "--batch", "1", "--warmup", "0",
                     "--repeats", "1", "--json", str(out)])
    assert [r["attn_implementation"] for r in rows] == ["sdpa", "mla_bridge"]
    assert all(r["ttft_ms"] > 0 for r in rows)
    assert rows[-1]["same_first_token"] is True and rows[-1]["ratio_sdpa_over_mla_bridge"] > 0
    assert out.exists()
