"""mla_bridge registered as a transformers attention function (adapters/mla_bridge_transformers).

A small random DeepSeek-V2 model (V2-Lite attention dims, 2 layers, dense MLPs), loaded twice from one checkpoint
written by transformers: ``attn_implementation="eager"`` (the reference) and ``"mla_bridge"``. On the CPU in float32 the
logits agree within 1e-4 at every prompt position and at every one of 20 greedy steps (transformers' generate, its
own DynamicCache: each step is a continuation with fewer queries than keys), and the generated tokens are identical;
likewise for a left-padded batch. Cases mla_bridge cannot serve are handed back to transformers (tested directly).
The keywords models pass: small random DSA models (deepseek_v32, glm_moe_dsa; hy_v4 with attention sinks) against
eager, and each keyword's routing tested directly against the model file's own eager function.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

import mla_bridge_transformers as mbt
from mla_bridge_transformers import attention as mbt_attention

from . import hf_deepseek as H

STEPS = 20


@pytest.fixture(scope="module")
def v2_folder(tmp_path_factory):
    return H.write_checkpoint("v2-lite", tmp_path_factory.mktemp("v2-2layers"), seed=3, num_layers=2)


@pytest.fixture(scope="module")
def pair(v2_folder):
    name = mbt.register()
    return H.load(v2_folder, "eager"), H.load(v2_folder, name)


@pytest.fixture
def no_hand_back(monkeypatch):
    """Fail if any call would be handed back to transformers (so the test measures mla_bridge, not sdpa)."""

    def refuse(reason, *args, **kwargs):
        raise AssertionError(f"handed back to transformers: {reason}")

    monkeypatch.setattr(mbt_attention, "_hand_back", refuse)


def _generate(model, input_ids, attention_mask=None, steps=STEPS, **kwargs):
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kwargs,
        )


def test_registered_name_is_the_model_attention(pair):
    eager, ours = pair
    assert ours.config._attn_implementation == "mla_bridge"
    from transformers import AttentionInterface

    assert AttentionInterface()["mla_bridge"] is mbt.mla_bridge_attention


def test_prompt_logits_and_greedy_steps_equal_eager(pair, no_hand_back, two_torch_threads):
    eager, ours = pair
    prompt = torch.randint(3, eager.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = eager(prompt).logits, ours(prompt).logits
    assert want.std() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # every prompt position
    g_want, g_got = _generate(eager, prompt), _generate(ours, prompt)
    assert g_got.sequences.shape[1] == prompt.shape[1] + STEPS
    assert torch.equal(g_got.sequences, g_want.sequences)
    assert len(set(g_want.sequences[0, prompt.shape[1] :].tolist())) > 1  # not one token repeated
    for step, (a, b) in enumerate(zip(g_got.logits, g_want.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"greedy step {step}: {m}")
    with torch.no_grad():  # the whole generated sequence in one forward: every position again
        torch.testing.assert_close(ours(g_got.sequences).logits, eager(g_want.sequences).logits, atol=1e-4, rtol=0)


def test_left_padded_batch_equals_eager(pair, no_hand_back, two_torch_threads):
    eager, ours = pair
    g = torch.Generator().manual_seed(1)
    lens = [9, 4, 7]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lens):  # left padding, as generate wants for decoder-only models
        ids[r, -n:] = torch.randint(3, eager.config.vocab_size, (n,), generator=g)
        mask[r, -n:] = 1
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=0)
    g_want, g_got = _generate(eager, ids, mask), _generate(ours, ids, mask)
    assert torch.equal(g_got.sequences, g_want.sequences)
    for step, (a, b) in enumerate(zip(g_got.logits, g_want.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"greedy step {step}: {m}")


def test_right_padded_batch_equals_eager_at_every_position(pair, caplog, two_torch_threads):
    """A right-padded row's padding queries see its real keys (eager gives them defined values): not the served mask
    structure, so the call goes to sdpa, and every position equals eager (mla_bridge gave 0 at padding rows)."""
    eager, ours = pair
    ids = torch.randint(3, eager.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mbt_attention._warned.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mla_bridge_transformers"):
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert "right or inner padding" in caplog.text


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_generate_equals_eager(pair, no_hand_back, two_torch_threads, padded):
    """A static cache hands every layer all max_cache_len key slots, the unwritten ones masked (decode steps: the query
    is not the last slot) or, with no mask, excluded by sdpa's top-left causal (the prefill): mla_bridge gave zero
    attention on decode steps and read unwritten slots in the prefill."""
    eager, ours = pair
    g = torch.Generator().manual_seed(6)
    lens = [8, 5] if padded else [8]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lens):
        ids[r, -n:] = torch.randint(3, eager.config.vocab_size, (n,), generator=g)
        mask[r, -n:] = 1
    kw = dict(steps=6, cache_implementation="static")
    g_want, g_got = _generate(eager, ids, mask, **kw), _generate(ours, ids, mask, **kw)
    assert torch.equal(g_got.sequences, g_want.sequences)
    for step, (a, b) in enumerate(zip(g_got.logits, g_want.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"static cache, step {step}: {m}")


def test_output_attentions_without_a_mask_is_causal(pair, two_torch_threads):
    """transformers' sdpa mask is None for a plain causal batch; handed to eager, None must become the causal mask
    (eager attended to every key: logits 0.49 off, attention mass above the diagonal)."""
    eager, ours = pair
    ids = torch.randint(3, eager.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = eager(ids, output_attentions=True)
        got = ours(ids, output_attentions=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)
    for a, b in zip(got.attentions, want.attentions):
        assert float(a.triu(1).abs().max()) == 0.0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_left_padded_batch_under_inference_mode_equals_eager(pair, no_hand_back, two_torch_threads):
    """Under ``torch.inference_mode()`` (the mode serving code runs in) a padded batch's mask is an inference tensor,
    which has no version counter: reading it raised "Inference tensors do not track version counter"."""
    eager, ours = pair
    ids = torch.randint(3, eager.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.inference_mode():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        g_want, g_got = _generate(eager, ids, mask), _generate(ours, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=0)
    assert torch.equal(g_got.sequences, g_want.sequences)


@pytest.mark.parametrize("first_mla_layer", [0, 4])
@pytest.mark.parametrize("inference", [False, True])
def test_a_mask_changed_in_place_is_read_again_by_the_first_layer(
    inference, first_mla_layer, no_hand_back, two_torch_threads
):
    """The layout of a mask is kept for the layers of one forward (the same mask object); the first MLA layer of a
    forward reads it again. Before, a mask object changed in place where torch keeps no count of it (through
    ``.data``, or any change of an inference tensor) kept its old layout: a wrong result; and only a layer of
    ``layer_idx`` 0 read it again, which a hybrid model's first MLA layer need not be (Kimi-Linear's are 4, 8, ...)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    module = types.SimpleNamespace(
        is_causal=True,
        config=types.SimpleNamespace(),
        num_key_value_groups=1,
        training=False,
        layer_idx=first_mla_layer,
    )
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(2, 2, 5, 24, generator=g), torch.randn(2, 2, 5, 24, generator=g)
    v = torch.randn(2, 2, 5, 16, generator=g)
    paddings = [torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])]
    with torch.inference_mode(inference):
        mask = _sdpa_mask(paddings[0].bool(), 5, 5).clone()
        for padding in paddings:
            mask.data.copy_(_sdpa_mask(padding.bool(), 5, 5))  # in place, with no count kept
            add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
            out, _ = mbt.mla_bridge_attention(module, q, k, v, mask, scaling=0.3)
            want, _ = m.eager_attention_forward(module, q, k, v, add, scaling=0.3)
            real = padding.bool()  # [B, Q]: left padding, the real queries are the real tokens
            torch.testing.assert_close(out[real], want[real], atol=1e-5, rtol=0)


