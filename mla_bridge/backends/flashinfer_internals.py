"""FlashInfer's private internals: the one module of mla_bridge and its adapters that reads or writes them.

Beyond the ragged wrapper's documented ``plan()`` and ``run()``, mla_bridge relies on its private structure in
FlashInfer 0.7.x (``flashinfer/prefill.py``) for three things:

* host time per run: :class:`mla_bridge.backends.flashinfer.DirectRun` and the JAX adapter's XLA call
  (``mla_bridge_jax.tvm_ffi``) replay the call ``run()`` ends in, recorded once per plan (:func:`record_ragged_run`:
  ``run()`` makes exactly one call ``self._cached_module.ragged_run(*run_args)``, ``_cached_module`` a
  ``types.SimpleNamespace``; for XLA one level further down, :func:`compiled_call`: ``ragged_run`` reorders its
  arguments for the compiled TVM-FFI ``ragged_run_func`` it closes over; both levels on stand-ins:
  :func:`record_compiled_run`);
* workspaces: fa2's per-stream float workspace is the ``_float_workspace_buffer`` that ``run()`` reads, and the int
  workspace sized to each plan is ``_int_workspace_buffer`` with its page-locked twin
  ``_pin_memory_int_workspace_buffer``, where ``plan()`` writes (:func:`float_workspace`, :func:`int_workspace`
  and their setters);
* memory accounting and the chunk gather's device indptr: the buffers ``plan()`` fills (:data:`LIVE_BUFFERS`,
  :func:`held_bytes`, :func:`device_kv_indptr`).

Version gate: the call is recorded only for the FlashInfer versions this module knows (:data:`KNOWN_VERSIONS`,
pyproject's ``flashinfer-python`` range); for another one :func:`record_ragged_run` refuses (``LookupError``, the
reason from :func:`version_why_not`) and the callers keep the public path, as for any recording that cannot be made
(``wrapper.run``; the JAX adapter's ``buffer_callback`` route). Without a ``flashinfer-python`` distribution (a
source checkout, a test's stand-in wrapper) the structural checks alone decide; the buffer accessors read what is
there. ``tests/gpu/test_gpu_flashinfer_internals.py`` checks on a GPU that a recorded call gives the bits of
``run()``. This module imports only :mod:`mla_bridge.dispatch`, so the workspace, which pools the wrappers below
the backends, uses it too.
"""

from __future__ import annotations

import re
import types
from typing import Any, Callable, Optional, Sequence

import torch

from .. import dispatch

__all__ = [
    "KNOWN_VERSIONS",
    "LIVE_BUFFERS",
    "version_why_not",
    "recording_why_not",
    "stand_ins",
    "record_ragged_run",
    "compiled_call",
    "record_compiled_run",
    "argument_slots",
    "live_slots",
    "live_values",
    "float_workspace",
    "set_float_workspace",
    "int_workspace",
    "set_int_workspace",
    "device_kv_indptr",
    "held_bytes",
]

#: The FlashInfer versions whose wrapper structure this module knows: ``[first, end)`` as (major, minor, patch).
KNOWN_VERSIONS = ((0, 7, 2), (0, 8, 0))
#: The wrapper's buffers that ``plan()`` fills and ``run()`` hands its call: a recorded call reads their current
#: values at every call, never the recorded ones.
LIVE_BUFFERS = ("_int_workspace_buffer", "_plan_info", "_qo_indptr_buf", "_kv_indptr_buf")
_FLOAT_WORKSPACE = "_float_workspace_buffer"
_PINNED_INT_WORKSPACE = "_pin_memory_int_workspace_buffer"


