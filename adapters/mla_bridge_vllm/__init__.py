"""mla_bridge for vLLM: an out-of-tree MLA prefill backend in vLLM's ``CUSTOM`` slot.

Install ``mla-bridge[vllm]``; vLLM calls :func:`register` in every process through the ``vllm.general_plugins``
entry point ``mla_bridge``, and ``--attention-config.mla_prefill_backend CUSTOM`` selects the backend.

The backend class lives in :mod:`mla_bridge_vllm.backend` (imports vLLM); the kernel-calling part it uses,
:mod:`mla_bridge_vllm.plans`, imports only mla_bridge and torch.
"""

from __future__ import annotations

__all__ = ["register", "BACKEND_CLASS_PATH"]

#: What vLLM's registry resolves the CUSTOM slot to.
BACKEND_CLASS_PATH = "mla_bridge_vllm.backend.MLABridgePrefillBackend"


def register() -> None:
    """Put :class:`~mla_bridge_vllm.backend.MLABridgePrefillBackend` in vLLM's ``CUSTOM`` MLA prefill slot.

    Idempotent (vLLM may load plugins several times per process). Only the class path is recorded: the class,
    and with it vLLM's MLA modules, is imported when vLLM resolves the slot.
    """
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
        register_mla_prefill_backend,
    )

    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
