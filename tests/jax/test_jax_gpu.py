"""The JAX adapter on a CUDA GPU with FlashInfer (run on the H200): zero-copy pointers, stream ordering, jit
bitwise equal to the torch core on both routes, mla_prefill under jit, and a benchmark smoke run."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims, Workspace  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402
from tests.helpers import jax_reference  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SM = 192**-0.5


@pytest.fixture(scope="module")
def gpu():
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    return dev


def _qkv(q_lens, kv_lens, heads, device, seed=0, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(seed), 3)
    t, s = sum(q_lens), sum(kv_lens)
    q = jax.random.normal(keys[0], (t, heads, 192), dtype)
    k = jax.random.normal(keys[1], (s, heads, 192), dtype)
    v = jax.random.normal(keys[2], (s, heads, 128), dtype)
    return tuple(jax.device_put(x, device) for x in (q, k, v))


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32).tolist()


def _equal(jx, tx) -> bool:
    return torch.equal(torch.from_dlpack(jx), tx)


def test_eager_zero_copy_on_gpu(gpu, monkeypatch):
    lens = [300, 1, 0, 77]
    q, k, v = _qkv(lens, lens, 16, gpu)
    seen = {}
    orig = mla_bridge.ragged_prefill

    def spy(tq, tk, tv, *a, **kw):
        out, lse = orig(tq, tk, tv, *a, **kw)
        seen.update(
            q=tq.data_ptr(),
            k=tk.data_ptr(),
            v=tv.data_ptr(),
            out=out.data_ptr(),
            lse=lse.data_ptr(),
            device=tq.device,
            backend=None,
        )
        return out, lse

    monkeypatch.setattr(mla_bridge, "ragged_prefill", spy)
    out, lse = mj.ragged_prefill(q, k, v, _indptr(lens), _indptr(lens), causal=True, sm_scale=SM)
    assert seen["device"].type == "cuda"
    assert (seen["q"], seen["k"], seen["v"]) == tuple(x.unsafe_buffer_pointer() for x in (q, k, v))
    assert (seen["out"], seen["lse"]) == (out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer())
    assert out.devices() == {gpu}


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("route", ["buffer_callback", "tvm_ffi"])
def test_jit_bitwise_equal_to_core(gpu, heads, route):
    q_lens, kv_lens = [700, 1, 0, 129, 33], [900, 1, 5, 129, 33]
    q, k, v = _qkv(q_lens, kv_lens, heads, gpu)
    qo, kv = _indptr(q_lens), _indptr(kv_lens)
    plan = mj.plan_ragged(
        qo,
        kv,
        num_heads=heads,
        head_dim_qk=192,
        head_dim_vo=128,
        causal=True,
        sm_scale=SM,
        dtype=jnp.bfloat16,
        device=gpu,
    )
    assert plan.backend.is_flashinfer
    if route == "tvm_ffi":
        from mla_bridge_jax import tvm_ffi

        reason = tvm_ffi.why_not(plan)
        if reason is not None:
            pytest.skip(f"tvm_ffi route unavailable: {reason}")
    core_out, core_lse = plan.run(*(torch.from_dlpack(x) for x in (q, k, v)))
    f = jax.jit(lambda a, b, c: mj.run_ragged(plan, a, b, c, jit_route=route))
    g = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, qo, kv, causal=True, sm_scale=SM, jit_route=route))
    for fn in (f, g):
        for _ in range(2):
            out, lse = fn(q, k, v)
            assert _equal(out, core_out) and _equal(lse, core_lse)


@pytest.mark.parametrize("route", ["buffer_callback", "tvm_ffi"])
def test_jit_orders_after_producers_and_before_consumers(gpu, route):
    """Inputs computed by XLA right before the call, outputs consumed right after, in one jit: the kernel must run
    on XLA's stream between them (a wrong stream shows up as stale or partial values)."""
    lens = [2048, 2048]
    q, k, v = _qkv(lens, lens, 16, gpu, seed=3)
    qo = _indptr(lens)
    w = jax.device_put(jax.random.normal(jax.random.key(9), (192, 192), jnp.bfloat16) * 0.07, gpu)
    if route == "tvm_ffi":
        from mla_bridge_jax import tvm_ffi

        plan = mj.plan_ragged(
            qo,
            qo,
            num_heads=16,
            head_dim_qk=192,
            head_dim_vo=128,
            causal=True,
            sm_scale=SM,
            dtype=jnp.bfloat16,
            device=gpu,
        )
        if tvm_ffi.why_not(plan) is not None:
            pytest.skip(f"tvm_ffi route unavailable: {tvm_ffi.why_not(plan)}")

    def layer(q, k, v):
        for _ in range(8):  # long producer chain
            q = (q @ w).astype(jnp.bfloat16)
        out, lse = mj.ragged_prefill(q, k, v, qo, qo, causal=True, sm_scale=SM, jit_route=route)
        return q, out * 2, lse + 1

    q2, out2, lse1 = jax.jit(layer)(q, k, v)
    core_out, core_lse = mla_bridge.ragged_prefill(
        *(torch.from_dlpack(x) for x in (q2, k, v)), qo, qo, causal=True, sm_scale=SM
    )
    assert torch.equal(torch.from_dlpack(out2), core_out * 2)
    assert torch.equal(torch.from_dlpack(lse1), core_lse + 1)