def _version_tuple(text: str) -> Optional[tuple[int, int, int]]:
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def version_why_not(version: Optional[str] = None) -> Optional[str]:
    """Why the call recording refuses the installed FlashInfer (``version``: that version string, default the
    installed ``flashinfer-python``'s), or None where it may try: a version within :data:`KNOWN_VERSIONS`, or no
    distribution found (then the structural checks of :func:`record_ragged_run` alone decide)."""
    text = dispatch.flashinfer_version() if version is None else version
    if text is None:
        return None
    parsed = _version_tuple(text)
    first, end = KNOWN_VERSIONS
    if parsed is not None and first <= parsed < end:
        return None
    return (
        f"FlashInfer {text} is outside the versions whose private run structure mla_bridge records "
        f"({'.'.join(map(str, first))} to before {'.'.join(map(str, end))}); runs use the wrapper's public run()"
    )


def recording_why_not(wrapper: Any) -> Optional[str]:
    """Why :func:`record_ragged_run` cannot record ``wrapper``'s run (:func:`version_why_not`, or a wrapper without
    FlashInfer 0.7's ``_cached_module`` holding a ``ragged_run``), or None where it may try (nothing is run)."""
    reason = version_why_not()
    if reason is not None:
        return reason
    module = getattr(wrapper, "_cached_module", None)
    if not isinstance(module, types.SimpleNamespace) or not callable(getattr(module, "ragged_run", None)):
        return "the FlashInfer wrapper has no module with a ragged_run (FlashInfer or mla_bridge changed)"
    return None


def stand_ins(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device, *, expanded: bool = True
) -> list[torch.Tensor]:
    """Tensors to record a run on: ``q, k, v, out`` of ``dtype`` and ``lse`` float32, of ``shapes = (q, k, v, out,
    lse)`` (:attr:`mla_bridge.ragged.RaggedSpec.shapes`) on ``device``; one element each, expanded (no memory), or
    with ``expanded=False`` real uninitialised tensors."""
    dtypes = (dtype, dtype, dtype, dtype, torch.float32)
    if expanded:
        return [torch.empty((), dtype=dt, device=device).expand(*shape) for shape, dt in zip(shapes, dtypes)]
    return [torch.empty(shape, dtype=dt, device=device) for shape, dt in zip(shapes, dtypes)]


def record_ragged_run(wrapper: Any, q, k, v, out, lse) -> tuple[Callable, list]:
    """``(ragged_run, its argument list)``: what ``wrapper.run(q, k, v, out=out, lse=lse, return_lse=True,
    lse_base="log2", lse_layout="NH")`` calls, recorded without launching anything (``run()``'s one call of
    ``_cached_module.ragged_run`` goes to a recorder; the wrapper's module is restored before this returns, also on an
    error). ``ragged_run`` is FlashInfer's own Python function: called with the list (after putting each call's
    tensors in their :func:`argument_slots`) it launches what ``run()`` would, and leaves the LSE in base 2.

    q, k, v, out, lse: tensors of the run's shapes and dtypes (``lse`` float32 ``[T, H]``; stand-ins, for example
    one element expanded, where FlashInfer accepts them).

    Raises:
        LookupError: a FlashInfer outside :data:`KNOWN_VERSIONS` (:func:`version_why_not`), a wrapper without
            FlashInfer 0.7's module, a ``run()`` that called ``ragged_run`` other than once or returned other than
            ``(out, lse)``.
        Exception: whatever ``wrapper.run`` raises for these tensors (FlashInfer checked something they lack).
    """
    reason = recording_why_not(wrapper)
    if reason is not None:
        raise LookupError(reason)
    module = wrapper._cached_module
    calls: list = []
    proxy = types.SimpleNamespace(**vars(module))
    proxy.ragged_run = lambda *a: calls.append(list(a))
    wrapper._cached_module = proxy
    try:
        res = wrapper.run(q, k, v, out=out, lse=lse, return_lse=True, lse_base="log2", lse_layout="NH")
    finally:
        wrapper._cached_module = module
    if len(calls) != 1:
        raise LookupError(f"FlashInfer's run called ragged_run {len(calls)} times")
    if not isinstance(res, tuple) or len(res) != 2 or res[0] is not out or res[1] is not lse:
        raise LookupError("FlashInfer's run did not return the (out, lse) it was given")
    return module.ragged_run, calls[0]


