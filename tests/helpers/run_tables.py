"""The run tables of a plan's index expansion (``PrefillPlan``'s runs of counting or repeated values) written out
by hand, and a plan's index tensors by name: shared by the CPU expansion tests (tests/test_plan_host.py) and the
GPU ones (tests/gpu/test_gpu_expand.py)."""

from __future__ import annotations

import numpy as np


def index_tensors(plan):
    names = ("ctx_req_ids", "ctx_positions", "ctx_dst", "new_dst")
    out = {n: getattr(plan, n) for n in names}
    out.update({f"chunk{i}.{n}": getattr(c, n) for i, c in enumerate(plan.chunks) for n in ("req_ids", "positions")})
    return out


def run_table(counts: np.ndarray, firsts: np.ndarray, counting_runs: int) -> tuple[np.ndarray, np.ndarray]:
    """The run table (ends, bases) of PrefillPlan._expand, written out: a counting run's base is its first value
    minus where it starts."""
    ends = np.cumsum(counts).astype(np.int64)
    starts = ends - counts
    base = np.array(
        [f - (s if i < counting_runs else 0) for i, (f, s) in enumerate(zip(firsts, starts))], dtype=np.int64
    )
    return ends, base


def expanded(counts, firsts, counting_runs) -> list:
    """The values _expand stands for, by a loop over the runs."""
    return [
        int(f) + (k if i < counting_runs else 0) for i, (n, f) in enumerate(zip(counts, firsts)) for k in range(int(n))
    ]


def run_tables(seed: int = 0, block: int = 1024) -> list:
    """Run tables ``(counts, firsts, counting_runs)`` for the expansions: random ones with empty runs, and the edges
    (no runs, only empty runs (total 0), a single run, runs longer than ``block`` tokens, counting 0, counting =
    total, many runs (a deep binary search), the fused and context-stream tables of a batch)."""
    rng = np.random.default_rng(seed)
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    cases = [
        (i64([]), i64([]), 0),
        (i64([0, 0, 0]), i64([4, 5, 6]), 2),
        (i64([7]), i64([3]), 1),
        (i64([7]), i64([3]), 0),
        (i64([3 * block + 5]), i64([-2]), 1),
        (i64([block + 1, 0, 2 * block]), i64([9, 1, 2**40]), 0),
        (i64([block, block + 3]), i64([0, 11]), 2),
        (i64([0, 5, 0, 0, 3, 0]), i64([1, 2, 3, 4, 5, 6]), 6),
    ]
    c, q = i64([2048, 0, 5, 2048]), i64([512, 3, 0, 1])
    b = c.size
    seq_start = np.cumsum(c + q) - (c + q)
    cases.append(
        (
            np.concatenate([c, c, q, c]),
            np.concatenate([np.zeros(b, np.int64), seq_start, seq_start + c, np.arange(b)]),
            3 * b,
        )
    )  # the fused schedule's
    cases.append((np.concatenate([c, c]), np.concatenate([np.zeros(b, np.int64), np.arange(b)]), b))  # the stream
    for _ in range(8):
        runs = int(rng.integers(1, 300))
        counts = rng.choice([0, 0, 1, 2, 7, block - 1, block + 1], size=runs).astype(np.int64)
        firsts = rng.integers(-(2**33), 2**33, size=runs)
        cases.append((counts, firsts, int(rng.integers(0, runs + 1))))
    return cases