def test_one_plan_and_one_mask_check_per_forward(pair, no_hand_back, monkeypatch, two_torch_threads):
    """Every layer of one forward shares one plan (made once, a miss of the plan cache the adapters share, then found
    there by each other layer) and one mask check; a forward of equal lengths finds the plan again (no new one)."""
    from mla_bridge.plan_cache import shared_plan_cache

    eager, ours = pair
    counts = {"mask": 0}
    real_mask = mbt_attention._check_mask

    def mask(*a, **k):
        counts["mask"] += 1
        return real_mask(*a, **k)

    monkeypatch.setattr(mbt_attention, "_check_mask", mask)
    cache = shared_plan_cache()
    cache.clear()
    misses, hits = cache.misses, cache.hits
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    pad = torch.ones_like(ids)
    pad[0, :2] = 0
    with torch.no_grad():
        ours(ids, attention_mask=pad)
    layers = ours.config.num_hidden_layers
    assert layers == 2 and counts == {"mask": 1}
    assert (cache.misses - misses, cache.hits - hits) == (1, layers - 1)
    with torch.no_grad():
        ours(ids)  # no padding: transformers passes no mask, nothing to check; another layout, another plan
    assert counts == {"mask": 1} and (cache.misses - misses, cache.hits - hits) == (2, 2 * (layers - 1))
    with torch.no_grad():
        ours(ids)  # the same layout again: the kept plan, for every layer
    assert (cache.misses - misses, cache.hits - hits) == (2, 3 * layers - 2)


