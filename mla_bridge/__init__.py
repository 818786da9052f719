"""mla_bridge: MLA (DeepSeek-V2/V3) ragged prefill through FlashInfer, one core for PyTorch, vLLM and JAX.

Data flows one way: :class:`MLADims` -> :func:`select_backend` -> :class:`PrefillPlan` / :func:`plan_ragged`
-> :func:`mla_prefill` / :meth:`RaggedPlan.run` -> :func:`merge_attn_states`. LSEs are natural-log everywhere.
DeepSeek Sparse Attention: a plan built with ``index_topk`` and ``mla_prefill(..., topk_indices=)``
(:mod:`mla_bridge.sparse`); :func:`indexer_topk` is a reference indexer that makes such indices.
"""

from .cache import quantize_latent_cache
from .dims import MLADims
from .dispatch import BACKEND_NAMES, BackendChoice, select_backend
from .merge import merge_attn_states
from .plan import PrefillPlan
from .plan_cache import PlanCache
from .prefill import mla_prefill
from .indexer import IndexerWeights, indexer_topk
from .graphs import PrefillGraph, PrefillLayer, capture_prefill
from .ragged import RaggedPlan, plan_ragged, ragged_prefill
from .weights import PreparedKVBProj, prepare_kv_b_proj
from .workspace import Workspace, WorkspaceTooSmallError

__version__ = "0.1.0"

__all__ = [
    "MLADims",
    "BackendChoice",
    "BACKEND_NAMES",
    "select_backend",
    "Workspace",
    "WorkspaceTooSmallError",
    "RaggedPlan",
    "plan_ragged",
    "ragged_prefill",
    "merge_attn_states",
    "PrefillPlan",
    "PlanCache",
    "mla_prefill",
    "PreparedKVBProj",
    "prepare_kv_b_proj",
    "PrefillGraph",
    "PrefillLayer",
    "capture_prefill",
    "quantize_latent_cache",
    "IndexerWeights",
    "indexer_topk",
    "__version__",
]
