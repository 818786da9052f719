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
* Plans (:func:`mla_bridge.plan_ragged`) are reused while the lengths stay the same: every layer of one forward shares
  one plan. The mask is checked (one device-to-host copy) once per mask object, not per layer; no mask costs no
  device work.

Handed back to transformers (the reason is logged once per kind), never silently wrong:
inputs that require grad while autograd records (training with ``attention_dropout`` 0, DeepSeek's default: the
kernels have no backward, and their gradient would be lost) or that carry forward-mode tangents (``torch.func.jvp``),
``dropout > 0`` (training), a sliding window, softcap or attention sinks, packed sequences (``cu_seq_lens_*``),
``output_attentions`` (to ``eager``, the only implementation returning weights, with ``None`` turned into sdpa's
causal mask), fewer key/value heads than query heads (GQA), a non-causal module, a float (additive) mask, or any
boolean mask of another structure (right or inner padding, packed sequences, custom patterns): ``sdpa``.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Any, Optional

import torch

import mla_bridge
from mla_bridge.dispatch import ENV_VAR
from mla_bridge.inference import differentiated

__all__ = ["ATTN_IMPLEMENTATION", "mla_bridge_attention", "ragged_from_mask", "fallback_reason"]

#: The name :func:`mla_bridge_transformers.register` registers by default.
ATTN_IMPLEMENTATION = "mla_bridge"

logger = logging.getLogger("mla_bridge_transformers")
_warned: set[str] = set()
_plan_cache: dict[tuple, Any] = {}
# [weakref to the mask, (its _version, batch, q_len, kv_len, device), the layout _ragged_layout made from them]
_mask_cache: list = [None, None, None]


