"""Launching mla_bridge's Triton kernels with a fraction of the host time of ``kernel[grid](...)``.

``kernel[grid](*args, **constexprs)`` goes through Triton's ``JITFunction.run`` on every call: it binds and
specializes every argument, builds the cache key, looks the compiled kernel up, reads the current device and stream
through torch, and only then calls the compiled kernel's launcher. Measured on the H200's host (Triton 3.6, torch
2.11, the merge kernel's 23 arguments), a launch through the compiled kernel's launcher with the stream handle read as
below costs under a third of one through ``kernel[grid]`` (docs/results.md). A chunked prefill launches two such
kernels per context chunk (the gather and the merge), so on a host-bound batch this is most of the difference to a
hand-written torch + FlashInfer pipeline.

:func:`launch` keeps, per JIT function, the compiled kernel of each *specialization* it has seen, keyed on
everything Triton specializes an argument on (``triton.runtime.jit`` binder, ``native_specialize_impl``; checked
against Triton 3.6 and 3.9):

* a tensor: its dtype and whether its data pointer is 16-byte aligned ("D" in Triton's key);
* an int: whether it is 1 (Triton makes it a constexpr), whether it is divisible by 16, and whether it fits int32,
  int64 or only uint64 (the parameter's type);
* a float (fp32), a bool (u1), ``None`` (a constexpr): their kind;
* the constexpr and compile-option values (``num_warps``, ...) with their types, the current device, and the Triton
  settings that enter Triton's own key (``TRITON_DEBUG``, the instrumentation mode, a stages-inspection hook).

The key is at least as fine as Triton's own, so a kernel is only reused for arguments it was compiled for. A key
seen for the first time goes through ``kernel[grid](...)`` (which compiles, or loads from Triton's cache, and
launches); later launches of that key call the compiled kernel's launcher directly, with the arguments in the order
``JITFunction.run`` passes them (every parameter in signature order, constexprs included; the launcher skips the
constexprs itself: read in the sources of Triton 3.6 and 3.9, and checked bitwise on the H200 with 3.6), on the
current stream (``torch._C._cuda_getCurrentRawStream``, the call Triton's own driver makes).

Everything else goes through ``kernel[grid](...)`` as before: a kernel with pre-run hooks, Triton without
``triton.knobs`` (older than 3.4, where the launch convention differs), launch hooks set (profilers such as Proton
add them to ``knobs.runtime``'s hook chains; the direct launch passes no hook and no launch metadata),
``TRITON_INTERPRET=1`` (no compiled kernel), an argument of another kind (an int beyond uint64 included), and
``MLA_BRIDGE_TRITON_LAUNCH=jit`` (the escape hatch; ``direct`` or unset is the default). Not re-checked on a direct
launch: Triton's test that the globals a kernel reads are unchanged (mla_bridge's kernels read none). Imported only
by the kernel modules, on first use.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch

from .. import switches

__all__ = ["launch", "spec_key", "LAUNCH_ENV", "LAUNCH_MODES"]

#: The environment variable choosing how kernels are launched: "direct" (default) or "jit" (always kernel[grid]).
LAUNCH_ENV = switches.TRITON_LAUNCH
LAUNCH_MODES = switches.LAUNCH_MODES  # ("direct", "jit")


def spec_key(args: Sequence[Any]) -> Optional[tuple]:
    """The specialization of runtime arguments as Triton sees it (module docstring), or None for an argument of a
    kind not covered (the caller then launches through ``kernel[grid]``). Written for speed (it runs on every
    launch: about 5 us for 24 arguments on this project's CPU machine): an int32-range int is 1, 16 (divisible by
    16) or 0; a wider one ``(divisible by 16, fits int64)`` (else uint64; None beyond); a tensor ``(dtype, 16-byte
    aligned)``."""
    key: list[Any] = []
    push = key.append
    for a in args:
        t = type(a)
        if t is int:
            if -2147483648 <= a <= 2147483647:
                push(1 if a == 1 else (16 if a & 15 == 0 else 0))
            elif -(2**63) <= a < 2**64:
                push((a & 15 == 0, a < 2**63))
            else:
                return None  # beyond uint64: Triton refuses it itself (OverflowError)
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            push((a.dtype, a.data_ptr() & 15 == 0))
        elif t is float:
            push("fp32")
        elif t is bool:
            push("u1")
        elif a is None:
            push(None)
        else:
            return None
    return tuple(key)


def mode() -> str:
    """The launch mode ``MLA_BRIDGE_TRITON_LAUNCH`` asks for ("direct" when unset or "auto").

    Raises:
        ValueError: any other value (the message lists :data:`LAUNCH_MODES`).
    """
    return switches.triton_launch()


_KNOBS: list = []  # triton.knobs once imported (False where Triton has none), looked up once


def _runtime_hooks():
    """Triton's launch hooks (set by profilers), or None where Triton has no ``knobs`` (older than 3.4)."""
    if not _KNOBS:
        try:
            from triton import knobs
        except ImportError:
            knobs = False
        _KNOBS.append(knobs)
    knobs = _KNOBS[0]
    return (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook) if knobs else None