def _probe_runs(monkeypatch):
    """Record, per served call, the q/k/v transformers handed to attention and every RaggedPlan.run (q, k, v, keywords)
    made for it: (calls, runs), runs[i] belonging to calls[i]."""
    import mla_bridge
    from transformers import AttentionInterface

    calls, runs = [], []
    real_run = mla_bridge.RaggedPlan.run

    def run(self, q, k, v, **kw):
        runs[-1].append((q, k, v, kw))
        return real_run(self, q, k, v, **kw)

    def probe(module, query, key, value, *args, **kwargs):
        calls.append((query, key, value))
        runs.append([])
        return mbt.mla_bridge_attention(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(mla_bridge.RaggedPlan, "run", run)
    monkeypatch.setitem(AttentionInterface._global_mapping, mbt.ATTN_IMPLEMENTATION, probe)
    return calls, runs


@pytest.mark.parametrize("case", ["prompt", "continuation"])
def test_unpadded_batches_read_q_k_v_in_place(pair, no_hand_back, monkeypatch, two_torch_threads, case):
    """An unpadded batch (no mask; or a continuation over transformers' DynamicCache, whose mask has no padding) runs
    one kernel call per batch row on views of the q, k and v transformers made (the same storage, strides a FlashInfer
    kernel reads in place, so neither the adapter nor RaggedPlan.run copies them), with no LSE asked for. The logits
    are bitwise those of the rows packed into one call (the layout before: q and k copied), and eager's within 1e-4.
    Before, every run's q and k were copies (another storage)."""
    from transformers import DynamicCache

    from mla_bridge.checks import kernel_ready

    eager, ours = pair
    calls, runs = _probe_runs(monkeypatch)
    batch, prefix, new = 3, 20, 18
    ids = torch.randint(3, eager.config.vocab_size, (batch, prefix + new), generator=torch.Generator().manual_seed(8))

    def forward(model):
        with torch.no_grad():
            if case == "prompt":
                return model(ids[:, :new]).logits
            cache = DynamicCache(config=model.config)
            model(ids[:, :prefix], past_key_values=cache)
            return model(ids[:, prefix:], past_key_values=cache).logits

    got = forward(ours)
    layers = ours.config.num_hidden_layers
    served = calls[-layers:], runs[-layers:]  # the last forward's layers
    assert len(served[0]) == layers
    for (query, key, value), made in zip(*served):
        assert (
            query.shape[0] == batch
            and query.shape[2] == new
            and key.shape[2] == (prefix if case != "prompt" else 0) + new
        )
        assert len(made) == batch  # one call per batch row
        for r, (q, k, v, kw) in enumerate(made):
            assert kw.get("return_lse") is False and kw.get("lse") is None
            for x, src in ((q, query), (k, key), (v, value)):
                assert x.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()  # a view, not a copy
                assert kernel_ready(x)  # FlashInfer reads it through its strides: RaggedPlan.run copies nothing
            assert torch.equal(q, query[r].transpose(0, 1)) and torch.equal(v, value[r].transpose(0, 1))
    monkeypatch.setattr(mbt_attention, "_ROW_CALL_MIN_QUERIES", 10**9)  # the rows packed into one call instead
    calls.clear(), runs.clear()
    packed = forward(ours)
    assert all(len(made) == 1 and made[0][0].shape[0] == batch * new for made in runs[-layers:])
    assert torch.equal(got, packed)
    want = forward(eager)
    assert want.std() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_sinks_on_rows_read_in_place(no_hand_back, monkeypatch, two_torch_threads):
    """Per-head sink logits on an unpadded batch of several rows (one kernel call per row, each writing its rows of
    the LSE): hy_v4's eager function's output, and bitwise the packed call's."""
    sinks = torch.tensor([3.0, -1.0])
    module, m = _fake_module("hy_v4", sinks=sinks)
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(3, 2, 20, 24, generator=g), torch.randn(3, 2, 20, 24, generator=g)
    v = torch.randn(3, 2, 20, 40, generator=g)[..., 8:24]  # a view, as transformers' value
    out, _ = mbt.mla_bridge_attention(module, q, k, v, None, scaling=0.3, s_aux=sinks)
    mask = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
    want, _ = m.eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    monkeypatch.setattr(mbt_attention, "_ROW_CALL_MIN_QUERIES", 10**9)
    packed, _ = mbt.mla_bridge_attention(module, q, k, v, None, scaling=0.3, s_aux=sinks)
    assert torch.equal(out, packed)


def test_padded_batch_is_gathered_without_a_host_sync_per_layer(pair, no_hand_back, two_torch_threads):
    """A left-padded batch: the valid rows' index tensors are made once per mask and the layers gather and scatter by
    them, so the forward reads the device on the host only in the mask check (torch's profiler counts the ops that
    read a count back, ``aten::nonzero``: the 2 index tensors per forward). Before, boolean-mask indexing read the
    mask's count back in every layer (3 per layer: q, k / v and the output)."""
    from torch.profiler import ProfilerActivity, profile

    eager, ours = pair
    ids, mask = _left_padded([19, 17, 20], eager.config.vocab_size, seed=12)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        got = ours(ids, attention_mask=mask).logits
    assert ours.config.num_hidden_layers == 2
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::nonzero") == 2
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=0)


# ---- the mask conversion ------------------------------------------------------------------------------------------


def _sdpa_mask(padding, q_len, kv_len):
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    return sdpa_mask(
        batch_size=padding.shape[0],
        q_length=q_len,
        kv_length=kv_len,
        q_offset=kv_len - q_len,
        mask_function=causal_mask_function,
        attention_mask=padding,
        allow_is_causal_skip=False,
    )


@pytest.mark.parametrize("q_len,kv_len", [(6, 6), (2, 6), (1, 6)])
def test_padding_masks_become_ragged_lengths(q_len, kv_len):
    cpu = torch.device("cpu")
    left = torch.ones(2, kv_len, dtype=torch.bool)
    left[0, :2] = False
    q_valid, key_valid = mbt.ragged_from_mask(_sdpa_mask(left, q_len, kv_len), 2, q_len, kv_len, cpu)
    assert torch.equal(key_valid, left) and torch.equal(q_valid, left[:, kv_len - q_len :])
    for slot in (kv_len - 1, 3):  # right padding, padding inside
        padding = torch.ones(2, kv_len, dtype=torch.bool)
        padding[1, slot] = False
        got = mbt.ragged_from_mask(_sdpa_mask(padding, q_len, kv_len), 2, q_len, kv_len, cpu)
        if q_len > 1 and slot >= kv_len - q_len:  # a padding query that sees keys (eager: a defined value)
            assert got is None
        else:  # the padding is among the cached keys only, or the one query sees every valid key: served as is
            assert torch.equal(got[1], padding) and bool(got[0].all())
    q_valid, key_valid = mbt.ragged_from_mask(None, 2, 4, 4, cpu)
    assert bool(q_valid.all()) and bool(key_valid.all())


def test_masks_of_a_static_cache_are_served_with_their_written_slots():
    cpu = torch.device("cpu")
    decode = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    decode[..., :8] = True  # the query is slot 7 of 10; slots 8 and 9 are not written yet
    q_valid, key_valid = mbt.ragged_from_mask(decode, 1, 1, 10, cpu)
    assert bool(q_valid.all()) and torch.equal(key_valid[0], decode[0, 0, 0])
    top_left = torch.ones(2, 1, 2, 6, dtype=torch.bool).tril()  # a prefill of 2 into a cache of 6
    q_valid, key_valid = mbt.ragged_from_mask(top_left, 2, 2, 6, cpu)
    assert bool(q_valid.all()) and key_valid.sum(1).tolist() == [2, 2] and bool(key_valid[:, :2].all())
    q_valid, key_valid = mbt.ragged_from_mask(None, 1, 8, 10, cpu)  # no mask, Q < K: sdpa's top-left causal
    assert key_valid.sum().item() == 8 and bool(key_valid[0, :8].all())


