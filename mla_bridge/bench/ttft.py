"""Section 7: time to first token of a whole model, the way a user meets mla_bridge.

A small DeepSeek-V2 model at DeepSeek-V2-Lite's attention dims (16 heads, kv_lora_rank 512, q/k 128 + 64, v 128,
YaRN) and hidden sizes (2048, dense MLP 10944, vocab 102400), 4 decoder layers, all dense (``first_k_dense_replace``
= layers, so that attention is what differs), random weights, bf16 on CUDA (float32 and a tiny model on the CPU in
quick mode). Cases: 10000-token prompts at batch 1, 4 and 16; 8000 cached + 2000 new tokens at batch 4 (a
transformers ``DynamicCache`` holding the prefix, rebuilt from the same tensors before each call); 32000 tokens at
batch 1.

Per case, interleaved (:meth:`Ctx.measure_many`), one prefill forward with ``logits_to_keep=1``, each call timed
from an idle GPU to the end of its work (``latency=True``: the time to first token a user measures; a forward whose
attention function reads its mask on the host once is not charged the timer's spin), after :data:`REST_S` seconds
with the GPU idle (on CUDA): a GPU at its power cap lowers its clock for the work that follows a power-hungry call
(a faster attention draws more power), so without a rest each call's time depends on the call before it in the
round, and "kept" measured that (the results page):

* transformers (one model, its attention switched by ``config._attn_implementation``): ``sdpa``; ``mla_bridge``
  (:func:`mla_bridge_transformers.register`); and the same model with attention replaced by a no-op returning zeros
  of the output's shape ("attention a no-op"): the model's time outside attention. ``attention ms`` of a path = its
  time minus the no-op's; ``attention share`` = that over the path's time (how much of the TTFT attention can move).
* the layer's attention alone, on the tensors transformers hands the first layer (kept from one untimed forward
  with a probing no-op attention: transformers' own strides and mask, whatever its version), once per layer:
  transformers' ``sdpa_attention_forward``, :func:`mla_bridge_transformers.mla_bridge_attention`, and the kernel
  calls it makes (``RaggedPlan.run`` per batch row on the same views, planned outside the timing). ``kept`` (on the
  mla_bridge row) = (sdpa model - mla_bridge model) / (sdpa alone - kernel alone): the share of the kernel's win
  that reaches the user; ``adapter own ms / layer`` = (mla_bridge_attention - kernel calls) / layers. Each
  difference is the median over rounds of the two calls' difference in that round (:func:`.common.paired_gap`).
* the JAX model (:mod:`mla_bridge_jax.models`) when JAX has a GPU: ``jax.nn.dot_product_attention`` cuDNN and XLA
  (v padded to 192) vs ``mla_bridge_jax``, one ``jax.jit`` each, and the no-op.

A path that fails (out of memory: XLA's attention at 16 x 10000 holds float32 scores of B x H x L x L) is a skipped
row carrying the error; the other paths are still timed. Ratios are baseline / mla_bridge (above 1: mla_bridge is
faster).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..checks import kernel_strides
from .common import Ctx, Job, Row, attention_flops, attention_note, fmt_err, paired_gap

__all__ = ["jobs", "V2_LITE", "TtftCase", "ttft_cases", "build_transformers_model", "NOOP_IMPLEMENTATION"]

SECTION = "ttft"
#: DeepSeek-V2-Lite's published sizes (its config.json), the fields of a transformers ``DeepseekV2Config``.
V2_LITE: dict[str, Any] = dict(
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
    },
    hidden_size=2048,
    intermediate_size=10944,
    vocab_size=102400,
    rms_norm_eps=1e-6,
)
LAYERS = 4
#: The attention implementation name of the no-op (zeros of the output's shape), registered with sdpa's mask.
NOOP_IMPLEMENTATION = "mla_bridge_bench_noop"
#: The attention function that records what transformers hands the first layer (the inputs of the alone rows).
PROBE_IMPLEMENTATION = "mla_bridge_bench_probe"
#: Timed forwards per path at most (a 16 x 10000 forward is about a third of a second on an H200). "kept" is a
#: ratio of two differences of a few percent of a forward, medians over rounds: fewer rounds let it swing by a third.
MAX_REPEATS = 11
#: Seconds the GPU stays idle before each timed call (untimed): enough, as measured on the results page, for a GPU
#: at its power cap to be back at its full clock after a 16 x 10000 forward.
REST_S = 0.4
#: The case whose adapter overhead is checked against the target (batch 4 x 10000 tokens).
ADAPTER_CASE = "4 x 10000"


@dataclass(frozen=True)
class TtftCase:
    name: str
    batch: int
    new: int  # tokens per row computed in the forward
    cached: int = 0  # tokens per row already in the KV cache


def ttft_cases(quick: bool) -> list[TtftCase]:
    if quick:
        return [
            TtftCase("1 x 32", 1, 32),
            TtftCase("2 x 32", 2, 32),
            TtftCase("2 x (24 cached + 8 new)", 2, 8, 24),
            TtftCase("1 x 64", 1, 64),
        ]
    return [
        TtftCase("1 x 10000", 1, 10000),
        TtftCase(ADAPTER_CASE, 4, 10000),
        TtftCase("16 x 10000", 16, 10000),
        TtftCase("4 x (8000 cached + 2000 new)", 4, 2000, 8000),
        TtftCase("1 x 32000", 1, 32000),
    ]


def model_fields(quick: bool, layers: int = LAYERS) -> dict:
    """The ``DeepseekV2Config`` fields of the bench's model (quick: hidden 256, MLP 256, vocab 512, the attention
    dims unchanged)."""
    fields = dict(
        V2_LITE,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        tie_word_embeddings=False,
    )
    if quick:
        fields.update(hidden_size=256, intermediate_size=256, vocab_size=512)
    return fields


def build_transformers_model(ctx: Ctx, quick: bool) -> Any:
    """The random model on ``ctx.device`` in ``ctx.dtype`` (built there, seeded), eval mode."""
    import transformers

    config = transformers.DeepseekV2Config(**model_fields(quick))
    torch.manual_seed(ctx.seed)
    with torch.device(ctx.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=ctx.dtype)
    return model.eval()


def _noop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention replaced by nothing: zeros ``[B, Q, H, D_v]`` (transformers' attention output layout)."""
    b, h, q_len, _ = query.shape
    return query.new_zeros(b, q_len, h, value.shape[-1]), None


