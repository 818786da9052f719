"""What a ``mla-bridge prefill`` run needs in memory, estimated before anything is allocated, and what is free.

:func:`estimate_run_memory` adds up, per place (the device, and on a GPU run also the host, where the inputs are
made in float32 first): the inputs (q, kv_c, k_pe, kv_b_proj weight, block_table), the paged latent cache, the plan's
per-token index tensors (device memory; on the CPU that is host memory made while the plan is built), the layer
outputs the command holds, and the largest of the transient peaks: :func:`mla_bridge.prefill.prefill_memory_bytes` of the plan
(plus the torch backend's float32 temporaries), the float64 check of the largest sampled request, and staging the
cache in float32. A sparse run (``--index-topk``) holds its ``[T, K]`` int32 indices too, and its transient peaks
are the sparse pass's (:func:`mla_bridge.cli.indices.sparse_pass_bytes`) and making the indices (the reference
indexer's scores, or the random picks': :func:`mla_bridge.cli.indices.indices_bytes`); the indexer's weights and
inputs are drawn in float32 on the host, one tensor at a time, like the prefill inputs. Called once without a plan (before the plan is built, whose index tensors are themselves
allocations) and once with it. :func:`check_fits` compares the totals with :func:`available_bytes` and refuses a run
that cannot fit with :class:`CLIError` (exit 2), unless ``--no-memory-check``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .errors import CLIError

__all__ = ["MemoryEstimate", "estimate_run_memory", "available_bytes", "check_fits", "MEMORY_FLAG"]

MEMORY_FLAG = "--no-memory-check"
_F32, _F64, _I64 = 4, 8, 8
#: float64 scores the reference check holds at once (mla_bridge.reference._SCORE_ELEMS), and its copies of them.
_REF_SCORE_BYTES = 3 * (1 << 25) * _F64
#: float32 temporaries of the torch backend besides each request's output: a few blocks of 2**22 scores.
_TORCH_BLOCK_BYTES = 6 * (1 << 22) * _F32


@dataclass
class MemoryEstimate:
    """Bytes a run needs, per place (``"device"``, and ``"host"`` for a GPU run): ``held[place]`` are the parts
    held together (name -> bytes), ``peaks[place]`` the transient peaks (name -> bytes), of which the largest
    counts. ``total(place) = sum(held) + max(peaks)``."""

    device_type: str
    held: dict = field(default_factory=dict)
    peaks: dict = field(default_factory=dict)

    def places(self) -> list[str]:
        return list(dict.fromkeys(list(self.held) + list(self.peaks)))

    def total(self, place: str) -> int:
        return sum(self.held.get(place, {}).values()) + max(self.peaks.get(place, {}).values(), default=0)

    def text(self, place: str) -> str:
        parts = [f"{name} {_gib(b)}" for name, b in self.held.get(place, {}).items() if b]
        peaks = {n: b for n, b in self.peaks.get(place, {}).items() if b}
        if peaks:
            name = max(peaks, key=peaks.get)  # type: ignore[arg-type]  # get of its own keys: never None
            parts.append(f"peak of {name} {_gib(peaks[name])}")
        return ", ".join(parts)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _plan_index_bytes(plan) -> int:
    """Bytes of the plan's per-token index tensors (fused: context and new-token placements; chunked: none, the
    gathers read each chunk's kv_indptr, and a chunk's per-call indices are in :func:`mla_bridge.prefill.prefill_memory_bytes`)."""
    tensors = [plan.ctx_req_ids, plan.ctx_positions, plan.ctx_dst, plan.new_dst]
    for c in plan.chunks:
        tensors += list(c.rows.indices or ())  # None for a plan's chunks (a hand-made ContextChunk may hold some)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def estimate_run_memory(
    dims,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_size: int,
    dtype,
    device,
    check_requests: Sequence[int],
    plan=None,
    plans_held: int = 2,
    sparse: Optional[dict] = None,
) -> MemoryEstimate:
    """Estimate the memory a ``mla-bridge prefill`` run needs (see the module docstring), in bytes.

    Args:
        dims: the layer's :class:`mla_bridge.MLADims`.
        query_lens, context_lens: tokens per request.
        block_size: tokens per cache block (the cache has ``sum(ceil(context / block_size)) + 1`` blocks).
        dtype: the run's torch dtype; device: the run's torch device.
        check_requests: request ids the float64 check recomputes.
        plan: the :class:`mla_bridge.PrefillPlan` once built (then its schedule's peak and its index tensors are
            counted exactly); without it the index tensors are bounded by the fused schedule's 24 bytes per context
            token and 8 per new token, and the prefill peak is left out.
        plans_held: plans alive at once (the command builds a second one to time planning again).
        sparse: for ``--index-topk``: ``index_topk``, ``source`` ("indexer" or "random") and the indexer's ``shape``
            (:func:`mla_bridge.cli.indices.indexer_shape`; None for random picks); None for a dense run.
    """
    import torch

    e = torch.empty((), dtype=dtype).element_size()
    h, r, rope, lat = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, dims.latent_dim
    t, ctx = sum(query_lens), sum(context_lens)
    blocks = sum(-(-c // block_size) for c in context_lens) + 1
    cache_elems = blocks * block_size * lat
    weight_elems = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim) * r
    input_elems = t * h * dims.head_dim_qk + t * r + t * rope + weight_elems
    out_bytes = t * h * (dims.v_head_dim * e + _F32)  # out and its float32 lse
    on_gpu = torch.device(device).type == "cuda"

    est = MemoryEstimate(torch.device(device).type)
    dev = est.held.setdefault("device", {})
    dev["inputs"] = (
        input_elems * e + len(query_lens) * max(1, max((-(-c // block_size) for c in context_lens), default=1)) * 4
    )
    dev["paged cache"] = cache_elems * e
    if plan is not None and plan.kv_cache_dtype != plan.dtype:  # --kv-cache-dtype fp8: the 1-byte copy beside it
        dev["FP8 paged cache"] = cache_elems  # (the unquantized one is kept for the quantization error)
    index = _plan_index_bytes(plan) if plan is not None else 24 * ctx + 8 * t
    dev["plan index tensors"] = plans_held * index
    dev["layer outputs"] = 2 * out_bytes  # the timed layer's and the instrumented layer's
    peaks = est.peaks.setdefault("device", {})
    if sparse is not None:
        from .indices import indices_bytes, sparse_pass_bytes

        dev["topk_indices"] = t * sparse["index_topk"] * 4
        peaks["making topk_indices"] = indices_bytes(
            query_lens, context_lens, sparse["index_topk"], sparse["source"], sparse["shape"], e
        )
        if plan is not None:
            fused = plan.sparse_latent_meta is not None
            rows = plan.ctx_dst.numel() + plan.new_dst.numel() if fused else 0
            peaks["mla_prefill"] = sparse_pass_bytes(dims, t, sparse["index_topk"], e, latent_rows=rows)
    if plan is not None and sparse is None:
        from ..prefill import prefill_memory_bytes

        peak = prefill_memory_bytes(plan)
        if plan.backend.name == "torch":  # per-request float32 output and score blocks
            peak += max(query_lens, default=0) * h * dims.v_head_dim * _F32 + _TORCH_BLOCK_BYTES
        peaks["mla_prefill"] = peak
    if plan is not None and plan.kv_cache_dtype != plan.dtype:  # quantize_latent_cache: float32, quotient, bytes
        peaks["quantizing the cache"] = cache_elems * (2 * _F32 + 1)
    if check_requests:
        worst = max(check_requests, key=lambda i: (context_lens[i] + query_lens[i], query_lens[i]))
        lq, s = query_lens[worst], context_lens[worst] + query_lens[worst]
        # float64 q and out, the sequence's latent (+ the gathered copy), its up-projection and k.
        peaks["float64 check"] = _F64 * (
            lq * h * (dims.head_dim_qk + dims.v_head_dim)
            + s * (2 * lat + h * (dims.qk_nope_head_dim + dims.v_head_dim) + h * dims.head_dim_qk)
        ) + min(_REF_SCORE_BYTES, 3 * _F64 * h * lq * s)
    # The inputs are drawn in float32 on the host, then converted / moved: the cache is the big one.
    staging = cache_elems * _F32 + max(t * h * dims.head_dim_qk, weight_elems) * _F32
    if sparse is not None and sparse["source"] == "indexer":  # later, one tensor at a time: a weight or an input
        shape, longest = sparse["shape"], max((q + c for q, c in zip(query_lens, context_lens)), default=0)
        widest = max(shape["hidden_size"], shape["q_lora_rank"])
        heads_by_rank = shape["index_n_heads"] * shape["index_head_dim"] * shape["q_lora_rank"]
        staging = max(staging, max(longest * widest, heads_by_rank) * _F32)
    if on_gpu:
        est.held["host"] = {"inputs staged in float32": staging}
    elif dtype != torch.float32:
        peaks["inputs staged in float32"] = staging
    return est


def _cgroup_free() -> Optional[int]:
    """Bytes left under this process's cgroup v2 memory limit, or None where there is none."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            rel = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if rel is None:
            return None
        base = "/sys/fs/cgroup" + rel.rstrip("/")
        with open(base + "/memory.max", encoding="utf-8") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(base + "/memory.current", encoding="utf-8") as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError, IndexError):
        return None


