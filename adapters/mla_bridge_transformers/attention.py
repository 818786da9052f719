"""The attention function transformers calls: ``fn(module, query, key, value, attention_mask, scaling, dropout,
**kwargs) -> (attn_output, attn_weights)`` (transformers 5, ``integrations/sdpa_attention.py`` and the models'
``eager_attention_forward``), with ``query [B, H, Q, D_qk]``, ``key [B, H_kv, K, D_qk]``, ``value [B, H_kv, K, D_v]``
and ``attn_output [B, Q, H, D_v]``. DeepSeek-V2/V3 (transformers 5.24, ``modeling_deepseek_v2/v3.py``) call it with
the latents already up-projected (``expand_kv``): D_qk 192, D_v 128, H_kv == H; v is not padded to 192.

Conversion (no attention math here):

* The mask is transformers' ``sdpa_mask`` (registered with the function): boolean, True = may attend, or ``None``.
  It is served when it is exactly "key padding + causal, bottom-right aligned": key ``j`` visible to query ``i`` iff
  key ``j`` is not padding and ``j <= i + K - Q`` (the new tokens are the last Q of transformers' cache; a
  continuation over its KV cache has Q < K). ``None`` means no padding and causal (transformers passes it only when
  Q == K or Q == 1). Each batch row becomes one ragged request holding its non-padding keys and the queries at
  non-padding positions, so the causal mask among them is bottom-right aligned on the packed request; padding may be
  left, right or anywhere. Rows of padding tokens get output 0 (eager gives them an arbitrary average).
* Plans (:func:`mla_bridge.plan_ragged`) are reused while the lengths stay the same: every layer of one forward shares
  one plan. The mask is checked (one device-to-host copy) once per mask object, not per layer; no mask costs no
  device work.

Handed back to transformers (the reason is logged once per kind), never silently wrong:
``dropout > 0`` (training), a sliding window, softcap or attention sinks, packed sequences (``cu_seq_lens_*``), ``output_attentions`` (to ``eager``, the
only implementation returning weights), fewer key/value heads than query heads (GQA), a non-causal module, a float
(additive) mask, or any boolean mask of another structure (packed sequences, custom patterns): ``sdpa``.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Optional

import torch

import mla_bridge

__all__ = ["ATTN_IMPLEMENTATION", "mla_bridge_attention", "ragged_from_mask", "fallback_reason"]

#: The name :func:`mla_bridge_transformers.register` registers by default.
ATTN_IMPLEMENTATION = "mla_bridge"

logger = logging.getLogger("mla_bridge_transformers")
_warned: set[str] = set()
_plan_cache: dict[tuple, Any] = {}
_mask_cache: list = [None, None, None]  # [weakref to the mask, its _version, (key_valid, q_lens, kv_lens)]


def ragged_from_mask(attention_mask: Optional[torch.Tensor], batch: int, q_len: int, kv_len: int,
                     device: torch.device) -> Optional[torch.Tensor]:
    """The non-padding keys ``[B, K]`` (bool) of a "key padding + bottom-right causal" mask, or ``None`` when
    ``attention_mask`` has another structure.

    Args:
        attention_mask: boolean ``[B, 1, Q, K]`` (True = may attend) or ``None`` (no padding, causal).
    """
    if attention_mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    m = attention_mask
    if m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or tuple(m.shape[2:]) != (q_len, kv_len):
        return None
    m = m.expand(batch, 1, q_len, kv_len)[:, 0]
    key_valid = m[:, -1, :]
    i = torch.arange(q_len, device=m.device).view(-1, 1)
    j = torch.arange(kv_len, device=m.device).view(1, -1)
    expected = key_valid[:, None, :] & (j <= i + (kv_len - q_len))[None]
    return key_valid if torch.equal(m, expected) else None


def fallback_reason(module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float,
                    kwargs: dict) -> Optional[str]:
    """Why this call cannot run through mla_bridge (``None`` when it can), from everything but the mask's values."""
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
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _ragged_layout(attention_mask, b: int, q_len: int, kv_len: int, device):
    """``(key_valid [B, K] bool or None when nothing is padding, q_lens, kv_lens)`` of a servable mask, else None.

    ``None`` (no mask) costs no device work. A mask costs one check and one device-to-host copy; the layers of one
    forward get the same mask object, so the result is kept while that object lives unmodified (``_version``)."""
    if attention_mask is None:
        return None, (q_len,) * b, (kv_len,) * b
    ref, version, cached = _mask_cache
    if ref is not None and ref() is attention_mask and version == attention_mask._version:
        return cached
    key_valid = ragged_from_mask(attention_mask, b, q_len, kv_len, device)
    if key_valid is None:
        result = None
    else:
        lens = torch.stack([key_valid[:, kv_len - q_len:].sum(1), key_valid.sum(1)]).cpu()
        q_lens, kv_lens = tuple(lens[0].tolist()), tuple(lens[1].tolist())
        result = (None if sum(kv_lens) == b * kv_len else key_valid), q_lens, kv_lens
    _mask_cache[:] = [weakref.ref(attention_mask), attention_mask._version, result]
    return result


def _plan(q_lens: tuple, kv_lens: tuple, heads: int, d_qk: int, d_vo: int, sm_scale: float, dtype, device):
    key = (q_lens, kv_lens, heads, d_qk, d_vo, sm_scale, dtype, device)
    plan = _plan_cache.get(key)
    if plan is None:
        _plan_cache.clear()  # one live plan: the layers of one forward share it
        qo, kv = mla_bridge.ragged.indptr_from_lens(q_lens), mla_bridge.ragged.indptr_from_lens(kv_lens)
        plan = _plan_cache[key] = mla_bridge.plan_ragged(
            qo, kv, num_heads=heads, head_dim_qk=d_qk, head_dim_vo=d_vo, causal=True, sm_scale=sm_scale, dtype=dtype,
            workspace=mla_bridge.workspace.default_workspace(device))
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
    reason = fallback_reason(module, query, key, attention_mask, dropout, kwargs)
    b, h, q_len, d_qk = query.shape
    kv_len, d_vo = key.shape[2], value.shape[-1]
    layout = None if reason else _ragged_layout(attention_mask, b, q_len, kv_len, query.device)
    if reason is None and layout is None:
        reason = "an attention mask other than key padding + causal (custom or packed)"
    if reason is not None:
        return _hand_back(reason, module, query, key, value, attention_mask, scaling, dropout, kwargs)

    key_valid, q_lens, kv_lens = layout
    sm_scale = float(scaling) if scaling is not None else d_qk ** -0.5
    q_valid = None if key_valid is None else key_valid[:, kv_len - q_len:]
    all_valid = key_valid is None
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, len, H, D]
    if all_valid:
        q, k, v = qt.reshape(b * q_len, h, d_qk), kt.reshape(b * kv_len, h, d_qk), vt.reshape(b * kv_len, h, d_vo)
    else:
        q, k, v = qt[q_valid], kt[key_valid], vt[key_valid]
    plan = _plan(q_lens, kv_lens, h, d_qk, d_vo, sm_scale, query.dtype, query.device)
    out, _ = plan.run(q, k, v)
    if all_valid:
        return out.view(b, q_len, h, d_vo), None
    full = out.new_zeros(b, q_len, h, d_vo)
    full[q_valid] = out
    return full, None