def register_noop() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NOOP_IMPLEMENTATION, _noop_attention)
    AttentionMaskInterface.register(NOOP_IMPLEMENTATION, sdpa_mask)
    return NOOP_IMPLEMENTATION


class _State:
    """What the section's jobs share: the model (built by the first job), dropped by the last."""

    def __init__(self) -> None:
        self.model: Any = None
        self.error: Optional[BaseException] = None
        self.jax: dict = {}


def _meta(case: TtftCase, ci: int, pi: int) -> dict:
    return dict(seq_len=case.batch * (case.cached + case.new), heads=V2_LITE["num_attention_heads"], order=(6, ci, pi))


def _fresh_cache(model: Any, prefix: list) -> Any:
    """A DynamicCache holding ``prefix`` (per layer ``(keys, values)``, as the prefill left them); the tensors are
    not modified (the cache concatenates new tokens onto copies)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers without the config argument
        cache = DynamicCache()
    for i, (k, v) in enumerate(prefix):
        cache.update(k, v, i)
    return cache


def _forward_fn(model: Any, impl: str, ids: torch.Tensor, prefix: Optional[list]) -> Callable[[], Any]:
    def fn() -> Any:
        model.config._attn_implementation = impl
        with torch.no_grad():
            if prefix is None:
                return model(input_ids=ids, logits_to_keep=1).logits
            return model(input_ids=ids, past_key_values=_fresh_cache(model, prefix), logits_to_keep=1).logits

    return fn


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The no-op attention that keeps the first layer's ``(query, key, value, attention_mask)`` in
    ``_PROBED`` (the tensors themselves: their strides are transformers' own, whatever its version)."""
    if not _PROBED:
        _PROBED.extend((query, key, value, attention_mask))
    return _noop_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


_PROBED: list = []


