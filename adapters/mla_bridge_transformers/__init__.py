"""mla_bridge as a Hugging Face transformers attention function (transformers 5's ``AttentionInterface``).

::

    import mla_bridge_transformers
    mla_bridge_transformers.register()                       # once per process; returns "mla_bridge"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mla_bridge", dtype=torch.bfloat16)

A DeepSeek-V2/V3 model (or any multi-head causal decoder) then runs its attention through :func:`mla_bridge.ragged_prefill`
(FlashInfer on the GPU, the torch backend on the CPU): the padded batch becomes packed ragged requests, and a
continuation over transformers' own KV cache (queries shorter than keys) runs bottom-right causal. DSA models'
top-k ``indices`` are served by a sparse attention over each query's picks (:mod:`mla_bridge.sparse_mha`), and
per-head attention sinks (``s_aux``) are merged in as a partial. What it cannot serve is handed back to transformers'
``sdpa``, or to the model's own ``eager`` for what only eager honours (attention weights, sinks, softcap); an unknown
keyword is refused by name: see :mod:`mla_bridge_transformers.attention`. Converts and delegates: no attention math
of its own.
"""

from __future__ import annotations

from .attention import ATTN_IMPLEMENTATION, fallback_reason, mla_bridge_attention, ragged_from_mask

__all__ = ["register", "ATTN_IMPLEMENTATION", "mla_bridge_attention", "ragged_from_mask", "fallback_reason"]


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`mla_bridge_attention` in transformers' ``AttentionInterface`` under ``name``, with
    transformers' ``sdpa_mask`` as its mask function (``AttentionMaskInterface``: boolean ``[B, 1, Q, K]`` masks, or
    ``None`` for a plain causal batch). Idempotent. Returns ``name``, for ``attn_implementation=``.

    Raises:
        ImportError: transformers < 5 (no ``AttentionMaskInterface``) or not installed.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, mla_bridge_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
