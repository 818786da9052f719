"""MLA ragged prefill from JAX: eager and under jax.jit.

Runs anywhere JAX and torch run: on a CUDA GPU with FlashInfer the kernels are FlashInfer's (fa3 on H100/H200,
cutlass on B200, fa2 elsewhere), on a CPU the core's torch backend. Install: pip install -e '.[jax]' (torch first).

    python examples/jax_prefill.py
"""

import argparse

import numpy as np

import jax
import jax.numpy as jnp

import mla_bridge_jax as mj
from mla_bridge import MLADims

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

dims = MLADims.deepseek_v2_lite()  # 16 heads, q/k 192 (128 nope + 64 rope), v 128, YaRN softmax scale
H = dims.num_heads

# A packed batch of three prompts: 5, 1 and 7 new tokens. Index pointers are host values (lists or numpy):
# they describe the batch, and the plan is made from them on the host.
query_lens = [5, 1, 7]
qo_indptr = np.concatenate([[0], np.cumsum(query_lens)]).tolist()  # [0, 5, 6, 13]
T = qo_indptr[-1]

key_q, key_k, key_v = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(key_q, (T, H, dims.head_dim_qk), jnp.bfloat16)
k = jax.random.normal(key_k, (T, H, dims.head_dim_qk), jnp.bfloat16)
v = jax.random.normal(key_v, (T, H, dims.head_dim_vo), jnp.bfloat16)

# 1. Eager: the arrays reach the kernel through DLPack (no copy) and come back as jax.Arrays.
#    Causal self-attention of the new tokens: keys == queries, so kv_indptr == qo_indptr.
out, lse = mj.ragged_prefill(q, k, v, qo_indptr, qo_indptr, causal=True, sm_scale=dims.softmax_scale)
print("eager:", out.shape, out.dtype, "lse", lse.shape, lse.dtype)  # (13, 16, 128) bfloat16, (13, 16) float32


# 2. Under jax.jit: close over the host index pointers. The plan is made once, when the function is traced; every
#    call of the compiled function reuses it (new lengths -> a new trace and plan).
@jax.jit
def attention_layer(q, k, v):
    out, _ = mj.ragged_prefill(q, k, v, qo_indptr, qo_indptr, causal=True, sm_scale=dims.softmax_scale)
    return out.reshape(T, H * dims.head_dim_vo)  # what the output projection consumes


y = attention_layer(q, k, v)
print("jit:", y.shape, "same as eager:", bool(jnp.array_equal(y, out.reshape(T, -1))))

# 3. Plan once per batch, run per layer: the plan lives outside jit and is closed over.
plan = mj.plan_ragged(
    qo_indptr,
    qo_indptr,
    num_heads=H,
    head_dim_qk=dims.head_dim_qk,
    head_dim_vo=dims.head_dim_vo,
    causal=True,
    sm_scale=dims.softmax_scale,
    dtype=jnp.bfloat16,
)
layer = jax.jit(lambda q, k, v: mj.run_ragged(plan, q, k, v)[0])
for _ in range(3):  # e.g. three layers
    out_layer = layer(q, k, v)


# 4. Check against plain float32 causal attention in jnp, one request at a time.
def dense_causal(qr, kr, vr):
    s = jnp.einsum("qhd,khd->hqk", qr.astype(jnp.float32), kr.astype(jnp.float32)) * dims.softmax_scale
    s = jnp.where(jnp.tril(jnp.ones(s.shape[1:], bool)), s, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), vr.astype(jnp.float32))


ref_out = jnp.concatenate([dense_causal(q[a:b], k[a:b], v[a:b]) for a, b in zip(qo_indptr[:-1], qo_indptr[1:])])
print("max |out - reference|:", float(jnp.max(jnp.abs(out_layer.astype(jnp.float32) - ref_out))))