def _model_attention_inputs(model: Any, ids: torch.Tensor, prefix: Optional[list]) -> tuple:
    """``(q, k, v, mask)`` as the model's first layer receives them in a forward of ``ids`` (over ``prefix``): the
    tensors of one probe forward (:func:`_probe_attention`), so the alone rows run on transformers' own layouts and
    masks (a copy of them in another layout times another kernel: cuDNN's speed depends on the strides). The model's
    attention implementation is left as it was."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, sdpa_mask)
    _PROBED.clear()
    implementation = model.config._attn_implementation
    try:
        _forward_fn(model, PROBE_IMPLEMENTATION, ids, prefix)()
        if len(_PROBED) != 4:
            raise RuntimeError("the model called no attention function")
        return tuple(_PROBED)
    finally:
        _PROBED.clear()
        model.config._attn_implementation = implementation


def _transformers_job(ctx: Ctx, state: _State, case: TtftCase, ci: int) -> list[Row]:
    import mla_bridge_transformers as mbt
    from mla_bridge_transformers import attention as mbt_attention

    paths = ("transformers sdpa", "transformers mla_bridge", "transformers, attention a no-op")
    if ctx.over_budget():
        return [
            ctx.skipped(SECTION, case.name, p, "time budget spent", **_meta(case, ci, i)) for i, p in enumerate(paths)
        ]
    if state.model is None and state.error is None:
        try:
            state.model = build_transformers_model(ctx, ctx.quick)
        except Exception as err:  # noqa: BLE001
            ctx.recover()
            state.error = err
    if state.model is None:
        assert state.error is not None  # no model: its build failed
        return [
            ctx.skipped(
                SECTION,
                case.name,
                paths[0],
                "model not built: " + fmt_err(state.error, 160),
                state.error,
                **_meta(case, ci, 0),
            )
        ]
    model = state.model
    impls = ("sdpa", mbt.register(), register_noop())
    repeats, warmup = min(ctx.repeats, MAX_REPEATS), min(ctx.warmup, 2)
    layers = model.config.num_hidden_layers
    ids_all = torch.randint(
        3,
        model.config.vocab_size,
        (case.batch, case.cached + case.new),
        generator=torch.Generator().manual_seed(ctx.seed + ci),
    ).to(ctx.device)
    rows: list[Row] = []
    prefix = None
    try:
        if case.cached:
            model.config._attn_implementation = "sdpa"
            from transformers import DynamicCache

            with torch.no_grad():
                try:
                    cache = DynamicCache(config=model.config)
                except TypeError:
                    cache = DynamicCache()
                model(input_ids=ids_all[:, : case.cached], past_key_values=cache, logits_to_keep=1)
            # the layers of a DeepSeek-V2 cache are full-attention ones: keys and values
            prefix = [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[union-attr]
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return [
            ctx.skipped(SECTION, case.name, p, "prefix prefill failed: " + fmt_err(err, 160), err, **_meta(case, ci, i))
            for i, p in enumerate(paths)
        ]
    ids = ids_all[:, case.cached :]
    items = [
        (p, _forward_fn(model, impl, ids, prefix), dict(**_meta(case, ci, i)))
        for i, (p, impl) in enumerate(zip(paths, impls))
    ]
    probed: Optional[tuple] = None
    probe_error: Optional[BaseException] = None
    try:
        probed = _model_attention_inputs(model, ids, prefix)
    except Exception as err:  # noqa: BLE001
        probe_error = err

    # the layer's attention alone, on the shapes and strides transformers hands it, once per layer
    alone_paths = (
        "attention alone x layers: transformers sdpa_attention_forward",
        "attention alone x layers: mla_bridge_attention",
        "attention alone x layers: kernel calls only",
    )
    flops = (
        attention_flops(
            [case.new] * case.batch,
            [case.cached + case.new] * case.batch,
            causal=True,
            heads=V2_LITE["num_attention_heads"],
        )
        * layers
    )
    alone_items: list = []
    alone_error: Optional[BaseException] = None
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if probed is None:
            assert probe_error is not None  # the probe failed
            raise probe_error
        q, k, v, mask = probed  # what transformers hands the first layer, its strides and its mask
        # each layer's own module, as in a forward: the mask is read on the first layer's call only
        modules = [layer.self_attn for layer in model.model.layers]
        scaling = modules[0].scaling
        rows_views = [(q[r].transpose(0, 1), k[r].transpose(0, 1), v[r].transpose(0, 1)) for r in range(case.batch)]
        strides = tuple(map(kernel_strides, rows_views[0]))
        plan = mbt_attention._plan(
            (case.new,),
            (case.cached + case.new,),
            q.shape[1],
            192,
            128,
            float(scaling),
            ctx.dtype,
            ctx.device,
            None if strides == (None, None, None) else strides,
        )
        out = q.new_empty(case.batch, case.new, q.shape[1], 128)

        def sdpa_alone() -> None:
            with torch.no_grad():
                for module in modules:
                    sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling)

        def ours_alone() -> None:
            with torch.no_grad():
                for module in modules:
                    mbt.mla_bridge_attention(module, q, k, v, mask, dropout=0.0, scaling=scaling)

        def kernel_alone() -> None:
            for _ in range(layers):
                for r, (qr, kr, vr) in enumerate(rows_views):
                    plan.run(qr, kr, vr, out=out[r], return_lse=False)

        alone_items = [
            (p, fn, dict(flops=flops, **_meta(case, ci, 3 + i)))
            for i, (p, fn) in enumerate(zip(alone_paths, (sdpa_alone, ours_alone, kernel_alone)))
        ]
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        alone_error = err
    # the models and the attention alone in the same rounds: their differences are the figures, so clock and
    # thermal drift must hit both alike
    measured = ctx.measure_many(
        SECTION,
        case.name,
        items + alone_items,
        repeats=repeats,
        warmup=warmup,
        latency=True,
        rest_s=REST_S if ctx.cuda else 0.0,
    )
    model_rows, alone = measured[: len(items)], measured[len(items) :]
    if alone_error is not None:
        alone = [
            ctx.skipped(
                SECTION,
                case.name,
                alone_paths[0],
                "failed: " + fmt_err(alone_error, 160),
                alone_error,
                **_meta(case, ci, 3),
            )
        ]
    rows.extend(model_rows + alone)
    _annotate_transformers(ctx, case, model_rows, alone, layers)
    return rows


def _ok_row(rows: list[Row], path: str) -> Optional[Row]:
    for r in rows:
        if r.path == path and r.status == "ok":
            return r
    return None


def _ok_ms(rows: list[Row], path: str) -> Optional[float]:
    row = _ok_row(rows, path)
    return None if row is None else row.ms


def _annotate_transformers(ctx: Ctx, case: TtftCase, model_rows: list[Row], alone: list[Row], layers: int) -> None:
    sdpa, ours, noop = (
        _ok_ms(model_rows, p)
        for p in ("transformers sdpa", "transformers mla_bridge", "transformers, attention a no-op")
    )
    kernel_alone = _ok_ms(alone, "attention alone x layers: kernel calls only")
    for r in model_rows:
        if r.status != "ok" or noop is None or r.path.endswith("no-op"):
            continue
        # an ok row has its ms
        r.extra.update(attention_ms=r.ms - noop, attention_share=(r.ms - noop) / r.ms)  # type: ignore[operator]
        r.note = attention_note(r.ms, noop)  # type: ignore[arg-type]
    ratio = sdpa / ours if sdpa and ours else None
    # differences paired by round (paired_gap): the model rows and the alone rows share their rounds
    saved = paired_gap(_ok_row(model_rows, "transformers sdpa"), _ok_row(model_rows, "transformers mla_bridge"))
    win = paired_gap(
        _ok_row(alone, "attention alone x layers: transformers sdpa_attention_forward"),
        _ok_row(alone, "attention alone x layers: kernel calls only"),
    )
    kept = saved / win if saved is not None and win is not None and win > 0 else None
    own_all = paired_gap(
        _ok_row(alone, "attention alone x layers: mla_bridge_attention"),
        _ok_row(alone, "attention alone x layers: kernel calls only"),
    )
    own = own_all / layers if own_all is not None else None
    for r in model_rows:
        if r.path == "transformers mla_bridge" and r.status == "ok":
            r.extra.update(ratio_sdpa_over_mla_bridge=ratio, kept_of_kernel_win=kept)
            r.note = (
                f"sdpa / mla_bridge {ratio:.3f}x; "
                + r.note
                + (f"; kept {kept:.2f} of the kernel's win" if kept is not None else "")
            )
    for r in alone:
        if r.path.endswith("mla_bridge_attention") and r.status == "ok" and own is not None:
            assert kernel_alone is not None  # own is set only with a kernel time
            r.extra.update(adapter_own_ms_per_layer=own, adapter_own_over_kernel=own * layers / kernel_alone)
            share = 100 * own * layers / kernel_alone
            r.note = f"adapter's own {own * 1e3:.0f} us / layer, paired by round ({share:.1f}% of the kernel)"
    ctx.check(f"ttft {case.name}: transformers sdpa / mla_bridge", ratio, ">=", 1.0)
    if case.cached == 0:
        ctx.check(
            f"ttft {case.name}: share of the kernel's win kept by the transformers model",
            kept,
            ">=",
            0.8,
            "" if kept is not None else "needs both model and kernel times, the kernel faster",
        )
    if case.name == ADAPTER_CASE:
        ctx.check(
            f"ttft {case.name}: adapter's own time / kernel time per layer",
            # own is set only with a kernel time
            own * layers / kernel_alone if own is not None else None,  # type: ignore[operator]
            "<=",
            0.03,
        )


def _jax_job(ctx: Ctx, state: _State, case: TtftCase, ci: int) -> list[Row]:
    """The JAX model's rows of ``case`` (:func:`mla_bridge.bench.ttft_jax.bench_rows`), or a skipped row saying why."""
    path = "JAX model"
    meta = _meta(case, ci, 10)
    if ctx.over_budget():
        return [ctx.skipped(SECTION, case.name, path, "time budget spent", **meta)]
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    if state.model is not None:  # the transformers jobs are done: give their memory to JAX
        state.model = None
        ctx.recover()
    try:
        import jax

        from . import ttft_jax
    except Exception as err:  # noqa: BLE001
        return [ctx.skipped(SECTION, case.name, path, "JAX or mla_bridge_jax not importable", err, **meta)]
    if ctx.cuda and not any(d.platform == "gpu" for d in jax.devices()):
        return [ctx.skipped(SECTION, case.name, path, f"JAX has no GPU (devices: {jax.devices()})", **meta)]
    if not ctx.cuda and any(d.platform == "gpu" for d in jax.devices()):
        return [ctx.skipped(SECTION, case.name, path, "the bench runs on the CPU, JAX on a GPU", **meta)]
    try:
        return ttft_jax.bench_rows(
            ctx,
            state.jax,
            case,
            ci,
            meta_fn=lambda pi: _meta(case, ci, 10 + pi),
            fields=model_fields(ctx.quick),
            section=SECTION,
            repeats=min(ctx.repeats, MAX_REPEATS),
            warmup=min(ctx.warmup, 2),
            rest_s=REST_S if ctx.cuda else 0.0,
        )
    except Exception as err:  # noqa: BLE001
        ctx.recover()
        return [ctx.skipped(SECTION, case.name, path, "failed: " + fmt_err(err, 160), err, **meta)]


def _release(state: _State) -> list[Row]:
    state.model = None
    state.jax.clear()
    return []


def jobs(ctx: Ctx) -> list[Job]:
    state = _State()
    cases = ttft_cases(ctx.quick)
    # mypy cannot infer a lambda with default arguments (each binds its loop values)
    out = [
        Job(SECTION, f"ttft transformers {c.name}", lambda cx, c=c, i=i: _transformers_job(cx, state, c, i))  # type: ignore[misc]
        for i, c in enumerate(cases)
    ]
    out += [
        Job(SECTION, f"ttft JAX {c.name}", lambda cx, c=c, i=i: _jax_job(cx, state, c, i))  # type: ignore[misc]
        for i, c in enumerate(cases)
    ]
    out.append(Job(SECTION, "ttft: release the models", lambda cx: _release(state)))
    return out
