"""The workloads: DeepSeek-sized shapes on a GPU, tiny ones in quick/CPU mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..dims import MLADims

__all__ = [
    "MainShape",
    "ContextCase",
    "SparseCase",
    "sparse_cases",
    "main_shapes",
    "context_cases",
    "loop_case",
    "mixed_lengths",
    "dims_for",
    "GLM5",
    "TORCH_BACKEND_MAX_WORK",
]

#: The torch backend (blockwise float32, Python loops) runs on the GPU only up to this many causal (q, k) pairs x
#: heads (1 x 10000 tokens at 16 heads); larger shapes are skipped with a note.
TORCH_BACKEND_MAX_WORK = 10000 * 10001 // 2 * 16


#: The model preset of the rows at GLM-5's dims (64 heads, q/k 192 + 64, v 256), beside the DeepSeek rows.
GLM5 = "glm-5"


@dataclass(frozen=True)
class MainShape:
    """``lens`` causal requests at ``heads`` heads, with the dims of ``preset`` (a :data:`mla_bridge.dims.PRESETS`
    name) or, without one, DeepSeek's (:func:`dims_for`)."""

    name: str
    heads: int
    lens: tuple[int, ...]
    preset: Optional[str] = None

    @property
    def dims(self) -> MLADims:
        return MLADims.preset(self.preset) if self.preset else dims_for(self.heads)

    @property
    def equal(self) -> bool:
        return len(set(self.lens)) == 1

    @property
    def tokens(self) -> int:
        return sum(self.lens)


@dataclass(frozen=True)
class ContextCase:
    """``batch`` requests of ``context`` cached + ``new`` new tokens at ``heads`` heads; ``budgets`` are
    (label, chunk_tokens). ``eager_ms_before``: eager mla_prefill per budget on the H200 before the
    per-pass choice of the fused or separate path (``kv_impl="auto"``) and the host-time work on the run path (figures
    and date in docs/results.md), the yardstick of the host-bound cases (graphed >= 2.5x faster, eager no slower)."""

    name: str
    batch: int
    context: int
    new: int
    budgets: tuple[tuple[str, int], ...]
    block_size: int
    heads: int = 16
    eager_ms_before: tuple[float, ...] = ()
    preset: Optional[str] = None  # the dims of this model preset (its heads), else DeepSeek's (dims_for)

    @property
    def dims(self) -> MLADims:
        return MLADims.preset(self.preset) if self.preset else dims_for(self.heads)


@dataclass(frozen=True)
class SparseCase:
    """DeepSeek Sparse Attention beside dense prefill: ``batch`` requests of ``context`` cached + ``new`` new tokens
    at ``heads`` heads, each new token picking ``index_topk`` keys (random valid causal picks)."""

    name: str
    batch: int
    context: int
    new: int
    index_topk: int
    heads: int
    block_size: int = 64

    def as_context_case(self) -> ContextCase:
        """The same batch as a :class:`ContextCase` (its inputs are made alike), with the default chunk budget."""
        return ContextCase(self.name, self.batch, self.context, self.new, (("sparse", 65536),), self.block_size,
                           heads=self.heads)  # fmt: skip


def sparse_cases(quick: bool) -> list[SparseCase]:
    """Contexts longer than ``index_topk``: DeepSeek-V3.2's 128 heads and K = 2048 from 4096 to 131072 cached tokens
    (2048 new), where the sparse pass reads a fixed K keys per token and dense prefill all of them (the crossover is
    read off the rows); in quick mode one tiny case."""
    if quick:
        return [SparseCase("4h 2x(96+16), K 32", 2, 96, 16, 32, heads=4, block_size=16)]
    return [SparseCase(f"128h 1x({c}+2048), K 2048", 1, c, 2048, 2048, heads=128) for c in (4096, 16384, 65536, 131072)]