def _triton_state() -> tuple:
    """The Triton settings outside the arguments that enter its own cache key (Triton 3.6-3.9: ``TRITON_DEBUG``,
    ``TRITON_INSTRUMENTATION_MODE``, a stages-inspection hook): part of the key, so a change is launched (and
    compiled) through ``kernel[grid]``."""
    knobs = _KNOBS[0] if _KNOBS else None
    if not knobs:
        return ()
    runtime, compilation = getattr(knobs, "runtime", None), getattr(knobs, "compilation", None)
    return (
        getattr(runtime, "debug", None),
        getattr(compilation, "instrumentation_mode", None),
        getattr(runtime, "add_stages_inspection_hook", None),
    )


def _hook_active(hook: Any) -> bool:
    """A launch hook that would do something: not None, and for Triton's ``HookChain`` (the default of 3.6 and
    later, empty until a profiler adds to it) one with calls."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _on_cuda(args: Sequence[Any]) -> bool:
    """The direct path takes launches whose first argument is a CUDA tensor (every mla_bridge kernel's output)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_cuda


def _current_device() -> int:
    return torch._C._cuda_getDevice()  # the device Triton launches on: torch's current one


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)  # what Triton's driver reads (0.1 us; current_stream(): 4 us)


#: per JIT function (by id: the kernels are module globals, alive as long as the process), its specializations
_CACHES: dict = {}


class _Entry:
    """One compiled specialization: its kernel and the constexpr values appended after the runtime arguments."""

    __slots__ = ("kernel", "tail")

    def __init__(self, kernel: Any, tail: tuple):
        self.kernel, self.tail = kernel, tail


def _tail(fn: Any, n_args: int, constexprs: dict) -> Optional[tuple]:
    """The values of the parameters after the ``n_args`` runtime ones, in signature order (given, or defaults), or
    None when that cannot be made (a name not given and without a default, an unknown keyword)."""
    names = list(getattr(fn, "arg_names", ()))
    params = list(getattr(fn, "params", ()))
    if len(names) != len(params) or n_args > len(names):
        return None
    if set(constexprs) - set(names[n_args:]):
        return None
    tail = []
    for name, p in zip(names[n_args:], params[n_args:]):
        if name in constexprs:
            tail.append(constexprs[name])
        else:
            default = getattr(p, "default", inspect.Parameter.empty)
            if default is inspect.Parameter.empty:
                return None
            tail.append(default)
    return tuple(tail)


def _usable(kernel: Any) -> bool:
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))


def launch(fn: Any, grid: tuple, args: Sequence[Any], constexprs: dict, options: Optional[dict] = None) -> None:
    """``fn[grid](*args, **constexprs, **options)``, with the compiled kernel's launcher called directly once this
    specialization has been launched (module docstring).

    Args:
        fn: a ``@triton.jit`` function.
        grid: 1 to 3 ints.
        args: the runtime (non-constexpr) arguments, positionally, in signature order.
        constexprs: every ``tl.constexpr`` parameter after them, by name (missing ones take their defaults).
        options: compile options (``num_warps``, ``num_stages``, ``enable_fp_fusion``, ...).

    Raises:
        ValueError: a bad ``MLA_BRIDGE_TRITON_LAUNCH``; whatever Triton raises for the launch itself.
    """
    options = options or {}
    hooks = _runtime_hooks() if mode() == "direct" else None
    quiet = hooks is not None and not _hook_active(hooks[0]) and not _hook_active(hooks[1])
    key = spec_key(args) if quiet and _on_cuda(args) and not getattr(fn, "pre_run_hooks", None) else None
    if key is None:
        fn[grid](*args, **constexprs, **options)
        return
    device = _current_device()
    values, opts = tuple(constexprs.values()), tuple(options.values())
    # the values' types too (True == 1 and False == 0 as dict keys, not to Triton)
    full = (
        device,
        key,
        tuple(constexprs),
        values,
        tuple(map(type, values)),
        tuple(options),
        opts,
        tuple(map(type, opts)),
        _triton_state(),
    )
    cache = _CACHES.get(id(fn))
    if cache is None:
        cache = _CACHES[id(fn)] = {}
    entry = cache.get(full)
    if entry is None:
        kernel = fn[grid](*args, **constexprs, **options)  # compiles (or loads) and launches through Triton
        tail = _tail(fn, len(args), constexprs) if _usable(kernel) else None
        cache[full] = _Entry(kernel, tail) if tail is not None else False
        return
    if entry is False:
        fn[grid](*args, **constexprs, **options)
        return
    k = entry.kernel
    k.run(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        _current_stream(device),
        k.function,
        k.packed_metadata,
        None,
        None,
        None,
        *args,
        *entry.tail,
    )
