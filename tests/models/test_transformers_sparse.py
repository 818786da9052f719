"""DSA models' ``indices=`` served by mla_bridge's transformers attention function (adapters/mla_bridge_transformers).

For implementations other than eager / sdpa, transformers' DSA attention (``DeepseekV32Attention``, GLM-5's
``GlmMoeDsaAttention``) passes its indexer's top-k as ``indices=`` (int32 ``[B, Q, k]``) and leaves them out of the
mask. mla_bridge serves them with its sparse attention in the MHA form (:mod:`mla_bridge.sparse_mha`): each query
attends the keys its top-k lists that its mask lets it see. Small random models with ``index_topk`` 4 and prompts of
up to 16 tokens (so the selection matters), a left-padded batch, in float32 on the CPU: the logits equal eager's
(which folds the top-k into its mask) within 1e-5 at every real prompt position and every greedy step, nothing handed
back. The indices each model's indexer produced in the eager run are captured and replayed into the mla_bridge run,
so that top-k ties (scores equal to rounding, as the attention's rounding differs) cannot make the test flaky.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mla_bridge_transformers as mbt
from mla_bridge_transformers import attention as mbt_attention

from . import hf_deepseek as H

DSA_MODELS = ["deepseek_v32", "glm_moe_dsa"]  # MLA with an indexer, no sinks
TOPK = 4


@pytest.fixture
def no_hand_back(monkeypatch):
    """Fail if any call would be handed back to transformers (so the test measures mla_bridge, not eager / sdpa)."""

    def refuse(reason, *args, **kwargs):
        raise AssertionError(f"handed back to transformers: {reason}")

    monkeypatch.setattr(mbt_attention, "_hand_back", refuse)


@contextlib.contextmanager
def indexer_calls(model, replay=None):
    """Record the top-k every indexer of ``model`` returns (``{layer: [int32 [B, S, k], ...]}``, in call order), or,
    with ``replay`` (such a record), run each indexer (its key cache updated as usual) and return the recorded top-k
    of that layer's next call instead, after checking its shape."""
    record: dict = {}
    patched = []
    for layer in model.model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is None:  # GLM-5's "shared" layers reuse the previous layer's top-k
            continue
        idx, real = layer.self_attn.layer_idx, indexer.forward

        def forward(*args, _idx=idx, _real=real, **kwargs):
            got = _real(*args, **kwargs)
            if replay is None:
                record.setdefault(_idx, []).append(got.clone())
                return got
            want = replay[_idx].pop(0)
            assert want.shape == got.shape, (want.shape, got.shape)
            return want

        indexer.forward = forward
        patched.append(indexer)
    assert patched
    try:
        yield record
    finally:
        for indexer in patched:
            del indexer.forward


def dsa_pair(model_type, index_topk=TOPK, **kw):
    name = mbt.register()
    return (
        H.dsa_model(model_type, index_topk=index_topk, **kw),
        H.dsa_model(model_type, index_topk=index_topk, attn_implementation=name, **kw),
    )


def left_padded(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lens):
        ids[r, -n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, -n:] = 1
    return ids, mask


def generate(model, ids, mask, steps):
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


@pytest.mark.parametrize("model_type", DSA_MODELS)
def test_sparse_prompt_and_greedy_steps_served_equal_eager(model_type, no_hand_back, two_torch_threads):
    """A left-padded batch of 16 and 11 tokens, index_topk 4: every call is served (sparse attention over the indexer's
    top-k, its masked picks dropped), and the logits equal eager's at every real position and greedy step. Before,
    these calls were handed back to sdpa (the top-k folded into the mask)."""
    eager, ours = dsa_pair(model_type)
    ids, mask = left_padded([16, 11], eager.config.vocab_size, seed=9)
    valid = mask.bool()
    with torch.no_grad(), indexer_calls(eager) as record:
        want = eager(ids, attention_mask=mask).logits
        g_want = generate(eager, ids, mask, steps=4)
    with torch.no_grad(), indexer_calls(ours, replay=record):
        got = ours(ids, attention_mask=mask).logits
        g_got = generate(ours, ids, mask, steps=4)
    assert all(not calls for calls in record.values())  # every recorded call was replayed
    with torch.no_grad():
        dense = H.dsa_model(model_type, index_topk=64)(ids, attention_mask=mask).logits  # same weights, every key
    assert (want - dense)[valid].abs().max() > 0.1  # the top-k matters on these prompts
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    assert torch.equal(g_got.sequences, g_want.sequences)
    for step, (a, b) in enumerate(zip(g_got.logits, g_want.logits)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"greedy step {step}: {m}")