def dims_for(heads: int) -> MLADims:
    """DeepSeek-V2-Lite's dims and scale at 16 heads, DeepSeek-V3's at 128, V2-Lite's scale otherwise."""
    if heads == 16:
        return MLADims.deepseek_v2_lite()
    if heads == 128:
        return MLADims.deepseek_v3()
    return MLADims(num_heads=heads, softmax_scale=MLADims.deepseek_v2_lite().softmax_scale)


def mixed_lengths(n: int, lo: int, hi: int, seed: int = 1234) -> tuple[int, ...]:
    """``n`` lengths in ``[lo, hi]`` from a fixed seed, both ends included, shuffled."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=n)
    lens[0], lens[-1] = lo, hi
    rng.shuffle(lens)
    return tuple(int(x) for x in lens)


def main_shapes(quick: bool) -> list[MainShape]:
    if quick:
        return [
            MainShape("16h 1x128", 16, (128,)),
            MainShape("16h 2x128", 16, (128,) * 2),
            MainShape("32h 1x64", 32, (64,)),
            MainShape("16h mixed 5 (5..150)", 16, mixed_lengths(5, 5, 150)),
            MainShape("glm-5 64h 2x48", 64, (48,) * 2, preset=GLM5),
        ]
    mixed = mixed_lengths(24, 37, 9000)
    return [
        MainShape("16h 1x10000", 16, (10000,)),
        MainShape("16h 4x10000", 16, (10000,) * 4),
        MainShape("16h 16x10000", 16, (10000,) * 16),
        MainShape("128h 1x10000", 128, (10000,)),
        MainShape("128h 4x10000", 128, (10000,) * 4),
        MainShape(f"16h mixed 24 (37..9000, {sum(mixed)} tok)", 16, mixed),
        MainShape("glm-5 64h 1x10000", 64, (10000,), preset=GLM5),
        MainShape("glm-5 64h 4x10000", 64, (10000,) * 4, preset=GLM5),
    ]


def context_cases(quick: bool) -> list[ContextCase]:
    """Each long case with a chunk budget that holds all its context and one that needs 4 chunks; then the two
    host-bound cases (many chunks; many short requests without context); then the first long case at GLM-5's dims
    (64 heads, 256/256)."""
    if quick:
        return [
            ContextCase("4h 2x(96+32)", 2, 96, 32, (("all context", 192), ("4 chunks", 48)), 16, heads=4),
            ContextCase("4h 1x(256+32)", 1, 256, 32, (("all context", 256), ("4 chunks", 64)), 16, heads=4),
            ContextCase("4h 4x(32+8)", 4, 32, 8, (("8 chunks", 16),), 16, heads=4),
            ContextCase("4h 8x16 new", 8, 0, 16, (("no context", 64),), 16, heads=4),
            ContextCase(
                "glm-5 64h 1x(96+32)", 1, 96, 32, (("all context", 128), ("4 chunks", 24)), 16, heads=64, preset=GLM5
            ),
        ]
    return [
        ContextCase("4x(8000+2000)", 4, 8000, 2000, (("all context", 32000), ("4 chunks", 8000)), 64),
        ContextCase("1x(64000+4000)", 1, 64000, 4000, (("all context", 64000), ("4 chunks", 16000)), 64),
        ContextCase("16x(2048+512)", 16, 2048, 512, (("8 chunks", 4096),), 64, eager_ms_before=(3.35,)),
        ContextCase("64x128 new", 64, 0, 128, (("no context", 65536),), 64, eager_ms_before=(0.42,)),
        ContextCase(
            "glm-5 64h 4x(8000+2000)",
            4,
            8000,
            2000,
            (("all context", 32000), ("4 chunks", 8000)),
            64,
            heads=64,
            preset=GLM5,
        ),
    ]


def loop_case(quick: bool) -> ContextCase:
    """The batch of the 61-layer planning loop: the first context case (tinier still in quick mode, where 61
    layers of the CPU reference add up)."""
    if quick:
        return ContextCase("4h 2x(32+8)", 2, 32, 8, (("all context", 64), ("4 chunks", 16)), 16, heads=4)
    return context_cases(False)[0]
