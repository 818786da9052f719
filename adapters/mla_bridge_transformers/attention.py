"""The attention function transformers calls: ``fn(module, query, key, value, attention_mask, scaling, dropout,
**kwargs) -> (attn_output, attn_weights)`` (transformers 5, ``integrations/sdpa_attention.py`` and the models'
``eager_attention_forward``), with ``query [B, H, Q, D_qk]``, ``key [B, H_kv, K, D_qk]``, ``value [B, H_kv, K, D_v]``
and ``attn_output [B, Q, H, D_v]``. DeepSeek-V2/V3 (transformers 5.24, ``modeling_deepseek_v2/v3.py``) call it with
the latents already up-projected (``expand_kv``): D_qk 192, D_v 128, H_kv == H; v is not padded to 192.

Conversion (no attention math here):

* The mask is transformers' ``sdpa_mask`` (registered with the function): boolean, True = may attend, or ``None``.
  ``None`` means what it means to sdpa (``sdpa_attention_forward``: ``is_causal`` when Q > 1): causal aligned top-left,
  so with Q < K (a static cache, whose last K - Q slots are not written yet) the queries see the first Q keys only;
  a single query sees all K keys. A mask is served when it is exactly "causal over each batch row's valid keys,
  bottom-right aligned": every query row sees a prefix of that row's valid keys (the keys any query sees), the
  rows that see none are padding (output 0; eager gives them an arbitrary average), and the others see one key
  more each, the last one all of them. That is transformers' mask for no padding, left padding, a continuation over
  its KV cache (Q < K) and a static cache (decode steps whose query is not the last slot). Each batch row becomes one
  ragged request holding its valid keys and its non-padding queries. Right padding or padding inside a row is not of
  that form (a padding query there sees keys, as in eager): it is handed to sdpa.
* Layout. A batch whose rows are all real (no mask, or a mask with no padding: a prompt, a continuation over the
  cache) is read where transformers put it: one kernel call per batch row over ``query[b]``, ``key[b]``, ``value[b]``
  as ``[L, H, D]`` views (transformers' ``[B, H, L, D]`` tensors, whatever their strides; their strides go to the
  plan, ``plan_ragged(strides=...)``), each writing its rows of one ``[B, Q, H, D_v]`` output: no copy of q, k or v
  where the kernel reads their strides (FlashInfer: a unit last stride and 16-byte aligned strides, which
  transformers' tensors have). All rows share one plan of one request. Rows of fewer than
  :data:`_ROW_CALL_MIN_QUERIES` queries (decode steps) are packed into one call instead. A padded batch gathers its valid query and
  key rows (index tensors made once per mask, no host sync per layer) into one ragged batch of one request per row,
  and scatters the output back. The LSE is computed only where it is used (sinks).
* Plans (:func:`mla_bridge.plan_ragged`) come from the plan cache the adapters share
  (:func:`mla_bridge.plan_cache.shared_plan_cache`): every layer of one forward shares one plan, and a later forward of
  equal lengths and strides reuses it. The mask is checked once per mask object, not per layer (in blocks of queries, never a
  ``[B, Q, K]`` temporary; one device-to-host copy); no mask costs no device work.

The keywords models pass (every ``modeling_*.py`` of transformers 5.25), each served or handed to an implementation
that honours it, never dropped:

* ``indices`` (DSA models: ``deepseek_v32``, ``glm_moe_dsa``, ``hy_v4``, ...: the indexer's top-k key positions per
  query, int ``[B, Q, k]``, -1 for none, which transformers folds into the mask only for eager / sdpa). Indices with
  ``k >= K`` (the top-k of K keys, distinct as ``torch.topk`` makes them, is every key) change nothing: the call goes
  on as any other, the layers of one forward sharing one mask check. Otherwise they are served: every pick the mask
  drops made -1 (:func:`sparse_picks`: transformers' indexer lists masked keys for early and padding queries), then
  :func:`mla_bridge.sparse_mha.sparse_attention_mha` per batch row over views of ``query`` / ``key`` / ``value`` (the
  MHA form, float32 arithmetic; sinks merged from its LSE), whatever the boolean mask's structure; a query left
  without keys (padding) gets 0. Where the call is handed back for another reason (GQA, an additive mask, autograd,
  ...) they are folded into the mask exactly as transformers does (a key outside a query's top-k is masked; ``None``
  first spelled out as sdpa's causal mask). Served, it is faster on the CPU than the top-k folded into the mask and
  handed to sdpa (docs/design/sparse.md). On the CPU a pick below -1 or past K is refused (ValueError naming
  ``indices``).
* ``s_aux`` (per-head attention sink logits ``[H]``, in the units of the scaled logits: ``hy_v4``; ``gpt_oss``,
  ``deepseek_v4`` and the others passing it are GQA/MQA and handed back): served. A sink is one more key per head,
  of logit ``s_aux`` and value vector 0, i.e. a partial with LSE ``s_aux`` and output 0, merged into the result by
  :func:`mla_bridge.merge.merge_sinks_` (``out * exp(lse) / (exp(lse) + exp(s_aux))``, as the models' eager
  functions compute it). Handed back (GQA, a mask not served, ...) or of another shape: to the model's eager function
  (sdpa ignores sinks).
* ``sinks`` (per-query sink logits, ``inkling2``), ``softcap`` and ``output_attentions``: the model's own
  ``eager_attention_forward`` (the only implementation honouring them; sdpa ignores sinks and refuses softcap), with
  the mask made additive and ``None`` spelled out as sdpa's causal mask. A model file without one: NotImplementedError.
* ``position_bias`` (T5-style relative bias), ``sliding_window`` (the window is in transformers' mask), packed
  sequences (``cu_seq_lens_*``), ``is_causal=False``, ``dropout > 0``: ``sdpa``, which honours them.
* Keywords that do not change the result (:data:`NEUTRAL_KEYWORDS`: ``position_ids``, ``use_cache``, ...; packing
  and windows reach attention through the mask) are accepted and passed on when handed back. Any other keyword whose
  value is not ``None`` is refused by name (TypeError): it may change the result and sdpa would drop it too.

Handed back to transformers (the reason is logged once per kind), never silently wrong:
inputs that require grad while autograd records (training with ``attention_dropout`` 0, DeepSeek's default: the
kernels have no backward, and their gradient would be lost) or that carry forward-mode tangents (``torch.func.jvp``),
the keywords above, fewer key/value heads than query heads (GQA), a non-causal module, a float (additive) mask, or
any boolean mask of another structure (right or inner padding, packed sequences, custom patterns): to ``sdpa``, or
to the model's ``eager`` when a keyword only eager honours is present.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Optional

import torch

import mla_bridge
from mla_bridge.inference import differentiated
from mla_bridge.merge import merge_sinks_
from mla_bridge.checks import kernel_strides
from mla_bridge.plan_cache import shared_plan_cache
from mla_bridge.sparse_mha import sparse_attention_mha

__all__ = [
    "ATTN_IMPLEMENTATION",
    "mla_bridge_attention",
    "ragged_from_mask",
    "fallback_reason",
    "sparse_picks",
    "fold_indices",
    "NEUTRAL_KEYWORDS",
    "HONOURED_KEYWORDS",
    "INDICES_ON_CUDA",
]

#: The name :func:`mla_bridge_transformers.register` registers by default.
ATTN_IMPLEMENTATION = "mla_bridge"

#: Keywords transformers' models pass that do not change the attention result: bookkeeping of the layers, the cache
#: and the outputs (sdpa and eager read none of them; packed sequences reach attention through the mask).
NEUTRAL_KEYWORDS = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache",
        "past_key_values",
        "past_key_value",
        "cache_position",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "deterministic",
        "input_ids",
    }
)
#: Keywords that change the result, each served or handed to an implementation honouring it (module docstring).
HONOURED_KEYWORDS = frozenset(
    {
        "indices",
        "s_aux",
        "sinks",
        "softcap",
        "output_attentions",
        "position_bias",
        "sliding_window",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "is_causal",
    }
)
#: What only the model's own eager function honours (sdpa ignores sinks, refuses softcap, returns no weights).
_EAGER_KEYWORDS = ("s_aux", "sinks", "softcap", "output_attentions")

logger = logging.getLogger("mla_bridge_transformers")
_warned: set[str] = set()
# [weakref to the mask, (its _version, batch, q_len, kv_len, device), the layout _ragged_layout made from them, the
# layer_idx of the last call that took it]
_mask_cache: list = [None, None, None, None]
#: Queries per batch row from which an unpadded batch runs one kernel call per row, in place; below it (decode
#: steps) the rows are packed into one call (a copy of the keys, one launch instead of one per row).
_ROW_CALL_MIN_QUERIES = 16
#: Mask elements compared at once when a mask's structure is checked (bool temporaries of this many elements).
_CHECK_ELEMS = 1 << 24


def ragged_from_mask(
    attention_mask: Optional[torch.Tensor], batch: int, q_len: int, kv_len: int, device: torch.device
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(q_valid [B, Q], key_valid [B, K])`` (bool) of a mask that is "causal over each row's valid keys, bottom-right
    aligned" (module docstring), or ``None`` when ``attention_mask`` has another structure.

    Args:
        attention_mask: boolean ``[B or 1, 1, Q, K]`` (True = may attend) or ``None`` (sdpa's ``is_causal``: top-left
            causal for Q > 1, so only the first Q keys are seen; one query sees all K).
    """
    if attention_mask is None:
        used = kv_len if q_len == 1 else min(q_len, kv_len)
        key_valid = torch.zeros(batch, kv_len, dtype=torch.bool, device=device)
        key_valid[:, :used] = True
        return torch.ones(batch, q_len, dtype=torch.bool, device=device), key_valid
    checked = _check_mask(attention_mask, batch, q_len, kv_len)
    if checked is None:
        return None
    q_valid, key_valid, ok = checked
    return (q_valid, key_valid) if bool(ok) else None