@pytest.mark.parametrize("q_len,kv_len", [(6, 6), (3, 9), (1, 5)])
def test_a_mask_broadcast_over_the_batch_reads_as_its_copy(q_len, kv_len):
    """transformers' mask of an unpadded batch is one [1, 1, Q, K] mask expanded over the batch (stride 0): checked
    once for all rows, it gives what the same mask materialised per row gives, servable or not."""
    cpu = torch.device("cpu")
    one = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    hole = one.clone()
    hole[..., -1, 0] = False  # the last query does not see the first key: not of the served structure
    for m in (one, hole):
        broadcast = m.expand(3, 1, q_len, kv_len)
        assert broadcast.stride(0) == 0
        got, want = (
            mbt.ragged_from_mask(broadcast, 3, q_len, kv_len, cpu),
            mbt.ragged_from_mask(broadcast.clone(), 3, q_len, kv_len, cpu),
        )
        # with one query, a hole is only a padded key; with more, the last query missing a key its elders see is not
        # of the served structure
        assert (want is None) == (m is hole and q_len > 1)
        assert (got is None) == (want is None)
        if want is not None:
            assert all(torch.equal(g, w) and g.shape == (3, n) for g, w, n in zip(got, want, (q_len, kv_len)))


def test_custom_masks_are_not_taken_for_padding():
    m = _sdpa_mask(torch.ones(2, 6, dtype=torch.bool), 6, 6)
    cpu = torch.device("cpu")
    sliding = m.clone()
    sliding[:, :, 5, 0] = False  # one key hidden from one query only
    assert mbt.ragged_from_mask(sliding, 2, 6, 6, cpu) is None
    skip = m.clone()
    skip[:, :, 3] = skip[:, :, 2]  # two queries that see the same keys
    assert mbt.ragged_from_mask(skip, 2, 6, 6, cpu) is None
    assert mbt.ragged_from_mask(m.float(), 2, 6, 6, cpu) is None
    assert mbt.ragged_from_mask(m.expand(2, 4, 6, 6), 2, 6, 6, cpu) is None  # per-head mask


def test_masks_are_checked_in_blocks_of_queries(monkeypatch):
    """The structure check compares the mask in blocks of queries (no [B, Q, K] temporary): blocks of a single query
    (a tiny budget) reach the verdict of one block over the whole mask, for served and refused masks alike."""
    cpu = torch.device("cpu")
    left = torch.ones(2, 6, dtype=torch.bool)
    left[0, :2] = False
    served = _sdpa_mask(left, 6, 6)
    sliding = _sdpa_mask(torch.ones(2, 6, dtype=torch.bool), 6, 6).clone()
    sliding[:, :, 5, 0] = False  # found in the last block only
    for mask, q_len in ((served, 6), (_sdpa_mask(left, 2, 6), 2), (sliding, 6)):
        whole = mbt.ragged_from_mask(mask, 2, q_len, 6, cpu)
        monkeypatch.setattr(mbt_attention, "_CHECK_ELEMS", 1)
        blocks = mbt.ragged_from_mask(mask, 2, q_len, 6, cpu)
        monkeypatch.undo()
        assert (whole is None) == (blocks is None) == (mask is sliding)
        if whole is not None:
            assert all(torch.equal(a, b) for a, b in zip(whole, blocks))


# ---- what is handed back -------------------------------------------------------------------------------------------


def _call(module, mask=None, dropout=0.0, q_len=4, kv_len=4, heads=2, kv_heads=2, grad=None, **kwargs):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, heads, q_len, 24, generator=g)
    k = torch.randn(1, kv_heads, kv_len, 24, generator=g)
    v = torch.randn(1, kv_heads, kv_len, 16, generator=g)
    if grad is not None:
        {"q": q, "k": k, "v": v}[grad].requires_grad_(True)
    return mbt.mla_bridge_attention(module, q, k, v, mask, scaling=0.3, dropout=dropout, **kwargs), (q, k, v)


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(dropout=0.1), "dropout"),
        (dict(sliding_window=2), "sliding window"),
        (dict(cu_seq_lens_q=torch.tensor([0, 2, 4])), "packed sequences"),
        (dict(position_bias=torch.zeros(1, 2, 4, 4)), "position_bias"),  # sdpa adds it to the logits
        (dict(kv_heads=1), "GQA"),
        (dict(is_causal=False), "non-causal"),
        (dict(mask=torch.zeros(1, 1, 4, 4)), "mask"),
        (dict(mask=torch.ones(1, 1, 4, 4, dtype=torch.bool)), "other than causal over each row"),
        (dict(grad="q"), "autograd"),
        (dict(grad="k"), "autograd"),
        (dict(grad="v"), "autograd"),
    ],
)
def test_unservable_calls_go_to_sdpa(monkeypatch, caplog, change, reason):
    seen = {}

    def fake_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        seen.update(dropout=dropout, scaling=scaling, mask=attention_mask)
        return "sdpa-out", None

    import transformers.integrations.sdpa_attention as sdpa_mod

    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", fake_sdpa)
    mbt_attention._warned.clear()
    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace())
    with caplog.at_level(logging.WARNING, logger="mla_bridge_transformers"):
        (out, weights), _ = _call(module, **change)
    assert out == "sdpa-out" and weights is None
    assert seen["scaling"] == 0.3 and seen["dropout"] == change.get("dropout", 0.0)
    assert reason in caplog.text and "sdpa" in caplog.text


def test_forward_mode_tangents_go_to_sdpa(monkeypatch):
    """A query carrying a forward-mode tangent (torch.func.jvp through the model; torch.no_grad() does not stop
    forward AD) goes to sdpa, whose jvp exists: the core refuses it (no derivative), and served it was differentiated
    on the CPU only (lost on CUDA)."""
    import torch.autograd.forward_ad as fwAD
    import transformers.integrations.sdpa_attention as sdpa_mod

    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", lambda *a, **k: ("sdpa-out", None))
    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace())
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 2, 4, 24, generator=g), torch.randn(1, 2, 4, 24, generator=g), torch.randn(1, 2, 4, 16)
    with torch.no_grad(), fwAD.dual_level():
        assert mbt.mla_bridge_attention(module, fwAD.make_dual(q, torch.ones_like(q)), k, v, None)[0] == "sdpa-out"
        served = mbt.mla_bridge_attention(module, q, k, v, None)[0]  # no tangent: served
    assert isinstance(served, torch.Tensor) and served.shape == (1, 4, 2, 16)


