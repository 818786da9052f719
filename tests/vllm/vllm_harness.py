"""Drives vLLM's own MLA prefill path on the CPU, with the prefill kernel class of our choosing.

What is real vLLM code here (vLLM >= 0.29, run with ``VLLM_TARGET_DEVICE=cpu``):

* the config: ``VllmConfig`` / ``ModelConfig`` read from a tiny DeepSeek-V2 ``config.json`` written to disk
  (DeepSeek's MLA sizes: kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; 4 heads), with
  ``AttentionConfig(backend="CPU_MLA", mla_prefill_backend="custom")``: vLLM's CPU platform would pick its AMX MLA
  attention backend (``AMX_MLA``, compiled CPU ops that the lean install lacks) whenever
  ``torch.cpu._is_amx_tile_supported()`` is True, so the reference ``CPU_MLA`` backend is named to make the suite
  mean the same on every x86 CPU (``test_cpu_attention_backend.py`` runs this set-up with AMX forced both ways);
* the layer: ``MLAAttention`` with a real ``ColumnParallelLinear`` ``kv_b_proj`` (tensor parallel size 1 over gloo),
  which asks vLLM's selector (``get_mla_prefill_backend``) for its prefill class and builds its CPU impl;
* the metadata: the CPU MLA backend's ``MLACommonMetadataBuilder.build`` on a ``CommonAttentionMetadata``, which
  packs the context into ``ContextChunk``s and calls the prefill backend's ``prepare_metadata``;
* the forward: ``MLAAttention.forward_impl`` -> ``forward_mha`` (up-projection of the new tokens, the new-token
  pass) -> ``_compute_prefill_context`` (gather of each chunk from the paged latent cache, up-projection, the chunk
  pass, ``accumulate_mla_context_chunk``) -> ``merge_attn_states``.

Two things are set by the harness, not by vLLM: the context-chunk workspace is shrunk to 64 tokens
(``determine_chunked_prefill_workspace_size``) so a small batch spans several chunks, and, because vLLM's CPU
platform always auto-selects its own prefill class, the CPU registry slot is pointed at the class under test while
a layer is built (``register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, ...)``), then restored.
The paged cache is filled directly (the cache-write kernel is not part of the prefill path).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Sequence
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    MLAAttention,
    MLACommonMetadataBuilder,
)
from vllm.model_executor.layers.linear import ColumnParallelLinear  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla.prefill import registry, selector  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

import mla_bridge_vllm  # noqa: E402

#: vLLM 0.28 has the prefill kernel API but no CPU MLA prefill path (no CPU registry slot, no CPU context gather).
HAS_CPU_MLA_PREFILL = "CPU" in registry.MLAPrefillBackendEnum.__members__

HEADS, RANK, NOPE, ROPE, VDIM = 4, 512, 128, 64, 128
SCALE = (NOPE + ROPE) ** -0.5
BLOCK = 16
WORKSPACE_TOKENS = 64
ADAPTER = mla_bridge_vllm.BACKEND_CLASS_PATH
VLLM_CPU = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa.CPUSDPAMLAPrefillBackend"
#: vLLM's reference CPU MLA attention backend (decode kernel + the shared MLA prefill scaffolding), named explicitly
#: so that an AMX CPU does not get ``AMX_MLA``; vLLM releases without it have no AMX choice to avoid either.
CPU_MLA = "CPU_MLA" if "CPU_MLA" in AttentionBackendEnum.__members__ else None

# Chunks with a 64-token workspace and 16-token blocks: [req 0 (20), req 1 (30)], [req 3 tokens 0-63],
# [req 3 tokens 64-99 (a continuation), req 4 (10)]; requests 2 and 5 have no context.
QUERY_LENS = (5, 3, 4, 6, 3, 2)
CONTEXT_LENS = (20, 30, 0, 100, 10, 0)

_CONFIGS: dict[torch.dtype, VllmConfig] = {}
_LAYER_COUNT = [0]


def _model_dir() -> str:
    path = tempfile.mkdtemp(prefix="mla_bridge_vllm_model_")
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "kv_lora_rank": RANK,
        "q_lora_rank": None,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": VDIM,
        "vocab_size": 128,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _init_distributed(vc: VllmConfig) -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)


def vllm_config(dtype: torch.dtype) -> VllmConfig:
    """One VllmConfig per dtype for the whole session (layers register themselves in it by unique name)."""
    vc = _CONFIGS.get(dtype)
    if vc is None:
        vc = VllmConfig(
            model_config=ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype=dtype, max_model_len=1024),
            cache_config=CacheConfig(block_size=BLOCK),
            attention_config=AttentionConfig(mla_prefill_backend="custom", **({"backend": CPU_MLA} if CPU_MLA else {})),
        )
        _init_distributed(vc)
        _CONFIGS[dtype] = vc
    return vc


@dataclass
class Batch:
    """One all-prefill batch: new tokens' q / kv_c_normed / k_pe, kv_b_proj's weight, and a paged latent cache
    holding each request's context (blocks in random order; unused slots are NaN so a wrong read shows)."""

    dtype: torch.dtype
    query_lens: Sequence[int]
    context_lens: Sequence[int]
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor  # [T, 1, rope], as DeepSeek's attention module hands it over
    w: torch.Tensor
    cache: torch.Tensor
    block_table: torch.Tensor
    context: list = field(default_factory=list)  # per request [context_len, 576], unpaged

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def common_metadata(self) -> CommonAttentionMetadata:
        qsl = torch.tensor([0] + torch.tensor(list(self.query_lens)).cumsum(0).tolist(), dtype=torch.int32)
        seq = torch.tensor([a + b for a, b in zip(self.query_lens, self.context_lens)], dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.clone(),
            seq_lens=seq,
            num_reqs=len(self.query_lens),
            num_actual_tokens=self.num_tokens,
            max_query_len=max(self.query_lens),
            max_seq_len=int(seq.max()),
            block_table_tensor=self.block_table,
            slot_mapping=torch.zeros(self.num_tokens, dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq.clone(),
        )


def make_batch(
    dtype: torch.dtype,
    query_lens: Sequence[int] = QUERY_LENS,
    context_lens: Sequence[int] = CONTEXT_LENS,
    seed: int = 0,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    blocks = [-(-c // BLOCK) for c in context_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"), dtype=dtype)
    table = torch.zeros(len(query_lens), max(blocks) + 2, dtype=torch.int32)
    context = [torch.randn(c, RANK + ROPE, generator=g).to(dtype) for c in context_lens]
    nxt = 0
    for r, c in enumerate(context_lens):
        for b in range(blocks[r]):
            table[r, b] = order[nxt]
            nxt += 1
            n = min(BLOCK, c - b * BLOCK)
            cache[table[r, b], :n] = context[r][b * BLOCK : b * BLOCK + n]
    w = (torch.randn(HEADS * (NOPE + VDIM), RANK, generator=g) * RANK**-0.5).to(dtype)
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=g).to(dtype)
    kv_c = torch.randn(t, RANK, generator=g).to(dtype)
    k_pe = torch.randn(t, 1, ROPE, generator=g).to(dtype)
    return Batch(dtype, list(query_lens), list(context_lens), q, kv_c, k_pe, w, cache, table, context)


def make_layer(dtype: torch.dtype, w: torch.Tensor, prefill_class_path: str = ADAPTER) -> MLAAttention:
    """A real MLAAttention whose prefill class vLLM's selector resolves to ``prefill_class_path``."""
    vc = vllm_config(dtype)
    _LAYER_COUNT[0] += 1
    prefix = f"model.layers.{_LAYER_COUNT[0]}.self_attn.attn"
    cpu_slot = registry.MLAPrefillBackendEnum.CPU
    had_override = cpu_slot.is_overridden()
    previous = cpu_slot.get_path()
    registry.register_mla_prefill_backend(cpu_slot, prefill_class_path)
    selector._auto_select_mla_prefill_backend.cache_clear()
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with set_current_vllm_config(vc):
            kv_b_proj = ColumnParallelLinear(
                RANK,
                HEADS * (NOPE + VDIM),
                bias=False,
                params_dtype=dtype,
                prefix=prefix.replace(".attn", ".kv_b_proj"),
            )
            layer = MLAAttention(
                num_heads=HEADS,
                scale=SCALE,
                qk_nope_head_dim=NOPE,
                qk_rope_head_dim=ROPE,
                v_head_dim=VDIM,
                q_lora_rank=None,
                kv_lora_rank=RANK,
                kv_b_proj=kv_b_proj,
                cache_config=vc.cache_config,
                prefix=prefix,
            )
            with torch.no_grad():
                kv_b_proj.weight.copy_(w)
            kv_b_proj.quant_method.process_weights_after_loading(kv_b_proj)
            layer.process_weights_after_loading(dtype)
    finally:
        torch.set_default_dtype(default_dtype)
        if had_override:
            registry.register_mla_prefill_backend(cpu_slot, previous)
        else:
            cpu_slot.clear_override()
        selector._auto_select_mla_prefill_backend.cache_clear()
    return layer


@dataclass
class Step:
    """One scheduler step's metadata (built by vLLM) and the builder's own prefill backend instance."""

    layer: MLAAttention
    metadata: object
    backend: object  # the builder's clone; prepare_metadata ran on it


def build_step(layer: MLAAttention, batch: Batch, workspace_tokens: int = WORKSPACE_TOKENS) -> Step:
    vc = vllm_config(batch.dtype)
    spec = layer.get_kv_cache_spec(vc)
    with (
        set_current_vllm_config(vc),
        mock.patch.object(
            MLACommonMetadataBuilder,
            "determine_chunked_prefill_workspace_size",
            staticmethod(lambda _config: workspace_tokens),
        ),
    ):
        builder = layer.attn_backend.get_builder_cls()(spec, [layer.layer_name], vc, torch.device("cpu"))
        metadata = builder.build(0, batch.common_metadata())
    return Step(layer, metadata, builder._prefill_backend)


def forward(step: Step, batch: Batch, layer: Optional[MLAAttention] = None) -> torch.Tensor:
    """``MLAAttention.forward_impl`` on the batch: out ``[T, H, v_head_dim]``."""
    layer = layer or step.layer
    out = torch.empty(batch.num_tokens, HEADS * VDIM, dtype=batch.dtype)
    with set_current_vllm_config(vllm_config(batch.dtype)):
        layer.forward_impl(batch.q, batch.kv_c, batch.k_pe, batch.cache, step.metadata, output=out)
    return out.view(batch.num_tokens, HEADS, VDIM)


def reference(batch: Batch) -> torch.Tensor:
    """Full-sequence SDPA in float64 (what vLLM's own MLA test compares against): each request's new tokens over
    its context (all visible) and its new tokens (causal), k/v up-projected from the unpaged latents."""
    w = batch.w.double()
    out = torch.zeros(batch.num_tokens, HEADS, VDIM, dtype=torch.float64)
    start = 0
    for n, c, ctx in zip(batch.query_lens, batch.context_lens, batch.context):
        new = torch.cat([batch.kv_c[start : start + n], batch.k_pe[start : start + n, 0]], dim=-1)
        latent = torch.cat([ctx, new]).double()
        kv = (latent[:, :RANK] @ w.t()).view(-1, HEADS, NOPE + VDIM)
        k = torch.cat([kv[..., :NOPE], latent[:, RANK:].unsqueeze(1).expand(-1, HEADS, -1)], dim=-1)
        v = kv[..., NOPE:]
        mask = torch.ones(n, c + n, dtype=torch.bool)
        mask[:, c:] = torch.ones(n, n, dtype=torch.bool).tril()
        q = batch.q[start : start + n].double()
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE
        )
        out[start : start + n] = o.transpose(0, 1)
        start += n
    return out


def ragged_lse_reference(
    q: torch.Tensor, k: torch.Tensor, qo: Sequence[int], kv: Sequence[int], causal: bool
) -> torch.Tensor:
    """Natural-log LSE ``[H, T]`` in float64 of a ragged batch (bottom-right causal when ``causal``)."""
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for r in range(len(qo) - 1):
        qa, qb, ka, kb = int(qo[r]), int(qo[r + 1]), int(kv[r]), int(kv[r + 1])
        if qb == qa or kb == ka:
            continue
        s = torch.einsum("qhd,khd->hqk", q[qa:qb].double(), k[ka:kb].double()) * SCALE
        if causal:
            keep = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril(diagonal=(kb - ka) - (qb - qa))
            s = s.masked_fill(~keep, float("-inf"))
        lse[:, qa:qb] = torch.logsumexp(s, dim=-1)
    return lse


def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")
