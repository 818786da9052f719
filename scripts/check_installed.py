"""Smoke test of the INSTALLED mla-bridge (a wheel in a clean venv), run from outside the checkout.

    python scripts/check_installed.py STAGE       (scripts/check.sh runs it from a temporary folder)

Stages, one per set of extras installed:
  core          torch + the wheel alone: mla_bridge imports from site-packages, its metadata asks for torch and
                numpy only, every package carries py.typed, a small ragged_prefill and mla_prefill on the CPU equal
                a float64 reference; without the cli extra `mla-bridge info` exits 2 naming it; each adapter whose
                framework is missing fails with an ImportError naming the framework.
  cli           + [cli]: `mla-bridge --version`, `mla-bridge info --json`, a tiny `mla-bridge prefill`.
  jax           + [jax]: mla_bridge_jax.ragged_prefill on the CPU equals the torch core's.
  transformers  + [transformers]: mla_bridge_transformers.register() registers the attention function.
Prints one line per check and a closing summary; exits 1 when a check failed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

CHECKOUT = Path(__file__).resolve().parents[1]
PACKAGES = ("mla_bridge", "mla_bridge_jax", "mla_bridge_vllm", "mla_bridge_transformers")
RESULTS: list[tuple[str, bool]] = []


def check(name: str) -> Callable:
    def run(fn: Callable[[], None]) -> Callable:
        try:
            fn()
        except Exception:  # noqa: BLE001 - every check is reported, the next one still runs
            RESULTS.append((name, False))
            print(f"FAILED {name}\n{traceback.format_exc()}", flush=True)
        else:
            RESULTS.append((name, True))
            print(f"ok     {name}", flush=True)
        return fn

    return run


def bin_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([bin_path("mla-bridge"), *args], capture_output=True, text=True, env=env, timeout=300)


def ragged_case():
    """Two causal requests (3 queries over 5 keys, 4 over 4) with a float64 reference (bottom-right aligned)."""
    import torch

    g = torch.Generator().manual_seed(0)
    qo, kv, h, dqk, dvo, scale = [0, 3, 7], [0, 5, 9], 2, 16, 8, 0.25
    q = torch.randn(7, h, dqk, generator=g)
    k = torch.randn(9, h, dqk, generator=g)
    v = torch.randn(9, h, dvo, generator=g)
    outs, lses = [], []
    for r in range(2):
        qr, kr, vr = q[qo[r] : qo[r + 1]].double(), k[kv[r] : kv[r + 1]].double(), v[kv[r] : kv[r + 1]].double()
        s = torch.einsum("qhd,khd->hqk", qr, kr) * scale
        nq, nk = qr.shape[0], kr.shape[0]
        mask = torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + (nk - nq)
        s = s.masked_fill(mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vr))
        lses.append(torch.logsumexp(s, -1).T)
    return (q, k, v, qo, kv, scale), torch.cat(outs), torch.cat(lses)


def stage_core() -> None:
    @check("mla_bridge is imported from the installed wheel, not the checkout")
    def _():
        import mla_bridge

        where = Path(mla_bridge.__file__).resolve()
        assert "site-packages" in where.parts, where
        assert CHECKOUT not in where.parents, where

    @check("one version: mla_bridge.__version__ is the distribution's")
    def _():
        import mla_bridge

        assert mla_bridge.__version__ == md.version("mla-bridge"), (mla_bridge.__version__, md.version("mla-bridge"))

    @check("a plain install asks for torch and numpy only")
    def _():
        plain = sorted(
            r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip()
            for r in md.requires("mla-bridge")
            if "extra ==" not in r
        )
        assert plain == ["numpy", "torch"], plain

    @check("py.typed in every package, LICENSE in the distribution")
    def _():
        files = {str(f) for f in md.files("mla-bridge")}
        for pkg in PACKAGES:
            assert f"{pkg}/py.typed" in files, pkg
        assert any(f.endswith("LICENSE") for f in files), sorted(f for f in files if "dist-info" in f)

    @check("the cli extra's packages are not installed (this stage is torch + the wheel)")
    def _():
        for name in ("rich", "matplotlib", "safetensors"):
            assert importlib.util.find_spec(name) is None, name

    @check("ragged_prefill on the CPU equals a float64 reference")
    def _():
        import torch
        from mla_bridge import ragged_prefill

        (q, k, v, qo, kv, scale), ref_out, ref_lse = ragged_case()
        out, lse = ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=scale)
        assert out.shape == (7, 2, 8) and lse.shape == (7, 2) and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)

    @check("mla_prefill on the CPU: a plan, a paged cache, the fused and the chunked schedule agree")
    def _():
        import torch
        from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill

        dims = MLADims(
            num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, softmax_scale=0.2
        )
        g = torch.Generator().manual_seed(1)
        q_lens, c_lens, bs = [4, 2], [6, 9], 4
        t = sum(q_lens)
        q = torch.randn(t, 2, 24, generator=g)
        kv_c, k_pe = torch.randn(t, 32, generator=g), torch.randn(t, 8, generator=g)
        w = torch.randn(2 * 32, 32, generator=g) / 6
        cache = torch.randn(8, bs, 40, generator=g)
        table = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
        outs = []
        for fuse, budget in ((True, 64), (False, 4)):
            plan = PrefillPlan.build(
                q_lens,
                c_lens,
                dims=dims,
                workspace=Workspace("cpu", chunk_tokens=budget),
                block_size=bs,
                dtype=torch.float32,
                fuse_context=fuse,
            )
            outs.append(mla_prefill(q, kv_c, k_pe, w, cache, table, plan))
        assert outs[0].shape == (t, 2, 16)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)

    @check("`mla-bridge info` without the cli extra: exit 2, naming the package and the extra")
    def _():
        proc = run_cli("info")
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        assert "rich" in proc.stderr and "mla-bridge[cli]" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr

    @check("an adapter whose framework is missing fails naming the framework")
    def _():
        missing = [name for name in ("jax", "vllm", "transformers") if importlib.util.find_spec(name) is None]
        assert missing, "expected the frameworks to be absent in this stage"
        if "jax" in missing:
            try:
                importlib.import_module("mla_bridge_jax")
            except ImportError as err:
                assert "jax" in str(err), err
            else:
                raise AssertionError("mla_bridge_jax imported without JAX")
        for pkg, framework in (("mla_bridge_vllm", "vllm"), ("mla_bridge_transformers", "transformers")):
            if framework not in missing:
                continue
            mod = importlib.import_module(pkg)  # these import lazily; register() needs the framework
            try:
                mod.register()
            except ImportError as err:
                assert framework in str(err), err
            else:
                raise AssertionError(f"{pkg}.register() ran without {framework}")


def stage_cli() -> None:
    @check("`mla-bridge --version` is the installed version")
    def _():
        proc = run_cli("--version")
        assert proc.returncode == 0 and md.version("mla-bridge") in proc.stdout, (proc.stdout, proc.stderr)

    @check("`mla-bridge info --json`: exit 0, the MLA_BRIDGE_* variables, float32 on the CPU")
    def _():
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "info.json"
            proc = run_cli("info", "--json", str(path))
            assert proc.returncode == 0, (proc.stdout, proc.stderr)
            info = json.loads(path.read_text())
        assert len(info["environment"]) >= 8 and info["dtype"] in ("float32", "bfloat16")
        assert "MLA_BRIDGE_JAX_MAX_PLANS" in proc.stdout

    @check("a tiny `mla-bridge prefill` passes its float64 check")
    def _():
        proc = run_cli(
            "prefill",
            "--device",
            "cpu",
            "--batch",
            "2",
            "--prompt-len",
            "16",
            "--context-lens",
            "32",
            "--check-requests",
            "1",
            "--no-breakdown",
        )
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
        assert "PASS" in proc.stdout


def stage_jax() -> None:
    @check("mla_bridge_jax.ragged_prefill on the CPU equals the torch core")
    def _():
        import jax.numpy as jnp
        import numpy as np
        import torch

        import mla_bridge_jax as mj
        from mla_bridge import ragged_prefill

        (q, k, v, qo, kv, scale), _, _ = ragged_case()
        out, lse = mj.ragged_prefill(
            jnp.asarray(q.numpy()), jnp.asarray(k.numpy()), jnp.asarray(v.numpy()), qo, kv, causal=True, sm_scale=scale
        )
        ref_out, ref_lse = ragged_prefill(q, k, v, qo, kv, causal=True, sm_scale=scale)
        np.testing.assert_allclose(np.asarray(out), ref_out.numpy(), atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), ref_lse.numpy(), atol=1e-6, rtol=1e-6)
        assert isinstance(torch.__version__, str)


def stage_transformers() -> None:
    @check("mla_bridge_transformers.register() registers the attention function")
    def _():
        from transformers import AttentionInterface

        import mla_bridge_transformers

        name = mla_bridge_transformers.register()
        assert name == "mla_bridge" and name in AttentionInterface()


STAGES = {"core": stage_core, "cli": stage_cli, "jax": stage_jax, "transformers": stage_transformers}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in STAGES:
        print(f"usage: python {Path(__file__).name} {{{','.join(STAGES)}}}", file=sys.stderr)
        return 2
    if Path.cwd().resolve() == CHECKOUT or CHECKOUT in Path.cwd().resolve().parents:
        print("run it from outside the checkout (it tests the installed package)", file=sys.stderr)
        return 2
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != CHECKOUT / "scripts"]
    STAGES[argv[0]]()
    failed = sum(not ok for _, ok in RESULTS)
    print(
        f"check_installed {argv[0]}: "
        + (f"all {len(RESULTS)} checks passed" if not failed else f"{failed} of {len(RESULTS)} checks FAILED")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