def test_output_attentions_goes_to_eager(two_torch_threads):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    fake = type("FakeAttention", (types.SimpleNamespace,), {"__module__": m.__name__})  # eager found by module
    module = fake(
        is_causal=True, config=types.SimpleNamespace(output_attentions=True), num_key_value_groups=1, training=False
    )
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    (out, weights), (q, k, v) = _call(module, mask=mask)
    assert weights is not None and weights.shape == (1, 2, 4, 4)
    want, _ = m.eager_attention_forward(
        module, q, k, v, torch.zeros(1, 1, 4, 4).masked_fill(~mask, torch.finfo(q.dtype).min), scaling=0.3
    )
    torch.testing.assert_close(out, want)


def test_served_call_equals_eager_on_a_continuation(two_torch_threads):
    # q shorter than k (a continuation over a KV cache): bottom-right causal, as transformers' eager mask says.
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = _sdpa_mask(padding, 3, 7)
    module = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=1, training=False
    )
    (out, weights), (q, k, v) = _call(module, mask=mask, q_len=3, kv_len=7)
    assert weights is None
    add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want, _ = m.eager_attention_forward(module, q, k, v, add, scaling=0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_one_broadcast_mask_serves_calls_of_other_batch_sizes(two_torch_threads):
    """A ``[1, 1, Q, K]`` mask broadcasts to any batch; the layout kept for a mask object is the one made for the
    call's batch, query and key lengths. Before, it was kept by the mask object alone, so the same mask object
    handed to a call with another batch size reused the first call's lengths and the core refused the call
    ("q has 12 tokens but qo_indptr[-1] = 8")."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    module = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=1, training=False
    )
    mask = torch.ones(4, 6, dtype=torch.bool).tril(2)[None, None]  # bottom-right causal, [1, 1, 4, 6]
    add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    g = torch.Generator().manual_seed(7)
    for batch in (2, 3, 1):
        q, k = torch.randn(batch, 2, 4, 24, generator=g), torch.randn(batch, 2, 6, 24, generator=g)
        v = torch.randn(batch, 2, 6, 16, generator=g)
        out, _ = mbt.mla_bridge_attention(module, q, k, v, mask, scaling=0.3)
        want, _ = m.eager_attention_forward(module, q, k, v, add, scaling=0.3)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_a_forced_backend_is_obeyed_on_the_same_lengths(monkeypatch, two_torch_threads):
    """The adapter's plan is kept across calls of equal lengths; its key now holds the backend asked for
    (``MLA_BRIDGE_BACKEND``) and the workspace, as the core's PlanCache key does. Before, a backend forced between two
    calls of equal lengths was ignored (the old plan ran), and obeyed only once the lengths changed."""
    module = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=1, training=False
    )
    monkeypatch.delenv("MLA_BRIDGE_BACKEND", raising=False)
    (out, _), _ = _call(module)
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "flashinfer-fa2")  # cannot serve on the CPU: refused by name
    with pytest.raises(ValueError, match="MLA_BRIDGE_BACKEND"):
        _call(module)
    monkeypatch.setenv("MLA_BRIDGE_BACKEND", "torch")
    (again, _), _ = _call(module)
    assert torch.equal(out, again)


# ---- the keywords transformers' models pass ------------------------------------------------------------------------

DSA_MODELS = ["deepseek_v32", "glm_moe_dsa"]  # MLA with an indexer, no sinks


def _fake_module(model_file: str, heads: int = 2, kv_heads: int = 2, **attrs):
    """An attention module of transformers' ``models/<model_file>``: its ``eager_attention_forward`` is found by the
    module's ``__module__``, as for the model's own attention class."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{model_file}.modeling_{model_file}")
    fake = type("FakeAttention", (types.SimpleNamespace,), {"__module__": mod.__name__})
    return fake(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=heads // kv_heads, training=False, **attrs
    ), mod


def _additive(mask):
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _topk_indices(q_len, kv_len, topk, seed=0, batch=1):
    """Top-k key positions per query as transformers' indexers make them: torch.topk of scores, keys above the causal
    diagonal (bottom-right) scored -inf, int32 ``[B, Q, topk]``."""
    scores = torch.randn(batch, q_len, kv_len, generator=torch.Generator().manual_seed(seed))
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    return scores.masked_fill(~causal, float("-inf")).topk(topk, dim=-1).indices.to(torch.int32)


def _dsa_pair(model_type, index_topk, **kw):
    name = mbt.register()
    return (
        H.dsa_model(model_type, index_topk=index_topk, **kw),
        H.dsa_model(model_type, index_topk=index_topk, attn_implementation=name, **kw),
    )


def _left_padded(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lens):
        ids[r, -n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, -n:] = 1
    return ids, mask


