"""Planning's host time on the GPU: a pooled wrapper's CUDA events, made once and recorded again by its later plans,
still order every run after its own plan's copies (FlashInfer fa3 / fa2, bf16, 192/128).

The GPU is kept busy (``torch.cuda._sleep``) before each plan, so FlashInfer's schedule copy is queued behind the
sleep while the host plans on and queues the run on another stream; that stream waits on the plan's event, the same
event object as the previous plan's (re-recorded). A wait that did not cover the new record would run on the
previous batch's schedule (errors of about 4; the tolerance is 1e-2). Reference: tests/helpers/gpu_cases.py's.

Marked ``gpu`` (skipped without CUDA + FlashInfer). On the H200:
    .venv/bin/python -m pytest tests/gpu/test_gpu_plan_events.py -q -m gpu
"""

from __future__ import annotations

import gc

import pytest
import torch

from mla_bridge import Workspace
from tests.helpers.gpu_cases import BACKENDS, SLEEP, TOL, cases, dev, require

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", BACKENDS)
def test_reused_events_order_runs_on_another_stream_after_their_own_plan(backend):
    require(backend)
    a, b, c = cases(backend)
    ws = Workspace(dev())
    side = torch.cuda.Stream()
    p = a.plan(ws)
    lease = p._kernel.lease
    plan_event = lease.plan_event
    with torch.cuda.stream(side):
        outs = [(a, p.run(a.q, a.k, a.v)[0])]
    run_event = lease.run_events[side.cuda_stream]
    made = {id(plan_event), id(run_event)}  # the lease's two events: every later record reuses one of them
    del p
    gc.collect()
    torch.cuda.synchronize()  # the wrapper is free again: the next plan takes it and its events
    for case in (b, c, a, b):
        torch.cuda._sleep(SLEEP)  # the current stream is busy: this plan's schedule copy is queued behind it
        p = case.plan(ws)
        # same wrapper, and its plan event one of the two events made at first (a spare is recorded again; which
        # one takes which role is the spare list's order)
        assert p._kernel.lease is lease and id(lease.plan_event) in made
        with torch.cuda.stream(side):
            outs.append((case, p.run(case.q, case.k, case.v)[0]))
        assert (
            id(lease.run_events[side.cuda_stream]) in made
            and lease.run_events[side.cuda_stream] is not lease.plan_event
        )
        del p
        gc.collect()
        torch.cuda.synchronize()
    assert ws.wrappers_created == 1
    errors = [case.error(out) for case, out in outs]
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_busy_leases_are_not_reused_while_the_gpu_is_behind(backend):
    """Plans dropped while the GPU is busy: each next plan gets another wrapper (its events are pending), and every
    result is right once the GPU catches up; after that the pool's wrappers come back with their events."""
    require(backend)
    batches = cases(backend)
    ws = Workspace(dev())
    side = torch.cuda.Stream()
    outs = []

    def plan_and_drop_each_batch_while_the_gpu_sleeps():
        torch.cuda._sleep(SLEEP)
        for case in batches:
            p = case.plan(ws)
            with torch.cuda.stream(side):
                outs.append((case, p.run(case.q, case.k, case.v)[0]))
            del p

    plan_and_drop_each_batch_while_the_gpu_sleeps()
    assert ws.wrappers_created == len(batches)
    torch.cuda.synchronize()
    gc.collect()
    plan_and_drop_each_batch_while_the_gpu_sleeps()
    torch.cuda.synchronize()
    assert ws.wrappers_created == len(batches)  # the second round reused the first round's wrappers
    errors = [case.error(out) for case, out in outs]
    assert max(errors) < TOL, errors
