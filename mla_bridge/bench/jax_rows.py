"""Section 6: the JAX adapter (eager, and under jit on each route) against the torch core and
``jax.nn.dot_product_attention`` (cuDNN, v padded to 192), on the same buffers.

JAX and :mod:`mla_bridge_jax` are imported only when the section runs (the bench sits on top of the package; the
core never imports an adapter); without them the section is one skipped row saying what is missing.

``compare()`` returns one dict per (case, implementation): ``case``, ``impl``, ``backend``, ``ms`` (mean wall time per
call over ``iters`` back-to-back calls, synchronised once at the end, so host overhead shows only when it exceeds
the kernel: this section's statistic is that mean, not the median of the other sections), ``tflops``
(:func:`.common.attention_flops`: ``2 * q.k pairs * H * (192 + 128)``, a causal request of n tokens n (n + 1) / 2
pairs),
``vs_torch`` (torch core ms / this ms), ``note`` (why a row was skipped, or the route), and ``flops``, ``heads``,
``seq_len`` (total tokens), ``repeats``. The ``tiny`` case (16
tokens) shows per-call overhead. Meant for the GPU (set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so torch and XLA
share memory); it also runs on CPU with small cases, for a smoke test.

    from mla_bridge.bench.jax_rows import compare
    for row in compare():
        print(row)
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .common import Case, Ctx, Job, Row, Variant, attention_flops

__all__ = ["compare", "DEFAULT_CASES", "format_rows", "jobs", "VARIANT"]

#: The section as one variant: its rows are those :func:`compare` returns (their ``impl`` is the path).
VARIANT = Variant("jax", "mla_bridge.bench.jax_rows.compare", 0, ("jax",))

#: (name, per-request lengths; causal, q_len == kv_len)
DEFAULT_CASES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("causal 4x4096", (4096,) * 4),
    ("causal 1x10000", (10000,)),
    ("tiny 1x16", (16,)),
)


def _time(fn: Callable[[], Any], sync: Callable[[Any], None], warmup: int, iters: int) -> float:
    result = None
    for _ in range(warmup):
        result = fn()
    sync(result)
    t0 = time.perf_counter()
    for _ in range(iters):
        result = fn()
    sync(result)
    return (time.perf_counter() - t0) * 1e3 / iters


def _jax_sync(result: Any) -> None:
    import jax

    jax.block_until_ready(result)


def _torch_sync(_: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare(
    cases: Sequence[tuple[str, Sequence[int]]] = DEFAULT_CASES,
    *,
    heads: int = 16,
    dtype: Any = None,
    causal: bool = True,
    warmup: int = 5,
    iters: int = 50,
    routes: Sequence[str] = ("buffer_callback", "tvm_ffi"),
    include_cudnn: bool = True,
    include_xla: bool = False,
    backend: Optional[str] = None,
    seed: int = 0,
) -> list[dict]:
    """Time each implementation on each case; see the module docstring for the row format.

    Args:
        cases: ``(name, lengths)``; each request has ``q_len == kv_len == length``.
        heads: attention heads (16: DeepSeek-V2-Lite; 128: V3).
        dtype: q/k/v dtype (``jnp.bfloat16`` by default).
        routes: jit routes to time (a route that cannot serve gets a row with its reason in ``note``).
        include_cudnn / include_xla: ``jax.nn.dot_product_attention`` with ``implementation="cudnn"`` / ``"xla"``
            (equal-length cases only; v padded to 192 and the output sliced back to 128).
        backend: force the core backend (default: the dispatch table).

    Raises:
        ImportError: JAX or :mod:`mla_bridge_jax` is not importable.
    """
    import jax
    import jax.numpy as jnp
    from mla_bridge_jax import api

    dtype = jnp.bfloat16 if dtype is None else dtype

    device = jax.devices()[0]
    d_qk, d_vo = 192, 128
    sm_scale = d_qk**-0.5
    rows: list[dict] = []
    key = jax.random.key(seed)
    for name, lens in cases:
        lens = [int(x) for x in lens]
        t = sum(lens)
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        kq, kk, kv_, key = jax.random.split(key, 4)
        q = jax.random.normal(kq, (t, heads, d_qk), dtype)
        k = jax.random.normal(kk, (t, heads, d_qk), dtype)
        v = jax.random.normal(kv_, (t, heads, d_vo), dtype)
        flops = attention_flops(lens, lens, causal=causal, heads=heads, head_dim_sum=d_qk + d_vo)
        plan = api.plan_ragged(
            indptr,
            indptr,
            num_heads=heads,
            head_dim_qk=d_qk,
            head_dim_vo=d_vo,
            causal=causal,
            sm_scale=sm_scale,
            dtype=dtype,
            device=device,
            backend=backend,
        )
        be = plan.backend.name

        def row(impl: str, ms: Optional[float], note: str = "", backend_name: str = be) -> None:
            rows.append(
                dict(
                    case=name,
                    impl=impl,
                    backend=backend_name,
                    ms=ms,
                    tflops=None if ms is None else flops / (ms * 1e-3) / 1e12,
                    vs_torch=None,
                    note=note,
                    flops=flops,
                    heads=heads,
                    seq_len=t,
                    repeats=iters,
                )
            )

        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        row("torch core (RaggedPlan.run)", _time(lambda: plan.run(tq, tk, tv), _torch_sync, warmup, iters))
        row("jax eager (run_ragged)", _time(lambda: api.run_ragged(plan, q, k, v), _jax_sync, warmup, iters))
        for route in routes:
            try:
                fn = jax.jit(lambda a, b, c, r=route: api.run_ragged(plan, a, b, c, jit_route=r))
                row(f"jax jit ({route})", _time(lambda: fn(q, k, v), _jax_sync, warmup, iters), note=route)
            except (ValueError, NotImplementedError, ImportError, RuntimeError) as err:
                row(f"jax jit ({route})", None, note=f"skipped: {err}")
        impls = [("cudnn", include_cudnn), ("xla", include_xla)]
        for impl, wanted in impls:
            if not wanted:
                continue
            label = f"jax.nn.dot_product_attention ({impl}, v padded to 192)"
            if len(set(lens)) != 1:
                row(label, None, note="skipped: needs equal lengths (padded batch)", backend_name=impl)
                continue
            if impl == "cudnn" and device.platform != "gpu":
                row(label, None, note="skipped: cuDNN needs a GPU", backend_name=impl)
                continue
            b, n = len(lens), lens[0]
            qd, kd = q.reshape(b, n, heads, d_qk), k.reshape(b, n, heads, d_qk)
            vd = jnp.pad(v.reshape(b, n, heads, d_vo), ((0, 0), (0, 0), (0, 0), (0, d_qk - d_vo)))

            def sdpa(a, b_, c, impl=impl):
                o = jax.nn.dot_product_attention(a, b_, c, scale=sm_scale, is_causal=causal, implementation=impl)
                return o[..., :d_vo]

            try:
                fn = jax.jit(sdpa)
                row(label, _time(lambda: fn(qd, kd, vd), _jax_sync, warmup, iters), backend_name=impl)
            except Exception as err:  # cuDNN may refuse a shape/dtype on a given GPU
                row(label, None, note=f"skipped: {type(err).__name__}: {str(err)[:200]}", backend_name=impl)
        base = next(r["ms"] for r in rows if r["case"] == name and r["impl"].startswith("torch core"))
        for r in rows:
            if r["case"] == name and r["ms"]:
                r["vs_torch"] = base / r["ms"]
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    """A plain-text table of :func:`compare` rows."""
    lines = [f"{'case':<16} {'impl':<52} {'backend':<16} {'ms':>9} {'TFLOP/s':>9} {'vs torch':>8}  note"]
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.4f}"
        tf = "-" if r["tflops"] is None else f"{r['tflops']:.1f}"
        vs = "-" if r["vs_torch"] is None else f"{r['vs_torch']:.3f}"
        lines.append(f"{r['case']:<16} {r['impl']:<52} {r['backend']:<16} {ms:>9} {tf:>9} {vs:>8}  {r['note']}")
    return "\n".join(lines)


def _job(ctx: Ctx) -> list[Row]:
    c = Case(ctx, "jax", "JAX adapter", {"jax": VARIANT}, 0)
    why = VARIANT.missing(ctx)
    if why:
        return [c.skip("jax", f"JAX section skipped: {why}")]
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    kwargs: dict = dict(warmup=ctx.warmup, iters=ctx.repeats, seed=ctx.seed, backend=ctx.backend)
    if ctx.quick:
        kwargs["cases"] = (("tiny 2x32", (32, 32)),)
    try:
        result = compare(**kwargs)
    except ImportError as err:
        return [c.skip("jax", "JAX section skipped: mla_bridge_jax is not importable", err)]
    except Exception as err:  # noqa: BLE001
        return [c.failed("jax", err)]
    rows = []
    for i, d in enumerate(result):
        ms, flops = d.get("ms"), d.get("flops")
        row = ctx.row("jax", d["case"], d["impl"], ms=ms, flops=flops, note=d.get("note") or "", order=(5, i, 0))
        row.status = "ok" if ms is not None else "skipped"
        row.seq_len, row.heads, row.repeats = d.get("seq_len"), d.get("heads"), d.get("repeats")
        row.extra.update(backend=d.get("backend"), vs_torch=d.get("vs_torch"), statistic="mean of back-to-back calls")
        rows.append(row)
    return rows or [c.skip("jax", "compare() returned no rows")]


def jobs(ctx: Ctx) -> list[Job]:
    return [Job("jax", "JAX adapter (mla_bridge.bench.jax_rows.compare)", _job)]


if __name__ == "__main__":  # pragma: no cover
    print(format_rows(compare()))