@pytest.mark.parametrize("model_type", DSA_MODELS)
def test_sparse_indices_logits_equal_eager(model_type, two_torch_threads):
    """DSA with index_topk 4 and prompts of up to 16 tokens: for implementations other than eager / sdpa, transformers
    passes the indexer's top-k as ``indices=`` and leaves it out of the mask. Served by mla_bridge's sparse attention
    (the masked picks dropped), the logits equal eager's at every real position of a left-padded batch and at every
    greedy step, each model running its own indexer (tests/models/test_transformers_sparse.py replays eager's
    indices instead); computed densely (the indices dropped) they were 0.84-0.88 off."""
    eager, ours = _dsa_pair(model_type, 4)
    ids, mask = _left_padded([16, 11], eager.config.vocab_size, seed=9)
    valid = mask.bool()
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        dense = H.dsa_model(model_type, index_topk=64)(ids, attention_mask=mask).logits  # same weights, no sparsity
    assert (want - dense)[valid].abs().max() > 0.1  # the top-k matters on these prompts
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    g_want, g_got = _generate(eager, ids, mask, steps=4), _generate(ours, ids, mask, steps=4)
    assert torch.equal(g_got.sequences, g_want.sequences)
    for step, (a, b) in enumerate(zip(g_got.logits, g_want.logits)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"greedy step {step}: {m}")


@pytest.mark.parametrize("model_type", DSA_MODELS)
def test_sparse_indices_selecting_every_key_are_served(model_type, no_hand_back, two_torch_threads):
    """Sequences no longer than index_topk: each query's top-k is every key (the indices' last dim is the key count),
    so they change nothing and mla_bridge serves the call itself: logits equal eager's, prompt and greedy steps."""
    eager, ours = _dsa_pair(model_type, 16)
    ids, mask = _left_padded([8, 5], eager.config.vocab_size, seed=10)
    g_want, g_got = _generate(eager, ids, mask, steps=6), _generate(ours, ids, mask, steps=6)
    assert torch.equal(g_got.sequences, g_want.sequences)
    for step, (a, b) in enumerate(zip(g_got.logits, g_want.logits)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"greedy step {step}: {m}")


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_indices_are_folded_into_the_mask(mask_kind, kv_heads, two_torch_threads):
    """``indices`` (top-2 of 6 keys per query, a batch of 2 under one broadcast ``[1, 1, Q, K]`` mask) on a call served
    (2 key/value heads: sparse attention over the picks the mask keeps; an additive mask is handed back with the top-k
    folded in) and on one handed back for another reason (GQA): each equals eager on the mask with the top-k folded
    in, for no mask (sdpa's causal), a boolean and an additive mask. Before, the indices were dropped (dense
    attention)."""
    module, m = _fake_module("deepseek_v32", kv_heads=kv_heads)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    mask = {"none": None, "bool": causal, "float": _additive(causal)}[mask_kind]
    indices = _topk_indices(6, 6, 2, seed=1, batch=2)
    g = torch.Generator().manual_seed(12)
    q, k, v = (
        torch.randn(2, 2, 6, 24, generator=g),
        torch.randn(2, kv_heads, 6, 24, generator=g),
        torch.randn(2, kv_heads, 6, 16, generator=g),
    )
    out, _ = mbt.mla_bridge_attention(module, q, k, v, mask, scaling=0.3, indices=indices)
    keep = torch.zeros(2, 6, 6, dtype=torch.bool).scatter(-1, indices.long(), True)[:, None]
    want, _ = m.eager_attention_forward(module, q, k, v, _additive(causal & keep), scaling=0.3)
    dense, _ = m.eager_attention_forward(module, q, k, v, _additive(causal), scaling=0.3)
    assert (want - dense).abs().max() > 0.1
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "indices,match",
    [
        (torch.zeros(1, 4, 2), "integer"),
        (torch.zeros(2, 4, 2, dtype=torch.int32), r"\[1, 4, k\]"),
        (torch.zeros(1, 4, dtype=torch.int64), r"\[1, 4, k\]"),
        ([[0, 1]], "tensor"),
    ],
)
def test_malformed_indices_are_refused_by_name(indices, match):
    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace())
    with pytest.raises((TypeError, ValueError), match=rf"indices.*{match}"):
        _call(module, indices=indices)


@pytest.mark.parametrize("index_topk", [16, 4])
def test_attention_sinks_logits_equal_eager(monkeypatch, two_torch_threads, index_topk):
    """hy_v4 (DSA whose attention has per-head sink logits, passed as ``s_aux``; drawn around 3.0 here): within
    index_topk (16) the call is served by the dense path, beyond it (4) by the sparse attention over the top-k; the
    sinks are merged in as a partial of LSE s_aux and output 0 on both. The logits equal eager's at every position and
    greedy step; handed to sdpa, which ignores sinks, they were 1.25 off."""
    handed = []
    real = mbt_attention._hand_back
    monkeypatch.setattr(mbt_attention, "_hand_back", lambda reason, *a: handed.append(reason) or real(reason, *a))
    eager, ours = _dsa_pair("hy_v4", index_topk, sinks=3.0)
    ids, mask = _left_padded([12, 9], eager.config.vocab_size, seed=11)
    valid = mask.bool()
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        no_sinks = H.dsa_model("hy_v4", index_topk=index_topk, sinks=-1e4)(ids, attention_mask=mask).logits
    assert (want - no_sinks)[valid].abs().max() > 0.1  # the sinks matter
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    g_want, g_got = _generate(eager, ids, mask, steps=3), _generate(ours, ids, mask, steps=3)
    assert torch.equal(g_got.sequences, g_want.sequences)
    for step, (a, b) in enumerate(zip(g_got.logits, g_want.logits)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"greedy step {step}: {m}")
    assert not handed, handed