def compiled_call(py_ragged_run: Callable, py_args: list) -> tuple[Any, list]:
    """``(compiled function, its argument list)`` one level below :func:`record_ragged_run`: FlashInfer 0.7's
    ``ragged_run`` reorders its arguments for the compiled TVM-FFI ``ragged_run_func`` (a free variable of it); a copy
    of it whose ``ragged_run_func`` records instead of launching is run on ``py_args`` (the original is untouched,
    nothing is launched).

    Raises:
        LookupError: a ``ragged_run`` without a ``ragged_run_func`` to call, or that called it other than once.
    """
    code = py_ragged_run.__code__
    if "ragged_run_func" not in code.co_freevars:
        raise LookupError("FlashInfer's ragged_run no longer calls a compiled ragged_run_func")
    recorded: list = []
    cells = []
    compiled = None
    assert py_ragged_run.__closure__ is not None  # it has free variables (ragged_run_func among them)
    for name, cell in zip(code.co_freevars, py_ragged_run.__closure__):
        if name == "ragged_run_func":
            compiled = cell.cell_contents
            cells.append(types.CellType(lambda *a: recorded.append(list(a))))
        else:
            cells.append(cell)
    clone = types.FunctionType(code, py_ragged_run.__globals__, code.co_name, py_ragged_run.__defaults__, tuple(cells))
    clone.__kwdefaults__ = py_ragged_run.__kwdefaults__
    clone(*py_args)
    if len(recorded) != 1:
        raise LookupError(f"FlashInfer's ragged_run called its compiled function {len(recorded)} times")
    return compiled, recorded[0]


