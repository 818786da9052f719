"""The ttft bench's JAX rows (:mod:`mla_bridge.bench.ttft`): the JAX DeepSeek-V2 model of
:mod:`mla_bridge_jax.models` with each attention, and each attention alone on the inputs the model hands it."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mla_bridge_jax import models

from .common import attention_note, paired_gap


def bench_rows(
    ctx: Any,
    store: dict,
    case: Any,
    ci: int,
    *,
    meta_fn: Callable,
    fields: dict,
    section: str,
    repeats: int,
    warmup: int,
    rest_s: float = 0.0,
) -> list:
    """The ttft bench's JAX rows of one case (:mod:`mla_bridge.bench.ttft`): the model at ``fields`` (random
    weights, seeded; kept in ``store`` across cases) timed with cuDNN, XLA, mla_bridge_jax and no-op attention,
    one jitted forward each (compiled in the warm-up), ``logits_to_keep=1``, timed from an idle GPU to the logits
    being ready (``latency=True``, after ``rest_s`` idle seconds); each path's failure (out of memory) a skipped row. Rows carry attention ms (minus the no-op) and the ratios to mla_bridge_jax."""
    import torch

    dtype = jnp.bfloat16 if ctx.cuda else jnp.float32
    if "params" not in store:
        import transformers

        config = transformers.DeepseekV2Config(**fields)
        torch.manual_seed(ctx.seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        store["cfg"] = models.DeepseekConfig.from_dict(config.to_dict())
        store["params"] = models.params_from_state_dict(model.state_dict(), dtype)
        del model
    cfg, params = store["cfg"], store["params"]
    ids_np = np.random.default_rng(ctx.seed + ci).integers(3, cfg.vocab_size, (case.batch, case.cached + case.new))
    ids = jnp.asarray(ids_np[:, case.cached :], dtype=jnp.int32)
    cache = None
    if case.cached:
        prefill = models.make_forward(
            cfg,
            batch=case.batch,
            seq_len=case.cached,
            attention="xla" if not ctx.cuda else "cudnn",
            dtype=dtype,
            logits_to_keep=1,
        )
        cache = jax.block_until_ready(prefill(params, jnp.asarray(ids_np[:, : case.cached], dtype=jnp.int32))[1])
    names = {
        "cudnn": "JAX model, jax.nn.dot_product_attention cuDNN",
        "xla": "JAX model, jax.nn.dot_product_attention XLA",
        "mla_bridge": "JAX model, mla_bridge_jax",
        "noop": "JAX model, attention a no-op",
    }
    items = []
    rows = []
    for pi, impl in enumerate(("cudnn", "xla", "mla_bridge", "noop")):
        if impl == "cudnn" and not ctx.cuda:
            rows.append(ctx.skipped(section, case.name, names[impl], "cuDNN attention needs a GPU", **meta_fn(pi)))
            continue
        try:
            fwd = models.make_forward(
                cfg,
                batch=case.batch,
                seq_len=case.new,
                attention=impl,
                prefix_len=case.cached,
                dtype=dtype,
                backend=ctx.backend,
                logits_to_keep=1,
            )
        except Exception as err:  # noqa: BLE001
            rows.append(
                ctx.skipped(
                    section, case.name, names[impl], f"failed: {type(err).__name__}: {err}"[:200], err, **meta_fn(pi)
                )
            )
            continue
        items.append((names[impl], (lambda f=fwd: jax.block_until_ready(f(params, ids, cache)[0])), meta_fn(pi)))
    alone_items, alone_skipped = _alone_items(ctx, cfg, params, ids, cache, case, dtype, meta_fn, section)
    # the models and the attention alone in the same rounds: "kept" is a difference of their differences, so clock
    # and thermal drift must hit both alike
    rows += alone_skipped
    rows += ctx.measure_many(
        section,
        case.name,
        items + alone_items,
        repeats=repeats,
        warmup=max(1, warmup),
        latency=True,
        rest_s=rest_s,
    )
    ms = {r.path: r.ms for r in rows if r.status == "ok"}
    noop, ours = ms.get(names["noop"]), ms.get(names["mla_bridge"])
    for r in rows:
        if r.status != "ok":
            continue
        if noop is not None and r.path in names.values() and r.path != names["noop"]:
            r.extra.update(attention_ms=r.ms - noop, attention_share=(r.ms - noop) / r.ms)
            r.note = attention_note(r.ms, noop)
        if ours and r.path in (names["cudnn"], names["xla"]):
            r.extra["ratio_over_mla_bridge_jax"] = r.ms / ours
            r.note = f"{r.ms / ours:.3f}x mla_bridge_jax's time; " + r.note
    for impl in ("cudnn", "xla"):
        other = ms.get(names[impl])
        ctx.check(f"ttft {case.name}: JAX {impl} / mla_bridge_jax", other / ours if other and ours else None, ">=", 1.0)
    by_path = {r.path: r for r in rows if r.status == "ok"}
    # differences paired by round (paired_gap): the model rows and the alone rows share their rounds
    saved = paired_gap(by_path.get(names["cudnn"]), by_path.get(names["mla_bridge"]))
    win = paired_gap(by_path.get(ALONE["cudnn"]), by_path.get(ALONE["mla_bridge"]))
    kept = saved / win if saved is not None and win is not None and win > 0 else None
    if kept is not None:
        ours_row = by_path[names["mla_bridge"]]
        ours_row.extra["kept_of_kernel_win"] = kept
        ours_row.note += f"; kept {kept:.2f} of the attention's win over cuDNN"
    ctx.check(
        f"ttft {case.name}: share of the attention's win over cuDNN kept by the JAX model",
        kept,
        ">=",
        0.8,
        "" if kept is not None else "needs both model and attention-alone times, mla_bridge_jax's attention faster",
    )
    return sorted(rows, key=lambda r: r.order)


ALONE = {
    "cudnn": "JAX attention alone x layers: jax.nn.dot_product_attention cuDNN",
    "mla_bridge": "JAX attention alone x layers: mla_bridge_jax",
}


def _alone_items(
    ctx: Any,
    cfg: models.DeepseekConfig,
    params: dict,
    ids: jax.Array,
    cache: Optional[list],
    case: Any,
    dtype: Any,
    meta_fn: Callable,
    section: str,
) -> tuple[list, list]:
    """The model's attention alone, once per layer, as items to time with the model rows (and the skipped rows of
    those that cannot run): the jitted ``attend`` of :func:`make_forward` (v padded for cuDNN, as in the model)
    called ``num_layers`` times on the q, k and v the model hands its first layer (:func:`attention_inputs`: the
    same shapes and values), timed as a latency like the model rows. ``kept`` = (cuDNN model - mla_bridge_jax model)
    / (cuDNN alone - mla_bridge_jax alone), each difference the median over rounds of its two calls' difference in
    that round (:func:`mla_bridge.bench.common.paired_gap`): the share of the attention's win that reaches the time
    to first token."""
    try:
        q, k, v = jax.block_until_ready(models.attention_inputs(cfg, params, ids, cache, prefix_len=case.cached))
    except Exception as err:  # noqa: BLE001
        return [], [
            ctx.skipped(
                section, case.name, ALONE["mla_bridge"], f"failed: {type(err).__name__}: {err}"[:200], err, **meta_fn(4)
            )
        ]
    items, rows = [], []
    for pi, impl in enumerate(ALONE, start=4):
        if impl == "cudnn" and not ctx.cuda:
            rows.append(ctx.skipped(section, case.name, ALONE[impl], "cuDNN attention needs a GPU", **meta_fn(pi)))
            continue
        try:
            attend = models.attention_fn(cfg, impl, case.batch, case.new, case.cached, dtype, ctx.backend)
        except Exception as err:  # noqa: BLE001
            rows.append(
                ctx.skipped(
                    section, case.name, ALONE[impl], f"failed: {type(err).__name__}: {err}"[:200], err, **meta_fn(pi)
                )
            )
            continue
        step = jax.jit(attend)

        def layers(step=step, attend=attend):  # attend keeps the mla_bridge plan alive
            outs = [step(q, k, v) for _ in range(cfg.num_layers)]
            jax.block_until_ready(outs)

        items.append((ALONE[impl], layers, meta_fn(pi)))
    return items, rows