def test_s_aux_is_served_as_a_sink_partial(no_hand_back, two_torch_threads):
    """Per-head sink logits on a served call (a continuation over left padding, so the batch is gathered): mla_bridge's
    output equals hy_v4's eager function (softmax over the keys and one sink logit per head, the sink dropped)."""
    sinks = torch.tensor([3.0, -1.0])
    module, m = _fake_module("hy_v4", sinks=sinks)
    mask = _sdpa_mask(torch.tensor([[0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool), 3, 7)
    (out, _), (q, k, v) = _call(module, mask=mask, q_len=3, kv_len=7, s_aux=sinks)
    want, _ = m.eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    module.sinks = torch.full((2,), -1e4)  # no sink
    dense, _ = m.eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.3)
    assert (want - dense).abs().max() > 0.1


@pytest.mark.parametrize(
    "model_file,change",
    [
        ("gemma2", dict(softcap=0.5)),  # sdpa refuses softcap
        ("inkling2", dict(sinks=torch.full((1, 2, 4, 1), 2.0))),  # per-query sink logits: sdpa ignores them
        ("hy_v4", dict(s_aux=torch.tensor([3.0, 2.0]), kv_heads=1)),  # GQA is handed back; sdpa ignores s_aux
        ("hy_v4", dict(s_aux=torch.tensor([3.0, 2.0]), mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))),  # not causal
    ],
)
def test_keywords_only_eager_honours_go_to_the_models_eager(model_file, change, two_torch_threads):
    """A call handed back with a keyword sdpa does not honour (softcap, sinks, s_aux) goes to the model's own eager
    function, with the mask made additive; its output equals that function's."""
    change = dict(change)
    kv_heads = change.pop("kv_heads", 2)
    mask = change.pop("mask", torch.ones(1, 1, 4, 4, dtype=torch.bool).tril())
    extra = {"sinks": change["s_aux"]} if "s_aux" in change else {}  # hy_v4's eager reads module.sinks
    module, m = _fake_module(model_file, kv_heads=kv_heads, **extra)
    (out, _), (q, k, v) = _call(module, mask=mask, kv_heads=kv_heads, **change)
    want, _ = m.eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.3, **change)
    plain, _ = m.eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.3)  # inkling2: no sinks
    if model_file != "hy_v4":
        assert (want - plain).abs().max() > 0.1
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", [dict(), dict(kv_heads=1), dict(dropout=0.1)])
def test_unknown_keywords_are_refused_by_name(monkeypatch, change):
    """A keyword mla_bridge does not know may change the result (``block_indices``: another model's sparse blocks), and
    sdpa would drop it too: refused by name, on a call it would serve and on ones it would hand back alike. A keyword
    that is None (what transformers passes for "absent") is accepted."""
    import transformers.integrations.sdpa_attention as sdpa_mod

    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", lambda *a, **k: ("sdpa-out", None))
    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace())
    with pytest.raises(TypeError, match="block_indices"):
        _call(module, block_indices=torch.zeros(1, 1, 4, 1, dtype=torch.int64), **change)
    (out, _), _ = _call(module, block_indices=None, **change)
    assert isinstance(out, torch.Tensor) if not change else out == "sdpa-out"


# ---- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_bf16_gpu_logits_within_transformers_own_spread(v2_folder, no_hand_back):
    """bf16 on the H200 (FlashInfer): the float32 eager model on the GPU is the truth; mla_bridge's bf16 logits must be
    no further from it than 1.5x the furthest of transformers' own bf16 implementations (eager, sdpa) measured in the
    same run: bf16 rounding of activations is the error source all three share, and a fused kernel that accumulates
    in float32 (sdpa, FlashInfer) should not be worse than either."""
    name = mbt.register()
    g = torch.Generator().manual_seed(0)
    lens = [300, 177]
    ids = torch.zeros(2, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lens):
        ids[r, -n:] = torch.randint(3, 64, (n,), generator=g)
        mask[r, -n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    valid = mask.bool()
    with torch.no_grad():
        truth = H.load(v2_folder, "eager", device="cuda")(ids, attention_mask=mask).logits[valid].float()
        err = {}
        for impl in ("eager", "sdpa", name):
            model = H.load(v2_folder, impl, dtype=torch.bfloat16, device="cuda")
            torch.cuda._sleep(int(1e8))
            err[impl] = (model(ids, attention_mask=mask).logits[valid].float() - truth).abs().max().item()
    spread = max(err["eager"], err["sdpa"])
    assert err[name] <= 1.5 * spread, err


@pytest.mark.gpu
@pytest.mark.parametrize("index_topk", [2048, 64])
def test_dsa_bf16_gpu_logits(monkeypatch, index_topk):
    """A DeepSeek-V3.2 model (MLA at V3.2's head dims: q/k 128 + 64, v 128; 16 heads) in bf16 on the H200, prompts of
    300 and 177 tokens left-padded. index_topk 2048: the indices select every key, mla_bridge serves every call
    (FlashInfer). index_topk 64: on CUDA the calls with ``indices=`` are handed back to sdpa with the top-k folded
    into the mask (faster there than the sparse MHA torch pass), as eager and sdpa fold them. Each bf16 model is fed the indices the float32 eager model's indexers
    produced (replayed: bf16 and float32 runs pick different top-k keys near ties, which would measure the selection,
    not the attention), and mla_bridge's logits are no further from the float32 model's than 1.5x the furthest of
    transformers' own bf16 implementations (eager, sdpa), as in the V2 test above."""
    import copy

    import transformers

    from tests.helpers.indexer_calls import indexer_calls

    if not hasattr(transformers, "DeepseekV32Config"):
        pytest.skip(f"transformers {transformers.__version__} has no deepseek_v32")
    name = mbt.register()
    handed = []
    real = mbt_attention._hand_back
    monkeypatch.setattr(mbt_attention, "_hand_back", lambda reason, *a: handed.append(reason) or real(reason, *a))
    dims = dict(
        num_attention_heads=16,
        num_key_value_heads=16,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        kv_lora_rank=512,
        q_lora_rank=64,
        hidden_size=256,
        index_head_dim=128,
        index_n_heads=8,
    )
    ids, mask = _left_padded([300, 177], 64, seed=0)
    ids, mask = ids.cuda(), mask.cuda()
    valid = mask.bool()
    logits = {}
    with torch.no_grad():
        truth_model = H.dsa_model("deepseek_v32", index_topk=index_topk, device="cuda", **dims)
        with indexer_calls(truth_model) as record:
            truth = truth_model(ids, attention_mask=mask).logits[valid].float()
        for impl in ("eager", "sdpa", name):
            model = H.dsa_model(
                "deepseek_v32",
                index_topk=index_topk,
                attn_implementation=impl,
                dtype=torch.bfloat16,
                device="cuda",
                **dims,
            )
            torch.cuda._sleep(int(1e8))  # keep the GPU busy so the host runs ahead
            with indexer_calls(model, replay=copy.deepcopy(record)):
                logits[impl] = model(ids, attention_mask=mask).logits[valid].float()
    err = {impl: (x - truth).abs().max().item() for impl, x in logits.items()}
    print(f"index_topk {index_topk}: max |logit error| {err}, handed back {sorted(set(handed))}")
    assert set(handed) == (set() if index_topk == 2048 else {mbt_attention.INDICES_ON_CUDA}), handed
    assert err[name] <= 1.5 * max(err["eager"], err["sdpa"]), err


def test_training_step_gradients_equal_eager(pair, two_torch_threads):
    """A training step (autograd recording, DeepSeek's attention_dropout 0): the call goes to sdpa, whose backward
    exists, and the gradients equal eager's. Served by mla_bridge, the attention's gradient was lost on CUDA
    (FlashInfer writes outside autograd); its inputs requiring grad are now handed back."""
    eager, ours = pair
    ids = torch.randint(3, eager.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(8))
    grads = []
    for model in (eager, ours):
        model.zero_grad()
        model(ids).logits.float().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "q_proj" in n or "kv_a_proj" in n})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert grads[0][n].abs().max() > 0, n
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.gpu
def test_gpu_training_step_gradients_equal_sdpa(v2_folder):
    """On the H200 (where FlashInfer would serve the call and write outside autograd): a bf16 training step through
    the mla_bridge attention gives the gradients of the sdpa model (the calls are handed to sdpa; within 1% of the
    largest, as sdpa's own backward may accumulate in another order between runs), none zero."""
    name = mbt.register()
    ids = torch.randint(3, 64, (2, 96), generator=torch.Generator().manual_seed(1)).cuda()
    grads = []
    for impl in ("sdpa", name):
        model = H.load(v2_folder, impl, dtype=torch.bfloat16, device="cuda")
        torch.cuda._sleep(int(1e8))
        model(ids).logits.float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if "q_proj" in n or "kv_a_proj" in n})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        top = grads[0][n].float().abs().max().item()
        assert top > 0 and (grads[1][n].float() - grads[0][n].float()).abs().max().item() <= 1e-2 * top, n