def test_eager_waits_for_pending_jax_work(gpu):
    lens = [4096, 4096]
    q, k, v = _qkv(lens, lens, 16, gpu, seed=4)
    big = jax.device_put(jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16), gpu)
    for _ in range(3):  # the next line is dispatched while this is still running on the GPU
        q = q + ((big @ big)[0, 0] * 0).astype(jnp.bfloat16)
    out, lse = mj.ragged_prefill(q, k, v, _indptr(lens), _indptr(lens), causal=True, sm_scale=SM)
    core_out, core_lse = mla_bridge.ragged_prefill(
        *(torch.from_dlpack(x) for x in (q, k, v)), _indptr(lens), _indptr(lens), causal=True, sm_scale=SM
    )
    assert _equal(out, core_out) and _equal(lse, core_lse)


def test_mla_prefill_jit_on_gpu(gpu):
    dims = MLADims.deepseek_v2_lite()
    ql, cl, bs = [37, 0, 5], [100, 64, 0], 16
    rng = np.random.default_rng(0)
    t = sum(ql)
    nb = sum(-(-c // bs) for c in cl) + 1
    host = [
        rng.standard_normal(s).astype(np.float32)
        for s in ((t, 16, 192), (t, 512), (t, 64), dims.kv_b_proj_shape, (nb, bs, 576))
    ]
    host[3] *= 512**-0.5
    table = np.full((3, 8), -1, np.int32)
    perm, i = rng.permutation(nb), 0
    for r, c in enumerate(cl):
        for b in range(-(-c // bs)):
            table[r, b] = perm[i]
            i += 1
    args = [jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu) for x in host] + [jax.device_put(table, gpu)]
    dev = mj._interop.torch_device_of(gpu)
    for chunk in (4096, 64):  # fused, then chunked (3 chunks + merges)
        plan = mj.build_plan(
            ql, cl, dims=dims, block_size=bs, dtype=jnp.bfloat16, workspace=Workspace(dev, chunk_tokens=chunk)
        )
        core_out, core_lse = mla_bridge.mla_prefill(*(torch.from_dlpack(a) for a in args), plan, return_lse=True)
        out, lse = jax.jit(lambda *a: mj.mla_prefill(*a, plan, return_lse=True))(*args)
        assert _equal(out, core_out) and _equal(lse, core_lse), (chunk, plan)
        ref_out, ref_lse = jax_reference.mla_attention(*args[:5], table, ql, cl, sm_scale=dims.softmax_scale)
        assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out))) < 2e-2


def test_bench_compare_smoke_on_gpu(gpu):
    from mla_bridge.bench.jax_rows import compare

    rows = compare([("causal 2x1024", (1024, 1024))], iters=3, warmup=1)
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["torch core (RaggedPlan.run)"]["ms"] > 0
    assert by_impl["jax jit (buffer_callback)"]["ms"] > 0
    assert any("cudnn" in r["impl"] for r in rows)


SLEEP = int(2e8)  # GPU cycles (about 0.1 s on the H200); 10 of them keep torch's stream busy past the host's next ops


