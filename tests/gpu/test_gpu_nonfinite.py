"""Where a NaN in one token's input goes, per backend, on the GPU (mla_bridge.prefill's "Non-finite inputs").

One MLA batch (DeepSeek-V2-Lite dims, 16 heads at 192/128): request 0 with 1000 new tokens, request 1 with 50, each
with cached context (fused and chunked schedules) or none. Compared with the same plan on the clean inputs:
  * a NaN in kv_c of request 0's new token ``t`` (its key's k and v all NaN): lse is non-finite exactly in the rows
    that see the key (rows >= t of request 0), and so is out; rows of request 0 whose keys end more than 256 keys
    before it, and all of request 1, are bitwise the clean values. FlashInfer's kernels (fa2, fa3, cutlass) multiply
    the probabilities of a key tile (0 for masked keys) by its values, so out may also be NaN in rows of request 0
    that cannot see the key but share a kernel tile with rows that do: a run of rows ending at ``t - 1``, shorter than
    256 (a query tile and a key tile are at most 128 each), with a finite lse. The torch backend keeps those rows
    clean (no such run). Each test prints the run it measured (``-s``).
  * a NaN in q of one row: that row alone.
  * a NaN in a cached context token of request 0: every row of request 0 (all of them see it), request 1 bitwise.

Marked ``gpu``. On the H200:
    python3 -m pytest tests/gpu/test_gpu_nonfinite.py -q -m gpu -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mla_bridge import MLADims, PrefillPlan, Workspace, mla_prefill, select_backend  # noqa: E402

BF16 = torch.bfloat16
Q_LENS = [1000, 50]
BAD = 700  # request 0's new token carrying the NaN
BACKENDS = ("flashinfer-cutlass", "flashinfer-fa3", "flashinfer-fa2", "torch")
SCHEDULES = {
    "no context": ([0, 0], 100_000, True),
    "fused": ([100, 30], 100_000, True),
    "chunked": ([100, 30], 64, True),
}


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def setup(ref, backend, schedule, seed):
    dtype = torch.float32 if backend == "torch" else BF16
    try:
        select_backend(dev(), requested=backend, dtype=dtype, head_dim_qk=192, head_dim_vo=128)
    except ValueError:
        pytest.skip(f"{backend} cannot serve on capability {torch.cuda.get_device_capability()}")
    c_lens, budget, fuse = SCHEDULES[schedule]
    dims = MLADims.deepseek_v2_lite()
    batch = ref.make_mla_batch(dims, Q_LENS, c_lens, 16, dtype=dtype, seed=seed, device=dev())
    plan = PrefillPlan.build(
        Q_LENS,
        c_lens,
        dims=dims,
        workspace=Workspace(dev(), chunk_tokens=budget),
        block_size=16,
        dtype=dtype,
        fuse_context=fuse,
        backend=backend,
    )
    assert plan.backend.name == backend and plan.fused == (schedule == "fused")

    def run():
        out, lse = mla_prefill(
            batch.q, batch.kv_c, batch.k_pe, batch.w, batch.cache, batch.block_table, plan, return_lse=True
        )
        torch.cuda.synchronize()
        return out.float().cpu(), lse.cpu()

    return batch, run


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x.reshape(x.shape[0], -1)).all(-1)


def runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """The rows (indices of True) as (first, last) runs."""
    out: list = []
    for i in rows.nonzero().flatten().tolist():
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_new_token(ref, backend, schedule):
    batch, run = setup(ref, backend, schedule, seed=1)
    clean_out, clean_lse = run()
    assert finite_rows(clean_out).all() and finite_rows(clean_lse).all()
    batch.kv_c[BAD, 0] = float("nan")
    out, lse = run()
    t = sum(Q_LENS)
    sees = (torch.arange(t) >= BAD) & (torch.arange(t) < Q_LENS[0])
    blind = ~finite_rows(out) & ~sees
    print(
        f"\n{backend:>18} {schedule:>10}: NaN in kv_c[{BAD}]: out non-finite in rows that cannot see it: "
        f"{runs(blind) or 'none'}"
    )
    assert torch.equal(~finite_rows(lse), sees), f"lse non-finite in {runs(~finite_rows(lse))}"
    assert not finite_rows(out)[sees].any()
    far = torch.arange(t) < BAD - 256  # keys end more than 256 keys before the NaN key (offset as in the schedule)
    far |= torch.arange(t) >= Q_LENS[0]  # request 1
    assert torch.equal(out[far], clean_out[far]) and torch.equal(lse[far], clean_lse[far])
    assert not blind[far].any()
    if blind.any():  # one run of rows right before the first row that sees the key, shorter than 256
        ((first, last),) = runs(blind)
        assert last == BAD - 1 and last - first < 256
    if backend == "torch":
        assert not blind.any()
        keep = ~sees
        assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_one_query_row(ref, backend, schedule):
    batch, run = setup(ref, backend, schedule, seed=2)
    clean_out, clean_lse = run()
    batch.q[BAD, 3, 7] = float("nan")
    out, lse = run()
    keep = torch.ones(sum(Q_LENS), dtype=torch.bool)
    keep[BAD] = False
    assert torch.equal(finite_rows(out), keep) and torch.equal(finite_rows(lse), keep)
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.parametrize("schedule", ["fused", "chunked"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_cached_context_token(ref, backend, schedule):
    batch, run = setup(ref, backend, schedule, seed=3)
    clean_out, clean_lse = run()
    position = 80  # of request 0's context; in the chunked schedule its chunk also holds request 1's context
    block, slot = divmod(position, batch.block_size)
    batch.cache[int(batch.block_table[0, block]), slot, 5] = float("nan")
    out, lse = run()
    keep = torch.arange(sum(Q_LENS)) >= Q_LENS[0]
    assert torch.equal(finite_rows(out), keep) and torch.equal(finite_rows(lse), keep)
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.parametrize("backend", BACKENDS)
def test_positive_infinite_logit_in_a_context_chunk_is_not_dropped(ref, backend):
    """A +inf in the k_pe of request 0's cached context token 40, with request 0's q RoPE part positive: every row of
    request 0 has a +inf logit, its softmax is undefined, and its out must be non-finite in the chunked schedule too,
    whose merge reads the context pass's LSE of +inf as an infinite logit, not as an empty partial (which would
    drop the pass and return finite values). Request 1 is bitwise as without it."""
    batch, run = setup(ref, backend, "chunked", seed=9)
    rope = batch.dims.qk_rope_head_dim
    batch.q[: Q_LENS[0], :, -rope:] = batch.q[: Q_LENS[0], :, -rope:].abs() + 0.1
    clean_out, clean_lse = run()
    block, slot = divmod(40, 16)
    batch.cache[int(batch.block_table[0, block]), slot, batch.dims.kv_lora_rank] = float("inf")
    out, lse = run()
    rows = torch.isfinite(out.reshape(out.shape[0], -1)).all(-1)
    assert not rows[: Q_LENS[0]].any(), f"{backend}: {int(rows[: Q_LENS[0]].sum())} rows of request 0 finite"
    assert torch.equal(out[Q_LENS[0] :], clean_out[Q_LENS[0] :]) and torch.equal(
        lse[Q_LENS[0] :], clean_lse[Q_LENS[0] :]
    )
