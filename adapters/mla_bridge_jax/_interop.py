"""JAX <-> torch conversion for the adapter: DLPack views, dtypes, devices, host values.

Every conversion here is zero-copy except the ones documented otherwise:
  * :func:`to_torch` (jax.Array -> torch.Tensor): ``torch.from_dlpack``; a JAX array is always dense, so this never
    copies (an array JAX holds in a non-default layout, e.g. one made from a transposed torch tensor, arrives as a
    strided view with the right strides). On CUDA, JAX makes torch's current stream wait for the array.
  * :func:`to_jax` (torch.Tensor -> jax.Array): ``jax.dlpack.from_dlpack``; on CUDA, torch makes JAX's stream wait.
  * DLPack orders the consumer after the producer's writes, nothing orders the producer after the consumer's reads:
    once an eager call's torch views of JAX's inputs are dropped, XLA may reuse those buffers (a donation, a deleted
    array's memory) while torch's queued kernels still read them. :func:`order_xla_after_torch` closes that gap.
  * :func:`from_torch` (user-facing torch -> JAX): tensors DLPack cannot hand over as they are are copied ONCE on
    their device first (``.contiguous()`` / ``.clone()``): a non-contiguous view (a last-dim slice ``t[..., :128]``
    is refused by JAX; a transposed tensor would become a JAX array in a non-default layout) and a data pointer that
    is not 16-byte aligned (XLA assumes aligned buffers; on GPU JAX takes a misaligned pointer silently). Values are
    never read at the wrong strides.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import weakref
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
import torch

__all__ = [
    "to_torch",
    "to_jax",
    "from_torch",
    "torch_dtype",
    "jax_dtype",
    "torch_device_of",
    "default_torch_device",
    "is_tracer",
    "check_array",
    "host_values",
    "buffer_device",
    "xla_stream",
    "order_xla_after_torch",
    "release_tokens",
    "jax_dtype_names",
]

_ALIGN = 16  # bytes: XLA's minimum alignment for entry parameters


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_array(name: str, x: Any) -> None:
    """``x`` must be a ``jax.Array`` (or a tracer of one under a JAX transformation).

    Raises:
        TypeError: naming ``name``; a torch tensor or numpy array gets a hint on how to convert it.
        ValueError: a deleted (or donated) array, naming ``name``.
    """
    if isinstance(x, jax.core.Tracer):
        return
    if isinstance(x, jax.Array):
        if x.is_deleted():  # donated or deleted: its buffer is gone (was a TypeError about NoneType)
            raise ValueError(
                f"{name} has been deleted (donated to another computation or deleted); pass a live jax.Array"
            )
        return
    hint = ""
    if isinstance(x, torch.Tensor):
        hint = " (convert a torch tensor with mla_bridge_jax.from_torch(t), or call mla_bridge's torch API directly)"
    elif isinstance(x, np.ndarray):
        hint = " (convert it with jnp.asarray(x))"
    raise TypeError(f"{name} must be a jax.Array, got {type(x).__module__}.{type(x).__name__}{hint}")


def host_values(name: str, x: Any, *, where: str) -> Any:
    """Host value of a length/indptr argument: lists, numpy and torch pass through; a concrete jax.Array is read
    back to numpy (a small device->host copy); a tracer is refused.

    Raises:
        TypeError: ``x`` is a tracer (a ``jax.jit`` argument or a value computed under a transformation).
    """
    if is_tracer(x):
        raise TypeError(
            f"{name} is a traced JAX value, but {where} needs it on the host (plan metadata is static): pass {name} "
            f"as a Python list or numpy array (closed over, or a static argument of jax.jit), or build the plan "
            f"outside the traced function (mla_bridge_jax.plan_ragged / mla_bridge_jax.build_plan)"
        )
    if isinstance(x, jax.Array):
        return np.asarray(x)
    return x


#: JAX / numpy dtype names that torch names alike, besides the FP8 formats (torch's dtype of the same name)
_SHARED_DTYPE_NAMES = frozenset(
    ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
)


def torch_dtype(dtype: Any, arg: str = "dtype") -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype (or a torch dtype, returned as is); ``arg`` names it in errors.

    Raises:
        TypeError: ``None`` (numpy would read it as float64) or no dtype at all; a dtype with no torch counterpart.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        raise TypeError(f"{arg} must be a JAX, numpy or torch dtype, got None")
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError) as err:
        raise TypeError(f"{arg} must be a JAX, numpy or torch dtype, got {dtype!r} ({err})") from None
    # and the FP8 formats torch has (the core says which it takes)
    found = getattr(torch, name, None) if name in _SHARED_DTYPE_NAMES or name.startswith("float8") else None
    if not isinstance(found, torch.dtype):
        raise TypeError(f"{arg} {name} has no torch counterpart supported by mla_bridge")
    return found


def jax_dtype(dtype: torch.dtype) -> Any:
    return jnp.dtype(str(dtype).replace("torch.", ""))


def torch_device_of(device: Any) -> torch.device:
    """The torch device of a JAX device (``jax.Device``), a torch device, or a string such as ``"cuda:0"``.

    Raises:
        ValueError: a string torch cannot parse or naming neither CPU nor CUDA (``device`` named), a JAX platform torch
            cannot address, or a CUDA device while torch has no CUDA.
    """
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as err:  # torch's "Expected one of cpu, cuda, ..." for JAX's "gpu" and the like
            raise ValueError(
                f"device must be a JAX device, a torch device, 'cpu' or 'cuda[:N]', got {device!r}"
            ) from err
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a JAX device, a torch device, 'cpu' or 'cuda[:N]', got {device!r}")
    else:
        platform = getattr(device, "platform", None)
        if platform == "cpu":
            dev = torch.device("cpu")
        elif platform in ("gpu", "cuda"):
            hw = getattr(device, "local_hardware_id", None)
            dev = torch.device("cuda", int(device.id if hw is None else hw))
        else:
            raise ValueError(
                f"JAX device {device!r} (platform {platform!r}) is not one mla_bridge can run on (CPU or CUDA)"
            )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"the JAX arrays live on {dev}, but this torch build has no CUDA "
            f"(torch {torch.__version__}); install a CUDA build of torch"
        )
    return dev


def default_torch_device() -> torch.device:
    """Where a traced call is planned at trace time: JAX's default device (``jax_default_device`` if set, else
    ``jax.devices()[0]``). A callback that runs on another device plans for that device on first use."""
    # a runtime option that jax's Config stub does not declare
    dev = jax.config.jax_default_device  # type: ignore[attr-defined]
    if dev is None or isinstance(dev, str):
        dev = jax.devices(dev)[0] if isinstance(dev, str) else jax.devices()[0]
    return torch_device_of(dev)


def to_torch(name: str, x: Any) -> torch.Tensor:
    """Zero-copy torch view of a single-device ``jax.Array`` (DLPack; on CUDA ordered after JAX's pending writes).

    The view shares JAX's buffer: never write into it. JAX keeps the buffer while the view lives, but does not wait
    for torch's queued reads of it once the view is gone: after queuing them, call :func:`order_xla_after_torch`.

    Raises:
        TypeError: not a jax.Array (named).
        ValueError: an array spread over several devices (named).
    """
    check_array(name, x)
    devices = x.sharding.device_set
    if len(devices) != 1:
        raise ValueError(
            f"{name} is spread over {len(devices)} devices; split the heads over them with "
            f"mla_bridge_jax.sharded_ragged_prefill / sharded_mla_prefill (or call under jax.jit)"
        )
    return torch.from_dlpack(x)


#: CUDA device index -> a one-element torch tensor handed to XLA by DLPack as the carrier of torch's stream position
_TOKENS: dict[int, torch.Tensor] = {}
_after: Any = None  # jax.jit of a one-element op, compiled once per device
#: JAX's TFRT GPU client (opt-in) launches a computation when its inputs are ready on the host, not in stream order
ENV_TFRT_CLIENT = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"


def _tfrt_client() -> bool:
    try:
        return bool(int(os.environ.get(ENV_TFRT_CLIENT, "0") or 0))
    except ValueError:
        return False


def order_xla_after_torch(device: torch.device) -> None:
    """Make XLA's compute stream on ``device`` wait for the work queued so far on torch's current stream there, so
    that XLA reuses no buffer torch's queued kernels still read (call it after an eager call queued torch work on
    DLPack views of JAX arrays, and before the views are dropped). Nothing on the CPU (torch's work there has run).

    How, keeping the zero-copy and without a host sync: a one-element torch tensor goes to JAX by DLPack
    (``jax.dlpack.from_dlpack`` hands torch the stream JAX reads external arrays on; torch records an event after its
    queued work and makes that stream wait; JAX's array is defined after that wait), and a jitted one-element op on
    it is dispatched: XLA's compute stream waits for its input's definition before it. With JAX's default GPU client
    (StreamExecutor) every later XLA computation on the device, a donation of the inputs or a reuse of their freed
    memory included, runs after it on that stream (host-to-device copies into reused memory wait for the compute
    stream too). Costs one small DLPack import and one cached jit dispatch per call (the op is compiled once per
    device). With the TFRT client (``XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1``), which launches a computation once its
    inputs are ready on the host rather than in stream order, this waits on the host for torch's stream instead."""
    if device.type != "cuda":
        return
    if _tfrt_client():
        torch.cuda.current_stream(device).synchronize()
        return
    global _after
    token = _TOKENS.get(device.index)
    if token is None:
        with _lock:
            token = _TOKENS.get(device.index)
            if token is None:
                token = _TOKENS[device.index] = torch.zeros(1, dtype=torch.int32, device=device)
    if _after is None:
        _after = jax.jit(lambda t: t + 1)
    _after(jax.dlpack.from_dlpack(token))  # the result is dropped: its computation's place in the stream is the point


def release_tokens() -> None:
    """Drop the per-device ordering tokens of :func:`order_xla_after_torch` (at interpreter exit, while CUDA is up);
    the next call makes a new one."""
    _TOKENS.clear()


def to_jax(t: torch.Tensor) -> jax.Array:
    """Zero-copy ``jax.Array`` of a dense, aligned torch tensor the core produced (DLPack)."""
    return jax.dlpack.from_dlpack(t)


def from_torch(t: torch.Tensor) -> jax.Array:
    """A torch tensor as a ``jax.Array`` on the same device: zero-copy when DLPack can pass it as it is, else one
    device copy first (non-contiguous views such as ``t[..., :128]`` or a transpose, or a data pointer that is not
    16-byte aligned). The result never aliases memory at the wrong strides, and never holds other values.

    Raises:
        TypeError: not a torch tensor; a 64-bit dtype (int64, uint64, float64, complex128) while JAX's 64-bit types
            are off (``jax_enable_x64``, off by default), where DLPack would narrow the values to 32 bits.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch expects a torch.Tensor, got {type(t).__name__}")
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # a runtime option the Config stub lacks
    if t.dtype.itemsize == 8 and t.dtype != torch.complex64 and not x64:
        raise TypeError(
            f"from_torch: a {t.dtype} tensor would be narrowed to 32 bits (JAX's 64-bit types are off); "
            f"convert it first or enable jax_enable_x64"
        )
    t = t.detach()
    if t.numel() and not t.is_contiguous():
        t = t.contiguous()  # one copy on t's device
    elif t.numel() and t.data_ptr() % _ALIGN:
        t = t.clone()  # one copy, aligned
    return jax.dlpack.from_dlpack(t)


# ---------------------------------------------------------------------------------------------------------------
# Inside an XLA callback
# ---------------------------------------------------------------------------------------------------------------


def buffer_device(buf: Any) -> torch.device:
    """The torch device of an XLA FFI buffer (``__dlpack_device__``: (1, _) CPU, (2, ordinal) CUDA)."""
    kind, ordinal = buf.__dlpack_device__()
    if int(kind) == 1:
        return torch.device("cpu")
    if int(kind) == 2:
        return torch.device("cuda", int(ordinal))
    raise ValueError(f"mla_bridge_jax: XLA buffer on DLPack device type {int(kind)}; only CPU and CUDA are served")


_streams: dict[tuple[int, int], Any] = {}
# plan -> the indices of the devices whose prior torch work XLA's stream has waited for
_synced: weakref.WeakKeyDictionary[Any, set[int | None]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@contextlib.contextmanager
def xla_stream(ctx: Any, device: torch.device, get_plan: Callable[[torch.device], Any]):
    """Inside a ``buffer_callback``: yield ``get_plan(device)`` with torch running on XLA's compute stream
    (``ctx.stream``) and ``device`` current, on CUDA; on CPU just the plan.

    The plan is fetched (and, for a device seen the first time, made) before torch switches streams; the first time
    a plan runs on a device, XLA's stream waits for the work already queued on torch's current stream there
    (FlashInfer's plan copies its schedule to the device on that stream, asynchronously).
    """
    if device.type != "cuda":
        yield get_plan(device)
        return
    with torch.cuda.device(device):
        plan = get_plan(device)
        ptr = int(ctx.stream)
        with _lock:
            stream = _streams.get((device.index, ptr))
            if stream is None:
                stream = _streams[(device.index, ptr)] = torch.cuda.ExternalStream(ptr, device=device)
            done = _synced.setdefault(plan, set())
            first = device.index not in done
            done.add(device.index)
        if first:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield plan


#: ``torch.<dtype>`` in a message: every dtype torch names (longest first, so "float8_e4m3fnuz" is not cut short).
_TORCH_DTYPE_NAME = re.compile(
    r"\btorch\.("
    + "|".join(
        sorted(
            {str(d)[len("torch.") :] for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=len, reverse=True
        )
    )
    + r")\b"
)


@contextlib.contextmanager
def jax_dtype_names():
    """Re-raise the core's TypeError / ValueError with its dtypes named as JAX names them ("torch.bfloat16" ->
    "bfloat16"): the caller handed JAX arrays, converted to torch only to reach the core. Other errors, and messages
    naming no torch dtype, pass unchanged."""
    try:
        yield
    except (TypeError, ValueError) as err:
        named = _TORCH_DTYPE_NAME.sub(r"\1", str(err))
        renamed = None
        if named != str(err):
            with contextlib.suppress(Exception):  # an exception type with another constructor stays as it is
                renamed = type(err)(named)
        if renamed is None:
            raise
        raise renamed.with_traceback(err.__traceback__) from err.__cause__
