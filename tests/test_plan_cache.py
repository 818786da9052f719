"""mla_bridge.plan_cache: RaggedPlans kept on their full spec (two specs that differ in anything never share a plan,
equal specs hit), one LRU bound over both kinds of plan, and the old import paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mla_bridge
from mla_bridge import PrefillPlan, RaggedPlan, Workspace
from mla_bridge.plan_cache import PlanCache, shared_plan_cache

WS = Workspace("cpu")
QO, KV = [0, 3, 5], [0, 4, 9]


def _spec(**change):
    spec = dict(
        qo_indptr=QO,
        kv_indptr=KV,
        num_heads=2,
        head_dim_qk=24,
        head_dim_vo=16,
        causal=False,
        sm_scale=0.25,
        dtype=torch.float32,
        workspace=WS,
        backend=None,
        strides=None,
    )
    spec.update(change)
    return spec


def test_the_old_import_paths_name_the_one_class():
    from mla_bridge.plan import PlanCache as from_plan

    assert mla_bridge.PlanCache is PlanCache is from_plan
    assert isinstance(shared_plan_cache(), PlanCache) and shared_plan_cache() is shared_plan_cache()


def test_equal_specs_hit_in_any_spelling():
    """Equal specs hit, however the indptrs and sizes are spelled (list, numpy, tensor; numpy ints)."""
    cache = PlanCache()
    plan = cache.get_ragged(**_spec())
    assert isinstance(plan, RaggedPlan) and (cache.hits, cache.misses) == (0, 1)
    for same in (
        _spec(),
        _spec(qo_indptr=np.array(QO), kv_indptr=torch.tensor(KV, dtype=torch.int64)),
        _spec(num_heads=np.int64(2), sm_scale=np.float32(0.25), causal=np.bool_(False)),
        _spec(strides=[None, None, None]),
    ):
        assert cache.get_ragged(**same) is plan
    assert (cache.hits, cache.misses) == (4, 1) and len(cache) == 1


@pytest.mark.parametrize(
    "change",
    [
        dict(qo_indptr=[0, 2, 5]),
        dict(kv_indptr=[0, 5, 9]),
        dict(num_heads=4),
        dict(head_dim_qk=32),
        dict(head_dim_vo=8),
        dict(causal=True),
        dict(sm_scale=0.5),
        dict(dtype=torch.float64),
        dict(workspace=Workspace("cpu")),
        dict(backend="torch"),
        dict(strides=(None, None, (48, 24))),
    ],
    ids=lambda c: next(iter(c)),
)
def test_specs_that_differ_never_share_a_plan(change):
    cache = PlanCache()
    base = cache.get_ragged(**_spec())
    other = cache.get_ragged(**_spec(**change))
    assert other is not base and (cache.hits, cache.misses) == (0, 2)
    assert cache.get_ragged(**_spec(**change)) is other and cache.get_ragged(**_spec()) is base


def test_the_backend_switch_is_part_of_the_key(monkeypatch):
    """``MLA_BRIDGE_BACKEND`` read at each look-up: a backend forced after a plan was kept gets a plan of its own."""
    cache = PlanCache()
    monkeypatch.delenv("MLA_BRIDGE_BACKEND", raising=False)
    plan = cache.get_ragged(**_spec())
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")
    forced = cache.get_ragged(**_spec())
    assert forced is not plan and cache.get_ragged(**_spec(backend="torch")) is forced


@pytest.mark.parametrize(
    "bad,exc",
    [
        (dict(num_heads=2.0), ValueError),
        (dict(num_heads=True), ValueError),
        (dict(causal=0), TypeError),
        (dict(sm_scale=-1.0), ValueError),
        (dict(dtype="float32"), TypeError),
        (dict(kv_indptr=[0, 4]), ValueError),
    ],
)
def test_a_hit_refuses_what_plan_ragged_refuses(bad, exc):
    """``2.0 == 2``, ``True == 1`` and ``0 == False`` as key parts: a kept plan never lets through what
    :func:`mla_bridge.plan_ragged` refuses (the same error whatever the cache holds), and nothing is kept for it."""
    cache = PlanCache()
    cache.get_ragged(**_spec())
    with pytest.raises(exc):
        mla_bridge.plan_ragged(**_spec(**bad))
    with pytest.raises(exc):
        cache.get_ragged(**_spec(**bad))
    assert cache.hits == 0 and len(cache) == 1


def test_one_lru_bound_over_both_kinds(tiny_dims):
    cache = PlanCache(maxsize=2)
    ragged = cache.get_ragged(**_spec())
    prefill = cache.get([3, 2], dims=tiny_dims, workspace=WS, block_size=4, dtype=torch.float32)
    assert isinstance(prefill, PrefillPlan) and len(cache) == 2
    assert cache.get_ragged(**_spec()) is ragged  # now the most recent: the prefill plan goes first
    cache.get_ragged(**_spec(causal=True))
    assert len(cache) == 2 and cache.get_ragged(**_spec()) is ragged
    again = cache.get([3, 2], dims=tiny_dims, workspace=WS, block_size=4, dtype=torch.float32)
    assert again is not prefill and cache.misses == 4
    cache.maxsize = 1  # lowered: the next insertion drops down to it
    cache.get_ragged(**_spec(sm_scale=0.5))
    assert len(cache) == 1


def test_lookup_and_discard_by_key():
    cache = PlanCache()
    key = cache.ragged_key(**_spec())
    assert cache.lookup(key) is None and cache.lookup(None) is None and (cache.hits, cache.misses) == (0, 0)
    plan = cache.get_ragged(**_spec())
    assert cache.lookup(key) is plan and cache.hits == 1
    assert cache.ragged_key(**_spec(num_heads=2.0)) is None  # not keyed: plan_ragged decides
    assert cache.discard(key) and not cache.discard(key) and len(cache) == 0
    assert cache.get_ragged(**_spec()) is not plan


def test_get_ragged_lens_finds_the_last_calls_plan_by_its_key(monkeypatch):
    """PlanCache.get_ragged_lens (a model's layers, one call each): the plan of the lengths' indptrs, the same plan
    get_ragged keeps; a call equal to the last one is a hit without the indptrs made again; anything the key holds,
    the backend switch included, changes it; what cannot be keyed never hits (plan_ragged decides)."""
    import mla_bridge.plan_cache as plan_cache_module

    monkeypatch.delenv("MLA_BRIDGE_BACKEND", raising=False)
    cache = PlanCache()
    args = {n: x for n, x in _spec().items() if n not in ("qo_indptr", "kv_indptr")}
    plan = cache.get_ragged_lens((3, 2), (4, 5), **args)
    assert cache.get_ragged(**_spec()) is plan and (cache.hits, cache.misses) == (1, 1)
    made = []
    real = plan_cache_module.indptr_from_lens
    monkeypatch.setattr(plan_cache_module, "indptr_from_lens", lambda lens: made.append(lens) or real(lens))
    assert cache.get_ragged_lens((3, 2), (4, 5), **args) is plan and made == [] and cache.hits == 2
    assert cache.get_ragged_lens((3, 2), (4, 5), **dict(args, sm_scale=0.5)) is not plan and len(made) == 2
    assert cache.get_ragged_lens((3, 2), (4, 5), **args) is plan and len(made) == 4  # found again, by get_ragged
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")
    forced = cache.get_ragged_lens((3, 2), (4, 5), **args)
    assert forced is not plan and cache.get_ragged(**_spec(backend="torch")) is forced
    monkeypatch.delenv("MLA_BRIDGE_BACKEND")
    cache.get_ragged_lens((3, 2), (4, 5), **args)
    with pytest.raises(ValueError):  # 2.0 == 2: never let through by the last call's key
        cache.get_ragged_lens((3, 2), (4, 5), **dict(args, num_heads=2.0))
    cache.clear()  # an evicted plan is made again
    again = cache.get_ragged_lens((3, 2), (4, 5), **args)
    assert again is not plan and cache.get_ragged_lens((3, 2), (4, 5), **args) is again


def test_a_request_takes_the_plan_of_the_key_it_made(monkeypatch):
    """ragged_request makes the key once and its get() takes the plan kept under that key, even where the backend
    switch changed in between (the JAX adapter counts the key, then takes the plan: they must be the same key's)."""
    cache = PlanCache()
    monkeypatch.delenv("MLA_BRIDGE_BACKEND", raising=False)
    key, get = cache.ragged_request(**_spec())
    assert key == cache.ragged_key(**_spec()) and key is not None
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")  # a get_ragged now would key the plan as forced
    plan = get()
    assert cache.lookup(key) is plan and (cache.hits, cache.misses) == (1, 1)
    assert cache.get_ragged(**_spec()) is not plan  # the forced key's own plan
    bad = dict(_spec(), sm_scale=-1.0)
    with pytest.raises(ValueError, match="sm_scale"):
        cache.ragged_request(**bad)
