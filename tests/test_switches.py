"""mla_bridge.switches: each MLA_BRIDGE_* variable read and validated in one place, its readers raising its errors,
``mla-bridge info`` listing every switch from its table; and BackendChoice.forced."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from mla_bridge import MLADims, switches
from mla_bridge.cli import main
from mla_bridge.dispatch import BACKEND_NAMES, select_backend

# (variable, its function, values it takes -> what the function returns, a value it refuses, the refusal's text)
CASES = [
    (
        switches.BACKEND,
        switches.backend,
        {None: None, "": None, " FlashInfer-FA2 ": "flashinfer-fa2", "auto": "auto", "torch": "torch"},
        "fa9",
        "MLA_BRIDGE_BACKEND: unknown backend 'fa9'; expected one of "
        "['flashinfer-cutlass', 'flashinfer-fa3', 'flashinfer-fa2', 'torch'] or 'auto'",
    ),
    (
        switches.KV,
        switches.kv,
        {None: "", "": "", " AUTO ": "auto", "Fused": "fused", "separate": "separate"},
        "cublas",
        "MLA_BRIDGE_KV must be one of ('fused', 'separate') or 'auto', got 'cublas'",
    ),
    (
        switches.GATHER,
        switches.gather,
        {None: "auto", "": "auto", "auto": "auto", " Torch": "torch", "triton": "triton"},
        " CUDA ",
        "MLA_BRIDGE_GATHER='cuda': expected torch, triton or auto",
    ),
    (
        switches.MERGE,
        switches.merge,
        {None: None, "": None, "auto": None, "TORCH": "torch", "flashinfer": "flashinfer", "triton": "triton"},
        "cutlass",
        "MLA_BRIDGE_MERGE='cutlass': expected one of triton, flashinfer, torch or auto",
    ),
    (
        switches.SPARSE,
        switches.sparse,
        {None: "auto", "": "auto", " AUTO ": "auto", "Torch": "torch", "triton": "triton"},
        "flashmla",
        "MLA_BRIDGE_SPARSE='flashmla': expected one of triton, torch or auto",
    ),
    (
        switches.FLASHINFER_DIRECT,
        switches.flashinfer_direct,
        {None: True, "": True, "1": True, "auto": True, " 0 ": False},
        "off",
        "MLA_BRIDGE_FLASHINFER_DIRECT='off': expected 1 (direct runs, the default), 0 (wrapper.run) or auto",
    ),
    (
        switches.TRITON_LAUNCH,
        switches.triton_launch,
        {None: "direct", "": "direct", "auto": "direct", "Direct": "direct", "JIT": "jit"},
        "fast",
        "MLA_BRIDGE_TRITON_LAUNCH='fast': expected one of ('direct', 'jit') or auto",
    ),
    (
        switches.JAX_JIT_ROUTE,
        switches.jax_jit_route,
        {None: "auto", "": "auto", "tvm_ffi": "tvm_ffi", "buffer_callback": "buffer_callback"},
        "AUTO",
        "$MLA_BRIDGE_JAX_JIT_ROUTE (jit_route not given) must be one of "
        "['auto', 'buffer_callback', 'tvm_ffi'], got 'AUTO'",
    ),
    (
        switches.JAX_MAX_PLANS,
        switches.jax_max_plans,
        {None: 16, "": 16, " 4 ": 4, "1": 1},
        "0",
        "MLA_BRIDGE_JAX_MAX_PLANS='0': expected a positive int (plans held at once; unset: 16)",
    ),
]


def _set(monkeypatch, name, value):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("name,read,accepted,refused,message", CASES, ids=[c[0] for c in CASES])
def test_each_switch_reads_its_values_and_refuses_others_by_name(monkeypatch, name, read, accepted, refused, message):
    for value, expected in accepted.items():
        _set(monkeypatch, name, value)
        assert read() == expected, (name, value)
    monkeypatch.setenv(name, refused)
    with pytest.raises(ValueError) as err:
        read()
    assert str(err.value) == message


def test_the_debug_switch_never_refuses(monkeypatch):
    for value, on in {
        None: False,
        "": False,
        "0": False,
        "off": False,
        "bogus": False,
        " 1": True,
        "TRUE": True,
    }.items():
        _set(monkeypatch, switches.DEBUG, value)
        assert switches.debug() is on, value


def test_every_switch_is_read_per_call_not_remembered(monkeypatch):
    """The functions read the environment each time they are called (the readers call them when they read today)."""
    monkeypatch.setenv(switches.MERGE, "torch")
    assert switches.merge() == "torch"
    monkeypatch.setenv(switches.MERGE, "triton")
    assert switches.merge() == "triton"
    monkeypatch.setenv(switches.JAX_MAX_PLANS, "5")
    assert switches.jax_max_plans() == 5
    assert switches.raw(switches.MERGE) == "triton"


def test_the_table_lists_each_switch_once_and_the_dispatch_table_backends():
    names = [sw.name for sw in switches.SWITCHES]
    assert len(names) == len(set(names)) == 10
    assert {c[0] for c in CASES} | {switches.DEBUG} == set(names)
    assert set(switches.KERNEL_SWITCHES) <= set(names)
    assert switches.BACKEND_NAMES == BACKEND_NAMES
    for sw in switches.SWITCHES:
        assert sw.name.startswith("MLA_BRIDGE_") and sw.values and sw.default and sw.doc and sw.read_by


def _readers():
    """Each kernel chooser with the switch it reads (the errors are the switch's, raised through the chooser)."""
    from mla_bridge.backends.flashinfer import direct_enabled
    from mla_bridge.cache import gather_impl
    from mla_bridge.kernels.launch import mode
    from mla_bridge.kv import kv_impl
    from mla_bridge.merge import select_merge
    from mla_bridge.sparse import select_sparse

    return [
        (switches.BACKEND, lambda: select_backend("cpu", dtype=torch.float32, head_dim_qk=192, head_dim_vo=128)),
        (switches.KV, lambda: kv_impl(torch.device("cpu"))),
        (switches.GATHER, lambda: gather_impl(torch.device("cpu"))),
        (switches.MERGE, lambda: select_merge((4, 2, 16), torch.float32, "cpu")),
        (switches.SPARSE, lambda: select_sparse(MLADims.preset("deepseek-v3.2"), torch.bfloat16, "cpu")),
        (switches.FLASHINFER_DIRECT, direct_enabled),
        (switches.TRITON_LAUNCH, mode),
    ]


@pytest.mark.parametrize("index", range(7), ids=list(switches.KERNEL_SWITCHES))
def test_the_choosers_raise_the_switch_error(monkeypatch, index):
    name, call = _readers()[index]
    refused, message = next((c[3], c[4]) for c in CASES if c[0] == name)
    monkeypatch.setenv(name, refused)
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message


@pytest.mark.parametrize("name", [switches.TRITON_LAUNCH, switches.FLASHINFER_DIRECT])
def test_mla_prefill_refuses_a_bad_launch_or_direct_switch_before_any_work(monkeypatch, name):
    from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill

    d = MLADims(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, softmax_scale=0.3)
    plan = PrefillPlan.build([3], [0], dims=d, workspace=Workspace("cpu"), block_size=4, dtype=torch.float32)
    q = torch.randn(3, 2, 16)
    out = torch.full((3, 2, 8), 7.0)
    args = (q, torch.randn(3, 16), torch.randn(3, 8), torch.randn(32, 16), torch.zeros(1, 4, 24))
    refused, message = next((c[3], c[4]) for c in CASES if c[0] == name)
    monkeypatch.setenv(name, refused)
    with pytest.raises(ValueError, match=re.escape(message)):
        mla_prefill(*args, torch.zeros(1, 1, dtype=torch.int32), plan, out=out)
    assert bool((out == 7.0).all())  # nothing written
    monkeypatch.delenv(name)
    mla_prefill(*args, torch.zeros(1, 1, dtype=torch.int32), plan, out=out)


def test_info_lists_every_switch_from_the_table_with_its_value_and_allowed_values(tmp_path, capsys, monkeypatch):
    for sw in switches.SWITCHES:
        monkeypatch.delenv(sw.name, raising=False)
    monkeypatch.setenv(switches.GATHER, "bogus")  # listed as set: info reports, it does not refuse
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    env = json.loads(path.read_text())["environment"]
    assert [e["name"] for e in env] == [sw.name for sw in switches.SWITCHES]
    for e, sw in zip(env, switches.SWITCHES):
        assert (e["default"], e["values"], e["meaning"], e["read_by"]) == (sw.default, sw.values, sw.doc, sw.read_by)
        assert e["value"] == ("bogus" if sw.name == switches.GATHER else None)
    text = capsys.readouterr().out  # a table whose cells wrap: words, not whole lines
    for sw in switches.SWITCHES:
        assert f"  {sw.name} " in text
    assert "'bogus'" in text and text.count("values:") == len(switches.SWITCHES)


# ----------------------------------------------------------------------------------------------- BackendChoice.forced


def test_a_backend_asked_for_by_name_is_forced_and_the_table_choice_is_not(monkeypatch):
    monkeypatch.delenv(switches.BACKEND, raising=False)
    kw = dict(dtype=torch.float32, head_dim_qk=192, head_dim_vo=128, causal=True)
    table = select_backend("cpu", **kw)
    assert table.name == "torch" and not table.forced and not table.reason.startswith("forced")
    assert not select_backend("cpu", requested="auto", **kw).forced  # auto: the table decides
    asked = select_backend("cpu", requested="torch", **kw)
    assert asked.forced and asked.reason == "forced by requested" and asked.name == "torch"
    monkeypatch.setenv(switches.BACKEND, " Torch ")
    by_env = select_backend("cpu", **kw)
    assert by_env.forced and by_env.reason == "forced by MLA_BRIDGE_BACKEND"
    monkeypatch.setenv(switches.BACKEND, "auto")
    assert not select_backend("cpu", **kw).forced


def test_max_plans_bounds_the_shared_plan_cache_without_the_jax_adapter():
    """``MLA_BRIDGE_JAX_MAX_PLANS`` is read when the shared plan cache is first made, by the core: the transformers
    and vLLM adapters get the bound without JAX imported. Before, only ``import mla_bridge_jax`` applied it, and that
    import resized the cache the other adapters had already set."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (
        "import sys\n"
        "from mla_bridge.plan_cache import shared_plan_cache\n"
        "assert shared_plan_cache().maxsize == 3, shared_plan_cache().maxsize\n"
        "assert 'mla_bridge_jax' not in sys.modules and 'jax' not in sys.modules\n"
        "shared_plan_cache().maxsize = 7\n"
        "import mla_bridge_jax\n"
        "assert shared_plan_cache().maxsize == 7, shared_plan_cache().maxsize\n"
        "print('OK')\n"
    )
    env = dict(os.environ, MLA_BRIDGE_JAX_MAX_PLANS=" 3 ", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "adapters"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr


def test_problem_names_an_invalid_value(monkeypatch):
    """``switches.problem(name)``: the reader's message for the value set now, or None (unset, valid, or a switch
    that takes anything); ``mla-bridge info`` flags it."""
    monkeypatch.setenv(switches.JAX_MAX_PLANS, "bogus")
    assert switches.problem(switches.JAX_MAX_PLANS) == (
        "MLA_BRIDGE_JAX_MAX_PLANS='bogus': expected a positive int (plans held at once; unset: 16)"
    )
    monkeypatch.setenv(switches.JAX_MAX_PLANS, "4")
    assert switches.problem(switches.JAX_MAX_PLANS) is None
    monkeypatch.setenv(switches.BACKEND, "cudnn")
    assert "unknown backend 'cudnn'" in switches.problem(switches.BACKEND)
    monkeypatch.setenv(switches.DEBUG, "bogus")
    assert switches.problem(switches.DEBUG) is None
    assert {sw.name for sw in switches.SWITCHES if switches.problem(sw.name) is None} >= {switches.DEBUG}