def _check_mask(m: torch.Tensor, batch: int, q_len: int, kv_len: int):
    """``(q_valid [B, Q], key_valid [B, K], ok)`` on the mask's device, ``ok`` a bool scalar tensor (read it to know
    whether the mask is of the served structure; nothing here waits for the device), or ``None`` for a mask whose
    dtype or shape is not a boolean ``[B or 1, 1, Q, K]``. The prefix structure is compared in blocks of queries
    (:data:`_CHECK_ELEMS` mask elements at once): no ``[B, Q, K]`` temporary. A mask broadcast over the batch (batch
    size 1 or stride 0: transformers' mask of an unpadded batch is one ``[1, 1, Q, K]`` mask expanded) is checked
    once, its results broadcast to the ``B`` rows."""
    if (
        m.dtype != torch.bool
        or m.dim() != 4
        or m.shape[1] != 1
        or tuple(m.shape[2:]) != (q_len, kv_len)
        or m.shape[0] not in (1, batch)
    ):
        return None
    m = m.expand(batch, 1, q_len, kv_len)[:, 0]
    if batch > 1 and m.stride(0) == 0:  # every batch row is the same memory: check one
        q_valid, key_valid, ok = _check_rows(m[:1])
        return q_valid.expand(batch, q_len), key_valid.expand(batch, kv_len), ok
    return _check_rows(m)