def record_compiled_run(
    wrapper: Any, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> tuple[Any, list, list[int]]:
    """``(compiled function, its argument list, the positions of q / k / v / out / lse in it)``: what ``wrapper.run``
    launches for a run of ``shapes = (q, k, v, out, lse)`` (``lse_layout="NH"``, the LSE left in base 2), recorded
    without launching anything (:func:`record_ragged_run`, then :func:`compiled_call`), for a caller that calls the
    compiled function itself with each call's tensors in those positions (the JAX adapter's XLA call). The five
    positions hold None. Recorded on expanded :func:`stand_ins`; should FlashInfer refuse those, on real
    (uninitialised) ones, once.

    Raises:
        LookupError: as :func:`record_ragged_run` and :func:`compiled_call` (a FlashInfer outside
            :data:`KNOWN_VERSIONS`, a wrapper or ``ragged_run`` that does not look like 0.7's), or FlashInfer refused
            the real stand-ins too (its error named).
    """

    def record(expanded: bool) -> tuple[Any, list, list[int]]:
        tensors = stand_ins(shapes, dtype, device, expanded=expanded)
        compiled, args = compiled_call(*record_ragged_run(wrapper, *tensors))
        slots = argument_slots(args, tensors)
        for i in slots:
            args[i] = None  # the recording keeps no stand-in alive
        return compiled, args, slots

    try:
        return record(expanded=True)
    except LookupError:
        raise
    except Exception:  # noqa: BLE001 - FlashInfer checked something the expanded stand-ins do not have
        try:
            return record(expanded=False)
        except LookupError:
            raise
        except Exception as err:  # noqa: BLE001
            raise LookupError(f"recording FlashInfer's run failed: {type(err).__name__}: {err}") from err


def argument_slots(args: Sequence, tensors: Sequence, names: Sequence[str] = ("q", "k", "v", "out", "lse")) -> list:
    """The position of each of ``tensors`` in ``args``, found by identity.

    Raises:
        LookupError: a tensor found other than once (the message names it by ``names``).
    """
    slots = []
    for name, x in zip(names, tensors):
        hits = [i for i, a in enumerate(args) if a is x]
        if len(hits) != 1:
            raise LookupError(f"{name} appears {len(hits)} times in FlashInfer's call")
        slots.append(hits[0])
    return slots


def live_slots(wrapper: Any, args: Sequence) -> tuple[Optional[int], tuple[tuple[int, str], ...]]:
    """Where a recorded :func:`record_ragged_run` list holds the wrapper's buffers, to be read afresh at each call:
    ``(position of the float workspace or None, ((position, buffer name), ...) of the :data:`LIVE_BUFFERS`)``.

    Raises:
        LookupError: a buffer found more than once (its argument would be ambiguous).
    """
    live: list[tuple[int, str]] = []
    fw = None
    for name in (_FLOAT_WORKSPACE,) + LIVE_BUFFERS:
        value = getattr(wrapper, name, None)
        hits = [i for i, a in enumerate(args) if value is not None and a is value]
        if len(hits) > 1:
            raise LookupError(f"FlashInfer's wrapper buffer {name} appears {len(hits)} times in its call")
        if name == _FLOAT_WORKSPACE:
            fw = hits[0] if hits else None
        else:
            live.extend((i, name) for i in hits)
    return fw, tuple(live)


def live_values(wrapper: Any, live: Sequence[tuple[int, str]], args: list) -> None:
    """Put the wrapper's current buffers of ``live`` (:func:`live_slots`) into ``args``."""
    for i, name in live:
        args[i] = getattr(wrapper, name)


def float_workspace(wrapper: Any, default: Any = None) -> Any:
    """The float workspace the wrapper's ``run()`` reads (``default`` where it has none, a stand-in)."""
    return getattr(wrapper, _FLOAT_WORKSPACE, default)


def set_float_workspace(wrapper: Any, buf: torch.Tensor) -> None:
    """Point the wrapper's ``run()`` at float workspace ``buf`` (the caller serialises this with its runs)."""
    setattr(wrapper, _FLOAT_WORKSPACE, buf)


def int_workspace(wrapper: Any) -> Optional[torch.Tensor]:
    """The wrapper's device int workspace, where its runs read the schedule (None where it has none: a stand-in)."""
    buf = getattr(wrapper, "_int_workspace_buffer", None)
    return buf if isinstance(buf, torch.Tensor) else None


def set_int_workspace(wrapper: Any, device_buf: torch.Tensor, host_buf: torch.Tensor) -> None:
    """Give the wrapper the int workspace ``device_buf`` and its page-locked twin ``host_buf`` (the same size), which
    its next ``plan()`` writes and copies (nothing queued may still read the buffers replaced)."""
    wrapper._int_workspace_buffer = device_buf
    setattr(wrapper, _PINNED_INT_WORKSPACE, host_buf)


def device_kv_indptr(wrapper: Any, host: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
    """The device copy of the kv indptr ``host`` that ``plan()`` just queued (FlashInfer 0.7: for an explicit backend
    ``plan()`` sets ``self._kv_indptr_buf = kv_indptr.to(self.device, non_blocking=True)``, and its runs read it), or
    None where the wrapper holds nothing of that kind (int32, ``host``'s length, on ``device``)."""
    buf = getattr(wrapper, "_kv_indptr_buf", None)
    if isinstance(buf, torch.Tensor) and buf.dtype == torch.int32 and buf.device == device and buf.shape == host.shape:
        return buf
    return None


def held_bytes(wrapper: Any) -> tuple[int, int]:
    """``(device bytes, page-locked host bytes)`` the wrapper holds for its plan: the int workspace and its
    page-locked twin, the indptr copies ``plan()`` made, and a plan info made of tensors (cutlass's work-index
    buffers). Read from the attributes as they are (a missing one counts 0)."""
    device = host = 0
    for name in ("_int_workspace_buffer", "_qo_indptr_buf", "_kv_indptr_buf"):
        t = getattr(wrapper, name, None)
        if isinstance(t, torch.Tensor):
            device += t.numel() * t.element_size()
    info = getattr(wrapper, "_plan_info", None)
    if isinstance(info, (tuple, list)):
        device += sum(t.numel() * t.element_size() for t in info if isinstance(t, torch.Tensor))
    pinned = getattr(wrapper, _PINNED_INT_WORKSPACE, None)
    if isinstance(pinned, torch.Tensor):
        host += pinned.numel() * pinned.element_size()
    return device, host
