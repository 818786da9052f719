"""mla_bridge.kernels.launch: a compiled Triton kernel is reused only for arguments of its own specialization.

A stand-in JIT function records every launch through ``fn[grid](...)`` (Triton's path: binds, compiles or looks up,
launches) and returns a stand-in compiled kernel whose ``run`` records the direct launches. Where Triton is
installed, the key is checked against Triton's own specializer: two arguments Triton tells apart are told apart here.
"""

from __future__ import annotations

import inspect
import itertools
import types

import pytest
import torch

import mla_bridge.kernels.launch as launch_mod
from mla_bridge.kernels.launch import launch, spec_key


class _Param:
    def __init__(self, default=inspect.Parameter.empty):
        self.default = default


class _Compiled:
    def __init__(self, fn, tag):
        self.fn, self.tag = fn, tag
        self.function, self.packed_metadata = f"function-{tag}", f"metadata-{tag}"

    def run(self, *call):
        self.fn.direct.append((self.tag, call))


class _JitFn:
    """``kernel(x_ptr, n, s, BLOCK: tl.constexpr, FLAG: tl.constexpr = 7)`` as far as launching goes."""

    arg_names = ["x_ptr", "n", "s", "BLOCK", "FLAG"]
    params = [_Param(), _Param(), _Param(), _Param(), _Param(7)]

    def __init__(self):
        self.jit, self.direct = [], []
        self._tags = itertools.count()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit.append((grid, args, kwargs))
            return _Compiled(self, next(self._tags))

        return run


_EMPTY_CHAIN = types.SimpleNamespace(calls=[])  # Triton 3.6+'s default hooks: HookChain objects with no calls


@pytest.fixture(params=["None hooks", "empty hook chains"])
def direct(monkeypatch, request):
    """Launches take the direct path: Triton's hooks unset (None, or Triton 3.6+'s empty HookChains), the arguments
    "on CUDA", device 0, stream 1234."""
    hooks = (None, None) if request.param == "None hooks" else (_EMPTY_CHAIN, _EMPTY_CHAIN)
    monkeypatch.setattr(launch_mod, "_runtime_hooks", lambda: hooks)
    monkeypatch.setattr(launch_mod, "_on_cuda", lambda args: True)
    monkeypatch.setattr(launch_mod, "_current_device", lambda: 0)
    monkeypatch.setattr(launch_mod, "_current_stream", lambda device: 1234)
    monkeypatch.delenv(launch_mod.LAUNCH_ENV, raising=False)
    monkeypatch.setattr(launch_mod, "_CACHES", {})


def test_second_launch_of_a_specialization_calls_the_compiled_kernel_directly(direct):
    fn, x = _JitFn(), torch.zeros(8)
    launch(fn, (3,), (x, 100, 17), dict(BLOCK=64), dict(num_warps=4))
    assert len(fn.jit) == 1 and fn.jit[0] == ((3,), (x, 100, 17), dict(BLOCK=64, num_warps=4)) and not fn.direct
    launch(fn, (5, 2), (x, 200, 33), dict(BLOCK=64), dict(num_warps=4))
    assert len(fn.jit) == 1
    tag, call = fn.direct[0]
    # grid padded to 3, the stream, the kernel's handles, no launch metadata or hooks, then every parameter in
    # signature order: the runtime arguments, the given constexpr, the default one
    assert tag == 0 and call == (5, 2, 1, 1234, "function-0", "metadata-0", None, None, None, x, 200, 33, 64, 7)


@pytest.mark.parametrize(
    "change",
    [
        "misaligned pointer",
        "other dtype",
        "int becomes 1",
        "int divisible by 16",
        "int beyond int32",
        "int beyond int64",
        "other constexpr",
        "constexpr True for 1",
        "other option",
        "option 0 for False",
        "other device",
        "TRITON_DEBUG set",
    ],
)
def test_another_specialization_goes_through_triton(direct, change, monkeypatch):
    fn = _JitFn()
    base = torch.zeros(64, dtype=torch.float32)
    args, cx = (base, 100, 17), dict(BLOCK=1 if change == "constexpr True for 1" else 64)
    opt = dict(num_warps=4, enable_fp_fusion=False)
    launch(fn, (1,), args, cx, opt)
    new_args, new_cx, new_opt = list(args), dict(cx), dict(opt)
    if change == "misaligned pointer":
        new_args[0] = base[1:]  # 4 bytes past a 16-byte aligned pointer
    elif change == "other dtype":
        new_args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "int becomes 1":
        new_args[1] = 1
    elif change == "int divisible by 16":
        new_args[2] = 32
    elif change == "int beyond int32":
        new_args[1] = 2**31 + 5
    elif change == "int beyond int64":
        new_args[1] = 2**63 + 5  # uint64 for Triton
    elif change == "option 0 for False":
        new_opt["enable_fp_fusion"] = 0
    elif change == "other device":
        monkeypatch.setattr(launch_mod, "_current_device", lambda: 1)
    elif change == "TRITON_DEBUG set":
        monkeypatch.setattr(launch_mod, "_triton_state", lambda: (True, "", None))
    elif change == "other constexpr":
        new_cx["BLOCK"] = 128
    elif change == "constexpr True for 1":
        new_cx["BLOCK"] = True
    elif change == "other option":
        new_opt["num_warps"] = 8
    launch(fn, (1,), tuple(new_args), new_cx, new_opt)
    assert len(fn.jit) == 2 and not fn.direct
    launch(fn, (1,), tuple(new_args), new_cx, new_opt)  # now known: direct, with the second compiled kernel
    assert len(fn.jit) == 2 and fn.direct[0][0] == 1


