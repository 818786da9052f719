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

import pytest
import torch

import mla_bridge_transformers as mbt
from mla_bridge_transformers import attention as mbt_attention

from tests.helpers.indexer_calls import indexer_calls

from . import hf_deepseek as H

DSA_MODELS = ["deepseek_v32", "glm_moe_dsa"]  # MLA with an indexer, no sinks
TOPK = 4


@pytest.fixture
def no_hand_back(monkeypatch):
    """Fail if any call would be handed back to transformers (so the test measures mla_bridge)."""

    def refuse(reason, *args, **kwargs):
        raise AssertionError(f"handed back to transformers: {reason}")

    monkeypatch.setattr(mbt_attention, "_hand_back", refuse)


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


#: Every DSA model type of transformers 5.25 whose attention hands its indexer's top-k to the attention function as
#: ``indices=`` (glm5_next folds its pooled top-k into the mask itself: not among them).
DSA_MODEL_TYPES = ["deepseek_v32", "glm_moe_dsa", "hy_v4", "mistral_large4", "axk2", "dots3_note"]


@pytest.mark.parametrize("model_type", DSA_MODEL_TYPES)
def test_every_dsa_model_type_served_equal_eager(model_type, no_hand_back, two_torch_threads):
    """One MLA layer of each DSA model type at its own head dims (hy_v4 with its per-head sinks; dots3_note's indexed
    layer), index_topk 4, a left-padded batch of 12 and 7 tokens: every call is served by mla_bridge's sparse
    attention, and the output at every real position equals eager's (the top-k folded into its mask) within 1e-5,
    eager's top-k replayed into the mla_bridge run."""
    from . import hf_mla

    eager, eager_base = hf_mla.make_model(model_type, index_topk=TOPK)
    ours, ours_base = hf_mla.make_model(model_type, index_topk=TOPK, attn_implementation=mbt.register())
    vocab = eager.config.get_text_config().vocab_size
    ids, mask = left_padded([12, 7], vocab, seed=3)
    valid = mask.bool()

    def out(model, **kw):
        got = model(ids, attention_mask=mask, **kw)
        return got.logits if hasattr(got, "logits") else got.last_hidden_state

    with torch.no_grad(), indexer_calls(eager, layers=eager_base.layers) as record:
        want = out(eager)
    with torch.no_grad(), indexer_calls(ours, replay=record, layers=ours_base.layers):
        got = out(ours)
    assert record and all(not calls for calls in record.values())  # every recorded call was replayed
    with torch.no_grad():
        dense = out(hf_mla.make_model(model_type)[0])  # same weights, every key
    assert (want - dense)[valid].abs().max() > 0.1  # the top-k matters on these prompts
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)


def _reference(q, k, v, mask, indices, scale, sinks=None):
    """float64 ``[B, Q, H, D_v]``: each query attends the keys both in its top-k and seen by its mask (what eager
    attends with the top-k folded into the mask), plus a sink of logit ``sinks[h]`` and value 0 where given; rows
    without a key 0."""
    b, h, q_len, _ = q.shape
    out = torch.zeros(b, q_len, h, v.shape[-1], dtype=torch.float64)
    for r in range(b):
        for i in range(q_len):
            keys = sorted({int(j) for j in indices[r, i] if bool(mask[r, 0, i, int(j)])})
            if not keys:
                continue
            for hh in range(h):
                s = torch.stack([q[r, hh, i].double() @ k[r, hh, j].double() * scale for j in keys])
                if sinks is not None:
                    s = torch.cat([s, sinks[hh].double().view(1)])
                p = torch.softmax(s, 0)
                out[r, i, hh] = sum(p[n] * v[r, hh, j].double() for n, j in enumerate(keys))
    return out


def _mask(q_len, kv_len, pads, right=False):
    """transformers' boolean ``[B, 1, Q, K]`` mask: causal bottom-right over each row's keys, ``pads[r]`` padding
    positions on the left (or the right) of row r's keys and queries."""
    b = len(pads)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    keys = torch.ones(b, kv_len, dtype=torch.bool)
    for r, p in enumerate(pads):
        if p:
            keys[r, -p:] = False if right else keys[r, -p:]
            keys[r, :p] = keys[r, :p] if right else False
    return (causal[None] & keys[:, None, :])[:, None]


@pytest.mark.parametrize(
    "q_len,kv_len,pads,right,sinks",
    [
        (9, 9, [0, 3], False, False),  # a left-padded prompt
        (4, 12, [0, 7], False, False),  # a continuation over the cache, left padded
        (1, 12, [2, 0], False, True),  # a decode step, with sinks
        (9, 9, [0, 2], True, False),  # right padding (the dense path hands it back)
    ],
)
def test_served_indices_equal_float64(no_hand_back, q_len, kv_len, pads, right, sinks):
    """The attention function itself, fed transformers-made top-3 indices (torch.topk of scores with the masked keys
    -inf: early and padding queries list masked keys): equals a float64 attention over the listed keys the mask keeps
    at every real query, and the model file's eager function on the mask with the top-k folded in; padding queries
    get 0."""
    m = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    import types

    b, h = len(pads), 3
    module = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=1, training=False
    )
    g = torch.Generator().manual_seed(q_len + kv_len)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n, d in ((q_len, 24), (kv_len, 24), (kv_len, 16)))
    mask = _mask(q_len, kv_len, pads, right)
    scores = torch.randn(b, q_len, kv_len, generator=g).masked_fill(~mask[:, 0], float("-inf"))
    indices = scores.topk(3, dim=-1).indices.to(torch.int32)
    s_aux = (1.0 + torch.randn(h, generator=g)) if sinks else None
    out, _ = mbt.mla_bridge_attention(module, q, k, v, mask, scaling=0.3, indices=indices, s_aux=s_aux)
    want = _reference(q, k, v, mask, indices, 0.3, s_aux)
    real = mask[:, 0].any(-1)  # queries that see a key
    if q_len > 1:  # the indices list keys the mask drops (early and padding queries): they must not be attended
        assert not bool(mask[:, 0].gather(-1, indices.long()).all())
    torch.testing.assert_close(out[real].double(), want[real], atol=1e-5, rtol=0)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    keep = torch.zeros(b, q_len, kv_len, dtype=torch.bool).scatter(-1, indices.long(), True)[:, None]
    additive = torch.zeros(mask.shape).masked_fill(~(mask & keep), torch.finfo(torch.float32).min)
    module.sinks = s_aux  # hy_v4's eager function reads the module's sinks
    eager = m if s_aux is None else pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4")
    want_eager, _ = eager.eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    torch.testing.assert_close(out[real], want_eager[real], atol=1e-5, rtol=0)
    dense = _reference(q, k, v, mask, torch.arange(kv_len).expand(b, q_len, kv_len), 0.3, s_aux)
    assert (dense[real] - want[real]).abs().max() > 1e-2  # the top-k matters