@pytest.mark.gpu
def test_gpu_rows_read_in_place_equal_the_packed_call_bitwise(v2_folder, no_hand_back, monkeypatch):
    """bf16 on the H200 (FlashInfer): an unpadded batch of 3 x 300 tokens runs one kernel call per row on views of
    transformers' q, k, v (FlashInfer reads their strides: RaggedPlan.run copies nothing), and its logits are bitwise
    those of the rows packed into one call (contiguous copies, the layout before), and within transformers' own bf16
    spread (sdpa against eager) of the float32 eager model. The GPU is kept busy so the host runs ahead."""
    from mla_bridge.checks import kernel_ready

    mbt.register()
    calls, runs = _probe_runs(monkeypatch)
    ids = torch.randint(3, 64, (3, 300), generator=torch.Generator().manual_seed(5)).cuda()
    model = H.load(v2_folder, mbt.ATTN_IMPLEMENTATION, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        torch.cuda._sleep(int(1e8))
        got = model(ids).logits.float()
        for (query, key, value), made in zip(calls, runs):
            assert len(made) == 3
            for q, k, v, kw in made:
                assert kw.get("return_lse") is False
                for x, src in ((q, query), (k, key), (v, value)):
                    assert x.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and kernel_ready(x)
        monkeypatch.setattr(mbt_attention, "_ROW_CALL_MIN_QUERIES", 10**9)
        torch.cuda._sleep(int(1e8))
        packed = model(ids).logits.float()
        truth = H.load(v2_folder, "eager", device="cuda")(ids).logits.float()
        sdpa = H.load(v2_folder, "sdpa", dtype=torch.bfloat16, device="cuda")(ids).logits.float()
        eager = H.load(v2_folder, "eager", dtype=torch.bfloat16, device="cuda")(ids).logits.float()
    assert torch.equal(got, packed)
    spread = max((sdpa - truth).abs().max().item(), (eager - truth).abs().max().item())
    assert (got - truth).abs().max().item() <= 1.5 * spread


@pytest.mark.parametrize(
    "shapes,name",
    [
        (((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 4, 8)), "value"),  # value's tokens differ from key's
        (((1, 2, 5, 8), (1, 2, 5, 8), (1, 3, 5, 8)), "value"),  # heads
        (((1, 2, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), "key"),  # key's batch differs from query's
        (((1, 2, 5, 8), (1, 2, 5, 6), (1, 2, 5, 8)), "key"),  # key's dim differs from query's
        (((2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)), "query"),  # 3-D
        (((1, 2, 5, 8), (2, 5, 8), (1, 2, 5, 8)), "key"),
        (((1, 2, 5, 8), (1, 2, 5, 8), (2, 5, 8)), "value"),
    ],
)
def test_mismatched_shapes_are_refused_by_name(shapes, name):
    """query / key / value not 4-D ``[batch, heads, tokens, dim]``, or key and value of unequal batch, heads or
    tokens: a ValueError naming the tensor, before any work. Before, the call failed deep in a reshape ("shape
    '[10, 3, 4]' is invalid") or an unpacking ("not enough values to unpack")."""
    module = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(), num_key_value_groups=1, training=False
    )
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        mbt.mla_bridge_attention(module, q, k, v, None, scaling=0.3)
