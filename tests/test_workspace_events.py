"""A pooled wrapper's CUDA events are made once and recorded again by its later plans (host time of planning).

On the fake GPU of tests/helpers/async_fakes.py (recording stand-ins for streams and events; "the GPU" completes events
when the test says so). Every event a lease hands out for a plan or a stream's first run must be one whose last
record has completed (the fixture below fails otherwise), the plan-ownership ordering must hold unchanged (a run on
another stream waits on its own plan's record), and a lease reused after the GPU caught up makes no new event. The
same on the H200 with the GPU kept busy: tests/gpu/test_gpu_plan_events.py.
"""

from __future__ import annotations

import gc

import pytest

import mla_bridge.dispatch as dispatch
import mla_bridge.workspace as workspace_module
from mla_bridge import Workspace
from mla_bridge.backends import flashinfer as fi_backend
from tests.helpers.async_fakes import FakeGPU, StandInWrapper, make_event_class, plan, run, wrapper_of


@pytest.fixture
def gpu(monkeypatch, fake_cuda_runtime):
    """The fake SM90 device of tests/helpers/async_fakes.py, whose events count how many were made; a lease may hand
    out an event for a new record (a plan, a stream's first run) only once its last record has completed."""
    g = FakeGPU()
    g.made = []
    base = make_event_class(g)

    class Event(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            g.made.append(self)

    event = workspace_module._Lease.event

    def checked(lease):
        e = event(lease)
        assert e.done, "a lease handed out an event whose last record is pending"
        return e

    monkeypatch.setattr(workspace_module._Lease, "event", checked)

    StandInWrapper.instances = []
    monkeypatch.setattr(dispatch, "flashinfer_version", lambda: "0.7.4")
    fake_cuda_runtime(lambda: (9, 0), lambda: g.current, Event, lambda: g.capturing)
    monkeypatch.setattr(fi_backend, "new_wrapper", lambda buf, backend: StandInWrapper(g, buf, backend))
    return g


def records(gpu):
    return [(e[1], e[2]) for e in gpu.log if e[0] == "record"]


def test_a_reused_wrapper_records_its_plan_event_again_once_the_gpu_is_done(gpu):
    ws = Workspace("cuda:0")
    a = plan(ws, [0, 4])
    ((stream, event_a),) = records(gpu)
    w = wrapper_of(a)
    del a
    gc.collect()
    b = plan(ws, [0, 5])  # a's plan event is pending: another wrapper, another event
    assert wrapper_of(b) is not w and len(gpu.made) == 2
    del b
    gc.collect()
    gpu.finish()
    c = plan(ws, [0, 6])  # the GPU caught up: a pooled wrapper and its event, recorded again
    # private: the lease's events are the only view of which record a later run waits on (the race tested here)
    assert len(gpu.made) == 2 and records(gpu)[-1] == (1, c._kernel.lease.plan_event)
    assert c._kernel.lease.plan_event in (event_a, gpu.made[1])
    assert c._kernel.lease.plan_event.done is False  # pending again: the lease stays busy until it completes
    assert ws.pooled_wrappers == 2


def test_run_events_are_reused_and_a_run_on_another_stream_waits_for_its_own_plan(gpu):
    ws = Workspace("cuda:0")
    a = plan(ws, [0, 4])
    gpu.current = gpu.stream(7)
    run(a, 4)  # waits for a's plan event, then records a run event on stream 7
    gpu.current = gpu.stream(1)
    made = len(gpu.made)
    assert made == 2
    del a
    gc.collect()
    gpu.finish()
    b = plan(ws, [0, 6])
    plan_event = b._kernel.lease.plan_event  # private: the only view of the event a run must wait on (a race)
    gpu.current = gpu.stream(7)
    run(b, 6)
    run(b, 6)
    gpu.current = gpu.stream(1)
    assert len(gpu.made) == made  # the plan event and the stream-7 run event: both made for a, recorded for b
    waits = [e for e in gpu.log if e[0] == "wait"]
    assert len(waits) == 2 and waits[-1] == ("wait", 7, plan_event)
    i_wait = gpu.log.index(waits[-1])
    assert gpu.log[i_wait - 1][0] == "record" and gpu.log[i_wait - 1][2] is plan_event  # waits on b's own record
    run_event = b._kernel.lease.run_events[7]
    assert run_event is not plan_event and [e[0] for e in gpu.log[-4:]] == ["run", "record", "run", "record"]
    assert gpu.log[-1][2] is run_event


def test_a_pending_run_event_keeps_the_wrapper_and_its_events(gpu):
    """The plan event completed but a run is still queued: the wrapper is not handed out, and neither event is
    handed out again until the run completes."""
    ws = Workspace("cuda:0")
    a = plan(ws, [0, 4])
    w = wrapper_of(a)
    gpu.finish()  # a's copies done
    run(a, 4)  # a run queued, pending
    del a
    gc.collect()
    b = plan(ws, [0, 5])
    assert wrapper_of(b) is not w
    del b
    gc.collect()
    gpu.finish()
    c = plan(ws, [0, 6])
    d = plan(ws, [0, 7])
    assert {wrapper_of(c), wrapper_of(d)} == set(StandInWrapper.instances) and len(StandInWrapper.instances) == 2
    assert len(gpu.made) == 3  # a's plan and run events, b's plan event: all recorded again, none made