def test_picks_out_of_range_are_refused_on_the_cpu():
    import types

    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace())
    q, k, v = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8)
    indices = torch.zeros(1, 4, 2, dtype=torch.int32)
    indices[0, 2, 1] = 6
    with pytest.raises(ValueError, match=r"indices\[0, 2, 1\] = 6 is not a key position"):
        mbt.mla_bridge_attention(module, q, k, v, None, indices=indices)


@pytest.mark.parametrize("kv_len,kv_heads", [(5, 2), (6, 2), (64, 2), (6, 1)])
def test_served_at_any_keys_per_pick(monkeypatch, kv_len, kv_heads):
    """A top-4 of 5, 6 or 64 keys (1.25 to 16 keys per pick) is served, not handed back; with fewer key/value heads
    than query heads (GQA) it is handed back with the top-k folded into the mask. A -1 pick is no key on both routes,
    and both equal eager on the mask with the top-k folded in."""
    import types

    m = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    handed = []
    real = mbt_attention._hand_back
    monkeypatch.setattr(mbt_attention, "_hand_back", lambda reason, *a: handed.append(reason) or real(reason, *a))
    module = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=2 // kv_heads, training=False
    )
    g = torch.Generator().manual_seed(kv_len)
    q = torch.randn(1, 2, 3, 24, generator=g)
    k, v = (torch.randn(1, kv_heads, kv_len, d, generator=g) for d in (24, 16))
    mask = torch.ones(3, kv_len, dtype=torch.bool).tril(kv_len - 3)[None, None]
    indices = torch.randn(1, 3, kv_len, generator=g).masked_fill(~mask[:, 0], float("-inf")).topk(4, dim=-1).indices
    indices[0, 2, 3] = -1  # no key (FlashMLA's padding), on either route
    out, _ = mbt.mla_bridge_attention(module, q, k, v, mask, scaling=0.3, indices=indices.to(torch.int32))
    keep = torch.zeros(1, 3, kv_len + 1, dtype=torch.bool).scatter(-1, indices % (kv_len + 1), True)[:, None, :, :-1]
    additive = torch.zeros(mask.shape).masked_fill(~(mask & keep), torch.finfo(torch.float32).min)
    want, _ = m.eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    assert (not handed) == (kv_heads == 2), handed


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indices_on_cuda_are_handed_back_folded(monkeypatch, dtype):
    """On CUDA DSA's indices go back to transformers' sdpa with the top-k folded into the mask (faster there than the
    sparse MHA torch pass): a left-padded batch at V3.2's head dims (16 heads, qk 192, v 128), 4096 keys, top-256
    made as transformers' indexer makes them; equals the float64 attention of the same (rounded) inputs within the
    output dtype's rounding at every real query."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    import types

    handed = []
    hand_back = mbt_attention._hand_back

    def record(reason, *a):
        handed.append(reason)
        return hand_back(reason, *a)

    monkeypatch.setattr(mbt_attention, "_hand_back", record)
    module = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=1, training=False
    )
    b, h, q_len, kv_len, kk = 2, 16, 64, 4096, 256
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for n, d in ((q_len, 192), (kv_len, 192), (kv_len, 128)))
    mask = _mask(q_len, kv_len, [0, 3000])
    indices = (
        torch.randn(b, q_len, kv_len, generator=g).masked_fill(~mask[:, 0], float("-inf")).topk(kk, dim=-1).indices
    )
    out, _ = mbt.mla_bridge_attention(
        module, q.cuda(), k.cuda(), v.cuda(), mask.cuda(), scaling=0.07, indices=indices.to(torch.int32).cuda()
    )
    assert handed == [mbt_attention.INDICES_ON_CUDA], handed
    seen = mask[:, 0].gather(-1, indices)
    picks = torch.where(seen, indices, -1)
    want = torch.zeros(b, q_len, h, 128, dtype=torch.float64)
    for r in range(b):  # float64 over the listed keys the mask keeps, per batch row
        qq, kk_, vv = q[r].double(), k[r].double(), v[r].double()
        s = torch.einsum("hqd,hqkd->hqk", qq, kk_[:, picks[r].clamp(min=0)]) * 0.07
        s = s.masked_fill(~(picks[r] >= 0)[None], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        want[r] = torch.einsum("hqk,hqkd->qhd", p, vv[:, picks[r].clamp(min=0)])
    real = mask[:, 0].any(-1)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.cpu()[real].double(), want[real], atol=tol, rtol=tol)