def _check_rows(m: torch.Tensor):
    """:func:`_check_mask` of the boolean ``[B, Q, K]`` ``m``."""
    batch, q_len, kv_len = m.shape
    key_valid = m.any(dim=1)  # the keys some query sees
    seen = m.sum(dim=2)  # keys each query sees
    rank = key_valid.cumsum(dim=1)  # 1-based rank of a valid key among its row's valid keys
    q_valid = seen > 0
    # the non-padding queries see one key more each, the last all of the row's valid keys (bottom-right causal)
    want = q_valid.cumsum(dim=1) + (key_valid.sum(dim=1) - q_valid.sum(dim=1))[:, None]
    ok = torch.where(q_valid, seen == want, True).all()
    # each query sees exactly the first seen[q] valid keys of its row
    step = max(1, _CHECK_ELEMS // max(1, batch * kv_len))
    for q0 in range(0, q_len, step):
        q1 = min(q_len, q0 + step)
        prefixes = key_valid[:, None, :] & (rank[:, None, :] <= seen[:, q0:q1, None])
        ok = ok & torch.eq(prefixes, m[:, q0:q1]).all()
    return q_valid, key_valid, ok


def fallback_reason(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    kwargs: dict,
    value: Optional[torch.Tensor] = None,
) -> Optional[str]:
    """Why this call cannot run through mla_bridge (``None`` when it can), from everything but the mask's values."""
    found = differentiated((("query", query), ("key", key), ("value", value), ("s_aux", kwargs.get("s_aux"))))
    if found is not None:
        return (
            "autograd (inputs that require grad: mla_bridge's kernels have no backward)"
            if found[1] == "grad"
            else "forward-mode AD (inputs with tangents: mla_bridge's kernels have no derivative)"
        )
    if dropout and dropout > 0:
        return f"dropout={dropout} (training)"
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        return "a sliding window"
    for name in ("softcap", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            return f"{name}"
    s_aux = kwargs.get("s_aux")
    if s_aux is not None and (not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (query.shape[1],)):
        return f"s_aux of shape {list(getattr(s_aux, 'shape', []))} (not one sink logit per head)"
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return "packed sequences (cu_seq_lens)"
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        return "output_attentions (attention weights)"
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        return "a non-causal module"
    if key.shape[1] != query.shape[1]:
        return f"{key.shape[1]} key/value heads for {query.shape[1]} query heads (GQA)"
    if query.shape[2] > key.shape[2]:
        return f"more queries ({query.shape[2]}) than keys ({key.shape[2]})"
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool
    ):
        return f"a {getattr(attention_mask, 'dtype', type(attention_mask).__name__)} mask (not the boolean sdpa mask)"
    return None


def _check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """ValueError naming the tensor: not 4-D ``[batch, heads, tokens, dim]``; key of another batch or dim than query;
    value of another batch, heads or tokens than key."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, tokens, dim], got shape {list(x.shape)}")
    if key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        raise ValueError(
            f"key must have query's batch and dim ({query.shape[0]}, {query.shape[3]}), got shape {list(key.shape)}"
        )
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"value must have key's batch, heads and tokens {list(key.shape[:3])}, got shape {list(value.shape)}"
        )


def _refuse_unknown(module, kwargs: dict) -> None:
    unknown = sorted(
        n for n, x in kwargs.items() if x is not None and n not in NEUTRAL_KEYWORDS and n not in HONOURED_KEYWORDS
    )
    if unknown:
        raise TypeError(
            f"mla_bridge attention: {type(module).__name__} passes the keyword(s) {', '.join(unknown)}, "
            f"unknown to mla_bridge: they may change the result, and handed to sdpa they would be dropped "
            f"too; load the model with attn_implementation='eager' (or the implementation its model "
            f"card names)"
        )


def _causal(module, kwargs: dict) -> bool:
    return bool(getattr(module, "is_causal", True)) and kwargs.get("is_causal") is not False


def _spelled_out(attention_mask, query, key, causal: bool):
    """``attention_mask``, or for ``None`` the boolean ``[1, 1, Q, K]`` mask sdpa means by it (``is_causal`` for Q > 1
    on a causal module: top-left aligned; else every key)."""
    if attention_mask is not None:
        return attention_mask
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
    return (mask.tril() if causal and q_len > 1 else mask)[None, None]


def _check_indices(indices, query, key) -> None:
    """TypeError / ValueError: ``indices`` not an integer tensor of shape ``[B, Q, k]`` (query's B and Q); on the CPU
    a pick below -1 or past key's K positions (on CUDA the caller's contract: checking would synchronize the host)."""
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a tensor (the top-k key positions per query), got {type(indices).__name__}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"indices must be an integer tensor (key positions), got {indices.dtype}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (b, q_len):
        raise ValueError(f"indices must be [{b}, {q_len}, k] (batch, queries, top-k), got {list(indices.shape)}")
    if indices.device.type == "cpu" and indices.numel():
        bad = (indices < -1) | (indices >= kv_len)
        if bool(bad.any()):
            r, q, j = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"indices[{r}, {q}, {j}] = {int(indices[r, q, j])} is not a key position (0 .. {kv_len - 1}, or -1 "
                f"for none)"
            )


def fold_indices(attention_mask, indices, query, key, causal: bool):
    """The mask with ``indices`` (int ``[B, Q, k]``: the key positions each query may see, checked by
    :func:`_check_indices`) folded in, as transformers folds them for eager / sdpa (``modeling_deepseek_v32.py``: a
    boolean mask ``& ~index_mask``, an additive one filled with the dtype's min); unchanged when ``k >= K`` (the
    top-k of K keys is every key). ``attention_mask``: transformers' mask (None, boolean or additive ``[B, 1, Q, K]``);
    ``query`` / ``key``: ``[B, H, Q, D]`` / ``[B, H, K, D]``. Returns the mask to hand to sdpa: boolean (True = may
    attend), or additive (the mask's dtype; keys not selected at ``query``'s dtype's min). Raises nothing."""
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if indices.shape[2] >= kv_len:
        return attention_mask
    idx = indices.long()
    idx = torch.where((idx >= 0) & (idx < kv_len), idx, kv_len)  # -1 (no key) into a column dropped below
    index_mask = torch.ones(b, q_len, kv_len + 1, dtype=torch.bool, device=indices.device).scatter(-1, idx, False)[
        :, None, :, :kv_len
    ]  # True = not selected
    mask = _spelled_out(attention_mask, query, key, causal)
    if mask.dtype == torch.bool:
        return mask & ~index_mask
    return mask.masked_fill(index_mask, torch.finfo(query.dtype).min)


def sparse_picks(attention_mask, indices: torch.Tensor, query, key, causal: bool) -> torch.Tensor:
    """``indices`` (int ``[B, Q, k]``, checked by :func:`_check_indices`) as int64 ``[B, Q, k]`` key positions with
    every pick the mask drops made -1: transformers' indexer takes the top-k of scores its mask set to -inf, so an
    early query (fewer than k keys it may see) or a padding query lists masked keys (later or padding positions),
    which eager / sdpa drop by folding the top-k into that mask. What is left is the set eager attends: the keys
    both listed and seen. ``attention_mask`` boolean ``[B or 1, 1, Q, K]`` or None (sdpa's causal, spelled out).
    A pick already -1 stays -1; one below -1 or past K (refused on the CPU by :func:`_check_indices`; on CUDA the
    caller's contract) is dropped."""
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    idx = indices.to(device=query.device, dtype=torch.int64)
    mask = _spelled_out(attention_mask, query, key, causal).expand(b, 1, q_len, kv_len)[:, 0]
    seen = mask.gather(-1, idx.clamp(0, kv_len - 1))
    return torch.where((idx >= 0) & (idx < kv_len) & seen, idx, -1)


def _serve_indices(module, query, key, value, attention_mask, indices, scaling, kwargs) -> torch.Tensor:
    """DSA's top-k served: :func:`mla_bridge.sparse_mha.sparse_attention_mha` over each batch row (``query[b]``,
    ``key[b]``, ``value[b]`` read in place as ``[L, H, D]`` views), the masked picks made -1 (:func:`sparse_picks`),
    sinks (``s_aux``) merged in from the LSE as on the dense path. Returns ``attn_output [B, Q, H, D_v]``; a query
    left with no key (padding) gets 0, as on the dense path."""
    b, h, q_len, d_qk = query.shape
    d_vo = value.shape[-1]
    picks = sparse_picks(attention_mask, indices, query, key, _causal(module, kwargs))
    sm_scale = float(scaling) if scaling is not None else d_qk**-0.5
    sinks = kwargs.get("s_aux")
    out = query.new_empty(b, q_len, h, d_vo)
    lse = None if sinks is None else torch.empty(b, q_len, h, dtype=torch.float32, device=query.device)
    for r in range(b):
        sparse_attention_mha(
            query[r].transpose(0, 1),
            key[r].transpose(0, 1),
            value[r].transpose(0, 1),
            picks[r],
            sm_scale,
            out=out[r],
            lse=None if lse is None else lse[r],
        )
    if sinks is not None:  # one more key per head, of logit s_aux and value 0 (as on the dense path)
        assert lse is not None
        merge_sinks_(out.view(b * q_len, h, d_vo), lse.view(b * q_len, h), sinks)
    return out


def _eager_keyword(module, kwargs: dict) -> Optional[str]:
    """The first keyword of the call that only the model's eager function honours, or None."""
    for name in _EAGER_KEYWORDS:
        x = kwargs.get(name)
        if x is not None and x is not False:
            return name
    return "output_attentions" if getattr(getattr(module, "config", None), "output_attentions", False) else None


def _hand_back(reason: str, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    needs_eager = _eager_keyword(module, kwargs)
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(
            "mla_bridge attention: %s is not served; handing the call to transformers' %s",
            reason,
            f"eager (for {needs_eager})" if needs_eager else "sdpa",
        )
    if needs_eager:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(
                f"mla_bridge attention: {reason} is not served and {needs_eager} needs eager "
                f"attention, but {type(module).__module__} has no eager_attention_forward; load "
                f"the model with attn_implementation='eager'"
            )
        attention_mask = _spelled_out(attention_mask, query, key, _causal(module, kwargs))
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min
            )
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


#: Why DSA's ``indices=`` are handed back on CUDA: the sparse MHA pass (:mod:`mla_bridge.sparse_mha`) is a torch path,
#: far slower there than transformers' sdpa over the top-k folded into the mask, which computes the same function
#: (``scripts/gpu/sparse_mha_vs_sdpa.py`` measures both; the figures are on the results page). On the CPU it is the
#: faster of the two and serves them.
INDICES_ON_CUDA = (
    "DSA indices= on CUDA: transformers' sdpa over the top-k folded into the mask is faster there than mla_bridge's "
    "sparse MHA pass (a torch path)"
)


def _ragged_layout(attention_mask, b: int, q_len: int, kv_len: int, device, layer_idx: Optional[int] = None):
    """``(q_rows, key_rows, q_lens, kv_lens, keys)`` of a servable mask, else None: ``q_rows`` / ``key_rows`` the
    ``(batch index, position)`` int64 index tensors of the valid queries / keys (device tensors, row-major: the
    packed ragged order), or both None when every query is real and the first ``keys`` keys of every row are the
    valid ones (then each batch row is read in place, :func:`mla_bridge_attention`).

    ``None`` (no mask) costs no device work. A mask costs one check and one device-to-host copy (and, padded, the
    index tensors); the layers of one forward get the same mask object, in the order of their ``layer_idx`` (the
    calling module's), so the result is kept for a call whose ``layer_idx`` is above the last one that took it (a
    later layer of the same forward; an unknown index, or one that does not grow, starts a forward and reads the
    mask, whatever the first MLA layer's index: a hybrid model's need not be 0) while that object lives, unmodified
    as far as torch counts (``_version``; an inference tensor keeps no count), and the call's batch, query and key
    lengths and device are the ones it was made for (a ``[1, 1, Q, K]`` mask broadcasts to any batch). So a mask
    changed in place where torch keeps no count (``.data``, an inference tensor) is read again by the next
    forward's first layer."""
    if attention_mask is None:
        keys = kv_len if q_len == 1 else min(q_len, kv_len)  # sdpa's is_causal: top-left aligned
        return None, None, (q_len,) * b, (keys,) * b, keys
    ref, key, cached, last_layer = _mask_cache
    version = -1 if attention_mask.is_inference() else attention_mask._version
    now = (version, b, q_len, kv_len, device)
    later_layer = isinstance(layer_idx, int) and isinstance(last_layer, int) and layer_idx > last_layer
    if later_layer and ref is not None and ref() is attention_mask and key == now:
        _mask_cache[:] = [ref, key, cached, layer_idx]
        return cached
    checked = _check_mask(attention_mask, b, q_len, kv_len)
    result = None
    if checked is not None:
        q_valid, key_valid, ok = checked
        host = torch.cat([ok.view(1).long(), q_valid.sum(1), key_valid.sum(1)]).cpu()  # the one host read
        if bool(host[0]):
            q_lens, kv_lens = tuple(host[1 : 1 + b].tolist()), tuple(host[1 + b :].tolist())
            if sum(q_lens) == b * q_len and sum(kv_lens) == b * kv_len:
                result = (None, None, q_lens, kv_lens, kv_len)
            else:
                result = (q_valid.nonzero(as_tuple=True), key_valid.nonzero(as_tuple=True), q_lens, kv_lens, kv_len)
    _mask_cache[:] = [weakref.ref(attention_mask), now, result, layer_idx]
    return result


def _plan(
    q_lens: tuple,
    kv_lens: tuple,
    heads: int,
    d_qk: int,
    d_vo: int,
    sm_scale: float,
    dtype,
    device,
    strides: Optional[tuple] = None,
):
    """The batch's causal plan from the plan cache the adapters share
    (:meth:`mla_bridge.plan_cache.PlanCache.get_ragged_lens`: keyed on everything it depends on, the ``(q, k, v)``
    strides it reads included; the layers of one forward find it by the last call's key, without re-making the
    indptrs). ``strides``: ``(q, k, v)``, each :func:`mla_bridge.checks.kernel_strides`; all None is as None
    (contiguous)."""
    return shared_plan_cache().get_ragged_lens(
        q_lens,
        kv_lens,
        num_heads=heads,
        head_dim_qk=d_qk,
        head_dim_vo=d_vo,
        causal=True,
        sm_scale=sm_scale,
        dtype=dtype,
        workspace=mla_bridge.workspace.default_workspace(device),
        strides=None if strides == (None, None, None) else strides,
    )


def mla_bridge_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function running :meth:`mla_bridge.RaggedPlan.run` (see the module docstring).

    Args:
        query ``[B, H, Q, D_qk]``, key ``[B, H, K, D_qk]``, value ``[B, H, K, D_v]``, attention_mask boolean
        ``[B, 1, Q, K]`` or ``None``, scaling (softmax scale; ``None`` means ``D_qk ** -0.5``).
        kwargs: the model's keywords (module docstring): ``indices`` int ``[B, Q, k]`` (served sparse, or folded
            into the mask and handed back),
            ``s_aux`` ``[H]`` sink logits (natural-log units of the scaled logits), the others served or handed back.

    Returns:
        ``(attn_output [B, Q, H, D_v] in query's dtype, None)``; transformers' sdpa / eager result when handed back.

    Raises:
        ValueError: query, key or value not 4-D; key of another batch or ``D_qk`` than query; value of another batch,
            heads or tokens than key (named), before any work.
        TypeError: a keyword that is neither known (:data:`NEUTRAL_KEYWORDS`, :data:`HONOURED_KEYWORDS`) nor None,
            named; ``indices`` not an integer tensor. ValueError: ``indices`` not ``[B, Q, k]``; on the CPU a pick
            below -1 or past K.
        NotImplementedError: a keyword only eager honours, on a call handed back, where the model's file has no
            ``eager_attention_forward``.
        the core's TypeError / ValueError (e.g. a dtype no backend serves), before any kernel runs.
    """
    _check_shapes(query, key, value)
    _refuse_unknown(module, kwargs)
    indices = kwargs.get("indices")
    if indices is not None:  # DSA's top-k
        _check_indices(indices, query, key)
        kwargs = {n: x for n, x in kwargs.items() if n != "indices"}
        if indices.shape[2] < key.shape[2]:  # a top-k that may leave keys out: served sparse, or folded and handed back
            reason = fallback_reason(module, query, key, attention_mask, dropout, kwargs, value)
            if reason is None and query.device.type == "cuda":
                reason = INDICES_ON_CUDA
            if reason is None:
                return _serve_indices(module, query, key, value, attention_mask, indices, scaling, kwargs), None
            folded = fold_indices(attention_mask, indices, query, key, _causal(module, kwargs))
            return _hand_back(reason, module, query, key, value, folded, scaling, dropout, kwargs)
    reason = fallback_reason(module, query, key, attention_mask, dropout, kwargs, value)
    b, h, q_len, d_qk = query.shape
    kv_len, d_vo = key.shape[2], value.shape[-1]
    layer_idx = getattr(module, "layer_idx", None)
    layout = None if reason else _ragged_layout(attention_mask, b, q_len, kv_len, query.device, layer_idx)
    if reason is None and layout is None:
        reason = (
            "an attention mask other than causal over each row's valid keys (right or inner padding, a custom or "
            "packed mask)"
        )
    if reason is not None:
        return _hand_back(reason, module, query, key, value, attention_mask, scaling, dropout, kwargs)

    assert layout is not None  # reason is None only where the layout was found
    q_rows, key_rows, q_lens, kv_lens, keys = layout
    sm_scale = float(scaling) if scaling is not None else d_qk**-0.5
    sinks = kwargs.get("s_aux")
    by_row = q_rows is None and (b == 1 or q_len >= _ROW_CALL_MIN_QUERIES)
    if by_row:  # every row real: each batch row read in place ([L, H, D] views), one plan of one request
        qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, L, H, D] views
        if keys < kv_len:
            kt, vt = kt[:, :keys], vt[:, :keys]
        rows = [(qt[r], kt[r], vt[r]) for r in range(b)]
        q_lens, kv_lens = (q_len,), (keys,)
    elif q_rows is None:  # a few queries per row (decode): one call over the rows packed ([B * len, H, D])
        q = query.transpose(1, 2).reshape(b * q_len, h, d_qk)
        k = key[:, :, :keys].transpose(1, 2).reshape(b * keys, h, d_qk)
        rows = [(q, k, value[:, :, :keys].transpose(1, 2).reshape(b * keys, h, d_vo))]
    else:  # padded: the valid rows only, gathered by index (made once per mask: no host sync here)
        rows = [(query.transpose(1, 2)[q_rows], key.transpose(1, 2)[key_rows], value.transpose(1, 2)[key_rows])]
    strides = tuple(map(kernel_strides, rows[0])) if rows else None
    plan = _plan(q_lens, kv_lens, h, d_qk, d_vo, sm_scale, query.dtype, query.device, strides)
    if by_row:
        full = query.new_empty(b, q_len, h, d_vo)
        lse = None if sinks is None else torch.empty(b, q_len, h, dtype=torch.float32, device=query.device)
        for r, (q, k, v) in enumerate(rows):
            plan.run(q, k, v, out=full[r], lse=None if lse is None else lse[r], return_lse=lse is not None)
        out = full.view(b * q_len, h, d_vo)
    elif sinks is None:
        out, lse = plan.run(*rows[0], return_lse=False), None
    else:
        out, lse = plan.run(*rows[0])
    if sinks is not None:  # one more key per head, of logit s_aux and value 0: a partial (out 0, LSE s_aux)
        assert lse is not None  # both routes fill an LSE where there are sinks
        merge_sinks_(out, lse.view(out.shape[:2]), sinks)
    if by_row:
        return full, None
    if q_rows is None:
        return out.view(b, q_len, h, d_vo), None
    full = out.new_zeros(b, q_len, h, d_vo)
    full[q_rows] = out
    return full, None
