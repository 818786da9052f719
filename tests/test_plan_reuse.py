"""Plan reuse (PlanCache) only on the full key, and the host work of PrefillPlan.build: FlashInfer plans only per
distinct pass shape (a stand-in wrapper counts them on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mla_bridge.ragged as ragged_mod
from mla_bridge import BackendChoice, MLADims, PlanCache, PrefillPlan, Workspace, mla_prefill
from mla_bridge.backends import flashinfer as fi_backend

Q, C = [3, 4, 1, 5], [10, 0, 7, 20]


def _args(dims, ws, **over):
    kw = dict(dims=dims, workspace=ws, block_size=8, dtype=torch.float32)
    kw.update(over)
    return kw


def test_equal_key_reuses_the_plan(tiny_dims):
    ws = Workspace("cpu", chunk_tokens=16)
    cache = PlanCache()
    a = cache.get(Q, C, **_args(tiny_dims, ws))
    assert cache.get(list(Q), tuple(C), **_args(tiny_dims, ws)) is a  # any sequence of the same ints
    assert cache.get(torch.tensor(Q), C, **_args(tiny_dims, ws)) is a
    assert (cache.hits, cache.misses, len(cache)) == (2, 1, 1)
    assert a.key == PrefillPlan.build(Q, C, **_args(tiny_dims, ws)).key


def test_every_part_of_the_key_matters(tiny_dims, monkeypatch):
    ws = Workspace("cpu", chunk_tokens=16)
    cache = PlanCache(maxsize=64)
    base = cache.get(Q, C, **_args(tiny_dims, ws))
    other_scale = MLADims(
        **{
            **{
                k: getattr(tiny_dims, k)
                for k in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            },
            "softmax_scale": 0.5,
        }
    )
    variants = {
        "query_lens": (Q[:-1] + [6], C, _args(tiny_dims, ws)),
        "context_lens": (Q, C[:-1] + [21], _args(tiny_dims, ws)),
        "swapped requests": (Q[::-1], C[::-1], _args(tiny_dims, ws)),
        "dims": (Q, C, _args(other_scale, ws)),
        "dtype": (Q, C, _args(tiny_dims, ws, dtype=torch.float64)),
        "block_size": (Q, C, _args(tiny_dims, ws, block_size=4)),
        "fuse_context": (Q, C, _args(tiny_dims, ws, fuse_context=False)),
        "backend": (Q, C, _args(tiny_dims, ws, backend="torch")),
        "workspace": (Q, C, _args(tiny_dims, Workspace("cpu", chunk_tokens=16))),
        "kv_cache_dtype": (Q, C, _args(tiny_dims, ws, kv_cache_dtype="fp8")),
    }
    seen = {id(base)}
    for name, (q, c, kw) in variants.items():
        plan = cache.get(q, c, **kw)
        assert id(plan) not in seen, name
        seen.add(id(plan))
    ws.chunk_tokens = 32  # the chunk budget is read when the plan is asked for
    assert cache.get(Q, C, **_args(tiny_dims, ws)) is not base
    ws.chunk_tokens = 16
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")  # what select_backend would read: the same request as
    assert cache.get(Q, C, **_args(tiny_dims, ws)) is cache.get(Q, C, **_args(tiny_dims, ws, backend="torch"))
    assert cache.get(Q, C, **_args(tiny_dims, ws)) is not base  # backend="torch" above
    monkeypatch.delenv("MLA_BRIDGE_BACKEND")
    assert cache.get(Q, C, **_args(tiny_dims, ws)) is base
    assert cache.misses == len(variants) + 2 and cache.hits == 4
    # the cache dtype is keyed resolved: "fp8", float8_e4m3fn and its uint8 view are one plan; "auto" is the dtype's
    fp8 = cache.get(Q, C, **_args(tiny_dims, ws, kv_cache_dtype="fp8"))
    assert fp8.kv_cache_dtype == torch.float8_e4m3fn
    assert cache.get(Q, C, **_args(tiny_dims, ws, kv_cache_dtype=torch.uint8)) is fp8
    assert cache.get(Q, C, **_args(tiny_dims, ws, kv_cache_dtype="auto")) is base


def test_key_is_made_on_first_use_from_the_build_time_budget_and_backend(tiny_dims, monkeypatch):
    """build does not make the key (its host time); made later, it still describes the plan as built: the chunk budget
    and MLA_BRIDGE_BACKEND as they were at build, not as they are when the key is first asked for."""
    from mla_bridge.plan import _plan_key

    ws = Workspace("cpu", chunk_tokens=16)
    plan = PrefillPlan.build(Q, C, **_args(tiny_dims, ws))
    assert plan._key is None  # private: the key not made by build (host time) shows nowhere else
    want = _plan_key(Q, C, tiny_dims, ws, 8, torch.device("cpu"), torch.float32, None, True, torch.float32, 16)
    ws.chunk_tokens = 32
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")
    assert plan.key == want and plan.key is plan.key  # made once, kept
    forced = PrefillPlan.build(Q, C, **_args(tiny_dims, ws))  # built under the variable and the new budget
    monkeypatch.delenv("MLA_BRIDGE_BACKEND")
    ws.chunk_tokens = 16
    assert (
        forced.key
        == _plan_key(Q, C, tiny_dims, ws, 8, torch.device("cpu"), torch.float32, "torch", True, torch.float32, 32)
        != want
    )


def test_cache_hands_its_key_to_the_plan(tiny_dims, monkeypatch):
    """PlanCache.get keys a new plan by the key it looked up with (made once per get), which equals the key the plan
    makes itself; a plan it cannot key (build refuses the arguments) is never stored."""
    import mla_bridge.plan as plan_mod

    made = []
    real = plan_mod._plan_key
    monkeypatch.setattr(plan_mod, "_plan_key", lambda *a: made.append(a) or real(*a))
    ws = Workspace("cpu", chunk_tokens=16)
    cache = PlanCache()
    plan = cache.get(Q, C, **_args(tiny_dims, ws))
    assert len(made) == 1 and len(cache) == 1 and cache.lookup(plan.key) is plan
    assert len(made) == 1  # plan.key is the key the cache looked up with, not made again
    assert plan.key == real(*made[0]) == PrefillPlan.build(Q, C, **_args(tiny_dims, ws)).key
    assert len(made) == 2  # the fresh build's key, made when asked for
    with pytest.raises(TypeError, match="dims must be an MLADims"):
        cache.get(Q, C, **_args(None, ws))
    assert len(cache) == 1 and cache.get(Q, C, **_args(tiny_dims, ws)) is plan


def test_reused_plan_gives_the_same_result(ref, tiny_dims):
    batch = ref.make_mla_batch(tiny_dims, Q, C, 8, seed=2)
    ws = Workspace("cpu", chunk_tokens=16)
    cache = PlanCache()
    want = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        PrefillPlan.build(Q, C, **_args(tiny_dims, ws)),
    )
    cache.get(Q, C, **_args(tiny_dims, ws))
    got = mla_prefill(
        batch.q,
        batch.kv_c,
        batch.k_pe,
        batch.w,
        batch.cache,
        batch.block_table,
        cache.get(Q, C, **_args(tiny_dims, ws)),
    )
    assert cache.hits == 1 and torch.equal(got, want)


def test_lru_bound(tiny_dims):
    ws = Workspace("cpu")
    cache = PlanCache(maxsize=2)
    a = cache.get([1], **_args(tiny_dims, ws))
    cache.get([2], **_args(tiny_dims, ws))
    cache.get([1], **_args(tiny_dims, ws))  # a is now the most recent
    cache.get([3], **_args(tiny_dims, ws))  # drops [2]
    assert len(cache) == 2 and cache.get([1], **_args(tiny_dims, ws)) is a
    assert cache.get([2], **_args(tiny_dims, ws)) is not None and cache.misses == 4
    with pytest.raises(ValueError, match="maxsize must be a positive int"):
        PlanCache(0)
    cache.clear()
    assert len(cache) == 0


class StandIn:
    def __init__(self, buf, backend):
        self._int_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self.planned = []

    def plan(self, qo, kv, *args, **kwargs):
        self.planned.append((qo.tolist(), kv.tolist(), kwargs["causal"]))


@pytest.fixture
def stand_in_flashinfer(monkeypatch):
    monkeypatch.setattr(fi_backend, "new_wrapper", StandIn)
    monkeypatch.setattr(ragged_mod, "select_backend", lambda *a, **k: BackendChoice("flashinfer-fa3", "stand-in"))


def test_chunks_of_equal_shape_share_one_flashinfer_plan(stand_in_flashinfer):
    dims = MLADims.deepseek_v2_lite()
    ws = Workspace("cpu", chunk_tokens=16384)
    plan = PrefillPlan.build([512] * 128, [2048] * 128, dims=dims, workspace=ws, block_size=64, dtype=torch.bfloat16)
    assert len(plan.chunks) == 16 and all(c.plan is plan.chunks[0].plan for c in plan.chunks)
    assert plan.num_plans == 2 and ws.plans_made == 2  # the causal main pass + one for all 16 chunks
    # the shared plan still sees each chunk's own tokens
    assert [int(c.req_ids[0]) for c in plan.chunks] == list(range(0, 128, 8))
    assert all(c.positions.tolist() == list(range(2048)) * 8 for c in plan.chunks[:2])
    # chunks of different shapes get their own plans: 3 requests x 100 in chunks of 64 -> 5 chunks, 4 shapes
    ws2 = Workspace("cpu", chunk_tokens=64)
    p2 = PrefillPlan.build([4, 4, 4], [100, 100, 100], dims=dims, workspace=ws2, block_size=16, dtype=torch.bfloat16)
    shapes = {(tuple(c.plan.qo_indptr.tolist()), tuple(c.plan.kv_indptr.tolist())) for c in p2.chunks}
    assert len(p2.chunks) == 5 and len(shapes) == 4
    assert p2.num_plans == 1 + len(shapes) == ws2.plans_made


def test_bench_splits_build_time_into_flashinfer_and_our_own(stand_in_flashinfer, monkeypatch):
    """The plan section's host-time split on the CPU, with a stand-in FlashInfer whose plan() takes 2 ms."""
    import io
    import time

    from rich.console import Console

    from mla_bridge.bench.common import Ctx
    from mla_bridge.bench.sections import _build_time_job

    monkeypatch.setattr(StandIn, "plan", lambda self, *a, **k: time.sleep(0.002))
    ctx = Ctx(
        device=torch.device("cpu"),
        quick=True,
        repeats=3,
        warmup=0,
        seed=0,
        backend=None,
        skip=set(),
        budget_s=None,
        console=Console(file=io.StringIO()),
    )
    build, fi, own = _build_time_job(ctx, 128, True, 0)
    assert build.status == "ok" and build.extra["flashinfer_plans"] == 2  # main + one for the 4 equal chunks
    assert fi.path == "PrefillPlan.build: FlashInfer plan() calls" and fi.ms >= 4.0
    assert own.path == "PrefillPlan.build: our own host work" and 0 < own.ms < build.ms
    assert build.extra["own_over_flashinfer"] == pytest.approx(own.ms / fi.ms)
    (check,) = [c for c in ctx.checks if c.name.startswith("plan: own host work / FlashInfer plan() time")]
    assert check.value == build.extra["own_over_flashinfer"] and check.target == 0.20


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        (dict(block_size=4.0), ValueError, "block_size must be a positive int"),
        (dict(block_size=True), ValueError, "block_size must be a positive int"),
        (dict(fuse_context=1), TypeError, "fuse_context must be a bool"),
    ],
)
def test_a_hit_refuses_what_build_refuses(tiny_dims, bad, exc, match):
    """``4.0 == 4`` and ``1 == True`` as key parts: a cached plan must not let an argument through that
    :meth:`PrefillPlan.build` refuses (the same error whatever the cache holds)."""
    ws = Workspace("cpu")
    cache = PlanCache()
    good = dict(block_size=int(bad.get("block_size", 4)), fuse_context=True)
    cache.get([3, 2], [5, 1], dims=tiny_dims, workspace=ws, dtype=torch.float32, **good)
    with pytest.raises(exc, match=match):
        PrefillPlan.build([3, 2], [5, 1], dims=tiny_dims, workspace=ws, dtype=torch.float32, **dict(good, **bad))
    with pytest.raises(exc, match=match):
        cache.get([3, 2], [5, 1], dims=tiny_dims, workspace=ws, dtype=torch.float32, **dict(good, **bad))
    assert cache.hits == 0 and cache.misses == 1


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64", None])
def test_chunk_tokens_set_after_construction_is_checked(bad):
    """Workspace.chunk_tokens may change between plans (the tests above); a value no plan can use is refused where
    it is set, naming it (before: PrefillPlan.build failed later with range() / split_with_sizes errors)."""
    ws = Workspace("cpu", chunk_tokens=64)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        ws.chunk_tokens = bad
    assert ws.chunk_tokens == 64
    ws.chunk_tokens = np.int64(16)
    assert ws.chunk_tokens == 16 and type(ws.chunk_tokens) is int