def test_hooks_env_and_cpu_tensors_keep_triton_path(direct, monkeypatch):
    fn, x = _JitFn(), torch.zeros(8)
    monkeypatch.setenv(launch_mod.LAUNCH_ENV, "jit")
    for _ in range(2):
        launch(fn, (1,), (x, 3, 5), dict(BLOCK=16))
    monkeypatch.setenv(launch_mod.LAUNCH_ENV, "direct")
    monkeypatch.setattr(launch_mod, "_runtime_hooks", lambda: (print, None))  # a profiler's enter hook
    for _ in range(2):
        launch(fn, (1,), (x, 3, 5), dict(BLOCK=16))
    busy_chain = types.SimpleNamespace(calls=[print])  # Triton 3.6+: a HookChain a profiler added to
    monkeypatch.setattr(launch_mod, "_runtime_hooks", lambda: (_EMPTY_CHAIN, busy_chain))
    launch(fn, (1,), (x, 3, 5), dict(BLOCK=16))
    monkeypatch.setattr(launch_mod, "_runtime_hooks", lambda: None)  # Triton older than 3.4
    launch(fn, (1,), (x, 3, 5), dict(BLOCK=16))
    monkeypatch.setattr(launch_mod, "_runtime_hooks", lambda: (None, None))
    monkeypatch.setattr(launch_mod, "_on_cuda", lambda args: False)  # TRITON_INTERPRET=1 on CPU tensors
    launch(fn, (1,), (x, 3, 5), dict(BLOCK=16))
    launch(fn, (1,), (x, object(), 5), dict(BLOCK=16))  # an argument of a kind the key does not cover
    monkeypatch.setattr(launch_mod, "_on_cuda", lambda args: True)
    launch(fn, (1,), (x, 2**64, 5), dict(BLOCK=16))  # beyond uint64: Triton's own OverflowError, not ours
    fn.pre_run_hooks = [print]  # a kernel with pre-run hooks: Triton runs them on every launch
    for _ in range(2):
        launch(fn, (1,), (x, 3, 5), dict(BLOCK=16))
    assert len(fn.jit) == 11 and not fn.direct


def test_missing_constexpr_or_unusable_kernel_keeps_triton_path(direct):
    fn, x = _JitFn(), torch.zeros(8)
    for _ in range(2):
        launch(fn, (1,), (x, 3, 5), {})  # BLOCK has no default: the tail cannot be made
    assert len(fn.jit) == 2 and not fn.direct

    class _Interpreted(_JitFn):
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.jit.append(args)
                return None  # the interpreter returns no compiled kernel

            return run

    fi = _Interpreted()
    for _ in range(2):
        launch(fi, (1,), (x, 3, 5), dict(BLOCK=16))
    assert len(fi.jit) == 2


def test_bad_launch_mode_is_refused(monkeypatch):
    monkeypatch.setenv(launch_mod.LAUNCH_ENV, "fast")
    with pytest.raises(ValueError, match="MLA_BRIDGE_TRITON_LAUNCH='fast'"):
        launch_mod.mode()
    monkeypatch.setenv(launch_mod.LAUNCH_ENV, " JIT ")
    assert launch_mod.mode() == "jit"


def test_key_is_at_least_as_fine_as_tritons():
    """Where Triton is installed: values Triton specializes differently get different keys here."""
    pytest.importorskip("triton")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    buf = torch.zeros(64, dtype=torch.bfloat16)
    values = [
        buf,
        buf[1:],
        buf[8:],
        torch.zeros(4, dtype=torch.uint8),
        torch.zeros(4, dtype=torch.float32),
        0,
        1,
        2,
        15,
        16,
        17,
        32,
        -1,
        -16,
        2**31 - 1,
        2**31,
        2**32,
        -(2**31),
        -(2**31) - 1,
        2**63,
        2**64 - 16,
        0.5,
        1.0,
        True,
        False,
        None,
    ]
    for refused in (2**64, 2**70, -(2**63) - 16):
        with pytest.raises(OverflowError):
            native_specialize_impl(BaseBackend, refused, False, True, True)
        assert spec_key([refused]) is None  # launched through kernel[grid], which raises Triton's own error
    for a, b in itertools.combinations(values, 2):
        ta = native_specialize_impl(BaseBackend, a, False, True, True)
        tb = native_specialize_impl(BaseBackend, b, False, True, True)
        if ta != tb:
            assert spec_key([a]) != spec_key([b]), (a, b, ta, tb)


def test_cdiv_and_next_power_of_2_are_tritons_values():
    """The launchers' plain-int grid helpers (triton.cdiv / next_power_of_2 are constexpr functions costing about
    2.5 us per host call in Triton 3.6+): the same values, checked against Triton where it is installed."""
    from mla_bridge.kernels import cdiv, next_power_of_2

    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 64, 65, 576)] == [0, 1, 2, 4, 64, 128, 1024]
    try:
        import triton
    except Exception:  # noqa: BLE001 - CI has no Triton: the values above are the check
        return
    for a in range(0, 3000, 7):
        assert next_power_of_2(a) == triton.next_power_of_2(a)
        for b in (1, 3, 16, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
