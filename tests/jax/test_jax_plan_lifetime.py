"""Plan lifetime on the CPU: the JAX adapter's plans live exactly as long as the compiled functions that can call
them, within a documented bound; an evicted plan is made again transparently, never read after it was freed.

* buffer_callback route (the CPU jit route): plans made inside a trace (``ragged_prefill`` under ``jax.jit``) are
  held by the plan cache the adapters share (``mla_bridge.plan_cache.shared_plan_cache()``, bounded by its
  ``maxsize``) and no longer than the compiled function.
* tvm_ffi route: the registry is bounded by ``mla_bridge_jax.tvm_ffi.MAX_PLANS``; run here with the C++ shim and
  a stand-in compiled kernel (needs jax-tvm-ffi and a C++ compiler, skipped otherwise).
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import plan_cache  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402
from tests.helpers.tvm_ffi_stand_in import KERNEL, FakePlan, call  # noqa: E402

SM = 192**-0.5


def _qkv(t, s, h=2, seed=0):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((t, h, 192)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((s, h, 192)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((s, h, 128)), jnp.bfloat16),
    )


def _core(q, k, v, qo):
    return mla_bridge.ragged_prefill(
        torch.from_dlpack(q), torch.from_dlpack(k), torch.from_dlpack(v), qo, qo, causal=True, sm_scale=SM
    )[0]


class _PlanCounter:
    """Weak references to every RaggedPlan the shared plan cache makes (to count the live ones)."""

    def __init__(self, monkeypatch):
        self.refs = []
        orig = plan_cache.plan_ragged

        def plan_ragged(*a, **kw):
            plan = orig(*a, **kw)
            self.refs.append(weakref.ref(plan))
            return plan

        monkeypatch.setattr(plan_cache, "plan_ragged", plan_ragged)

    def live(self) -> int:
        gc.collect()
        return sum(r() is not None for r in self.refs)


def _spec(n):
    return dict(
        qo_indptr=[0, n],
        kv_indptr=[0, n],
        causal=True,
        sm_scale=SM,
        backend=None,
        num_heads=2,
        head_dim_qk=192,
        head_dim_vo=128,
        dtype=torch.bfloat16,
    )


def test_a_collection_while_a_trace_makes_its_key_keeps_the_plan(monkeypatch):
    """A race, seen through private names because that is the only way to hold it open: a compiled function of a
    batch died in a reference cycle, and a new trace of the same batch makes its key; a collection then (any
    allocation may start one) finalized the dead user and dropped the plan the trace was about to take, which it
    then planned again (a miss)."""
    from mla_bridge_jax import api

    cache = plan_cache.shared_plan_cache()
    cache.clear()
    cpu = torch.device("cpu")
    gc.disable()
    try:
        dead = api._Plans(_spec(6))
        dead.get(cpu)
        dead.cycle = dead  # dead, waiting for the collector
        del dead
        made = cache.ragged_key

        def key_then_collect(**kw):
            key = made(**kw)
            gc.collect()  # the collection the key's allocations may start
            return key

        monkeypatch.setattr(cache, "ragged_key", key_then_collect)
        misses = cache.misses
        live = api._Plans(_spec(6))
        live.get(cpu)
        assert cache.misses == misses and len(cache) == 1  # the dead user's plan, now the live one's
        monkeypatch.undo()
        del live
        gc.collect()
        assert len(cache) == 0  # its last user gone, the plan goes
    finally:
        gc.enable()


def test_a_finalizer_inside_the_plan_caches_lock_does_not_deadlock():
    """A race, seen through private names: a collection that runs while this thread holds the plan cache's lock
    (here: when the plan an insertion evicts is freed) finalized a dead user whose plan was then dropped, taking the
    same lock again: the thread hung. The drop now waits for a traced call."""
    import threading

    from mla_bridge.workspace import default_workspace
    from mla_bridge_jax import api

    cache = plan_cache.shared_plan_cache()
    cache.clear()
    cpu, maxsize = torch.device("cpu"), cache.maxsize
    cache.maxsize = 1
    gc.disable()
    try:
        first = api._Plans(_spec(3))
        first.get(cpu)
        second = api._Plans(_spec(5))  # evicts the first plan
        second.get(cpu)
        second.cycle = second  # dead in a cycle, waiting for the collector
        del second
        weakref.finalize(cache.lookup(cache.ragged_key(**dict(_spec(5), workspace=default_workspace(cpu)))), gc.collect)
        done = []
        thread = threading.Thread(target=lambda: done.append(api._Plans(_spec(7)).get(cpu)), daemon=True)
        thread.start()  # inserts a third plan: evicts the second under the lock, whose freeing collects
        thread.join(30)
        assert done, "the thread hung in the plan cache's lock"
        key = cache.ragged_key(**dict(_spec(5), workspace=default_workspace(cpu)))
        first.get(cpu)  # a traced call drops what the finalizer could not
        assert not api._DEAD_KEYS and key not in api._KEY_USERS and cache.lookup(key) is None
    finally:
        gc.enable()
        cache.maxsize = maxsize


def test_traced_plans_are_bounded_and_replanned_when_evicted(monkeypatch):
    shared = plan_cache.shared_plan_cache()
    shared.clear()
    monkeypatch.setattr(shared, "maxsize", 2)
    counter = _PlanCounter(monkeypatch)
    layouts = [[0, n] for n in (3, 4, 5, 6, 7)]  # 5 batch layouts: 5 traces, 5 compiled functions
    fns = [
        jax.jit(lambda a, b, c, qo=qo: mj.ragged_prefill(a, b, c, qo, qo, causal=True, sm_scale=SM)) for qo in layouts
    ]
    inputs = [_qkv(qo[-1], qo[-1], seed=i) for i, qo in enumerate(layouts)]
    for f, x, qo in zip(fns, inputs, layouts):
        out, _ = f(*x)
        assert torch.equal(torch.from_dlpack(out), _core(*x, qo))
    assert counter.live() <= 2  # before: one live plan (and wrapper) per compiled function, 5 here
    made = len(counter.refs)
    out, _ = fns[0](*inputs[0])  # its plan was evicted: made again, transparently, with the right values
    assert torch.equal(torch.from_dlpack(out), _core(*inputs[0], layouts[0]))
    assert len(counter.refs) == made + 1 and counter.live() <= 2


@pytest.mark.parametrize("changed", ["indptr", "sm_scale"])
def test_an_evicted_plan_is_made_again_from_the_traced_values_not_the_callers_objects(changed):
    # a compiled function keeps the batch it was traced with: a caller that refills its host indptr buffer (same
    # total) or its 0-d sm_scale array after tracing must not change what the compiled function computes when its
    # plan is made again after an eviction
    shared = plan_cache.shared_plan_cache()
    shared.clear()
    qo, scale = np.array([0, 4, 8], np.int32), np.array(SM)
    f = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, qo, qo, causal=True, sm_scale=scale)[0])
    x = _qkv(8, 8)
    want = _core(*x, [0, 4, 8])
    assert torch.equal(torch.from_dlpack(f(*x)), want)
    if changed == "indptr":
        qo[:] = [0, 2, 8]
    else:
        scale[()] = 2.0
    shared.clear()  # evicted (as by other batches through the shared cache)
    assert torch.equal(torch.from_dlpack(f(*x)), want)


def test_traced_plans_die_with_their_compiled_function(monkeypatch):
    counter = _PlanCounter(monkeypatch)
    f = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, [0, 3, 5], [0, 3, 5], causal=True, sm_scale=SM))
    x = _qkv(5, 5)
    jax.block_until_ready(f(*x))
    assert counter.live() == 1
    del f
    jax.clear_caches()
    assert counter.live() == 0


# ---------------------------------------------------------------------------------------------------------------
# tvm_ffi registry (C++ shim + stand-in kernel on the CPU)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stand_in():
    pytest.importorskip("jax_tvm_ffi")
    tvm_ffi = pytest.importorskip("tvm_ffi")
    try:
        return tvm_ffi.cpp.load_inline(name="mla_bridge_jax_test_lifetime", cpp_sources=KERNEL, functions=["stand_in"])
    except Exception as err:  # noqa: BLE001 - no compiler
        pytest.skip(f"cannot build a TVM-FFI module here: {err}")


@pytest.fixture
def registry(monkeypatch, stand_in):
    from mla_bridge_jax import tvm_ffi as route

    def record(plan):
        return stand_in.stand_in, [torch.full((1,), float(plan.value)), None, None, None, None, None], [1, 2, 3, 4, 5]

    monkeypatch.setattr(route, "record", record)
    monkeypatch.setattr(route, "_remaker", lambda plan, value=None: lambda v=plan.value: FakePlan(v), raising=False)
    monkeypatch.setattr(route, "MAX_PLANS", 2, raising=False)
    FakePlan.made = []
    yield route
    for pid in list(route._registered):
        route.release(route._registered[pid])


def test_tvm_ffi_registry_is_bounded_and_replans_evicted_plans(registry):
    route = registry
    pids = [route.register(FakePlan(v)) for v in (10.0, 20.0, 30.0)]
    assert route.registered_plans() == 2  # before: every registered plan was kept for the life of the process
    gc.collect()
    assert FakePlan.made[0]() is None  # the evicted plan (and its wrapper) is gone
    q = np.arange(16, dtype=np.float32).reshape(2, 1, 8)
    out, _ = call(route, pids[0])  # evicted: re-planned on its next call (which evicts the oldest, pids[1])
    np.testing.assert_array_equal(np.asarray(out), q[..., :4] + 10.0)
    assert route.registered_plans() == 2 and len(FakePlan.made) == 4
    out, _ = call(route, pids[2])  # still registered: no re-plan
    np.testing.assert_array_equal(np.asarray(out), q[..., :4] + 30.0)
    assert len(FakePlan.made) == 4
    out, _ = call(route, pids[1])
    np.testing.assert_array_equal(np.asarray(out), q[..., :4] + 20.0)
    assert route.registered_plans() == 2 and len(FakePlan.made) == 5


def test_tvm_ffi_released_plan_fails_clearly(registry):
    route = registry
    plan = FakePlan(5.0)
    pid = route.register(plan)
    assert route.register(plan) == pid  # once per plan
    assert route.release(plan) and not route.release(plan)
    with pytest.raises(Exception, match=rf"plan {pid} was released"):
        jax.block_until_ready(call(route, pid))


EXIT_SCRIPT = """
import types, torch, numpy as np, jax, jax.numpy as jnp
from tests.helpers import tvm_ffi_stand_in as t
from mla_bridge_jax import tvm_ffi as route
import tvm_ffi
stand_in = tvm_ffi.cpp.load_inline(name="mla_bridge_jax_test_lifetime", cpp_sources=t.KERNEL, functions=["stand_in"])
route.record = lambda plan: (stand_in.stand_in, [torch.full((1,), 7.0), None, None, None, None, None], [1, 2, 3, 4, 5])
route._remaker = lambda plan, value=None: (lambda: t.FakePlan(7.0))
plans = [t.FakePlan(7.0) for _ in range(3)]
pids = [route.register(p) for p in plans]
out, _ = t.call(route, pids[0])
assert float(np.asarray(out)[0, 0, 0]) == 7.0
print("registered", route.shim().num_plans(), flush=True)
"""


def test_process_with_registered_plans_exits_cleanly(stand_in, tmp_path):
    """The shim's C++ statics hold FlashInfer's function, recorded tensors and the Python miss handler; left to the
    static destructors after the interpreter is gone they crashed the process at exit (exit code 139 on the H200 after
    `mla-bridge bench` and the JAX GPU tests). The registry empties them at exit."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "exit_check.py"
    script.write_text(EXIT_SCRIPT)
    root = os.path.dirname(os.path.dirname(here))
    path = os.pathsep.join([root, os.path.join(root, "adapters"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert "registered" in res.stdout, res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