def ragged_from_mask(attention_mask: Optional[torch.Tensor], batch: int, q_len: int, kv_len: int,
                     device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
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
    m = attention_mask
    if m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or tuple(m.shape[2:]) != (q_len, kv_len):
        return None
    m = m.expand(batch, 1, q_len, kv_len)[:, 0]
    key_valid = m.any(dim=1)  # the keys some query sees
    seen = m.sum(dim=2)  # keys each query sees
    rank = key_valid.cumsum(dim=1)  # 1-based rank of a valid key among its row's valid keys
    prefixes = key_valid[:, None, :] & (rank[:, None, :] <= seen[:, :, None])
    q_valid = seen > 0
    # the non-padding queries see one key more each, the last all of the row's valid keys (bottom-right causal)
    want = q_valid.cumsum(dim=1) + (key_valid.sum(dim=1) - q_valid.sum(dim=1))[:, None]
    causal = torch.where(q_valid, seen == want, True)
    return (q_valid, key_valid) if torch.equal(m, prefixes) and bool(causal.all()) else None


def fallback_reason(module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float,
                    kwargs: dict, value: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why this call cannot run through mla_bridge (``None`` when it can), from everything but the mask's values."""
    found = differentiated((("query", query), ("key", key), ("value", value)))
    if found is not None:
        return ("autograd (inputs that require grad: mla_bridge's kernels have no backward)" if found[1] == "grad" else
                "forward-mode AD (inputs with tangents: mla_bridge's kernels have no derivative)")
    if dropout and dropout > 0:
        return f"dropout={dropout} (training)"
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        return "a sliding window"
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return f"{name}"
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
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool):
        return f"a {getattr(attention_mask, 'dtype', type(attention_mask).__name__)} mask (not the boolean sdpa mask)"
    return None


def _hand_back(reason: str, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("mla_bridge attention: %s is not served; handing the call to transformers' %s", reason,
                       "eager" if "output_attentions" in reason else "sdpa")
    if "output_attentions" in reason:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(f"mla_bridge attention: {reason} needs eager attention, and "
                                      f"{type(module).__module__} has no eager_attention_forward; load the model with "
                                      f"attn_implementation='eager'")
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is None and q_len > 1:  # sdpa's is_causal (top-left), which eager needs spelled out
            attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()[None, None]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _ragged_layout(attention_mask, b: int, q_len: int, kv_len: int, device):
    """``(q_valid, key_valid, q_lens, kv_lens, keys)`` of a servable mask, else None: ``q_valid`` / ``key_valid``
    bool ``[B, Q]`` / ``[B, K]``, or both None when every query is real and the first ``keys`` keys of every row are
    the valid ones (then q, k[:keys], v[:keys] are reshaped, not gathered).

    ``None`` (no mask) costs no device work. A mask costs one check and one device-to-host copy; the layers of one
    forward get the same mask object, so the result is kept while that object lives unmodified (``_version``) and
    the call's batch, query and key lengths and device are the ones it was made for (a ``[1, 1, Q, K]`` mask
    broadcasts to any batch)."""
    if attention_mask is None:
        keys = kv_len if q_len == 1 else min(q_len, kv_len)  # sdpa's is_causal: top-left aligned
        return None, None, (q_len,) * b, (keys,) * b, keys
    ref, key, cached = _mask_cache
    now = (attention_mask._version, b, q_len, kv_len, device)
    if ref is not None and ref() is attention_mask and key == now:
        return cached
    valid = ragged_from_mask(attention_mask, b, q_len, kv_len, device)
    if valid is None:
        result = None
    else:
        q_valid, key_valid = valid
        lens = torch.stack([q_valid.sum(1), key_valid.sum(1)]).cpu()
        q_lens, kv_lens = tuple(lens[0].tolist()), tuple(lens[1].tolist())
        dense = sum(q_lens) == b * q_len and sum(kv_lens) == b * kv_len
        result = (None, None, q_lens, kv_lens, kv_len) if dense else (q_valid, key_valid, q_lens, kv_lens, kv_len)
    _mask_cache[:] = [weakref.ref(attention_mask), now, result]
    return result


def _plan(q_lens: tuple, kv_lens: tuple, heads: int, d_qk: int, d_vo: int, sm_scale: float, dtype, device):
    """The batch's plan, kept while everything it depends on is equal: the lengths, sizes, scale, dtype, device, the
    backend asked for (``MLA_BRIDGE_BACKEND``, read now) and the workspace (by identity), as the core's
    :class:`mla_bridge.PlanCache` keys a plan (a :class:`mla_bridge.RaggedPlan` has no chunk budget to key)."""
    workspace = mla_bridge.workspace.default_workspace(device)
    key = (q_lens, kv_lens, heads, d_qk, d_vo, sm_scale, dtype, device, os.environ.get(ENV_VAR) or None,
           id(workspace))
    plan = _plan_cache.get(key)
    if plan is None:
        _plan_cache.clear()  # one live plan: the layers of one forward share it
        qo, kv = mla_bridge.ragged.indptr_from_lens(q_lens), mla_bridge.ragged.indptr_from_lens(kv_lens)
        plan = _plan_cache[key] = mla_bridge.plan_ragged(
            qo, kv, num_heads=heads, head_dim_qk=d_qk, head_dim_vo=d_vo, causal=True, sm_scale=sm_scale, dtype=dtype,
            workspace=workspace)
    return plan


def mla_bridge_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function running :meth:`mla_bridge.RaggedPlan.run` (see the module docstring).

    Args:
        query ``[B, H, Q, D_qk]``, key ``[B, H, K, D_qk]``, value ``[B, H, K, D_v]``, attention_mask boolean
        ``[B, 1, Q, K]`` or ``None``, scaling (softmax scale; ``None`` means ``D_qk ** -0.5``).

    Returns:
        ``(attn_output [B, Q, H, D_v] in query's dtype, None)``; transformers' sdpa / eager result when handed back.

    Raises:
        the core's TypeError / ValueError (e.g. a dtype no backend serves), before any kernel runs.
    """
    reason = fallback_reason(module, query, key, attention_mask, dropout, kwargs, value)
    b, h, q_len, d_qk = query.shape
    kv_len, d_vo = key.shape[2], value.shape[-1]
    layout = None if reason else _ragged_layout(attention_mask, b, q_len, kv_len, query.device)
    if reason is None and layout is None:
        reason = ("an attention mask other than causal over each row's valid keys (right or inner padding, a custom "
                  "or packed mask)")
    if reason is not None:
        return _hand_back(reason, module, query, key, value, attention_mask, scaling, dropout, kwargs)

    q_valid, key_valid, q_lens, kv_lens, keys = layout
    sm_scale = float(scaling) if scaling is not None else d_qk ** -0.5
    dense = key_valid is None
    qt, kt, vt = query.transpose(1, 2), key[:, :, :keys].transpose(1, 2), value[:, :, :keys].transpose(1, 2)
    if dense:  # [B, len, H, D] -> [B * len, H, D]: views where transformers' layout allows, else one copy
        q, k, v = qt.reshape(b * q_len, h, d_qk), kt.reshape(b * keys, h, d_qk), vt.reshape(b * keys, h, d_vo)
    else:
        q, k, v = qt[q_valid], kt[key_valid], vt[key_valid]
    plan = _plan(q_lens, kv_lens, h, d_qk, d_vo, sm_scale, query.dtype, query.device)
    out, _ = plan.run(q, k, v)
    if dense:
        return out.view(b, q_len, h, d_vo), None
    full = out.new_zeros(b, q_len, h, d_vo)
    full[q_valid] = out
    return full, None
