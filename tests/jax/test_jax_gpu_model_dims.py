"""The JAX adapter on a CUDA GPU at the MLA dims of the models people serve: ``run_ragged`` / ``ragged_prefill``
under ``jax.jit`` on both traced routes (``buffer_callback``, ``tvm_ffi`` where it serves the plan) and
``mla_prefill`` under ``jax.jit`` (fused and chunked), bit for bit equal to the torch core on the same device buffers,
and ``mla_prefill`` within the CLI's bf16 tolerance of a float64 attention. FlashInfer serves where the dispatch
table has a row for the head dims (fa3 for 192/128, 256/256, 128/128 on SM90; fa2 for 256/128), the torch backend
otherwise (MiniCPM3's 96/64).

Run on the H200: python3 -m pytest tests/jax/test_jax_gpu_model_dims.py -q -m gpu
Self-contained: no helper module of the suite is imported.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import mla_bridge  # noqa: E402
from mla_bridge import MLADims, Workspace, select_backend  # noqa: E402
from mla_bridge.cli.prefill import TOLERANCE  # noqa: E402

import mla_bridge_jax as mj  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: (num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
MODEL_DIMS = {
    "kimi_k2": (64, 512, 128, 64, 128),
    "glm4_moe_lite": (20, 512, 192, 64, 256),
    "glm_moe_dsa": (64, 512, 192, 64, 256),
    "glm5_next": (64, 512, 256, 0, 256),
    "mistral4": (32, 256, 64, 64, 128),
    "minicpm3": (40, 256, 64, 32, 64),
    "dots3_note-swa": (64, 1024, 192, 64, 128),
}
Q_LENS, C_LENS, BLOCK = [37, 5, 64, 1], [100, 0, 33, 250], 16


def dims_of(name: str) -> MLADims:
    h, r, n, p, v = MODEL_DIMS[name]
    return MLADims(num_heads=h, kv_lora_rank=r, qk_nope_head_dim=n, qk_rope_head_dim=p, v_head_dim=v)


@pytest.fixture(scope="module")
def gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


def _torch_device(gpu) -> torch.device:
    return torch.device("cuda", gpu.local_hardware_id if gpu.local_hardware_id is not None else gpu.id)


def _equal(jx, tx) -> bool:
    return torch.equal(torch.from_dlpack(jx), tx)


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32).tolist()


@pytest.mark.parametrize("route", ["buffer_callback", "tvm_ffi"])
@pytest.mark.parametrize("name", MODEL_DIMS)
def test_ragged_jit_at_model_dims_bitwise_equal_to_core(gpu, name, route):
    dims = dims_of(name)
    h, dqk, dvo = dims.num_heads, dims.head_dim_qk, dims.head_dim_vo
    q_lens, kv_lens = [300, 1, 0, 129, 33], [500, 1, 5, 129, 33]
    qo, kv = _indptr(q_lens), _indptr(kv_lens)
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (
        jax.device_put(jax.random.normal(key, shape, jnp.bfloat16), gpu)
        for key, shape in zip(keys, ((qo[-1], h, dqk), (kv[-1], h, dqk), (kv[-1], h, dvo)))
    )
    sm = dims.softmax_scale
    plan = mj.plan_ragged(
        qo, kv, num_heads=h, head_dim_qk=dqk, head_dim_vo=dvo, causal=True, sm_scale=sm, dtype=jnp.bfloat16, device=gpu
    )
    want = select_backend(_torch_device(gpu), dtype=torch.bfloat16, head_dim_qk=dqk, head_dim_vo=dvo).name
    assert plan.backend.name == want
    if route == "tvm_ffi":
        from mla_bridge_jax import tvm_ffi

        reason = tvm_ffi.why_not(plan)
        if reason is not None:
            pytest.skip(f"tvm_ffi route unavailable: {reason}")
    core_out, core_lse = plan.run(*(torch.from_dlpack(x) for x in (q, k, v)))
    assert core_out.shape == (qo[-1], h, dvo)
    f = jax.jit(lambda a, b, c: mj.run_ragged(plan, a, b, c, jit_route=route))
    g = jax.jit(lambda a, b, c: mj.ragged_prefill(a, b, c, qo, kv, causal=True, sm_scale=sm, jit_route=route))
    for fn in (f, g):
        out, lse = fn(q, k, v)
        assert out.shape == (qo[-1], h, dvo) and _equal(out, core_out) and _equal(lse, core_lse), plan


def _mla_args(gpu, dims: MLADims, seed: int):
    """bf16 device inputs of mla_prefill at ``dims`` (k_pe ``[T, 0]`` without a RoPE part), blocks shuffled."""
    rng = np.random.default_rng(seed)
    t = sum(Q_LENS)
    nb = sum(-(-c // BLOCK) for c in C_LENS) + 1
    host = [
        rng.standard_normal(s).astype(np.float32)
        for s in (
            (t, dims.num_heads, dims.head_dim_qk),
            (t, dims.kv_lora_rank),
            (t, dims.qk_rope_head_dim),
            dims.kv_b_proj_shape,
            (nb, BLOCK, dims.latent_dim),
        )
    ]
    host[3] *= dims.kv_lora_rank**-0.5
    table = np.full((len(Q_LENS), max(-(-c // BLOCK) for c in C_LENS) + 1), -1, np.int32)
    perm, i = rng.permutation(nb), 0
    for r, c in enumerate(C_LENS):
        for b in range(-(-c // BLOCK)):
            table[r, b] = perm[i]
            i += 1
    return [jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu) for x in host] + [jax.device_put(table, gpu)]


def _reference64(dims: MLADims, args) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 MLA prefill (torch, on the device) of mla_prefill's inputs: each request's context from the paged
    cache, then its new tokens, up-projected; bottom-right causal. ``(out [T, H, v], lse [T, H])``."""
    q, kv_c, k_pe, w, cache, table = (torch.from_dlpack(a) for a in args)
    q, kv_c, k_pe, w, cache = (x.double() for x in (q, kv_c, k_pe, w, cache))
    rank, nope, h, vd = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.num_heads, dims.v_head_dim
    outs, lses, start = [], [], 0
    for r, (n, c) in enumerate(zip(Q_LENS, C_LENS)):
        pos = torch.arange(c, device=q.device)
        ctx = cache[table[r, pos // BLOCK].long(), pos % BLOCK]
        seq = torch.cat([ctx, torch.cat([kv_c[start : start + n], k_pe[start : start + n]], -1)])
        up = (seq[:, :rank] @ w.t()).view(-1, h, nope + vd)
        k = torch.cat([up[..., :nope], seq[:, None, rank:].expand(-1, h, dims.qk_rope_head_dim)], -1)
        s = torch.einsum("thd,shd->hts", q[start : start + n], k) * dims.softmax_scale
        visible = torch.ones(n, c + n, dtype=torch.bool, device=q.device).tril(c)
        s = s.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hts,shd->thd", torch.exp(s - lse[..., None]), up[..., nope:]))
        lses.append(lse.t())
        start += n
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("name", MODEL_DIMS)
def test_mla_prefill_jit_at_model_dims(gpu, name):
    dims = dims_of(name)
    args = _mla_args(gpu, dims, seed=5)
    dev = _torch_device(gpu)
    ref_out, ref_lse = _reference64(dims, args)
    (oa, orel), (la, lrel) = TOLERANCE["bfloat16"]
    for chunk in (100_000, 64):  # fused, then chunked (several chunks + merges)
        plan = mj.build_plan(
            Q_LENS,
            C_LENS,
            dims=dims,
            block_size=BLOCK,
            dtype=jnp.bfloat16,
            workspace=Workspace(dev, chunk_tokens=chunk),
        )
        assert chunk != 64 or len(plan.chunks) >= 3, plan
        core_out, core_lse = mla_bridge.mla_prefill(*(torch.from_dlpack(a) for a in args), plan, return_lse=True)
        out, lse = jax.jit(lambda *a: mj.mla_prefill(*a, plan, return_lse=True))(*args)
        assert out.shape == (sum(Q_LENS), dims.num_heads, dims.v_head_dim)
        assert _equal(out, core_out) and _equal(lse, core_lse), (chunk, plan)
        out64, lse64 = torch.from_dlpack(out).double(), torch.from_dlpack(lse).double()
        ex_out = ((out64 - ref_out).abs() - (oa + orel * ref_out.abs())).max().item()
        ex_lse = ((lse64 - ref_lse).abs() - (la + lrel * ref_lse.abs())).max().item()
        print(f"{name} chunk_tokens={chunk}: {plan.backend.name}, excess out {ex_out:.3g} lse {ex_lse:.3g}")
        assert ex_out <= 0 and ex_lse <= 0, (name, chunk, plan, ex_out, ex_lse)