def _mla_args(gpu, dims, ql, cl, bs, seed):
    """mla_prefill's inputs as XLA-owned bf16 arrays (donatable), block table included."""
    rng = np.random.default_rng(seed)
    t = sum(ql)
    nb = sum(-(-c // bs) for c in cl) + 1
    host = [
        rng.standard_normal(s).astype(np.float32)
        for s in ((t, 16, 192), (t, 512), (t, 64), dims.kv_b_proj_shape, (nb, bs, 576))
    ]
    host[3] *= 512**-0.5
    table = np.full((len(ql), max(1, max(-(-c // bs) for c in cl))), -1, np.int32)
    perm, i = rng.permutation(nb), 0
    for r, c in enumerate(cl):
        for b in range(-(-c // bs)):
            table[r, b] = perm[i]
            i += 1
    return [jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu) for x in host] + [jax.device_put(table, gpu)]


@pytest.mark.parametrize("entry", ["ragged_prefill", "run_ragged", "mla_prefill"])
def test_eager_inputs_may_be_donated_right_after_the_call(gpu, entry):
    """An eager call queues its kernels on torch's stream, kept busy here, and returns; an input is then donated to
    a jitted function that overwrites it (q; for mla_prefill the paged cache, as an engine's cache update would).
    XLA must not reuse the buffer before the queued kernels read it: the eager call orders XLA's stream after
    them (mla_bridge_jax._interop.order_xla_after_torch). Before, nothing did, and the kernel read the overwritten
    buffer (H200, ragged_prefill then q donated: max error 4.17)."""
    overwrite = jax.jit(lambda x: x * 0 + 3, donate_argnums=0)
    if entry == "mla_prefill":
        dims = MLADims.deepseek_v2_lite()
        ql, cl = [300, 0, 5], [1000, 64, 0]
        args = _mla_args(gpu, dims, ql, cl, 16, seed=6)
        plan = mj.build_plan(ql, cl, dims=dims, block_size=16, dtype=jnp.bfloat16, device=gpu)
        want = mla_bridge.mla_prefill(*(torch.from_dlpack(a) for a in args), plan, return_lse=True)
        victim = 4  # the cache

        def call():
            return mj.mla_prefill(*args, plan, return_lse=True)
    else:
        lens = [1500, 2500]
        q, k, v = _qkv(lens, lens, 16, gpu, seed=5)
        qo = _indptr(lens)
        args = [q, k, v]
        want = mla_bridge.ragged_prefill(*(torch.from_dlpack(x) for x in args), qo, qo, causal=True, sm_scale=SM)
        victim = 0  # q
        if entry == "ragged_prefill":

            def call():
                return mj.ragged_prefill(*args, qo, qo, causal=True, sm_scale=SM)
        else:
            plan = mj.plan_ragged(
                qo,
                qo,
                num_heads=16,
                head_dim_qk=192,
                head_dim_vo=128,
                causal=True,
                sm_scale=SM,
                dtype=jnp.bfloat16,
                device=gpu,
            )

            def call():
                return mj.run_ragged(plan, *args)

    want = tuple(t.clone() for t in want)
    overwrite(jnp.zeros_like(args[victim])).block_until_ready()  # compiled now, not while torch's stream sleeps
    call()  # the eager path's own first-use work (JIT, compiles) done before the timed part
    torch.cuda.synchronize()
    ptr = args[victim].unsafe_buffer_pointer()
    torch.cuda._sleep(10 * SLEEP)  # on torch's current stream: the call's kernels start after it
    out, lse = call()
    overwritten = overwrite(args.pop(victim))  # donated: XLA writes 3s into that buffer
    assert overwritten.unsafe_buffer_pointer() == ptr, "XLA did not reuse the donated buffer: the test means nothing"
    overwritten.block_until_ready()
    torch.cuda.synchronize()
    got_out, got_lse = torch.from_dlpack(out), torch.from_dlpack(lse)
    err = (got_out.float() - want[0].float()).abs().max().item()
    assert torch.equal(got_out, want[0]) and torch.equal(got_lse, want[1]), f"max error of out {err}"


_EXIT_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, torch
import mla_bridge_jax as mj
from mla_bridge import MLADims, Workspace
from tests.parity.inputs import PREFILL_CASES, prefill_inputs

case = next(c for c in PREFILL_CASES if not c.fused and sum(c.context_lens))  # a chunked schedule
x = prefill_inputs(case)
dev = jax.devices("gpu")[0]
args = [
    jax.device_put(jnp.asarray(x[n], dtype=jnp.bfloat16 if x[n].dtype == np.float32 else None), dev)
    for n in ("q", "kv_c", "k_pe", "kv_b_proj_weight", "kv_cache", "block_table")
]
plan = mj.build_plan(case.query_lens, case.context_lens, dims=MLADims(num_heads=case.heads),
                     block_size=case.block_size, dtype="bfloat16",
                     workspace=Workspace("cuda", chunk_tokens=case.chunk_tokens))
jax.block_until_ready(jax.jit(lambda *a: mj.mla_prefill(*a, plan))(*args))
print("ran", flush=True)
"""


def test_a_process_with_a_jitted_chunked_plan_exits_cleanly(gpu, tmp_path):
    """A script that keeps its plan in a global (as the guide's examples do) and runs a chunked plan under jax.jit
    exits with status 0. The chunk passes' kv_indptrs (FlashInfer's copies, owned by the pooled wrappers the workspace
    keeps) were marked used on XLA's stream with ``record_stream``; freed after JAX's exit handlers had torn down
    XLA's client, each aborted the process ("CUDA error: context is destroyed", exit status 134)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "exit_after_jit.py"
    script.write_text(_EXIT_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "adapters"), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert "ran" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-3000:])