def test_a_hit_survives_another_threads_eviction_between_look_up_and_reorder(tiny_dims):
    """PlanCache.get from several threads: another thread's eviction could remove the key between the look-up and
    move_to_end (KeyError with 4 threads). Forced here: right after thread A's look-up of a kept plan finds it,
    thread B gets a new plan, which with maxsize=1 evicts A's. The cache must keep B out until A's hit is done, so A
    gets its plan, B its own, and the cache ends with B's alone. (A waits for B at most a moment: without the
    serialisation B is done by then; with it B waits for A.)"""
    import threading
    from collections import OrderedDict

    ws = Workspace("cpu")
    cache = PlanCache(maxsize=1)
    a = cache.get([1], **_args(tiny_dims, ws))
    got, errors, done = {}, [], threading.Event()

    def thread_b():
        try:
            got["b"] = cache.get([2], **_args(tiny_dims, ws))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)
        finally:
            done.set()

    b_thread = threading.Thread(target=thread_b)

    class LookUpThenEvict(OrderedDict):
        def get(self, key, default=None):
            found = super().get(key, default)
            if found is a and not b_thread.is_alive() and not done.is_set():
                b_thread.start()
                done.wait(timeout=0.5)
            return found

    cache._plans = LookUpThenEvict(cache._plans)  # private: the only place to put the eviction inside the look-up
    got["a"] = cache.get([1], **_args(tiny_dims, ws))  # was: KeyError from move_to_end
    b_thread.join(timeout=30)
    assert not errors and not b_thread.is_alive()
    assert got["a"] is a and got["b"].query_lens == [2]
    assert len(cache) == 1 and cache.get([2], **_args(tiny_dims, ws)) is got["b"]
    assert (cache.hits, cache.misses) == (2, 2)


def test_threads_sharing_a_small_cache_count_every_get(tiny_dims):
    """Many threads, few keys, a cache smaller than the keys: every get returns a plan of its lengths, none raises,
    and hits + misses count every get (no update lost)."""
    import sys
    import threading

    ws = Workspace("cpu")
    cache = PlanCache(maxsize=2)
    keys = [[1], [2], [3]]
    errors, wrong = [], []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows

    def work(i):
        try:
            for n in range(600):
                lens = keys[(i + n) % len(keys)]
                if cache.get(lens, **_args(tiny_dims, ws)).query_lens != lens:
                    wrong.append(lens)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors and not wrong
    assert cache.hits + cache.misses == 8 * 600 and len(cache) == 2