def available_bytes(place: str, device) -> tuple[Optional[int], str]:
    """``(bytes free, where the number comes from)`` for ``"host"`` (``MemAvailable`` of ``/proc/meminfo``, capped by
    a cgroup v2 limit) or ``"device"`` (the host for a CPU run; ``torch.cuda.mem_get_info`` on a GPU). ``None`` when
    it cannot be told (then nothing is refused)."""
    import torch

    free: Optional[int]
    if place == "device" and torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free on {device} (torch.cuda.mem_get_info)"
    free, source = None, "MemAvailable in /proc/meminfo"
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    cg = _cgroup_free()
    if cg is not None and (free is None or cg < free):
        free, source = cg, "left under this cgroup's memory.max"
    return free, f"available on the host ({source})"


def check_fits(est: MemoryEstimate, device, skip: bool = False) -> None:
    """Raise :class:`CLIError` (exit 2) when a place needs more than is available (:func:`available_bytes`), with
    the estimate and the available amount; ``skip`` (``--no-memory-check``) turns the check off."""
    if skip:
        return
    for place in est.places():
        need = est.total(place)
        free, source = available_bytes(place, device)
        if free is not None and need > free:
            where = "host" if place == "host" or est.device_type == "cpu" else str(device)
            raise CLIError(
                f"this run needs about {_gib(need)} of {where} memory ({est.text(place)}) but "
                f"{_gib(free)} is {source}: use fewer or shorter requests, or {MEMORY_FLAG} to run "
                f"anyway"
            )
