"""What a chunked bf16 ``mla_prefill`` must equal: its own partials merged in float64 and rounded once (shared by
tests/test_chunk_precision.py and tests/gpu/test_gpu_chunk_precision.py)."""

from __future__ import annotations

import torch

from tests.helpers.merge_cases import ulp


def partials_merged_once(batch, plan, weight):
    """The plan's own partials -- its main pass and every chunk pass, on the separate k/v path, outs as the kernels
    write them (the plan's dtype), LSEs as mla_prefill's merges read them -- merged in float64 and rounded once to
    the plan's dtype; with the merged float64 LSE. What mla_prefill(..., weight, ..., kv_impl="separate") gives up
    to one rounding flip of the result, whatever the number of chunks (``weight``: a PreparedKVBProj)."""
    import math

    from mla_bridge import kv as KV

    k_pe = batch.k_pe.reshape(batch.kv_c.shape[0], -1)
    inputs = KV.KVInputs(weight, batch.kv_c, k_pe, batch.cache, batch.block_table, impl="separate")
    k, v = KV.new_tokens_kv(inputs)
    o, lse = plan.main.run(batch.q, k, v)
    parts = [(0, plan.num_tokens, o, lse)]
    for c in plan.chunks:
        if c.plan is not None:
            k, v = KV.chunk_kv(c, inputs)
            o, lse2 = c.plan.run(batch.q[c.q_start : c.q_end], k, v, lse_base="log2")
            parts.append((c.q_start, c.q_end, o, lse2 * math.log(2.0)))  # the float32 multiply of the merges
    total = parts[0][3].double().cpu().clone()
    for a, b, _, lse in parts[1:]:
        total[a:b] = torch.logaddexp(total[a:b], lse.double().cpu())
    acc = torch.zeros(parts[0][2].shape, dtype=torch.float64)
    for a, b, o, lse in parts:
        acc[a:b] += o.double().cpu() * torch.exp(lse.double().cpu() - total[a:b]).unsqueeze(-1)
    return acc.to(plan.dtype), total


def assert_rounded_once(out, want):
    """Within one unit in the last place of ``want``'s dtype (the float32 running out may round the other way near
    a rounding boundary), plus 1e-5 x max |want| for the float32 running arithmetic itself (where a row's partials
    nearly cancel, its small result has a small ulp). One bf16 rounding per merge costs up to 2**-9 x |out| each."""
    diff = (out.double().cpu() - want.double()).abs()
    excess = diff - ulp(want, want.dtype) - 1e-5 * float(want.double().abs().max())
    assert excess.max() <= 0, (float(diff.max()), int((excess > 0).sum()))
