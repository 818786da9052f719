"""Parity: the vLLM adapter's outputs equal the core's ``ragged_prefill`` bitwise on the same q/k/v (same backend).

Two sources of inputs:

* the shared seeded cases of ``tests/parity/inputs.py`` (the same ones the JAX adapter's parity test uses), handed to
  the adapter through vLLM's own metadata classes (``MLACommonPrefillMetadata`` and its ``ContextChunk``): causal
  cases through the new-token pass, non-causal ones as a context chunk;
* the q/k/v that vLLM's real prefill path (``MLAAttention.forward_impl``, see ``tests/vllm/vllm_harness.py``) hands
  the adapter, captured call by call.

Needs vLLM (``bash scripts/test_vllm.sh``); skipped where it is not installed.
"""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.v1.attention.backends.mla.prefill.base", reason="needs the vllm package")

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata  # noqa: E402

from mla_bridge import ragged_prefill  # noqa: E402
from mla_bridge_vllm.backend import MLABridgePrefillBackend  # noqa: E402

import vllm_harness as H  # noqa: E402  (tests/vllm, on pytest's pythonpath)

from . import inputs  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _make(cls, **values):
    """A vLLM dataclass from the fields this vLLM version has (ContextChunk gained fields across releases)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def _metadata(q_lens, kv_lens, dtype, as_chunk):
    qo = torch.tensor(inputs.cumsum0(q_lens), dtype=torch.int32)
    kv = torch.tensor(inputs.cumsum0(kv_lens), dtype=torch.int32)
    n = len(q_lens)
    chunked = None
    if as_chunk:
        chunk = _make(
            MLACommonPrefillMetadata.ContextChunk,
            index=0,
            request_slice=slice(0, n),
            token_slice=slice(0, int(qo[-1])),
            continuation_token_end=int(qo[1]),
            is_continuation=False,
            num_context_tokens=int(kv[-1]),
            query_start_loc=qo,
            max_query_len=max(q_lens),
            cu_seq_lens=kv,
            starts=torch.zeros(n, dtype=torch.int32),
            max_seq_len=max(kv_lens),
            seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
            token_to_seq=torch.repeat_interleave(torch.arange(n, dtype=torch.int32), torch.tensor(kv_lens)),
            all_rows_active=all(q_lens) and all(kv_lens),
        )
        chunked = _make(
            MLACommonPrefillMetadata.ChunkedContextMetadata,
            context_lens=kv[1:] - kv[:-1],
            workspace=torch.empty(0),
            chunks=[chunk],
            context_lens_list=list(kv_lens),
            empty_token_slices=[],
        )
    md = _make(
        MLACommonPrefillMetadata,
        block_table=torch.zeros(n, 1, dtype=torch.int32),
        query_start_loc=qo,
        max_query_len=max(q_lens),
        chunked_context=chunked,
        q_data_type=dtype,
        output_dtype=dtype,
        query_lens_cpu=qo[1:] - qo[:-1],
    )
    return md, (chunked.chunks[0] if as_chunk else None)


def _adapter(heads, sm_scale):
    return MLABridgePrefillBackend(
        num_heads=heads,
        scale=sm_scale,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vllm_config=None,
    )


# vLLM's new-token pass is causal with kv == q; causal cases with other key lengths never reach the adapter.
VLLM_CASES = [c for c in inputs.RAGGED_CASES if not c.causal or c.q_lens == c.kv_lens]


@pytest.mark.parametrize("dtype_name", inputs.DTYPES)
@pytest.mark.parametrize("case", VLLM_CASES, ids=str)
def test_shared_ragged_cases_bitwise(case, dtype_name):
    dtype = DTYPES[dtype_name]
    x = {
        k: (torch.from_numpy(v).to(dtype) if isinstance(v, np.ndarray) else v)
        for k, v in inputs.ragged_inputs(case).items()
    }
    backend = _adapter(case.heads, case.sm_scale)
    md, chunk = _metadata(case.q_lens, case.kv_lens, dtype, as_chunk=not case.causal)
    backend.prepare_metadata(md)
    if case.causal:
        out, lse = backend.run_prefill_new_tokens(x["q"], x["k"], x["v"], return_softmax_lse=True)
    else:
        out, lse = backend.run_prefill_context_chunk(chunk, x["q"], x["k"], x["v"])
    ref_out, ref_lse = ragged_prefill(
        x["q"], x["k"], x["v"], case.qo_indptr, case.kv_indptr, causal=case.causal, sm_scale=case.sm_scale
    )
    assert backend._plans.main.backend.name == "torch"
    assert torch.equal(out, ref_out)
    assert lse.shape == (case.heads, sum(case.q_lens))
    assert torch.equal(lse, ref_lse.t())


@pytest.mark.skipif(not H.HAS_CPU_MLA_PREFILL, reason="this vLLM has no CPU MLA prefill path to drive")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_vllm_forward_calls_bitwise(dtype):
    """Every call vLLM's forward path makes on the adapter equals ragged_prefill on those very q/k/v."""
    batch = H.make_batch(dtype, seed=3)
    step = H.build_step(H.make_layer(dtype, batch.w), batch)
    calls = []
    run_new, run_chunk = step.backend.run_prefill_new_tokens, step.backend.run_prefill_context_chunk

    def new(q, k, v, return_softmax_lse, out=None, output_scale=None):
        res = run_new(q, k, v, return_softmax_lse, out, output_scale)
        calls.append((None, q.clone(), k.clone(), v.clone(), res))
        return res

    def chunk_fn(chunk, q, k, v, out=None):
        res = run_chunk(chunk, q, k, v, out)
        calls.append((chunk, q.clone(), k.clone(), v.clone(), res))
        return res

    step.backend.run_prefill_new_tokens, step.backend.run_prefill_context_chunk = new, chunk_fn
    H.forward(step, batch)
    assert len(calls) == 4
    qo_all = inputs.cumsum0(batch.query_lens)
    for chunk, q, k, v, (out, lse) in calls:
        if chunk is None:
            qo, kv, causal = qo_all, qo_all, True
        else:
            qo, kv, causal = chunk.query_start_loc.tolist(), chunk.cu_seq_lens.tolist(), False
        ref_out, ref_lse = ragged_prefill(q, k, v, qo, kv, causal=causal, sm_scale=H.SCALE)
        assert torch.equal(out, ref_out)
        assert torch.equal(lse, ref_lse.t())
